"""Token checkpoints in Redis, with leases and fencing.

Each in-flight request has a packed array of (int32 token id, float32 behaviour logprob) records
that its current owner appends to. Ownership is a lease: claiming bumps a strictly increasing
epoch (the fencing token), and every append/finish carries the writer's epoch. A Lua script
checks epoch and offset and writes in one atomic step, so a worker that was paused (SIGSTOP)
and resumed after another worker took the request over learns it lost the lease and cannot
corrupt what the new owner writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from rlboost import wire

RECORD = np.dtype([("token", "<i4"), ("logprob", "<f4")])

_CLAIM = """
local meta, lease, hist, tok = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, ttl, version, steal, keep = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5])
if redis.call('HGET', meta, 'finished') == '1' then
  return {-1, tonumber(redis.call('HGET', meta, 'epoch') or '0'), ''}
end
local cur = redis.call('GET', lease)
if cur and steal ~= '1' and string.match(cur, '^(%S+)') ~= owner then
  return {-2, redis.call('PTTL', lease), cur}
end
local epoch = redis.call('HINCRBY', meta, 'epoch', 1)
redis.call('HSET', meta, 'owner', owner)
redis.call('SET', lease, owner .. ' ' .. epoch, 'PX', ttl)
local data = redis.call('GET', tok) or ''
redis.call('RPUSH', hist, owner .. ' ' .. epoch .. ' ' .. (string.len(data) / 8) .. ' ' .. version)
for _, k in ipairs({meta, hist, tok}) do redis.call('EXPIRE', k, keep) end
return {epoch, 0, data}
"""

_APPEND = """
local meta, lease, tok = KEYS[1], KEYS[2], KEYS[3]
local m = redis.call('HMGET', meta, 'epoch', 'finished')
if m[1] ~= ARGV[1] then return -1 end
if m[2] == '1' then return -3 end
if redis.call('STRLEN', tok) ~= tonumber(ARGV[2]) * 8 then return -2 end
local len = redis.call('APPEND', tok, ARGV[3]) / 8
if redis.call('PEXPIRE', lease, ARGV[4]) == 0 then
  redis.call('SET', lease, ARGV[5] .. ' ' .. ARGV[1], 'PX', ARGV[4])
end
return len
"""

_FINISH = """
local meta, lease, tok = KEYS[1], KEYS[2], KEYS[3]
local epoch, total = tonumber(ARGV[1]), tonumber(ARGV[2])
if tonumber(redis.call('HGET', meta, 'epoch') or '0') ~= epoch then return -1 end
if redis.call('STRLEN', tok) / 8 ~= total then return -2 end
redis.call('HSET', meta, 'finished', '1')
redis.call('DEL', lease)
return 1
"""

_RENEW = """
local meta, lease = KEYS[1], KEYS[2]
local epoch, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
if tonumber(redis.call('HGET', meta, 'epoch') or '0') ~= epoch then return -1 end
if redis.call('HGET', meta, 'finished') == '1' then return -3 end
redis.call('SET', lease, ARGV[3] .. ' ' .. epoch, 'PX', ttl)
return 1
"""

_RELEASE = """
local meta, lease = KEYS[1], KEYS[2]
if tonumber(redis.call('HGET', meta, 'epoch') or '0') ~= tonumber(ARGV[1]) then return -1 end
redis.call('DEL', lease)
return 1
"""


class CheckpointError(RuntimeError):
    pass


class LeaseLost(CheckpointError):
    """The writer's epoch is stale: another worker owns the request now. Drop it."""


class LeaseHeld(CheckpointError):
    """Another live owner holds the lease; retry after `retry_after_s`."""

    def __init__(self, rid: str, holder: str, retry_after_s: float) -> None:
        super().__init__(f"{rid} is leased by {holder} for {retry_after_s:.2f}s more")
        self.holder, self.retry_after_s = holder, retry_after_s


class AlreadyFinished(CheckpointError):
    """The request already has its result; whoever holds the message should just ack it."""


class OffsetMismatch(CheckpointError):
    """An append that does not continue exactly where the checkpoint ends (a bug, never silent)."""


@dataclass(frozen=True, slots=True)
class Claim:
    epoch: int
    token_ids: list[int]
    logprobs: list[float]


def pack(token_ids: Sequence[int], logprobs: Sequence[float]) -> bytes:
    if len(token_ids) != len(logprobs):
        raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
    rec = np.empty(len(token_ids), dtype=RECORD)
    rec["token"] = token_ids
    rec["logprob"] = logprobs
    return rec.tobytes()


def unpack(data: bytes) -> tuple[list[int], list[float]]:
    rec = np.frombuffer(data, dtype=RECORD)
    return rec["token"].tolist(), rec["logprob"].tolist()


class CheckpointStore:
    """Pooled async client over the checkpoint keys of `rlboost.wire`."""

    def __init__(self, url: str, max_connections: int = 32, keep_s: int = 86400) -> None:
        # BlockingConnectionPool waits for a free connection instead of raising under load.
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=30)
        self.redis = aioredis.Redis(connection_pool=pool)
        self.keep_s = keep_s
        self._claim = self.redis.register_script(_CLAIM)
        self._append = self.redis.register_script(_APPEND)
        self._finish = self.redis.register_script(_FINISH)
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> None:
        await self.redis.ping()

    async def claim(self, rid: str, owner: str, policy_version: int, ttl_s: float, steal: bool = False) -> Claim:
        """Take the lease with a new epoch and get the tokens so far (to resume from)."""
        k = wire
        status, extra, data = await self._claim(
            keys=[k.ckpt_meta_key(rid), k.ckpt_lease_key(rid), k.ckpt_history_key(rid), k.ckpt_tokens_key(rid)],
            args=[owner, int(ttl_s * 1000), policy_version, "1" if steal else "0", self.keep_s],
        )
        if status == -1:
            raise AlreadyFinished(f"{rid} is finished")
        if status == -2:
            holder = data.decode() if isinstance(data, bytes) else str(data)
            raise LeaseHeld(rid, holder, max(extra, 0) / 1000)
        tokens, logprobs = unpack(data)
        return Claim(epoch=int(status), token_ids=tokens, logprobs=logprobs)

    async def append(self, rid: str, owner: str, epoch: int, offset: int, token_ids: Sequence[int],
                     logprobs: Sequence[float], ttl_s: float) -> int:
        (n,) = await self.append_many([(rid, owner, epoch, offset, token_ids, logprobs)], ttl_s)
        if isinstance(n, Exception):
            raise n
        return n

    async def append_many(self, appends: Sequence[tuple[str, str, int, int, Sequence[int], Sequence[float]]],
                          ttl_s: float) -> list[int | CheckpointError]:
        """Fenced appends of many requests in one pipeline (one round trip). Each entry is
        (rid, owner, epoch, offset, token_ids, logprobs); each outcome is the new length or the
        error for that request, so one lost lease does not fail the others."""
        ttl_ms = int(ttl_s * 1000)
        replies = await self._pipelined(self._append, [
            ((wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid), wire.ckpt_tokens_key(rid)),
             (epoch, offset, pack(toks, lps), ttl_ms, owner)) for rid, owner, epoch, offset, toks, lps in appends])
        return [_append_outcome(a[0], a[2], a[3], r) for a, r in zip(appends, replies, strict=True)]

    async def _pipelined(self, script, calls: list[tuple[tuple, tuple]]) -> list[object]:
        """Run one Lua script for many (keys, args) in one pipeline. EVALSHA directly: the
        Script wrapper's per-call bookkeeping costs more than Redis spends running the script."""
        for attempt in (1, 2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
            if attempt == 1 and any(isinstance(r, NoScriptError) for r in replies):
                await self.redis.script_load(script.script)  # Redis restarted and lost its script cache
                continue
            break
        return replies

    async def finish(self, rid: str, epoch: int, total_tokens: int) -> None:
        r = await self._finish(
            keys=[wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid), wire.ckpt_tokens_key(rid)],
            args=[epoch, total_tokens],
        )
        if r == -1:
            raise LeaseLost(f"{rid}: epoch {epoch} is stale, cannot finish")
        if r == -2:
            raise OffsetMismatch(f"{rid}: finish with {total_tokens} tokens does not match the checkpoint")

    async def renew(self, rid: str, owner: str, epoch: int, ttl_s: float) -> None:
        r = await self._renew(keys=[wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid)],
                              args=[epoch, int(ttl_s * 1000), owner])
        if r == -1:
            raise LeaseLost(f"{rid}: epoch {epoch} is stale, cannot renew")
        if r == -3:
            raise AlreadyFinished(f"{rid} is finished")

    async def release(self, rid: str, epoch: int) -> bool:
        """Give the lease up (drain/hand-off) so the next claimant need not wait for expiry."""
        return await self._release(keys=[wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid)], args=[epoch]) == 1

    async def release_many(self, leases: Sequence[tuple[str, int]]) -> list[bool]:
        """`release` for a whole drained batch in one round trip: (rid, epoch) -> released?"""
        replies = await self._pipelined(self._release, [
            ((wire.ckpt_meta_key(rid), wire.ckpt_lease_key(rid)), (epoch,)) for rid, epoch in leases])
        return [r == 1 for r in replies]

    async def read(self, rid: str) -> tuple[list[int], list[float]]:
        return unpack(await self.redis.get(wire.ckpt_tokens_key(rid)) or b"")

    async def epoch(self, rid: str) -> int:
        return int(await self.redis.hget(wire.ckpt_meta_key(rid), "epoch") or 0)

    async def is_finished(self, rid: str) -> bool:
        return await self.redis.hget(wire.ckpt_meta_key(rid), "finished") == b"1"

    async def segments(self, rid: str) -> list[wire.Segment]:
        """Who generated which tokens, with which policy version; empty segments dropped."""
        segs = []
        for raw in await self.redis.lrange(wire.ckpt_history_key(rid), 0, -1):
            owner, epoch, offset, version = raw.decode().split(" ")
            segs.append(wire.Segment(offset=int(offset), worker_id=owner, epoch=int(epoch), policy_version=int(version)))
        return [s for i, s in enumerate(segs) if i + 1 == len(segs) or segs[i + 1].offset != s.offset]


def _append_outcome(rid: str, epoch: int, offset: int, reply: object) -> int | CheckpointError:
    if isinstance(reply, Exception):
        return CheckpointError(f"{rid}: {reply}")
    n = int(reply)  # type: ignore[arg-type]
    if n == -1:
        return LeaseLost(f"{rid}: epoch {epoch} is stale")
    if n == -2:
        return OffsetMismatch(f"{rid}: append at {offset} does not continue the checkpoint")
    if n == -3:
        return AlreadyFinished(f"{rid} is finished")
    return n
