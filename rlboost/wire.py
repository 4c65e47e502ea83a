"""The wire contract: every subject, stream, consumer, KV bucket, message type and Redis key.

Everything that crosses a process boundary is defined here and nowhere else, so a reader can
learn the whole protocol from this one file. Messages are msgspec structs encoded as MessagePack;
each carries the schema version `v`, checked before the body is decoded, so a peer speaking
another version is refused with a clear reason instead of being misread.
"""

from __future__ import annotations

import re
import uuid
from typing import Literal, TypeVar

import msgspec

SCHEMA_VERSION = 1

# ---------------------------------------------------------------- streams and subjects

STREAM_REQUESTS = "RB_REQUESTS"  # work queue: one message per (prompt, sample) request
STREAM_TOKENS = "RB_TOKENS"  # limits: token chunks as generated, for live collection and replay
STREAM_RESULTS = "RB_RESULTS"  # limits: one message per finished response, dedup by request id
STREAM_EVENTS = "RB_EVENTS"  # limits: lease/hand-off events, so replay can tell a request's life
STREAM_DLQ = "RB_DLQ"  # limits: dead letters with the reason in a header

BUCKET_WORKERS = "rb-workers"  # worker registry, heartbeat values with a TTL
BUCKET_POLICY = "rb-policy"  # latest policy version pointer
BUCKET_CONTROL = "rb-control"  # per-worker control (drain / abort)


def request_subject(pool: str) -> str:
    return f"rb.req.{pool}"


def token_subject(step: int, request_id: str) -> str:
    return f"rb.tok.{step}.{request_id}"


def result_subject(step: int) -> str:
    return f"rb.res.{step}"


def event_subject(step: int, request_id: str) -> str:
    return f"rb.evt.{step}.{request_id}"


def dlq_subject(source_stream: str) -> str:
    return f"rb.dlq.{source_stream}"


def resume_subject(pool: str) -> str:
    """The priority lane: requests handed off with tokens already generated (a drained worker,
    the reserved cluster at the end of its seeding window). Workers keep spare slots for it, so
    a hand-off resumes at once instead of queueing behind fresh prompts."""
    return f"rb.req.{pool}.resume"


def consumer_name(pool: str) -> str:
    """All workers of a pool share this durable pull consumer: pull is the load balancer."""
    return f"rb-workers-{pool}"


def resume_consumer_name(pool: str) -> str:
    return f"rb-resume-{pool}"


def handoff_msg_id(request_id: str, epoch: int) -> str:
    """One hand-off message per lease epoch: a retried publish is dropped as a duplicate."""
    return f"{request_id}-h{epoch}"


HDR_MSG_ID = "Nats-Msg-Id"
HDR_DLQ_REASON = "Rb-Dlq-Reason"
HDR_DLQ_SUBJECT = "Rb-Dlq-Subject"
HDR_DLQ_SEQ = "Rb-Dlq-Seq"

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_name(kind: str, value: str) -> str:
    """Ids become subject tokens and Redis keys: refuse dots, wildcards, spaces."""
    if not _NAME.match(value):
        raise WireError(f"invalid {kind} {value!r}: use 1-128 of [A-Za-z0-9_-]")
    return value


def request_id(step: int, prompt: int, sample: int, run: str = "") -> str:
    """`[<run>-]s<step>-p<prompt>-g<sample>`: sorts by step, prompt, sample. The run prefix keeps
    a new run on the same servers from mistaking an old run's checkpoints or results for its own."""
    rid = f"s{step:05d}-p{prompt:05d}-g{sample:03d}"
    return f"{check_name('run id', run)}-{rid}" if run else rid


def new_run_id() -> str:
    return "r" + uuid.uuid4().hex[:8]


# ---------------------------------------------------------------- weights (rlboost/weights.py)
# Policy weights: content-addressed safetensors shards + one manifest per version in a blob
# store (JetStream Object Store bucket by default, or a directory); the latest published
# version is an ASCII integer under WEIGHTS_POINTER_KEY in BUCKET_POLICY, which workers watch.

BUCKET_WEIGHTS = "rb-weights"  # JetStream Object Store bucket (stream OBJ_rb-weights)
WEIGHTS_POINTER_KEY = "weights-latest"  # key in BUCKET_POLICY: latest published version


def weights_shard_key(sha256_hex: str) -> str:
    """A shard is named by the SHA-256 of its bytes: equal content, equal name, stored once."""
    return f"shards/{sha256_hex}.safetensors"


def weights_manifest_key(version: int) -> str:
    """Zero-padded so a lexicographic listing is in version order."""
    return f"manifests/v{version:012d}.json"


# ---------------------------------------------------------------- stream configurations


class StreamSpec(msgspec.Struct, frozen=True):
    name: str
    subjects: tuple[str, ...]
    retention: Literal["limits", "workqueue"]
    max_age_s: float = 0.0  # 0 = forever
    duplicate_window_s: float = 120.0


STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(STREAM_REQUESTS, ("rb.req.>",), "workqueue", duplicate_window_s=600.0),
    StreamSpec(STREAM_TOKENS, ("rb.tok.>",), "limits", max_age_s=7 * 86400.0),
    StreamSpec(STREAM_RESULTS, ("rb.res.>",), "limits", duplicate_window_s=3600.0),
    StreamSpec(STREAM_EVENTS, ("rb.evt.>",), "limits", max_age_s=7 * 86400.0),
    StreamSpec(STREAM_DLQ, ("rb.dlq.>",), "limits", max_age_s=30 * 86400.0),
)


class ConsumerSpec(msgspec.Struct, frozen=True):
    """The pool's work-queue consumer. `ack_wait` is how long a silent (killed) worker keeps a
    request; live workers extend it with `in_progress()` heartbeats. After `max_deliver` the
    message is a poison message and is dead-lettered."""

    ack_wait_s: float = 10.0
    max_deliver: int = 20
    max_ack_pending: int = 100_000


# ---------------------------------------------------------------- Redis key layout
# Keys of one request share the hash tag {rid} so a Redis Cluster keeps them on one slot
# and the Lua scripts stay atomic.


def ckpt_tokens_key(rid: str) -> str:
    """Packed records of (int32 token id, float32 behaviour logprob), appended in order."""
    return f"rb:{{{rid}}}:tok"


def ckpt_meta_key(rid: str) -> str:
    """Hash: epoch (fencing token), owner, finished."""
    return f"rb:{{{rid}}}:meta"


def ckpt_lease_key(rid: str) -> str:
    """String `owner epoch`, with the lease TTL: its expiry is what lets another worker claim."""
    return f"rb:{{{rid}}}:lease"


def ckpt_history_key(rid: str) -> str:
    """List of segments `owner epoch offset policy_version`: who generated which tokens."""
    return f"rb:{{{rid}}}:hist"


# ---------------------------------------------------------------- messages


class WireError(ValueError):
    """Bytes that are not a valid message of the expected type."""


class SchemaVersionError(WireError):
    """A well-formed message of a schema version this build does not speak."""


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off


class RolloutRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One (prompt, sample) to generate. `seed` keys sampling with the request id and the token
    position, so whichever worker resumes the request produces the same tokens."""

    v: int = SCHEMA_VERSION
    request_id: str
    step: int
    policy_version: int
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    sampling: SamplingParams = SamplingParams()
    eos_id: int = -1  # -1 = no stop token
    group: int = 0  # prompt index within the step: GRPO groups by it


class TokenChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens [offset, offset+len) of a response, published after they are checkpointed."""

    v: int = SCHEMA_VERSION
    request_id: str
    step: int
    worker_id: str
    epoch: int
    offset: int
    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    ts: float


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """Tokens from `offset` on were generated by `worker_id` (lease `epoch`) with `policy_version`."""

    offset: int
    worker_id: str
    epoch: int
    policy_version: int


class RolloutResult(msgspec.Struct, frozen=True, kw_only=True):
    v: int = SCHEMA_VERSION
    request_id: str
    step: int
    group: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    segments: list[Segment]
    finish_reason: Literal["stop", "length"]
    worker_id: str
    ts: float


class WorkerHeartbeat(msgspec.Struct, frozen=True, kw_only=True):
    v: int = SCHEMA_VERSION
    worker_id: str
    pool: str
    engine: str
    pid: int
    host: str
    state: Literal["starting", "running", "draining", "stopped"]
    policy_version: int
    inflight: int
    slots: int
    tokens_generated: int
    ts: float


class Control(msgspec.Struct, frozen=True, kw_only=True):
    """Put in the control bucket under the worker id (or `all`)."""

    v: int = SCHEMA_VERSION
    command: Literal["drain", "abort"]
    reason: str = ""
    ts: float = 0.0


class LeaseEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A change of hands of a request: published (by the manager), claimed, released on drain,
    lost to fencing, finished, dead-lettered."""

    v: int = SCHEMA_VERSION
    request_id: str
    step: int
    worker_id: str
    epoch: int
    kind: Literal["publish", "claim", "release", "fenced", "finish", "deadletter"]
    offset: int
    ts: float
    detail: str = ""


Message = RolloutRequest | TokenChunk | RolloutResult | WorkerHeartbeat | Control | LeaseEvent


class _Header(msgspec.Struct):
    v: int


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(_Header)
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


T = TypeVar("T")


def decode(kind: type[T], data: bytes) -> T:
    """Decode and validate, or raise WireError / SchemaVersionError with a readable reason."""
    try:
        header = _header_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"malformed {kind.__name__}: {e}") from None
    if header.v != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{kind.__name__} has schema version {header.v}; this build speaks {SCHEMA_VERSION}"
        )
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        msg = decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError(f"malformed {kind.__name__}: {e}") from None
    if isinstance(msg, RolloutRequest):
        check_name("request id", msg.request_id)
        if not msg.prompt_ids or msg.max_new_tokens < 1:
            raise WireError(f"request {msg.request_id}: empty prompt or max_new_tokens < 1")
    return msg
