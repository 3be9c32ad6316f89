"""The benchmarks' own machinery (bench/)."""
