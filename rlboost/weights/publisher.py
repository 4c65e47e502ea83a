"""The weight store, trainer side: publish policy versions as snapshots (content-addressed
safetensors shards) or sparse deltas against the previous version, move the version pointer,
garbage-collect. The worker side (pull into a verified local cache) is `rlboost.weights.cache`;
the manifest (`rlboost.weights.manifest`) is the contract between the two.

A version is published in the serving dtype the caller hands over (the trainer casts its fp32
master weights to `trainer.publish_dtype`, bf16 for a bf16 model); the manifest records it.

Snapshot or delta: the publisher keeps the previous version's tensors and encodes the new ones
against them (`rlboost.weights.deltas`). The version is stored as a delta when that is at most
`delta_max_ratio` of the full bytes; otherwise, every `full_every` versions, and when there is no
previous version in memory (a fresh or restarted trainer), as a snapshot — which still carries
the delta when it pays, so a worker holding the previous version pulls only the delta. Every
manifest names the SHA-256 of every tensor, which a reconstruction must reproduce bit for bit.

With `snapshot_deltas` (opt-in, off by default), a delta-only version two or more versions after
the last snapshot also gets a snapshot delta (`rlboost.weights.manifest.SnapshotDelta`, stored
beside the manifest): its change from that snapshot in one delta, when that is fewer bytes than the
per-version deltas since the snapshot. A late joiner then replays one delta
on the snapshot instead of all of them (on `rlboost bench weights`' lr 1e-6 steps, one delta of
6.6 % changed elements instead of three of 4.2, 3.0 and 2.5 %: about half the decoding). The
cost is the publisher's: the snapshot's tensors are kept in memory (one more copy of the version
in host RAM), each version is encoded twice (the two encodings run on two threads), and the
cumulative delta, which grows with the distance from the snapshot, is uploaded beside the small
one (docs/benchmarks/weights.md has the figures: 2.7-3.3 times the bytes uploaded per version,
publish 0.50 s -> 1.44 s median at lr 1e-6, for a late-joiner gain the bench cannot tell from its
noise, hence opt-in). A follower pulls only the per-version delta and never reads the snapshot
delta. Off, the publisher stores exactly what it stored before snapshot deltas existed.

Why the shards are cut the way they are: a changed tensor re-ships its whole shard, so the
unit of transfer should be the unit of change — a tensor. Tensors are taken in a stable order
(the state dict's); a tensor of at least `target_shard_bytes` (default 4 MiB: the matrices)
gets a shard of its own, smaller ones (norms, biases, small projections) are packed together
up to that size so a model is hundreds of objects, not thousands. `max_shard_bytes` (default
256 MiB) is a hard bound: a bigger tensor (an embedding) is split into row blocks, so a
reader never holds more than one bounded shard per parallel fetch.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.js import JetStreamContext

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.weights import deltas
from rlboost.weights.deltas import SPARSE_FORMATS
from rlboost.weights.blobstore import BlobStore, FileBlobStore, JetStreamBlobStore
from rlboost.weights.errors import ObjectMissing, StoreError, StoreUnavailable
from rlboost.weights.manifest import Delta, DeltaTensor, Manifest, ShardEntry, SnapshotDelta, TensorEntry, TensorPart

if TYPE_CHECKING:
    import torch

log = get_logger(component="weights")

DEFAULT_MAX_SHARD_BYTES = 256 << 20
DEFAULT_TARGET_SHARD_BYTES = 4 << 20
DELTA_BLOB_BYTES = 64 << 20  # delta payloads are packed into blobs of about this size

__all__ = ["WeightPublisher", "PublishReport", "plan_shards", "gc_store", "published_versions", "open_store",
           "read_snapshot_delta",
           "DEFAULT_MAX_SHARD_BYTES", "DEFAULT_TARGET_SHARD_BYTES"]


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
        dict[str, torch.Tensor], dict[str, torch.Tensor], list[TensorEntry]]:
    """(whole tensors, contiguous CPU pieces keyed for safetensors with oversized tensors split
    into row blocks, entries). Entries carry the tensor's SHA-256 and an empty shard id, filled
    once the shards are hashed. The whole tensors are copies: the publisher keeps them as the
    next delta's base, so a caller changing its tensors in place cannot alter them."""
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, torch.Tensor] = {}
    entries: list[TensorEntry] = []
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous().clone()  # own storage: tied weights, views, later writes
        tensors[name] = t
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
        entries.append(TensorEntry(name, dtype, shape, parts, deltas.tensor_sha256(t)))
    return tensors, pieces, entries


def _serialize(group: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    from safetensors.torch import save

    data = save(group, metadata={"format": "pt"})
    return data, hashlib.sha256(data).hexdigest()


def _encode_delta(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], fmt: str = "sparse3") -> tuple[
        list[DeltaTensor], list[bytes], int]:
    """Per tensor the smallest exact encoding against `old`, packed into blobs of about
    DELTA_BLOB_BYTES. Returns (entries with blob ids, blobs, changed elements)."""
    entries: list[tuple[str, str, int, int, int, int]] = []  # name, enc, blob index, offset, length, count
    blobs: list[bytearray] = [bytearray()]
    changed = 0
    for name, t in new.items():
        enc, count, payload = deltas.encode(old.get(name), t, fmt=fmt)
        changed += count
        if blobs[-1] and len(blobs[-1]) + len(payload) > DELTA_BLOB_BYTES:
            blobs.append(bytearray())
        entries.append((name, enc, len(blobs) - 1, len(blobs[-1]), len(payload), count))
        blobs[-1] += payload
    data = [bytes(b) for b in blobs if b]
    shas = [hashlib.sha256(b).hexdigest() for b in data]
    out = [DeltaTensor(name, enc, shas[i] if length else "", off if length else 0, length, count)
           for name, enc, i, off, length, count in entries]
    return out, data, changed


# ---------------------------------------------------------------- publisher


@dataclass
class PublishReport:
    version: int
    shards: int
    shards_uploaded: int
    total_bytes: int  # of the full version: its shards (a delta-only version: its tensors' bytes)
    bytes_uploaded: int
    seconds: float
    gc_deleted_versions: list[int] = field(default_factory=list)
    manifest_digest: str = ""  # what results' segments name (wire.Segment.weights)
    kind: str = "snapshot"  # snapshot | delta | snapshot+delta
    delta_bytes: int = 0  # bytes of the delta blobs (0: no delta)
    changed_elements: int = 0
    elements: int = 0
    dtype: str = ""
    snapshot_delta_bytes: int = 0  # bytes of the delta from the last snapshot (0: none published)


class WeightPublisher:
    """Trainer side. `await publisher.publish(model.state_dict(), version)` once per policy version."""

    def __init__(self, store: BlobStore, pointer=None, *,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 target_shard_bytes: int = DEFAULT_TARGET_SHARD_BYTES,
                 keep_versions: int = 3, parallel: int = 2, deltas: bool = True,
                 delta_max_ratio: float = 0.5, full_every: int = 10, delta_format: str = "sparse3",
                 snapshot_deltas: bool = False) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1")
        if full_every < 1:
            raise ValueError("full_every must be >= 1")
        if delta_format not in SPARSE_FORMATS:  # (`deltas` is the on/off argument here)
            raise ValueError(f"delta_format must be one of {SPARSE_FORMATS}")
        self.store = store
        self.pointer = pointer
        self.max_shard_bytes = max_shard_bytes
        self.target_shard_bytes = target_shard_bytes
        self.keep_versions = keep_versions
        self.parallel = parallel
        self.deltas = deltas
        self.delta_max_ratio = delta_max_ratio
        self.full_every = full_every
        self.delta_format = delta_format  # sparse2: for workers older than sparse3 (`rlboost.weights.deltas`)
        self.snapshot_deltas = snapshot_deltas
        # the last version this process published: (version, manifest digest, tensors) = the next delta's base
        self._prev: tuple[int, str, dict[str, torch.Tensor]] | None = None
        self._last_snapshot: int | None = None
        # the last snapshot's (version, manifest digest, tensors), the base of `snapshot_delta`s
        # (None: snapshot deltas are off), and the bytes of the per-version deltas published since
        self._snap: tuple[int, str, dict[str, torch.Tensor]] | None = None
        self._chain_bytes = 0

    async def publish(self, state_dict: Mapping[str, torch.Tensor], version: int, *,
                      meta: Mapping[str, str] | None = None, set_pointer: bool = True,
                      gc: bool = True) -> PublishReport:
        """Upload the blobs the store lacks, then the manifest, then move the pointer, then GC.

        The order is what makes it safe: a manifest only appears once all its blobs are in
        the store, and the pointer only once the manifest is."""
        if version < 0:
            raise ValueError("version must be >= 0")
        t0 = time.perf_counter()
        tensors, pieces, entries = await asyncio.to_thread(_pieces, state_dict, self.max_shard_bytes)
        full_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        dtypes = sorted({e.dtype for e in entries if e.dtype.startswith(("float", "bfloat"))})
        uploaded = [0, 0]

        async def put(key: str, data: bytes) -> None:
            if not await self.store.has(key):
                await self.store.put(key, data)
                uploaded[0] += 1
                uploaded[1] += len(data)

        delta: Delta | None = None
        from_snap: Delta | None = None
        changed = 0
        prev, snap = self._prev, self._snap
        if self.deltas and prev is not None and prev[0] < version:
            # from the last snapshot too, when the previous version is not that snapshot; on a
            # second thread (numpy and zstd release the GIL), which a busy box does not always have
            cumulative = snap is not None and snap[0] < prev[0] and version - snap[0] < self.full_every
            encoded = await asyncio.gather(
                asyncio.to_thread(_encode_delta, prev[2], tensors, self.delta_format),
                *([asyncio.to_thread(_encode_delta, snap[2], tensors, self.delta_format)] if cumulative else []))
            dts, blobs, changed = encoded[0]
            if sum(map(len, blobs)) <= self.delta_max_ratio * full_bytes:  # else it does not pay
                delta = await self._upload_delta(prev, dts, blobs, put)
                cum_bytes = sum(map(len, encoded[1][1])) if cumulative else 0
                if cumulative and cum_bytes < self._chain_bytes + delta.bytes \
                        and cum_bytes <= self.delta_max_ratio * full_bytes:
                    from_snap = await self._upload_delta(snap, encoded[1][0], encoded[1][1], put)
        snapshot = (delta is None or self._last_snapshot is None
                    or version - self._last_snapshot >= self.full_every)
        if snapshot:
            from_snap = None  # a snapshot is its own start

        shard_list: list[ShardEntry] = []
        if snapshot:
            shard_list, entries = await self._upload_shards(pieces, entries, put)
        else:
            entries = [TensorEntry(e.name, e.dtype, e.shape, [], e.sha256) for e in entries]
        manifest = Manifest(version=version, created=time.time(), total_bytes=sum(s.size for s in shard_list),
                            shards=shard_list, tensors=entries, dtype=",".join(dtypes), delta=delta,
                            meta=dict(meta or {}))
        mkey = wire.weights_manifest_key(version)
        old = await read_manifest(self.store, version) if await self.store.has(mkey) else None
        if old is not None:  # (an unreadable one is nobody's weights: ours replaces it)
            if not old.same_weights(manifest):
                raise ValueError(f"version {version} is already published with other weights; "
                                 f"publish a new version number")
            manifest = old  # workers pull the stored one: its digest names this version
        else:
            if from_snap is not None:  # before the manifest: a reader that sees the manifest sees it
                await self.store.put(wire.weights_snapshot_delta_key(version), SnapshotDelta(
                    version=version, manifest_digest=manifest.digest(), delta=from_snap).encode())
            await self.store.put(mkey, manifest.encode())
        if manifest.snapshot:
            self._last_snapshot = version
            self._chain_bytes = 0
            self._snap = (version, manifest.digest(), tensors) if self.snapshot_deltas and manifest.shards else None
        else:
            self._chain_bytes += manifest.delta.bytes if manifest.delta else 0
        if old is not None:
            from_snap = None  # the stored manifest's own (if any) stays
        self._prev = (version, manifest.digest(), tensors)
        if set_pointer and self.pointer is not None:
            await self.pointer.set(version)
        kind = "snapshot+delta" if manifest.shards and manifest.delta else "snapshot" if manifest.snapshot else "delta"
        report = PublishReport(version, len(manifest.shards), uploaded[0], manifest.total_bytes or full_bytes,
                               uploaded[1], time.perf_counter() - t0, manifest_digest=manifest.digest(), kind=kind,
                               delta_bytes=manifest.delta.bytes if manifest.delta else 0,
                               changed_elements=changed, elements=sum(t.numel() for t in tensors.values()),
                               dtype=manifest.dtype,
                               snapshot_delta_bytes=from_snap.bytes if from_snap else 0)
        if gc:
            report.gc_deleted_versions = await gc_store(self.store, self.keep_versions, upto=version)
        log.info("weights published", version=version, kind=kind, dtype=manifest.dtype,
                 mb=round(report.total_bytes / 1e6, 1), delta_mb=round(report.delta_bytes / 1e6, 2),
                 mb_uploaded=round(report.bytes_uploaded / 1e6, 1), s=round(report.seconds, 2),
                 gc=report.gc_deleted_versions)
        return report

    async def _upload_delta(self, base: tuple[int, str, dict], dts: list[DeltaTensor], blobs: list[bytes],
                            put) -> Delta:
        delta = Delta(base=base[0], base_digest=base[1], tensors=dts,
                      blobs=[ShardEntry(hashlib.sha256(b).hexdigest(), len(b), []) for b in blobs])
        for entry, b in zip(delta.blobs, blobs):
            await put(wire.weights_delta_key(entry.sha256), b)
        return delta

    async def _upload_shards(self, pieces: dict[str, torch.Tensor], entries: list[TensorEntry],
                             put) -> tuple[list[ShardEntry], list[TensorEntry]]:
        groups = plan_shards([(k, t.numel() * t.element_size()) for k, t in pieces.items()],
                             self.max_shard_bytes, self.target_shard_bytes)
        shard_of: dict[str, str] = {}
        shards: list[ShardEntry | None] = [None] * len(groups)
        sem = asyncio.Semaphore(self.parallel)

        async def one(i: int, keys: list[str]) -> None:
            async with sem:
                data, sha = await asyncio.to_thread(_serialize, {k: pieces[k] for k in keys})
                await put(wire.weights_shard_key(sha), data)
                shards[i] = ShardEntry(sha, len(data), keys)
                for k in keys:
                    shard_of[k] = sha

        await asyncio.gather(*(one(i, g) for i, g in enumerate(groups)))
        tensors = [TensorEntry(e.name, e.dtype, e.shape, [TensorPart(shard_of[p.key], p.key, p.start, p.stop)
                                                         for p in e.parts], e.sha256) for e in entries]
        return [s for s in shards if s is not None], tensors

    async def gc(self, keep: int | None = None) -> list[int]:
        return await gc_store(self.store, keep or self.keep_versions, upto=self._prev[0] if self._prev else None)


_MANIFEST_KEY = re.compile(r"manifests/v(\d{1,18})\.json")
_SNAPSHOT_DELTA_KEY = re.compile(r"snapdeltas/v(\d{1,18})\.json")
_reported: set[tuple[int, str]] = set()  # invalid entries (store, key) this process reported: one line each


def _report_invalid(store: BlobStore, key: str, why: object) -> None:
    if (id(store), key) not in _reported:
        _reported.add((id(store), key))
        log.warning("weight store: skipping an invalid entry (not published by this build's publisher)",
                    key=key[:200], reason=str(why)[:300])


async def published_versions(store: BlobStore) -> list[int]:
    """The versions with a manifest in the store. A name that is not a manifest key (planted,
    or another tool's) is skipped and reported once, never a reason to fail."""
    out = []
    for key in await store.list("manifests/v"):
        m = _MANIFEST_KEY.fullmatch(key)
        if m is None:
            _report_invalid(store, key, "not a manifest name")
        else:
            out.append(int(m.group(1)))
    return sorted(out)


async def read_manifest(store: BlobStore, version: int) -> Manifest | None:
    """The version's manifest, or None if it is gone or invalid (reported once): the store is
    shared, and a manifest nobody can load is no version of anyone's. A store that does not
    answer (`StoreUnavailable`) still raises: that is not the manifest's fault."""
    return await _read_checked(store, wire.weights_manifest_key(version), Manifest.decode)


async def read_snapshot_delta(store: BlobStore, manifest: Manifest) -> SnapshotDelta | None:
    """The snapshot delta stored beside `manifest`, checked against it; None if there is none,
    or it is invalid (reported once): it only ever saves a late joiner some replay."""
    return await _read_checked(store, wire.weights_snapshot_delta_key(manifest.version),
                               lambda data: SnapshotDelta.decode(data, manifest))


async def _read_checked(store: BlobStore, key: str, decode):
    """`decode(bytes)` of the object at `key`; None if it is missing or does not decode
    (reported once); a store that does not answer raises."""
    try:
        return decode(await store.read_all(key))
    except ObjectMissing:
        return None
    except StoreUnavailable:
        raise
    except StoreError as e:
        _report_invalid(store, key, e)
        return None


async def gc_store(store: BlobStore, keep: int, upto: int | None = None) -> list[int]:
    """Keep the newest `keep` versions and every version they need (a delta-only version needs
    its base, back to a snapshot); delete the other manifests, then every shard and delta blob
    no kept manifest references. Returns the deleted versions.

    `upto`: the version this publisher published last. Newer manifests are not its to judge
    (and must not push its own versions out of the window): they are neither counted nor
    deleted, nor are their blobs. Invalid manifests (`read_manifest`) are skipped and reported,
    never counted, never deleted.

    Manifests go first, so a concurrent reader sees a version either whole or absent
    (`VersionUnavailable`), never a manifest pointing at deleted blobs. Run it from the one
    publisher process: a blob uploaded for a manifest not yet written would look orphaned."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    versions = await published_versions(store)
    newer = [v for v in versions if upto is not None and v > upto]
    needed: dict[int, Manifest] = {}
    invalid: set[int] = set()
    kept = 0
    for v in reversed([v for v in versions if v not in newer]):
        if kept >= keep:
            break
        if v in needed:
            kept += 1
            continue
        first = True
        while v not in needed:
            m = await read_manifest(store, v)
            if m is None:
                if first:
                    invalid.add(v)
                else:
                    log.warning("weights gc: a kept version's base is gone or invalid", version=v)
                break
            kept += first
            first = False
            needed[v] = m
            if m.snapshot or m.delta is None:
                break
            v = m.delta.base
    others: list[Manifest] = []  # newer versions' blobs stay
    for v in newer:
        if (m := await read_manifest(store, v)) is not None:
            others.append(m)
    dropped = [v for v in versions if v not in needed and v not in invalid and v not in newer]
    for v in dropped:
        await store.delete(wire.weights_manifest_key(v))
    live: set[str] = set()
    kept_manifests = {m.version: m for m in [*needed.values(), *others]}
    for m in kept_manifests.values():
        live.update(wire.weights_shard_key(s.sha256) for s in m.shards)
        if m.delta is not None:
            live.update(wire.weights_delta_key(b.sha256) for b in m.delta.blobs)
    for key in await store.list("snapdeltas/"):  # a kept version's snapshot delta keeps its blobs
        match = _SNAPSHOT_DELTA_KEY.fullmatch(key)
        if match is None:
            _report_invalid(store, key, "not a snapshot delta name")
            continue
        v = int(match.group(1))
        if v in kept_manifests:
            sd = await read_snapshot_delta(store, kept_manifests[v])
            if sd is not None:
                live.update(wire.weights_delta_key(b.sha256) for b in sd.delta.blobs)
        elif upto is None or v <= upto:  # its version is gone (or was never written)
            await store.delete(key)
    orphans = [k for k in await store.list("shards/") + await store.list("deltas/") if k not in live]
    for k in orphans:
        await store.delete(k)
    if dropped or orphans:
        log.info("weights gc", deleted_versions=dropped, deleted_blobs=len(orphans), kept=sorted(needed))
    return dropped


# ---------------------------------------------------------------- wiring


async def open_store(js: JetStreamContext | None = None, directory: str | os.PathLike[str] | None = None, *,
                     url: str = "", s3_endpoint: str = "", s3_region: str = "",
                     bucket: str = wire.BUCKET_WEIGHTS, create: bool = True, replicas: int = 1) -> BlobStore:
    """The configured backend (`[weights] store`, passed as `url`): `s3://bucket/prefix` an
    S3-compatible bucket (`rlboost.weights.s3`, endpoint/region from `s3_endpoint`/`s3_region`
    or the environment, credentials from the environment only); `file:///path` or a path a
    directory (local disk / shared mount; also `directory`); empty: the JetStream Object Store
    bucket (the embedded default)."""
    if url.startswith("s3://"):
        from rlboost.weights.s3 import S3BlobStore

        return S3BlobStore(url, endpoint=s3_endpoint, region=s3_region)
    if "://" in url and not url.startswith("file://"):
        raise ValueError(f"weight store {url!r}: use s3://bucket/prefix, file:///path, a path, or empty (JetStream)")
    if url:
        directory = os.path.expanduser(url.removeprefix("file://"))
    if directory:
        return FileBlobStore(directory, create=create)
    if js is None:
        raise ValueError("open_store needs a JetStream context, a directory or a store URL")
    return await JetStreamBlobStore.open(js, bucket, create=create, replicas=replicas)
