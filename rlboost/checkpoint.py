"""Token checkpoints in Redis, with leases and fencing.

Each in-flight request has a packed array of (int32 token id, float32 behaviour logprob) records
that its current owner appends to. Ownership is a lease: claiming bumps a strictly increasing
epoch (the fencing token), and every append/finish carries the writer's epoch. A Lua script
checks epoch and offset and writes in one atomic step, so a worker that was paused (SIGSTOP)
and resumed after another worker took the request over learns it lost the lease and cannot
corrupt what the new owner writes.

The epoch is no proof of holding the lease, since any credential can read it: every write under
a lease also carries the claimant's secret (`CheckpointStore.secret`), of which the claim keeps
only a digest. A stolen worker credential can still claim a request itself (and spoil what it
claims, under a lease of its own that the history records); it cannot write into a lease that
another client holds. What the credentials can still do beside the scripts:
docs/guides/security.md.

Epochs never go backwards, even when Redis does. A restart without persistence, the AOF's
last unsynced second (`appendfsync everysec`) or a failover to a replica that missed the last
writes all roll `meta` back, and a plain counter would then hand a new claimant the epoch a
paused worker still holds (two writers, one epoch). So a claim's epoch is a hybrid logical
clock: max(stored epoch + 1, Redis server time in microseconds). Whatever was lost was issued
before the store went down; every claim after it is issued later, so its epoch is larger than
any epoch handed out before, whatever `meta` remembers. (Assumes the server clock does not
step back across a restart by more than the outage lasted; a failover takes seconds.)
What a restart costs: with the AOF, a kill -9 loses at most the last second of appends; each
request whose tail was lost is resumed from its last persisted checkpoint (the writer's next
append no longer continues the checkpoint, the worker hands the request back), so at most
~1 s of generation plus K tokens is regenerated per request in flight. A clean shutdown
(SIGTERM) fsyncs the AOF and loses nothing.

A worker's flush (the new tokens of every request it serves) is one fenced write: one script
call (`append_packed`, `_APPEND_MANY`) that checks each request's epoch and offset and appends,
with an outcome per request. On a Redis Cluster a script may only touch keys of one hash slot,
and the keys of a request share its `{rid}` tag: there the flush is grouped by slot (one call
per slot) and redis-py's cluster pipeline sends each master its calls in one batch. The key
layout stays per request rather than per worker or per bucket: a request moves between workers
and its keys must be found from its id alone by whichever worker claims it next, and a coarse
shared tag would pile a whole bucket of requests onto one master. So on a cluster a flush costs
a script call per request, sent per node; on a standalone Redis or a sentinel's primary it is
one call.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import numpy as np
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import AskError, ClusterError, NoScriptError, ResponseError, TryAgainError

from rlboost import wire
from rlboost.errors import (
    AlreadyFinished,
    CheckpointError,
    CorruptCheckpoint,
    LEASE_HELD,
    LeaseHeld,
    LeaseLost,
    OffsetMismatch,
    REDIS_REFUSED,
    lua_error,
)
from rlboost.checkpoint_history import HISTORY_ENV, History
from rlboost.checkpoint_scripts import (  # (patched here by tests: the store registers these names)
    _APPEND_ENV,
    _APPEND_MANY,
    _CLAIM,
    _EPISODE,
    _FINISH,
    _RELEASE,
    _RENEW,
    _RESET,
    _VOUCH,
)
from rlboost.logs import get_logger

# The checkpoint errors live in rlboost.errors (one root); callers import them from here too.
__all__ = ["AlreadyFinished", "CheckpointError", "CorruptCheckpoint", "LeaseHeld", "LeaseLost", "OffsetMismatch",
           "CheckpointStore", "Claim", "History", "HISTORY_ENV", "pack", "unpack", "parse_segment"]

log = get_logger(component="checkpoint")

RECORD = wire.RECORD
MAX_APPENDS_PER_CALL = 1024  # requests per fenced-append script call (bounds how long it blocks Redis)

# The scripts (what each checks and answers) are rlboost/checkpoint_scripts.py; the operation
# history a store writes when asked is rlboost/checkpoint_history.py.


@dataclass(frozen=True, slots=True)
class Claim:
    epoch: int
    token_ids: list[int]
    logprobs: list[float]
    episode: wire.EpisodeState | None = None  # an episode's stored state (None: none stored yet)


def pack(token_ids: Sequence[int], logprobs: Sequence[float]) -> bytes:
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
    rec = np.empty(len(token_ids), dtype=RECORD)
    rec["token"] = token_ids
    rec["logprob"] = logprobs
    return rec.tobytes()


def unpack(data: bytes, rid: str = "?") -> tuple[list[int], list[float]]:
    """The checkpoint door: bytes from Redis become (tokens, logprobs) or CorruptCheckpoint."""
    if len(data) % RECORD.itemsize:
        raise CorruptCheckpoint(f"{rid}: token checkpoint is {len(data)} bytes, not a multiple of {RECORD.itemsize}")
    rec = np.frombuffer(data, dtype=RECORD)
    tokens = rec["token"]
    if len(tokens) and int(tokens.min()) < 0:
        raise CorruptCheckpoint(f"{rid}: token checkpoint holds a negative token id")
    return tokens.tolist(), rec["logprob"].tolist()


def parse_segment(raw: bytes) -> wire.Segment:
    """One history line `owner epoch offset policy_version [weights [env]]`, or CorruptCheckpoint."""
    try:
        owner, epoch, offset, version, *rest = raw.decode("ascii").split(" ")
        if len(rest) > 2 or rest[1:] not in ([], ["env"]):
            raise ValueError(f"{4 + len(rest)} fields")
        seg = wire.Segment(offset=int(offset), worker_id=wire.check_name("worker id", owner), epoch=int(epoch),
                           policy_version=int(version), weights=wire.check_weights_id(rest[0] if rest else ""),
                           kind="env" if rest[1:] else "model")
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpoint(f"history line {raw[:80]!r}: {e}") from None
    if min(seg.offset, seg.epoch, seg.policy_version) < 0:
        raise CorruptCheckpoint(f"history line {raw[:80]!r}: negative field")
    return seg


class CheckpointStore:
    """Pooled async client over the checkpoint keys of `rlboost.wire`."""

    def __init__(self, url: str, max_connections: int = 32, keep_s: int = 86400, timeout_s: float = 5.0,
                 history_dir: str | None = None) -> None:
        # Every operation and the outcome the store gave, one JSON line each, when a history
        # directory is given (or $RLBOOST_STORE_HISTORY): what `benchmarks/history.py` checks.
        # Off (None), each operation pays one attribute check.
        self.history = History.open(history_dir or os.environ.get(HISTORY_ENV) or None)
        # BlockingConnectionPool waits for a free connection instead of raising under load.
        # Every call is bounded: a Redis that stops answering (killed, paused, partitioned)
        # raises TimeoutError after `timeout_s` instead of freezing the caller.
        self.redis = _connect(url, max_connections, timeout_s)
        self.keep_s = keep_s
        # What proves that this client holds the leases it claimed (see the scripts): fresh
        # random bits per client, never sent anywhere but to Redis (in the scripts' ARGV: Redis
        # keeps only a digest), so a hand-off, a log line or a stolen credential never carries
        # it. One per client rather than per claim: a flush checks it once per script call for
        # all its requests (one digest), and a client serves one worker.
        self.secret = secrets.token_bytes(16)
        self._claim = self.redis.register_script(_CLAIM)
        self._append_many = self.redis.register_script(_APPEND_MANY)
        self._resp_keys: dict[str, bytes] = {}  # rid -> its append keys in RESP (_keys_resp)
        self._queued: list[tuple[tuple, asyncio.Future]] = []  # commands coalesced into the next pipeline
        self._sending: set[asyncio.Task] = set()
        self._finish = self.redis.register_script(_FINISH)
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)
        self._append_env = self.redis.register_script(_APPEND_ENV)
        self._episode = self.redis.register_script(_EPISODE)
        self._vouch = self.redis.register_script(_VOUCH)

    async def close(self) -> None:
        await self.redis.aclose()
        if self.history is not None:
            self.history.close()
            self.history = None

    async def load_scripts(self) -> bool:
        """SCRIPT LOAD the checkpoint scripts (idempotent). The trainer does this: the worker
        identity may only EVALSHA them (rlboost/auth.py), so after a Redis restart emptied the
        script cache, workers wait for the trainer's next load. False if this identity may not.
        On a Redis Cluster, redis-py sends SCRIPT LOAD to every master (each has its own cache)."""
        try:
            for script in (self._claim, self._append_many, self._finish, self._renew, self._release,
                           self._append_env, self._episode, self._vouch):
                await self.redis.script_load(script.script)
        except redis.exceptions.NoPermissionError:
            return False
        return True

    async def ping(self) -> None:
        await self.redis.ping()

    async def claim(self, rid: str, owner: str, policy_version: int, ttl_s: float, steal: bool = False,
                    weights: str = "", episode: bool = False, inherit: bool = False, spec: str = "",
                    handoff: bool = False) -> Claim:
        """Take the lease with a new epoch and get the tokens so far (see `_claim_once`)."""
        if self.history is None:
            return await self._claim_once(rid, owner, policy_version, ttl_s, steal, weights, episode, inherit, spec,
                                          handoff)
        t0 = time.monotonic()
        try:
            c = await self._claim_once(rid, owner, policy_version, ttl_s, steal, weights, episode, inherit, spec,
                                       handoff)
        except BaseException as e:
            self.history.record("claim", rid, owner, 0, 0, 0, e, t0)
            raise
        self.history.record("claim", rid, owner, c.epoch, len(c.token_ids), 0, c.epoch, t0)
        return c

    async def _claim_once(self, rid: str, owner: str, policy_version: int, ttl_s: float, steal: bool,
                          weights: str, episode: bool, inherit: bool, spec: str = "",
                          handoff: bool = False) -> Claim:
        """Take the lease with a new epoch and get the tokens so far (to resume from).
        `weights` names the weights that will generate from here on (recorded in the segment).
        `episode`: the request is an episode; its stored state comes back too (`Claim.episode`).
        `inherit`: an environment worker's claim (it appends tool results, never model tokens):
        its history line keeps the last segment's version and weights, whatever it passes.
        `spec`: the request's `wire.spec_digest` (empty: not checked). Taken from the fresh lane
        (`handoff` False) it is recorded with the checkpoint; from a hand-off (`handoff`) it must
        be the recorded one. Either refusal is a CorruptCheckpoint whose message says which: the
        message (or the checkpoint) is not the request the run published."""
        k = wire
        keys = [k.ckpt_meta_key(rid), k.ckpt_lease_key(rid), k.ckpt_history_key(rid), k.ckpt_tokens_key(rid)]
        if episode:
            keys.append(k.ckpt_episode_key(rid))
        try:
            reply = await self._coalesced(
                ("EVALSHA", self._claim.sha, len(keys), *keys, owner, int(ttl_s * 1000), policy_version,
                 "1" if steal else "0", self.keep_s, wire.check_weights_id(weights), "1" if inherit else "0",
                 self.secret, spec, "1" if handoff else "0"))
            if isinstance(reply, Exception):
                raise reply
            status, extra, data, *state = reply  # type: ignore[misc]
        except ResponseError as e:  # e.g. an epoch that is not an integer
            # A cluster's CLUSTERDOWN / TRYAGAIN / MOVED (a master restarting, slots moving) is
            # the store being unavailable, not the checkpoint being corrupt: the caller retries.
            if (isinstance(e, (NoScriptError, ClusterError, TryAgainError, AskError)) or "NOPERM" in str(e)
                    or "no permissions" in str(e).lower()):
                raise
            raise CorruptCheckpoint(f"{rid}: claim refused by Redis: {e}") from None
        status = int(status)
        if status == LEASE_HELD:
            holder = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
            raise LeaseHeld(rid, holder, max(extra, 0) / 1000)
        if (err := lua_error("claim", status, rid)) is not None:
            raise err
        tokens, logprobs = unpack(data, rid)
        ep = _episode_state(rid, state[0]) if state else None
        if ep is not None and ep.at > len(tokens):
            raise CorruptCheckpoint(f"{rid}: the episode state describes {ep.at} tokens, the checkpoint holds "
                                    f"{len(tokens)}")
        return Claim(epoch=int(status), token_ids=tokens, logprobs=logprobs, episode=ep)

    def _coalesced(self, command: tuple) -> asyncio.Future:
        """One command's reply (or its error, as a value), sent in one pipeline with every other
        command coalesced in the same event-loop turn: a worker claims the requests of a fetch
        together, and a Redis round trip each cost more than the claims themselves."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queued.append((command, fut))
        if len(self._queued) == 1:
            loop.call_soon(self._send_queued)
        return fut

    def _send_queued(self) -> None:
        batch, self._queued = self._queued, []
        task = asyncio.ensure_future(self._run_queued(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _run_queued(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        try:
            replies = await self._pipeline([command for command, _ in batch])
        except Exception as e:  # the store unreachable (after the client's retries): each caller sees it
            replies = [e] * len(batch)
        for (_, fut), reply in zip(batch, replies, strict=True):
            if not fut.done():  # its caller may have been cancelled meanwhile
                fut.set_result(reply)

    async def append(self, rid: str, owner: str, epoch: int, offset: int, token_ids: Sequence[int],
                     logprobs: Sequence[float], ttl_s: float) -> int:
        (n,) = await self.append_many([(rid, owner, epoch, offset, token_ids, logprobs)], ttl_s)
        if isinstance(n, Exception):
            raise n
        return n

    async def append_many(self, appends: Sequence[tuple[str, str, int, int, Sequence[int], Sequence[float]]],
                          ttl_s: float) -> list[int | CheckpointError]:
        """Fenced appends of many requests (a worker's flush). Each entry is (rid, owner, epoch,
        offset, token_ids, logprobs); each outcome is the new length or the error for that
        request, so one lost lease does not fail the others."""
        return await self.append_packed([(rid, owner, epoch, offset, pack(toks, lps))
                                         for rid, owner, epoch, offset, toks, lps in appends], ttl_s)

    async def append_packed(self, appends: Sequence[tuple[str, str, int, int, bytes]],
                            ttl_s: float) -> list[int | CheckpointError]:
        """`append_many` with the records already packed (`pack`): (rid, owner, epoch, offset,
        records). One script call per (hash slot, owner) group, all in one round trip (see
        `_groups`); outcomes in the order of `appends`."""
        if not appends:
            return []
        t0 = time.monotonic() if self.history is not None else 0.0
        ttl = b"%d" % int(ttl_s * 1000)
        keep = b"%d" % self.keep_s
        cluster = isinstance(self.redis, RedisCluster)
        groups = self._groups(appends) if cluster or len({a[1] for a in appends}) > 1 else [
            (appends[0][1], range(j, min(j + MAX_APPENDS_PER_CALL, len(appends))))
            for j in range(0, len(appends), MAX_APPENDS_PER_CALL)]
        calls = []
        for owner, members in groups:
            keys: list[bytes] = []
            heads: list[bytes] = []
            blobs: list[bytes] = []
            for i in members:
                rid, _, epoch, offset, data = appends[i]
                keys.append(self._keys_resp(rid) if not cluster else wire.ckpt_append_keys(rid))
                heads.append(b"%d %d %d" % (epoch, offset, len(data)))
                blobs.append(data)
            if cluster:
                keys = [k for three in keys for k in three]  # type: ignore[misc]
            calls.append((keys, [ttl, owner.encode(), keep, b" ".join(heads), b"".join(blobs), self.secret]))
        try:
            replies = await (self._pipelined if cluster else self._raw_scripts)(self._append_many, calls)
        except BaseException as e:  # unanswered (a lost connection, cancelled): unknown outcomes
            if self.history is not None:
                self.history.record_many("append", [(rid, owner, epoch, offset, len(data) // RECORD.itemsize, e)
                                                    for rid, owner, epoch, offset, data in appends], t0)
            raise
        out: list[int | CheckpointError] = [CheckpointError("no reply")] * len(appends)  # every slot is set below
        for (_, members), reply in zip(groups, replies, strict=True):
            for i, r in zip(members, _append_replies(reply, len(members)), strict=True):
                if type(r) is int and r >= 0:  # the common case, without the error lookup
                    out[i] = r
                else:
                    rid, _, epoch, offset, _ = appends[i]
                    out[i] = _append_outcome(rid, epoch, offset, r)
        if self.history is not None:  # one line per request, from the batch's outcomes
            self.history.record_many("append", [(rid, owner, epoch, offset, len(data) // RECORD.itemsize, o)
                                                for (rid, owner, epoch, offset, data), o in zip(appends, out)], t0)
        return out

    def _keys_resp(self, rid: str) -> bytes:
        """The RESP encoding of a request's three append keys, kept while the request is in
        flight (it is appended to every flush). Bounded: forgotten wholesale when full."""
        got = self._resp_keys.get(rid)
        if got is None:
            if len(self._resp_keys) >= 1 << 16:
                self._resp_keys.clear()
            got = self._resp_keys[rid] = _bulks(wire.ckpt_append_keys(rid))
        return got

    async def _raw_scripts(self, script, calls: Sequence[tuple[Sequence[bytes], Sequence[bytes]]]) -> list[object]:
        """EVALSHA calls packed here (RESP) and sent on one pooled connection as one write:
        redis-py's generic command packing cost more per request of a flush than the script
        itself. Each call's keys come RESP-encoded, three per request (`_keys_resp`). Not on a
        cluster (no routing here). A lost connection raises ConnectionError for the caller to
        retry: safe, the scripts refuse a repeat."""
        sha = script.sha.encode()
        payload = b"".join(b"*%d\r\n" % (3 + 3 * len(keys) + len(args)) + _bulks([b"EVALSHA", sha, b"%d" % (3 * len(keys))])
                           + b"".join(keys) + _bulks(args) for keys, args in calls)
        pool = self.redis.connection_pool
        for attempt in (1, 2):
            conn = await pool.get_connection()
            try:
                # The client's retry policy, as for any redis-py command: a restarted Redis closed
                # our pooled connection; reconnect and send again (safe, see above).
                replies = await conn.retry.call_with_retry(lambda: self._send_read(conn, payload, len(calls)),
                                                           lambda _: conn.disconnect())
            except BaseException:
                await conn.disconnect()
                raise
            finally:
                await pool.release(conn)
            if attempt == 1 and any(isinstance(r, NoScriptError) for r in replies) and await self.load_scripts():
                continue  # Redis restarted and lost its script cache (see _pipelined)
            return replies
        return replies

    @staticmethod
    async def _send_read(conn, payload: bytes, n: int) -> list[object]:
        await conn.send_packed_command(payload, check_health=False)
        replies: list[object] = []
        for _ in range(n):
            try:
                replies.append(await conn.read_response())
            except ResponseError as e:  # one call's error: the rest of the replies still follow
                replies.append(e)
        return replies

    def _groups(self, appends: Sequence[tuple]) -> list[tuple[str, Sequence[int]]]:
        """Which appends share one script call: (owner, indices) per group.

        A standalone Redis (or a sentinel's primary) runs the whole flush as one call, at most
        MAX_APPENDS_PER_CALL requests each (a script blocks the server while it runs: bounded).
        A Redis Cluster refuses a script whose keys span hash slots, so there a flush is grouped
        by the slot of each request's `{rid}` tag, and redis-py's cluster pipeline sends each
        master its groups in one batch. Why not change the key layout so that a flush's keys
        share a slot (a per-worker or per-bucket tag)? A request moves between workers, and its
        keys must be found by whoever claims it next from its id alone; a coarse bucket tag
        would pile a whole bucket of requests onto one master. Sharding by request stays, and
        on a cluster a flush costs one call per request (today's cost), grouped per node."""
        by: dict[tuple[int, str], list[int]] = {}
        cluster = isinstance(self.redis, RedisCluster)
        for i, a in enumerate(appends):
            slot = key_slot(wire.ckpt_meta_key(a[0]).encode()) if cluster else 0
            by.setdefault((slot, a[1]), []).append(i)
        out = []
        for (_, owner), members in by.items():
            out += [(owner, members[j:j + MAX_APPENDS_PER_CALL]) for j in range(0, len(members), MAX_APPENDS_PER_CALL)]
        return out

    async def _pipelined(self, script, calls: Sequence[tuple[Sequence, Sequence]]) -> list[object]:
        """Run one Lua script for many (keys, args) in one pipeline (see `_pipeline`)."""
        return await self._pipeline([("EVALSHA", script.sha, len(keys), *keys, *args) for keys, args in calls])

    async def _pipeline(self, commands: Sequence[tuple]) -> list[object]:
        """Commands (scripts by EVALSHA) in one pipeline, one reply or exception each. EVALSHA
        directly: the Script wrapper's per-call bookkeeping costs more than Redis spends running
        the script.

        On a Redis Cluster the pipeline is redis-py's ClusterPipeline: it routes each command by
        the slot of its keys and sends one batch per master. Every script call's keys share one
        hash slot (one `{rid}` tag, or a group of `append_packed` made per slot), so each script
        stays atomic. `execute_command`, not `evalsha()`: ClusterPipeline blocks the latter by
        name, though it routes EVALSHA fine."""
        for attempt in (1, 2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                try:
                    replies = await pipe.execute(raise_on_error=False)
                except AttributeError as e:  # see _Cluster
                    raise RedisConnectionError(f"connection closed under this pipeline: {e}") from e
            if attempt == 1 and any(isinstance(r, NoScriptError) for r in replies):
                # Redis restarted and lost its script cache. A worker identity may not load
                # scripts: its calls fail (and are retried) until the trainer reloads them.
                if await self.load_scripts():
                    continue
            break
        return replies

    async def finish(self, rid: str, epoch: int, total_tokens: int) -> None:
        t0 = time.monotonic() if self.history is not None else 0.0
        try:
            r = await self._finish(
                keys=[wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid), wire.ckpt_tokens_key(rid)],
                args=[epoch, total_tokens, self.secret],
            )
        except BaseException as e:
            if self.history is not None:
                self.history.record("finish", rid, "", epoch, total_tokens, 0, e, t0)
            raise
        err = lua_error("finish", r, f"{rid} (epoch {epoch}, {total_tokens} tokens)")
        if self.history is not None:
            self.history.record("finish", rid, "", epoch, total_tokens, 0, err or int(r), t0)
        if err is not None:
            raise err

    async def finish_many(self, finishes: Sequence[tuple[str, int, int]]) -> list[list[wire.Segment] | CheckpointError]:
        """`finish` for many requests, (rid, epoch, total_tokens) each, in one round trip, with
        each request's provenance (`segments`) read in the same pipeline: what its result
        carries. One outcome per request: its segments, or its error."""
        t0 = time.monotonic() if self.history is not None else 0.0
        commands: list[tuple] = []
        for rid, epoch, total in finishes:
            commands.append(("EVALSHA", self._finish.sha, 3, wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid),
                             wire.ckpt_tokens_key(rid), epoch, total, self.secret))
            commands.append(("LRANGE", wire.ckpt_history_key(rid), 0, -1))
        try:
            replies = await self._pipeline(commands)
        except BaseException as e:
            if self.history is not None:
                self.history.record_many("finish", [(rid, "", epoch, total, 0, e) for rid, epoch, total in finishes],
                                         t0)
            raise
        out: list[list[wire.Segment] | CheckpointError] = []
        for j, (rid, epoch, total) in enumerate(finishes):
            fin, hist = replies[2 * j], replies[2 * j + 1]
            detail = f"{rid} (epoch {epoch}, {total} tokens)"
            if isinstance(fin, Exception) or isinstance(hist, Exception):
                out.append(CheckpointError(f"{detail}: {fin if isinstance(fin, Exception) else hist}"))
            elif (err := lua_error("finish", int(fin), detail)) is not None:  # type: ignore[arg-type]
                out.append(err)
            else:
                out.append(_segments(rid, hist))  # type: ignore[arg-type]
        if self.history is not None:
            self.history.record_many("finish", [(rid, "", epoch, total, 0, 1 if isinstance(o, list) else o)
                                                for (rid, epoch, total), o in zip(finishes, out)], t0)
        return out

    async def renew(self, rid: str, owner: str, epoch: int, ttl_s: float) -> None:
        t0 = time.monotonic() if self.history is not None else 0.0
        try:
            r = await self._renew(keys=[wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid)],
                                  args=[epoch, int(ttl_s * 1000), owner, self.secret])
        except BaseException as e:
            if self.history is not None:
                self.history.record("renew", rid, owner, epoch, 0, 0, e, t0)
            raise
        err = lua_error("renew", r, f"{rid} (epoch {epoch})")
        if self.history is not None:
            self.history.record("renew", rid, owner, epoch, 0, 0, err or int(r), t0)
        if err is not None:
            raise err

    async def release(self, rid: str, epoch: int) -> bool:
        """Give the lease up (drain/hand-off) so the next claimant need not wait for expiry."""
        t0 = time.monotonic() if self.history is not None else 0.0
        try:
            r = await self._release(keys=[wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid)], args=[epoch, self.secret])
        except BaseException as e:
            if self.history is not None:
                self.history.record("release", rid, "", epoch, 0, 0, e, t0)
            raise
        if self.history is not None:
            self.history.record("release", rid, "", epoch, 0, 0, _released(rid, epoch, r), t0)
        return r == 1

    async def release_many(self, leases: Sequence[tuple[str, int]]) -> list[bool]:
        """`release` for a whole drained batch in one round trip: (rid, epoch) -> released?"""
        t0 = time.monotonic() if self.history is not None else 0.0
        try:
            replies = await self._pipelined(self._release, [
                ((wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid)), (epoch, self.secret)) for rid, epoch in leases])
        except BaseException as e:
            if self.history is not None:
                self.history.record_many("release", [(rid, "", epoch, 0, 0, e) for rid, epoch in leases], t0)
            raise
        if self.history is not None:
            self.history.record_many("release", [(rid, "", epoch, 0, 0, _released(rid, epoch, r))
                                                 for (rid, epoch), r in zip(leases, replies)], t0)
        return [r == 1 for r in replies]

    async def vouch_many(self, specs: Sequence[tuple[str, str]]) -> list[bool]:
        """Record (rid, `wire.spec_digest`) of requests taken from the fresh lane and handed on
        unstarted (`_VOUCH`), in one round trip: False where another spec is recorded (the
        hand-off will be refused)."""
        replies = await self._pipelined(self._vouch, [((wire.ckpt_meta_key(rid),), (spec, self.keep_s))
                                                      for rid, spec in specs])
        return [r == 1 for r in replies]

    async def append_env(self, rid: str, owner: str, epoch: int, offset: int, token_ids: Sequence[int],
                         state: wire.EpisodeState, ttl_s: float) -> int:
        """Append an episode's environment tokens at `offset` and the state that follows them
        (`state.at` must be their end), in one fenced step (`_APPEND_ENV`): refused like an
        append (LeaseLost, OffsetMismatch, AlreadyFinished), and then nothing is written. The
        new length on success."""
        call = self._append_env_once(rid, owner, epoch, offset, token_ids, state, ttl_s)
        if self.history is None:
            return await call
        return await self._recorded("append_env", rid, owner, epoch, offset, len(token_ids), call)

    async def _append_env_once(self, rid: str, owner: str, epoch: int, offset: int, token_ids: Sequence[int],
                               state: wire.EpisodeState, ttl_s: float) -> int:
        if state.at != offset + len(token_ids):
            raise OffsetMismatch(f"{rid}: a state at {state.at} after {len(token_ids)} env tokens at {offset}")
        blob = _state_bytes(rid, state)
        k = wire
        try:
            r = await self._append_env(
                keys=[k.ckpt_meta_key(rid), k.ckpt_lease_key(rid), k.ckpt_tokens_key(rid), k.ckpt_history_key(rid),
                      k.ckpt_episode_key(rid)],
                args=[epoch, offset, int(ttl_s * 1000), owner, self.keep_s, pack(token_ids, [0.0] * len(token_ids)),
                      blob, self.secret])
        except ResponseError as e:
            if isinstance(e, NoScriptError) or "NOPERM" in str(e) or "no permissions" in str(e).lower():
                raise
            raise CorruptCheckpoint(f"{rid}: env append refused by Redis: {e}") from None
        if (err := lua_error("append_env", r, f"{rid} (epoch {epoch}, at {offset})")) is not None:
            raise err
        return int(r)

    async def put_episode(self, rid: str, owner: str, epoch: int, state: wire.EpisodeState, ttl_s: float) -> None:
        """Store an episode's state under the lease (`_EPISODE`): refused (LeaseLost,
        AlreadyFinished, OffsetMismatch) unless `epoch` holds the lease and the checkpoint is
        exactly `state.at` tokens long."""
        call = self._put_episode_once(rid, owner, epoch, state, ttl_s)
        if self.history is None:
            return await call
        await self._recorded("episode", rid, owner, epoch, state.at, 0, call)

    async def _put_episode_once(self, rid: str, owner: str, epoch: int, state: wire.EpisodeState,
                                ttl_s: float) -> int:
        k = wire
        r = await self._episode(
            keys=[k.ckpt_meta_key(rid), k.ckpt_lease_key(rid), k.ckpt_tokens_key(rid), k.ckpt_episode_key(rid)],
            args=[epoch, state.at, int(ttl_s * 1000), owner, self.keep_s, _state_bytes(rid, state), self.secret])
        if (err := lua_error("episode", r, f"{rid} (epoch {epoch}, at {state.at})")) is not None:
            raise err
        return 1

    async def _recorded(self, op: str, rid: str, owner: str, epoch: int, offset: int, n: int, call) -> int:
        """Await `call` (a store operation) and record it and its outcome in the history."""
        assert self.history is not None
        t0 = time.monotonic()
        try:
            r = await call
        except BaseException as e:
            self.history.record(op, rid, owner, epoch, offset, n, e, t0)
            raise
        self.history.record(op, rid, owner, epoch, offset, n, r, t0)
        return r

    async def episode(self, rid: str) -> wire.EpisodeState | None:
        """An episode's stored state (None: none stored), or CorruptCheckpoint."""
        return _episode_state(rid, await self.redis.get(wire.ckpt_episode_key(rid)) or b"")

    async def read(self, rid: str) -> tuple[list[int], list[float]]:
        return unpack(await self.redis.get(wire.ckpt_tokens_key(rid)) or b"", rid)

    async def epoch(self, rid: str) -> int:
        raw = await self.redis.hget(wire.ckpt_meta_key(rid), "epoch") or b"0"
        try:
            return int(raw)
        except ValueError:
            raise CorruptCheckpoint(f"{rid}: epoch {raw[:40]!r} is not an integer") from None

    async def owner(self, rid: str) -> tuple[str, int, bool]:
        """(owner, epoch, finished) of the request's meta hash: what a result is checked against."""
        owner, epoch, finished = await self.redis.hmget(wire.ckpt_meta_key(rid), "owner", "epoch", "finished")
        try:
            return (owner or b"").decode("ascii"), int(epoch or 0), finished == b"1"
        except (UnicodeDecodeError, ValueError):
            raise CorruptCheckpoint(f"{rid}: meta hash does not parse") from None

    async def is_finished(self, rid: str) -> bool:
        return await self.redis.hget(wire.ckpt_meta_key(rid), "finished") == b"1"

    async def segments(self, rid: str) -> list[wire.Segment]:
        """Who generated which tokens, with which policy version; empty segments dropped.

        A history line that does not parse is skipped and logged, not raised: the history is
        provenance, the tokens are the result, and a finished result must never be lost to junk
        written next to it."""
        return _segments(rid, await self.redis.lrange(wire.ckpt_history_key(rid), 0, -1))

    async def is_held(self, rid: str) -> bool:
        """Someone holds the request's lease now (it expires with its holder)."""
        return bool(await self.redis.exists(wire.ckpt_lease_key(rid)))

    async def check(self, rid: str) -> None:
        """Raise CorruptCheckpoint if any of the request's keys holds what a claim refuses: a meta
        hash, tokens or episode state that do not parse, a key of another type. (A history line
        that does not parse is skipped by its readers, never a reason to start over.)"""
        try:
            await self.owner(rid)
            await self.read(rid)
            await self.episode(rid)
            await self.redis.lrange(wire.ckpt_history_key(rid), 0, 0)
        except ResponseError as e:  # WRONGTYPE: a key of another type than rlboost writes there
            raise CorruptCheckpoint(f"{rid}: {e}") from None

    async def reset(self, rid: str) -> None:
        """Start the request over (the trainer's redo of a request whose checkpoint holds junk):
        its tokens, episode state, history and lease are deleted, so whoever holds the lease is
        fenced out (its next write is refused) and the next claim starts from the prompt. The
        epoch is kept past every epoch issued (an epoch is never issued twice): the next claim
        takes max(epoch + 1, server time), and a meta hash too corrupt to read is replaced by one
        whose epoch is the server time plus a minute. Needs the trainer role (DEL)."""
        await self.redis.eval(_RESET, 5, *(wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid),
                                           wire.ckpt_tokens_key(rid), wire.ckpt_history_key(rid),
                                           wire.ckpt_episode_key(rid)))



class _Cluster(RedisCluster):
    """redis-py's async cluster client closes all of a node's connections when one of them
    fails, under the feet of other tasks using them: those raise AttributeError (the socket
    writer is gone). Report that as the lost connection it is, so callers retry or hand the
    request back as after any Redis outage, instead of an admission task dying with it."""

    async def execute_command(self, *args, **kwargs):
        try:
            return await super().execute_command(*args, **kwargs)
        except AttributeError as e:
            raise RedisConnectionError(f"connection closed under this call: {e}") from e


def _connect(url: str, max_connections: int, timeout_s: float) -> aioredis.Redis | RedisCluster:
    """A pooled client. `redis+sentinel://[user:pass@]host:port[,host:port]/<master>[/db]` asks
    the sentinels for the primary, and again after a failover; `redis+cluster://[user:pass@]
    host:port[,host:port][/0]` is a Redis Cluster reached through those startup nodes (the
    client learns the slot map from them and follows MOVED/ASK)."""
    common = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                  # A restarted Redis closed our pooled connections: reconnect and retry (safe: a
                  # script that did run is refused the second time by its offset/epoch checks).
                  retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 6), retry_on_error=[RedisConnectionError])
    if not url.startswith(("redis+sentinel://", "redis+cluster://")):
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout_s * 2,
                                                        **common)
        return aioredis.Redis(connection_pool=pool)
    parts = urlsplit(url)
    hosts = [(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1])) for h in parts.netloc.rsplit("@", 1)[-1].split(",")]
    auth = {"username": unquote(parts.username) if parts.username else None,
            "password": unquote(parts.password) if parts.password else None}
    if url.startswith("redis+cluster://"):  # a cluster has database 0 only
        return _Cluster(startup_nodes=[ClusterNode(h, p) for h, p in hosts], max_connections=max_connections,
                            **auth, **common)
    master, _, db = parts.path.strip("/").partition("/")
    sentinel = Sentinel(hosts, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    return sentinel.master_for(master or "rb", db=int(db or 0), max_connections=max_connections, **auth, **common)


def _segments(rid: str, lines: list[bytes]) -> list[wire.Segment]:
    segs = []
    for raw in lines:
        try:
            segs.append(parse_segment(raw))
        except CorruptCheckpoint as e:
            log.warning("skipping corrupt history line", request_id=rid, error=str(e))
    return [s for i, s in enumerate(segs) if i + 1 == len(segs) or segs[i + 1].offset != s.offset]


def _state_bytes(rid: str, state: wire.EpisodeState) -> bytes:
    """An episode state as stored, checked first: a state the door would refuse is never written."""
    data = wire.encode(state)
    try:
        wire.decode(wire.EpisodeState, data)
    except wire.WireError as e:
        raise CheckpointError(f"{rid}: refusing to store an invalid episode state: {e}") from None
    return data


def _episode_state(rid: str, raw: bytes) -> wire.EpisodeState | None:
    """The episode door: stored bytes become an EpisodeState, None (nothing stored) or CorruptCheckpoint."""
    if not raw:
        return None
    try:
        return wire.decode(wire.EpisodeState, raw)
    except wire.WireError as e:
        raise CorruptCheckpoint(f"{rid}: episode state: {e}") from None


def _bulks(parts: Sequence[bytes]) -> bytes:
    """Bulk strings of the Redis protocol (RESP); a command is an array of them."""
    out = []
    for p in parts:
        out += (b"$%d\r\n" % len(p), p, b"\r\n")
    return b"".join(out)


def _append_replies(reply: object, n: int) -> list[object]:
    """The reply of one batched append call -> one outcome per request (see _APPEND_MANY)."""
    if isinstance(reply, Exception):  # the whole call failed
        return [reply] * n
    try:
        codes, *errors = reply  # type: ignore[misc]
        out: list[object] = [int(c) for c in codes.split(b",")] if n else []
    except (TypeError, ValueError, AttributeError):
        return [CheckpointError(f"unexpected reply {reply!r:.80}")] * n
    if len(out) != n:
        return [CheckpointError(f"{len(out)} outcomes for {n} appends")] * n
    errors.reverse()
    return [errors.pop() if c == REDIS_REFUSED and errors else c for c in out]


def _append_outcome(rid: str, epoch: int, offset: int, reply: object) -> int | CheckpointError:
    if isinstance(reply, (Exception, bytes, str)):  # a call that failed, or a command one request's pcall caught
        return CheckpointError(f"{rid}: {reply.decode(errors='replace') if isinstance(reply, bytes) else reply}")
    n = int(reply)  # type: ignore[arg-type]
    return lua_error("append", n, f"{rid} (epoch {epoch}, at {offset})") or n


def _released(rid: str, epoch: int, reply: object) -> object:
    """A release's reply as a history outcome."""
    if isinstance(reply, Exception) or reply == 1:
        return reply
    return LeaseLost(f"{rid} (epoch {epoch}): release of a stale epoch")
