"""`rlboost bench reproduce`: does a preempted run learn exactly like an undisturbed one?

Two runs with the same seeds on the same servers: one undisturbed, one where a worker is
stopped with SIGTERM (notice) and another with SIGKILL (no notice) mid-step, both restarted.
Compared: every response's tokens, every behaviour logprob, the per-step rewards, the
held-out accuracies, and the SHA-256 of the final weights.

Why they can be identical: sampling is keyed by (seed, position), the torch engine computes in
float64 so batch composition does not move a sample, checkpoints keep logprobs in float32 on
both paths, and the trainer, in its deterministic mode (`--precision fp64`, the default here),
back-propagates groups in group order whatever the arrival order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlboost.benchmarks import report
from rlboost.config import Settings
from rlboost.trainer import command


def _rollouts(run_dir: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def compare(a_dir: Path, b_dir: Path) -> dict:
    ra, rb = _rollouts(a_dir), _rollouts(b_dir)
    same_tokens = sum(1 for k in ra if k in rb and ra[k]["tokens"] == rb[k]["tokens"])
    lp_diff = max((abs(x - y) for k in ra if k in rb for x, y in zip(ra[k]["logprobs"], rb[k]["logprobs"])),
                  default=0.0)
    migrated = sum(1 for r in rb.values() if len(set(r["workers"])) > 1)
    ma, mb = _metrics(a_dir), _metrics(b_dir)
    return {"responses": len(ra), "identical_token_sequences": same_tokens, "max_logprob_abs_diff": lp_diff,
            "migrated_responses": migrated, "rewards_a": [m["reward"] for m in ma], "rewards_b": [m["reward"] for m in mb],
            "evals_a": [m["eval_acc"] for m in ma], "evals_b": [m["eval_acc"] for m in mb],
            "chaos": [m["chaos"] for m in mb]}


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench reproduce", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--chaos", default="1:term,3:kill")
    p.add_argument("--model-dir", default="")
    p.add_argument("--precision", default="fp64", help="the trainer's (fp64: the deterministic mode)")
    report.add_out(p, "the two runs' folders and reproduce.json (default: a new temp folder)")
    a = p.parse_args(argv)
    out_dir = report.out_dir(a, prefix="rlboost-reproduce-")
    common = ["--steps", str(a.steps), "--prompts", str(a.prompts), "--samples", str(a.samples), "--seed",
              str(a.seed), "--workers", "2", "--eval-every", "2", "--save-rollouts", "--model-dir", a.model_dir,
              "--precision", a.precision]
    finals = {}
    for name, extra in (("undisturbed", []), ("preempted", ["--chaos", a.chaos])):
        cfg = command.parse([*common, "--run-dir", str(out_dir / name), *extra], s=s)
        finals[name] = command.execute(cfg, s)
        print(f"{name}: rewards {[m['reward'] for m in _metrics(out_dir / name)]}", flush=True)
    cmp = compare(out_dir / "undisturbed", out_dir / "preempted")
    result = {**cmp, "weights_identical": finals["undisturbed"]["final_weights_sha256"]
              == finals["preempted"]["final_weights_sha256"],
              "final_weights_sha256": {k: v["final_weights_sha256"] for k, v in finals.items()},
              "handoffs": {k: v["handoffs"] for k, v in finals.items()}, "precision": a.precision, "out": str(out_dir)}
    print(f"{cmp['identical_token_sequences']}/{cmp['responses']} responses token-identical "
          f"({cmp['migrated_responses']} of them migrated between workers in the preempted run); "
          f"max |logprob diff| {cmp['max_logprob_abs_diff']:.3g}; final weights identical: {result['weights_identical']}")
    return report.finish("reproduce", result, out_dir)
