"""Peers serve each other (rlboost/weights/peers.py, peerhttp.py): the blob server's refusals
and bound, pulls that take blobs from peers before the origin, lying and dead peers, the
worker's `[weights] peers` setting, and the acceptance test: 8 late joiners of a version in a
real S3 API server (moto) pulling at once, the origin serving at most twice the version."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import socket
from pathlib import Path

import pytest
import torch

from helpers import PassThroughStore
from rlboost import wire
from rlboost.config import ConfigError, load_settings
from rlboost.services import free_port
from rlboost.weights import BlobStore, FileBlobStore, Manifest, S3BlobStore, WeightCache, WeightPublisher
from rlboost.weights.errors import StoreError
from rlboost.weights.peerhttp import PeerError, PeerServer, read_blob
from rlboost.weights.peers import PeerNetwork, open_peers_bucket

MiB = 1 << 20
TOKEN = "peer-secret-token"


def model(seed: int, tensors: int = 8, numel: int = 64 * 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)}


def all_whole(cache: WeightCache) -> None:
    """Nothing half-received, and every cached blob is exactly what its name says."""
    assert not list(cache.root.rglob("*.part"))
    for f in [*cache.shards_dir.iterdir(), *cache.deltas_dir.iterdir()]:
        assert hashlib.sha256(f.read_bytes()).hexdigest() == f.name.split(".")[0], f


class CountingStore(PassThroughStore, BlobStore):
    """The origin store as it is, counting the bytes it hands out (the origin's load)."""

    def __init__(self, inner: BlobStore, counter: dict[str, int]) -> None:
        super().__init__(inner)
        self.counter = counter

    async def read(self, key):
        async for chunk in self.inner.read(key):
            self.counter["bytes"] += len(chunk)
            yield chunk


class LyingPeer:
    """A peer server that answers every blob request with the right length and one byte
    flipped (a compromised or broken worker), or (`cut`) with half the body before it hangs up
    (a worker killed mid-transfer): a real HTTP server on loopback. A ranged request (a piece of
    a version file) gets that range of the flipped body."""

    def __init__(self, blobs: dict[str, bytes], cut: bool = False) -> None:
        self.blobs, self.cut, self.served, self.url = blobs, cut, 0, ""

    async def start(self) -> LyingPeer:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            sha = head.split(b" ")[1].decode().rsplit("/", 1)[-1]
            bad = bytearray(self.blobs[sha])
            bad[len(bad) // 2] ^= 0x01
            status = b"200 OK"
            ranged = re.search(rb"(?i)\r\nrange: bytes=(\d+)-(\d+)", head)
            if ranged:
                bad, status = bad[int(ranged[1]):int(ranged[2]) + 1], b"206 Partial Content"
            body = bytes(bad[:len(bad) // 2] if self.cut else bad)
            w.write(b"HTTP/1.1 %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (status, len(bad)) + body)
            await w.drain()
            self.served += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def http_get(url: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    r, w = await asyncio.open_connection(host, int(port))
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    w.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode())
    data = await r.read()
    w.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def published(store: BlobStore, state: dict[str, torch.Tensor], version: int = 1,
                    shard_bytes: int = 256 * 1024) -> Manifest:
    await WeightPublisher(store, target_shard_bytes=shard_bytes, deltas=False).publish(state, version)
    return Manifest.decode(await store.read_all(wire.weights_manifest_key(version)))


async def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- the blob server


@pytest.fixture
async def served(tmp_path):
    """A cache holding version 1 verified (one 16 MiB shard and small ones) and its server (token, bound 1)."""
    store = FileBlobStore(tmp_path / "origin", create=True)
    state = {"big": torch.randn(4 * MiB, generator=torch.Generator().manual_seed(0)), **model(1, tensors=2)}
    m = await published(store, state, shard_bytes=1 * MiB)
    cache = WeightCache(tmp_path / "cache", store)
    await cache.ensure(1)
    server = PeerServer(cache, token=TOKEN, max_serving=1)
    await server.start()
    yield cache, server, m
    await server.close()
    cache.close()


async def test_server_serves_only_verified_blobs_to_token_holders(served):
    cache, server, m = served
    small = min(m.shards, key=lambda s: s.size)
    path = f"/blob/{small.sha256}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, body = await http_get(server.url, path, auth)
    assert status == 200 and hashlib.sha256(body).hexdigest() == small.sha256
    # no token, a wrong one, another scheme: refused before anything else is looked at
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        assert (await http_get(server.url, path, headers))[0] == 401
        assert (await http_get(server.url, "/blob/nonsense", headers))[0] == 401
    # a name that is not a SHA-256: refused before any path is built from it
    for bad in ("/blob/../../etc/passwd", "/blob/" + small.sha256.upper(), "/blob/" + small.sha256[:-1],
                f"/blob/{small.sha256}/x", "/blob/" + "g" * 64):
        assert (await http_get(server.url, bad, auth))[0] == 400, bad
    assert (await http_get(server.url, "/other", auth))[0] == 404
    # unknown to the cache, or on disk but not hashed by this process, or changed since: 404
    unknown = hashlib.sha256(b"never published").hexdigest()
    assert (await http_get(server.url, f"/blob/{unknown}", auth))[0] == 404
    planted = b"a file nobody hashed"
    (cache.shards_dir / f"{hashlib.sha256(planted).hexdigest()}.safetensors").write_bytes(planted)
    assert (await http_get(server.url, f"/blob/{hashlib.sha256(planted).hexdigest()}", auth))[0] == 404
    victim = cache.shards_dir / f"{small.sha256}.safetensors"
    os.unlink(victim)  # the version dir keeps the inode alive; a new file under the name is not it
    victim.write_bytes(body)
    assert (await http_get(server.url, path, auth))[0] == 404
    # the client side says the same
    with pytest.raises(PeerError, match="401"):
        async for _ in read_blob(server.url, small.sha256, token="wrong"):
            pass


async def test_server_bounds_the_bodies_it_sends_at_once(served):
    cache, server, m = served
    big = max(m.shards, key=lambda s: s.size)
    assert big.size >= 16 * MiB  # far more than the socket buffers hold
    auth = {"Authorization": f"Bearer {TOKEN}"}
    host, port = server.url.removeprefix("http://").split(":")
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a client that reads nothing
    slow.connect((host, int(port)))
    slow.sendall(f"GET /blob/{big.sha256} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    try:
        await wait_for(lambda: server.serving == 1)
        assert (await http_get(server.url, f"/blob/{big.sha256}", auth))[0] == 503
        assert server.busy_refusals == 1
    finally:
        slow.close()
    await wait_for(lambda: server.serving == 0)
    status, body = await http_get(server.url, f"/blob/{big.sha256}", auth)
    assert status == 200 and hashlib.sha256(body).hexdigest() == big.sha256


async def test_an_open_server_stays_on_loopback(tmp_path):
    cache = WeightCache(tmp_path / "c", FileBlobStore(tmp_path / "o", create=True))
    with pytest.raises(StoreError, match="token"):
        PeerServer(cache, host="0.0.0.0")
    PeerServer(cache, host="0.0.0.0", token=TOKEN)  # with a token it may
    with pytest.raises(ConfigError, match="weights.peer_advertise"):
        load_settings(environ={"RLBOOST_WEIGHTS__PEER_HOST": "0.0.0.0"})
    cache.close()


# ---------------------------------------------------------------- pulls through peers


async def joiner(tmp_path: Path, name: str, kv, store: BlobStore, **net) -> tuple[WeightCache, PeerServer]:
    network = PeerNetwork(kv, name, token=TOKEN, **net)
    cache = WeightCache(tmp_path / name, store, peers=network)
    server = PeerServer(cache, token=TOKEN)
    network.url = await server.start()
    return cache, server


async def leave(*members: tuple[WeightCache, PeerServer]) -> None:
    for cache, server in members:
        await cache.peers.close()
        await server.close()
        cache.close()


@pytest.fixture
async def peers_kv(js):
    kv = await open_peers_bucket(js)
    yield kv
    await js.delete_key_value(wire.BUCKET_PEERS)


async def test_a_lying_peer_is_caught_and_the_pull_completes_elsewhere(peers_kv, tmp_path):
    """The only holders a blob has are a liar (one byte flipped) and a dead address: every
    lying copy is refused by the hash check, nothing of it is kept, and the version comes from
    the origin; a later joiner takes every blob from the honest peer, none from the origin."""
    origin = FileBlobStore(tmp_path / "origin", create=True)
    state = model(2)
    m = await published(origin, state)
    blobs = {s.sha256: await origin.read_all(wire.weights_shard_key(s.sha256)) for s in m.shards}
    liar = await LyingPeer(blobs).start()
    dead = f"http://127.0.0.1:{free_port()}"
    liar_net = PeerNetwork(peers_kv, "liar")
    liar_net.url = liar.url
    dead_net = PeerNetwork(peers_kv, "dead")
    dead_net.url = dead
    for s in m.shards:
        await liar_net.advertise(s.sha256)
        await dead_net.advertise(s.sha256)
    counted = {"bytes": 0}
    first = await joiner(tmp_path, "first", peers_kv, CountingStore(origin, counted))
    second = await joiner(tmp_path, "second", peers_kv, CountingStore(origin, counted))
    try:
        vv = await first[0].ensure(1)
        assert all(torch.equal(vv.load_tensors()[k], state[k]) for k in state)
        st = first[0].stats
        assert liar.served == st.peer_rejected == len(m.shards)  # each blob: one lie, caught
        assert st.peer_blobs == 0 and st.origin_bytes == m.total_bytes  # blob bytes (the manifest aside)
        all_whole(first[0])

        # the liar and the dead address are still advertised; the first joiner now is too
        vv = await second[0].ensure(1)
        assert all(torch.equal(vv.load_tensors()[k], state[k]) for k in state)
        st2 = second[0].stats
        assert st2.peer_blobs == len(m.shards) and st2.peer_rejected == liar.served - len(m.shards)
        assert st2.origin_bytes == 0 and st2.peer_bytes >= m.total_bytes  # every shard from the honest peer
        all_whole(second[0])
    finally:
        await leave(first, second)
        await liar.close()


async def test_a_peer_cut_mid_body_or_a_dead_claimant_costs_a_retry(peers_kv, tmp_path):
    """A holder that hangs up half-way through every body is not asked again (nothing of it is
    kept, it is not counted as a lie); a claim whose worker died (never refreshed) is taken over
    once stale, and the version comes from the origin."""
    origin = FileBlobStore(tmp_path / "origin", create=True)
    state = model(5)
    m = await published(origin, state)
    blobs = {s.sha256: await origin.read_all(wire.weights_shard_key(s.sha256)) for s in m.shards}
    cutter = await LyingPeer(blobs, cut=True).start()
    nets = {name: PeerNetwork(peers_kv, name, claim_stale_s=0.5) for name in ("cutter", "ghost")}
    nets["cutter"].url, nets["ghost"].url = cutter.url, f"http://127.0.0.1:{free_port()}"
    for s in m.shards:
        await nets["cutter"].advertise(s.sha256)
        assert await nets["ghost"].claim(s.sha256, exclude={"cutter"})  # ... and dies: no refresh, no advert
    one = await joiner(tmp_path, "one", peers_kv, origin, claim_stale_s=0.5)
    try:
        t0 = asyncio.get_running_loop().time()
        vv = await one[0].ensure(1)
        assert all(torch.equal(vv.load_tensors()[k], state[k]) for k in state)
        assert asyncio.get_running_loop().time() - t0 >= 0.4  # it waited for the claim to go stale
        st = one[0].stats
        assert cutter.served == len(m.shards) and st.peer_rejected == 0 and st.peer_blobs == 0
        assert st.origin_bytes == m.total_bytes
        for s in m.shards:  # every blob: the ghost's claim taken over, then ended by the advert
            entry = await one[0].peers.state(s.sha256)
            assert not entry.claim and set(entry.holders) == {"cutter", "one"}
        all_whole(one[0])
    finally:
        await leave(one)
        await cutter.close()


async def test_the_peers_setting_wires_a_worker(peers_kv, js, tmp_path, monkeypatch):
    """`[weights] peers = true`: a worker's weight source serves what it pulled, and a second
    worker pulls the version from it; closing withdraws the adverts."""
    from rlboost.workers.main import weight_source

    monkeypatch.setenv("RLBOOST_PEER_TOKEN", TOKEN)
    s = load_settings(environ={"RLBOOST_WEIGHTS__STORE": f"file://{tmp_path}/origin",
                               "RLBOOST_WEIGHTS__PEERS": "true", "RLBOOST_WORKER__EMULATED_PULLS": "true",
                               "RLBOOST_WORKER__CACHE_DIR": str(tmp_path / "wc")})
    # what `rlboost run` hands the workers it starts carries the peers' settings too
    assert load_settings(environ=s.weights.store_env()).weights.peers is True
    origin = FileBlobStore(tmp_path / "origin", create=True)
    m = await published(origin, model(3))
    a, b = await weight_source(s, js, "w-a"), await weight_source(s, js, "w-b")
    try:
        assert a.server.token == TOKEN and a.server.url.startswith("http://127.0.0.1:")
        await a.path(1)
        await b.path(1)
        assert a.cache.stats.peer_blobs == 0 and b.cache.stats.peer_blobs == len(m.shards)
        assert b.cache.stats.origin_bytes == 0 and b.cache.stats.peer_bytes == m.total_bytes
        entry = await a.cache.peers.state(m.shards[0].sha256)
        assert set(entry.holders) == {"w-a", "w-b"} and not entry.claim
    finally:
        await a.aclose()
        await b.aclose()
    assert not (await b.cache.peers.state(m.shards[0].sha256)).holders


@pytest.mark.slow
async def test_eight_late_joiners_the_origin_serves_each_blob_about_once(s3_server, peers_kv, tmp_path):
    """Acceptance: a version (8 MiB in 32 shards) in an S3 API server; 8 workers join after it
    is published and pull it at the same moment, each serving the others; a lying peer holds
    (it says) a quarter of the blobs. All 8 reach the version verified, the origin serves at
    most 2x its bytes (each blob is claimed by one worker and fetched once), and every lying
    copy is caught by the hash check."""
    bucket = s3_server.new_bucket()
    try:
        origin = S3BlobStore(f"s3://{bucket}/w", endpoint=s3_server.url)
        state = model(4, tensors=32)
        m = await published(origin, state)
        size = m.total_bytes
        assert size >= 8 * MiB and len(m.shards) >= 32
        blobs = {s.sha256: await origin.read_all(wire.weights_shard_key(s.sha256)) for s in m.shards}
        liar = await LyingPeer(blobs).start()
        liar_net = PeerNetwork(peers_kv, "liar")
        liar_net.url = liar.url
        for s in m.shards[::4]:
            await liar_net.advertise(s.sha256)

        counted = {"bytes": 0}
        joiners = [await joiner(tmp_path, f"late-{i}", peers_kv, CountingStore(origin, counted)) for i in range(8)]
        try:
            versions = await asyncio.wait_for(asyncio.gather(*(c.ensure(1) for c, _ in joiners)), 120)
            for vv in versions:
                got = vv.load_tensors()
                assert all(torch.equal(got[k], state[k]) for k in state)
            for c, _ in joiners:
                all_whole(c)
            stats = [c.stats for c, _ in joiners]
            rejected = sum(s.peer_rejected for s in stats)
            print(f"\norigin served {counted['bytes']} bytes for a {size}-byte version "
                  f"({counted['bytes'] / size:.2f}x; without peers each reads it all: 8x); peers served "
                  f"{sum(s.peer_bytes for s in stats) / size:.2f}x; lying copies {liar.served}, refused {rejected}")
            assert counted["bytes"] <= 2 * size
            # the liar holds 8 blobs, so whoever claims one has tried it first: every copy it sent was caught
            await wait_for(lambda: liar.served == rejected)
            assert rejected >= 8
        finally:
            await leave(*joiners)
            await liar.close()
    finally:
        s3_server.drop_bucket(bucket)


@pytest.mark.parametrize("piece", [16 * MiB, 600 * 1024])  # the version's one file in one piece, or in four
async def test_a_late_joiner_takes_a_rebuilt_version_whole_from_a_peer_and_refuses_a_lie(peers_kv, tmp_path,
                                                                                         monkeypatch, piece):
    """A version rebuilt from deltas is served whole: a late joiner with an empty cache takes its
    files from a peer that holds it (nothing replayed, no snapshot or delta from the origin), in
    pieces of whole tensors fetched in parallel, checking the header and every tensor's SHA-256
    as they arrive. A peer that serves one byte wrong is refused and not asked again; with no
    honest holder the joiner takes the snapshot and the deltas from the origin, and then serves
    the version itself."""
    from rlboost.weights import peer_versions as cache_module

    monkeypatch.setattr(cache_module, "PEER_PIECE_BYTES", piece)
    origin = FileBlobStore(tmp_path / "origin", create=True)
    g = torch.Generator().manual_seed(7)
    master = {f"layers.{i}.weight": torch.randn(256, 1024, generator=g) * 0.02 for i in range(4)}
    pub = WeightPublisher(origin, full_every=10)
    truth = {}
    for v in range(4):  # v0 a snapshot, v1-v3 deltas
        if v:
            for t in master.values():
                t.add_(torch.randn(t.shape, generator=g) * 1e-5)
        truth[v] = {k: t.to(torch.bfloat16) for k, t in master.items()}
        await pub.publish(truth[v], v)
    m3 = Manifest.decode(await origin.read_all(wire.weights_manifest_key(3)))
    assert not m3.shards and m3.delta is not None

    def exact(cache: WeightCache, vv) -> None:
        got = vv.load_tensors()
        assert all(torch.equal(got[k].view(torch.int16), truth[3][k].view(torch.int16)) for k in truth[3])
        all_whole(cache)
        assert not list(cache.tmp_dir.iterdir())

    follower = await joiner(tmp_path, "follower", peers_kv, origin)
    counted = {"bytes": 0}
    first = second = None
    liar = None
    try:
        for v in range(4):
            await follower[0].ensure(v)  # each delta replayed on the version before: advertised whole
        assert follower[0].stats.peer_versions == 0 and follower[0].stats.reconstructed == 3
        files = sorted((follower[0].versions_dir / f"v{3:012d}").glob("tensors-*.safetensors"))
        assert len(files) == 1
        url, digest, auth = follower[1].url, m3.digest(), {"Authorization": f"Bearer {TOKEN}"}
        status, body = await http_get(url, f"/version/{digest}/0", auth | {"Range": "bytes=8-19"})
        assert status == 206 and body == files[0].read_bytes()[8:20]
        size = files[0].stat().st_size
        assert (await http_get(url, f"/version/{digest}/0", auth | {"Range": f"bytes=0-{size}"}))[0] == 416
        assert (await http_get(url, f"/version/{digest}/0", {"Range": "bytes=0-9"}))[0] == 401
        for bad in (f"/version/{digest}/x", f"/version/{digest}", "/version/../0", f"/version/{digest[:-1]}/0"):
            assert (await http_get(url, bad, auth))[0] == 400, bad
        for missing in (f"/version/{digest}/1", f"/version/{hashlib.sha256(b'other').hexdigest()}/0"):
            assert (await http_get(url, missing, auth))[0] == 404, missing  # no such file, no such version
        liar = await LyingPeer({"0": files[0].read_bytes()}).start()
        liar_net = PeerNetwork(peers_kv, "liar")
        liar_net.url = liar.url
        await liar_net.advertise_version(m3.digest())

        await follower[0].peers.withdraw("", wire.peer_version_key(m3.digest()))  # the liar alone
        first = await joiner(tmp_path, "first", peers_kv, origin)
        exact(first[0], await first[0].ensure(3))
        st = first[0].stats
        assert liar.served >= st.peer_rejected == 1 and st.peer_versions == 0  # refused, then the origin
        assert st.reconstructed == 1 and st.origin_bytes > m3.delta.bytes  # the snapshot and the deltas

        second = await joiner(tmp_path, "second", peers_kv, CountingStore(origin, counted))
        exact(second[0], await second[0].ensure(3))  # the liar is still advertised, and now `first`
        st = second[0].stats
        assert st.peer_versions == 1 and st.reconstructed == 0 and st.origin_bytes == 0
        assert st.peer_rejected <= 1  # the liar's bad piece, if it was asked for it
        assert counted["bytes"] < 10_000  # from the origin: only manifests
        assert (second[0].versions_dir / f"v{3:012d}" / files[0].name).read_bytes() == files[0].read_bytes()
    finally:
        await leave(*(m for m in (follower, first, second) if m is not None))
        if liar is not None:
            await liar.close()


def test_a_version_file_is_cut_into_pieces_of_whole_tensors_each_with_bytes():
    from rlboost.weights.peer_versions import _pieces

    header, big, empty, small = (0, 8, ""), (8, 100, "a" * 64), (108, 0, "b" * 64), (108, 5, "c" * 64)
    assert _pieces([header, big, empty, small], 50) == [[header], [big, empty], [small]]
    assert _pieces([header, big, empty, small], 1 << 20) == [[header, big, empty, small]]
