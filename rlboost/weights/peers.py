"""Peers serve each other: who holds which blob, and who is fetching it from the origin.

A worker whose cache holds a blob (a snapshot shard or a delta blob) verified serves it over
HTTP (`peerhttp.PeerServer`) and says so in the `rb-peers` KV bucket, one entry per blob:
`blob.<sha256>` -> `BlobHolders` {holders: worker id -> URL, claim: the worker fetching it from
the origin now, claim_ts}. Every change is a compare-and-set on that one entry (KV revision), so
concurrent workers never lose each other's updates.

A pull (`rlboost.weights.fetch`, a `WeightCache` with `peers=`) then takes each blob:
1. from up to `tries` holders, in random order (spreads the load); a busy one (503) is tried
   again a little later, one that fails or lies is not asked again for this blob;
2. if none holds it: claims it and fetches it from the origin, keeping the claim fresh while it
   does, then advertises it (which clears the claim) - everyone else waits for that and takes
   it from this worker (or from whoever took it from this worker), so the origin serves each
   blob about once however many workers pull the version at the same moment;
3. a claim not refreshed for `claim_stale_s` (its worker died) is taken over; past `wait_s`
   without a usable source the pull reads the origin itself, as it does without peers.
Every byte from a peer is hashed against the manifest as it arrives and a copy that does not
match is refused (`CacheStats.peer_rejected`): a lying peer costs a retry, never a wrong weight.
The directory is advisory only: a stale or forged entry costs a failed request.

A version rebuilt from deltas is served whole too: its cache's files are the same bytes on every
worker (the layout follows from the manifest, every tensor's bytes are its SHA-256), so a worker
advertises `version.<manifest digest>` and serves its files; a late joiner with an empty cache
takes the version from such a holder, file by file, checking the header and every tensor's
SHA-256 as the bytes arrive (`rlboost.weights.peer_versions`), instead of the nearest snapshot
and the deltas since. It replays nothing, as a plain snapshot pull does not.

Not done here: a base snapshot a late joiner only replays deltas on (`WeightCache._from_base_snapshot`) is
not kept, so it is neither claimed nor advertised (its shards come from peers that pulled that
snapshot version, else from the origin); a version is not claimed (a joiner that finds no holder
takes the snapshot and the deltas since, and serves the version it rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.weights.peerhttp import PeerBusy, PeerError, PeerServer, read_blob, read_version_file

log = get_logger(component="peers")

__all__ = ["PeerNetwork", "BlobHolders", "PeerBusy", "PeerError", "PeerServer", "open_peers_bucket"]

PEERS_TTL_S = 24 * 3600.0  # an entry nobody touched for a day is dropped (the blob is long gone)


class BlobHolders(msgspec.Struct, kw_only=True):
    holders: dict[str, str] = msgspec.field(default_factory=dict)  # worker id -> peer URL, newest last
    claim: str = ""  # the worker fetching the blob from the origin for everyone ("" = none)
    claim_ts: float = 0.0  # its wall clock when it last refreshed the claim


async def open_peers_bucket(js: JetStreamContext, replicas: int = 1):
    """The `rb-peers` KV bucket (the trainer provisions it; created here when missing and allowed)."""
    try:
        return await js.key_value(wire.BUCKET_PEERS)
    except NotFoundError:
        try:
            return await js.create_key_value(KeyValueConfig(bucket=wire.BUCKET_PEERS, history=1, ttl=PEERS_TTL_S,
                                                            replicas=replicas))
        except BadRequestError:  # a concurrent creator won
            return await js.key_value(wire.BUCKET_PEERS)


class PeerNetwork:
    """One worker's view of its peers (what `WeightCache(peers=...)` takes). `url` is set once
    this worker's own `PeerServer` is up: only then does it advertise and claim blobs."""

    def __init__(self, kv, peer_id: str, *, token: str = "", tries: int = 3, wait_s: float = 30.0,
                 claim_stale_s: float = 10.0, max_holders: int = 32) -> None:
        self.kv = kv
        self.peer_id = wire.check_name("peer id", peer_id)
        self.token = token
        self.tries = max(1, tries)
        self.wait_s = wait_s
        self.claim_stale_s = claim_stale_s
        self.max_holders = max_holders
        self.url = ""
        self._advertised: set[str] = set()
        self._background: set[asyncio.Task] = set()

    # -- reading

    async def state(self, sha: str) -> BlobHolders:
        """The blob's entry; an empty one if there is none or the bucket does not answer (the
        pull then goes to the origin, as without peers)."""
        return await self._state(wire.peer_blob_key(sha))

    async def version_state(self, digest: str) -> BlobHolders:
        """Who serves the version of this manifest digest whole (empty: nobody, or no answer)."""
        return await self._state(wire.peer_version_key(digest))

    async def _state(self, key: str) -> BlobHolders:
        try:
            entry = await self.kv.get(key)
            return msgspec.json.decode(entry.value, type=BlobHolders)
        except KeyNotFoundError:
            return BlobHolders()
        except Exception as e:
            log.warning("peer directory unreadable", key=key[:24], error=repr(e))
            return BlobHolders()

    def read(self, url: str, sha: str) -> AsyncIterator[bytes]:
        return read_blob(url, sha, token=self.token)

    def read_version(self, url: str, digest: str, index: int, start: int, stop: int) -> AsyncIterator[bytes]:
        return read_version_file(url, digest, index, start, stop, token=self.token)

    def live_claim(self, st: BlobHolders) -> bool:
        """Someone else is fetching it from the origin and was alive a moment ago."""
        return bool(st.claim) and st.claim != self.peer_id and time.time() - st.claim_ts < self.claim_stale_s

    # -- writing (compare-and-set on the blob's entry)

    async def _change(self, sha: str, fn, key: str = "") -> BlobHolders | None:
        """Apply `fn(entry) -> new entry | None (no change)` atomically to blob `sha`'s entry (or
        to `key`'s); the entry after it, or None when the bucket did not answer (every caller
        treats that as "no peers")."""
        key = key or wire.peer_blob_key(sha)
        try:
            for _ in range(32):
                try:
                    entry = await self.kv.get(key)
                    cur, rev = msgspec.json.decode(entry.value, type=BlobHolders), entry.revision
                except KeyNotFoundError:
                    cur, rev = BlobHolders(), None
                new = fn(cur)
                if new is None:
                    return cur
                try:
                    data = msgspec.json.encode(new)
                    await (self.kv.create(key, data) if rev is None else self.kv.update(key, data, last=rev))
                    return new
                except (KeyWrongLastSequenceError, BadRequestError):  # another worker changed it first
                    await asyncio.sleep(random.random() * 0.02)
            raise TimeoutError("too much contention")
        except Exception as e:
            log.warning("peer directory not updated", key=key[:24], error=repr(e))
            return None

    async def claim(self, sha: str, exclude: set[str] = frozenset()) -> bool:
        """Become the worker that fetches `sha` from the origin: only if nobody usable holds it
        (holders not in `exclude`) and nobody else has a live claim. False also when this
        worker serves nothing (`url` unset): it could not hand the blob on."""
        if not self.url:
            return False

        def fn(cur: BlobHolders) -> BlobHolders | None:
            if any(h not in exclude and h != self.peer_id for h in cur.holders) or self.live_claim(cur):
                return None
            cur.claim, cur.claim_ts = self.peer_id, time.time()
            return cur

        st = await self._change(sha, fn)
        return st is not None and st.claim == self.peer_id

    async def release(self, sha: str) -> None:
        """Give a claim up (the origin fetch failed): the next worker claims it."""
        await self._change(sha, lambda cur: _cleared(cur, self.peer_id))

    @contextlib.asynccontextmanager
    async def claimed(self, sha: str):
        """Keep this worker's claim fresh while the body runs (a fetch of a large blob outlasts
        `claim_stale_s`); give it up when the body fails."""

        async def refresh() -> None:
            while True:
                await asyncio.sleep(self.claim_stale_s / 4)
                await self._change(sha, lambda cur: _refreshed(cur, self.peer_id))

        task = asyncio.create_task(refresh())
        try:
            yield
        except BaseException:
            task.cancel()
            await asyncio.shield(self.release(sha))
            raise
        finally:
            task.cancel()

    async def advertise(self, sha: str, key: str = "") -> None:
        """This worker holds `sha` verified and serves it (clears its own claim in the same write);
        with `key`, that entry instead (`advertise_version`)."""
        if not self.url:
            return
        key = key or wire.peer_blob_key(sha)

        def fn(cur: BlobHolders) -> BlobHolders | None:
            if cur.holders.get(self.peer_id) == self.url and cur.claim != self.peer_id:
                return None
            cur.holders.pop(self.peer_id, None)
            cur.holders[self.peer_id] = self.url  # newest last
            while len(cur.holders) > self.max_holders:  # the oldest entries go (likely long gone)
                cur.holders.pop(next(iter(cur.holders)))
            return _cleared(cur, self.peer_id) or cur

        if await self._change(sha, fn, key) is not None:
            self._advertised.add(key)

    async def advertise_version(self, digest: str) -> None:
        """This worker holds the version of manifest `digest` whole, verified, and serves its files."""
        await self.advertise("", wire.peer_version_key(digest))

    async def withdraw(self, sha: str, key: str = "") -> None:
        key = key or wire.peer_blob_key(sha)
        self._advertised.discard(key)
        await self._change(sha, lambda cur: cur if cur.holders.pop(self.peer_id, None) else None, key)

    def withdraw_soon(self, sha: str = "", key: str = "") -> None:
        """(from sync code: the cache's prune) best effort, in the background."""
        key = key or wire.peer_blob_key(sha)
        if key not in self._advertised:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the stale entry costs a 404
            task = asyncio.get_running_loop().create_task(self.withdraw(sha, key))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Withdraw every advert (the server is going away), within `timeout_s`."""
        keys = list(self._advertised)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(self.withdraw("", k) for k in keys), *self._background,
                                                  return_exceptions=True), timeout_s)
        self.url = ""


def _cleared(cur: BlobHolders, peer_id: str) -> BlobHolders | None:
    if cur.claim != peer_id:
        return None
    cur.claim, cur.claim_ts = "", 0.0
    return cur


def _refreshed(cur: BlobHolders, peer_id: str) -> BlobHolders | None:
    if cur.claim != peer_id:
        return None  # taken over (we stalled past claim_stale_s): the fetch goes on regardless
    cur.claim_ts = time.time()
    return cur
