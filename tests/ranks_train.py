"""Train 3 GRPO steps on fixed batches and save the weights: run alone, or under torchrun
(`torchrun --nproc-per-node 2 tests/ranks_train.py MODEL_DIR OUT [OFF_POLICY]`) where rank 0
feeds the steps and the other ranks follow (tests/test_distributed.py compares the two). With
OFF_POLICY (algorithm.off_policy), half of each response comes from an older policy version
and the last step's off-policy statistics are written to OUT.json."""

from __future__ import annotations

import json
import random
import sys

import torch
from safetensors.torch import save_file

from rlboost import wire
from rlboost.config import AlgorithmSettings, TrainerSettings
from rlboost.trainer import distributed
from rlboost.trainer.grpo_trainer import GRPOTrainer


def batch(step: int, prompts: int = 5, samples: int = 4, stale: bool = False) -> list[wire.RolloutResult]:
    rng = random.Random(step)
    out = []
    for p in range(prompts):
        prompt = [rng.randrange(2, 16) for _ in range(rng.randint(4, 7))]
        for g in range(samples):
            toks = [rng.randrange(2, 16) for _ in range(rng.randint(3, 9))]
            # stale: the first tokens from p versions back (partial rollout), the rest from this step's
            segs = [wire.Segment(0, "w", 1, step - p % 3), wire.Segment(len(toks) // 2, "w", 2, step)] if stale else []
            out.append(wire.RolloutResult(request_id=wire.request_id(step, p, g), step=step, group=p, prompt_ids=prompt,
                                          token_ids=toks, logprobs=[-2.6 + 0.02 * i for i in range(len(toks))],
                                          segments=segs, finish_reason="stop", worker_id="w", ts=0.0))
    return out


def main(model_dir: str, out: str, off_policy: str = "") -> None:
    torch.set_num_threads(1)
    ranks = distributed.init_from_env("cpu")
    t = GRPOTrainer(model_dir, TrainerSettings(device="cpu", precision="fp32", lr=1e-3, micro_batch_tokens=40,
                                               weight_decay=0.01, warmup_steps=1),
                    AlgorithmSettings(off_policy=off_policy or "none", is_cap=1.5), seed=0, ranks=ranks)
    lockstep = distributed.Lockstep(t, ranks)
    if not ranks.leader:
        lockstep.follow()
    else:
        for step in range(3):
            t.start_step(step, policy_version=step)
            results = batch(step, stale=bool(off_policy))
            for g in sorted({r.group for r in results}, reverse=True):
                group = [r for r in results if r.group == g]
                t.add_group(g, group, [float(sum(r.token_ids) % 3 == 0) for r in group])
            report = t.finish_step()
        if off_policy:
            with open(out + ".json", "w") as f:
                json.dump(report.off_policy_row(), f)
        state = lockstep.call("state_dict", torch.float32)
        lockstep.stop()
        save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    if distributed.torchrun_rank():
        distributed.exit_rank(0)
