"""Sparse weight deltas: bit-exact chains, refusal of corrupt deltas and lying hashes with recovery
through a snapshot, GC that keeps the bases, skipped versions, the torch engine on a rebuilt folder.
Real stores (a directory, the JetStream Object Store), real publisher and cache."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

import msgspec
import numpy as np
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file

from rlboost import wire
from rlboost.errors import RlboostError
from rlboost.weights import (
    BlobStore,
    DeltaCorrupt,
    FileBlobStore,
    JetStreamBlobStore,
    Manifest,
    ShardCorrupt,
    SnapshotDelta,
    StoreError,
    WeightCache,
    WeightPublisher,
    deltas,
    published_versions,
)
from rlboost.weights.publisher import read_snapshot_delta
from rlboost.weights.safetensors_io import whole_tensor_dir


class Policy:
    """fp32 master weights taking small steps; published in bf16, as a trainer does. A step of
    `lr` moves every element, but only those crossing a bf16 rounding boundary change bits."""

    def __init__(self, seed: int = 0, lr: float = 1e-5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.g, self.lr = g, lr
        self.master = {"embed.weight": torch.randn(96, 64, generator=g) * 0.02,
                       "layers.0.attn.weight": torch.randn(64, 64, generator=g) * 0.02,
                       "layers.0.norm.weight": torch.ones(64),
                       "layers.0.mlp.weight": torch.randn(128, 64, generator=g) * 0.02}

    def step(self) -> None:
        for t in self.master.values():
            t.add_(torch.randn(t.shape, generator=self.g).sign() * self.lr)

    def published(self) -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16) for k, v in self.master.items()} | {"positions": torch.arange(16)}


def assert_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:  # bit patterns, not values: -0.0 == 0.0 and NaN != NaN would hide differences
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(deltas.bits(a[k]), deltas.bits(b[k])), k


@pytest_asyncio.fixture(params=["file", "jetstream"])
async def store(request, js, tmp_path) -> AsyncIterator[BlobStore]:
    if request.param == "file":
        yield FileBlobStore(tmp_path / "store", create=True)
        return
    bucket = f"rbd-{uuid.uuid4().hex[:10]}"
    yield await JetStreamBlobStore.open(js, bucket)
    with contextlib.suppress(Exception):
        await js.delete_object_store(bucket)


async def publish_chain(pub: WeightPublisher, policy: Policy, versions: range) -> dict[int, dict]:
    out = {}
    for v in versions:
        if v != versions.start:
            policy.step()
        out[v] = policy.published()
        await pub.publish(out[v], v)
    return out


async def manifest(store: BlobStore, v: int) -> Manifest:
    return Manifest.decode(await store.read_all(wire.weights_manifest_key(v)))


# ---------------------------------------------------------------- encodings


def round_trip(old: torch.Tensor, new: torch.Tensor) -> str:
    """Encode `new` against `old` in each format the publisher writes and as sparse2 with the band
    (the format before: still read), decode each both ways (a copy, in place): bit for bit `new`.
    Returns the encoding chosen by default."""
    encs = {}
    for fmt in deltas.SPARSE_FORMATS + ("band",):
        if fmt == "band":
            ob, nb = deltas.bits(old), deltas.bits(new)
            changed = ob != nb
            if not (changed.any() and old.dtype == new.dtype and old.shape == new.shape):
                continue
            enc, count = "sparse2", int(np.count_nonzero(changed))
            payload = deltas._sparse2(ob, nb, changed, str(new.dtype).removeprefix("torch."), True)
        else:
            enc, count, payload = deltas.encode(old, new, fmt=fmt)
        encs[fmt] = enc
        for inplace in (False, True):
            base = deltas.bits(old).copy()
            got = deltas.decode(base, enc, count, payload, new.numel(), new.element_size(), inplace=inplace)
            assert np.array_equal(got, deltas.bits(new)), (new.dtype, enc, fmt, inplace)
    return encs["sparse3"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool])
def test_every_encoding_round_trips_bit_exactly(dtype):
    g = torch.Generator().manual_seed(1)
    old = (torch.randn(4096, generator=g) * 10).to(dtype)
    seen = set()
    for frac in (0.0, 0.01, 0.2, 0.9):
        new = old.clone()
        idx = torch.randperm(old.numel(), generator=g)[:int(frac * old.numel())]
        new[idx] = (torch.randn(idx.numel(), generator=g) * 10).to(dtype) if dtype != torch.bool else ~old[idx]
        seen.add(round_trip(old, new))
    enc, count, payload = deltas.encode(None, old)  # no base: raw
    assert enc == "raw" and np.array_equal(deltas.decode(None, enc, count, payload, old.numel(),
                                                         old.element_size()), deltas.bits(old))
    assert "same" in seen and "sparse3" in seen and seen & {"xor", "raw"}


def small_steps(dtype: torch.dtype, n: int, scale: float, lr: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A trainer's step as the publisher sees it: fp32 masters (Gaussian, as a weight matrix is)
    moved by about lr each, cast. The small-magnitude ones change most."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * scale
    return master.to(dtype), (master + torch.randn(n, generator=g) * lr).to(dtype)


# lr: bf16 and fp32 at about 1% of a typical element's ULP; fp16's scale keeps most elements above its subnormals
@pytest.mark.parametrize("dtype, scale, lr", [(torch.bfloat16, 0.02, 1e-6), (torch.float16, 1.0, 1e-4),
                                              (torch.float32, 0.02, 1e-11)])
def test_small_steps_cost_less_in_sparse3_than_in_each_format_before(dtype, scale, lr):
    old, new = small_steps(dtype, 1 << 18, scale, lr, seed=2)
    assert round_trip(old, new) == "sparse3"
    ob, nb = deltas.bits(old), deltas.bits(new)
    name = str(dtype).removeprefix("torch.")
    enc, count, payload = deltas.encode(old, new)
    threshold, in_band, *_ = deltas._HEADER3.unpack_from(payload)
    assert threshold and 0 < in_band <= count  # the small elements' changes are ranked in their band
    sizes = {"sparse3": len(payload), "sparse2": len(deltas.encode(old, new, fmt="sparse2")[2]),
             "band": len(deltas._sparse2(ob, nb, ob != nb, name, True))}
    # sparse2's band ranks the small elements apart too; sparse3 also codes each stream, the signs and
    # the steps apart
    assert sizes["sparse3"] < sizes["band"] < sizes["sparse2"]
    # the format before (uint32 gaps and XORs, byte planes) of the same change is bigger; it is still read
    ob, nb = deltas.bits(old), deltas.bits(new)
    idx = np.flatnonzero(ob != nb)
    gaps = (np.diff(idx, prepend=-1) - 1).astype(np.uint32)
    legacy = deltas._zstd(deltas._planes(gaps) + deltas._planes((ob ^ nb)[idx]))
    assert sizes["sparse2"] < 0.9 * len(legacy)
    assert np.array_equal(deltas.decode(ob.copy(), "sparse", count, legacy, old.numel(), old.element_size()), nb)


def test_adversarial_tensors_round_trip_bit_exactly():
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(-32768, 32768, (8192,), generator=g, dtype=torch.int32).to(torch.int16)
    old = pattern.view(torch.bfloat16)  # every bit pattern: NaNs (several payloads), +-inf, -0.0, subnormals
    assert old.isnan().any()
    specials = torch.tensor([0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x8000, 0x0000, 0x0001, 0x7F7F],
                            dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    old = torch.cat([old, specials])
    new = old.clone()
    new.view(torch.int16)[::13] ^= torch.tensor(0x7FFF, dtype=torch.int16)  # jumps across NaN, inf, sign, zero
    new.view(torch.int16)[-len(specials):] = specials.view(torch.int16).flip(0)  # NaN <-> inf <-> 0 ...
    assert round_trip(old, new) == "sparse3"
    assert round_trip(old, old.clone()) == "same"
    assert round_trip(old, (new.view(torch.int16) + 1).view(torch.bfloat16)) in ("raw", "xor")  # all changed
    one = old.clone()
    one.view(torch.int16)[-1] += 1  # a single change, the last element
    assert round_trip(old, one) == "sparse3"
    wide = torch.zeros(3 << 20, dtype=torch.bfloat16)  # gaps past 255, 2**16 and 2**21: escaped
    far = wide.clone()
    far[[0, 70_000, (3 << 20) - 1]] = 1.0
    assert round_trip(wide, far) == "sparse3"
    gaps = np.array([0, 254, 255, 256, 70_000, (1 << 32) - 1], np.int64)
    packed, escapes = deltas._gaps(gaps)
    assert escapes == 4 and np.array_equal(deltas._ungaps(packed, gaps.size, escapes), gaps)


def sparse2(header: tuple[int, int, int, int], positions: bytes, diffs: bytes) -> bytes:
    return deltas._zstd(deltas._HEADER.pack(*header) + positions + diffs)


def test_a_hostile_payload_is_refused_not_allocated():
    old = torch.zeros(1000, dtype=torch.bfloat16)
    new = old.clone()
    new[::100] = 1
    enc, count, payload = deltas.encode(old, new, fmt="sparse2")
    assert enc == "sparse2"
    base = deltas.bits(old)
    with pytest.raises(DeltaCorrupt):  # claims more elements than the tensor has
        deltas.decode(base, "sparse2", 10**9, payload, 1000, 2)
    with pytest.raises(DeltaCorrupt):  # not zstd
        deltas.decode(base, enc, count, b"\x28\xb5\x2f\xfd garbage", 1000, 2)
    bomb = deltas._zstd(bytes(64 << 20))  # inflates far past the 2,000 bytes a raw tensor may have
    with pytest.raises(DeltaCorrupt, match="more than"):
        deltas.decode(None, "raw", 0, bomb, 1000, 2)
    with pytest.raises(DeltaCorrupt, match="more than"):  # nor past what `count` positions and values can take
        deltas.decode(base, "sparse2", count, bomb, 1000, 2)
    far = deltas._zstd(np.array([5000] * count, np.uint32).tobytes() + bytes(2 * count))
    with pytest.raises(DeltaCorrupt, match="past the end"):  # the old format still checked
        deltas.decode(base, "sparse", count, far, 1000, 2)
    ones, zeros = bytes([1] * 10), bytes(20)
    escape = deltas._planes(np.array([5000], np.uint32))  # a gap of 255 + 5000
    with pytest.raises(DeltaCorrupt, match="past the end of the tensor"):
        deltas.decode(base, "sparse2", 10, sparse2((0, 0, 0, 1), bytes([254] * 9 + [255]) + escape, zeros), 1000, 2)
    with pytest.raises(DeltaCorrupt, match="header"):  # more changes in the band than in all
        deltas.decode(base, "sparse2", 10, sparse2((1 << 7, 7, 11, 0), ones, zeros), 1000, 2)
    with pytest.raises(DeltaCorrupt, match="header"):  # a threshold wider than the element
        deltas.decode(base, "sparse2", 10, sparse2((1 << 20, 7, 5, 0), ones, zeros), 1000, 2)
    with pytest.raises(DeltaCorrupt, match="header"):  # an escape the bytes do not hold
        deltas.decode(base, "sparse2", 10, sparse2((0, 0, 0, 1), ones, zeros), 1000, 2)
    with pytest.raises(DeltaCorrupt, match="escapes"):  # an escape the header does not count
        deltas.decode(base, "sparse2", 10, sparse2((0, 0, 0, 0), bytes([1] * 9 + [255]), zeros), 1000, 2)
    # the band of a zero tensor is all of it (magnitude 0 < 1 << 7): 1000 members, rank 1000 is past it
    rank = deltas._planes(np.array([1000 - 255], np.uint32))
    with pytest.raises(DeltaCorrupt, match="past the end of its band"):
        deltas.decode(base, "sparse2", 1, sparse2((1 << 7, 7, 1, 1), b"\xff" + rank, zeros[:2]), 1000, 2)
    with pytest.raises(DeltaCorrupt, match="unknown delta encoding"):
        deltas.decode(base, "sparse4", count, payload, 1000, 2)
    assert issubclass(DeltaCorrupt, ShardCorrupt) and issubclass(DeltaCorrupt, RlboostError)


def sparse3(threshold: int, in_band: int, gaps: tuple[bytes, bytes], escapes=(0, 0), steps: bytes | None = None,
            count: int = 10) -> bytes:
    """A sparse3 payload as written (`deltas._sparse3`), from its parts."""
    frames = [deltas._zstd(g) for g in gaps]
    tail = deltas._zstd(bytes(2 * count) if steps is None else steps)
    return (deltas._HEADER3.pack(threshold, in_band, *escapes, *map(len, frames), len(tail))
            + b"".join(frames) + bytes((count + 7) // 8) + tail)


def test_a_hostile_sparse3_payload_is_refused():
    base = deltas.bits(torch.zeros(1000, dtype=torch.bfloat16))  # magnitude 0: in any band
    c = bytes([99] * 10)  # ten changes, every 100th element
    got = deltas.decode(base.copy(), "sparse3", 10, sparse3(0, 0, (b"", c)), 1000, 2)
    assert np.flatnonzero(got).tolist() == list(range(99, 1000, 100))  # the parts make a valid payload
    t = 1 << 7  # the band: magnitudes below 1 << 7, here every element
    refused = {
        "header": [sparse3(1 << 15, 1, (c[:1], c[:9])),  # a threshold wider than the magnitude
                   sparse3(t, 11, (c + c[:1], b"")),  # more changes in the band than in all
                   sparse3(0, 1, (c[:1], c[:9])),  # a band without a threshold
                   sparse3(t, 0, (b"", c))[:-1],  # its parts do not add up to it
                   sparse3(t, 1, (c[:1], c[:9]), escapes=(2, 0))],  # more escapes than gaps
        "past the end of its band": [sparse3(t, 1, (b"\xff" + deltas._planes(np.array([1000 - 255], np.uint32)),
                                                    c[:9]), escapes=(1, 0))],
        "past the end of the tensor": [sparse3(0, 0, (b"", bytes([200] * 10)))],
        "escapes": [sparse3(0, 0, (b"", bytes([99] * 9 + [255])))],
        "more than": [sparse3(0, 0, (b"", c), steps=bytes(64 << 20))],  # a bomb of steps
    }
    for why, payloads in refused.items():
        for payload in payloads:
            with pytest.raises(DeltaCorrupt, match=why):
                deltas.decode(base.copy(), "sparse3", 10, payload, 1000, 2)


async def test_a_reader_of_a_format_before_refuses_a_newer_delta_clearly(tmp_path, monkeypatch):
    """The manifest names each tensor's encoding; a build that does not know one refuses the
    version at the door instead of misreading its bytes. The readers before sparse3 and before
    sparse2 knew these encodings (as committed in 62d22c2 and 24c90b5); against manifests this
    publisher writes, by default and with `delta_format = "sparse2"` (for workers before sparse3)."""
    from rlboost.config import WeightsSettings
    from rlboost.weights import manifest as manifest_module

    before = {"sparse3": ("same", "sparse2", "sparse", "xor", "raw"), "sparse2": ("same", "sparse", "xor", "raw")}
    for fmt in ("sparse3", "sparse2"):
        store = FileBlobStore(tmp_path / f"store-{fmt}", create=True)
        pub = WeightPublisher(store, **WeightsSettings(delta_format=fmt).publisher_options())
        await publish_chain(pub, Policy(seed=8, lr=1e-6), range(0, 2))
        data = await store.read_all(wire.weights_manifest_key(1))
        assert fmt in {t.enc for t in Manifest.decode(data).delta.tensors} <= {fmt, "same", "xor"}
        with monkeypatch.context() as m:
            m.setattr(manifest_module, "ENCODINGS", before[fmt])  # the reader before it
            with pytest.raises(StoreError, match=f"'{fmt}' is unknown to this build"):
                Manifest.decode(data)
            if fmt == "sparse2":  # what a worker before sparse3 reads
                m.setattr(manifest_module, "ENCODINGS", before["sparse3"])
                Manifest.decode(data)
    m1 = Manifest.decode(data)  # and this build names what it does not know
    later = msgspec.structs.replace(m1.delta, tensors=[msgspec.structs.replace(t, enc="sparse4")
                                                       for t in m1.delta.tensors])
    with pytest.raises(StoreError, match="'sparse4' is unknown to this build"):
        Manifest.decode(msgspec.structs.replace(m1, delta=later).encode())


# ---------------------------------------------------------------- acceptance


async def test_a_chain_of_deltas_reconstructs_bit_exactly(store, tmp_path):
    pub = WeightPublisher(store, full_every=4, keep_versions=10)
    policy = Policy()
    truth = await publish_chain(pub, policy, range(0, 7))
    kinds = {v: await manifest(store, v) for v in truth}
    assert [bool(m.shards) for m in kinds.values()] == [True, False, False, False, True, False, False]
    assert all(m.delta is not None for v, m in kinds.items() if v > 0)  # the v4 snapshot carries one too
    assert all(m.dtype == "bfloat16" for m in kinds.values())  # the publish dtype is recorded
    full = kinds[0].total_bytes
    assert all(m.delta.bytes < full / 4 for v, m in kinds.items() if v > 0)

    follower = WeightCache(tmp_path / "follower", store)  # pulls every version as it comes
    for v in truth:
        before = follower.stats.bytes_fetched
        vv = await follower.ensure(v)
        assert_exact(vv.load_tensors(), truth[v])
        if v > 0:  # only the delta moved, the v4 snapshot included
            assert follower.stats.bytes_fetched - before == kinds[v].delta.bytes
    assert follower.stats.reconstructed == 6 and follower.stats.paths_refused == 0
    assert follower.cached_versions() == [4, 5, 6]  # pruned as it goes: a rebuilt version is a full copy

    assert await store.list("snapdeltas/") == []  # snapshot deltas are opt-in: none by default
    late = WeightCache(tmp_path / "late", store)  # nothing cached: the nearest snapshot + deltas
    assert_exact((await late.ensure(6)).load_tensors(), truth[6])
    assert late.stats.bytes_fetched == kinds[4].total_bytes + kinds[5].delta.bytes + kinds[6].delta.bytes
    with whole_tensor_dir(late.versions_dir / f"v{6:012d}") as whole:  # a rebuilt folder is whole already
        assert whole == late.versions_dir / f"v{6:012d}"
        # the cache writes these files itself: the safetensors library (vLLM's reader) reads them as its own
        assert_exact({k: v for f in whole.glob("tensors-*.safetensors") for k, v in load_file(f).items()}, truth[6])

    away = WeightCache(tmp_path / "away", store)  # held v1, was away for five versions
    await away.ensure(1)
    before = away.stats.bytes_fetched
    assert_exact((await away.ensure(6)).load_tensors(), truth[6])
    assert away.stats.bytes_fetched - before == sum(kinds[v].delta.bytes for v in range(2, 7))


async def test_a_corrupt_delta_is_refused_and_the_worker_recovers_through_a_snapshot(tmp_path):
    store = FileBlobStore(tmp_path / "store", create=True)
    pub = WeightPublisher(store, full_every=3)
    truth = await publish_chain(pub, Policy(seed=2), range(0, 4))  # v0 snapshot, v1 v2 deltas, v3 snapshot
    cache = WeightCache(tmp_path / "cache", store, corrupt_retries=2)
    await cache.ensure(1)
    m2 = await manifest(store, 2)
    blob = tmp_path / "store" / wire.weights_delta_key(m2.delta.blobs[0].sha256)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the stored copy rotted: every read is wrong
    blob.write_bytes(bytes(data))

    with pytest.raises(ShardCorrupt):  # v2 exists only as that delta: refused, not loaded
        await cache.ensure(2)
    assert 2 not in cache.cached_versions()
    vv = await cache.ensure(3)  # cheapest path (v1 + d2 + d3) is refused; the v3 snapshot serves
    assert_exact(vv.load_tensors(), truth[3])
    assert cache.stats.paths_refused >= 1


async def test_a_late_joiner_whose_delta_rotted_loads_nothing_and_leaves_nothing(tmp_path):
    """The only path is the v0 snapshot + two deltas, one of them rotted in the store: the pull
    fails clearly, with no replay and nothing left in tmp/ or shards/; repaired, it succeeds."""
    store = FileBlobStore(tmp_path / "store", create=True)
    truth = await publish_chain(WeightPublisher(store, full_every=3), Policy(seed=2), range(0, 3))
    m2 = await manifest(store, 2)
    blob = tmp_path / "store" / wire.weights_delta_key(m2.delta.blobs[0].sha256)
    good = blob.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    late = WeightCache(tmp_path / "late", store, corrupt_retries=2)
    with pytest.raises(ShardCorrupt, match="failed verification"):
        await late.ensure(2)
    assert late.cached_versions() == [] and late.stats.reconstructed == 0
    assert not list(late.tmp_dir.iterdir()) and not list(late.shards_dir.iterdir())
    blob.write_bytes(good)  # the store repaired: the same cache pulls it
    assert_exact((await late.ensure(2)).load_tensors(), truth[2])


async def test_a_lying_hash_is_refused_and_the_worker_recovers_through_a_snapshot(tmp_path):
    store = FileBlobStore(tmp_path / "store", create=True)
    pub = WeightPublisher(store, full_every=3)
    truth = await publish_chain(pub, Policy(seed=3), range(0, 4))
    m2 = await manifest(store, 2)
    lie = [msgspec.structs.replace(t, sha256="0" * 64) if t.name == "layers.0.attn.weight" else t
           for t in m2.tensors]
    await store.put(wire.weights_manifest_key(2), msgspec.structs.replace(m2, tensors=lie).encode())
    cache = WeightCache(tmp_path / "cache", store)
    await cache.ensure(1)

    with pytest.raises(DeltaCorrupt, match="does not match"):
        await cache.ensure(2)
    assert 2 not in cache.cached_versions() and not list(cache.tmp_dir.iterdir())  # nothing half-built
    assert_exact((await cache.ensure(3)).load_tensors(), truth[3])


async def test_gc_never_deletes_a_base_a_kept_version_depends_on(store, tmp_path):
    pub = WeightPublisher(store, full_every=4, keep_versions=2)
    truth = await publish_chain(pub, Policy(seed=4), range(0, 4))  # v0 snapshot, v1..v3 deltas
    assert await published_versions(store) == [0, 1, 2, 3]  # 2 and 3 are kept: they need 1 and 0
    fresh = WeightCache(tmp_path / "fresh", store)
    assert_exact((await fresh.ensure(2)).load_tensors(), truth[2])

    policy = Policy(seed=4)
    for _ in range(3):
        policy.step()
    truth |= await publish_chain(pub, policy, range(3, 6))  # v4 is a snapshot: v0..v3 may go
    assert await published_versions(store) == [4, 5]
    live = {wire.weights_delta_key(b.sha256) for v in (4, 5) for b in (await manifest(store, v)).delta.blobs}
    assert set(await store.list("deltas/")) == live
    assert_exact((await WeightCache(tmp_path / "late", store).ensure(5)).load_tensors(), truth[5])


async def test_a_rebuilt_folder_is_checked_again_after_a_restart(tmp_path):
    store = FileBlobStore(tmp_path / "store", create=True)
    truth = await publish_chain(WeightPublisher(store), Policy(seed=5), range(0, 2))
    cache = WeightCache(tmp_path / "cache", store)
    vv = await cache.ensure(1)
    f = next(vv.path.glob("tensors-*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01
    f.write_bytes(bytes(data))
    restarted = WeightCache(tmp_path / "cache", store)
    assert_exact((await restarted.ensure(1)).load_tensors(), truth[1])
    assert restarted.stats.reconstructed == 1


async def test_a_delta_blob_id_never_names_a_path(tmp_path):
    store = FileBlobStore(tmp_path / "store", create=True)
    await publish_chain(WeightPublisher(store), Policy(seed=6), range(0, 2))
    m1 = await manifest(store, 1)
    bad = "../../victim"
    d = msgspec.structs.replace(m1.delta, blobs=[msgspec.structs.replace(m1.delta.blobs[0], sha256=bad)],
                                tensors=[msgspec.structs.replace(t, blob=bad) for t in m1.delta.tensors])
    with pytest.raises(StoreError, match="invalid shard id"):
        Manifest.decode(msgspec.structs.replace(m1, delta=d).encode())


async def test_a_late_joiner_whose_snapshot_is_corrupt_loads_nothing(tmp_path):
    """The rebuild overlaps the snapshot's download: a shard that never verifies stops both."""
    store = FileBlobStore(tmp_path / "store", create=True)
    truth = await publish_chain(WeightPublisher(store), Policy(seed=7), range(0, 3))
    m0 = await manifest(store, 0)
    shard = tmp_path / "store" / wire.weights_shard_key(m0.shards[-1].sha256)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    late = WeightCache(tmp_path / "late", store, corrupt_retries=2)
    with pytest.raises(ShardCorrupt):
        await late.ensure(2)
    assert late.cached_versions() == [] and not list(late.tmp_dir.iterdir())
    data[-1] ^= 0xFF  # the store's copy is repaired: the same cache gets there
    shard.write_bytes(bytes(data))
    assert_exact((await late.ensure(2)).load_tensors(), truth[2])
    # v0 was only a base: checked through v2's hashes, neither kept nor left half-written
    assert late.cached_versions() == [2] and not list(late.shards_dir.iterdir()) and not list(late.tmp_dir.iterdir())


@pytest.mark.parametrize("change, why", [
    (lambda d, m: {"delta": msgspec.structs.replace(d, base=m.version)}, "not an earlier version"),
    (lambda d, m: {"delta": msgspec.structs.replace(d, tensors=d.tensors[1:])}, "every tensor exactly once"),
    (lambda d, m: {"delta": msgspec.structs.replace(d, tensors=d.tensors + d.tensors[:1])}, "every tensor exactly once"),
    (lambda d, m: {"delta": msgspec.structs.replace(d, tensors=[msgspec.structs.replace(
        t, offset=d.blobs[0].size) if t.length else t for t in d.tensors])}, "outside its blob"),
    (lambda d, m: {"delta": msgspec.structs.replace(d, tensors=[msgspec.structs.replace(t, enc="gzip")
                                                                for t in d.tensors])}, "encoding"),
    (lambda d, m: {"tensors": [msgspec.structs.replace(t, sha256="") for t in m.tensors]}, "SHA-256"),
    (lambda d, m: {"tensors": [msgspec.structs.replace(t, dtype="object") for t in m.tensors]}, "dtype"),
    (lambda d, m: {"delta": None}, "neither shards nor a delta"),
])
async def test_the_manifest_door_refuses_a_malformed_delta(tmp_path, change, why):
    store = FileBlobStore(tmp_path / "store", create=True)
    await publish_chain(WeightPublisher(store), Policy(seed=8), range(0, 2))
    m1 = await manifest(store, 1)
    with pytest.raises(StoreError, match=why):
        Manifest.decode(msgspec.structs.replace(m1, **change(m1.delta, m1)).encode())


@pytest.mark.parametrize("on_disk, setting, expect", [
    ("bfloat16", "auto", torch.bfloat16), ("float32", "auto", torch.float32), ("float32", "bf16", torch.bfloat16),
])
async def test_versions_are_published_in_the_serving_dtype(tmp_path, on_disk, setting, expect):
    """A bf16 model is published in bf16 by default, cast from the fp32 master weights."""
    import json

    from rlboost.config import TrainerSettings
    from rlboost.trainer.grpo_trainer import GRPOTrainer
    from rlboost.trainer.model import init_model_dir
    from rlboost.trainer.tasks import get_task

    model_dir = init_model_dir(tmp_path / "model", get_task("addition"), seed=0, hidden=32, layers=1, heads=2, mlp=64)
    config = json.loads((model_dir / "config.json").read_text())
    config["torch_dtype"] = on_disk
    (model_dir / "config.json").write_text(json.dumps(config))
    trainer = GRPOTrainer(str(model_dir), TrainerSettings(device="cpu", precision="fp32", publish_dtype=setting))
    assert trainer.master_dtype == torch.float32 and trainer.publish_dtype == expect
    state = trainer.state_dict()
    store = FileBlobStore(tmp_path / "store", create=True)
    await WeightPublisher(store).publish(state, 0)
    m = await manifest(store, 0)
    assert m.dtype == str(expect).removeprefix("torch.")
    master = dict(trainer.model.named_parameters())
    name = next(k for k in master if k in state)
    assert torch.equal(state[name], master[name].detach().to(expect))


async def test_concurrent_pulls_of_a_snapshot_and_the_versions_built_on_it(tmp_path):
    """A prefetch of the snapshot and requests for later versions at once: one download, all exact."""
    import asyncio

    store = FileBlobStore(tmp_path / "store", create=True)
    truth = await publish_chain(WeightPublisher(store, full_every=10), Policy(seed=9), range(0, 4))
    cache = WeightCache(tmp_path / "cache", store)
    got = await asyncio.gather(*(cache.ensure(v) for v in (3, 0, 2, 3)))
    for vv in got:
        assert_exact(vv.load_tensors(), truth[vv.version])
    ms = [await manifest(store, v) for v in range(4)]
    assert cache.stats.bytes_fetched == ms[0].total_bytes + sum(m.delta.bytes for m in ms[1:])  # each blob once


async def test_a_late_joiner_receives_a_base_snapshot_once_for_versions_pulled_together(store, tmp_path):
    """A snapshot that is only a base is received unverified into tmp/ (the rebuilt tensors'
    hashes check it): two versions after it pulled at once share one copy, and none is left."""
    import asyncio

    truth = await publish_chain(WeightPublisher(store, full_every=10), Policy(seed=11), range(0, 4))
    cache = WeightCache(tmp_path / "cache", store)
    got = await asyncio.gather(cache.ensure(3), cache.ensure(2))
    for vv in got:
        assert_exact(vv.load_tensors(), truth[vv.version])
    ms = [await manifest(store, v) for v in range(4)]
    assert cache.stats.bytes_fetched == ms[0].total_bytes + sum(m.delta.bytes for m in ms[1:])
    assert not list(cache.tmp_dir.iterdir()) and not list(cache.shards_dir.iterdir()) and not cache._copies


async def test_a_base_snapshot_damaged_in_transit_is_received_again(tmp_path):
    """The base's bytes are hashed only when a rebuilt tensor does not match: the damaged shard
    is found, refused and received again; a good base with a bad delta is the delta's fault."""
    store = FileBlobStore(tmp_path / "store", create=True)
    truth = await publish_chain(WeightPublisher(store, full_every=10), Policy(seed=12), range(0, 3))
    m0 = await manifest(store, 0)
    key = wire.weights_shard_key(m0.shards[0].sha256)
    read, damaged = store.read, []

    async def read_once_damaged(k):
        first = k == key and not damaged
        async for chunk in read(k):
            if first:
                chunk = bytearray(chunk)
                chunk[-1] ^= 0xFF  # a tensor's last byte: used by the rebuild
                damaged.append(k)
                first = False
            yield chunk

    store.read = read_once_damaged
    cache = WeightCache(tmp_path / "cache", store)
    assert_exact((await cache.ensure(2)).load_tensors(), truth[2])
    assert damaged == [key] and cache.stats.shards_refused == 1 and cache.stats.paths_refused == 0
    assert not list(cache.tmp_dir.iterdir())


async def test_either_delta_format_rebuilds_bit_exactly_and_sparse3_is_smaller(tmp_path):
    from rlboost.config import WeightsSettings

    sizes = {}
    for fmt in ("sparse3", "sparse2"):
        store = FileBlobStore(tmp_path / f"store-{fmt}", create=True)
        pub = WeightPublisher(store, **WeightsSettings(delta_format=fmt).publisher_options())
        truth = await publish_chain(pub, Policy(seed=5, lr=1e-6), range(0, 4))
        late = WeightCache(tmp_path / f"late-{fmt}", store)  # the snapshot + 3 deltas replayed
        assert_exact((await late.ensure(3)).load_tensors(), truth[3])
        sizes[fmt] = sum([(await manifest(store, v)).delta.bytes for v in (1, 2, 3)])
    assert sizes["sparse3"] < sizes["sparse2"]
    with pytest.raises(ValueError, match="weights.delta_format: 'band'"):
        WeightsSettings(delta_format="band")


# ---------------------------------------------------------------- snapshot deltas (a late joiner replays one)
# opt-in (`snapshot_deltas=True`; off by default, what the tests above hold): every publisher here turns them on


async def test_a_late_joiner_replays_one_delta_from_the_snapshot_and_a_follower_its_own(store, tmp_path):
    """Opted in, from the second version after a snapshot on, the publisher also stores the version's
    change from that snapshot in one delta, beside the manifest (which is byte for byte what it was):
    a late joiner takes the snapshot + that one delta; a follower still pulls only each small delta.
    By default (off) none is stored."""
    import json

    from rlboost.config import WeightsSettings

    pub = WeightPublisher(store, full_every=10, keep_versions=10, snapshot_deltas=True)
    policy = Policy(seed=13, lr=1e-6)
    truth, reports = {}, {}
    for v in range(4):
        if v:
            policy.step()
        truth[v] = policy.published()
        reports[v] = await pub.publish(truth[v], v)
    ms = {v: await manifest(store, v) for v in truth}
    jumps = {v: await read_snapshot_delta(store, m) for v, m in ms.items()}
    assert [v for v, sd in jumps.items() if sd] == [2, 3]
    assert all(jumps[v].delta.base == 0 and jumps[v].delta.base_digest == ms[0].digest() for v in (2, 3))
    assert [r.snapshot_delta_bytes for r in reports.values()] == [0, 0, jumps[2].delta.bytes, jumps[3].delta.bytes]
    assert jumps[3].delta.bytes < sum(ms[v].delta.bytes for v in (1, 2, 3))  # published only when it is fewer bytes
    for v in (2, 3):  # the manifest has exactly the fields it had: a reader before reads it as it was
        data = await store.read_all(wire.weights_manifest_key(v))
        assert set(json.loads(data)) == {"v", "version", "created", "total_bytes", "shards", "tensors", "dtype",
                                         "delta", "meta"}
        assert Manifest.decode(data).encode() == data

    late = WeightCache(tmp_path / "late", store)
    assert_exact((await late.ensure(3)).load_tensors(), truth[3])
    assert late.stats.bytes_fetched == ms[0].total_bytes + jumps[3].delta.bytes and late.stats.reconstructed == 1
    assert not list(late.tmp_dir.iterdir()) and not list(late.shards_dir.iterdir())

    read_all, reads = store.read_all, []

    async def recording(key):
        reads.append(key)
        return await read_all(key)

    store.read_all = recording
    follower = WeightCache(tmp_path / "follower", store, keep_versions=10)  # v0 stays cached as well
    for v in truth:
        before = follower.stats.bytes_fetched
        assert_exact((await follower.ensure(v)).load_tensors(), truth[v])
        if v:
            assert follower.stats.bytes_fetched - before == ms[v].delta.bytes
    assert reads and not [k for k in reads if k.startswith("snapdeltas/")]  # a follower never even reads one
    store.read_all = read_all

    # the default, off (`[weights] snapshot_deltas = false`, and the publisher's): no snapshot copy kept, none stored
    off = FileBlobStore(tmp_path / "off", create=True)
    assert WeightsSettings().snapshot_deltas is False and WeightPublisher(off).snapshot_deltas is False
    pub = WeightPublisher(off, **WeightsSettings(full_every=10).publisher_options())
    for v in truth:
        assert (await pub.publish(truth[v], v)).snapshot_delta_bytes == 0
    assert await off.list("snapdeltas/") == [] and pub._snap is None


async def test_a_rotted_snapshot_delta_costs_a_retry_and_the_chain_serves(tmp_path):
    """The snapshot delta's blob rotted in the store: refused by its hash (a retry), then the
    rebuilt tensors' path through it is given up and the deltas since the snapshot serve, exact."""
    store = FileBlobStore(tmp_path / "store", create=True)
    pub = WeightPublisher(store, full_every=10, snapshot_deltas=True)
    truth = await publish_chain(pub, Policy(seed=14), range(0, 4))
    sd = await read_snapshot_delta(store, await manifest(store, 3))
    blob = tmp_path / "store" / wire.weights_delta_key(sd.delta.blobs[0].sha256)
    data = bytearray(blob.read_bytes())
    data[len(data) // 3] ^= 0x10
    blob.write_bytes(bytes(data))
    late = WeightCache(tmp_path / "late", store, corrupt_retries=2)
    assert_exact((await late.ensure(3)).load_tensors(), truth[3])
    assert late.stats.paths_refused == 1 and late.stats.shards_refused == 2
    assert late.cached_versions() == [3] and not list(late.tmp_dir.iterdir())


async def test_a_snapshot_delta_that_lies_is_refused_and_the_chain_serves(tmp_path):
    """A snapshot delta whose blob is sound but whose change is not the version's (here: another
    version's) fails the rebuilt tensors' SHA-256: nothing is installed from it, the chain serves."""
    store = FileBlobStore(tmp_path / "store", create=True)
    pub = WeightPublisher(store, full_every=10, snapshot_deltas=True)
    truth = await publish_chain(pub, Policy(seed=15), range(0, 4))
    m2, m3 = await manifest(store, 2), await manifest(store, 3)
    sd2 = await read_snapshot_delta(store, m2)
    lie = SnapshotDelta(version=3, manifest_digest=m3.digest(), delta=sd2.delta)  # v2's change, said to be v3's
    await store.put(wire.weights_snapshot_delta_key(3), lie.encode())
    late = WeightCache(tmp_path / "late", store)
    assert_exact((await late.ensure(3)).load_tensors(), truth[3])
    assert late.stats.paths_refused == 1 and late.cached_versions() == [3] and not list(late.tmp_dir.iterdir())


@pytest.mark.parametrize("change, why", [
    (lambda sd, m: {"version": 2}, "not this manifest"),
    (lambda sd, m: {"manifest_digest": "0" * 64}, "not this manifest"),
    (lambda sd, m: {"delta": msgspec.structs.replace(sd.delta, base=3)}, "not an earlier version"),
    (lambda sd, m: {"delta": msgspec.structs.replace(sd.delta, tensors=sd.delta.tensors[1:])}, "exactly once"),
    (lambda sd, m: {"delta": msgspec.structs.replace(sd.delta, blobs=[msgspec.structs.replace(
        sd.delta.blobs[0], sha256="../../victim")])}, "invalid shard id"),
    (lambda sd, m: {"delta": msgspec.structs.replace(sd.delta, tensors=[msgspec.structs.replace(t, enc="sparse9")
                                                                        for t in sd.delta.tensors])}, "unknown"),
])
async def test_the_door_refuses_a_malformed_snapshot_delta_and_a_pull_goes_on_without_it(tmp_path, change, why):
    store = FileBlobStore(tmp_path / "store", create=True)
    pub = WeightPublisher(store, full_every=10, snapshot_deltas=True)
    truth = await publish_chain(pub, Policy(seed=16), range(0, 4))
    m3 = await manifest(store, 3)
    sd = await read_snapshot_delta(store, m3)
    bad = msgspec.structs.replace(sd, **change(sd, m3)).encode()
    with pytest.raises(StoreError, match=why):
        SnapshotDelta.decode(bad, m3)
    await store.put(wire.weights_snapshot_delta_key(3), bad)
    assert await read_snapshot_delta(store, m3) is None  # reported once, never a reason to fail
    late = WeightCache(tmp_path / "late", store)
    assert_exact((await late.ensure(3)).load_tensors(), truth[3])
    assert late.stats.paths_refused == 0 and late.stats.reconstructed == 1


async def test_gc_drops_a_snapshot_delta_with_its_version_and_keeps_a_kept_ones_blobs(store, tmp_path):
    pub = WeightPublisher(store, full_every=3, keep_versions=2, snapshot_deltas=True)
    truth = await publish_chain(pub, Policy(seed=17), range(0, 6))  # v0 S, v1, v2, v3 S, v4, v5
    assert await published_versions(store) == [3, 4, 5]
    assert await store.list("snapdeltas/") == [wire.weights_snapshot_delta_key(5)]  # v2's went with v2
    sd = await read_snapshot_delta(store, await manifest(store, 5))
    assert all([await store.has(wire.weights_delta_key(b.sha256)) for b in sd.delta.blobs])
    late = WeightCache(tmp_path / "late", store)
    assert_exact((await late.ensure(5)).load_tensors(), truth[5])
    assert late.stats.bytes_fetched == (await manifest(store, 3)).total_bytes + sd.delta.bytes


async def test_a_snapshot_delta_starts_from_the_last_snapshot_and_a_late_joiner_fetches_it(store, tmp_path):
    """With snapshot deltas, v6 also has its change from the v4 snapshot in one delta (v5 needs
    none: its delta is that), and a late joiner takes the v4 snapshot + that one delta."""
    truth = await publish_chain(WeightPublisher(store, full_every=4, keep_versions=10, snapshot_deltas=True),
                                Policy(), range(0, 7))
    kinds = {v: await manifest(store, v) for v in truth}
    jumps = {v: await read_snapshot_delta(store, m) for v, m in kinds.items()}
    assert [v for v, sd in jumps.items() if sd] == [2, 3, 6]
    assert jumps[6].delta.base == 4 and jumps[6].delta.base_digest == kinds[4].digest()
    late = WeightCache(tmp_path / "late", store)  # nothing cached: the nearest snapshot + its one delta
    assert_exact((await late.ensure(6)).load_tensors(), truth[6])
    assert late.stats.bytes_fetched == kinds[4].total_bytes + jumps[6].delta.bytes


async def test_with_snapshot_deltas_a_late_joiner_whose_deltas_rotted_loads_nothing(tmp_path):
    """The only paths are the v0 snapshot + two deltas and the v0 snapshot + v2's snapshot delta,
    v2's delta and its snapshot delta rotted in the store: the pull fails clearly, with no
    replay and nothing left in tmp/ or shards/; repaired, it succeeds."""
    store = FileBlobStore(tmp_path / "store", create=True)
    truth = await publish_chain(WeightPublisher(store, full_every=3, snapshot_deltas=True), Policy(seed=2),
                                range(0, 3))
    m2 = await manifest(store, 2)
    blobs = [tmp_path / "store" / wire.weights_delta_key(d.blobs[0].sha256)
             for d in (m2.delta, (await read_snapshot_delta(store, m2)).delta)]
    good = [blob.read_bytes() for blob in blobs]
    for blob, data in zip(blobs, good):
        data = bytearray(data)
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
    late = WeightCache(tmp_path / "late", store, corrupt_retries=2)
    with pytest.raises(ShardCorrupt, match="failed verification"):
        await late.ensure(2)
    assert late.cached_versions() == [] and late.stats.reconstructed == 0 and late.stats.paths_refused == 2
    assert not list(late.tmp_dir.iterdir()) and not list(late.shards_dir.iterdir())
    for blob, data in zip(blobs, good):  # the store repaired: the same cache pulls it
        blob.write_bytes(data)
    assert_exact((await late.ensure(2)).load_tensors(), truth[2])


async def once_each(store: BlobStore, ms: list[Manifest]) -> tuple[int, int]:
    """The delta bytes of pulling v2 and v3 of a v0 snapshot at once, each blob once: v2's and
    v3's snapshot deltas, or v2's and v3's own delta (v3's pull found v2 already in: a follower)."""
    j2, j3 = [(await read_snapshot_delta(store, m)).delta.bytes for m in ms[2:4]]
    return j2 + j3, j2 + ms[3].delta.bytes


async def test_with_snapshot_deltas_concurrent_pulls_of_a_snapshot_and_later_versions_fetch_each_once(tmp_path):
    """A prefetch of the snapshot and requests for later versions at once: one download, all exact."""
    import asyncio

    store = FileBlobStore(tmp_path / "store", create=True)
    truth = await publish_chain(WeightPublisher(store, full_every=10, snapshot_deltas=True), Policy(seed=9),
                                range(0, 4))
    cache = WeightCache(tmp_path / "cache", store)
    got = await asyncio.gather(*(cache.ensure(v) for v in (3, 0, 2, 3)))
    for vv in got:
        assert_exact(vv.load_tensors(), truth[vv.version])
    ms = [await manifest(store, v) for v in range(4)]
    assert cache.stats.bytes_fetched - cache.stats.delta_bytes_fetched == ms[0].total_bytes  # the shards once
    assert cache.stats.delta_bytes_fetched in await once_each(store, ms)


async def test_with_snapshot_deltas_a_base_snapshot_is_received_once_for_versions_pulled_together(store, tmp_path):
    """A snapshot that is only a base is received unverified into tmp/ (the rebuilt tensors'
    hashes check it): two versions after it pulled at once share one copy, and none is left.
    Each replays its own snapshot delta, so the two pulls share no delta blob that would keep
    them in step: the shards' reads wait until both pulls hold the copy (a pull that is over
    before the other one starts receives nothing to share)."""
    import asyncio
    import time

    pub = WeightPublisher(store, full_every=10, snapshot_deltas=True)
    truth = await publish_chain(pub, Policy(seed=11), range(0, 4))
    cache = WeightCache(tmp_path / "cache", store)
    read = store.read

    async def once_both_hold_it(key):
        deadline = time.monotonic() + 30
        while key.startswith("shards/") and time.monotonic() < deadline \
                and not any(users >= 2 for _, users in cache._copies.values()):
            await asyncio.sleep(0.01)
        async for chunk in read(key):
            yield chunk

    store.read = once_both_hold_it
    got = await asyncio.gather(cache.ensure(3), cache.ensure(2))
    store.read = read
    for vv in got:
        assert_exact(vv.load_tensors(), truth[vv.version])
    ms = [await manifest(store, v) for v in range(4)]
    assert cache.stats.bytes_fetched - cache.stats.delta_bytes_fetched == ms[0].total_bytes  # the shards once
    assert cache.stats.delta_bytes_fetched in await once_each(store, ms)
    assert not list(cache.tmp_dir.iterdir()) and not list(cache.shards_dir.iterdir()) and not cache._copies
