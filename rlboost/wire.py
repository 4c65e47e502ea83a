"""The wire contract: every subject, stream, consumer, KV bucket, message type and Redis key.

Everything that crosses a process boundary is defined here and nowhere else, so a reader can
learn the whole protocol from this one file. Messages are msgspec structs encoded as MessagePack;
each carries the schema version `v`, checked before the body is decoded, so a peer speaking
another version is refused with a clear reason instead of being misread.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import uuid
from typing import Literal, TypeVar

import msgspec
import numpy as np

from rlboost.errors import RlboostError

# 2: a request carries every stop id (`stop_ids`); a result can say `error` (a request the
# engine cannot serve) with the reason.
# 3: token chunks travel as one `TokenFlush` per worker flush (and step) on
# `rb.tok.<step>.<worker>`, their tokens packed as in the checkpoint (`RECORD`); a `TokenChunk`
# is the per-request view of one (`TokenFlush.token_chunks`), no longer a message of its own.
# 4: a request may be an episode (`RolloutRequest.episode`, issue 25): its checkpoint is one token
# stream of typed segments (`Segment.kind`: model tokens, or environment tokens that are never
# trained, `trainable_mask`), plus the episode's state (`EpisodeState` under `ckpt_episode_key`),
# both written only under the lease (fenced like appends). Token chunks and results say which
# tokens came from the environment; a result of an episode carries its final state.
SCHEMA_VERSION = 4

# ---------------------------------------------------------------- streams and subjects

STREAM_REQUESTS = "RB_REQUESTS"  # work queue: one message per (prompt, sample) request
STREAM_TOKENS = "RB_TOKENS"  # limits: token chunks as generated, for live collection and replay
STREAM_RESULTS = "RB_RESULTS"  # limits: one message per finished response, dedup by request id
STREAM_EVENTS = "RB_EVENTS"  # limits: lease/hand-off events, so replay can tell a request's life
STREAM_DLQ = "RB_DLQ"  # limits: dead letters with the reason in a header

BUCKET_WORKERS = "rb-workers"  # worker registry, heartbeat values with a TTL
BUCKET_POLICY = "rb-policy"  # latest policy version pointer
BUCKET_CONTROL = "rb-control"  # per-worker control (drain / abort)
BUCKET_RUN = "rb-run"  # the run lease: one `rlboost run` per set of servers (rlboost/runlease.py)
RUN_LEASE_KEY = "lease"  # its one key; the bucket's max age is the lease's TTL


def request_subject(pool: str) -> str:
    return f"rb.req.{pool}"


def token_subject(step: int, worker_id: str) -> str:
    """A worker's token flushes of one step. Readers filter by step (`rb.tok.<step>.>`) and find
    a request's chunks inside the flushes (`TokenFlush.token_chunks`)."""
    return f"rb.tok.{step}.{worker_id}"


def token_steps_subject(step: int) -> str:
    """Every token flush of a step: what live collection and replay read."""
    return f"rb.tok.{step}.>"


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


def env_subject(pool: str) -> str:
    """The environment lane (`env.inline = false`): an episode whose model turn ended in tool
    calls, fenced and released by its generation worker, for an environment worker
    (`rlboost env-worker`) to run the calls; it then goes back to `resume_subject(pool)`."""
    return f"rb.req.{pool}.env"


ENV_FILTER = "rb.req.*.env"  # every pool's environment lane: one consumer serves them all
ENV_CONSUMER = "rb-env"


def env_lane_pool(subject: str) -> str:
    """The pool of an environment-lane subject (where the episode goes back to), validated."""
    parts = subject.split(".")
    if len(parts) != 4 or parts[:2] != ["rb", "req"] or parts[3] != "env":
        raise WireError(f"{subject!r} is not an environment-lane subject ({ENV_FILTER})")
    return check_name("pool", parts[2])


def consumer_name(pool: str) -> str:
    """All workers of a pool share this durable pull consumer: pull is the load balancer."""
    return f"rb-workers-{pool}"


def resume_consumer_name(pool: str) -> str:
    return f"rb-resume-{pool}"


def is_handoff_subject(subject: str) -> bool:
    """A message of a resume or environment lane: a hand-off, which any worker credential may
    publish (only the trainer publishes on the fresh lane), so its request is checked against
    the spec its fresh claim recorded (`spec_digest`)."""
    return subject.startswith("rb.req.") and subject.endswith((".resume", ".env"))


def handoff_msg_id(request_id: str, epoch: int) -> str:
    """One hand-off message per lease epoch: a retried publish is dropped as a duplicate."""
    return f"{request_id}-h{epoch}"


def env_handoff_msg_id(request_id: str, epoch: int) -> str:
    """One environment-lane message per generation lease epoch."""
    return f"{request_id}-e{epoch}"


def env_return_msg_id(request_id: str, turn: int, done: bool) -> str:
    """An episode back from its tools: one message per tool phase (`turn`: model turns recorded
    when it ended), whoever sends it: an environment worker that died after sending and before
    acking is replaced by one that sends the same id, which the stream drops."""
    return f"{request_id}-t{turn}{'d' if done else ''}"


HDR_MSG_ID = "Nats-Msg-Id"
HDR_DLQ_REASON = "Rb-Dlq-Reason"
HDR_DLQ_SUBJECT = "Rb-Dlq-Subject"
HDR_DLQ_SEQ = "Rb-Dlq-Seq"

_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


def check_name(kind: str, value: str) -> str:
    """Ids become subject tokens and Redis keys: refuse dots, wildcards, spaces, newlines.
    `fullmatch`, not `match` with `$`: `$` also matches before a final newline."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise WireError(f"invalid {kind} {value!r}: use 1-128 of [A-Za-z0-9_-]")
    return value


_WEIGHTS_ID = re.compile(r"^[A-Za-z0-9_.:-]{0,80}$")


def check_weights_id(value: str) -> str:
    """A weights id is stored space-separated in the checkpoint history: no spaces."""
    if not _WEIGHTS_ID.match(value):
        raise WireError(f"invalid weights id {value!r}: use 0-80 of [A-Za-z0-9_.:-]")
    return value


def flush_msg_id(first: "FlushChunk") -> str:
    """A flush's de-duplication id, named by its first chunk: a chunk (request, lease epoch,
    offset) is accepted by the fenced store once, so no other flush starts with it, and a
    publish retried after a lost ack carries the same id and is stored once."""
    return f"{first.request_id}-c{first.epoch}-{first.offset}-f"


def event_msg_id(request_id: str, kind: str, epoch: int, offset: int) -> str:
    return f"{request_id}-{kind}{epoch}-{offset}"


def request_id(step: int, prompt: int, sample: int, run: str = "") -> str:
    """`[<run>-]s<step>-p<prompt>-g<sample>`: sorts by step, prompt, sample. The run prefix keeps
    a new run on the same servers from mistaking an old run's checkpoints or results for its own
    (a resumed run's life that cannot take its previous life's requests adds its tag: `<run>-l<life>`)."""
    rid = f"s{step:05d}-p{prompt:05d}-g{sample:03d}"
    return f"{check_name('run id', run)}-{rid}" if run else rid


def new_run_id() -> str:
    return "r" + uuid.uuid4().hex[:8]


# ---------------------------------------------------------------- weights (rlboost/weights/)
# Policy weights: content-addressed safetensors shards or delta blobs + one manifest per version in a blob
# store (JetStream Object Store bucket by default, a directory, or an S3 bucket); the latest published
# version is an ASCII integer under WEIGHTS_POINTER_KEY in BUCKET_POLICY, which workers watch.

BUCKET_WEIGHTS = "rb-weights"  # JetStream Object Store bucket (stream OBJ_rb-weights)
WEIGHTS_POINTER_KEY = "weights-latest"  # key in BUCKET_POLICY: latest published version


def weights_shard_key(sha256_hex: str) -> str:
    """A shard is named by the SHA-256 of its bytes: equal content, equal name, stored once."""
    return f"shards/{sha256_hex}.safetensors"


def weights_delta_key(sha256_hex: str) -> str:
    """A delta blob (zstd-compressed changes of many tensors), named by the SHA-256 of its bytes."""
    return f"deltas/{sha256_hex}.zst"


def weights_manifest_key(version: int) -> str:
    """Zero-padded so a lexicographic listing is in version order."""
    return f"manifests/v{version:012d}.json"


def weights_snapshot_delta_key(version: int) -> str:
    """A delta-only version's change from the last snapshot, beside its manifest (not in it:
    `rlboost.weights.manifest.SnapshotDelta` says why)."""
    return f"snapdeltas/v{version:012d}.json"


# Peers (rlboost/weights/peers.py): workers serve each other the blobs they hold verified; who
# holds which blob, and who is fetching it from the store, is one KV entry per blob.
BUCKET_PEERS = "rb-peers"


def peer_blob_key(sha256_hex: str) -> str:
    """The blob's entry in BUCKET_PEERS (holders and the origin claim: `peers.BlobHolders`)."""
    return f"blob.{sha256_hex}"


def peer_version_key(manifest_digest: str) -> str:
    """A version's entry in BUCKET_PEERS: the workers that serve it whole (`peers.BlobHolders`,
    no claim), by its manifest's digest."""
    return f"version.{manifest_digest}"


_S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_BLOB_PATH = re.compile(r"[A-Za-z0-9._/-]+")


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` (a weight store, `[weights] store`) -> ("bucket", "some/prefix").
    ValueError if it is not one; credentials and options never ride in the URL."""
    if not url.startswith("s3://"):
        raise ValueError(f"{url!r} is not an s3:// URL (s3://bucket/prefix)")
    if any(c in url for c in "@?#"):
        raise ValueError(f"{url!r}: no credentials or options in the URL (they come from the environment)")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not _S3_BUCKET.fullmatch(bucket):
        raise ValueError(f"{url!r}: {bucket!r} is not a valid bucket name (3-63 of a-z 0-9 . -)")
    if prefix and (not _BLOB_PATH.fullmatch(prefix) or any(p in ("", ".", "..") for p in prefix.split("/"))):
        raise ValueError(f"{url!r}: the prefix must be /-separated segments of [A-Za-z0-9._-]")
    return bucket, prefix


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


def stream_of(subject: str) -> str:
    """The stream that holds `subject` (known statically, so readers need not ask the server)."""
    for spec in STREAMS:
        if any(subject.startswith(pat[:-1]) for pat in spec.subjects):
            return spec.name
    raise ValueError(f"no rlboost stream holds subject {subject!r}")


class ConsumerSpec(msgspec.Struct, frozen=True):
    """The pool's work-queue consumer. `ack_wait` is how long a silent (killed) worker keeps a
    request; live workers extend it with `in_progress()` heartbeats. After `max_deliver` the
    message is a poison message and is dead-lettered."""

    ack_wait_s: float = 10.0
    max_deliver: int = 20
    max_ack_pending: int = 100_000


# ---------------------------------------------------------------- Redis key layout
# Keys of one request share the hash tag {rid} so a Redis Cluster keeps them on one slot
# and the Lua scripts stay atomic. (A worker's flush spans many requests, hence many slots: on
# a cluster rlboost/checkpoint.py groups it by slot; see CheckpointStore._groups.)

# One token of a checkpoint and of a token flush: (int32 token id, float32 behaviour logprob),
# little-endian, 8 bytes. The checkpoint is these records appended in order.
RECORD = np.dtype([("token", "<i4"), ("logprob", "<f4")])


def ckpt_tokens_key(rid: str) -> str:
    """Packed records of (int32 token id, float32 behaviour logprob), appended in order."""
    return f"rb:{{{rid}}}:tok"


def ckpt_meta_key(rid: str) -> str:
    """Hash: epoch (fencing token), owner, finished, released (the epoch let go last), key (the
    SHA-1 hex digest of the lease holder's secret: a write under the lease must bring the secret,
    rlboost/checkpoint.py)."""
    return f"rb:{{{rid}}}:meta"


def ckpt_lease_key(rid: str) -> str:
    """String `owner epoch`, with the lease TTL: its expiry is what lets another worker claim. A
    release or a finish ends it with a 1 ms TTL (`- epoch`)."""
    return f"rb:{{{rid}}}:lease"


def ckpt_append_keys(rid: str) -> tuple[bytes, bytes, bytes]:
    """(meta, lease, tokens) keys of a request, encoded: what a flush's fenced append names,
    per request (bytes, built once: the hot path of a worker)."""
    t = rid.encode()
    return b"rb:{%b}:meta" % t, b"rb:{%b}:lease" % t, b"rb:{%b}:tok" % t


def ckpt_history_key(rid: str) -> str:
    """List of segments `owner epoch offset policy_version weights [env]`: who generated which
    tokens (a line ending in `env`: environment tokens appended under that lease)."""
    return f"rb:{{{rid}}}:hist"


def ckpt_episode_key(rid: str) -> str:
    """An episode's state (`EpisodeState`, encoded): turn, the environment's JSON state, pending
    tool calls. Written only by the lease holder, with the tokens it describes (fenced)."""
    return f"rb:{{{rid}}}:ep"


# ---------------------------------------------------------------- messages


class WireError(RlboostError, ValueError):
    """Bytes that are not a valid message of the expected type."""


class SchemaVersionError(WireError):
    """A well-formed message of a schema version this build does not speak."""


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off


class EpisodeSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What makes a request an episode: the environment that answers the model's turns and the
    data row it starts from. The request's `max_new_tokens` bounds the whole episode (model and
    environment tokens after the prompt); `max_turn_tokens` bounds one model turn (0: no bound
    beyond the episode's); `max_turns` bounds the model turns. Every worker that continues the
    episode reads the same bounds here, so a resumed episode ends where an undisturbed one would."""

    env: str  # the environment: a built-in name or `module:fn` / `file.py:fn` (rlboost/envs)
    row: str = "{}"  # JSON text of the data row the episode starts from
    config: str = "{}"  # JSON text of the environment's own options (keyword arguments of its factory)
    max_turns: int = 8
    max_turn_tokens: int = 0
    tool_timeout_s: float = 30.0  # a tool call running longer counts as a failed call
    on_tool_error: Literal["message", "end"] = "message"  # a failed call: the model reads the error, or the end


class RolloutRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One (prompt, sample) to generate. `seed` keys sampling with the request id and the token
    position, so whichever worker resumes the request produces the same tokens. With `episode`
    the request is a multi-turn episode (schema 4) whose tokens interleave model turns and
    environment replies."""

    v: int = SCHEMA_VERSION
    request_id: str
    step: int
    policy_version: int
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    sampling: SamplingParams = SamplingParams()
    eos_id: int = -1  # -1 = no stop token
    stop_ids: list[int] = []  # every EOS id of the model (generation_config + tokenizer), with eos_id
    group: int = 0  # prompt index within the step: GRPO groups by it
    episode: EpisodeSpec | None = None  # a multi-turn episode (schema 4); None: one response
    # A newer version may continue it (async rollout's in-flight update): a worker moving to the
    # next version carries the request along, its later tokens a segment of their own. The oldest
    # segment stays `policy_version`, so the staleness bound holds. A worker that predates the
    # field ignores it and generates the request under `policy_version` only, as before.
    upgradable: bool = False

    def stops(self) -> frozenset[int]:
        return frozenset(self.stop_ids) | ({self.eos_id} if self.eos_id >= 0 else frozenset())


def spec_digest(req: RolloutRequest) -> str:
    """SHA-1 hex of everything a request asks for (prompt, seed, sampling, bounds, stop ids,
    episode...) but its policy version, which a worker may raise on the way (a version floor, an
    in-flight update) and which is checked on its own (every segment names its version). The
    first claim from the fresh lane records it in the checkpoint's meta hash; a hand-off of the
    request must carry the same (rlboost/checkpoint.py, `_CLAIM`). SHA-1 suffices: the digest
    tells an honest hand-off from a planted one, and a planted spec that collides with the
    published one would have to be found for each request."""
    return hashlib.sha1(encode(msgspec.structs.replace(req, policy_version=0))).hexdigest()


class TokenChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens [offset, offset+len) of a response, as checkpointed: the per-request view of a
    `TokenFlush` (since schema 3 it does not travel on its own)."""

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
    kind: Literal["model", "env"] = "model"  # env: environment tokens (no logprobs, never trained)


class FlushChunk(msgspec.Struct, frozen=True, array_like=True):
    """One request's new tokens in a flush: `records` are packed `RECORD`s, the very bytes
    appended to its checkpoint under lease `epoch` at `offset`. `env`: environment tokens of an
    episode (their logprobs are 0 and mean nothing)."""

    request_id: str
    epoch: int
    offset: int
    policy_version: int
    records: bytes
    env: bool = False


FLUSH_MESSAGE_BYTES = 256 << 10  # records per token message, well under NATS' 1 MiB max_payload


def split_flush(chunks: list[FlushChunk], budget: int = FLUSH_MESSAGE_BYTES) -> list[list[FlushChunk]]:
    """A flush's chunks in as few messages as fit `budget` bytes of records each (a large batch
    with a long K would overflow one NATS message; one chunk alone is never split)."""
    parts: list[list[FlushChunk]] = [[]]
    size = 0
    for c in chunks:
        if parts[-1] and size + len(c.records) > budget:
            parts.append([])
            size = 0
        parts[-1].append(c)
        size += len(c.records)
    return parts if parts[-1] else []


class TokenFlush(msgspec.Struct, frozen=True, kw_only=True):
    """Every token chunk of one worker flush (one step), published after they are checkpointed:
    one message per flush instead of one per request. `ts`: when the fenced append was sent."""

    v: int = SCHEMA_VERSION
    step: int
    worker_id: str
    ts: float
    chunks: list[FlushChunk]

    def token_chunks(self) -> list[TokenChunk]:
        out = []
        for c in self.chunks:
            rec = np.frombuffer(c.records, dtype=RECORD)
            out.append(TokenChunk(request_id=c.request_id, step=self.step, worker_id=self.worker_id, epoch=c.epoch,
                                  offset=c.offset, token_ids=rec["token"].tolist(), logprobs=rec["logprob"].tolist(),
                                  policy_version=c.policy_version, ts=self.ts, kind="env" if c.env else "model"))
        return out


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """Tokens from `offset` on were generated by `worker_id` (lease `epoch`) with `policy_version`,
    with exactly the weights named by `weights`: the SHA-256 of the version's manifest
    (`rlboost.weights.manifest_digest`), `emulated-v<N>` for the emulated engine, "" if unknown
    (an older worker). The trainer checks it against the manifest it published.

    `kind` "env": environment tokens of an episode (a tool result, an env/user turn), appended by
    `worker_id` under lease `epoch` while the episode ran `policy_version`: part of the model's
    context, never trained (`trainable_mask`), their logprobs 0."""

    offset: int
    worker_id: str
    epoch: int
    policy_version: int
    weights: str = ""
    kind: Literal["model", "env"] = "model"


MAX_TOOL_CALLS_PER_TURN = 64
MAX_EPISODE_STATE_BYTES = 1 << 20  # the environment's JSON state, per checkpoint write


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call a model turn made. `key` (`tool_call_key`) is its idempotency key: the
    environment receives it, so a tool with side effects can de-duplicate the rare re-run after
    a worker died during the call; its result, once fenced into the checkpoint, is never asked
    for again."""

    key: str
    name: str
    arguments: str = "{}"  # JSON text, as the model wrote it (parsed by the environment)


class ToolRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call that was answered: who ran it, how long it took, and where in the response
    its turn's environment tokens start (`at`): what replay shows of a turn."""

    key: str
    name: str
    worker_id: str
    latency_s: float
    at: int
    error: bool = False  # the tool raised or timed out: the model was told so (or the episode ended)


class EpisodeState(msgspec.Struct, frozen=True, kw_only=True):
    """What an episode needs to continue on any machine, stored under `ckpt_episode_key` with the
    tokens it describes (`at`: the checkpoint's length when it was written, checked by the store).

    `turn`: model turns completed; `env_state`: the environment's own state as JSON text;
    `pending`: the tool calls of the last model turn that have no result in the checkpoint yet
    (a resume runs these, with the same keys); `calls`: every answered call; `done`: the episode
    ended (`reason` says why)."""

    v: int = SCHEMA_VERSION
    turn: int = 0
    at: int = 0
    env_state: str = "null"
    pending: list[ToolCall] = []
    calls: list[ToolRecord] = []
    done: bool = False
    reason: str = ""


def tool_call_key(request_id: str, turn: int, index: int) -> str:
    """The idempotency key of call `index` of model turn `turn` of an episode, `<request id>/
    <turn>/<index>` (the environment protocol's `idempotency_key`): the same on every worker
    that (re)runs it."""
    return f"{request_id}/{turn}/{index}"


_TOOL_KEY = re.compile(r"[A-Za-z0-9_-]{1,128}/\d{1,9}/\d{1,9}")


def check_tool_key(value: str) -> str:
    if not isinstance(value, str) or not _TOOL_KEY.fullmatch(value):
        raise WireError(f"invalid tool call key {value!r}: use <request id>/<turn>/<index>")
    return value


class RolloutResult(msgspec.Struct, frozen=True, kw_only=True):
    v: int = SCHEMA_VERSION
    request_id: str
    step: int
    group: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    segments: list[Segment]
    finish_reason: Literal["stop", "length", "error"]  # error: the engine cannot serve the request
    worker_id: str
    ts: float
    error: str = ""  # why, when finish_reason is "error"
    epoch: int = 0  # the lease epoch it was finished under: the trainer checks it against Redis
    episode: EpisodeState | None = None  # an episode's final state (its reward is the trainer's to compute)


def result_msg_id(r: RolloutResult) -> str:
    """The result's de-duplication id: the request, the lease epoch and a digest of everything
    the result says but its timestamp. A republished result (same checkpoint, same lease) gets
    the same id, so the stream stores it once; a forgery published first can only take the id
    of a byte-identical result, which is the genuine one: any field it changes (segments,
    finish reason, worker, group ...) changes the id, and the genuine result is stored beside
    it for the manager to verify (issue 30: with a digest of the tokens alone, a forgery with
    the genuine tokens and false provenance made the stream drop the genuine result)."""
    digest = hashlib.sha256(_encoder.encode(msgspec.structs.replace(r, ts=0.0))).hexdigest()[:16]
    return f"{r.request_id}-e{r.epoch}-{digest}"


def finish_reason(req: RolloutRequest, tokens: list[int]) -> str:
    """Why a (non-error) response of `req` with `tokens` ended: what the worker writes and the
    manager checks (a result cannot say otherwise)."""
    if tokens and tokens[-1] in req.stops():
        return "stop"
    return "length" if len(tokens) >= req.max_new_tokens else "stop"


def is_complete(req: RolloutRequest, tokens: list[int]) -> bool:
    return len(tokens) >= req.max_new_tokens or (bool(tokens) and tokens[-1] in req.stops())


def token_versions(segments: list[Segment], n_tokens: int) -> list[int]:
    """The policy version that generated each of a response's `n_tokens` tokens, from its
    segments (a segment covers its offset up to the next segment's): what off-policy
    correction and staleness bounds read per token. -1 where the segments do not say (no
    segment, tokens before the first offset, a negative version). Segments come off the wire,
    so their order is not trusted: sorted by offset, and of two at one offset the later claim
    in the list wins, as in the checkpoint's history."""
    out = [-1] * n_tokens
    for seg in sorted(segments, key=lambda s: s.offset):  # stable: a later claim at an offset wins
        start = max(0, seg.offset)
        if start < n_tokens:
            out[start:] = [seg.policy_version if seg.policy_version >= 0 else -1] * (n_tokens - start)
    return out


def trainable_mask(segments: list[Segment], n_tokens: int) -> list[bool]:
    """Which of a response's `n_tokens` tokens the loss may train: False on environment tokens
    (segments of kind "env", up to the next segment), True on the rest (model tokens, and tokens
    no segment covers: a single-turn response is all model tokens). Segments are sorted as in
    `token_versions` (from the wire: order not trusted; of two at one offset the later wins)."""
    out = [True] * n_tokens
    for seg in sorted(segments, key=lambda s: s.offset):
        start = max(0, seg.offset)
        if start < n_tokens:
            out[start:] = [seg.kind != "env"] * (n_tokens - start)
    return out


def token_turns(segments: list[Segment], n_tokens: int) -> list[int]:
    """Each of a response's `n_tokens` tokens' model turn: the number of environment segments
    (kind "env") that start at or before it. A model turn handed off mid-way spans several
    segments but no env segment, so it stays one turn; a single-turn response is all turn 0."""
    out = [0] * n_tokens
    for seg in sorted(segments, key=lambda s: s.offset):
        if seg.kind == "env" and 0 <= seg.offset < n_tokens:
            out[seg.offset:] = [out[seg.offset] + 1] * (n_tokens - seg.offset)
    return out


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
    """Put in the control bucket under the worker id (or `all`). Bounded: an entry acts only on
    the worker it names (`target`, equal to its key) and only until `deadline` (unix time); an
    entry without one has expired. Make them with `control()`."""

    v: int = SCHEMA_VERSION
    command: Literal["drain", "abort"]
    reason: str = ""
    ts: float = 0.0
    target: str = ""  # the worker id, or CONTROL_ALL
    deadline: float = 0.0


CONTROL_ALL = "all"


def control(command: Literal["drain", "abort"], target: str, reason: str = "", ttl_s: float = 60.0) -> Control:
    """A control entry for `target` (a worker id or CONTROL_ALL), valid for `ttl_s` from now.
    A fleet-wide entry also acts only on workers started before it (`ts`)."""
    now = time.time()
    return Control(command=command, reason=reason, ts=now, target=check_name("control target", target),
                   deadline=now + ttl_s)


class VersionFloor(msgspec.Struct, frozen=True, kw_only=True):
    """The oldest policy version a pool's workers may generate with (rollout modes partial and
    async, `rlboost.orchestrator`): a worker holding an older request hands it back, and a request
    older than this is resumed from its checkpoint under `version`. Put by the trainer only."""

    v: int = SCHEMA_VERSION
    version: int
    ts: float = 0.0


def version_floor_key(pool: str) -> str:
    """Its key in the control bucket (next to the per-worker entries)."""
    return f"floor-{check_name('pool', pool)}"


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


class RunLease(msgspec.Struct, frozen=True, kw_only=True):
    """Who holds the servers (BUCKET_RUN, RUN_LEASE_KEY): the one `rlboost run` whose pools,
    version pointer and weight store they are. Written by the holder when it takes the lease and
    at each renewal (`renewed`); the entry lapses `ttl_s` after its last write (the bucket's max
    age). `pid_space` and `proc_start` let a process that shares the holder's pid space prove the
    holder dead (its pid gone, or now another process) and take the lease over at once."""

    v: int = SCHEMA_VERSION
    run_id: str
    token: str  # this holder's own (one per take): its renewals and release touch only its own lease
    host: str
    pid: int
    started: float  # unix time the lease was taken
    renewed: float  # unix time of the last renewal (the holder's clock)
    ttl_s: float
    data_dir: str = ""  # services.data_dir of the holder (the embedded servers' home)
    run_dir: str = ""
    pid_space: str = ""  # host, boot id and pid namespace; empty: unknown (no takeover by death)
    proc_start: int = 0  # the holder's start in clock ticks after boot (/proc); 0: unknown


Message = (RolloutRequest | TokenFlush | TokenChunk | RolloutResult | WorkerHeartbeat | Control | LeaseEvent
           | EpisodeState | RunLease)


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
