"""The manifest: the contract between the publisher and every puller, validated at the door.

A version is a list of tensors (name, dtype, shape, SHA-256 of the tensor's bytes) plus how to
get them, in one or both of two forms:
- a **snapshot**: content-addressed safetensors shards (`shards`; each tensor's `parts` say
  which rows live under which key of which shard);
- a **delta** against an earlier version (`delta`): per tensor, an encoded change in a
  content-addressed delta blob (see `rlboost.weights.deltas`), applied to the base version's
  tensor; the result must hash to the tensor's `sha256`, or it is refused.
A delta-only version has no shards; a snapshot may carry a delta too (cheap for a worker that
holds the base). Every id that becomes a file name is checked to be a SHA-256 hex digest.

Beside a delta-only version's manifest the publisher may store a `SnapshotDelta` (its own key,
`wire.weights_snapshot_delta_key`): the version's change from the last snapshot in one delta, so
a late joiner replays one delta on that snapshot instead of every version's since. It is not a
field of the manifest on purpose: a reader before it would decode the manifest without it and
re-encode it to another digest, and so refuse every delta based on that version; apart, the
manifest is exactly what it was, and a reader before it never looks at the other key.
"""

from __future__ import annotations

import hashlib
import re

import msgspec

from rlboost.weights.errors import StoreError

MANIFEST_SCHEMA = 2
ENCODINGS = ("same", "sparse3", "sparse2", "sparse", "xor", "raw")  # see rlboost.weights.deltas; a new format, a new name
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")

_SHA = re.compile(r"[0-9a-f]{64}")


def check_shard_id(sha: str) -> str:
    """A shard/blob id is a lowercase SHA-256 hex digest, full match: it is used as a file name."""
    if not _SHA.fullmatch(sha):
        raise StoreError(f"invalid shard id {sha[:80]!r} in weights manifest: not a SHA-256 hex digest")
    return sha


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
    parts: list[TensorPart]  # in the snapshot's shards; [] in a delta-only version
    sha256: str = ""  # of the tensor's bytes (C order): what a reconstruction must produce


class ShardEntry(msgspec.Struct, frozen=True):
    sha256: str
    size: int
    keys: list[str]  # tensor keys inside the safetensors file (a delta blob: [])


class DeltaTensor(msgspec.Struct, frozen=True, array_like=True):
    """Tensor `name`'s change from the base: `length` bytes at `offset` of blob `blob`,
    encoded as `enc` with `count` changed elements ("same": no bytes, nothing changed)."""

    name: str
    enc: str
    blob: str
    offset: int
    length: int
    count: int


class Delta(msgspec.Struct, frozen=True, kw_only=True):
    base: int  # the version this delta applies to
    base_digest: str  # that version's manifest digest: a cached copy must be exactly it
    blobs: list[ShardEntry]
    tensors: list[DeltaTensor]

    @property
    def bytes(self) -> int:
        return sum(b.size for b in self.blobs)


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    v: int = MANIFEST_SCHEMA
    version: int
    created: float
    total_bytes: int  # bytes of the snapshot's shards (0: delta-only)
    shards: list[ShardEntry]
    tensors: list[TensorEntry]
    dtype: str = ""  # the publish (serving) dtype of the floating-point tensors
    delta: Delta | None = None
    meta: dict[str, str] = {}

    @property
    def snapshot(self) -> bool:
        return bool(self.shards) or not self.tensors

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def decode(data: bytes) -> Manifest:
        """The manifest door: every shard and blob id becomes a file name, so each must be exactly
        a SHA-256 hex digest (no `/`, no `..`, no absolute path); every tensor part must point at
        a listed shard, every delta at a listed blob and a listed tensor, within the blob."""
        try:
            m = msgspec.json.decode(data, type=Manifest)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as e:
            raise StoreError(f"malformed weights manifest: {'nested too deeply' if isinstance(e, RecursionError) else e}") from None
        if m.v != MANIFEST_SCHEMA:
            raise StoreError(f"weights manifest schema {m.v}; this build reads {MANIFEST_SCHEMA}")

        def bad(why: str) -> StoreError:
            return StoreError(f"weights manifest v{m.version}: {why}")

        if m.version < 0:
            raise bad("negative version")
        listed = _listed(m.shards, bad)
        names = set()
        for t in m.tensors:
            if t.dtype not in DTYPES:
                raise bad(f"tensor {t.name[:80]!r} has dtype {t.dtype[:20]!r}")
            if any(d < 0 for d in t.shape):
                raise bad(f"tensor {t.name[:80]!r} has a negative dimension")
            if t.sha256:
                check_shard_id(t.sha256)
            if m.shards and not t.parts:
                raise bad(f"tensor {t.name[:80]!r} is in no shard of the snapshot")
            if not m.shards and t.parts:
                raise bad(f"tensor {t.name[:80]!r} points at shards of a delta-only version")
            for part in t.parts:
                if part.shard not in listed:
                    raise bad(f"tensor {t.name!r} points at unlisted shard {part.shard[:80]!r}")
            names.add(t.name)
        if m.delta is not None:
            _check_delta(m.delta, m.version, names, bad)
            if any(not t.sha256 for t in m.tensors):
                raise bad("a delta version must name every tensor's SHA-256")
        elif not m.shards and m.tensors:
            raise bad("neither shards nor a delta")
        return m

    def digest(self) -> str:
        """The SHA-256 of the manifest's encoding: names exactly this version's weights (each
        shard is named by its own hash). Results carry it per segment (`wire.Segment.weights`)."""
        return hashlib.sha256(self.encode()).hexdigest()

    def same_weights(self, other: Manifest) -> bool:
        """The same tensors bit for bit (names, dtypes, shapes and SHA-256s), however stored."""
        return [(t.name, t.dtype, t.shape, t.sha256) for t in self.tensors] == \
            [(t.name, t.dtype, t.shape, t.sha256) for t in other.tensors]


class SnapshotDelta(msgspec.Struct, frozen=True, kw_only=True):
    """Version `version` (exactly the manifest of digest `manifest_digest`) as one delta from
    the snapshot `delta.base`: stored beside the manifest (see the module docstring)."""

    version: int
    manifest_digest: str
    delta: Delta

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def decode(data: bytes, manifest: Manifest) -> SnapshotDelta:
        """Checked at the door against the version's manifest, as strictly as its own delta: it
        must name that very manifest, and a snapshot before it, and cover every tensor once with
        blob ids that are SHA-256 digests and encodings this build reads."""
        try:
            sd = msgspec.json.decode(data, type=SnapshotDelta)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else e
            raise StoreError(f"malformed snapshot delta: {why}") from None

        def bad(why: str) -> StoreError:
            return StoreError(f"snapshot delta of v{manifest.version}: {why}")

        if sd.version != manifest.version or sd.manifest_digest != manifest.digest():
            raise bad(f"it names v{sd.version} {sd.manifest_digest[:12]!r}, not this manifest")
        if manifest.shards or manifest.delta is None:
            raise bad("only a delta-only version has one")
        _check_delta(sd.delta, manifest.version, {t.name for t in manifest.tensors}, bad)
        return sd


def _check_delta(d: Delta, version: int, names: set[str], bad) -> None:
    """A delta of version `version` whose tensors are `names`: a base before it, blobs named by
    SHA-256 digests, every tensor exactly once, each change inside its blob, known encodings."""
    if not 0 <= d.base < version:
        raise bad(f"delta base {d.base} is not an earlier version")
    check_shard_id(d.base_digest)
    blobs = _listed(d.blobs, bad)
    for dt in d.tensors:
        if dt.enc not in ENCODINGS:  # a newer publisher's format: refused, never guessed at
            raise bad(f"delta of {dt.name[:80]!r}: encoding {dt.enc[:20]!r} is unknown to this build "
                      f"(it reads {', '.join(ENCODINGS)}); upgrade the reader")
        if dt.name not in names or min(dt.offset, dt.length, dt.count) < 0:
            raise bad(f"delta of {dt.name[:80]!r}: unknown tensor or a negative size")
        if dt.enc != "same" and (dt.blob not in blobs or dt.offset + dt.length > blobs[dt.blob]):
            raise bad(f"delta of {dt.name[:80]!r} lies outside its blob")
    if {dt.name for dt in d.tensors} != names or len(d.tensors) != len(names):
        raise bad("the delta does not cover every tensor exactly once")


def _listed(entries: list[ShardEntry], bad) -> dict[str, int]:
    out = {}
    for s in entries:
        check_shard_id(s.sha256)
        if s.size < 0:
            raise bad(f"shard {s.sha256[:12]} has a negative size")
        out[s.sha256] = s.size
    return out
