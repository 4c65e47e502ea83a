"""Per-role identities on real servers: a worker can do its job and nothing it should not.

The servers are started by `EmbeddedServices` on free ports with roles configured, i.e. with
the nats-server config and Redis ACL file that rlboost/auth.py generates (the same rules the
infra/ files carry)."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from urllib.parse import quote

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import redis.exceptions

from rlboost import auth, bus, wire
from rlboost.checkpoint import CheckpointStore
from rlboost.config import AuthSettings, ServicesSettings
from rlboost.services import EmbeddedServices, resolve_urls

TRAINER_PW, WORKER_PW = "trainer-s3cret", "worker:s3cret@/%"  # URL-special characters survive
POOL = "spot"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    s = ServicesSettings(data_dir=str(tmp_path_factory.mktemp("rlboost-auth")),
                         auth=AuthSettings(trainer_password=TRAINER_PW, worker_password=WORKER_PW, worker_pools=POOL))
    svc = EmbeddedServices(s)
    st, started = svc.up()
    assert started
    yield svc, st
    svc.stop_recorded()


def nats_url(st, user: str, password: str) -> str:
    return f"nats://{user}:{quote(password, safe='')}@127.0.0.1:{st.nats_port}"


def redis_url(st, user: str, password: str) -> str:
    return f"redis://{user}:{quote(password, safe='')}@127.0.0.1:{st.redis_port}/0"


class Errors:
    """The error callback: permission violations arrive asynchronously, as protocol errors."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def __call__(self, e: Exception) -> None:
        self.seen.append(str(e).lower())

    async def wait_for(self, subject: str, timeout: float = 3.0) -> str:
        want = f'permissions violation for publish to "{subject.lower()}"'
        for _ in range(int(timeout / 0.05)):
            hit = [e for e in self.seen if want in e]
            if hit:
                return hit[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no permissions violation for {subject}; errors seen: {self.seen}")


@pytest_asyncio.fixture
async def trainer(secured):
    _, st = secured
    nc = await bus.connect(nats_url(st, "trainer", TRAINER_PW), name="test-trainer")
    js = nc.jetstream()
    await bus.provision(js, pools=(POOL,))
    yield js
    await nc.drain()


@pytest_asyncio.fixture
async def worker(secured, trainer):
    _, st = secured
    errors = Errors()
    nc = await bus.connect(nats_url(st, "worker", WORKER_PW), name="test-worker", error_cb=errors)
    yield nc, nc.jetstream(), errors
    await nc.close()


def test_generated_files_are_private(secured):
    svc, _ = secured
    for name in ("nats.conf", "users.acl"):
        mode = stat.S_IMODE((Path(svc.data_dir) / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    assert WORKER_PW in (Path(svc.data_dir) / "nats.conf").read_text()


async def test_worker_does_its_job(trainer, worker):
    nc, js, errors = worker
    # consume: the trainer puts a fresh request, the worker fetches it from its pool's consumer
    req = wire.RolloutRequest(request_id="s00001-p00000-g000", step=1, policy_version=0, prompt_ids=[1, 2],
                              max_new_tokens=4, seed=1)
    await trainer.publish(wire.request_subject(POOL), wire.encode(req))
    sub = await js.pull_subscribe_bind(durable=wire.consumer_name(POOL), stream=wire.STREAM_REQUESTS)
    (msg,) = await sub.fetch(1, timeout=5)
    assert wire.decode(wire.RolloutRequest, msg.data).request_id == req.request_id
    await msg.in_progress()
    # publish: tokens, results, events, a hand-off to the resume lane; then ack
    for subject in (wire.token_subject(1, req.request_id), wire.result_subject(1), wire.event_subject(1, req.request_id),
                    wire.resume_subject(POOL), wire.dlq_subject(wire.STREAM_REQUESTS)):
        ack = await js.publish(subject, b"x", timeout=5)
        assert ack.seq > 0, subject
    await msg.ack()
    # heartbeat into the registry, read the policy pointer the trainer wrote and the control bucket
    await (await js.key_value(wire.BUCKET_WORKERS)).put("spot-w1", b"hb")
    await (await trainer.key_value(wire.BUCKET_POLICY)).put(wire.WEIGHTS_POINTER_KEY, b"7")
    entry = await (await js.key_value(wire.BUCKET_POLICY)).get(wire.WEIGHTS_POINTER_KEY)
    assert entry.value == b"7"
    # joining is safe: provisioning an already provisioned server needs no forbidden call
    await bus.provision(js, pools=(POOL,))
    await nc.flush()
    assert not [e for e in errors.seen if "permission" in e], errors.seen


@pytest.mark.parametrize("case", ["fresh-lane", "delete-stream", "purge-stream", "policy-put", "other-pool"])
async def test_worker_is_refused(trainer, worker, case):
    nc, js, errors = worker
    if case == "fresh-lane":
        subject = wire.request_subject(POOL)
        with pytest.raises(Exception):
            await js.publish(subject, b"injected prompt", timeout=1)
    elif case == "delete-stream":
        subject = f"$JS.API.STREAM.DELETE.{wire.STREAM_TOKENS}"
        with pytest.raises(Exception):
            await js.delete_stream(wire.STREAM_TOKENS)
    elif case == "purge-stream":
        subject = f"$JS.API.STREAM.PURGE.{wire.STREAM_RESULTS}"
        await nc.publish(subject, b"{}")
    elif case == "policy-put":
        subject = f"$KV.{wire.BUCKET_POLICY}.{wire.WEIGHTS_POINTER_KEY}"
        kv = await js.key_value(wire.BUCKET_POLICY)
        with pytest.raises(Exception):
            await kv.put(wire.WEIGHTS_POINTER_KEY, b"999")
    else:  # another pool's consumer
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{wire.STREAM_REQUESTS}.{wire.consumer_name('reserved')}"
        await nc.publish(subject, b"{}")
    await nc.flush()
    await errors.wait_for(subject)
    # and nothing happened: the streams are there, the policy pointer is not 999
    for name in (wire.STREAM_TOKENS, wire.STREAM_RESULTS):
        assert (await trainer.stream_info(name)).config.name == name
    if case == "policy-put":
        entry = await (await trainer.key_value(wire.BUCKET_POLICY)).get(wire.WEIGHTS_POINTER_KEY)
        assert entry is None or entry.value != b"999"


async def test_wrong_password_is_a_clear_error(secured):
    _, st = secured
    with pytest.raises(ConnectionError) as e:
        await asyncio.wait_for(bus.connect(nats_url(st, "worker", "wrong")), timeout=10)
    text = str(e.value)
    assert "refused the credentials" in text and "authorization violation" in text.lower()
    assert "wrong" not in text  # the password is not echoed


async def test_redis_acl(secured):
    _, st = secured
    store = CheckpointStore(redis_url(st, "worker", WORKER_PW))
    try:
        await store.ping()
        rid = "acl-test-1"
        c = await store.claim(rid, "w1", policy_version=0, ttl_s=10.0)
        assert c.epoch == 1
        assert await store.append(rid, "w1", c.epoch, 0, [5, 6], [-0.1, -0.2], 10.0) == 2
        with pytest.raises(redis.exceptions.NoPermissionError):
            await store.redis.set("not-a-checkpoint", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await store.redis.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            await store.redis.config_get("*")
    finally:
        await store.close()
    admin = aioredis.from_url(redis_url(st, "trainer", TRAINER_PW))
    try:
        assert await admin.set("anything", "1")
    finally:
        await admin.aclose()
    for url in (redis_url(st, "worker", "wrong"), f"redis://127.0.0.1:{st.redis_port}/0"):
        anon = aioredis.from_url(url)
        try:
            with pytest.raises((redis.exceptions.AuthenticationError, redis.exceptions.ResponseError)):
                await anon.ping()
        finally:
            await anon.aclose()


def test_worker_permissions_shape():
    perms = auth.worker_permissions(["spot"])
    allow, deny = perms["publish"]["allow"], perms["publish"]["deny"]
    assert "rb.req.spot.resume" in allow and "rb.req.spot" not in allow and "rb.req.*" in deny
    assert not [s for s in allow if s.startswith(("$JS.API.STREAM.DELETE", "$JS.API.STREAM.UPDATE", "$KV.rb-policy"))]
    assert perms["subscribe"]["allow"][0] == "_INBOX.>"
    with pytest.raises(wire.WireError):
        auth.worker_pools(AuthSettings(worker_pools="spot,bad.pool"))


async def test_credentials_from_settings_join_plain_urls(secured, trainer):
    """What compose/k8s do: plain URLs in config, the identity from RLBOOST_SERVICES__* (a Secret)."""
    _, st = secured
    s = ServicesSettings(nats_url=f"nats://127.0.0.1:{st.nats_port}", redis_url=f"redis://127.0.0.1:{st.redis_port}/0",
                         nats_user="worker", nats_password=WORKER_PW, redis_user="worker", redis_password=WORKER_PW)
    n_url, r_url = resolve_urls(s)
    nc = await bus.connect(n_url)
    try:
        await (await nc.jetstream().key_value(wire.BUCKET_WORKERS)).put("spot-w2", b"hb")
    finally:
        await nc.close()
    store = CheckpointStore(r_url)
    try:
        await store.ping()
    finally:
        await store.close()
