"""Benchmarks that run real worker processes: `rlboost bench chaos`, `rlboost bench fleet`."""


def percentile(xs: list[float], p: float) -> float | None:
    """The `p` quantile of `xs` (nearest rank), rounded to 0.1; None when there is nothing."""
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))], 1) if xs else None
