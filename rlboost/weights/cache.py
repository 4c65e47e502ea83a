"""The weight store, worker side: pull policy versions into a verified local cache.

`WeightCache.ensure(version)` returns a directory holding exactly that version's tensors, every
one hash-verified, or raises — there is no code path that hands out a different version.

`WeightCache` coordinates; each question has its own module:
- `plan`: which ways lead to the version given what is cached (a snapshot and the deltas after
  it, a cached base and its deltas, a snapshot delta), cheapest in bytes first;
- `fetch`: getting each blob verified, from peers (rlboost/weights/peers.py) or the origin store;
- `peer_versions`: a version rebuilt from deltas taken whole from a peer that holds it;
- `origin`: the store read with retries and back-off, manifests, snapshot deltas;
- `disk`: the content-addressed cache on disk and what this process verified in it.

Here: the ways are tried in order. A way from a cached version replays its deltas on it; a way
from a snapshot fetches its shards (the target is that snapshot: linked into its version dir) or,
when the snapshot is only a base, receives its shards unhashed while the deltas are replayed on
each tensor whose shard is in (`_from_base_snapshot`): the target's SHA-256 of every rebuilt
tensor checks every byte used. A reconstruction checks every tensor against the target's
manifest; a blob that does not match its name is fetched again, a delta that does not rebuild
its tensor is refused (`DeltaCorrupt`) and the next way is tried, down to the version's own
snapshot when it has one. Nothing is placed in `versions/` unverified, and only `versions/` dirs
are handed to engines. Reading is safetensors only, zero-copy, never pickle.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from rlboost.logs import get_logger
from rlboost.weights.blobstore import BlobStore
from rlboost.weights.disk import CacheDir, Step, file_sha256
from rlboost.weights.errors import DeltaCorrupt, ShardCorrupt, StoreError, VersionUnavailable
from rlboost.weights.fetch import BlobFetcher, all_or_none
from rlboost.weights.manifest import Manifest, ShardEntry
from rlboost.weights.origin import Origin
from rlboost.weights.peer_versions import PeerVersions
from rlboost.weights.peerhttp import PeerServer
from rlboost.weights.peers import PeerNetwork, open_peers_bucket
from rlboost.weights.plan import Planner
from rlboost.weights.safetensors_io import load_tensors
from rlboost.weights.stats import CacheStats

if TYPE_CHECKING:
    import torch
    from nats.js import JetStreamContext

    from rlboost.config import WeightsSettings

log = get_logger(component="weights")

__all__ = ["WeightCache", "VerifiedVersion", "CacheStats", "peer_cache"]


@dataclass(frozen=True)
class VerifiedVersion:
    """Exactly `version`'s shards, each verified against the manifest, in `path`
    (manifest.json + `<sha256>.safetensors`). Pass `path` to the engine's reload hook."""

    version: int
    path: Path
    manifest: Manifest

    def load_tensors(self) -> dict[str, torch.Tensor]:
        return load_tensors(self.path, expect_version=self.version)


class WeightCache:
    """Worker side: a local content-addressed cache of shards and per-version directories
    (`rlboost.weights.disk` says the layout), filled from `store` and, with `peers`, from
    other workers' caches first."""

    def __init__(self, root: str | os.PathLike[str], store: BlobStore, *, parallel: int = 4,
                 retry_deadline_s: float = 60.0, corrupt_retries: int = 3, keep_versions: int = 3,
                 peers: PeerNetwork | None = None) -> None:
        # versions kept on disk after each pull (0: keep all): a version rebuilt from deltas is a
        # full copy, so an unpruned cache grows by a model per version
        self.keep_versions = keep_versions
        self.parallel = parallel
        self.stats = CacheStats()
        self._disk = CacheDir(root, self.stats, advertise=peers.advertise if peers is not None else None,
                              withdraw=peers.withdraw_soon if peers is not None else None)
        self.root, self.shards_dir, self.deltas_dir, self.versions_dir, self.tmp_dir = (
            self._disk.root, self._disk.shards_dir, self._disk.deltas_dir, self._disk.versions_dir, self._disk.tmp_dir)
        self._origin = Origin(store, retry_deadline_s=retry_deadline_s, corrupt_retries=corrupt_retries)
        self._plan = Planner(self._origin, self._disk)
        self._fetch = BlobFetcher(self._disk, self._origin, self.stats, parallel=parallel, peers=peers)
        self._whole = PeerVersions(peers, self._disk, self.stats, self._fetch.sem, self._fetch.pool) \
            if peers is not None else None
        self._ensuring = 0
        self._locks: dict[int, asyncio.Lock] = {}
        self._copies: dict[str, list] = {}  # sha -> [receiving task, pulls using it] (see _copy)

    # the store and its patience are the origin's, the peers the fetcher's (one owner each)
    @property
    def store(self) -> BlobStore:
        return self._origin.store

    @store.setter
    def store(self, store: BlobStore) -> None:
        self._origin.store = store

    @property
    def retry_deadline_s(self) -> float:
        return self._origin.retry_deadline_s

    @retry_deadline_s.setter
    def retry_deadline_s(self, seconds: float) -> None:
        self._origin.retry_deadline_s = seconds

    @property
    def corrupt_retries(self) -> int:
        return self._origin.corrupt_retries

    @property
    def peers(self) -> PeerNetwork | None:
        """Other workers' caches as sources ahead of the store (rlboost/weights/peers.py); None: the store only."""
        return self._fetch.peers

    # -- the one entry point that matters

    async def ensure(self, version: int, *, wait_s: float = 0.0) -> VerifiedVersion:
        """Return `version`'s verified directory, fetching what the cache lacks, or raise
        `VersionUnavailable` / `ShardCorrupt` / `StoreUnavailable`. Never another version.

        `wait_s`: a request may name a version whose manifest is not in the store yet (the
        trainer is still uploading); keep looking for that long before giving up."""
        self._ensuring += 1
        try:
            vv = await self._ensure(version, wait_s)
        finally:
            self._ensuring -= 1
        if self.keep_versions and not self._ensuring:
            # on the event loop, not a thread: no other pull can start linking shards meanwhile
            # (unlinking files and a few directories is quick)
            self.prune(self.keep_versions, (version,))
        return vv

    async def _ensure(self, version: int, wait_s: float) -> VerifiedVersion:
        lock = self._locks.setdefault(version, asyncio.Lock())
        async with lock:
            manifest = await self._plan.manifest(version, wait_s)
            found = VerifiedVersion(version, self._disk.vdir(version), manifest)
            if await self._disk.cached(manifest):
                return found
            refused: list[StoreError] = []
            if self._whole is not None and not manifest.shards and manifest.delta is not None \
                    and not (self._disk.vdir(manifest.delta.base) / "manifest.json").exists() \
                    and await self._whole.take(manifest):  # not a follower: a peer's whole copy
                return found
            for cost, cached, start, chain in await self._plan.paths(manifest):
                try:
                    t0 = time.perf_counter()
                    await self._fetch.ensure_all([(b, True) for _, d in chain for b in d.blobs])  # small
                    if cached:
                        self.stats.fetch_s += time.perf_counter() - t0
                        await self._rebuild(start, chain, None)
                    else:
                        await self._from_snapshot(start, chain, t0)
                    if chain and self.peers is not None:  # rebuilt: served whole to late joiners
                        await self.peers.advertise_version(manifest.digest())
                    return found
                except (ShardCorrupt, VersionUnavailable) as e:  # DeltaCorrupt is a ShardCorrupt
                    self.stats.paths_refused += 1
                    refused.append(e)
                    log.warning("weights path refused; trying the next", version=version, start=start.version,
                                deltas=[m.version for m, _ in chain], bytes=cost, error=str(e))
            if refused:
                raise refused[-1]
            raise VersionUnavailable(f"weights version {version}: no snapshot and no cached base to "
                                     f"rebuild it from in {self.store.location}")

    async def _from_snapshot(self, start: Manifest, chain: list[Step], t0: float) -> None:
        if chain:
            return await self._from_base_snapshot(start, chain, t0)
        try:  # the target is this snapshot: its shards, each verified, linked into its version dir
            await self._fetch.ensure_all([(s, False) for s in start.shards])
        finally:
            self.stats.fetch_s += time.perf_counter() - t0
        await asyncio.to_thread(self._disk.link_version, start)  # ensure() holds this version's lock

    async def _from_base_snapshot(self, start: Manifest, chain: list[Step], t0: float) -> None:
        """A snapshot that is only a base (a late joiner's nearest snapshot; the target is a delta
        version after it). The shards the cache lacks are received into tmp/ as they come, neither
        hashed nor kept, while the deltas are replayed on each tensor whose shard is in (the
        download overlaps the rebuild). The target's SHA-256 of every rebuilt tensor checks every
        byte used, so hashing the base too would only say which part was bad: that is done only
        on a mismatch. A damaged shard is received again (up to `corrupt_retries`); with none
        damaged, the delta is (DeltaCorrupt, the next path is tried). This saves a SHA-256 pass
        over a whole version, about a tenth of a late joiner's CPU."""
        held: dict[str, tuple[Path, list]] = {}  # sha -> (an unverified copy in tmp/, its `_copies` entry)
        try:
            for _attempt in range(self.corrupt_retries):
                ready = {s.sha256: threading.Event() for s in start.shards}
                failed: set[str] = set()

                async def one(shard: ShardEntry) -> None:
                    try:
                        fetching = self._fetch.inflight.get(shard.sha256)
                        if fetching is not None and shard.sha256 not in held:  # a pull of the snapshot
                            try:  # itself is fetching it, verified: use that
                                await asyncio.shield(fetching)
                            except asyncio.CancelledError:
                                if not fetching.cancelled():
                                    raise  # we were cancelled
                            except Exception:
                                pass  # that fetch failed: receive a copy of our own
                        if shard.sha256 not in held and not await self._disk.valid(shard, False):
                            held[shard.sha256] = await self._copy(shard)
                    except BaseException:
                        failed.add(shard.sha256)
                        raise
                    finally:
                        ready[shard.sha256].set()

                def shard_file(sha: str) -> Path:  # (rebuild thread) once it is in
                    ready[sha].wait()
                    if sha in failed:
                        raise _Abandoned(sha)
                    return held[sha][0] if sha in held else self._disk.shard_path(sha)

                fetches = [asyncio.create_task(one(sh)) for sh in start.shards]
                rebuild = asyncio.create_task(self._rebuild(start, chain, shard_file))
                try:
                    await all_or_none(fetches)
                except BaseException:
                    for event in ready.values():  # the rebuild thread gives up on what never came
                        event.set()
                    await asyncio.gather(rebuild, return_exceptions=True)
                    raise
                finally:
                    self.stats.fetch_s += time.perf_counter() - t0
                try:
                    return await rebuild
                except DeltaCorrupt:
                    damaged = [sh for sh in start.shards if sh.sha256 in held and
                               await asyncio.to_thread(file_sha256, held[sh.sha256][0]) != sh.sha256]
                    if not damaged:
                        raise  # the base is what the manifest says: a delta is corrupt
                    for sh in damaged:
                        self._disk.refuse(sh, "received copy hash mismatch", sh.size)
                        self._drop_copy(sh.sha256, held.pop(sh.sha256)[1], damaged=True)
                t0 = time.perf_counter()
            raise ShardCorrupt(f"snapshot v{start.version} from {self.store.location} failed verification "
                               f"{self.corrupt_retries} times; refusing to load it")
        finally:
            for sha, (_, entry) in held.items():
                self._drop_copy(sha, entry)

    async def _copy(self, shard: ShardEntry) -> tuple[Path, list]:
        """An unverified copy of a base snapshot's shard in tmp/, shared by the pulls that need it
        at the same time (a late joiner asked for two versions after one snapshot receives it
        once). Returns (path, entry); give it back with `_drop_copy(sha, entry)`."""
        entry = self._copies.get(shard.sha256)
        if entry is None:
            entry = self._copies[shard.sha256] = [asyncio.ensure_future(self._fetch.receive(shard)), 0]
        entry[1] += 1
        try:
            return await asyncio.shield(entry[0]), entry
        except BaseException:
            self._drop_copy(shard.sha256, entry)
            raise

    def _drop_copy(self, sha: str, entry: list, damaged: bool = False) -> None:
        """One pull is done with a copy: the last one deletes it (a damaged one is not handed out again)."""
        entry[1] -= 1
        if (damaged or entry[1] == 0) and self._copies.get(sha) is entry:
            del self._copies[sha]
        if entry[1] == 0:
            task = entry[0]
            if not task.done():
                task.cancel()
            elif not task.cancelled() and task.exception() is None:
                task.result().unlink(missing_ok=True)

    async def _rebuild(self, start: Manifest, chain: list[Step],
                       shard_file: Callable[[str], Path] | None) -> None:
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self._disk.rebuilt, start, chain, shard_file, self.parallel)
        finally:
            self.stats.rebuild_s += time.perf_counter() - t0
        self.stats.reconstructed += 1

    # -- what peers are served, and housekeeping (the disk's)

    def open_version_file(self, digest: str, index: int) -> BinaryIO | None:
        """See `CacheDir.open_version_file`: a checked rebuilt version's file i, else None."""
        return self._disk.open_version_file(digest, index)

    def open_verified(self, sha: str) -> BinaryIO | None:
        """See `CacheDir.open_verified`: a blob this process hashed itself and that is unchanged, else None."""
        return self._disk.open_verified(sha)

    def close(self) -> None:
        """Stop the hashing threads (the cache directory stays as it is)."""
        self._fetch.close()

    def cached_versions(self) -> list[int]:
        return self._disk.cached_versions()

    def prune(self, keep: int, also_keep: Iterable[int] = ()) -> list[int]:
        """Drop all but the newest `keep` version dirs (and `also_keep`, e.g. versions still
        serving requests), then shards no remaining version uses. Returns dropped versions."""
        return self._disk.prune(keep, also_keep, fetching=self._fetch.inflight)


async def peer_cache(root: str | os.PathLike[str], store: BlobStore, js: JetStreamContext, peer_id: str,
                     cfg: WeightsSettings, **cache_options) -> tuple[WeightCache, PeerServer]:
    """A worker's weight cache with peers on (`[weights] peers`): its server started, bound to
    `peer_host`, and its URL (`peer_advertise` or the bound host) used in adverts. The token is
    read from the environment variable `peer_token_env` names; a non-loopback address needs one."""
    token = os.environ.get(cfg.peer_token_env, "") if cfg.peer_token_env else ""
    network = PeerNetwork(await open_peers_bucket(js), peer_id, token=token, tries=cfg.peer_tries,
                          wait_s=cfg.peer_wait_s)
    cache = WeightCache(Path(root), store, peers=network, **cache_options)
    server = PeerServer(cache, host=cfg.peer_host, port=cfg.peer_port, token=token,
                        max_serving=cfg.peer_max_serving, advertise_host=cfg.peer_advertise)
    try:
        network.url = await server.start()
    except OSError as e:
        cache.close()
        raise StoreError(f"weights.peer_host {cfg.peer_host}:{cfg.peer_port}: cannot serve peers: {e}") from e
    return cache, server


class _Abandoned(StoreError):
    """(rebuild thread) a shard it waits for will not come: the fetch's own error is raised."""
