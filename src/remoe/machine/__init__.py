"""The machine a run is on: intra-op threads (``threads``), the host allocator
(``allocator``), the GEMM-rate probe (``perf``), host-synchronisation counting (``syncs``)."""
