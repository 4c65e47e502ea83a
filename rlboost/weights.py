"""The weight store, trainer side: publish policy versions as content-addressed safetensors
shards, move the version pointer, garbage-collect. The worker side (pull into a verified local
cache) is `rlboost.weight_cache`; the manifest defined here is the contract between the two.

Trainer side (`WeightPublisher`): a state dict becomes safetensors shards, each named by the
SHA-256 of its bytes, plus one manifest per version (tensor -> shard, dtype, shape, hashes),
then the version pointer in the `rb-policy` KV bucket moves. An unchanged shard has the same
hash, so it is neither uploaded nor fetched again. GC keeps the newest N versions.

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
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
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
    "Manifest", "ShardEntry", "TensorEntry", "TensorPart", "WeightPublisher", "PublishReport", "VersionPointer",
    "VersionUnavailable", "ShardCorrupt", "StoreUnavailable", "ObjectMissing", "StoreError", "open_store",
    "plan_shards", "gc_store",
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
