"""`rlboost bench modes`: the demo task trained in each rollout mode, held-out accuracy against step
and wall clock in one plot.

The same `rlboost run` (hybrid policy, 2 torch workers, the same seeds and model) once per mode of
`--modes` (default sync, partial, async with `--max-staleness` 1), one after the other on the
same servers. Held-out greedy accuracy every `--eval-every` steps; the wall clock of a step is
its `step_s` (evaluation excluded, as in metrics.jsonl). On a 2-core CPU box rollout and training
share the cores, so what asynchrony buys on GPUs (training while the fleet generates) is mostly
not visible here: read the figures as "does it still learn", not as a speed-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from rlboost.benchmarks import report
from rlboost.config import Settings
from rlboost.logs import configure_logging
from rlboost.trainer import command


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in curves.items():
        wall = list(itertools.accumulate(r["step_s"] for r in rows))
        pts = [(r["step"], w, r["eval_acc"]) for r, w in zip(rows, wall, strict=True) if r["eval_acc"] is not None]
        ax1.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=name)
        ax2.plot([p[1] for p in pts], [p[2] for p in pts], "o-", label=name)
    ax1.set_xlabel("step")
    ax2.set_xlabel("training wall clock (s, evaluation excluded)")
    for ax in (ax1, ax2):
        ax.set_ylabel("held-out accuracy (greedy)")
        ax.legend(fontsize=8)
    fig.suptitle("rollout modes on the demo task")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench modes", description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="sync,partial,async")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--off-policy", default="tis", help="algorithm.off_policy in every mode (the same loss for all)")
    p.add_argument("--model-dir", default="", help="default: the demo model (built on first use)")
    report.add_out(p, "the runs' folders, modes.json and modes.png (default: a new temp folder)")
    a = p.parse_args(argv)
    configure_logging(json=s.log_json, level="warning")  # the live tables and the summary are the output
    out_dir = report.out_dir(a, prefix="rlboost-modes-")
    common = ["--steps", str(a.steps), "--prompts", str(a.prompts), "--samples", str(a.samples), "--seed", str(a.seed),
              "--workers", "2", "--eval-every", str(a.eval_every), "--max-staleness", str(a.max_staleness),
              "--algorithm.off_policy", a.off_policy]
    if a.model_dir:
        common += ["--model-dir", a.model_dir]
    curves, finals = {}, {}
    for mode in [m for m in a.modes.split(",") if m]:
        name = f"async k={a.max_staleness}" if mode == "async" else mode
        cfg = command.parse([*common, "--mode", mode, "--run-dir", str(out_dir / mode)], s=s)
        finals[name] = command.execute(cfg, s)
        curves[name] = _metrics(out_dir / mode)
        evals = [(r["step"], r["eval_acc"]) for r in curves[name] if r["eval_acc"] is not None]
        print(f"{name}: held-out accuracy {evals}, {sum(r['step_s'] for r in curves[name]):.1f} s of steps", flush=True)
    result = {name: {"eval_first": f["eval_first"], "eval_last": f["eval_last"], "steps": f["steps"],
                     "train_s": round(sum(r["step_s"] for r in curves[name]), 1),
                     "staleness_max": max(r.get("staleness_max", 0) for r in curves[name])}
              for name, f in finals.items()}
    return report.finish("modes", {"modes": result, "out": str(out_dir)}, out_dir, plot=lambda path: plot(curves, path))
