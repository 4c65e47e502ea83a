"""The weight store, worker side: pull policy versions into a verified local cache.

`WeightCache.ensure(version)` returns a directory holding exactly that version's shards, every
one hash-verified, or raises — there is no code path that hands out a different version.
Missing shards are fetched in parallel; a truncated/corrupt shard is refused and fetched again;
an unreachable store is retried with back-off until a deadline, then reported clearly.
`follow()` watches the version pointer and reloads the engine. Reading is safetensors only,
zero-copy (`read_safetensors`), never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import queue
import random
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.objstore import BlobStore, Buffer, ObjectMissing, StoreError, StoreUnavailable
from rlboost.weights import Manifest, ShardCorrupt, ShardEntry, VersionPointer, VersionUnavailable

if TYPE_CHECKING:
    import torch

log = get_logger(component="weights")

__all__ = ["WeightCache", "VerifiedVersion", "CacheStats", "load_tensors", "read_safetensors"]


@dataclass
class CacheStats:
    bytes_fetched: int = 0
    shards_fetched: int = 0
    shards_reused: int = 0  # already in the local cache, verified
    shards_refused: int = 0  # received or found corrupt / truncated, never used


@dataclass(frozen=True)
class VerifiedVersion:
    """Exactly `version`'s shards, each verified against the manifest, in `path`
    (manifest.json + `<sha256>.safetensors`). Pass `path` to the engine's reload hook."""

    version: int
    path: Path
    manifest: Manifest

    def load_tensors(self) -> dict[str, torch.Tensor]:
        return load_tensors(self.path, expect_version=self.version)


def load_tensors(path: str | os.PathLike[str], expect_version: int | None = None) -> dict[str, torch.Tensor]:
    """A verified version directory -> {name: tensor}. For a torch engine:
    `model.load_state_dict(load_tensors(weights_dir, version))`.

    Safetensors only, never pickle. The files are memory-mapped copy-on-write, so the tensors
    share the page cache the fetch just filled (no read, no copy until the engine copies them
    into its parameters), and writing to a tensor never alters the cached file."""
    import torch

    path = Path(path)
    manifest = Manifest.decode((path / "manifest.json").read_bytes())
    if expect_version is not None and manifest.version != expect_version:
        raise VersionUnavailable(f"{path} holds version {manifest.version}, not {expect_version}")
    flat: dict[str, torch.Tensor] = {}
    for s in manifest.shards:
        flat.update(read_safetensors(path / f"{s.sha256}.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for e in manifest.tensors:
        t = flat[e.parts[0].key] if len(e.parts) == 1 else torch.cat([flat[p.key] for p in e.parts])
        if list(t.shape) != e.shape or str(t.dtype).removeprefix("torch.") != e.dtype:
            raise StoreError(f"tensor {e.name}: {t.dtype} {list(t.shape)} does not match the manifest")
        out[e.name] = t
    return out


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
              "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Zero-copy safetensors reader: parse the JSON header, map the file privately, view each
    tensor in place (bounds-checked against the file). `safetensors.torch.load_file` copies
    every byte, which halves the end-to-end pull rate."""
    import json
    import mmap

    import torch

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise StoreError(f"{path}: not a safetensors file")
        hlen = int.from_bytes(head, "little")
        if hlen > size - 8:
            raise StoreError(f"{path}: safetensors header longer than the file")
        header = json.loads(f.read(hlen))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    base = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, _ST_DTYPES[spec["dtype"]])
        start, stop = spec["data_offsets"]
        shape = spec["shape"]
        if not 0 <= start <= stop <= size - base:
            raise StoreError(f"{path}: tensor {name} outside the file")
        count = (stop - start) // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + start).view(shape)
    return out


class WeightCache:
    """Worker side: a local content-addressed cache of shards and per-version directories.

    Layout under `root`: `shards/<sha256>.safetensors` (content-addressed, shared between
    versions), `versions/v<N>/` (manifest.json + hard links to the version's shards), `tmp/`.
    One cache dir per worker process (or per machine when workers share it read-mostly).
    """

    def __init__(self, root: str | os.PathLike[str], store: BlobStore, *, parallel: int = 4,
                 retry_deadline_s: float = 60.0, corrupt_retries: int = 3) -> None:
        self.root = Path(root)
        self.store = store
        self.parallel = parallel
        self.retry_deadline_s = retry_deadline_s
        self.corrupt_retries = corrupt_retries
        self.stats = CacheStats()
        self.shards_dir, self.versions_dir, self.tmp_dir = (self.root / d for d in ("shards", "versions", "tmp"))
        for d in (self.shards_dir, self.versions_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._verified: dict[str, tuple[int, int, int]] = {}  # sha -> (inode, size, mtime_ns) hashed OK
        self._inflight: dict[str, asyncio.Future[None]] = {}
        self._locks: dict[int, asyncio.Lock] = {}
        self._sem = asyncio.Semaphore(parallel)
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="weights-sink")

    # -- the one entry point that matters

    async def ensure(self, version: int, *, wait_s: float = 0.0) -> VerifiedVersion:
        """Return `version`'s verified directory, fetching what the cache lacks, or raise
        `VersionUnavailable` / `ShardCorrupt` / `StoreUnavailable`. Never another version.

        `wait_s`: a request may name a version whose manifest is not in the store yet (the
        trainer is still uploading); keep looking for that long before giving up."""
        lock = self._locks.setdefault(version, asyncio.Lock())
        async with lock:
            manifest = await self._manifest(version, wait_s)
            # One shard failing stops the others: no fetch outlives the ensure() that started it.
            fetches = [asyncio.create_task(self._ensure_shard(s)) for s in manifest.shards]
            try:
                await asyncio.gather(*fetches)
            except BaseException:
                for f in fetches:
                    f.cancel()
                await asyncio.gather(*fetches, return_exceptions=True)
                raise
            path = await asyncio.to_thread(self._link_version, manifest)
            return VerifiedVersion(version, path, manifest)

    async def activate(self, version: int, reload: Callable[[Path, int], Awaitable[None]], *,
                       wait_s: float = 0.0) -> VerifiedVersion:
        """ensure() then hand the verified directory to the engine's reload hook."""
        vv = await self.ensure(version, wait_s=wait_s)
        await reload(vv.path, vv.version)
        return vv

    async def follow(self, pointer: VersionPointer, reload: Callable[[Path, int], Awaitable[None]],
                     stop: asyncio.Event, current: int | None = None) -> None:
        """Watch the version pointer; activate each newer version. A worker lagging several
        versions jumps straight to the newest (intermediate ones are skipped, not fetched)."""
        latest: list[int] = []
        changed = asyncio.Event()

        async def watch() -> None:
            async for v in pointer.watch(stop):
                latest.append(v)
                changed.set()

        watcher = asyncio.create_task(watch())
        try:
            while not stop.is_set():
                waiter = asyncio.create_task(changed.wait())
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                stopper.cancel()
                if stop.is_set():
                    break
                changed.clear()
                target = max(latest)
                if current is not None and target <= current:
                    continue
                try:
                    await self.activate(target, reload)
                    current = target
                except StoreError as e:  # VersionUnavailable, ShardCorrupt, StoreUnavailable
                    log.error("weights update failed; keeping the current version", version=target,
                              current=current, error=str(e))
                    await asyncio.sleep(1.0)
                    changed.set()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher

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
                if time.monotonic() >= deadline:
                    raise VersionUnavailable(
                        f"weights version {version} is not in {self.store.location} "
                        f"(not published yet, or garbage-collected)") from None
                await asyncio.sleep(0.2)
        m = Manifest.decode(data)
        if m.version != version:
            raise StoreError(f"manifest {wire.weights_manifest_key(version)} claims version {m.version}")
        return m

    # -- shards

    def _shard_path(self, sha: str) -> Path:
        return self.shards_dir / f"{sha}.safetensors"

    async def _ensure_shard(self, shard: ShardEntry) -> None:
        while True:
            if await self._valid_local(shard):
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
                await self._retrying(f"shard {shard.sha256[:12]}", lambda: self._fetch(shard))
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

    async def _valid_local(self, shard: ShardEntry) -> bool:
        """A cached file is used only if its size matches and its SHA-256 was checked — by this
        process, on this very file (inode, size, mtime); otherwise it is hashed again."""
        path = self._shard_path(shard.sha256)
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
                return True
        self._refuse(shard, f"cached copy is {'corrupt' if st.st_size == shard.size else 'truncated'}", st.st_size)
        path.unlink(missing_ok=True)
        return False

    def _refuse(self, shard: ShardEntry, reason: str, got_bytes: int) -> None:
        self.stats.shards_refused += 1
        self._verified.pop(shard.sha256, None)
        log.warning("weight shard refused", shard=shard.sha256[:16], reason=reason, expected_bytes=shard.size,
                    got_bytes=got_bytes)

    async def _fetch(self, shard: ShardEntry) -> None:
        """Stream the shard into a temp file through a worker thread that hashes and writes
        each chunk as it comes (hashlib and file writes release the GIL, so this overlaps with
        receiving; the event loop only hands over references). Only a file of the right size
        and hash is renamed into the cache; refused copies are fetched again, up to a limit."""
        key = wire.weights_shard_key(shard.sha256)
        loop = asyncio.get_running_loop()
        for _attempt in range(self.corrupt_retries):
            tmp = self.tmp_dir / f"{shard.sha256}.{uuid.uuid4().hex[:8]}.part"
            chunks_q: queue.SimpleQueue[Buffer | None] = queue.SimpleQueue()
            sink = loop.run_in_executor(self._pool, _hash_to_file, tmp, chunks_q)
            n = 0
            try:
                try:
                    async with contextlib.aclosing(self.store.read(key)) as chunks:
                        async for chunk in chunks:
                            n += len(chunk)
                            if n > shard.size:
                                break  # longer than the manifest says: corrupt, stop reading
                            chunks_q.put(chunk)
                finally:
                    chunks_q.put(None)
                    written, digest = await sink
            except ObjectMissing:
                tmp.unlink(missing_ok=True)
                raise VersionUnavailable(f"shard {shard.sha256} is gone from {self.store.location} "
                                         f"(its version was garbage-collected?)") from None
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            if n == written == shard.size and digest == shard.sha256:
                path = self._shard_path(shard.sha256)
                os.replace(tmp, path)
                st = path.stat()
                self._verified[shard.sha256] = (st.st_ino, st.st_size, st.st_mtime_ns)
                self.stats.bytes_fetched += n
                self.stats.shards_fetched += 1
                return
            tmp.unlink(missing_ok=True)
            reason = "truncated" if n < shard.size else "too long" if n > shard.size else "hash mismatch"
            self._refuse(shard, f"received copy {reason}", n)
        raise ShardCorrupt(f"shard {shard.sha256} from {self.store.location} failed verification "
                           f"{self.corrupt_retries} times; refusing to load it")

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
        if vdir.exists():
            trash = self.tmp_dir / f"old-{vdir.name}.{uuid.uuid4().hex[:8]}"
            os.replace(vdir, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, vdir)
        return vdir

    def _version_dir_current(self, vdir: Path, manifest: Manifest) -> bool:
        try:
            if Manifest.decode((vdir / "manifest.json").read_bytes()) != manifest:
                return False
            return all(os.path.samefile(vdir / f"{s.sha256}.safetensors", self._shard_path(s.sha256))
                       for s in manifest.shards)
        except (OSError, StoreError):
            return False

    # -- housekeeping

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
        for p in self.shards_dir.glob("*.safetensors"):
            sha = p.name.split(".")[0]
            if sha not in live and sha not in self._inflight:
                p.unlink(missing_ok=True)
                self._verified.pop(sha, None)
        return dropped


def _hash_to_file(path: Path, chunks: queue.SimpleQueue) -> tuple[int, str]:
    """(thread) Write and hash chunks until None; returns (bytes, hex digest)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "wb", buffering=0) as f:
        while (chunk := chunks.get()) is not None:
            h.update(chunk)
            f.write(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
