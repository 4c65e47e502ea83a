"""The weight store: publish policy versions as content-addressed safetensors shards, pull them
into a verified local cache.

Trainer side (`WeightPublisher`): a state dict becomes safetensors shards, each named by the
SHA-256 of its bytes, plus one manifest per version (tensor -> shard, dtype, shape, hashes),
then the version pointer in the `rb-policy` KV bucket moves. An unchanged shard has the same
hash, so it is neither uploaded nor fetched again. GC keeps the newest N versions.

Worker side (`WeightCache`): `ensure(version)` returns a directory holding exactly that
version's shards, every one hash-verified, or raises — there is no code path that hands out a
different version. Missing shards are fetched in parallel; a truncated/corrupt shard is
refused and fetched again; an unreachable store is retried with back-off until a deadline,
then reported clearly. `follow()` watches the pointer and reloads the engine.

Why the shards are cut the way they are: a changed tensor re-ships its whole shard, so the
unit of transfer should be the unit of change — a tensor. Tensors are taken in a stable order
(the state dict's); a tensor of at least `target_shard_bytes` (default 4 MiB: the matrices)
gets a shard of its own, smaller ones (norms, biases, small projections) are packed together
up to that size so a model is hundreds of objects, not thousands. `max_shard_bytes` (default
256 MiB) is a hard bound: a bigger tensor (an embedding) is split into row blocks, so a
reader never holds more than one bounded shard per parallel fetch. With fewer, bigger shards
(HF's 5 GB style), a change to 10% of the tensors would touch most shards.
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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyNotFoundError

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.objstore import (
    BlobStore,
    Buffer,
    FileBlobStore,
    JetStreamBlobStore,
    ObjectMissing,
    StoreError,
    StoreUnavailable,
)

if TYPE_CHECKING:
    import torch

log = get_logger(component="weights")

MANIFEST_SCHEMA = 1
DEFAULT_MAX_SHARD_BYTES = 256 << 20
DEFAULT_TARGET_SHARD_BYTES = 4 << 20

__all__ = [
    "Manifest", "ShardEntry", "TensorEntry", "TensorPart", "WeightPublisher", "PublishReport", "WeightCache",
    "VerifiedVersion", "CacheStats", "VersionPointer", "VersionUnavailable", "ShardCorrupt", "StoreUnavailable",
    "ObjectMissing", "StoreError", "load_tensors", "open_store", "plan_shards", "gc_store",
]


class VersionUnavailable(StoreError):
    """The store has no manifest for the requested version (not yet published, or GC'd)."""


class ShardCorrupt(StoreError):
    """A shard kept failing verification (truncated / wrong hash) after every retry."""


# ---------------------------------------------------------------- manifest


class TensorPart(msgspec.Struct, frozen=True, array_like=True):
    """Rows [start, stop) of a tensor live under `key` in the shard `shard` (a SHA-256)."""

    shard: str
    key: str
    start: int
    stop: int


class TensorEntry(msgspec.Struct, frozen=True):
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: list[int]
    parts: list[TensorPart]  # one part unless the tensor is bigger than max_shard_bytes


class ShardEntry(msgspec.Struct, frozen=True):
    sha256: str
    size: int
    keys: list[str]  # tensor keys inside the safetensors file


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    v: int = MANIFEST_SCHEMA
    version: int
    created: float
    total_bytes: int
    shards: list[ShardEntry]
    tensors: list[TensorEntry]
    meta: dict[str, str] = {}

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def decode(data: bytes) -> Manifest:
        try:
            m = msgspec.json.decode(data, type=Manifest)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise StoreError(f"malformed weights manifest: {e}") from None
        if m.v != MANIFEST_SCHEMA:
            raise StoreError(f"weights manifest schema {m.v}; this build reads {MANIFEST_SCHEMA}")
        return m

    def same_weights(self, other: Manifest) -> bool:
        return self.shards == other.shards and self.tensors == other.tensors


# ---------------------------------------------------------------- shard planning


def plan_shards(sizes: list[tuple[str, int]], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                target_shard_bytes: int = DEFAULT_TARGET_SHARD_BYTES) -> list[list[str]]:
    """Group tensor keys (in the given, stable order) into shards; see the module docstring.

    A shard closes once it holds `target_shard_bytes`; a tensor that alone reaches the target
    starts a fresh shard; nothing exceeds `max_shard_bytes` unless a single key does (callers
    split those first)."""
    target = min(target_shard_bytes, max_shard_bytes)
    groups: list[list[str]] = []
    cur: list[str] = []
    cur_bytes = 0
    for key, n in sizes:
        if cur and (cur_bytes + n > max_shard_bytes or n >= target):
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(key)
        cur_bytes += n
        if cur_bytes >= target:
            groups.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        groups.append(cur)
    return groups


def _pieces(state_dict: Mapping[str, torch.Tensor], max_shard_bytes: int) -> tuple[
        dict[str, torch.Tensor], list[TensorEntry]]:
    """Contiguous CPU tensors keyed for safetensors, oversized ones split into row blocks.
    Entries carry an empty shard id, filled once the shards are hashed."""
    pieces: dict[str, torch.Tensor] = {}
    entries: list[TensorEntry] = []
    seen_storage: set[int] = set()
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage and t.numel():  # tied weights: safetensors refuses shared memory
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        dtype = str(t.dtype).removeprefix("torch.")
        shape = list(t.shape)
        nbytes = t.numel() * t.element_size()
        if nbytes > max_shard_bytes and t.dim() >= 1 and t.shape[0] > 1:
            row_bytes = max(1, nbytes // t.shape[0])
            rows = max(1, max_shard_bytes // row_bytes)
            parts = []
            for i, start in enumerate(range(0, t.shape[0], rows)):
                stop = min(start + rows, t.shape[0])
                key = f"{name}@rows{i}"
                pieces[key] = t[start:stop].clone()  # its own storage: safetensors refuses views
                parts.append(TensorPart("", key, start, stop))
        else:
            pieces[name] = t
            parts = [TensorPart("", name, 0, shape[0] if shape else 0)]
        entries.append(TensorEntry(name, dtype, shape, parts))
    return pieces, entries


def _serialize(group: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    from safetensors.torch import save

    data = save(group, metadata={"format": "pt"})
    return data, hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- version pointer


class VersionPointer:
    """The latest published version, an ASCII integer in the `rb-policy` KV bucket.

    Workers watch it; it only moves forward (a trainer restarting from an older checkpoint
    must publish a new, higher version, or it would silently roll workers back)."""

    def __init__(self, kv: Any, key: str = wire.WEIGHTS_POINTER_KEY) -> None:
        self.kv = kv
        self.key = key

    @classmethod
    async def open(cls, js: JetStreamContext, key: str = wire.WEIGHTS_POINTER_KEY) -> VersionPointer:
        try:
            try:
                kv = await js.key_value(wire.BUCKET_POLICY)
            except Exception:
                try:
                    kv = await js.create_key_value(KeyValueConfig(bucket=wire.BUCKET_POLICY, history=5))
                except BadRequestError:
                    kv = await js.key_value(wire.BUCKET_POLICY)
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"cannot open KV bucket {wire.BUCKET_POLICY}: {e!r}") from e
        return cls(kv, key)

    async def get(self) -> int | None:
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            return None
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"reading {wire.BUCKET_POLICY}/{self.key}: {e!r}") from e
        return int(entry.value) if entry.value else None

    async def set(self, version: int) -> None:
        current = await self.get()
        if current is not None and version < current:
            raise ValueError(f"version pointer is at {current}; refusing to move it back to {version}")
        try:
            await self.kv.put(self.key, str(version).encode())
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"writing {wire.BUCKET_POLICY}/{self.key}: {e!r}") from e

    async def watch(self, stop: asyncio.Event | None = None) -> AsyncIterator[int]:
        """Yield the current version (if any), then every new one, until `stop` is set."""
        watcher = await self.kv.watch(self.key)
        try:
            while stop is None or not stop.is_set():
                try:
                    entry = await watcher.updates(timeout=0.5)
                except nats.errors.TimeoutError:
                    continue
                if entry is None or not entry.value or entry.operation in ("DEL", "PURGE"):
                    continue
                yield int(entry.value)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()


# ---------------------------------------------------------------- publisher


@dataclass
class PublishReport:
    version: int
    shards: int
    shards_uploaded: int
    total_bytes: int
    bytes_uploaded: int
    seconds: float
    gc_deleted_versions: list[int] = field(default_factory=list)


class WeightPublisher:
    """Trainer side. `await publisher.publish(model.state_dict(), version)` once per policy version."""

    def __init__(self, store: BlobStore, pointer: VersionPointer | None = None, *,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 target_shard_bytes: int = DEFAULT_TARGET_SHARD_BYTES,
                 keep_versions: int = 3, parallel: int = 2) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        self.store = store
        self.pointer = pointer
        self.max_shard_bytes = max_shard_bytes
        self.target_shard_bytes = target_shard_bytes
        self.keep_versions = keep_versions
        self.parallel = parallel

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int, *,
                      meta: Mapping[str, str] | None = None, set_pointer: bool = True,
                      gc: bool = True) -> PublishReport:
        """Upload the shards the store lacks, then the manifest, then move the pointer, then GC.

        The order is what makes it safe: a manifest only appears once all its shards are in
        the store, and the pointer only once the manifest is."""
        if version < 0:
            raise ValueError("version must be >= 0")
        t0 = time.perf_counter()
        pieces, entries = await asyncio.to_thread(_pieces, state_dict, self.max_shard_bytes)
        groups = plan_shards([(k, t.numel() * t.element_size()) for k, t in pieces.items()],
                             self.max_shard_bytes, self.target_shard_bytes)
        shard_of: dict[str, str] = {}
        shards: list[ShardEntry | None] = [None] * len(groups)
        uploaded = [0, 0]
        sem = asyncio.Semaphore(self.parallel)

        async def one(i: int, keys: list[str]) -> None:
            async with sem:
                data, sha = await asyncio.to_thread(_serialize, {k: pieces[k] for k in keys})
                key = wire.weights_shard_key(sha)
                if not await self.store.has(key):
                    await self.store.put(key, data)
                    uploaded[0] += 1
                    uploaded[1] += len(data)
                shards[i] = ShardEntry(sha, len(data), keys)
                for k in keys:
                    shard_of[k] = sha

        await asyncio.gather(*(one(i, g) for i, g in enumerate(groups)))
        tensors = [TensorEntry(e.name, e.dtype, e.shape, [TensorPart(shard_of[p.key], p.key, p.start, p.stop)
                                                         for p in e.parts]) for e in entries]
        done = [s for s in shards if s is not None]
        manifest = Manifest(version=version, created=time.time(), total_bytes=sum(s.size for s in done),
                            shards=done, tensors=tensors, meta=dict(meta or {}))
        mkey = wire.weights_manifest_key(version)
        if await self.store.has(mkey):
            old = Manifest.decode(await self.store.read_all(mkey))
            if not old.same_weights(manifest):
                raise ValueError(f"version {version} is already published with other weights; "
                                 f"publish a new version number")
        else:
            await self.store.put(mkey, manifest.encode())
        if set_pointer and self.pointer is not None:
            await self.pointer.set(version)
        report = PublishReport(version, len(done), uploaded[0], manifest.total_bytes, uploaded[1],
                               time.perf_counter() - t0)
        if gc:
            report.gc_deleted_versions = await gc_store(self.store, self.keep_versions)
        log.info("weights published", version=version, shards=report.shards, uploaded=report.shards_uploaded,
                 mb=round(report.total_bytes / 1e6, 1), mb_uploaded=round(report.bytes_uploaded / 1e6, 1),
                 s=round(report.seconds, 2), gc=report.gc_deleted_versions)
        return report

    async def gc(self, keep: int | None = None) -> list[int]:
        return await gc_store(self.store, keep or self.keep_versions)


async def published_versions(store: BlobStore) -> list[int]:
    prefix = "manifests/v"
    return sorted(int(k[len(prefix):].split(".")[0]) for k in await store.list(prefix))


async def gc_store(store: BlobStore, keep: int) -> list[int]:
    """Keep the newest `keep` versions; delete older manifests, then every shard no kept
    manifest references. Returns the deleted versions.

    Manifests go first, so a concurrent reader sees a version either whole or absent
    (`VersionUnavailable`), never a manifest pointing at deleted shards. Run it from the one
    publisher process: a shard uploaded for a manifest not yet written would look orphaned."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    versions = await published_versions(store)
    kept, dropped = versions[-keep:], versions[:-keep]
    for v in dropped:
        await store.delete(wire.weights_manifest_key(v))
    live: set[str] = set()
    for v in kept:
        m = Manifest.decode(await store.read_all(wire.weights_manifest_key(v)))
        live.update(wire.weights_shard_key(s.sha256) for s in m.shards)
    orphans = [k for k in await store.list("shards/") if k not in live]
    for k in orphans:
        await store.delete(k)
    if dropped or orphans:
        log.info("weights gc", deleted_versions=dropped, deleted_shards=len(orphans), kept=kept)
    return dropped


# ---------------------------------------------------------------- worker-side cache


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


# ---------------------------------------------------------------- wiring


async def open_store(js: JetStreamContext | None = None, directory: str | os.PathLike[str] | None = None, *,
                     bucket: str = wire.BUCKET_WEIGHTS, create: bool = True) -> BlobStore:
    """The configured backend: a directory if given (local disk / shared mount), else the
    JetStream Object Store bucket (the embedded default)."""
    if directory:
        return FileBlobStore(directory, create=create)
    if js is None:
        raise ValueError("open_store needs a JetStream context or a directory")
    return await JetStreamBlobStore.open(js, bucket, create=create)
