"""Resume: what a checkpoint carries beside the trainer's own state, and how a new life takes it back.

The trainer's weights, optimizer and step count are `rlboost.trainer.training_checkpoint`'s. This module keeps
the run's identity (`run.json`: a resumed run, even one killed before its first checkpoint,
publishes under the same request ids) and the parts' own state at a checkpoint:

- the request source's data position and the draws since (an async run has drawn and published
  the steps after the checkpoint already; a partial run holds groups of earlier steps in flight,
  `carried`), so a resumed life draws the same prompts under the same request ids;
- the ledger's newest version with the digests of the versions those requests may name;
- the seeding window, and the metrics' running totals.

A run killed before its first checkpoint resumes from its start (`restore_start`), with the
version its first life published the model under (kept in run.json, `remember_start`).

A previous life that ran past the step this life starts from (checkpoint_every > 1, or the
run's start) published later steps too, under the same ids as this life will: up to the step
after its last row in metrics.jsonl (the one it died in), plus the k steps async publishes
ahead. Those go out again as republished (`Resumed.republish_through`): the work queue takes
back what it still holds. In sync / async, the steps a dead life trained past the restart are
generated again under this life's own ids (`fresh_from`): what it published for them names
versions this life's weights are not.
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
from rlboost.trainer.request_source import RequestSource
from rlboost.trainer.step_metrics import StepMetrics


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


def remember_start(run_dir: Path, published: dict) -> None:
    """The version a new run published the model under, in run.json: where a resume before its
    first checkpoint starts from."""
    meta = json.loads((run_dir / "run.json").read_text())
    meta["published"] = published
    (run_dir / "run.json.tmp").write_text(json.dumps(meta) + "\n")
    (run_dir / "run.json.tmp").replace(run_dir / "run.json")


@dataclass
class Resumed:
    """Where this life starts: a fresh run, its start again (no checkpoint yet), or the step
    after a checkpoint."""

    resumed: bool = False  # a later life of the run
    first_step: int = 0
    last_saved: int = -1  # the step of the checkpoint resumed from (-1: none)
    eval_first: float | None = None  # the run's first held-out accuracy (measured once, in its first life)
    published: dict | None = None  # the ledger's part: {"version", "digest", "recent"}
    republish_through: int = -1  # the last step a previous life may have published

    @property
    def from_checkpoint(self) -> bool:
        return self.last_saved >= 0


def republish_through(run_dir: Path, step: int, max_staleness: int) -> int:
    """The last step a previous life may have published past `step`: the step after its last row
    in metrics.jsonl (the one it died in), plus the k steps async publishes ahead."""
    reached = step
    with contextlib.suppress(OSError):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                reached = max(reached, int(json.loads(line)["step"]) + 1)
    return reached + max_staleness


def checkpoint_meta(step: int, eval_first: float | None, *, run_id: str, orchestrator: Orchestrator,
                    source: RequestSource, ledger: VersionLedger, window: SeedWindow, tally: StepMetrics) -> dict:
    """The run's state after `step`, beside the trainer's (saved together by trainer.training_checkpoint)."""
    carried = orchestrator.untrained() if orchestrator.mode == "partial" else {}
    position = source.position(carried, step, ledger.version)
    if carried:  # partial: a carried response may hold tokens of every version since its draw
        oldest = min(source.drawn_under(s) for s in carried)
    else:
        oldest = ledger.version - orchestrator.max_staleness
    return {"run_id": run_id, "eval_first": eval_first, "handoffs_total": tally.handoffs_total,
            "published": ledger.checkpoint(oldest),
            "carried": {str(s): gs for s, gs in carried.items()}, **position, "dollars": tally.dollars,
            "seed_window": window.state()}


def restore(state: dict, run_dir: Path, *, max_staleness: int, source: RequestSource, window: SeedWindow,
            tally: StepMetrics) -> Resumed:
    """The parts' state back from a checkpoint (the trainer's is restored by trainer.training_checkpoint)."""
    source.restore(state)
    first = state["step"] + 1
    if state.get("seed_window"):
        window.load_state(state["seed_window"])
    tally.restore(state)
    return Resumed(resumed=True, first_step=first, last_saved=state["step"], eval_first=state.get("eval_first"),
                   published=state.get("published"),
                   republish_through=republish_through(run_dir, first, max_staleness))


def restore_start(run_dir: Path, max_staleness: int) -> Resumed:
    """A resume before the run's first checkpoint: from the start, with the version its first
    life published the model under (run.json), so what that life finished for step 0 (and
    async: the k after) verifies and is taken; the steps it published are published again."""
    published = json.loads((run_dir / "run.json").read_text()).get("published")
    return Resumed(resumed=True, first_step=0, published=published,
                   republish_through=republish_through(run_dir, 0, max_staleness))


def fresh_from(how: str, resumed: Resumed, mode: str) -> tuple[int, str] | None:
    """Sync / async: the step from which this life's requests get its own ids, and why (None:
    none do). `how`: how the ledger started (`VersionLedger.start`). What a previous life
    published for those steps names versions this life's weights are not (it trained past the
    version this life starts from, or that version is gone): not on-policy, or older than
    max_staleness in this life's numbering, which skips the dead life's versions. A partial run
    trains off-policy and takes them as they are (its ledger adopts the newer versions)."""
    if mode == "partial" or not resumed.resumed:
        return None
    if how == "past":
        return resumed.first_step + 1, "versions were published past the one it starts from"
    if how == "gone":
        return resumed.first_step, "the checkpoint's version is gone from the weight store"
    return None
