"""Benchmarks of the RL loop: `rlboost bench reproduce`."""
