"""Encode/decode validates; bad bytes and foreign schema versions raise typed errors."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from rlboost import wire


def _records(tokens: list[int], logprobs: list[float]) -> bytes:
    rec = np.empty(len(tokens), dtype=wire.RECORD)
    rec["token"], rec["logprob"] = tokens, logprobs
    return rec.tobytes()


def test_round_trip_of_every_message_type():
    msgs = [
        wire.RolloutRequest(request_id="s1-p2-g3", step=1, policy_version=2, prompt_ids=[1, 2], max_new_tokens=5, seed=7),
        wire.TokenChunk(request_id="a", step=1, worker_id="w", epoch=2, offset=0, token_ids=[1], logprobs=[-0.5],
                        policy_version=0, ts=1.0),
        wire.TokenFlush(step=1, worker_id="w", ts=1.0, chunks=[wire.FlushChunk("a", 2, 0, 0, _records([1], [-0.5]))]),
        wire.RolloutResult(request_id="a", step=1, group=0, prompt_ids=[1], token_ids=[2], logprobs=[-1.0],
                           segments=[wire.Segment(0, "w", 1, 0)], finish_reason="stop", worker_id="w", ts=2.0),
        wire.WorkerHeartbeat(worker_id="w", pool="p", engine="emulated", pid=1, host="h", state="running",
                             policy_version=0, inflight=0, slots=4, tokens_generated=0, ts=0.0),
        wire.Control(command="drain", reason="spot notice"),
        wire.LeaseEvent(request_id="a", step=1, worker_id="w", epoch=1, kind="claim", offset=0, ts=0.0),
    ]
    for m in msgs:
        assert wire.decode(type(m), wire.encode(m)) == m


@pytest.mark.parametrize("data", [b"", b"\xc1", b"garbage", msgspec.msgpack.encode([1, 2, 3])])
def test_malformed_bytes_raise_wire_error(data):
    with pytest.raises(wire.WireError):
        wire.decode(wire.RolloutRequest, data)


def test_unknown_schema_version_is_its_own_error():
    data = msgspec.msgpack.encode({"v": wire.SCHEMA_VERSION + 1, "anything": "new"})
    with pytest.raises(wire.SchemaVersionError, match=f"schema version {wire.SCHEMA_VERSION + 1}"):
        wire.decode(wire.RolloutRequest, data)


def test_wrong_field_types_are_refused():
    data = msgspec.msgpack.encode({"v": wire.SCHEMA_VERSION, "request_id": "a", "step": "one", "policy_version": 0,
                                   "prompt_ids": [1], "max_new_tokens": 3, "seed": 0})
    with pytest.raises(wire.WireError, match="step"):
        wire.decode(wire.RolloutRequest, data)


@pytest.mark.parametrize("rid", ["a.b", "a*", "", "x" * 129, "a b", "a>"])
def test_request_ids_that_would_break_subjects_are_refused(rid):
    req = wire.RolloutRequest(request_id=rid, step=1, policy_version=0, prompt_ids=[1], max_new_tokens=1, seed=0)
    with pytest.raises(wire.WireError, match="invalid request id"):
        wire.decode(wire.RolloutRequest, wire.encode(req))


def test_request_ids_are_subject_safe_and_sort_by_step_prompt_sample():
    ids = [wire.request_id(s, p, g) for s in (1, 10) for p in (2, 11) for g in (0, 3)]
    assert ids == sorted(ids)
    for i in ids:
        wire.check_name("request id", i)


def test_checkpoint_keys_of_one_request_share_a_cluster_slot():
    keys = [f("abc") for f in (wire.ckpt_tokens_key, wire.ckpt_meta_key, wire.ckpt_lease_key, wire.ckpt_history_key)]
    assert all("{abc}" in k for k in keys) and len(set(keys)) == 4
    assert wire.ckpt_append_keys("abc") == tuple(
        f("abc").encode() for f in (wire.ckpt_meta_key, wire.ckpt_lease_key, wire.ckpt_tokens_key))


def test_a_token_flush_carries_the_chunks_of_every_request_of_a_flush():
    flush = wire.TokenFlush(step=4, worker_id="w1", ts=2.5, chunks=[
        wire.FlushChunk("s4-a", 7, 16, 1, _records([3, 4], [-0.5, -0.25])),
        wire.FlushChunk("s4-b", 9, 0, 1, _records([5], [-1.0]))])
    got = wire.decode(wire.TokenFlush, wire.encode(flush)).token_chunks()
    assert got == [
        wire.TokenChunk(request_id="s4-a", step=4, worker_id="w1", epoch=7, offset=16, token_ids=[3, 4],
                        logprobs=[-0.5, -0.25], policy_version=1, ts=2.5),
        wire.TokenChunk(request_id="s4-b", step=4, worker_id="w1", epoch=9, offset=0, token_ids=[5], logprobs=[-1.0],
                        policy_version=1, ts=2.5)]
    assert wire.flush_msg_id(flush.chunks[0]) != wire.flush_msg_id(flush.chunks[1])
    assert wire.stream_of(wire.token_subject(4, "w1")) == wire.STREAM_TOKENS
    assert wire.token_subject(4, "w1").startswith(wire.token_steps_subject(4)[:-1])


@pytest.mark.parametrize("chunk, reason", [
    (wire.FlushChunk("a.b", 1, 0, 0, b""), "invalid request id"),
    (wire.FlushChunk("a", 1, 0, 0, b"\x00" * 7), "not a multiple of 8"),
    (wire.FlushChunk("a", 1, 0, 0, _records([-3], [0.0])), "negative token id"),
    (wire.FlushChunk("a", -1, 0, 0, b""), "negative epoch"),
])
def test_a_token_flush_is_validated_chunk_by_chunk(chunk, reason):
    data = wire.encode(wire.TokenFlush(step=1, worker_id="w", ts=0.0, chunks=[chunk]))
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(wire.TokenFlush, data)


def test_a_peer_of_schema_2_is_refused_clearly():
    """Schema 3 changed how token chunks travel (one TokenFlush per flush): a schema-2 peer's
    per-request TokenChunk, or any of its messages, is refused with both versions named."""
    old_chunk = msgspec.msgpack.encode({"v": 2, "request_id": "a", "step": 1, "worker_id": "w", "epoch": 1,
                                        "offset": 0, "token_ids": [1], "logprobs": [0.0], "policy_version": 0,
                                        "ts": 0.0})
    for kind in (wire.TokenFlush, wire.TokenChunk):
        with pytest.raises(wire.SchemaVersionError, match="schema version 2; this build speaks 3"):
            wire.decode(kind, old_chunk)
    old_request = msgspec.msgpack.encode({"v": 2, "request_id": "a", "step": 1, "policy_version": 0,
                                          "prompt_ids": [1], "max_new_tokens": 3, "seed": 0})
    with pytest.raises(wire.SchemaVersionError, match="RolloutRequest has schema version 2; this build speaks 3"):
        wire.decode(wire.RolloutRequest, old_request)


def test_a_large_flush_is_split_under_the_message_budget():
    chunks = [wire.FlushChunk(f"r{i}", 1, 0, 0, _records([i] * 64, [0.0] * 64)) for i in range(10)]  # 512 B each
    parts = wire.split_flush(chunks, budget=1500)
    assert [len(p) for p in parts] == [2, 2, 2, 2, 2] and [c for p in parts for c in p] == chunks
    assert wire.split_flush(chunks) == [chunks] and wire.split_flush([]) == []
    assert wire.split_flush(chunks[:1], budget=10) == [chunks[:1]]  # one chunk alone is never split
