"""Fuzzing every door: decoders with hypothesis (bounded, derandomized), and a real worker process
fed a seeded mix of hostile requests, control entries, checkpoints and forged results.

The invariant at each door: a valid value or the door's own error with a reason, never anything
else (no RecursionError, no ValueError from deep inside). At the worker: no exit, every hostile
request dead-lettered on its first delivery with a reason, every forged result refused by the
trainer's manager, and the genuine results byte-identical to an undisturbed run."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlboost import checkpoint, wire
from rlboost.clients import open_clients
from rlboost.pool_client import PoolClient
from rlboost.weights import StoreError
from rlboost.weights import Manifest, parse_version
from rlboost.workers.engines.emulated import LengthModel, reference_tokens
from rlboost.workers.fleet import WorkerFleet

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
KINDS = [wire.RolloutRequest, wire.TokenChunk, wire.TokenFlush, wire.RolloutResult, wire.WorkerHeartbeat, wire.Control, wire.LeaseEvent]

# msgpack-able values, nested, with the field names of the real messages mixed in
_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=40) \
    | st.binary(max_size=40)
_names = st.sampled_from(["v", "request_id", "step", "prompt_ids", "token_ids", "logprobs", "worker_id", "epoch",
                          "command", "target", "deadline", "segments", "max_new_tokens", "sampling", "pool"])
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_names | st.text(max_size=8),
                                                                                             inner, max_size=6),
                       max_leaves=30)
_messages = st.dictionaries(_names, _values, max_size=10).map(lambda d: {"v": 1, **d})


def _valid_request(i: int = 0) -> bytes:
    return wire.encode(wire.RolloutRequest(request_id=wire.request_id(1, i, 0), step=1, policy_version=0,
                                           prompt_ids=[5, 6, 7], max_new_tokens=12, seed=3, group=i))


def _door(kind, data: bytes) -> None:
    try:
        wire.decode(kind, data)
    except wire.WireError as e:
        assert str(e)


@FUZZ
@given(kind=st.sampled_from(KINDS), data=st.binary(max_size=300))
def test_wire_door_on_random_bytes(kind, data):
    _door(kind, data)


@settings(FUZZ, max_examples=100)
@given(kind=st.sampled_from(KINDS), body=_messages)
def test_wire_door_on_random_structures(kind, body):
    _door(kind, msgspec.msgpack.encode(body))


@FUZZ
@given(kind=st.sampled_from(KINDS), cut=st.integers(0, 200), flips=st.lists(st.tuples(st.integers(0, 200),
                                                                                       st.integers(0, 7)), max_size=4),
       depth=st.integers(0, 5000))
def test_wire_door_on_damaged_messages(kind, cut, flips, depth):
    data = bytearray(_valid_request()[:cut] if cut else _valid_request())
    for pos, bit in flips:
        if data:
            data[pos % len(data)] ^= 1 << bit
    _door(kind, bytes(data))
    _door(kind, b"\x81\xa1v\x01" + b"\x91" * depth)  # a map whose value is nested `depth` deep


@settings(FUZZ, max_examples=60)
@given(body=_messages, sha=st.text(max_size=80) | st.sampled_from(["../../x", "/etc/passwd", "a" * 64 + "\n"]))
def test_manifest_door(body, sha):
    good = {"v": 1, "version": 1, "created": 0.0, "total_bytes": 1,
            "shards": [{"sha256": sha, "size": 1, "keys": ["w"]}],
            "tensors": [{"name": "w", "dtype": "float32", "shape": [1], "parts": [[sha, "w", 0, 1]]}]}
    for doc in (good, {**good, **body}, body):
        try:
            m = Manifest.decode(msgspec.json.encode(doc))
        except StoreError as e:
            assert str(e)
            continue
        assert all(len(s.sha256) == 64 and set(s.sha256) <= set("0123456789abcdef") for s in m.shards)


@FUZZ
@given(raw=st.binary(max_size=30) | st.text(max_size=30).map(str.encode))
def test_version_pointer_door(raw):
    v = parse_version(raw)
    assert v is None or (isinstance(v, int) and v >= 0 and str(v).encode() == raw.lstrip(b"0").rjust(1, b"0"))


@FUZZ
@given(data=st.binary(max_size=100), line=st.binary(max_size=60))
def test_checkpoint_door(data, line):
    try:
        tokens, logprobs = checkpoint.unpack(data)
        assert len(tokens) == len(logprobs) == len(data) // 8 and min(tokens, default=0) >= 0
    except checkpoint.CorruptCheckpoint as e:
        assert str(e)
    try:
        seg = checkpoint.parse_segment(line)
        assert seg.offset >= 0 and seg.epoch >= 0
    except checkpoint.CorruptCheckpoint as e:
        assert str(e)


# ---------------------------------------------------------------- a real worker under fire


def hostile_requests(rng: random.Random, step: int) -> list[bytes]:
    """Payloads the request door must refuse: damaged genuine ones, lying fields, deep nesting."""
    base = wire.RolloutRequest(request_id=wire.request_id(step, 900, 0), step=step, policy_version=0,
                               prompt_ids=[5, 6], max_new_tokens=8, seed=1)
    liars = [dict(request_id=base.request_id + "\n"), dict(request_id="a.b"), dict(request_id="x" * 129),
             dict(request_id="*"), dict(prompt_ids=[]), dict(prompt_ids=[-1]), dict(prompt_ids=[2**40]),
             dict(max_new_tokens=0), dict(max_new_tokens=2**30), dict(step=-1), dict(eos_id=-7),
             dict(sampling=wire.SamplingParams(temperature=float("nan"))),
             dict(sampling=wire.SamplingParams(top_p=0.0))]
    out = [wire.encode(msgspec.structs.replace(base, **kw)) for kw in liars]
    out += [b"", b"\xc1", msgspec.msgpack.encode({"v": 2}), msgspec.msgpack.encode({"v": 1, "request_id": 5}),
            b"\x81\xa1v\x01" + b"\x91" * 100_000]
    genuine = wire.encode(base)
    while len(out) < 45:
        data = bytearray(genuine)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        data = data[: rng.randint(0, len(data))] if rng.random() < 0.3 else data
        try:
            wire.decode(wire.RolloutRequest, bytes(data))
        except wire.WireError:
            out.append(bytes(data))  # only what the door refuses: a damaged copy may still be valid
    return out


@pytest.mark.slow
async def test_a_worker_process_under_fire_serves_the_genuine_work_unchanged(nats_url, redis_url, js, tmp_path):
    rng, step, pool = random.Random(19), 1901, "fuzz"
    genuine = [wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step, policy_version=0,
                                   prompt_ids=[5, 6, 7], max_new_tokens=10 + i, seed=40 + i, group=i)
               for i in range(12)]
    hostile = hostile_requests(rng, step)
    fleet = WorkerFleet(nats_url, redis_url, tmp_path / "workers", pool,
                        worker_args=["--speed", "0", "--ack-wait", "3", "--lease-ttl", "2"],
                        env={"RLBOOST_WORKER__HEARTBEAT_S": "0.2"})
    async with open_clients(nats_url, redis_url, "test-fuzz", pools=(pool,)) as c:
        # checkpoints no script writes, under ids of well-formed requests
        corrupt = [wire.RolloutRequest(request_id=wire.request_id(step, 950 + i, 0), step=step, policy_version=0,
                                       prompt_ids=[1], max_new_tokens=4, seed=i) for i in range(3)]
        await c.store.redis.set(wire.ckpt_tokens_key(corrupt[0].request_id), b"\x00" * 13)
        await c.store.redis.hset(wire.ckpt_meta_key(corrupt[1].request_id), "epoch", "1e9x")
        await c.store.redis.set(wire.ckpt_tokens_key(corrupt[2].request_id), checkpoint.pack([-5], [0.0]))
        control = await js.key_value(wire.BUCKET_CONTROL)
        worker = fleet.start()

        def worker_log() -> str:
            return (tmp_path / "workers" / f"{worker.worker_id}.log").read_text()

        async def hostile_control() -> None:
            """Junk, deep nesting, expired, someone else's, timestamp 0: each read by the worker's
            control check (every heartbeat, 0.2 s here), none may drain it."""
            for _ in range(600):  # the worker's first control check comes after it started
                if "worker started" in worker_log():
                    break
                await asyncio.sleep(0.05)
            for malformed, entry in ((True, b"\xff"), (True, b"\x81\xa1v\x01" + b"\x91" * 50_000),
                                     (False, wire.encode(msgspec.structs.replace(
                                         wire.control("drain", worker.worker_id), deadline=1.0))),
                                     (False, wire.encode(wire.control("drain", "someone-else"))),
                                     (False, wire.encode(wire.Control(command="drain", ts=0.0)))):
                seen = worker_log().count("ignoring malformed control message")
                for key in (worker.worker_id, wire.CONTROL_ALL):
                    await control.put(key, entry)
                for _ in range(200 if malformed else 10):  # until it is read; a valid one: 2+ heartbeats
                    await asyncio.sleep(0.05)
                    if malformed and worker_log().count("ignoring malformed control message") > seen:
                        break

        controls = asyncio.create_task(hostile_control())
        subject = wire.request_subject(pool)
        lanes = [subject, wire.resume_subject(pool)]
        mixed = [(wire.encode(q), q.request_id) for q in genuine] + [(h, None) for h in hostile] \
            + [(wire.encode(q), q.request_id) for q in corrupt]
        rng.shuffle(mixed)
        for i, (data, rid) in enumerate(mixed):
            await js.publish(lanes[i % 2] if rid is None else subject, data)
        forged = [b"\x00", b"\x81\xa1v\x01" + b"\x91" * 50_000, wire.encode(wire.RolloutResult(
            request_id=genuine[0].request_id, step=step, group=0, prompt_ids=[5, 6, 7], token_ids=[1],
            logprobs=[0.0], segments=[], finish_reason="stop", worker_id=worker.worker_id, ts=0.0, epoch=1))]
        for i, data in enumerate(forged):  # the last one under the bare request id, first: main's dedup id
            await js.publish(wire.result_subject(step), data,
                             headers={wire.HDR_MSG_ID: genuine[0].request_id if data is forged[-1] else f"f{i}"})
        got = {r.request_id: r async for r in PoolClient(c, pool).results(step, genuine, timeout_s=90)}
        await controls
        await asyncio.sleep(0.5)
        for key in (worker.worker_id, wire.CONTROL_ALL):
            await control.delete(key)
        for _ in range(200):
            dlq = (await js.stream_info(wire.STREAM_DLQ, subjects_filter=">")).state.subjects or {}
            if dlq.get(wire.dlq_subject(wire.STREAM_REQUESTS), 0) >= len(hostile) + len(corrupt):
                break
            await asyncio.sleep(0.05)
        alive = worker.proc.poll() is None
        log = worker_log()
    fleet.stop_all()
    assert alive and "drain requested" not in log, log[-3000:]
    assert "ignoring malformed control message" in log
    # every hostile request dead-lettered once, on its first delivery, with a reason
    assert dlq.get(wire.dlq_subject(wire.STREAM_REQUESTS)) == len(hostile) + len(corrupt)
    assert dlq.get(wire.dlq_subject(wire.STREAM_RESULTS)) == len(forged)
    sub = await js.subscribe(wire.dlq_subject(wire.STREAM_REQUESTS), ordered_consumer=True)
    for _ in range(len(hostile) + len(corrupt)):
        reason = (await sub.next_msg(timeout=5)).headers[wire.HDR_DLQ_REASON]
        assert reason and "max deliveries" not in reason
    await sub.unsubscribe()
    # the genuine results: byte-identical to an undisturbed run
    lengths = LengthModel()
    for q in genuine:
        n = min(q.max_new_tokens, lengths.length(q.seed, q.request_id))
        tokens, logprobs = reference_tokens(q.seed, q.request_id, 0, n)
        assert checkpoint.pack(got[q.request_id].token_ids, got[q.request_id].logprobs) == checkpoint.pack(
            tokens, logprobs), q.request_id
        assert got[q.request_id].finish_reason == ("length" if n == q.max_new_tokens else "stop")
