"""`make demo` / `rlboost demo`: the main job, with defaults that fit a 2-core box in minutes.

Starts the embedded servers, bootstraps the model if it is missing, and runs the hybrid policy
with the reserved trainer and 2 preemptible torch workers for 20 RL steps (`--steps`; no time
cap unless `--max-minutes`: a busy box takes longer, and shows the same learning).
"""

from __future__ import annotations

from rlboost.config import Settings
from rlboost.trainer import command


def main(argv: list[str], s: Settings) -> int:
    return command.main(argv, s, demo=True)
