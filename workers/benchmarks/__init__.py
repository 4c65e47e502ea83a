"""Benchmarks that run real worker processes: `rlboost bench chaos`, `rlboost bench fleet`."""
