"""A hand-off is taken only for a request the run published, with its published spec (issue 40).

The resume lane is written by every worker credential (a worker hands its requests back there),
the fresh lane by the trainer only. A request's first claim from the fresh lane records its spec
(`wire.spec_digest`) with its checkpoint; a hand-off whose request was never claimed so, or whose
spec (seed, prompt, sampling, bounds, episode...) differs, is dead-lettered with the reason and
generates nothing. The genuine hand-offs (a drain, a version floor, the environment pool) still
resume: tests/test_worker.py, tests/test_env_pool.py."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from helpers import step_results

from rlboost import wire
from rlboost.clients import open_clients
from rlboost.config import WorkerSettings
from rlboost.workers.counters import Counters
from rlboost.workers.engines.emulated import EmulatedEngine, LengthModel, reference_tokens
from rlboost.workers.worker import RolloutWorker

POOL = "handoff-spec"


@pytest.fixture
async def clients(nats_url, redis_url, js):
    async with open_clients(nats_url, redis_url, "test-handoff-spec") as c:
        yield c


def _req(step: int, i: int, seed: int = 11) -> wire.RolloutRequest:
    return wire.RolloutRequest(request_id=wire.request_id(step, i, 0, run="hs"), step=step, policy_version=0,
                               prompt_ids=[5, 6, 7], max_new_tokens=30, seed=seed, group=i)


def _reference(r: wire.RolloutRequest) -> list[int]:
    n = min(r.max_new_tokens, LengthModel().length(r.seed, r.request_id))
    return reference_tokens(r.seed, r.request_id, 0, n)[0]


async def _dead_letters(js, n: int, timeout: float = 10.0) -> list[str]:
    """The reasons of the first `n` dead letters, once there are `n` (a state, not a sleep)."""
    deadline = time.monotonic() + timeout
    while (await js.stream_info(wire.STREAM_DLQ)).state.messages < n and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    sub = await js.subscribe("rb.dlq.>", ordered_consumer=True)
    try:
        return [(await sub.next_msg(timeout=5)).headers[wire.HDR_DLQ_REASON] for _ in range(n)]
    finally:
        await sub.unsubscribe()


async def test_a_planted_hand_off_is_refused_and_the_published_request_is_generated_as_published(clients):
    """A worker credential plants on the resume lane a hand-off of a request the trainer has not
    published yet (its id guessed from the run's naming) with another seed, and one of a request
    that is in flight with another seed. Both are dead-lettered with the reason; the published
    requests give exactly the undisturbed run's tokens."""
    js, step = clients.js, 401
    w = RolloutWorker(WorkerSettings(pool=POOL, slots=8, ack_wait_s=3.0, lease_ttl_s=2.0, heartbeat_s=0.2),
                      EmulatedEngine(speed=0.0), clients, worker_id=f"{POOL}-w", counters=Counters())
    task = asyncio.create_task(w.run())
    try:
        future, current = _req(step, 0), _req(step, 1)
        # planted before the trainer publishes `future`: under its id, another seed
        await js.publish(wire.resume_subject(POOL), wire.encode(msgspec.structs.replace(future, seed=99)))
        reasons = await _dead_letters(js, 1)
        assert "never came from the trainer" in reasons[0], reasons
        await js.publish(wire.request_subject(POOL), wire.encode(current))
        first = await step_results(js, step, 1)
        assert first[current.request_id].token_ids == _reference(current)
        # planted for a request the run did publish, with another seed
        await js.publish(wire.resume_subject(POOL), wire.encode(msgspec.structs.replace(current, seed=98)))
        reasons = await _dead_letters(js, 2)
        assert "is not the one published" in reasons[1], reasons
        # the trainer publishes `future` now: generated from its own spec, not the planted one's
        await js.publish(wire.request_subject(POOL), wire.encode(future))
        got = await step_results(js, step, 2)
        assert got[future.request_id].token_ids == _reference(future)
        assert got[future.request_id].token_ids != _reference(msgspec.structs.replace(future, seed=99))
        assert got[current.request_id].token_ids == _reference(current)
        assert w.counters.get("dead_lettered") == 2
    finally:
        w.request_drain("test over")
        await task


async def test_a_request_forwarded_unstarted_is_vouched_for(clients):
    """A seeding engine forwards its queue unstarted to another pool's resume lane
    (`_forward_own_queue`): it records each request's spec first (`CheckpointStore.vouch_many`),
    as a fresh claim would, so the hand-off is taken; a recorded spec is never replaced."""
    step = 402
    r = _req(step, 0)
    assert await clients.store.vouch_many([(r.request_id, wire.spec_digest(r))]) == [True]
    assert await clients.store.vouch_many([(r.request_id, wire.spec_digest(r))]) == [True]
    other = wire.spec_digest(msgspec.structs.replace(r, seed=99))
    assert await clients.store.vouch_many([(r.request_id, other)]) == [False]
    c = await clients.store.claim(r.request_id, "w", 0, ttl_s=5, spec=wire.spec_digest(r), handoff=True)
    assert c.token_ids == []
    # the policy version is no part of the spec: a worker raises it on the way (floor, update)
    assert wire.spec_digest(msgspec.structs.replace(r, policy_version=7)) == wire.spec_digest(r)
