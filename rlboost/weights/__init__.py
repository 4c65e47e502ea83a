"""The weight store: policy versions as safetensors snapshots or sparse deltas in a blob store,
pulled into a verified local cache.

- `manifest`: the per-version contract (tensors and their SHA-256, shards, delta), validated at the door;
- `blobstore`: the object store backends (embedded JetStream Object Store, a directory);
- `s3`: an S3-compatible bucket as a blob store (optional extra `rlboost[s3]`, obstore);
- `deltas`: bit-exact encodings of a tensor's change (sparse2: positions + integer differences; XOR; raw), zstd-compressed;
- `publisher`: trainer side (snapshot or delta, the version pointer, GC that keeps delta bases);
- `pointer`: the latest published version in the `rb-policy` KV bucket;
- `cache`: worker side, `WeightCache` (tries the ways to a version in order, replays deltas, falls back to a snapshot),
  coordinating `plan` (the ways to a version given what is cached, cheapest first), `fetch` (each blob
  verified, from peers or the origin), `peer_versions` (a rebuilt version taken whole from a peer), `origin`
  (the store read with retries: manifests, snapshot deltas), `disk` (the on-disk content-addressed cache)
  and `stats` (what pulls cost);
- `peers`, `peerhttp`: workers serve each other the blobs they hold verified, the store last;
- `safetensors_io`: zero-copy reading of a verified version directory;
- `source`: `WeightSource` ("version -> folder an engine loads"; `StoreWeights`, `EmulatedWeights`);
- `errors`: the store's errors, under `rlboost.errors.RlboostError`.
"""

from rlboost.weights.blobstore import BlobStore, FileBlobStore, JetStreamBlobStore
from rlboost.weights.cache import CacheStats, VerifiedVersion, WeightCache
from rlboost.weights.errors import (
    DeltaCorrupt,
    ObjectMissing,
    ShardCorrupt,
    StoreError,
    StoreUnavailable,
    VersionGone,
    VersionUnavailable,
)
from rlboost.weights.manifest import (
    MANIFEST_SCHEMA,
    Manifest,
    ShardEntry,
    SnapshotDelta,
    TensorEntry,
    TensorPart,
    check_shard_id,
)
from rlboost.weights.pointer import VersionPointer, parse_version
from rlboost.weights.publisher import (
    DEFAULT_MAX_SHARD_BYTES,
    DEFAULT_TARGET_SHARD_BYTES,
    PublishReport,
    WeightPublisher,
    gc_store,
    open_store,
    plan_shards,
    published_versions,
)
from rlboost.weights.s3 import S3BlobStore
from rlboost.weights.safetensors_io import load_tensors, read_safetensors
from rlboost.weights.source import EmulatedWeights, StoreWeights, WeightSource

__all__ = [
    "BlobStore", "FileBlobStore", "JetStreamBlobStore", "S3BlobStore", "DeltaCorrupt", "ObjectMissing", "ShardCorrupt",
    "StoreError", "StoreUnavailable", "VersionUnavailable", "VersionGone", "MANIFEST_SCHEMA", "Manifest", "ShardEntry",
    "SnapshotDelta", "TensorEntry", "TensorPart", "check_shard_id", "VersionPointer", "parse_version",
    "DEFAULT_MAX_SHARD_BYTES", "DEFAULT_TARGET_SHARD_BYTES", "PublishReport", "WeightPublisher", "gc_store",
    "open_store", "plan_shards", "published_versions", "EmulatedWeights", "StoreWeights", "WeightSource",
    "CacheStats", "WeightCache", "VerifiedVersion", "load_tensors", "read_safetensors",
]

