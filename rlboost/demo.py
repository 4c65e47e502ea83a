"""`make demo`: until the RL loop lands, the dataflow smoke on embedded servers."""

from __future__ import annotations

from rlboost import smoke
from rlboost.config import Settings


def main(argv: list[str], s: Settings) -> int:
    return smoke.main(argv, s)
