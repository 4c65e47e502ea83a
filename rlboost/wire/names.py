"""The protocol's names: the schema version, streams, subjects, consumers, KV buckets, message
ids, the weight store's and the peers' keys, and the Redis key layout."""

from __future__ import annotations

import re
import uuid
from typing import Literal

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

class WireError(RlboostError, ValueError):
    """Bytes that are not a valid message of the expected type."""


class SchemaVersionError(WireError):
    """A well-formed message of a schema version this build does not speak."""


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

