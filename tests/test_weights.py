"""Weight store: publish / pull / verify / GC, on a real JetStream Object Store, a real directory and a
real S3 API server (moto's, on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

from helpers import PassThroughStore
from rlboost import wire
from rlboost.weights import BlobStore, FileBlobStore, JetStreamBlobStore, S3BlobStore
from rlboost.weights import WeightCache, load_tensors, read_safetensors
from rlboost.weights.safetensors_io import whole_tensor_dir
from rlboost.weights.source import StoreWeights
from rlboost.weights import (
    Manifest,
    ObjectMissing,
    ShardCorrupt,
    StoreUnavailable,
    VersionPointer,
    VersionGone,
    VersionUnavailable,
    WeightPublisher,
    gc_store,
    plan_shards,
    published_versions,
)

KB = 1024
SHARD = 16 * KB  # target shard bytes for the tests: each 16 KiB tensor is its own shard


def model(seed: int, layers: int = 10) -> dict[str, torch.Tensor]:
    """A toy transformer-shaped state dict: 16 KiB matrices, tiny norms, an int buffer."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.randn(64, 64, generator=g)}
    for i in range(layers):
        sd[f"layers.{i}.attn.weight"] = torch.randn(64, 64, generator=g)
        sd[f"layers.{i}.norm.weight"] = torch.randn(64, generator=g)
        sd[f"layers.{i}.mlp.weight"] = torch.randn(64, 64, generator=g).to(torch.bfloat16).float()
    sd["positions"] = torch.arange(32, dtype=torch.int64)
    return sd


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest_asyncio.fixture
async def jstore(js) -> AsyncIterator[JetStreamBlobStore]:
    bucket = f"rbw-{uuid.uuid4().hex[:10]}"
    store = await JetStreamBlobStore.open(js, bucket)
    yield store
    with contextlib.suppress(Exception):
        await js.delete_object_store(bucket)


@pytest_asyncio.fixture
async def pointer(js) -> VersionPointer:
    return await VersionPointer.open(js, key=f"weights-test-{uuid.uuid4().hex[:10]}")


@pytest.fixture(params=["jetstream", "file", "s3"])
def backend(request) -> str:
    return request.param


@pytest_asyncio.fixture
async def store(backend, js, tmp_path, request) -> AsyncIterator[BlobStore]:
    """Each backend behind the same contract: every test taking `store` runs on all three."""
    if backend == "file":
        yield FileBlobStore(tmp_path / "store", create=True)
        return
    if backend == "s3":
        srv = request.getfixturevalue("s3_server")
        bucket = srv.new_bucket()
        yield S3BlobStore(f"s3://{bucket}/weights", endpoint=srv.url)
        srv.drop_bucket(bucket)
        return
    bucket = f"rbw-{uuid.uuid4().hex[:10]}"
    yield await JetStreamBlobStore.open(js, bucket)
    with contextlib.suppress(Exception):
        await js.delete_object_store(bucket)


def publisher(store: BlobStore, pointer: VersionPointer | None = None, **kw) -> WeightPublisher:
    kw.setdefault("target_shard_bytes", SHARD)
    return WeightPublisher(store, pointer, **kw)


class FaultyStore(PassThroughStore, BlobStore):
    """A real store whose first `times` reads of shards are damaged in transit."""

    def __init__(self, inner: BlobStore, fault: str, times: int = 1) -> None:
        super().__init__(inner)
        self.fault, self.left = fault, times

    async def read(self, key):
        damage = key.startswith("shards/") and self.left > 0
        if damage:
            self.left -= 1
        first = True
        async for chunk in self.inner.read(key):
            if damage and first:
                chunk = bytearray(chunk)
                if self.fault == "flip":
                    chunk[len(chunk) // 2] ^= 0xFF
                elif self.fault == "truncate":
                    chunk = chunk[: len(chunk) // 2]
                elif self.fault == "extend":
                    chunk = chunk + b"\0" * 100
            first = False
            yield chunk


# ---------------------------------------------------------------- the BlobStore contract


async def test_blob_store_contract(store):
    """What every backend promises the publisher and the cache (put, has, streamed read,
    delete, list), on the real JetStream Object Store, a directory and an S3 API server."""
    assert await store.list() == []
    assert not await store.has("shards/a.bin")
    with pytest.raises(ObjectMissing):
        await store.read_all("shards/a.bin")
    big = os.urandom(9 * (1 << 20) + 123)  # several chunks on every backend
    await store.put("shards/a.bin", big)
    await store.put("shards/ab.bin", memoryview(bytearray(b"x" * 10)))  # any buffer
    await store.put("manifests/v1.json", b"{}")
    await store.put("empty", b"")
    assert await store.has("shards/a.bin") and await store.has("empty")
    chunks = [bytes(c) async for c in store.read("shards/a.bin")]
    assert b"".join(chunks) == big
    assert await store.read_all("shards/ab.bin") == b"x" * 10
    assert await store.read_all("empty") == b""
    assert await store.list("shards/") == ["shards/a.bin", "shards/ab.bin"]
    assert await store.list("shards/a") == ["shards/a.bin", "shards/ab.bin"]  # a string prefix, not a folder
    assert await store.list("shards/ab") == ["shards/ab.bin"]
    assert await store.list("manifests/v") == ["manifests/v1.json"]
    assert await store.list() == ["empty", "manifests/v1.json", "shards/a.bin", "shards/ab.bin"]
    await store.put("shards/a.bin", b"replaced")  # a put replaces the whole blob
    assert await store.read_all("shards/a.bin") == b"replaced"
    await store.delete("shards/a.bin")
    await store.delete("shards/a.bin")  # a missing blob is not an error
    assert not await store.has("shards/a.bin")
    with pytest.raises(ObjectMissing):
        await store.read_all("shards/a.bin")
    assert await store.list("shards/") == ["shards/ab.bin"]


# ---------------------------------------------------------------- planning


def test_plan_shards_isolates_large_tensors_and_packs_small_ones():
    sizes = [("a", 100), ("big1", 1000), ("b", 10), ("c", 10), ("big2", 1000), ("d", 10)]
    assert plan_shards(sizes, max_shard_bytes=5000, target_shard_bytes=500) == [
        ["a"], ["big1"], ["b", "c"], ["big2"], ["d"]]
    small = [(f"t{i}", 100) for i in range(10)]
    groups = plan_shards(small, max_shard_bytes=250, target_shard_bytes=1000)
    assert all(sum(100 for _ in g) <= 250 for g in groups) and sum(len(g) for g in groups) == 10


async def test_oversized_tensor_is_split_into_bounded_shards(store, tmp_path):
    sd = {"embed": torch.randn(100, 64), "small": torch.randn(8)}  # embed: 25.6 KB
    rep = await publisher(store, max_shard_bytes=8 * KB, target_shard_bytes=8 * KB).publish(sd, 1)
    m = Manifest.decode(await store.read_all(wire.weights_manifest_key(1)))
    assert len(m.tensors[0].parts) == 4 and rep.shards >= 4
    assert all(s.size <= 8 * KB + 512 for s in m.shards)  # bounded (+ the safetensors header)
    cache = WeightCache(tmp_path / "cache", store)
    vv = await cache.ensure(1)
    assert_same(vv.load_tensors(), sd)
    with whole_tensor_dir(vv.path) as whole:  # what an engine reading the files itself (vLLM) gets
        assert whole != vv.path
        files = {k: v for f in whole.glob("*.safetensors") for k, v in read_safetensors(f).items()}
        assert_same({k: files[k] for k in sd}, sd)
    assert not whole.exists()


# ---------------------------------------------------------------- acceptance


async def test_late_joining_worker_reaches_current_version(jstore, pointer, tmp_path):
    pub = publisher(jstore, pointer)
    for v in (1, 2, 3):
        await pub.publish(model(v), v)
    assert await pointer.get() == 3
    cache = WeightCache(tmp_path / "late", jstore)  # a fresh worker: empty cache
    vv = await cache.ensure(await pointer.get())
    assert vv.version == 3 and vv.manifest.version == 3
    assert_same(vv.load_tensors(), model(3))
    assert cache.stats.bytes_fetched == vv.manifest.total_bytes


async def test_new_version_moves_only_changed_shards(store, tmp_path):
    pub = publisher(store, deltas=False)  # snapshots only: content addressing alone
    v1 = model(1)
    rep1 = await pub.publish(v1, 1)
    cache = WeightCache(tmp_path / "cache", store)
    await cache.ensure(1)
    fetched_v1 = cache.stats.bytes_fetched
    assert fetched_v1 == rep1.total_bytes == rep1.bytes_uploaded

    v2 = dict(v1)
    changed = ["layers.3.attn.weight", "layers.7.mlp.weight"]
    for k in changed:
        v2[k] = v1[k] + 1.0
    rep2 = await pub.publish(v2, 2)
    m1 = Manifest.decode(await store.read_all(wire.weights_manifest_key(1)))
    m2 = Manifest.decode(await store.read_all(wire.weights_manifest_key(2)))
    new_shards = {s.sha256 for s in m2.shards} - {s.sha256 for s in m1.shards}
    assert len(new_shards) == len(changed)
    expected = sum(s.size for s in m2.shards if s.sha256 in new_shards)
    assert rep2.shards_uploaded == len(changed) and rep2.bytes_uploaded == expected

    vv = await cache.ensure(2)
    assert cache.stats.bytes_fetched - fetched_v1 == expected  # bytes actually moved to the worker
    assert expected < rep2.total_bytes / 5
    assert_same(vv.load_tensors(), v2)

    rep3 = await pub.publish(v2, 3)  # identical weights: nothing moves
    assert rep3.bytes_uploaded == 0
    before = cache.stats.bytes_fetched
    await cache.ensure(3)
    assert cache.stats.bytes_fetched == before


@pytest.mark.parametrize("fault", ["flip", "truncate", "extend"])
async def test_damaged_shard_in_transit_is_refused_and_fetched_again(jstore, tmp_path, fault):
    await publisher(jstore).publish(model(1), 1)
    cache = WeightCache(tmp_path / "cache", FaultyStore(jstore, fault, times=1))
    vv = await cache.ensure(1)
    assert cache.stats.shards_refused == 1
    assert_same(vv.load_tensors(), model(1))


async def test_persistently_corrupt_shard_is_never_loaded(jstore, tmp_path):
    await publisher(jstore).publish(model(1), 1)
    faulty = FaultyStore(jstore, "flip", times=10**6)
    cache = WeightCache(tmp_path / "cache", faulty, corrupt_retries=3)
    with pytest.raises(ShardCorrupt):
        await cache.ensure(1)
    assert cache.stats.shards_refused >= 3
    reads_left = faulty.left
    await asyncio.sleep(0.3)
    assert faulty.left == reads_left  # the failed ensure() left no other shard's fetch running
    assert cache.cached_versions() == []  # no version dir was built from bad bytes
    # The store is healthy again (e.g. the bad replica was replaced): the next ensure recovers.
    cache.store = jstore
    assert_same((await cache.ensure(1)).load_tensors(), model(1))


async def test_corrupt_or_truncated_cached_shard_is_refused_and_recovered(store, tmp_path):
    await publisher(store).publish(model(1), 1)
    cache = WeightCache(tmp_path / "cache", store)
    m = (await cache.ensure(1)).manifest
    full = cache.stats.bytes_fetched
    bad, short = (cache.root / "shards" / f"{m.shards[i].sha256}.safetensors" for i in (0, 1))
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF  # same size, wrong bytes (bit rot); written in place (same inode)
    with open(bad, "r+b") as f:
        f.write(data)
    os.truncate(short, short.stat().st_size // 2)

    restarted = WeightCache(tmp_path / "cache", store)  # a worker restarting on its old cache
    vv = await restarted.ensure(1)
    assert restarted.stats.shards_refused == 2 and restarted.stats.shards_fetched == 2
    assert restarted.stats.bytes_fetched == m.shards[0].size + m.shards[1].size < full
    assert_same(vv.load_tensors(), model(1))


async def test_gc_keeps_exactly_n_versions(store, tmp_path):
    pub = publisher(store, keep_versions=2)
    for v in range(1, 6):
        rep = await pub.publish(model(v), v)
    assert rep.gc_deleted_versions == [3]
    assert await published_versions(store) == [4, 5]
    live = set()
    for v in (4, 5):
        m = Manifest.decode(await store.read_all(wire.weights_manifest_key(v)))
        live |= {wire.weights_shard_key(s.sha256) for s in m.shards}
    assert set(await store.list("shards/")) == live  # no orphan shard left, none missing
    assert await gc_store(store, keep=1) == [4]
    assert await published_versions(store) == [5]
    cache = WeightCache(tmp_path / "cache", store)
    with pytest.raises(VersionUnavailable):
        await cache.ensure(2)
    assert_same((await cache.ensure(5)).load_tensors(), model(5))


async def test_missing_version_is_never_served_with_another(jstore, tmp_path):
    pub = publisher(jstore)
    await pub.publish(model(1), 1)
    cache = WeightCache(tmp_path / "cache", jstore)
    v1 = await cache.ensure(1)
    with pytest.raises(VersionUnavailable, match="version 2"):
        await cache.ensure(2)
    assert cache.cached_versions() == [1]
    with pytest.raises(VersionUnavailable):
        load_tensors(v1.path, expect_version=2)

    async def publish_later() -> None:
        await asyncio.sleep(0.3)
        await pub.publish(model(2), 2)

    task = asyncio.create_task(publish_later())
    vv = await cache.ensure(2, wait_s=10.0)  # a request for a version being published: waits for it
    await task
    assert vv.version == 2 and vv.path != v1.path
    assert_same(vv.load_tensors(), model(2))


async def test_unreachable_store_gives_clear_error_then_recovers(tmp_path):
    staged = FileBlobStore(tmp_path / "staged", create=True)
    await publisher(staged).publish(model(1), 1)
    mount = tmp_path / "mnt"  # not there yet: an unmounted shared volume
    cache = WeightCache(tmp_path / "cache", FileBlobStore(mount), retry_deadline_s=0.5)
    with pytest.raises(StoreUnavailable, match=r"not reachable.*gave up.*attempts"):
        await cache.ensure(1)

    cache.retry_deadline_s = 20.0

    async def mount_later() -> None:
        await asyncio.sleep(0.5)
        os.replace(tmp_path / "staged", mount)

    task = asyncio.create_task(mount_later())
    vv = await cache.ensure(1)  # retried with back-off until the volume appeared
    await task
    assert_same(vv.load_tensors(), model(1))


async def test_closed_nats_connection_is_store_unavailable(nats_url, js, tmp_path):
    from rlboost import bus

    conn = await bus.connect(nats_url)
    bucket = f"rbw-{uuid.uuid4().hex[:10]}"
    store = await JetStreamBlobStore.open(conn.jetstream(), bucket)
    await publisher(store).publish(model(1), 1)
    await conn.close()
    cache = WeightCache(tmp_path / "cache", store, retry_deadline_s=0.3)
    with pytest.raises(StoreUnavailable, match="gave up"):
        await cache.ensure(1)
    await js.delete_object_store(bucket)


async def test_a_worker_prefetches_what_the_version_pointer_announces(jstore, pointer, tmp_path):
    pub = publisher(jstore, pointer)
    await pub.publish(model(1), 1)
    source = StoreWeights(WeightCache(tmp_path / "cache", jstore))
    stop = asyncio.Event()
    follower = asyncio.create_task(source.follow(pointer, stop))
    for _ in range(100):
        if source.cache.cached_versions() == [1]:
            break
        await asyncio.sleep(0.05)
    await pub.publish(model(2), 2)
    for _ in range(100):
        if source.cache.cached_versions() == [1, 2]:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(follower, 5)
    assert source.cache.cached_versions() == [1, 2]
    path = await source.path(2)  # already there: nothing moves
    assert_same(load_tensors(path, expect_version=2), model(2))
    assert source.weights_id(path, 2) == Manifest.decode(await jstore.read_all(wire.weights_manifest_key(2))).digest()


async def test_republish_rules(jstore, pointer):
    pub = publisher(jstore, pointer)
    await pub.publish(model(1), 1)
    again = await pub.publish(model(1), 1)  # a trainer retrying the same publish: harmless
    assert again.bytes_uploaded == 0
    with pytest.raises(ValueError, match="already published"):
        await pub.publish(model(9), 1)
    await pub.publish(model(2), 2)
    with pytest.raises(ValueError, match="refusing"):
        await pointer.set(1)


async def test_objects_readable_by_stock_nats_client(js, jstore):
    """Our fast writer keeps the standard object layout: other NATS tools read our shards."""
    data = os.urandom(3 * (1 << 20) + 123)
    await jstore.put("shards/x.bin", data)
    obj = await (await js.object_store(jstore.bucket)).get("shards/x.bin")
    assert obj.data == data
    assert await jstore.read_all("shards/x.bin") == data
    assert await jstore.list("shards/") == ["shards/x.bin"]
    await jstore.delete("shards/x.bin")
    assert not await jstore.has("shards/x.bin") and await jstore.list() == []


async def test_a_version_older_than_the_newest_published_is_gone_not_waited_for(store, tmp_path):
    """Versions are published in order: a missing one below the newest was garbage-collected
    (or its publish died) and no wait brings it; a missing one above may still be uploading."""
    await publisher(store).publish(model(2), 2)
    cache = WeightCache(tmp_path / "cache", store)
    with pytest.raises(VersionGone, match="version 2 is"):
        await cache.ensure(1, wait_s=60.0)  # before: 60 s of polling, then VersionUnavailable
    with pytest.raises(VersionUnavailable) as not_yet:
        await cache.ensure(3, wait_s=0.3)
    assert not isinstance(not_yet.value, VersionGone)
