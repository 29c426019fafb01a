"""The machine a run is on: thread count, allocator, the GEMM rate probe, host-sync counting."""
