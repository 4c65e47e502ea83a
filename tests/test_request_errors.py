"""A request the engine cannot serve gets an `error` result; the worker serves on.

Context overflow and token ids outside the vocabulary, published by hand to a real torch
worker process; and a per-request engine failure in the middle of a batch (RequestError).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from helpers import step_results

from rlboost import wire
from rlboost.clients import open_clients
from rlboost.config import WorkerSettings
from rlboost.pool_client import PoolClient
from rlboost.trainer.model import init_model_dir
from rlboost.trainer.tasks import get_task
from rlboost.workers.counters import Counters, read_counters
from rlboost.workers.engines.base import RequestError
from rlboost.workers.engines.emulated import EmulatedEngine
from rlboost.workers.engines.torch_engine import TorchEngine
from rlboost.workers.worker import RolloutWorker, make_sequence


RUN = wire.new_run_id()  # request ids of their own: the session's Redis outlives each test


def _req(step: int, i: int, prompt: list[int], max_new: int = 8) -> wire.RolloutRequest:
    return wire.RolloutRequest(request_id=wire.request_id(step, i, 0, run=RUN), step=step, policy_version=0,
                               prompt_ids=prompt, max_new_tokens=max_new, seed=100 + i, eos_id=1, stop_ids=[1],
                               group=i)


@pytest.mark.slow
async def test_a_torch_worker_process_answers_bad_requests_with_errors_and_serves_on(
        nats_url, redis_url, js, tmp_path):
    model = init_model_dir(tmp_path / "model", get_task("addition"), seed=4, hidden=32, layers=1, heads=2, mlp=64)
    engine = TorchEngine(str(model))  # max_positions 256, vocabulary of 16
    pool, step = "errs", 301
    counters = tmp_path / "w.counters"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlboost.cli", "worker", "--pool", pool, "--engine", "torch", "--model-dir", str(model),
         "--worker-id", "errs-w1", "--counters", str(counters)],
        env={**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
             "RLBOOST_WORKER__CACHE_DIR": str(tmp_path / "cache")},
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "wb"))
    try:
        too_long = _req(step, 0, [5] * 250, max_new=16)  # 250 + 16 > 256 positions
        out_of_vocab = _req(step, 1, [5, 6, engine.vocab_size + 7])
        good = [_req(step, 2 + i, [4, 5, 2, 6, 13]) for i in range(3)]
        async with open_clients(nats_url, redis_url, "test-errors") as c:
            manager = PoolClient(c, pool)  # the trainer's side: it verifies every result, errors too
            await manager.publish_step([too_long, out_of_vocab, *good], pool)
            got = {r.request_id: r async for r in manager.results(step, [too_long, out_of_vocab, *good],
                                                                   timeout_s=90)}
        assert got[too_long.request_id].finish_reason == "error"
        assert "exceed the model's context of 256" in got[too_long.request_id].error
        assert got[out_of_vocab.request_id].finish_reason == "error"
        assert "outside the vocabulary" in got[out_of_vocab.request_id].error
        for r in good:
            assert got[r.request_id].finish_reason in ("stop", "length") and got[r.request_id].token_ids
        # ... and it serves the next request too, still alive
        later = _req(step + 1, 0, [4, 5, 2, 6, 13])
        await js.publish(wire.request_subject(pool), wire.encode(later))
        assert (await step_results(js, step + 1, 1, timeout=60.0))[later.request_id].finish_reason != "error"
        assert proc.poll() is None
        assert read_counters(counters)["request_errors"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class ChokesOn666(EmulatedEngine):
    """An engine that only finds out mid-batch that it cannot serve a request."""

    async def generate(self, batch, max_tokens, stop=None):
        for s in batch:
            if s.prompt_ids[0] == 666:
                raise RequestError(s.request_id, "the engine choked on it")
        return await super().generate(batch, max_tokens, stop)


async def test_a_request_that_fails_mid_batch_gets_an_error_and_the_rest_finish(nats_url, redis_url, js):
    step, pool = 303, "choke"
    async with open_clients(nats_url, redis_url, "test-choke") as c:
        w = RolloutWorker(WorkerSettings(pool=pool, slots=8, ack_wait_s=3.0, lease_ttl_s=2.0, heartbeat_s=0.2),
                          ChokesOn666(speed=0.0), c, worker_id=f"{pool}-w", counters=Counters())
        task = asyncio.create_task(w.run())
        reqs = [_req(step, i, [666 if i == 2 else 5, 6, 7], max_new=40) for i in range(6)]
        manager = PoolClient(c, pool)  # the trainer's side: it verifies every result, errors too
        await manager.publish_step(reqs, pool)
        got = {r.request_id: r async for r in manager.results(step, reqs, timeout_s=60)}
        assert not w.draining.is_set()
        w.request_drain("test over")
        await task
    assert got[reqs[2].request_id].finish_reason == "error" and "choked" in got[reqs[2].request_id].error
    assert all(got[r.request_id].finish_reason != "error" for i, r in enumerate(reqs) if i != 2)
    assert w.counters.get("request_errors") == 1


def test_the_torch_engine_refuses_what_it_cannot_serve(tmp_path):
    model = init_model_dir(tmp_path / "model", get_task("addition"), seed=4, hidden=32, layers=1, heads=2, mlp=64)
    engine = TorchEngine(str(model), max_model_len=64)
    fine = _req(1, 0, [4, 5, 6], max_new=8)
    assert engine.check(make_sequence(fine, [])) is None
    assert "context of 64" in engine.check(make_sequence(_req(1, 1, [4] * 60, max_new=8), []))
    bad = make_sequence(_req(1, 2, [4, -3]), [])
    assert "outside the vocabulary" in engine.check(bad)
    with pytest.raises(RequestError) as e:
        asyncio.run(engine.generate([make_sequence(fine, []), bad], 4))
    assert e.value.request_id == bad.request_id
    assert asyncio.run(engine.generate([make_sequence(fine, [])], 4))[0].token_ids  # still serves
