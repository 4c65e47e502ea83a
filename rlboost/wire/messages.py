"""The protocol's messages: msgspec structs encoded as MessagePack, each carrying the schema
version `v`."""

from __future__ import annotations

import hashlib
import re
import time
from typing import Literal

import msgspec
import numpy as np

from rlboost.wire.names import SCHEMA_VERSION, WireError, check_name, RECORD

_encoder = msgspec.msgpack.Encoder()  # for digests (spec_digest, result_msg_id)


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
    return hashlib.sha1(_encoder.encode(msgspec.structs.replace(req, policy_version=0))).hexdigest()


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


def flush_msg_id(first: FlushChunk) -> str:
    """A flush's de-duplication id, named by its first chunk: a chunk (request, lease epoch,
    offset) is accepted by the fenced store once, so no other flush starts with it, and a
    publish retried after a lost ack carries the same id and is stored once."""
    return f"{first.request_id}-c{first.epoch}-{first.offset}-f"


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

