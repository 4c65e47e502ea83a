"""Every dead letter reaches the trainer: a request a worker dead-letters for any reason (here a
checkpoint planted with junk before the request was published, as a stolen rollout credential
can) is published again from its spec, its checkpoint reset, and the step completes with the
result an undisturbed run gives."""

from __future__ import annotations

import asyncio

import episode_env
import pytest

from rlboost import wire
from rlboost.clients import open_clients
from rlboost.config import EnvSettings, WorkerSettings
from rlboost.envs import calculator
from rlboost.pool_client import PoolClient
from rlboost.workers.counters import Counters
from rlboost.workers.engines.emulated import EmulatedEngine, LengthModel, reference_tokens
from rlboost.workers.engines.scripted import ScriptedEngine
from rlboost.workers.worker import RolloutWorker


@pytest.fixture
async def clients(nats_url, redis_url, js):
    async with open_clients(nats_url, redis_url, "test-dead-letters") as c:
        yield c


@pytest.fixture
async def worker(clients):
    """A factory of running rollout workers (an engine each), drained at the end."""
    running: list[tuple[RolloutWorker, asyncio.Task]] = []

    def start(pool: str, engine, **kw) -> RolloutWorker:
        settings = WorkerSettings(pool=pool, slots=8, checkpoint_tokens=4, ack_wait_s=3.0, lease_ttl_s=2.0,
                                  heartbeat_s=0.2)
        w = RolloutWorker(settings, engine, clients, worker_id=f"{pool}-w{len(running)}", counters=Counters(), **kw)
        running.append((w, asyncio.create_task(w.run())))
        return w

    yield start
    for w, task in running:
        w.request_drain("test over")
    await asyncio.gather(*(t for _, t in running))


async def _collect(manager: PoolClient, step: int, reqs) -> dict[str, wire.RolloutResult]:
    return {r.request_id: r async for r in manager.results(step, reqs, timeout_s=60.0)}


# What a credential can SET at a request's keys: odd-length token bytes, a meta hash that is a
# string, an episode state that is no state.
PLANTS = {
    "tok": lambda rid: (wire.ckpt_tokens_key(rid), b"\x01\x02\x03"),
    "meta": lambda rid: (wire.ckpt_meta_key(rid), b"junk"),
}


@pytest.mark.parametrize("planted", sorted(PLANTS))
async def test_a_single_turn_request_with_a_planted_checkpoint_is_redone_and_its_step_completes(
        clients, worker, planted):
    step, pool = 601 + sorted(PLANTS).index(planted), f"dl{planted}"
    reqs = [wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step, policy_version=0,
                                prompt_ids=[5, 6, 7], max_new_tokens=24, seed=11, group=i) for i in range(4)]
    key, junk = PLANTS[planted](reqs[0].request_id)
    await clients.store.redis.set(key, junk)
    w = worker(pool, EmulatedEngine())
    manager = PoolClient(clients, pool)
    await manager.publish_step(reqs)
    got = await asyncio.wait_for(_collect(manager, step, reqs), 60.0)
    assert set(got) == {r.request_id for r in reqs}
    lengths = LengthModel()
    for r in reqs:  # the redone request's result is the one an undisturbed run gives
        n = min(r.max_new_tokens, lengths.length(r.seed, r.request_id))
        assert got[r.request_id].token_ids == reference_tokens(r.seed, r.request_id, 0, n)[0]
    assert w.counters.get("dead_lettered") >= 1


@pytest.mark.parametrize("planted", ["ep-junk", "ep-state"])
async def test_an_episode_with_a_planted_snapshot_is_redone_and_its_step_completes(clients, worker, tmp_path,
                                                                                   planted):
    step, pool = 611 + (planted == "ep-state"), planted
    rows = calculator.rows("train", 3, seed=4)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, max_turns=6, max_turn_tokens=64, run="dl")
    rid = reqs[0].request_id
    # junk bytes, or a well-formed state whose snapshot is not one: both make the claim unusable
    junk = b"\x00garbage" if planted == "ep-junk" else wire.encode(wire.EpisodeState(turn=0, at=0, env_state="{}"))
    await clients.store.redis.set(wire.ckpt_episode_key(rid), junk)
    w = worker(pool, ScriptedEngine(episode_env.tokenizer(), episode_env.solver(rows)),
               env=EnvSettings(ref=episode_env.ENV_REF))
    manager = PoolClient(clients, pool)
    await manager.publish_step(reqs)
    got = await asyncio.wait_for(_collect(manager, step, reqs), 60.0)
    assert set(got) == {r.request_id for r in reqs}
    assert all(r.episode.reason == "done" for r in got.values())
    assert w.counters.get("dead_lettered") >= 1 and manager.redone.get(rid, 0) == 0  # forgotten once the step is in


async def test_junk_planted_again_and_again_fails_the_step_with_the_reason_not_a_hang(clients, worker):
    step, pool = 621, "dlagain"
    req = wire.RolloutRequest(request_id=wire.request_id(step, 0, 0), step=step, policy_version=0,
                              prompt_ids=[5, 6, 7], max_new_tokens=24, seed=11, group=0)
    key = wire.ckpt_tokens_key(req.request_id)
    stop = asyncio.Event()

    async def plant() -> None:  # the attacker writes junk again whenever the trainer resets it
        while not stop.is_set():
            await clients.store.redis.set(key, b"\x01\x02\x03")
            await asyncio.sleep(0.02)

    planter = asyncio.create_task(plant())
    worker(pool, EmulatedEngine())
    manager = PoolClient(clients, pool)
    await manager.publish_step([req])
    from rlboost.errors import RequestsDeadLettered

    with pytest.raises(RequestsDeadLettered, match="corrupt"):
        await asyncio.wait_for(_collect(manager, step, [req]), 60.0)
    stop.set()
    await planter


async def test_forged_dead_letters_cost_no_result_and_duplicate_none(clients, worker):
    """Any worker credential may publish on the dead-letter subjects: a dead letter is a hint.
    Forged ones for every request of a step, while a slow worker holds them: each request still
    yields exactly its undisturbed result, and a held request is not published again."""
    step, pool = 631, "dlforged"
    reqs = [wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step, policy_version=0,
                                prompt_ids=[5, 6, 7], max_new_tokens=24, seed=11, group=i) for i in range(4)]
    w = worker(pool, EmulatedEngine(speed=0.02))  # slow: the requests are held while the forgeries come
    manager = PoolClient(clients, pool)
    await manager.publish_step(reqs)
    deadline = asyncio.get_running_loop().time() + 30.0
    while w.counters.get("claims") < len(reqs) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    for r in reqs:
        await clients.js.publish(wire.dlq_subject(wire.STREAM_REQUESTS), wire.encode(r),
                                 headers={wire.HDR_DLQ_REASON: "corrupt checkpoint: forged"})
    import structlog

    with structlog.testing.capture_logs() as logs:
        got = await asyncio.wait_for(_collect(manager, step, reqs), 60.0)
    lengths = LengthModel()
    for r in reqs:
        n = min(r.max_new_tokens, lengths.length(r.seed, r.request_id))
        assert got[r.request_id].token_ids == reference_tokens(r.seed, r.request_id, 0, n)[0]
    assert not [e for e in logs if e["event"] == "request published again after a dead letter"]
    assert w.counters.get("claims") == len(reqs)
