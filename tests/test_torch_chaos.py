"""The worker invariants on the torch engine: real model, real processes, real signals.

A request resumed on another worker (after SIGTERM, SIGKILL, or a SIGSTOP takeover) must
continue with exactly the tokens and logprobs one uninterrupted engine produces for it.
"""

from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from rlboost import wire
from rlboost.trainer.model import init_model_dir
from rlboost.trainer.tasks import get_task
from rlboost.benchmarks.chaos import chaos
from rlboost.workers.engines.base import Sequence
from rlboost.workers.engines.torch_engine import TorchEngine


@pytest.mark.slow
def test_torch_workers_under_chaos_match_an_uninterrupted_engine(services, tmp_path):
    nats_url, redis_url = services
    model_dir = init_model_dir(tmp_path / "model", get_task("addition"), seed=3)
    rng = random.Random(5)
    step = 777
    requests = [wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step, policy_version=0,
                                    prompt_ids=[rng.randrange(3, 16) for _ in range(8)],
                                    max_new_tokens=rng.randint(40, 120), seed=rng.randrange(1 << 30), group=i)
                for i in range(36)]
    engine = TorchEngine(str(model_dir))

    async def alone(q: wire.RolloutRequest) -> tuple[list[int], list[float]]:
        seq = Sequence(request_id=q.request_id, prompt_ids=list(q.prompt_ids), seed=q.seed,
                       max_new_tokens=q.max_new_tokens, eos_id=q.eos_id)
        (g,) = await engine.generate([seq], q.max_new_tokens)
        return g.token_ids, g.logprobs

    expected = {q.request_id: asyncio.run(alone(q)) for q in requests}  # one request at a time, in one go

    def reference(q: wire.RolloutRequest) -> tuple[list[int], list[float]]:
        return expected[q.request_id]

    a = argparse.Namespace(requests=len(requests), workers=3, slots=6, k=8, speed=0, min_new=0, max_new=0,
                           every=2.5, chaos_until=0.9, min_actions=2, ack_wait=3.0, timeout=240.0, seed=11)
    out = asyncio.run(chaos(a, nats_url, redis_url, tmp_path / "workers",
                            engine_args=["--engine", "torch", "--model-dir", str(model_dir)],
                            reference=reference, requests=requests))
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["mismatched"] == 0, out
    assert out["kills"] + out["terms"] + out["stops"] >= 2, out
    assert out["regenerated_tokens_term"] == 0, out
    assert out["regenerated_tokens_kill"] <= a.k * out["killed_inflight"], out
