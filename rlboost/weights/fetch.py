"""Getting a blob (a snapshot shard or a delta blob) into the cache, verified: from peers first
when the cache has them, from the origin store otherwise.

Each blob is streamed into a tmp/ file through a worker thread that hashes and writes each chunk
as it comes, and only a copy of the right size and SHA-256 is moved into the cache
(`CacheDir.keep`); a refused copy is fetched again, from the origin up to `corrupt_retries` times.
A blob two pulls need at the same time is fetched once (`inflight`), at most `parallel` at a time.

With peers (rlboost/weights/peers.py): holders first (random order, up to `peers.tries` a round;
a busy one is asked again later, one that fails or lies is not asked again), else claim the blob
and fetch it from the origin for everyone, else wait for whoever claimed it; past `peers.wait_s`,
the origin. Every byte from a peer is hashed: a peer is not trusted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import queue
import random
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.weights.blobstore import Buffer
from rlboost.weights.disk import CacheDir
from rlboost.weights.errors import ObjectMissing, ShardCorrupt, VersionUnavailable
from rlboost.weights.manifest import ShardEntry
from rlboost.weights.origin import Origin
from rlboost.weights.peerhttp import PeerBusy, PeerError
from rlboost.weights.stats import CacheStats

if TYPE_CHECKING:
    from rlboost.weights.peers import PeerNetwork

log = get_logger(component="weights")

__all__ = ["BlobFetcher", "all_or_none"]


class BlobFetcher:
    def __init__(self, disk: CacheDir, origin: Origin, stats: CacheStats, *, parallel: int = 4,
                 peers: PeerNetwork | None = None) -> None:
        self.disk, self.origin, self.stats = disk, origin, stats
        # other workers' caches as sources ahead of the store (rlboost/weights/peers.py); None: the store only
        self.peers = peers
        self.inflight: dict[str, asyncio.Future[None]] = {}  # sha -> the fetch of it under way
        self.sem = asyncio.Semaphore(parallel)
        self.pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="weights-sink")

    def close(self) -> None:
        """Stop the hashing threads."""
        self.pool.shutdown(wait=False)

    async def ensure_all(self, blobs: list[tuple[ShardEntry, bool]]) -> None:
        """Fetch (shard or delta blob, is_delta) pairs the cache lacks, in parallel. One fetch
        failing stops the others: no fetch outlives the ensure() that started it."""
        if self.peers is not None:  # workers pulling the same version at once claim different blobs first
            blobs = random.sample(blobs, len(blobs))
        await all_or_none([asyncio.create_task(self.ensure(s, delta)) for s, delta in blobs])

    async def ensure(self, shard: ShardEntry, delta: bool = False) -> None:
        """The blob in the cache, verified: the cached copy, another pull's fetch of it, or ours."""
        while True:
            if await self.disk.valid(shard, delta):
                self.stats.shards_reused += 1
                return
            fut = self.inflight.get(shard.sha256)
            if fut is None:
                break
            try:  # another version being ensured right now shares this shard: wait for its fetch
                await asyncio.shield(fut)
                return
            except asyncio.CancelledError:
                if not fut.cancelled():
                    raise  # we were cancelled
                # its ensure() was given up: look again, fetch it ourselves if need be
        fut = asyncio.get_running_loop().create_future()
        self.inflight[shard.sha256] = fut
        try:
            async with self.sem:
                await self.origin.retrying(f"shard {shard.sha256[:12]}", lambda: self._fetch(shard, delta))
            fut.set_result(None)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters re-raise it, nobody logs "never retrieved"
            raise
        finally:
            del self.inflight[shard.sha256]

    async def receive(self, shard: ShardEntry) -> Path:
        """A snapshot shard's bytes in a tmp/ file of the right size, not hashed (a base snapshot
        that only the rebuilt tensors' hashes check, `WeightCache`): the caller checks and deletes it."""
        async with self.sem:
            return await self.origin.retrying(f"shard {shard.sha256[:12]}",
                                              lambda: self._fetch(shard, False, verify=False))

    async def _fetch(self, shard: ShardEntry, delta: bool, verify: bool = True) -> Path:
        """Receive a blob: from peers first when the cache has them (`rlboost.weights.peers`),
        from the origin store otherwise. `verify=False` (`receive`): the right size is enough
        for the origin's bytes (the caller checks them), and the tmp/ file itself is returned."""
        if self.peers is not None:
            return await self._fetch_peered(shard, delta, verify)
        return await self._fetch_origin(shard, delta, verify)

    async def _fetch_origin(self, shard: ShardEntry, delta: bool, verify: bool = True) -> Path:
        """From the store, refused copies fetched again up to `corrupt_retries` times."""
        store, retries = self.origin.store, self.origin.corrupt_retries
        key = (wire.weights_delta_key if delta else wire.weights_shard_key)(shard.sha256)
        for _attempt in range(retries):
            try:
                path = await self._take(store.read(key), shard, delta, verify, hashing=verify, source="origin")
            except ObjectMissing:
                raise VersionUnavailable(f"shard {shard.sha256} is gone from {store.location} "
                                         f"(its version was garbage-collected?)") from None
            if path is not None:
                return path
        raise ShardCorrupt(f"shard {shard.sha256} from {store.location} failed verification "
                           f"{retries} times; refusing to load it")

    async def _fetch_peered(self, shard: ShardEntry, delta: bool, verify: bool) -> Path:
        """Holders first, else claim it and fetch it from the origin for everyone, else wait for
        whoever claimed it; past `peers.wait_s`, the origin (see the module's docstring). Every
        byte from a peer is hashed, whatever `verify` says."""
        peers, sha = self.peers, shard.sha256
        bad: set[str] = {peers.peer_id}
        deadline = time.monotonic() + peers.wait_s
        claimed = False
        while time.monotonic() < deadline:
            st = await peers.state(sha)
            holders = [(h, url) for h, url in st.holders.items() if h not in bad]
            random.shuffle(holders)
            busy = False
            for h, url in holders[:peers.tries]:
                try:
                    path = await self._take(peers.read(url, sha), shard, delta, verify, hashing=True, source="peer")
                except PeerBusy:
                    busy = True
                    continue
                except PeerError as e:
                    bad.add(h)
                    log.info("peer could not serve a blob; trying the next source", blob=sha[:12], peer=h, error=str(e))
                    continue
                if path is None:
                    bad.add(h)
                    self.stats.peer_rejected += 1
                    log.warning("peer served a blob that failed verification; not asked again for it",
                                blob=sha[:12], peer=h, url=url)
                    continue
                self.stats.peer_blobs += 1
                if verify:
                    await peers.advertise(sha)
                return path
            if verify and peers.live_claim(st):  # its claimant is fetching it: wait as long as it is alive
                deadline = max(deadline, time.monotonic() + peers.claim_stale_s)
            if busy or (verify and peers.live_claim(st)):  # a holder, or a holder soon: wait a little
                await asyncio.sleep(0.05 + random.random() * 0.2)
                continue
            if not verify:  # a base snapshot's shard (not kept, so never served): the origin
                break
            if await peers.claim(sha, exclude=bad):
                claimed = True
                break
            await asyncio.sleep(0.05 + random.random() * 0.1)  # lost the race to claim it: look again
        if not claimed:
            return await self._fetch_origin(shard, delta, verify)
        async with peers.claimed(sha):
            path = await self._fetch_origin(shard, delta, verify)
        await peers.advertise(sha)  # the claim ends here: the waiters take it from us
        return path

    async def _take(self, source_chunks: AsyncIterator[Buffer], shard: ShardEntry, delta: bool, verify: bool,
                    hashing: bool, source: str) -> Path | None:
        """Stream one copy of the blob into a temp file through a worker thread that hashes and
        writes each chunk as it comes (hashlib and file writes release the GIL, so this overlaps
        with receiving; the event loop only hands over references). Only a file of the right
        size (and hash, if `hashing`) is kept: moved into the cache (`verify`) or returned as
        the tmp/ file itself (not `verify`). None: the copy was refused (counted and logged).
        `source` ("origin" or "peer") names the counter of the bytes received."""
        loop = asyncio.get_running_loop()
        tmp = self.disk.part_path(shard.sha256)
        chunks_q: queue.SimpleQueue[Buffer | None] = queue.SimpleQueue()
        sink = loop.run_in_executor(self.pool, _hash_to_file, tmp, chunks_q, hashing)
        n = 0
        try:
            try:
                async with contextlib.aclosing(source_chunks) as chunks:
                    async for chunk in chunks:
                        n += len(chunk)
                        if n > shard.size:
                            break  # longer than the manifest says: corrupt, stop reading
                        chunks_q.put(chunk)
            finally:
                chunks_q.put(None)
                if source == "peer":
                    self.stats.peer_bytes += n
                else:
                    self.stats.origin_bytes += n
                written, digest = await sink
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if n == written == shard.size and (not hashing or digest == shard.sha256):
            self.stats.bytes_fetched += n
            self.stats.shards_fetched += 1
            if not verify:
                return tmp  # never in shards/
            path = self.disk.keep(tmp, shard.sha256, delta)
            self.stats.delta_bytes_fetched += n if delta else 0
            return path
        tmp.unlink(missing_ok=True)
        reason = "truncated" if n < shard.size else "too long" if n > shard.size else "hash mismatch"
        self.disk.refuse(shard, f"received copy {reason}", n)
        return None


def _hash_to_file(path: Path, chunks: queue.SimpleQueue, hashing: bool = True) -> tuple[int, str]:
    """(thread) Write (and hash) chunks until None; returns (bytes, hex digest or "")."""
    h = hashlib.sha256() if hashing else None
    n = 0
    with open(path, "wb", buffering=0) as f:
        while (chunk := chunks.get()) is not None:
            if h is not None:
                h.update(chunk)
            f.write(chunk)
            n += len(chunk)
    return n, h.hexdigest() if h is not None else ""


async def all_or_none(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; if one fails (or the wait is cancelled), cancel the rest and wait
    for them too, so that no task outlives the call that started it."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
