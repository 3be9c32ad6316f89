"""End-to-end suites: real trioshed servers, real llama-server children, official clients."""
