"""Encode/decode validates; bad bytes and foreign schema versions raise typed errors."""

from __future__ import annotations

import msgspec
import pytest

from rlboost import wire


def test_round_trip_of_every_message_type():
    msgs = [
        wire.RolloutRequest(request_id="s1-p2-g3", step=1, policy_version=2, prompt_ids=[1, 2], max_new_tokens=5, seed=7),
        wire.TokenChunk(request_id="a", step=1, worker_id="w", epoch=2, offset=0, token_ids=[1], logprobs=[-0.5],
                        policy_version=0, ts=1.0),
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
    with pytest.raises(wire.SchemaVersionError, match="schema version 2"):
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
