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


@pytest.mark.parametrize("old", [2, 3])
def test_a_peer_of_an_older_schema_is_refused_clearly(old):
    """Schema 3 changed how token chunks travel (one TokenFlush per flush), schema 4 added
    episodes (typed segments, the episode state): an older peer's messages, byte-for-byte what
    it sends, are refused with both versions named, never misread."""
    old_chunk = msgspec.msgpack.encode({"v": old, "request_id": "a", "step": 1, "worker_id": "w", "epoch": 1,
                                        "offset": 0, "token_ids": [1], "logprobs": [0.0], "policy_version": 0,
                                        "ts": 0.0})
    for kind in (wire.TokenFlush, wire.TokenChunk):
        with pytest.raises(wire.SchemaVersionError, match=f"schema version {old}; this build speaks 4"):
            wire.decode(kind, old_chunk)
    old_request = msgspec.msgpack.encode({"v": old, "request_id": "a", "step": 1, "policy_version": 0,
                                          "prompt_ids": [1], "max_new_tokens": 3, "seed": 0})
    with pytest.raises(wire.SchemaVersionError, match=f"RolloutRequest has schema version {old}; this build speaks 4"):
        wire.decode(wire.RolloutRequest, old_request)
    old_result = msgspec.msgpack.encode({"v": old, "request_id": "a", "step": 1, "group": 0, "prompt_ids": [1],
                                         "token_ids": [2], "logprobs": [0.0], "segments": [[0, "w", 1, 0, ""]],
                                         "finish_reason": "stop", "worker_id": "w", "ts": 0.0})
    with pytest.raises(wire.SchemaVersionError, match=f"RolloutResult has schema version {old}"):
        wire.decode(wire.RolloutResult, old_result)


def _episode_request(**spec) -> wire.RolloutRequest:
    return wire.RolloutRequest(request_id="s1-p0-g0", step=1, policy_version=0, prompt_ids=[1, 2], max_new_tokens=64,
                               seed=3, episode=wire.EpisodeSpec(env="calculator", **spec))


def test_an_episode_request_and_state_round_trip():
    req = _episode_request(row='{"question": "2+3", "answer": 5}', max_turns=4, max_turn_tokens=16)
    assert wire.decode(wire.RolloutRequest, wire.encode(req)) == req
    key = wire.tool_call_key(req.request_id, 2, 0)
    assert key == "s1-p0-g0/2/0" and wire.check_tool_key(key)
    state = wire.EpisodeState(turn=2, at=40, env_state='{"stack": [1, 2]}',
                              pending=[wire.ToolCall(key=key, name="calc", arguments='{"expr": "2+3"}')],
                              calls=[wire.ToolRecord(key=wire.tool_call_key(req.request_id, 1, 0), name="calc",
                                                     worker_id="w", latency_s=0.01, at=20)])
    assert wire.decode(wire.EpisodeState, wire.encode(state)) == state
    res = wire.RolloutResult(request_id="a", step=1, group=0, prompt_ids=[1], token_ids=[2, 3, 4], logprobs=[-1.0, 0, 0],
                             segments=[wire.Segment(0, "w", 1, 0), wire.Segment(1, "w", 1, 0, "", "env")],
                             finish_reason="stop", worker_id="w", ts=2.0, episode=state)
    assert wire.decode(wire.RolloutResult, wire.encode(res)) == res
    flush = wire.TokenFlush(step=1, worker_id="w", ts=1.0, chunks=[
        wire.FlushChunk("a", 2, 0, 0, _records([1], [-0.5])), wire.FlushChunk("a", 2, 1, 0, _records([7], [0]), True)])
    assert [c.kind for c in wire.decode(wire.TokenFlush, wire.encode(flush)).token_chunks()] == ["model", "env"]


def test_a_single_turn_request_is_encoded_as_before_but_for_its_version():
    """Single-turn requests are unchanged: a schema-4 request without an episode is the schema-3
    message plus `episode: nil` (no other field moved), and a segment without a kind is a model one."""
    req = wire.RolloutRequest(request_id="s1-p2-g3", step=1, policy_version=2, prompt_ids=[1, 2], max_new_tokens=5,
                              seed=7)
    fields = msgspec.msgpack.decode(wire.encode(req))
    assert fields.pop("episode") is None and fields["v"] == 4
    assert fields.pop("upgradable") is False  # async's in-flight update (an older worker ignores it)
    assert list(fields) == ["v", "request_id", "step", "policy_version", "prompt_ids", "max_new_tokens", "seed",
                            "sampling", "eos_id", "stop_ids", "group"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode([0, "w", 1, 0]), type=wire.Segment).kind == "model"


@pytest.mark.parametrize("spec, reason", [
    (dict(env=""), "episode env"),
    (dict(env="bad\nname"), "episode env"),
    (dict(env="calculator", max_turns=0), "max_turns"),
    (dict(env="calculator", max_turn_tokens=-1), "max_turn_tokens"),
    (dict(env="calculator", tool_timeout_s=float("inf")), "tool_timeout_s"),
    (dict(env="calculator", row="{not json"), "not JSON"),
    (dict(env="calculator", config="[" * 100_000), "not JSON"),
])
def test_a_malformed_episode_request_is_refused(spec, reason):
    req = wire.RolloutRequest(request_id="a", step=1, policy_version=0, prompt_ids=[1], max_new_tokens=5, seed=0,
                              episode=wire.EpisodeSpec(**spec))
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(wire.RolloutRequest, wire.encode(req))


@pytest.mark.parametrize("state, reason", [
    (wire.EpisodeState(turn=-1), "negative turn"),
    (wire.EpisodeState(env_state="{x"), "env_state"),
    (wire.EpisodeState(env_state="1" * (wire.MAX_EPISODE_STATE_BYTES + 1)), "env_state"),
    (wire.EpisodeState(pending=[wire.ToolCall(key="a.b/1/0", name="c")]), "tool call key"),
    (wire.EpisodeState(pending=[wire.ToolCall(key="a/1", name="c")]), "tool call key"),
    (wire.EpisodeState(pending=[wire.ToolCall(key=f"k/0/{i}", name="c") for i in range(65)]), "pending"),
    (wire.EpisodeState(calls=[wire.ToolRecord(key="k/0/0", name="c", worker_id="w", latency_s=float("nan"),
                                              at=0)]), "latency"),
])
def test_a_malformed_episode_state_is_refused(state, reason):
    with pytest.raises(wire.WireError, match=reason):
        wire.decode(wire.EpisodeState, wire.encode(state))


def test_the_mask_trains_model_tokens_only():
    """Environment tokens are part of the context, never of the loss; a response without
    segments (or before its first) is model tokens; order on the wire is not trusted."""
    model, env = (lambda off, v=0: wire.Segment(off, "w", 1, v)), (lambda off, v=0: wire.Segment(off, "w", 1, v, "", "env"))
    segs = [model(0), env(3), model(5), env(8), model(8), env(9)]
    assert wire.trainable_mask(segs, 11) == [True] * 3 + [False] * 2 + [True] * 3 + [True] + [False] * 2
    assert wire.trainable_mask(list(reversed(segs[:3])), 6) == [True] * 3 + [False] * 2 + [True]
    assert wire.trainable_mask([], 3) == [True] * 3
    assert wire.trainable_mask([env(0)], 2) == [False, False] and wire.trainable_mask(segs, 0) == []
    # environment tokens carry the version the episode ran when they were appended (the store
    # copies the lease's segment): version checks and staleness bounds read them like any token
    assert wire.token_versions([model(0, 1), env(2, 1), model(3, 2)], 4) == [1, 1, 1, 2]


def test_a_large_flush_is_split_under_the_message_budget():
    chunks = [wire.FlushChunk(f"r{i}", 1, 0, 0, _records([i] * 64, [0.0] * 64)) for i in range(10)]  # 512 B each
    parts = wire.split_flush(chunks, budget=1500)
    assert [len(p) for p in parts] == [2, 2, 2, 2, 2] and [c for p in parts for c in p] == chunks
    assert wire.split_flush(chunks) == [chunks] and wire.split_flush([]) == []
    assert wire.split_flush(chunks[:1], budget=10) == [chunks[:1]]  # one chunk alone is never split
