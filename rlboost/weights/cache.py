"""The weight store, worker side: pull policy versions into a verified local cache.

`WeightCache.ensure(version)` returns a directory holding exactly that version's tensors, every
one hash-verified, or raises — there is no code path that hands out a different version.

The path: the manifests form a chain (a delta version names its base). Walking it back from the
wanted version, each snapshot on the way (shards the cache lacks + the deltas after it) and a
cached version that is exactly a delta's base (only the deltas after it) is a way there; the
cheapest in bytes to fetch is tried first. A version the publisher stored a snapshot delta for
(opt-in, `snapshot_deltas`: its change from the last snapshot in one delta,
`rlboost.weights.manifest.SnapshotDelta`) is also
a way there from that snapshot, cached or not: a late joiner with nothing cached so takes the
nearest snapshot and replays that one delta (or the deltas since, when there is none or it
fails); a follower holding the previous version takes its small delta and never reads the other.
A snapshot that is only a base is checked through the rebuilt tensors' hashes and not kept
(`_from_base_snapshot`). A reconstruction checks every
tensor's SHA-256 against the target's manifest; a blob that does not match its name
is fetched again, a delta that does not rebuild its tensor is refused (`DeltaCorrupt`) and the
next path is tried, down to the version's own snapshot when it has one. Nothing is placed in
`versions/` unverified, and only `versions/` dirs are handed to engines.

Missing shards and blobs are fetched in parallel; an unreachable store is retried with back-off
until a deadline, then reported clearly. With `peers` (rlboost/weights/peers.py) a blob is taken
from another worker that holds it verified before the store, and hashed all the same. Reading is
safetensors only, zero-copy, never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import queue
import random
import re
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.procs import pid_alive
from rlboost.weights import deltas
from rlboost.weights.blobstore import BlobStore, Buffer
from rlboost.weights.errors import (
    DeltaCorrupt,
    ObjectMissing,
    ShardCorrupt,
    StoreError,
    StoreUnavailable,
    VersionGone,
    VersionUnavailable,
)
from rlboost.weights.manifest import Delta, Manifest, ShardEntry, SnapshotDelta, check_shard_id
from rlboost.weights.peerhttp import PeerBusy, PeerError
from rlboost.weights.publisher import published_versions, read_snapshot_delta
from rlboost.weights.rebuild import BaseFiles, layout, rebuild, write_all
from rlboost.weights.safetensors_io import ITEMSIZE, RECONSTRUCTED_GLOB, load_tensors

if TYPE_CHECKING:
    import torch

    from rlboost.weights.peers import PeerNetwork

log = get_logger(component="weights")

__all__ = ["WeightCache", "VerifiedVersion", "CacheStats"]

_SHA_HEX = re.compile(r"[0-9a-f]{64}")
MAX_CHAIN = 64  # deltas a pull replays at most; the publisher's full_every keeps chains far shorter
Step = tuple[Manifest, Delta]  # a version and the delta replayed to reach it (its `delta`, or its snapshot delta)


@dataclass
class CacheStats:
    bytes_fetched: int = 0
    shards_fetched: int = 0
    shards_reused: int = 0  # already in the local cache, verified
    shards_refused: int = 0  # received or found corrupt / truncated, never used
    delta_bytes_fetched: int = 0  # of bytes_fetched, delta blobs
    reconstructed: int = 0  # versions rebuilt from deltas
    paths_refused: int = 0  # a way to a version that failed verification (another was tried)
    fetch_s: float = 0.0  # wall time fetching shards and blobs (hashing them as they arrive)
    rebuild_s: float = 0.0  # wall time replaying deltas, verifying and writing rebuilt versions
    # where the bytes came from (received, accepted or not): the origin store, or peers
    origin_bytes: int = 0
    peer_bytes: int = 0
    peer_blobs: int = 0  # blobs taken from a peer, verified
    peer_rejected: int = 0  # copies a peer served that failed verification (another source was tried)
    peer_versions: int = 0  # versions taken whole from a peer (nothing replayed)


PEER_PIECE_BYTES = 16 << 20  # a version taken whole from peers comes in pieces of about this size, in parallel


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
    """Worker side: a local content-addressed cache of shards and per-version directories.

    Layout under `root`: `shards/<sha256>.safetensors` (content-addressed, shared between
    versions), `versions/v<N>/` (manifest.json + hard links to the version's shards), `tmp/`.
    One cache dir per worker process (or per machine when workers share it read-mostly).
    """

    def __init__(self, root: str | os.PathLike[str], store: BlobStore, *, parallel: int = 4,
                 retry_deadline_s: float = 60.0, corrupt_retries: int = 3, keep_versions: int = 3,
                 peers: PeerNetwork | None = None) -> None:
        self.root = Path(root)
        self.store = store
        # other workers' caches as sources ahead of the store (rlboost/weights/peers.py); None: the store only
        self.peers = peers
        # versions kept on disk after each pull (0: keep all): a version rebuilt from deltas is a
        # full copy, so an unpruned cache grows by a model per version
        self.keep_versions = keep_versions
        self._ensuring = 0
        self.parallel = parallel
        self.retry_deadline_s = retry_deadline_s
        self.corrupt_retries = corrupt_retries
        self.stats = CacheStats()
        self.shards_dir, self.deltas_dir, self.versions_dir, self.tmp_dir = (
            self.root / d for d in ("shards", "deltas", "versions", "tmp"))
        for d in (self.shards_dir, self.deltas_dir, self.versions_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._clean_leftovers()
        self._verified: dict[str, tuple[int, int, int]] = {}  # sha -> (inode, size, mtime_ns) hashed OK
        self._verified_dirs: dict[int, str] = {}  # version -> manifest digest of a dir this process checked
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._copies: dict[str, list] = {}  # sha -> [receiving task, pulls using it] (see _copy)
        self._locks: dict[int, asyncio.Lock] = {}
        self._sem = asyncio.Semaphore(parallel)
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="weights-sink")

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
            manifest = await self._manifest(version, wait_s)
            if await self._cached(manifest):
                return VerifiedVersion(version, self._vdir(version), manifest)
            refused: list[StoreError] = []
            if self.peers is not None and not manifest.shards and manifest.delta is not None \
                    and not (self._vdir(manifest.delta.base) / "manifest.json").exists() \
                    and await self._from_peer_version(manifest):  # not a follower: a peer's whole copy
                return VerifiedVersion(version, self._vdir(version), manifest)
            for cost, cached, start, chain in await self._paths(manifest):
                try:
                    t0 = time.perf_counter()
                    await self._fetch_all([(b, True) for _, d in chain for b in d.blobs])  # small
                    if cached:
                        self.stats.fetch_s += time.perf_counter() - t0
                        await self._rebuild(start, chain, None)
                    else:
                        await self._from_snapshot(start, chain, t0)
                    if chain and self.peers is not None:  # rebuilt: served whole to late joiners
                        await self.peers.advertise_version(manifest.digest())
                    return VerifiedVersion(version, self._vdir(version), manifest)
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
            await self._fetch_all([(s, False) for s in start.shards])
        finally:
            self.stats.fetch_s += time.perf_counter() - t0
        await asyncio.to_thread(self._link_version, start)  # ensure() holds this version's lock

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
                        fetching = self._inflight.get(shard.sha256)
                        if fetching is not None and shard.sha256 not in held:  # a pull of the snapshot
                            try:  # itself is fetching it, verified: use that
                                await asyncio.shield(fetching)
                            except asyncio.CancelledError:
                                if not fetching.cancelled():
                                    raise  # we were cancelled
                            except Exception:
                                pass  # that fetch failed: receive a copy of our own
                        if shard.sha256 not in held and not await self._valid_local(shard, False):
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
                    return held[sha][0] if sha in held else self._shard_path(sha)

                fetches = [asyncio.create_task(one(sh)) for sh in start.shards]
                rebuild = asyncio.create_task(self._rebuild(start, chain, shard_file))
                try:
                    await _all_or_none(fetches)
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
                               await asyncio.to_thread(_file_sha256, held[sh.sha256][0]) != sh.sha256]
                    if not damaged:
                        raise  # the base is what the manifest says: a delta is corrupt
                    for sh in damaged:
                        self._refuse(sh, "received copy hash mismatch", sh.size)
                        self._drop_copy(sh.sha256, held.pop(sh.sha256)[1], damaged=True)
                t0 = time.perf_counter()
            raise ShardCorrupt(f"snapshot v{start.version} from {self.store.location} failed verification "
                               f"{self.corrupt_retries} times; refusing to load it")
        finally:
            for sha, (_, entry) in held.items():
                self._drop_copy(sha, entry)

    async def _from_peer_version(self, target: Manifest) -> bool:
        """Take a version rebuilt from deltas whole from a peer that holds it (`rlboost.weights.peers`):
        its files, laid out as this cache would write them (the layout follows from the manifest),
        each checked as it arrives (the header byte for byte, every tensor against its SHA-256), then
        installed as a rebuilt version. A joiner with no cached base replays nothing this way, as a
        plain snapshot pull does not. False (nothing kept) when no holder serves every file: the
        caller takes the snapshot and the deltas."""
        peers, digest = self.peers, target.digest()
        if not all(e.sha256 for e in target.tensors):
            return False  # a tensor without a hash could not be checked
        st = await peers.version_state(digest)
        holders = [(h, url) for h, url in st.holders.items() if h != peers.peer_id]
        if not holders:
            return False
        random.shuffle(holders)
        t0 = time.perf_counter()
        vdir = self._vdir(target.version)
        tmp = self.tmp_dir / f"{vdir.name}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        bad: set[str] = set()
        try:
            jobs, files = await asyncio.to_thread(layout, target.tensors, tmp)
            try:
                spans: dict[int, list[tuple[int, int, str]]] = {fd: [] for _, _, fd in files}
                for entry, fd, offset in jobs:
                    spans[fd].append((offset, math.prod(entry.shape) * ITEMSIZE[entry.dtype], entry.sha256))
                pieces = []  # (file index, fd, header, regions): whole tensors, about PEER_PIECE_BYTES each
                for index, (_, header, fd) in enumerate(files):
                    for regions in _pieces([(0, len(header), "")] + sorted(spans[fd]), PEER_PIECE_BYTES):
                        pieces.append((index, fd, header, regions))

                async def one(index: int, fd: int, header: bytes, regions: list[tuple[int, int, str]]) -> None:
                    start, stop = regions[0][0], regions[-1][0] + regions[-1][1]
                    deadline = time.monotonic() + peers.wait_s
                    async with self._sem:
                        while time.monotonic() < deadline:
                            busy = False
                            for h, url in [x for x in holders if x[0] not in bad][:peers.tries]:
                                try:
                                    if await self._take_version_file(
                                            peers.read_version(url, digest, index, start, stop), fd, header, regions):
                                        return
                                    self.stats.peer_rejected += 1
                                    log.warning("peer served a version file that failed verification; not asked "
                                                "again", version=target.version, file=index, peer=h, url=url)
                                except PeerBusy:
                                    busy = True
                                    continue
                                except PeerError as e:
                                    log.info("peer could not serve a version file; trying the next source",
                                             version=target.version, file=index, peer=h, error=str(e))
                                bad.add(h)
                            if not busy:
                                break
                            await asyncio.sleep(0.05 + random.random() * 0.2)
                    raise PeerError(f"no peer served version {target.version} file {index}")

                await _all_or_none([asyncio.create_task(one(*piece)) for piece in pieces])
            finally:
                for _, _, fd in files:
                    os.close(fd)
            (tmp / "manifest.json").write_bytes(target.encode())
            await asyncio.to_thread(self._install, tmp, vdir)
        except PeerError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("weights: no peer served the version whole; taking the snapshot and the deltas",
                     version=target.version, error=str(e))
            return False
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self.stats.fetch_s += time.perf_counter() - t0
        self._verified_dirs[target.version] = digest
        self.stats.peer_versions += 1
        await peers.advertise_version(digest)
        return True

    async def _take_version_file(self, chunks: AsyncIterator[Buffer], fd: int, header: bytes,
                                 regions: list[tuple[int, int, str]]) -> bool:
        """Stream a piece of a version file (`regions`, back to back) from a peer into `fd` through a
        worker thread that writes each chunk at its place and checks it (`_check_to_fd`); True when
        every byte checked out."""
        loop = asyncio.get_running_loop()
        q: queue.SimpleQueue[Buffer | None] = queue.SimpleQueue()
        sink = loop.run_in_executor(self._pool, _check_to_fd, fd, q, header, regions)
        size, n = regions[-1][0] + regions[-1][1] - regions[0][0], 0
        try:
            async with contextlib.aclosing(chunks) as body:
                async for chunk in body:
                    n += len(chunk)
                    if n > size:
                        break  # longer than the manifest allows: a lie, stop reading
                    q.put(chunk)
        finally:
            q.put(None)
            self.stats.peer_bytes += n
            ok = await sink
        if ok and n == size:
            self.stats.bytes_fetched += n
            return True
        return False

    async def _copy(self, shard: ShardEntry) -> tuple[Path, list]:
        """An unverified copy of a base snapshot's shard in tmp/, shared by the pulls that need it
        at the same time (a late joiner asked for two versions after one snapshot receives it
        once). Returns (path, entry); give it back with `_drop_copy(sha, entry)`."""
        entry = self._copies.get(shard.sha256)
        if entry is None:
            entry = self._copies[shard.sha256] = [asyncio.ensure_future(self._receive(shard)), 0]
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
            await asyncio.to_thread(self._reconstruct, start, chain, shard_file)
        finally:
            self.stats.rebuild_s += time.perf_counter() - t0
        self.stats.reconstructed += 1

    async def _fetch_all(self, blobs: list[tuple[ShardEntry, bool]]) -> None:
        """Fetch (shard or delta blob, is_delta) pairs the cache lacks, in parallel. One fetch
        failing stops the others: no fetch outlives the ensure() that started it."""
        if self.peers is not None:  # workers pulling the same version at once claim different blobs first
            blobs = random.sample(blobs, len(blobs))
        await _all_or_none([asyncio.create_task(self._ensure_shard(s, delta)) for s, delta in blobs])

    # -- paths

    def _vdir(self, version: int) -> Path:
        return self.versions_dir / f"v{version:012d}"

    async def _cached(self, manifest: Manifest) -> bool:
        """`versions/v<N>` holds exactly this manifest's weights, checked by this process: a
        snapshot's hard links to verified shards, a reconstructed version's tensors re-hashed
        once per process (a restarted worker does not trust a file it did not check)."""
        vdir = self._vdir(manifest.version)
        try:
            if Manifest.decode((vdir / "manifest.json").read_bytes()) != manifest:
                return False
        except (OSError, StoreError):
            return False
        if self._verified_dirs.get(manifest.version) == manifest.digest():
            return True
        if any(vdir.glob(RECONSTRUCTED_GLOB)):  # rebuilt from deltas (a snapshot may have been too)
            if not await asyncio.to_thread(_tensors_match, vdir, manifest):
                return False
            self._verified_dirs[manifest.version] = manifest.digest()
            return True
        if not manifest.snapshot or not await asyncio.to_thread(self._version_dir_current, vdir, manifest):
            return False
        for s in manifest.shards:  # re-hashes a shard this process has not checked yet
            if not await self._valid_local(s, delta=False):
                return False
        return True

    async def _paths(self, target: Manifest) -> list[tuple[int, bool, Manifest, list[Step]]]:
        """Every way to `target` the manifests allow, cheapest first: (bytes to fetch, whether
        `start` is a cached version, start, the steps replayed from it, oldest first). A start is
        a snapshot (fetch the shards the cache lacks) or a cached version that is exactly a
        delta's base (a cached one is preferred at equal cost); unless the target's own delta
        base is cached (a follower), the target's snapshot delta is a way from its snapshot."""
        jump: asyncio.Future[SnapshotDelta | None] | None = None
        if not target.shards and target.delta is not None \
                and not (self._vdir(target.delta.base) / "manifest.json").exists():
            # not a follower, by the look of the cache: the snapshot delta is read while the walk
            # below reads the chain's manifests, not after it (a round trip to the store less)
            jump = asyncio.ensure_future(self._snapshot_delta(target))
        try:
            return await self._walk(target, jump)
        finally:
            if jump is not None and not jump.done():
                jump.cancel()

    async def _walk(self, target: Manifest, jump: asyncio.Future[SnapshotDelta | None] | None) -> list[
            tuple[int, bool, Manifest, list[Step]]]:
        paths: list[tuple[int, int, Manifest, list[Step]]] = []
        after: list[Step] = []  # the steps after `m`, newest first
        seen: dict[int, Manifest] = {}  # the manifests read on the way, by version
        delta_bytes = 0
        m = target
        while True:
            seen[m.version] = m
            if m.snapshot:
                paths.append((self._missing(m) + delta_bytes, 1, m, after[::-1]))
            if m.delta is None or len(after) >= MAX_CHAIN:
                break
            delta_bytes += m.delta.bytes
            after = after + [(m, m.delta)]
            base = await self._base(m.delta)
            if base is None:
                break  # gone, or another life's version under that number: no delta applies to it
            if await self._cached(base):
                paths.append((delta_bytes, 0, base, after[::-1]))
                break
            m = base
        follower = any(kind == 0 and len(steps) == 1 for _, kind, _, steps in paths)
        if jump is None and not follower and not target.shards and target.delta is not None:
            jump = asyncio.ensure_future(self._snapshot_delta(target))
        if jump is not None and not follower and (sd := await jump) is not None \
                and (snap := await self._base(sd.delta, seen)) is not None and snap.shards:
            cached = await self._cached(snap)
            paths.append((sd.delta.bytes + (0 if cached else self._missing(snap)), 0 if cached else 1, snap,
                          [(target, sd.delta)]))
        paths.sort(key=lambda p: (p[0], p[1]))
        return [(cost, kind == 0, start, chain) for cost, kind, start, chain in paths]

    async def _base(self, delta: Delta, seen: dict[int, Manifest] | None = None) -> Manifest | None:
        """The manifest of the delta's base: one read on the way (`seen`), the cached copy, else
        the store's; None if none, or if it is not exactly the one the delta was made from."""
        base = (seen or {}).get(delta.base)
        if base is None:
            try:
                base = await self._manifest(delta.base, 0.0)
            except VersionUnavailable:
                return None
        return base if base.digest() == delta.base_digest else None

    async def _snapshot_delta(self, target: Manifest) -> SnapshotDelta | None:
        """The target's snapshot delta, if the publisher stored one (a store that does not answer
        now: none; the other paths are still there)."""
        try:
            return await read_snapshot_delta(self.store, target)
        except StoreError as e:
            log.info("weights: no snapshot delta read; replaying the deltas since the snapshot",
                     version=target.version, error=str(e))
            return None

    def _missing(self, snapshot: Manifest) -> int:
        """Bytes of the snapshot's shards the cache lacks."""
        return sum(s.size for s in snapshot.shards if not self._shard_path(s.sha256, False).exists())

    def _reconstruct(self, start: Manifest, chain: list[Step],
                     shard_file: Callable[[str], Path] | None = None) -> None:
        """(thread) Replay the steps of `chain` (oldest first) on `start`'s cached tensors into a
        new directory in tmp/, every tensor checked against the target's SHA-256 before it is
        written (`rlboost.weights.rebuild`, on `parallel` threads), then rename the directory into
        versions/. Raises DeltaCorrupt on any mismatch; nothing is installed then.

        `shard_file` (a snapshot start still arriving): the base tensors are read from the file
        `shard_file(sha)` returns once each is in; otherwise from `start`'s version dir."""
        target = chain[-1][0]
        if shard_file:
            base = BaseFiles(start, shard_file=shard_file)
        else:
            vdir = self._vdir(start.version)
            try:
                if Manifest.decode((vdir / "manifest.json").read_bytes()) != start:
                    raise VersionUnavailable(f"{vdir} no longer holds version {start.version}")
            except FileNotFoundError:
                raise VersionUnavailable(f"{vdir} is gone") from None
            rebuilt = sorted(vdir.glob(RECONSTRUCTED_GLOB))
            base = BaseFiles(start, whole_files=rebuilt) if rebuilt else \
                BaseFiles(start, shard_file=lambda sha: vdir / f"{check_shard_id(sha)}.safetensors")
        tmp = self.tmp_dir / f"{self._vdir(target.version).name}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            blobs = {b.sha256: self._shard_path(b.sha256, True).read_bytes() for _, d in chain for b in d.blobs}
            rebuild(target, chain, base, blobs, tmp, self.parallel)
            (tmp / "manifest.json").write_bytes(target.encode())
            self._install(tmp, self._vdir(target.version))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            base.close()
        self._verified_dirs[target.version] = target.digest()

    def _install(self, tmp: Path, vdir: Path) -> None:
        """Rename a finished directory into versions/, replacing an old one atomically enough:
        a reader sees the old directory or the new one, never a half-built one."""
        if vdir.exists():
            trash = self.tmp_dir / f"old-{vdir.name}.{uuid.uuid4().hex[:8]}"
            os.replace(vdir, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, vdir)

    # -- manifests

    async def _manifest(self, version: int, wait_s: float) -> Manifest:
        local = self.versions_dir / f"v{version:012d}" / "manifest.json"
        with contextlib.suppress(FileNotFoundError, StoreError):
            m = Manifest.decode(local.read_bytes())
            if m.version == version:
                return m
        deadline = time.monotonic() + wait_s
        while True:
            try:
                data = await self._retrying(f"manifest v{version}",
                                            lambda: self.store.read_all(wire.weights_manifest_key(version)))
                break
            except ObjectMissing:
                if wait_s > 0 and (newer := await self._newest_published()) > version:
                    # versions are published in order: a newer one means this one will not come
                    raise VersionGone(f"weights version {version} is not in {self.store.location} and "
                                      f"version {newer} is: garbage-collected") from None
                if time.monotonic() >= deadline:
                    raise VersionUnavailable(
                        f"weights version {version} is not in {self.store.location} "
                        f"(not published yet, or garbage-collected)") from None
                await asyncio.sleep(0.2)
        m = Manifest.decode(data)
        if m.version != version:
            raise StoreError(f"manifest {wire.weights_manifest_key(version)} claims version {m.version}")
        return m

    async def _newest_published(self) -> int:
        """The newest version with a manifest in the store (0: none, or the store did not answer)."""
        try:
            return max(await published_versions(self.store), default=0)
        except StoreError:
            return 0

    # -- shards

    def _shard_path(self, sha: str, delta: bool = False) -> Path:
        """Inside shards/ (deltas/) or refused: the manifest door validates ids, this is the second lock."""
        where = self.deltas_dir if delta else self.shards_dir
        path = (where / f"{check_shard_id(sha)}.{'zst' if delta else 'safetensors'}").resolve()
        if path.parent != where.resolve():
            raise StoreError(f"shard path {path} is outside {where}")
        return path

    async def _ensure_shard(self, shard: ShardEntry, delta: bool = False) -> None:
        while True:
            if await self._valid_local(shard, delta):
                self.stats.shards_reused += 1
                return
            fut = self._inflight.get(shard.sha256)
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
        self._inflight[shard.sha256] = fut
        try:
            async with self._sem:
                await self._retrying(f"shard {shard.sha256[:12]}", lambda: self._fetch(shard, delta))
            fut.set_result(None)
        except asyncio.CancelledError:
            fut.cancel()
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters re-raise it, nobody logs "never retrieved"
            raise
        finally:
            del self._inflight[shard.sha256]

    async def _valid_local(self, shard: ShardEntry, delta: bool) -> bool:
        """A cached file is used only if its size matches and its SHA-256 was checked — by this
        process, on this very file (inode, size, mtime); otherwise it is hashed again."""
        path = self._shard_path(shard.sha256, delta)
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        if st.st_size == shard.size and self._verified.get(shard.sha256) == ident:
            return True
        if st.st_size == shard.size:
            digest = await asyncio.to_thread(_file_sha256, path)
            if digest == shard.sha256:
                self._verified[shard.sha256] = ident
                if self.peers is not None:  # e.g. a restarted worker's cache: servable again
                    await self.peers.advertise(shard.sha256)
                return True
        self._refuse(shard, f"cached copy is {'corrupt' if st.st_size == shard.size else 'truncated'}", st.st_size)
        path.unlink(missing_ok=True)
        return False

    def _refuse(self, shard: ShardEntry, reason: str, got_bytes: int) -> None:
        self.stats.shards_refused += 1
        self._verified.pop(shard.sha256, None)
        log.warning("weight shard refused", shard=shard.sha256[:16], reason=reason, expected_bytes=shard.size,
                    got_bytes=got_bytes)

    async def _receive(self, shard: ShardEntry) -> Path:
        """A snapshot shard's bytes in a tmp/ file of the right size, not hashed (see
        `_from_base_snapshot`): the caller checks and deletes it."""
        async with self._sem:
            return await self._retrying(f"shard {shard.sha256[:12]}", lambda: self._fetch(shard, False, verify=False))

    async def _fetch(self, shard: ShardEntry, delta: bool, verify: bool = True) -> Path:
        """Receive a blob: from peers first when the cache has them (`rlboost.weights.peers`),
        from the origin store otherwise. `verify=False` (`_receive`): the right size is enough
        for the origin's bytes (the caller checks them), and the tmp/ file itself is returned."""
        if self.peers is not None:
            return await self._fetch_peered(shard, delta, verify)
        return await self._fetch_origin(shard, delta, verify)

    async def _fetch_origin(self, shard: ShardEntry, delta: bool, verify: bool = True) -> Path:
        """From the store, refused copies fetched again up to `corrupt_retries` times."""
        key = (wire.weights_delta_key if delta else wire.weights_shard_key)(shard.sha256)
        for _attempt in range(self.corrupt_retries):
            try:
                path = await self._take(self.store.read(key), shard, delta, verify, hashing=verify, source="origin")
            except ObjectMissing:
                raise VersionUnavailable(f"shard {shard.sha256} is gone from {self.store.location} "
                                         f"(its version was garbage-collected?)") from None
            if path is not None:
                return path
        raise ShardCorrupt(f"shard {shard.sha256} from {self.store.location} failed verification "
                           f"{self.corrupt_retries} times; refusing to load it")

    async def _fetch_peered(self, shard: ShardEntry, delta: bool, verify: bool) -> Path:
        """Holders first (random order, up to `peers.tries` a round; a busy one is asked again
        later, one that fails or lies is not asked again), else claim the blob and fetch it from
        the origin for everyone, else wait for whoever claimed it; past `peers.wait_s`, the
        origin. Every byte from a peer is hashed, whatever `verify` says: a peer is not trusted."""
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
        size (and hash, if `hashing`) is kept: renamed into the cache (`verify`) or returned as
        the tmp/ file itself (not `verify`). None: the copy was refused (counted and logged).
        `source` ("origin" or "peer") names the counter of the bytes received."""
        loop = asyncio.get_running_loop()
        tmp = self.tmp_dir / f"{shard.sha256}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"
        chunks_q: queue.SimpleQueue[Buffer | None] = queue.SimpleQueue()
        sink = loop.run_in_executor(self._pool, _hash_to_file, tmp, chunks_q, hashing)
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
            path = self._shard_path(shard.sha256, delta)
            os.replace(tmp, path)
            st = path.stat()
            self._verified[shard.sha256] = (st.st_ino, st.st_size, st.st_mtime_ns)
            self.stats.delta_bytes_fetched += n if delta else 0
            return path
        tmp.unlink(missing_ok=True)
        reason = "truncated" if n < shard.size else "too long" if n > shard.size else "hash mismatch"
        self._refuse(shard, f"received copy {reason}", n)
        return None

    def open_version_file(self, digest: str, index: int) -> BinaryIO | None:
        """File `index` of a version this process rebuilt (or took whole) and checked, whose
        manifest digest is `digest`, opened for reading; else None. What a `PeerServer` serves
        to late joiners (`_from_peer_version`), who check every byte again."""
        for v, d in list(self._verified_dirs.items()):
            if d == digest:
                with contextlib.suppress(OSError):
                    return open(self._vdir(v) / f"tensors-{index:05d}.safetensors", "rb")  # noqa: SIM115
        return None

    def open_verified(self, sha: str) -> BinaryIO | None:
        """A blob (shard or delta) this process hashed itself, opened for reading, if the file is
        still exactly the one it hashed (inode, size, mtime); else None. What a `PeerServer`
        serves: nothing unverified ever leaves this cache."""
        if not _SHA_HEX.fullmatch(sha):
            return None
        for delta in (False, True):
            try:
                f = open(self._shard_path(sha, delta), "rb")  # noqa: SIM115 - the caller closes it
            except (FileNotFoundError, StoreError):
                continue
            st = os.fstat(f.fileno())
            if self._verified.get(sha) == (st.st_ino, st.st_size, st.st_mtime_ns):
                return f
            f.close()
        return None

    async def _retrying(self, what: str, op: Callable[[], Awaitable[Any]]) -> Any:
        """Retry StoreUnavailable with exponential back-off (jittered, capped at 5 s) until
        `retry_deadline_s`; then raise it with the attempt count."""
        deadline = time.monotonic() + self.retry_deadline_s
        delay, attempt = 0.1, 0
        while True:
            attempt += 1
            try:
                return await op()
            except StoreUnavailable as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(f"{e} (gave up on {what} after {attempt} attempts, "
                                           f"{self.retry_deadline_s:.0f}s)") from e
                sleep = min(delay * (1 + random.random() / 2), left, 5.0)
                log.warning("weight store unreachable; retrying", what=what, attempt=attempt,
                            retry_in_s=round(sleep, 2), error=str(e))
                await asyncio.sleep(sleep)
                delay = min(delay * 2, 5.0)

    # -- version directories

    def _link_version(self, manifest: Manifest) -> Path:
        """(Re)build versions/v<N> as hard links to the verified shard files. Built in tmp/ and
        renamed into place, so a reader never sees a half-built directory."""
        vdir = self.versions_dir / f"v{manifest.version:012d}"
        if self._version_dir_current(vdir, manifest):
            return vdir
        tmp = self.tmp_dir / f"{vdir.name}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        for s in manifest.shards:
            src, dst = self._shard_path(s.sha256), tmp / f"{s.sha256}.safetensors"
            try:
                os.link(src, dst)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(src, dst)
        (tmp / "manifest.json").write_bytes(manifest.encode())
        self._install(tmp, vdir)
        self._verified_dirs.pop(manifest.version, None)
        return vdir

    def _version_dir_current(self, vdir: Path, manifest: Manifest) -> bool:
        try:
            if Manifest.decode((vdir / "manifest.json").read_bytes()) != manifest or any(vdir.glob(RECONSTRUCTED_GLOB)):
                return False
            return all(os.path.samefile(vdir / f"{s.sha256}.safetensors", self._shard_path(s.sha256))
                       for s in manifest.shards)
        except (OSError, StoreError):
            return False

    # -- housekeeping

    def _clean_leftovers(self) -> None:
        """A process killed mid-pull leaves its partial downloads in tmp/ (`<sha>.<pid>-<rand>.part`):
        delete those of processes that are gone, so a restarted worker's cache holds nothing
        half-written. A live process's (a cache shared between workers) are left alone; a name
        without a pid (older builds) counts as a dead owner's."""
        for p in self.tmp_dir.glob("*.part"):
            owner = p.name.split(".")[-2].split("-")[0] if p.name.count(".") >= 2 else ""
            if owner.isdigit() and int(owner) != os.getpid() and pid_alive(int(owner)):
                continue
            with contextlib.suppress(OSError):
                p.unlink()
                log.info("removed a partial download left by a killed pull", path=str(p))

    def close(self) -> None:
        """Stop the hashing threads (the cache directory stays as it is)."""
        self._pool.shutdown(wait=False)

    def cached_versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.versions_dir.glob("v*") if p.name[1:].isdigit())

    def prune(self, keep: int, also_keep: Iterable[int] = ()) -> list[int]:
        """Drop all but the newest `keep` version dirs (and `also_keep`, e.g. versions still
        serving requests), then shards no remaining version uses. Returns dropped versions."""
        versions = self.cached_versions()
        keep_set = set(versions[-keep:] if keep > 0 else []) | set(also_keep)
        dropped = [v for v in versions if v not in keep_set]
        for v in dropped:
            shutil.rmtree(self.versions_dir / f"v{v:012d}", ignore_errors=True)
        live: set[str] = set()
        for v in keep_set:
            with contextlib.suppress(FileNotFoundError, StoreError):
                m = Manifest.decode((self.versions_dir / f"v{v:012d}" / "manifest.json").read_bytes())
                live.update(s.sha256 for s in m.shards)
                live.update(b.sha256 for b in (m.delta.blobs if m.delta else []))
        for v in dropped:
            digest = self._verified_dirs.pop(v, None)
            if digest and self.peers is not None:
                self.peers.withdraw_soon(key=wire.peer_version_key(digest))
        for p in [*self.shards_dir.glob("*.safetensors"), *self.deltas_dir.glob("*.zst")]:
            sha = p.name.split(".")[0]
            if sha not in live and sha not in self._inflight:
                p.unlink(missing_ok=True)
                self._verified.pop(sha, None)
                if self.peers is not None:
                    self.peers.withdraw_soon(sha)
        return dropped


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


def _pieces(regions: list[tuple[int, int, str]], piece: int) -> list[list[tuple[int, int, str]]]:
    """Back-to-back regions cut into runs of about `piece` bytes (a region is never split: its
    SHA-256 is checked whole; one of no bytes, an empty tensor, joins the run before it, so every
    run has bytes to ask for)."""
    out: list[list[tuple[int, int, str]]] = [[]]
    for r in regions:
        if out[-1] and r[1] and sum(n for _, n, _ in out[-1]) + r[1] > piece:
            out.append([])
        out[-1].append(r)
    return out


def _check_to_fd(fd: int, chunks: queue.SimpleQueue, header: bytes, regions: list[tuple[int, int, str]]) -> bool:
    """(thread) Write chunks until None at their places in `fd`, checking them against `regions`
    ((offset, bytes, SHA-256), ascending, back to back from the first's offset; one of no hash
    is the file's header, compared byte for byte). True if every region checked out and nothing
    came past the last."""
    size = regions[-1][0] + regions[-1][1]
    pos, i, ok = regions[0][0], 0, all(a[0] + a[1] == b[0] for a, b in zip(regions, regions[1:]))
    h = hashlib.sha256()
    while (chunk := chunks.get()) is not None:
        if not ok:
            continue  # drain: the receiver stops on its own
        mv = memoryview(chunk).cast("B")
        if pos + len(mv) > size:
            ok = False
            continue
        write_all(fd, mv, pos)
        off = 0
        while off < len(mv):
            start, n, sha = regions[i]
            take = min(len(mv) - off, start + n - (pos + off))
            piece = mv[off:off + take]
            if sha:
                h.update(piece)
            elif piece != header[pos + off:pos + off + take]:
                ok = False
                break
            off += take
            if pos + off == start + n:  # a region ends here
                if sha:
                    ok = ok and h.hexdigest() == sha
                    h = hashlib.sha256()
                i += 1
                if i == len(regions):
                    break
        pos += len(mv)
    empty = hashlib.sha256().hexdigest()  # regions of no bytes left at the end (an empty tensor)
    return ok and pos == size and all(n == 0 and sha in ("", empty) for _, n, sha in regions[i:])


async def _all_or_none(tasks: list[asyncio.Task]) -> None:
    """Wait for every task; if one fails (or the wait is cancelled), cancel the rest and wait
    for them too, so that no task outlives the call that started it."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _tensors_match(vdir: Path, manifest: Manifest) -> bool:
    """(thread) Every tensor of a reconstructed directory hashes to the manifest's SHA-256."""
    try:
        tensors = load_tensors(vdir, expect_version=manifest.version)
        return all(e.sha256 and deltas.tensor_sha256(tensors[e.name]) == e.sha256 for e in manifest.tensors)
    except (OSError, StoreError, KeyError, ValueError):
        return False


class _Abandoned(StoreError):
    """(rebuild thread) a shard it waits for will not come: the fetch's own error is raised."""
