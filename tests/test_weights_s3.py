"""The S3 weight store against a real S3 API server (moto's, on loopback): multipart puts,
prefixes, a server killed mid-pull, a connection cut mid-body, a tampered object, an
unreachable endpoint, and the `[weights] store` setting that selects it. The backend contract
itself (the tests taking `store`) runs on S3 in tests/test_weights.py."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
import torch

from helpers import PassThroughStore
from rlboost import wire
from rlboost.config import ConfigError, load_settings
from rlboost.services import free_port
from rlboost.weights import (
    BlobStore,
    Manifest,
    S3BlobStore,
    ShardCorrupt,
    StoreUnavailable,
    WeightCache,
    WeightPublisher,
    load_tensors,
    open_store,
)
from rlboost.weights.errors import ObjectMissing, StoreError

MiB = 1 << 20


def model(seed: int, tensors: int = 4, numel: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def no_partial_files(cache: WeightCache) -> None:
    """Nothing half-received anywhere, and every cached shard is exactly what its name says."""
    assert not list(cache.root.rglob("*.part")), list(cache.root.rglob("*.part"))
    assert not list(cache.tmp_dir.iterdir())
    for f in cache.shards_dir.iterdir():
        assert hashlib.sha256(f.read_bytes()).hexdigest() == f.name.split(".")[0], f


@pytest.fixture
def bucket(s3_server):
    name = s3_server.new_bucket()
    yield name
    s3_server.drop_bucket(name)


# ---------------------------------------------------------------- S3 specifics


async def test_large_blobs_go_multipart_and_small_ones_in_one_put(s3_server, bucket):
    store = S3BlobStore(f"s3://{bucket}/w", endpoint=s3_server.url, multipart_threshold=5 * MiB, part_size=5 * MiB)
    big, small = os.urandom(11 * MiB + 7), os.urandom(1 * MiB)
    await store.put("shards/big", big)
    await store.put("shards/small", small)
    client = s3_server.client()
    # an S3 multipart object's ETag is "<md5 of part md5s>-<parts>": 5 + 5 + 1 MiB
    assert client.head_object(Bucket=bucket, Key="w/shards/big")["ETag"].strip('"').endswith("-3")
    assert "-" not in client.head_object(Bucket=bucket, Key="w/shards/small")["ETag"]
    assert await store.read_all("shards/big") == big and await store.read_all("shards/small") == small


async def test_prefixes_keep_stores_apart_in_one_bucket(s3_server, bucket):
    a = S3BlobStore(f"s3://{bucket}/runs/a", endpoint=s3_server.url)
    b = S3BlobStore(f"s3://{bucket}/runs/a2/", endpoint=s3_server.url)
    await a.put("shards/x", b"A")
    await b.put("shards/x", b"B")
    assert await a.list() == ["shards/x"] and await b.list() == ["shards/x"]
    assert await a.read_all("shards/x") == b"A" and await b.read_all("shards/x") == b"B"
    keys = sorted(o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"])
    assert keys == ["runs/a/shards/x", "runs/a2/shards/x"]
    with pytest.raises(ValueError):
        await a.put("../a2/shards/x", b"escape")
    with pytest.raises(ValueError):
        await a.read_all("/shards/x")


def test_bad_urls_are_refused():
    for url in ("s3://", "s3://ab/x", "s3://Bad_Bucket/x", "s3://key:secret@bucket/x", "s3://bucket/a/../b",
                "s3://bucket/x?endpoint=http://evil", "gs://bucket/x"):
        with pytest.raises(ValueError):
            S3BlobStore(url)


async def test_unreachable_endpoint_and_missing_bucket_are_store_unavailable(s3_server, tmp_path):
    dead = S3BlobStore("s3://rbw-nowhere/w", endpoint=f"http://127.0.0.1:{free_port()}", max_retries=1,
                       retry_timeout_s=1.0)
    for op in (dead.has("k"), dead.read_all("k"), dead.put("k", b"x"), dead.list(), dead.delete("k")):
        with pytest.raises(StoreUnavailable, match="rbw-nowhere"):
            await op
    missing = S3BlobStore("s3://rbw-no-such-bucket/w", endpoint=s3_server.url)
    for op in (missing.read_all("k"), missing.put("k", b"x"), missing.list()):
        with pytest.raises(StoreUnavailable, match="does not exist"):
            await op
    cache = WeightCache(tmp_path / "cache", dead, retry_deadline_s=0.5)
    with pytest.raises(StoreUnavailable, match="gave up"):
        await cache.ensure(1)


@pytest.mark.slow
async def test_refused_credentials_fail_fast_and_say_so(s3_env, tmp_path):
    """A server that checks credentials and does not know ours (403): a StoreError naming the
    credential variables, at once — not StoreUnavailable retried until the pull deadline."""
    from s3server import MotoS3

    srv = MotoS3(tmp_path / "moto.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"}).start()
    try:
        store = S3BlobStore("s3://rbw-locked/w", endpoint=srv.url)
        for op in (store.has("k"), store.read_all("k"), store.put("k", b"x"), store.list()):
            with pytest.raises(StoreError, match="AWS_ACCESS_KEY_ID") as e:
                await op
            assert not isinstance(e.value, StoreUnavailable)
        cache = WeightCache(tmp_path / "cache", store, retry_deadline_s=60.0)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(StoreError, match="access refused"):
            await cache.ensure(1)
        assert asyncio.get_running_loop().time() - t0 < 10.0  # not retried until the deadline
    finally:
        srv.kill()


class KillOnFirstShardChunk(PassThroughStore, BlobStore):
    """The real S3 store; the moment the first shard's first bytes arrive, the server is killed."""

    def __init__(self, inner: S3BlobStore, server) -> None:
        super().__init__(inner)
        self.server, self.killed = server, False

    async def read(self, key):
        async for chunk in self.inner.read(key):
            if key.startswith("shards/") and not self.killed:
                self.killed = True
                self.server.kill()
            yield chunk


@pytest.mark.slow
async def test_server_killed_mid_pull_fails_clearly_then_resumes(s3_env, tmp_path):
    """The S3 server dies (SIGKILL) while a worker pulls: the pull ends in StoreUnavailable after
    its retry deadline, leaves no partial file (only whole, verified shards), and once a server
    is back with the version the same cache finishes it, re-fetching none of those shards."""
    from s3server import MotoS3

    srv = MotoS3(tmp_path / "moto.log").start()
    try:
        bucket = srv.new_bucket()
        store = S3BlobStore(f"s3://{bucket}/w", endpoint=srv.url, max_retries=1, retry_timeout_s=1.0)
        state = model(1, tensors=12, numel=512 * 1024)  # 12 shards of 2 MiB
        await WeightPublisher(store, target_shard_bytes=2 * MiB).publish(state, 1)
        m = Manifest.decode(await store.read_all(wire.weights_manifest_key(1)))
        assert len(m.shards) == 12

        killer = KillOnFirstShardChunk(store, srv)
        cache = WeightCache(tmp_path / "cache", killer, retry_deadline_s=1.0)
        with pytest.raises(StoreUnavailable, match="gave up"):
            await cache.ensure(1)
        assert killer.killed and cache.cached_versions() == []
        no_partial_files(cache)
        kept = {f.name for f in cache.shards_dir.iterdir()}
        assert 1 <= len(kept) < 12  # the shard that was arriving when the server died is whole

        # A server is back on the same address. moto keeps nothing across a restart, so the
        # trainer's retry publishes the version again (same bytes, same content addresses).
        fetched = cache.stats.shards_fetched, cache.stats.bytes_fetched
        srv = MotoS3(tmp_path / "moto.log", port=srv.port).start()
        srv.client().create_bucket(Bucket=bucket)
        await WeightPublisher(store, target_shard_bytes=2 * MiB).publish(state, 1)
        cache.store = store
        vv = await cache.ensure(1)
        assert_same(vv.load_tensors(), state)
        assert cache.stats.shards_reused >= len(kept)  # the kept shards did not move again
        assert cache.stats.shards_fetched - fetched[0] == 12 - len(kept)
        assert cache.stats.bytes_fetched - fetched[1] == sum(s.size for s in m.shards
                                                             if f"{s.sha256}.safetensors" not in kept)
        no_partial_files(cache)
    finally:
        srv.kill()


class CuttableProxy:
    """A loopback TCP proxy in front of the S3 server whose open connections can be reset."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.conns: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.port = 0

    async def start(self) -> CuttableProxy:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.conns.append((cw, sw))

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(1 << 16):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.close()

        await asyncio.gather(pipe(cr, sw), pipe(sr, cw))

    def cut(self) -> int:
        """Reset every connection open now (RST, as a crashed load balancer); new ones go through."""
        n = len(self.conns)
        for cw, sw in self.conns:
            cw.transport.abort()
            sw.transport.abort()
        self.conns.clear()
        return n

    async def close(self) -> None:
        self.cut()
        self.server.close()
        await self.server.wait_closed()


async def ranged_gets(server, path: str, at_least: int = 1, timeout_s: float = 5.0) -> int:
    """Ranged GETs (206) of `path` in the S3 server's request log, once there are `at_least`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        n = sum(1 for line in server.log.read_text(errors="replace").splitlines()
                if f'"GET {path} ' in line and '" 206 ' in line)
        if n >= at_least or asyncio.get_running_loop().time() > deadline:
            return n
        await asyncio.sleep(0.05)


async def read_after_cut(store: S3BlobStore, key: str, proxy: CuttableProxy, replace=None) -> bytes:
    """Read `key`, resetting the connection once the first chunk is in (and first replacing
    the object, if `replace`): the SHA-256 of all that came."""
    h = hashlib.sha256()
    reader = store.read(key)
    h.update(await reader.__anext__())
    if replace is not None:
        await replace()
    assert proxy.cut() >= 1
    async for chunk in reader:
        h.update(chunk)
    return h.digest()


@pytest.mark.slow
async def test_connection_cut_mid_body_resumes_with_a_ranged_get(s3_server, bucket):
    data = os.urandom(48 * MiB + 11)  # far more than the socket buffers hold in flight
    direct = S3BlobStore(f"s3://{bucket}/w", endpoint=s3_server.url)
    await direct.put("shards/big", data)
    proxy = await CuttableProxy(s3_server.port).start()
    path = f"/{bucket}/w/shards/big"
    try:
        via_proxy = f"s3://{bucket}/w"
        # the client's own retries resume the body (a ranged GET, pinned to the ETag) ...
        store = S3BlobStore(via_proxy, endpoint=f"http://127.0.0.1:{proxy.port}")
        store.READ_CHUNK = 1 * MiB
        assert await read_after_cut(store, "shards/big", proxy) == hashlib.sha256(data).digest()
        assert await ranged_gets(s3_server, path) == 1
        # ... and where they are spent (none here), the store's read resumes it itself
        bare = S3BlobStore(via_proxy, endpoint=f"http://127.0.0.1:{proxy.port}", max_retries=0)
        bare.READ_CHUNK = 1 * MiB
        assert await read_after_cut(bare, "shards/big", proxy) == hashlib.sha256(data).digest()
        assert bare.resumed_reads == 1 and await ranged_gets(s3_server, path, 2) == 2

        # the object is replaced between the cut and the resume: never spliced, a clear error
        for s in (store, bare):
            with pytest.raises(StoreUnavailable, match="replaced while being read"):
                await read_after_cut(s, "shards/big", proxy,
                                     replace=lambda: direct.put("shards/big", os.urandom(48 * MiB)))
    finally:
        await proxy.close()


@pytest.mark.parametrize("tamper", ["flip", "truncate"])
async def test_tampered_object_is_caught_by_the_hash_check(s3_server, bucket, tmp_path, tamper):
    store = S3BlobStore(f"s3://{bucket}/w", endpoint=s3_server.url)
    state = model(2)
    await WeightPublisher(store, target_shard_bytes=16 * 1024).publish(state, 1)
    m = Manifest.decode(await store.read_all(wire.weights_manifest_key(1)))
    victim = m.shards[1]
    key = f"w/{wire.weights_shard_key(victim.sha256)}"
    client = s3_server.client()
    original = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    bad = bytearray(original)
    if tamper == "flip":
        bad[len(bad) // 2] ^= 0x01
    else:
        bad = bad[: len(bad) - 100]
    client.put_object(Bucket=bucket, Key=key, Body=bytes(bad))  # someone with write access to the bucket

    cache = WeightCache(tmp_path / "cache", store, corrupt_retries=2)
    with pytest.raises(ShardCorrupt, match=victim.sha256):
        await cache.ensure(1)
    assert cache.cached_versions() == [] and cache.stats.shards_refused == 2
    assert not (cache.shards_dir / f"{victim.sha256}.safetensors").exists()
    no_partial_files(cache)

    client.put_object(Bucket=bucket, Key=key, Body=original)  # the object is restored
    assert_same((await cache.ensure(1)).load_tensors(), state)


# ---------------------------------------------------------------- the setting


async def test_weights_store_setting_selects_the_s3_bucket(s3_server, bucket, js, tmp_path):
    """`[weights] store = "s3://bucket/prefix"` (+ s3_endpoint) in a config file: the trainer's
    publisher and a worker's weight source both use that bucket; credentials come from the
    environment (AWS_ACCESS_KEY_ID etc., set by the s3_env fixture), none from the file."""
    from rlboost.workers.main import weight_source

    cfg = tmp_path / "rlboost.toml"
    cfg.write_text(f'[weights]\nstore = "s3://{bucket}/run-7"\ns3_endpoint = "{s3_server.url}"\n'
                   f'[worker]\nemulated_pulls = true\ncache_dir = "{tmp_path / "wc"}"\n')
    s = load_settings(cfg, environ=dict(os.environ))
    store = await open_store(js=js, **s.weights.store_options())
    assert isinstance(store, S3BlobStore) and store.location.startswith(f"s3://{bucket}/run-7")
    state = model(3)
    await WeightPublisher(store, target_shard_bytes=16 * 1024).publish(state, 4)
    source = await weight_source(s, js, "w-s3")
    assert isinstance(source.cache.store, S3BlobStore)
    path = await source.path(4)
    assert_same(load_tensors(path, expect_version=4), state)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert keys and all(k.startswith("run-7/") for k in keys)
    with pytest.raises(ObjectMissing):
        await store.read_all(wire.weights_manifest_key(5))

    # the same keys from the environment, and what a started process inherits
    env = {**os.environ, "RLBOOST_WEIGHTS__STORE": f"s3://{bucket}/run-8", "RLBOOST_WEIGHTS__S3_REGION": "eu-west-1"}
    s2 = load_settings(environ=env)
    assert (s2.weights.store, s2.weights.s3_region) == (f"s3://{bucket}/run-8", "eu-west-1")
    assert s.weights.store_env() == {"RLBOOST_WEIGHTS__STORE": f"s3://{bucket}/run-7",
                                     "RLBOOST_WEIGHTS__S3_ENDPOINT": s3_server.url}
    file_store = await open_store(**load_settings(environ={"RLBOOST_WEIGHTS__STORE": f"file://{tmp_path}/d"})
                                  .weights.store_options())
    assert file_store.location == f"file://{tmp_path}/d"
    for bad in ("gs://bucket/x", "s3://AKIA:secret@bucket/x", "s3://b/x"):
        with pytest.raises(ConfigError, match="weights.store"):
            load_settings(environ={"RLBOOST_WEIGHTS__STORE": bad})
    with pytest.raises(ConfigError, match="weights.s3_endpoint"):
        load_settings(environ={"RLBOOST_WEIGHTS__S3_ENDPOINT": "127.0.0.1:9000"})
    assert Path(tmp_path / "wc" / "w-s3").is_dir()


@pytest.mark.slow
def test_a_run_publishes_to_and_its_workers_pull_from_the_s3_store(s3_server, bucket, services, tmp_path):
    """`rlboost run --weights.store s3://...`: the trainer publishes every version to the bucket
    (nothing to the JetStream bucket) and the run's worker process pulls from it."""
    import json
    import subprocess
    import sys

    from rlboost.trainer.model import init_model_dir
    from rlboost.trainer.tasks import get_task

    model_dir = init_model_dir(tmp_path / "model", get_task("addition"), seed=2)
    meta = model_dir / "rlboost.json"  # pretend it was warm-started: this test is about the weights
    meta.write_text(json.dumps({**(json.loads(meta.read_text()) if meta.exists() else {}), "trained": True}))
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": services[0], "RLBOOST_REDIS_URL": services[1], "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--model-dir", str(model_dir), "--run-dir",
                        str(run_dir), "--prompts", "4", "--samples", "4", "--eval-every", "100", "--steps", "2",
                        "--workers", "1", "--policy", "disaggregated", "--weights.store", f"s3://{bucket}/run",
                        "--weights.s3_endpoint", s3_server.url],
                       capture_output=True, text=True, env=env, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    manifests = sorted(k for k in keys if k.startswith("run/manifests/"))
    assert len(manifests) >= 2 and any(k.startswith("run/shards/") for k in keys)
    pulled = [d for d in (run_dir / "weight-cache").iterdir() if d.name != "reserved"]
    assert pulled and any((d / "versions").glob("v*") for d in pulled), list((run_dir / "weight-cache").rglob("*"))
