"""The one door for wire bytes: `encode`, and `decode`, which validates what the types cannot say."""

from __future__ import annotations

import json
import math
from typing import TypeVar

import msgspec
import numpy as np

from rlboost.wire.names import SCHEMA_VERSION, WireError, SchemaVersionError, check_name, RECORD
from rlboost.wire.messages import RolloutRequest, TokenChunk, TokenFlush, MAX_TOOL_CALLS_PER_TURN, MAX_EPISODE_STATE_BYTES, EpisodeState, check_tool_key, RolloutResult, WorkerHeartbeat, Control, LeaseEvent, Message


class _Header(msgspec.Struct):
    v: int


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


T = TypeVar("T")


MAX_MESSAGE_BYTES = 16 << 20  # larger than any genuine message (NATS' own default cap is 1 MiB)
MAX_TOKEN_ID = 2**31 - 1  # engines index int32 vocabularies; the model's own bound is the engine's check
MAX_NEW_TOKENS = 1 << 20


def decode(kind: type[T], data: bytes) -> T:
    """The one door for wire bytes: decode and validate, or raise WireError / SchemaVersionError
    with a readable reason. Sizes are bounded before decoding; nesting deeper than the decoder's
    recursion limit is refused here as WireError (msgspec raises RecursionError), so no consumer
    ever sees anything but a valid message or a WireError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"malformed {kind.__name__}: not bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"malformed {kind.__name__}: {len(data)} bytes, over the {MAX_MESSAGE_BYTES} byte bound")
    try:
        header = _header_decoder.decode(data)
    except _UNDECODABLE as e:
        raise WireError(f"malformed {kind.__name__}: {_reason(e)}") from None
    if header.v != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{kind.__name__} has schema version {header.v}; this build speaks {SCHEMA_VERSION}"
        )
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        msg = decoder.decode(data)
    except _UNDECODABLE as e:
        raise WireError(f"malformed {kind.__name__}: {_reason(e)}") from None
    _validate(msg)
    return msg


# msgspec raises DecodeError/ValidationError, but also UnicodeDecodeError for a str field that
# is not UTF-8, and RecursionError past its nesting limit: all mean "not a valid message".
_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


def _reason(e: Exception) -> str:
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _validate(msg: object) -> None:
    """Field values the types cannot express: names, ranges, matching lengths."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise WireError(f"{type(msg).__name__} {getattr(msg, 'request_id', '')}: {what}".replace("  ", " "))

    if isinstance(msg, RolloutRequest):
        check_name("request id", msg.request_id)
        if not msg.prompt_ids or msg.max_new_tokens < 1:
            raise WireError(f"request {msg.request_id}: empty prompt or max_new_tokens < 1")
        need(all(0 <= t <= MAX_TOKEN_ID for t in msg.prompt_ids), f"prompt ids outside [0, {MAX_TOKEN_ID}]")
        need(msg.max_new_tokens <= MAX_NEW_TOKENS, f"max_new_tokens over {MAX_NEW_TOKENS}")
        need(min(msg.step, msg.policy_version, msg.group) >= 0, "negative step, policy version or group")
        need(-1 <= msg.eos_id <= MAX_TOKEN_ID, "eos id outside [-1, 2**31)")
        p = msg.sampling
        need(math.isfinite(p.temperature) and p.temperature >= 0 and math.isfinite(p.top_p) and 0 < p.top_p <= 1
             and p.top_k >= 0, "sampling parameters out of range")
        if (ep := msg.episode) is not None:
            need(0 < len(ep.env) <= 500 and ep.env.isprintable(), "episode env: 1-500 printable characters")
            need(1 <= ep.max_turns <= MAX_TURNS and 0 <= ep.max_turn_tokens <= MAX_NEW_TOKENS,
                 f"episode max_turns outside [1, {MAX_TURNS}] or negative max_turn_tokens")
            need(math.isfinite(ep.tool_timeout_s) and 0 < ep.tool_timeout_s <= 86400, "episode tool_timeout_s")
            need(_is_json(ep.row) and _is_json(ep.config), "episode row or config is not JSON text (or too large)")
    elif isinstance(msg, (TokenChunk, RolloutResult)):
        check_name("request id", msg.request_id)
        check_name("worker id", msg.worker_id)
        need(len(msg.token_ids) == len(msg.logprobs), "token and logprob counts differ")
        need(msg.step >= 0 and msg.epoch >= 0, "negative step or epoch")
        need(all(0 <= t <= MAX_TOKEN_ID for t in msg.token_ids), "token ids out of range")
        if isinstance(msg, RolloutResult):
            for seg in msg.segments:
                check_name("segment worker id", seg.worker_id)
            if msg.episode is not None:
                _validate(msg.episode)
    elif isinstance(msg, TokenFlush):
        check_name("worker id", msg.worker_id)
        need(msg.step >= 0, "negative step")
        for c in msg.chunks:
            check_name("request id", c.request_id)
            need(min(c.epoch, c.offset, c.policy_version) >= 0, f"{c.request_id}: negative epoch, offset or version")
            need(len(c.records) % RECORD.itemsize == 0, f"{c.request_id}: records not a multiple of {RECORD.itemsize} bytes")
            tokens = np.frombuffer(c.records, dtype=RECORD)["token"]
            need(not len(tokens) or int(tokens.min()) >= 0, f"{c.request_id}: negative token id")
    elif isinstance(msg, WorkerHeartbeat):
        check_name("worker id", msg.worker_id)
        check_name("pool", msg.pool)
    elif isinstance(msg, Control):
        if msg.target:
            check_name("control target", msg.target)
        need(len(msg.reason) <= 1000, "reason over 1000 characters")
    elif isinstance(msg, LeaseEvent):
        check_name("request id", msg.request_id)
        check_name("worker id", msg.worker_id)
    elif isinstance(msg, EpisodeState):
        need(msg.turn >= 0 and msg.at >= 0, "negative turn or offset")
        need(_is_json(msg.env_state), "env_state is not JSON text (or too large)")
        need(len(msg.pending) <= MAX_TOOL_CALLS_PER_TURN, f"over {MAX_TOOL_CALLS_PER_TURN} pending tool calls")
        need(len(msg.calls) <= MAX_TURNS * MAX_TOOL_CALLS_PER_TURN, "too many tool calls")
        need(len(msg.reason) <= 1000, "reason over 1000 characters")
        for call in msg.pending:
            check_tool_key(call.key)
            need(len(call.name) <= 200 and len(call.arguments) <= MAX_EPISODE_STATE_BYTES, "tool call too large")
        for rec in msg.calls:
            check_tool_key(rec.key)
            check_name("tool worker id", rec.worker_id)
            need(len(rec.name) <= 200, "tool record too large")
            need(rec.at >= 0 and math.isfinite(rec.latency_s) and rec.latency_s >= 0,
                 "tool record: negative offset or latency")


MAX_TURNS = 10_000


def _is_json(text: str, limit: int = MAX_EPISODE_STATE_BYTES) -> bool:
    """`text` is JSON within `limit` characters (nesting beyond Python's recursion limit is not)."""
    if len(text) > limit:
        return False
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True
