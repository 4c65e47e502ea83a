"""What a run shows and leaves behind: live progress, metrics.jsonl, and a PNG of the curves."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

COLUMNS = [("step", "step"), ("reward", "reward"), ("eval_acc", "eval"), ("tokens_per_s", "tok/s"),
           ("live_workers", "workers"), ("fleet_desired", "want"), ("t_seed", "T_seed"), ("handoffs", "hand-offs"), ("step_s", "secs"),
           ("is_ratio_mean", "IS"), ("is_capped", "IS>cap"), ("staleness_mean", "stale")]  # off-policy, per token
# a run on episodes (`--env`) also shows the environment's side, per episode: its tool calls and
# the environment's errors (an `env_error` end is the environment's fault, not the model's);
# after `eval`, beside the reward they explain. Single-turn runs keep the table as it was.
EPISODE_COLUMNS = [("tool_calls_mean", "calls"), ("env_errors_mean", "env_err")]


def columns(rows: list[dict]) -> list[tuple[str, str]]:
    """The table's (key, label) pairs for `rows`: the episode columns where a row is an episode run's."""
    if not any("tool_calls_mean" in r for r in rows):
        return COLUMNS
    at = [k for k, _ in COLUMNS].index("eval_acc") + 1
    return COLUMNS[:at] + EPISODE_COLUMNS + COLUMNS[at:]


def cell(row: dict, key: str) -> str:
    v = row.get(key)
    if v is None:
        return ""
    # two decimals keep the episode columns narrow (the means have 3-4 in metrics.jsonl)
    return f"{v:.2f}" if key in dict(EPISODE_COLUMNS) and isinstance(v, float) else str(v)


class RunReport:
    def __init__(self, run_dir: Path, steps: int) -> None:
        self.run_dir, self.steps = run_dir, steps
        self.rows: list[dict] = []
        self.eval_first: float | None = None
        self.metrics = open(run_dir / "metrics.jsonl", "a")
        self.console = Console(stderr=True)
        self.live = Live(self._table(), console=self.console, refresh_per_second=4) if self.console.is_terminal else None
        self._status = ""
        if self.live:
            self.live.start()

    def start(self, eval_first: float | None) -> None:
        self.eval_first = eval_first
        self._say("no held-out set" if eval_first is None else
                  f"held-out greedy accuracy (mean reward) before RL: {eval_first:.3f}")

    def progress(self, step: int, arrived: int, total: int) -> None:
        self._status = f"step {step}: {arrived}/{total} responses"
        if self.live:
            self.live.update(self._table())

    def step(self, row: dict) -> None:
        self.rows.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.live:
            self.live.update(self._table())
        else:
            self._say("  ".join(f"{label}={cell(row, key) or None}" for key, label in columns([row])))

    def _say(self, text: str) -> None:
        if self.live:
            self.live.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def _table(self) -> Table:
        t = Table(title=f"rlboost run  {self.run_dir}  {self._status}", expand=False)
        shown = self.rows[-15:]
        cols = columns(shown)
        for _, label in cols:
            t.add_column(label, justify="right")
        for row in shown:
            t.add_row(*(cell(row, k) for k, _ in cols))
        return t

    def close(self) -> None:
        if self.live:
            self.live.stop()
        self.metrics.close()
        if self.rows:
            plot(self.rows, self.run_dir / "curves.png", self.eval_first)


def plot(rows: list[dict], path: Path, eval_first: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax1.plot(steps, [r["reward"] for r in rows], label="mean reward (rollout)")
    ev = [(r["step"], r["eval_acc"]) for r in rows if r.get("eval_acc") is not None]
    if eval_first is not None:
        ev = [(-1, eval_first), *ev]
    if ev:
        ax1.plot([s for s, _ in ev], [a for _, a in ev], "o-", label="held-out greedy accuracy")
    ax1.set_ylabel("reward / accuracy")
    ax1.set_ylim(0, 1)
    ax1.legend(loc="lower right")
    ax1.set_title(f"rlboost {rows[0].get('policy', '')}: learning")
    ax2.plot(steps, [r["tokens_per_s"] for r in rows], label="trained tokens/s")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s")
    ax3 = ax2.twinx()
    ax3.step(steps, [r.get("live_workers") or 0 for r in rows], where="mid", color="gray", alpha=0.5,
             label="live workers")
    ax3.set_ylabel("live preemptible workers")
    ax3.set_ylim(0, max(r.get("live_workers") or 0 for r in rows) + 1)
    ax3.yaxis.get_major_locator().set_params(integer=True)
    ax2.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
