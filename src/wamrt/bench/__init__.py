"""Benchmarks: latency waterfall, peer comparison, load tests; result files as performance.md defines."""
