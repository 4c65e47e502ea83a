"""Hostile input at every door, on real servers: nothing it sends deletes a file, kills a worker,
hangs the trainer or drains the fleet. Each test names the hole it closes (issue 19)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import structlog
import torch
from helpers import step_results

from rlboost import wire
from rlboost.checkpoint import CorruptCheckpoint, pack
from rlboost.clients import open_clients
from rlboost.config import WorkerSettings
from rlboost.errors import CheckpointError, RlboostError
from rlboost.pool_client import PoolClient
from rlboost.weights import DeltaCorrupt, FileBlobStore, StoreError
from rlboost.weights import WeightCache
from rlboost.weights import Manifest, VersionPointer, WeightPublisher
from rlboost.workers.counters import Counters
from rlboost.workers.engines.base import EngineError
from rlboost.workers.engines.emulated import EmulatedEngine
from rlboost.workers.worker import RolloutWorker

DEEP = b"\x82\xa1v\x01\xa1x" + b"\x91" * 200_000 + b"\xc0"  # 200 KB of nested MessagePack arrays


def _req(step: int, i: int, max_new: int = 12, rid: str | None = None) -> wire.RolloutRequest:
    return wire.RolloutRequest(request_id=rid or wire.request_id(step, i, 0), step=step, policy_version=0,
                               prompt_ids=[5, 6, 7], max_new_tokens=max_new, seed=11, group=i)


@pytest.fixture
async def clients(nats_url, redis_url, js):
    async with open_clients(nats_url, redis_url, "test-hostile") as c:
        yield c


def _worker(clients, pool: str) -> RolloutWorker:
    settings = WorkerSettings(pool=pool, slots=8, ack_wait_s=3.0, lease_ttl_s=2.0, heartbeat_s=0.2)
    return RolloutWorker(settings, EmulatedEngine(speed=0.0), clients, worker_id=f"{pool}-w", counters=Counters())


async def _dlq_reasons(js) -> list[str]:
    n = (await js.stream_info(wire.STREAM_DLQ)).state.messages
    sub = await js.subscribe("rb.dlq.>", ordered_consumer=True)
    out = []
    for _ in range(n):
        m = await sub.next_msg(timeout=5)
        out.append(m.headers[wire.HDR_DLQ_REASON])
    await sub.unsubscribe()
    return out


def test_every_deliberate_error_has_one_root():
    for kind in (wire.WireError, wire.SchemaVersionError, CheckpointError, CorruptCheckpoint, StoreError,
                 EngineError, DeltaCorrupt):
        assert issubclass(kind, RlboostError), kind


# ---------------------------------------------------------------- 1. manifests name files


@pytest.mark.parametrize("where", ["relative", "absolute"])
async def test_a_shard_id_in_a_manifest_never_reaches_outside_the_cache(tmp_path, where):
    """A manifest whose shard id is `../../victim` or an absolute path: main deleted that file."""
    store = FileBlobStore(tmp_path / "store", create=True)
    await WeightPublisher(store).publish({"w": torch.ones(4)}, 1)
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"the user's model")
    good = Manifest.decode(await store.read_all(wire.weights_manifest_key(1)))
    sha = "../../victim" if where == "relative" else str(tmp_path / "victim")
    shard = msgspec.structs.replace(good.shards[0], sha256=sha)
    tensors = [msgspec.structs.replace(t, parts=[msgspec.structs.replace(p, shard=sha) for p in t.parts])
               for t in good.tensors]
    await store.put(wire.weights_manifest_key(2), msgspec.json.encode(
        msgspec.structs.replace(good, version=2, shards=[shard], tensors=tensors)))
    cache = WeightCache(tmp_path / "cache", store)
    with pytest.raises((StoreError, ValueError)) as refused:
        await cache.ensure(2)
    assert victim.exists() and victim.read_bytes() == b"the user's model"
    assert "invalid shard id" in str(refused.value)
    assert (await cache.ensure(1)).version == 1  # genuine versions still served


# ---------------------------------------------------------------- 2/3. messages that killed workers


@pytest.mark.parametrize("data, reason", [
    (wire.encode(_req(1, 0, rid="s00001-p00000-g000\n")), "invalid request id"),
    (wire.encode(msgspec.structs.replace(_req(1, 0), prompt_ids=[5, -3])), "prompt ids outside"),
    (wire.encode(msgspec.structs.replace(_req(1, 0), prompt_ids=[2**40])), "prompt ids outside"),
    (DEEP, "nested too deeply"),
])
def test_the_wire_door_refuses_with_a_reason(data, reason):
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(wire.RolloutRequest, data)


@pytest.mark.parametrize("kind", [wire.RolloutRequest, wire.TokenChunk, wire.TokenFlush, wire.RolloutResult, wire.WorkerHeartbeat,
                                  wire.Control, wire.LeaseEvent])
def test_deep_nesting_is_a_wire_error_for_every_message(kind):
    with pytest.raises(wire.WireError, match="nested too deeply"):
        wire.decode(kind, DEEP)


async def test_hostile_requests_and_corrupt_checkpoints_are_dead_lettered_at_once(clients):
    """A trailing-newline id, out-of-range prompt ids, deep nesting, and checkpoints holding
    odd-length tokens or a junk epoch: each dead-lettered on its first delivery with its reason
    (main: crashes, or the DLQ only after max_deliver). A finished request whose history is
    junk still gets its result. The worker serves the genuine requests throughout."""
    js, r, step = clients.js, clients.store.redis, 201
    pool = "hostile"
    odd, bad_epoch, junk_hist = (wire.request_id(step, 90 + i, 0, run="x") for i in range(3))
    await r.set(wire.ckpt_tokens_key(odd), b"\x01\x02\x03")
    await r.hset(wire.ckpt_meta_key(bad_epoch), "epoch", "not-a-number")
    old = await clients.store.claim(junk_hist, "w-old", 0, ttl_s=5)
    await clients.store.append(junk_hist, "w-old", old.epoch, 0, [9, 9, 9], [-0.5] * 3, ttl_s=5)
    await clients.store.finish(junk_hist, old.epoch, 3)
    await r.rpush(wire.ckpt_history_key(junk_hist), b"\xff junk")
    w = _worker(clients, pool)
    task = asyncio.create_task(w.run())
    t0 = time.monotonic()
    subject = wire.request_subject(pool)
    await js.publish(subject, wire.encode(_req(step, 0, rid=f"{wire.request_id(step, 80, 0)}\n")))
    await js.publish(subject, wire.encode(msgspec.structs.replace(_req(step, 81), prompt_ids=[1, -1])))
    await js.publish(subject, DEEP)
    for rid in (odd, bad_epoch, junk_hist):
        await js.publish(subject, wire.encode(_req(step, 0, rid=rid)))
    genuine = [_req(step, i) for i in range(4)]
    for q in genuine:
        await js.publish(subject, wire.encode(q))
    got = await step_results(js, step, len(genuine) + 1)
    for _ in range(100):
        if (await js.stream_info(wire.STREAM_DLQ)).state.messages >= 5:
            break
        await asyncio.sleep(0.05)
    elapsed = time.monotonic() - t0
    w.request_drain("test over")
    await task
    assert set(got) == {q.request_id for q in genuine} | {junk_hist}
    assert got[junk_hist].token_ids == [9, 9, 9]
    reasons = await _dlq_reasons(js)
    assert len(reasons) == 5, reasons
    assert sum("invalid request id" in x for x in reasons) == 1
    assert sum("prompt ids outside" in x for x in reasons) == 1
    assert sum("nested too deeply" in x for x in reasons) == 1
    assert sum("corrupt checkpoint" in x for x in reasons) == 2
    assert not any("max deliveries" in x for x in reasons)
    assert elapsed < 3.0 * 20  # well before max_deliver x ack_wait


async def test_checkpoint_door(store, rid):
    await store.redis.set(wire.ckpt_tokens_key(rid), pack([1, 2], [0.0, 0.0])[:-1])
    with pytest.raises(CorruptCheckpoint, match="not a multiple"):
        await store.read(rid)
    await store.redis.hset(wire.ckpt_meta_key(rid), "epoch", "x")
    with pytest.raises(CorruptCheckpoint):
        await store.claim(rid, "w1", 0, ttl_s=1)


# ---------------------------------------------------------------- 4. the trainer takes only what it asked for


async def test_the_manager_takes_only_genuine_results(clients):
    """Forged results (an unknown request, a known one with another group, one not bound to its
    lease, one published first under the bare request id) and deep nesting on the results
    subject: each dead-lettered with a reason; the genuine results all arrive (main: the forged
    group hung `rlboost run`, the deep one crashed it)."""
    js, step, pool = clients.js, 301, "trust"
    reqs = [_req(step, i) for i in range(3)]
    forged = wire.RolloutResult(request_id=reqs[0].request_id, step=step, group=reqs[0].group,
                                prompt_ids=list(reqs[0].prompt_ids), token_ids=[1, 2], logprobs=[0.0, 0.0],
                                segments=[], finish_reason="length", worker_id="mallory", ts=0.0, epoch=1)
    subject = wire.result_subject(step)
    old_run = msgspec.structs.replace(forged, request_id="rold-" + reqs[0].request_id)
    await js.publish(subject, wire.encode(old_run))  # an earlier run's result: history, skipped quietly
    manager = PoolClient(clients, pool)
    await manager.publish_step(reqs)
    await js.publish(subject, wire.encode(msgspec.structs.replace(forged, request_id=wire.request_id(step, 77, 0))))
    await js.publish(subject, wire.encode(msgspec.structs.replace(forged, group=99)),
                     headers={wire.HDR_MSG_ID: reqs[0].request_id})
    await js.publish(subject, wire.encode(forged), headers={wire.HDR_MSG_ID: reqs[1].request_id})
    await js.publish(subject, DEEP)
    w = _worker(clients, pool)
    task = asyncio.create_task(w.run())
    got = [r async for r in manager.results(step, reqs, timeout_s=30)]
    w.request_drain("test over")
    await task
    assert sorted(r.request_id for r in got) == sorted(q.request_id for q in reqs)
    assert all(r.worker_id == w.worker_id and r.epoch >= 1 and r.token_ids != [1, 2] for r in got)
    reasons = await _dlq_reasons(js)
    assert len(reasons) == 4, reasons
    assert sum("unknown request" in x for x in reasons) == 1
    assert sum("group or prompt differ" in x for x in reasons) == 1
    assert sum("refused" in x for x in reasons) == 2  # the group one and the lease one
    assert sum("nested too deeply" in x for x in reasons) == 1


async def test_a_garbage_version_pointer_is_ignored(js):
    import uuid

    pointer = await VersionPointer.open(js, key=f"weights-test-{uuid.uuid4().hex[:10]}")
    stop = asyncio.Event()
    seen: list[int] = []

    async def watch() -> None:
        async for v in pointer.watch(stop):
            seen.append(v)

    watcher = asyncio.create_task(watch())
    await pointer.set(3)
    for i, garbage in enumerate((b"\xff\xfe", b"../7", b"-1", b"9" * 40, DEEP[:64])):
        await pointer.kv.put(pointer.key, garbage)
        if i < 3:  # a fresh reader finds the last valid one in the key's history (5 entries)
            assert await VersionPointer(pointer.kv, pointer.key).get() == 3
        assert await pointer.get() == 3
    await pointer.set(4)
    for _ in range(100):
        if seen[-1:] == [4]:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await watcher
    assert seen == [3, 4]


# ---------------------------------------------------------------- 5. bounded control


async def test_control_entries_are_bounded(clients):
    """`drain` for all with timestamp 0 (main: drained every worker started later, for good), an
    expired one, one filed under this worker's key but naming another: all ignored. A current
    one naming the worker drains it."""
    kv = await clients.js.key_value(wire.BUCKET_CONTROL)
    w = _worker(clients, "ctl")
    await kv.put(wire.CONTROL_ALL, wire.encode(wire.Control(command="drain", reason="old", ts=0.0)))
    await kv.put(w.worker_id, wire.encode(msgspec.structs.replace(wire.control("drain", w.worker_id), deadline=1.0)))
    task = asyncio.create_task(w.run())
    await asyncio.sleep(1.0)  # five heartbeats, five control checks
    assert not w.draining.is_set() and not task.done()
    await kv.put(w.worker_id, wire.encode(wire.control("abort", "someone-else")))
    await asyncio.sleep(0.6)
    assert not w.draining.is_set()
    await kv.put(w.worker_id, DEEP)  # (main: RecursionError there skipped the fleet-wide key too)
    await kv.put(wire.CONTROL_ALL, wire.encode(wire.control("drain", wire.CONTROL_ALL, "spot notice")))
    await asyncio.wait_for(task, timeout=10)
    assert "spot notice" in w.drain_reason
    await kv.delete(wire.CONTROL_ALL)
    await kv.delete(w.worker_id)


async def test_replay_reads_past_hostile_messages(js):
    """`rlboost replay` skips what does not decode (main: deep nesting made it exit)."""
    from rlboost import replay

    step, rid = 401, wire.request_id(401, 0, 0)
    ev = wire.LeaseEvent(request_id=rid, step=step, worker_id="w1", epoch=1, kind="claim", offset=0, ts=1.0)
    for subject in (wire.event_subject(step, rid), wire.token_subject(step, rid), wire.result_subject(step)):
        await js.publish(subject, DEEP)
    await js.publish(wire.event_subject(step, rid), wire.encode(ev))
    life = await replay.life_of(js, step, rid)
    assert life.events == [ev] and not life.chunks and life.result is None
    assert set(await replay.step_lives(js, step)) == {rid}


# ---------------------------------------------------------------- issue 30: planted manifests


async def test_a_planted_manifest_never_stops_a_run(tmp_path):
    """A manifest whose shard id is not a digest, above the versions this run publishes, and a
    name that is no manifest key at all: the publisher's pointer walk and GC skip them with one
    warning line each, its own versions stay, and reaching the planted version number replaces
    the unreadable manifest (main: every `rlboost run` on the store exited with a traceback,
    `StoreError: invalid shard id`, at its first publish)."""
    from rlboost.weights import published_versions

    store = FileBlobStore(tmp_path / "store", create=True)
    await WeightPublisher(store, keep_versions=1).publish({"w": torch.ones(4)}, 1)
    good = Manifest.decode(await store.read_all(wire.weights_manifest_key(1)))
    bad = msgspec.structs.replace(good.shards[0], sha256="not-a-digest")
    for v in (3, 9):
        await store.put(wire.weights_manifest_key(v), msgspec.json.encode(msgspec.structs.replace(
            good, version=v, shards=[bad], tensors=[msgspec.structs.replace(t, parts=[
                msgspec.structs.replace(p, shard="not-a-digest") for p in t.parts]) for t in good.tensors])))
    await store.put("manifests/vjunk.json", b"{}")
    pub = WeightPublisher(store, keep_versions=2, deltas=False)
    with structlog.testing.capture_logs() as logs:
        for v in (2, 3, 4):
            await pub.publish({"w": torch.full((4,), float(v))}, v)  # gc after each
    assert await published_versions(store) == [3, 4, 9]  # 1, 2: collected; 9: not this publisher's to judge
    assert (await WeightCache(tmp_path / "cache", store).ensure(3)).version == 3  # ours now
    assert (await WeightCache(tmp_path / "cache2", store).ensure(4)).version == 4
    skipped = sorted(e["key"] for e in logs if "skipping an invalid entry" in e["event"])
    assert skipped == ["manifests/v000000000003.json", "manifests/v000000000009.json", "manifests/vjunk.json"]
