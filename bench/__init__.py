"""Load-test harness and side-by-side benchmarks for trioshed.

``bench.load`` is the load generator (``python -m bench.load`` / ``trioshed-bench``);
``bench.compare`` starts direct ``llama-server``s, llama.cpp's router and trioshed in one run
and reports every figure as a ratio to direct (``make bench``); ``bench.sched_scale`` times the
scheduler's pure decisions with no processes at all.
"""
