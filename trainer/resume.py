"""Resume: what a checkpoint carries beside the trainer's own state, and how a new life takes it back.

The trainer's weights, optimizer and step count are `trainer.checkpoint`'s. This module keeps
the run's identity (`run.json`: a resumed run, even one killed before its first checkpoint,
publishes under the same request ids) and the parts' own state at a checkpoint:

- the request source's data position and the draws since (an async run has drawn and published
  the steps after the checkpoint already; a partial run holds groups of earlier steps in flight,
  `carried`), so a resumed life draws the same prompts under the same request ids;
- the ledger's newest version with the digests of the versions those requests may name;
- the seeding window, and the metrics' running totals.

A previous life that ran past its checkpoint (checkpoint_every > 1) published later steps too,
under the same ids as this life will: up to the step after its last row in metrics.jsonl (the
one it died in), plus the k steps async publishes ahead. Those go out again as republished
(`Resumed.republish_through`): the work queue takes back what it still holds.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from rlboost import wire
from rlboost.config import ConfigError
from rlboost.offload import SeedWindow
from rlboost.orchestrator import Orchestrator
from rlboost.weights.ledger import VersionLedger
from trainer.request_source import RequestSource
from trainer.step_metrics import StepMetrics


def run_identity(run_dir: Path, resume: bool, wanted: str = "") -> str:
    """The run id: kept in <run_dir>/run.json, so a resumed run (even one killed before its first
    checkpoint) publishes under the same request ids."""
    path = run_dir / "run.json"
    if resume and path.exists():
        return json.loads(path.read_text())["run_id"]
    if resume:
        raise ConfigError(f"--resume {run_dir}: no run.json there (not a run folder)")
    run_id = wire.check_name("run id", wanted) if wanted else wire.new_run_id()
    path.write_text(json.dumps({"run_id": run_id}) + "\n")
    return run_id


@dataclass
class Resumed:
    """Where this life starts: a fresh run, or the step after a checkpoint."""

    first_step: int = 0
    last_saved: int = -1  # the step of the checkpoint resumed from
    eval_first: float | None = None  # the run's first held-out accuracy (measured once, in its first life)
    published: dict | None = None  # the ledger's part: {"version", "digest", "recent"}
    republish_through: int = -1  # the last step a previous life may have published

    @property
    def resumed(self) -> bool:
        return self.last_saved >= 0


def checkpoint_meta(step: int, eval_first: float | None, *, run_id: str, orchestrator: Orchestrator,
                    source: RequestSource, ledger: VersionLedger, window: SeedWindow, tally: StepMetrics) -> dict:
    """The run's state after `step`, beside the trainer's (saved together by trainer.checkpoint)."""
    carried = orchestrator.untrained() if orchestrator.mode == "partial" else {}
    position = source.position(carried, step, ledger.version)
    if carried:  # partial: a carried response may hold tokens of every version since its draw
        oldest = min(source.drawn_under(s) for s in carried)
    else:
        oldest = ledger.version - orchestrator.max_staleness
    return {"run_id": run_id, "eval_first": eval_first, "handoffs_total": tally.handoffs_total,
            "published": ledger.checkpoint(oldest),
            "carried": {str(s): gs for s, gs in carried.items()}, **position, "dollars": tally.dollars,
            "seed_window": {"t_seed": window.t_seed, "memory": {str(k): v for k, v in window.memory.items()},
                            "workers": window._workers}}


def restore(state: dict, run_dir: Path, *, max_staleness: int, source: RequestSource, window: SeedWindow,
            tally: StepMetrics) -> Resumed:
    """The parts' state back from a checkpoint (the trainer's is restored by trainer.checkpoint)."""
    source.restore(state)
    first = state["step"] + 1
    reached = first
    with contextlib.suppress(OSError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                reached = max(reached, int(json.loads(line)["step"]) + 1)
    w = state.get("seed_window") or {}
    if w:
        window.t_seed = w["t_seed"]
        window.memory = {int(k): v for k, v in w["memory"].items()}
        window._workers = w["workers"]
    tally.restore(state)
    return Resumed(first_step=first, last_saved=state["step"], eval_first=state.get("eval_first"),
                   published=state.get("published"), republish_through=reached + max_staleness)
