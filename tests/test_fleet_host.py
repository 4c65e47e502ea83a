"""Emulated instances sharing one fleet-host process (benchmarks/fleet_host.py): preempting one
reaches exactly its requests; the instance beside it in the same process serves on.

The preemption moment is chosen by state (the instance holds a lease on a request with a
checkpoint and tokens still to make), not by wall-clock luck."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from rlboost import wire
from rlboost.clients import open_clients
from rlboost.pool_client import PoolClient
from rlboost.workers.engines.emulated import reference_tokens
from rlboost.benchmarks.fleet_host import HostedFleet

K, MAX_NEW = 4, 24


async def held_by(c, worker_id: str, rids: list[str]) -> set[str]:
    """Requests `worker_id` holds unfinished, with at least one checkpoint and tokens still to make."""
    out = set()
    for rid in rids:
        owner, _, finished = await c.store.owner(rid)
        if owner == worker_id and not finished:
            tokens, _ = await c.store.read(rid)
            if K <= len(tokens) <= MAX_NEW - 2 * K:
                out.add(rid)
    return out


async def scenario(nats_url: str, redis_url: str, tmp_path, notice: bool) -> None:
    pool = f"host-{uuid.uuid4().hex[:8]}"
    # 60 ms per token (speed 0.1): a request takes ~1.5 s, so A is caught mid-request
    fleet = HostedFleet(nats_url, redis_url, tmp_path, pool, hosts=1, worker_args=[
        "--engine", "emulated", "--speed", "0.1", "--gpus", "1", "--slots", "4", "--checkpoint-tokens", str(K),
        "--token-scale", "1", "--ack-wait", "1.5", "--lease-ttl", "1.0", "--drain-grace", "5"],
        env={"RLBOOST_LOG_LEVEL": "warning", "RLBOOST_WORKER__HEARTBEAT_S": "0.25"})
    try:
        async with open_clients(nats_url, redis_url, "test-fleet-host", pools=(pool,)) as c:
            m = PoolClient(c, pool)
            a, b = fleet.start("a"), fleet.start("b")  # one host process: both instances in it
            deadline = time.monotonic() + 30
            while len(await m.live_workers()) < 2:
                assert time.monotonic() < deadline, "instances did not start"
                await asyncio.sleep(0.05)
            reqs = [wire.RolloutRequest(request_id=f"{pool}-{i}", step=0, policy_version=0, prompt_ids=[7] * 8,
                                        max_new_tokens=MAX_NEW, seed=1000 + i, group=i) for i in range(8)]
            rids = [r.request_id for r in reqs]
            await m.publish_step(reqs)
            results = asyncio.create_task(_collect(m, reqs))
            held: set[str] = set()
            while not held:  # preempt A once it holds work in progress
                assert time.monotonic() < deadline, "A never held a checkpointed request"
                held = await held_by(c, a.worker_id, rids)
                await asyncio.sleep(0.01)
            if notice:
                await asyncio.to_thread(fleet.terminate, a)
                assert await asyncio.to_thread(a.gone.wait, 10)
            else:
                await asyncio.to_thread(fleet.kill, a)
            gone_at = time.time()
            got = await asyncio.wait_for(results, 60)
            kv = await c.js.key_value(wire.BUCKET_WORKERS)
            last_beat = wire.decode(wire.WorkerHeartbeat, (await kv.get(a.worker_id)).value).ts \
                if not notice else None  # a drained worker deletes its entry
            assert b.worker_id in {hb.worker_id for hb in await m.live_workers()}  # B serves on
    finally:
        await asyncio.to_thread(fleet.stop_all)

    assert set(got) == set(rids)
    for rid, r in got.items():  # every result is the reference: nothing lost, nothing mixed up
        req = reqs[rids.index(rid)]
        assert r.token_ids == reference_tokens(req.seed, rid, 0, MAX_NEW)[0]
    moved = {rid for rid, r in got.items() if r.segments[0].worker_id == a.worker_id and r.worker_id != a.worker_id}
    assert held and held <= moved  # A's requests in progress finished elsewhere...
    for rid in moved:  # ... on B, from A's checkpoint, not from scratch
        assert got[rid].worker_id == b.worker_id and got[rid].segments[-1].offset >= K
    for rid in set(got) - moved:  # the rest were one worker's from start to finish
        assert {s.worker_id for s in got[rid].segments} == {got[rid].worker_id}
    ca, cb = a.counters(), b.counters()
    assert cb["fenced"] == 0  # B, in the same process, kept every lease
    if notice:  # drained: everything flushed and handed off, nothing to regenerate
        assert ca["generated"] == ca["checkpointed"] and ca["handed_off"] >= len(held)
    else:  # killed: at most the last unflushed chunk of each request it held
        assert ca["generated"] - ca["checkpointed"] <= K * 4
        assert ca["handed_off"] == 0
        assert last_beat < gone_at  # no heartbeat after the kill


async def _collect(m: PoolClient, reqs: list[wire.RolloutRequest]) -> dict[str, wire.RolloutResult]:
    return {r.request_id: r async for r in m.results(0, reqs, timeout_s=60)}


@pytest.mark.slow
@pytest.mark.parametrize("notice", [False, True], ids=["kill", "notice"])
def test_preempted_hosted_instance_requests_finish_elsewhere(services, tmp_path, notice):
    asyncio.run(scenario(*services, tmp_path, notice))
