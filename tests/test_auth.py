"""Per-role identities on real servers: a worker, and an environment worker (the env role), can
do its job and nothing it should not.

The servers are started by `EmbeddedServices` on free ports with roles configured, i.e. with
the nats-server config and Redis ACL file that rlboost/auth.py generates (the same rules the
infra/ files carry)."""

from __future__ import annotations

import asyncio
import os
import stat
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import nats.js.errors
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import redis.exceptions

from rlboost import auth, bus, wire
from rlboost.checkpoint import CheckpointStore
from rlboost.config import AuthSettings, ServicesSettings
from rlboost.services import EmbeddedServices, resolve_urls

TRAINER_PW, WORKER_PW, ENV_PW = "trainer-s3cret", "worker:s3cret@/%", "env#s3cret?&"  # URL-special characters survive
POOL = "spot"


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    s = ServicesSettings(data_dir=str(tmp_path_factory.mktemp("rlboost-auth")),
                         auth=AuthSettings(trainer_password=TRAINER_PW, worker_password=WORKER_PW, env_password=ENV_PW,
                                           worker_pools=POOL))
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
        return await self.wait_for_text(want, timeout)

    async def wait_for_text(self, want: str, timeout: float = 3.0) -> str:
        want = want.lower()
        for _ in range(int(timeout / 0.05)):
            hit = [e for e in self.seen if want in e]
            if hit:
                return hit[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no {want!r}; errors seen: {self.seen}")

    def refusals(self) -> list[str]:
        return [e for e in self.seen if "permission" in e]


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


@pytest_asyncio.fixture
async def env_identity(secured, trainer):
    """A connection with the env role's identity (an environment worker's)."""
    _, st = secured
    errors = Errors()
    nc = await bus.connect(nats_url(st, "env", ENV_PW), name="test-env-worker", error_cb=errors)
    yield nc, nc.jetstream(), errors
    await nc.close()


def test_generated_files_are_private(secured):
    svc, _ = secured
    for name in ("nats.conf", "users.acl"):
        mode = stat.S_IMODE((Path(svc.data_dir) / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    assert WORKER_PW in (Path(svc.data_dir) / "nats.conf").read_text()
    assert ENV_PW in (Path(svc.data_dir) / "users.acl").read_text()


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
    # publish: tokens, results, events, a hand-off to the resume lane, an episode to the environment
    # lane (env.inline = false); then ack
    for subject in (wire.token_subject(1, req.request_id), wire.result_subject(1), wire.event_subject(1, req.request_id),
                    wire.resume_subject(POOL), wire.dlq_subject(wire.STREAM_REQUESTS), wire.env_subject(POOL)):
        ack = await js.publish(subject, b"x", timeout=5)
        assert ack.seq > 0, subject
    await msg.ack()
    # heartbeat into the registry, read the policy pointer the trainer wrote and the control bucket
    await (await js.key_value(wire.BUCKET_WORKERS)).put("spot-w1", b"hb")
    await (await trainer.key_value(wire.BUCKET_POLICY)).put(wire.WEIGHTS_POINTER_KEY, b"7")
    entry = await (await js.key_value(wire.BUCKET_POLICY)).get(wire.WEIGHTS_POINTER_KEY)
    assert entry.value == b"7"
    # the peers directory ([weights] peers): advertise a blob, claim another (compare-and-set writes)
    from rlboost.weights.peers import PeerNetwork, open_peers_bucket

    peers = PeerNetwork(await open_peers_bucket(js), "spot-w1")
    peers.url = "http://127.0.0.1:1"
    await peers.advertise("a" * 64)
    assert (await peers.state("a" * 64)).holders == {"spot-w1": peers.url}
    assert await peers.claim("b" * 64) and (await peers.state("b" * 64)).claim == "spot-w1"
    # joining is safe: provisioning an already provisioned server needs no forbidden call
    await bus.provision(js, pools=(POOL,))
    await nc.flush()
    assert not [e for e in errors.seen if "permission" in e], errors.seen


FORBIDDEN = ["fresh-lane", "delete-stream", "purge-stream", "policy-put", "other-pool", "delete-by-sequence",
             "consumer-update", "consumer-durable-update", "consumer-delete", "other-pool-resume", "control-put",
             "weights-put", "other-pool-env", "env-consumer"]


@pytest.mark.slow
@pytest.mark.parametrize("case", FORBIDDEN)
async def test_worker_is_refused(trainer, worker, case):
    nc, js, errors = worker
    rq, durable = wire.STREAM_REQUESTS, wire.consumer_name(POOL)
    raw = {  # forbidden JetStream API calls, sent raw: the server's answer is a permissions violation
        "delete-by-sequence": (f"$JS.API.STREAM.MSG.DELETE.{rq}", b'{"seq": 1}'),
        "consumer-update": (f"$JS.API.CONSUMER.CREATE.{rq}.{durable}",
                            b'{"stream_name": "RB_REQUESTS", "config": {"durable_name": "rb-workers-spot", '
                            b'"ack_policy": "explicit", "max_deliver": 1, "filter_subject": "rb.req.spot"}}'),
        "consumer-durable-update": (f"$JS.API.CONSUMER.DURABLE.CREATE.{rq}.{durable}",
                                    b'{"stream_name": "RB_REQUESTS", "config": {"durable_name": "rb-workers-spot", '
                                    b'"ack_policy": "explicit", "max_deliver": 1}}'),
        "consumer-delete": (f"$JS.API.CONSUMER.DELETE.{rq}.{durable}", b""),
        "other-pool-resume": (wire.resume_subject("reserved"), b"injected hand-off"),
        "control-put": (f"$KV.{wire.BUCKET_CONTROL}.{wire.CONTROL_ALL}", b"drain"),
        "weights-put": (f"$O.{wire.BUCKET_WEIGHTS}.M.x", b"{}"),
        "other-pool-env": (wire.env_subject("reserved"), b"injected episode"),
        "env-consumer": (f"$JS.API.CONSUMER.MSG.NEXT.{rq}.{wire.ENV_CONSUMER}", b'{"batch": 1}'),  # the env role's
    }
    if case in raw:
        subject, payload = raw[case]
        await nc.publish(subject, payload)
    elif case == "fresh-lane":
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
        try:  # nobody has published a version here: no pointer at all is the other right answer
            entry = await (await trainer.key_value(wire.BUCKET_POLICY)).get(wire.WEIGHTS_POINTER_KEY)
        except nats.js.errors.KeyNotFoundError:
            entry = None
        assert entry is None or entry.value != b"999"
    info = await trainer.consumer_info(rq, durable)  # the pool consumer is there, unchanged
    assert info.config.max_deliver == wire.ConsumerSpec().max_deliver


# ---------------------------------------------------------------- the env role (environment workers)


async def test_env_identity_does_its_job(trainer, worker, env_identity):
    """What workers/env_worker.py does on NATS, as the env identity: wait for the provisioned
    servers and join `rb-env` (reads only), take the episode a generation worker identity
    handed to its pool's environment lane, extend and ack it, publish environment token chunks,
    a lease event, a dead letter, an error result and the episode back to its pool's resume
    lane. No permission violation on either identity."""
    await trainer.purge_stream(wire.STREAM_REQUESTS)  # other tests' messages: this one's lane starts empty
    wnc, wjs, werrors = worker
    nc, js, errors = env_identity
    assert await bus.provision_or_wait(js)  # as open_clients(wait_provisioned=True): nothing to create
    spec = wire.ConsumerSpec()
    assert await bus.join_pool(js, wire.ENV_CONSUMER, spec, configs=[bus.env_consumer_config(spec)]) is not None
    rid = f"env-auth-{uuid.uuid4().hex[:8]}"
    await wjs.publish(wire.env_subject(POOL), b"episode", headers={wire.HDR_MSG_ID: wire.env_handoff_msg_id(rid, 1)})
    sub = await js.pull_subscribe_bind(durable=wire.ENV_CONSUMER, stream=wire.STREAM_REQUESTS)
    (msg,) = await sub.fetch(1, timeout=5)
    assert msg.data == b"episode" and wire.env_lane_pool(msg.subject) == POOL
    await msg.in_progress()  # a long tool call extends ack_wait
    for subject in (wire.token_subject(1, "env-w1"), wire.event_subject(1, rid), wire.dlq_subject(wire.STREAM_REQUESTS),
                    wire.result_subject(1)):
        assert (await js.publish(subject, b"x", timeout=5)).seq > 0, subject
    back = await js.publish(wire.resume_subject(POOL), msg.data, timeout=5,
                            headers={wire.HDR_MSG_ID: wire.env_return_msg_id(rid, 1, False)})
    await msg.ack()
    await nc.flush()
    await wnc.flush()
    assert not errors.refusals() and not werrors.refusals(), (errors.seen, werrors.seen)
    # the episode is on its pool's resume lane, for the generation workers; the env lane is empty
    got = await trainer.get_msg(wire.STREAM_REQUESTS, back.seq)
    assert got.subject == wire.resume_subject(POOL) and got.data == b"episode"
    assert (await trainer.consumer_info(wire.STREAM_REQUESTS, wire.ENV_CONSUMER)).num_pending == 0


async def test_env_identity_runs_the_checkpoint_scripts(secured):
    """An episode's tool phase in Redis: a generation worker (worker identity) records a model
    turn and lets go; the env identity claims it (inherit), renews, appends the tool's tokens
    and the state after them, releases; claims again and finishes (an `error` result's path).
    What it may not do: test_redis_refuses_rollout_identities."""
    _, st = secured
    admin = CheckpointStore(redis_url(st, "trainer", TRAINER_PW))
    assert await admin.load_scripts()
    gen = CheckpointStore(redis_url(st, "worker", WORKER_PW))
    env = CheckpointStore(redis_url(st, "env", ENV_PW))
    rid = f"env-acl-{uuid.uuid4().hex[:8]}"
    try:
        assert not await env.load_scripts()  # EVALSHA only: the trainer loads them
        c = await gen.claim(rid, "spot-gen", 0, ttl_s=10.0, weights="w0", episode=True)
        assert await gen.append(rid, "spot-gen", c.epoch, 0, [5, 6, 7], [-0.1] * 3, 10.0) == 3
        await gen.put_episode(rid, "spot-gen", c.epoch, wire.EpisodeState(turn=1, at=3), 10.0)
        assert await gen.release(rid, c.epoch)
        e = await env.claim(rid, "env-1", 0, ttl_s=10.0, episode=True, inherit=True)
        assert e.epoch > c.epoch and e.token_ids == [5, 6, 7] and e.episode.at == 3
        await env.renew(rid, "env-1", e.epoch, 10.0)
        assert await env.append_env(rid, "env-1", e.epoch, 3, [8, 9], wire.EpisodeState(turn=1, at=5), 10.0) == 5
        await env.put_episode(rid, "env-1", e.epoch, wire.EpisodeState(turn=1, at=5), 10.0)
        assert (await env.episode(rid)).at == 5
        assert await env.release(rid, e.epoch)
        again = await env.claim(rid, "env-1", 0, ttl_s=10.0, episode=True, inherit=True)
        await env.finish(rid, again.epoch, 5)
        assert (await admin.read(rid))[0] == [5, 6, 7, 8, 9]
    finally:
        for store in (admin, gen, env):
            await store.close()


ENV_FORBIDDEN = ["fresh-lane", "env-lane", "pool-consumer", "resume-consumer", "env-consumer-update",
                 "consumer-create", "consumer-delete", "delete-by-sequence", "delete-stream", "registry-put",
                 "policy-read", "policy-put", "control-put", "weights-read", "weights-put"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ENV_FORBIDDEN)
async def test_env_identity_is_refused(trainer, env_identity, case):
    """What an environment worker's credential may not do: inject prompts or episodes, serve the
    generation lanes, (re)configure or add consumers, delete streams or messages, heartbeat,
    read or move the policy pointer, read or write weights. Refused by the server, and nothing
    happened."""
    nc, js, errors = env_identity
    rq, env = wire.STREAM_REQUESTS, wire.ENV_CONSUMER
    update = (b'{"stream_name": "RB_REQUESTS", "config": {"durable_name": "rb-env", "ack_policy": "explicit", '
              b'"max_deliver": 1, "filter_subject": "rb.req.*.env"}}')
    raw = {  # sent raw where the call is a plain publish or a JetStream API request
        "env-lane": (wire.env_subject(POOL), b"injected episode"),
        "pool-consumer": (f"$JS.API.CONSUMER.MSG.NEXT.{rq}.{wire.consumer_name(POOL)}", b'{"batch": 1}'),
        "resume-consumer": (f"$JS.API.CONSUMER.MSG.NEXT.{rq}.{wire.resume_consumer_name(POOL)}", b'{"batch": 1}'),
        "env-consumer-update": (f"$JS.API.CONSUMER.CREATE.{rq}.{env}", update),
        "consumer-create": (f"$JS.API.CONSUMER.DURABLE.CREATE.{rq}.rb-env-shadow", update.replace(b'"rb-env"',
                                                                                                   b'"rb-env-shadow"')),
        "consumer-delete": (f"$JS.API.CONSUMER.DELETE.{rq}.{env}", b""),
        "delete-by-sequence": (f"$JS.API.STREAM.MSG.DELETE.{rq}", b'{"seq": 1}'),
        "policy-read": (f"$JS.API.DIRECT.GET.KV_{wire.BUCKET_POLICY}.$KV.{wire.BUCKET_POLICY}.{wire.WEIGHTS_POINTER_KEY}",
                        b""),
        "control-put": (f"$KV.{wire.BUCKET_CONTROL}.{wire.CONTROL_ALL}", b"drain"),
        "weights-put": (f"$O.{wire.BUCKET_WEIGHTS}.M.x", b"{}"),
    }
    before = (await trainer.stream_info(rq)).state.messages
    if case in raw:
        subject, payload = raw[case]
        await nc.publish(subject, payload)
    elif case == "fresh-lane":
        subject = wire.request_subject(POOL)
        with pytest.raises(Exception):
            await js.publish(subject, b"injected prompt", timeout=1)
    elif case == "delete-stream":
        subject = f"$JS.API.STREAM.DELETE.{wire.STREAM_TOKENS}"
        with pytest.raises(Exception):
            await js.delete_stream(wire.STREAM_TOKENS)
    elif case == "registry-put":  # no heartbeat: the trainer counts generation workers only
        subject = f"$KV.{wire.BUCKET_WORKERS}.env-1"
        kv = await js.key_value(wire.BUCKET_WORKERS)
        with pytest.raises(Exception):
            await kv.put("env-1", b"hb")
    elif case == "policy-put":
        subject = f"$KV.{wire.BUCKET_POLICY}.{wire.WEIGHTS_POINTER_KEY}"
        kv = await js.key_value(wire.BUCKET_POLICY)
        with pytest.raises(Exception):
            await kv.put(wire.WEIGHTS_POINTER_KEY, b"999")
    else:  # weights-read: the trainer put an object; the env identity cannot read it
        subject = f"$JS.API.STREAM.MSG.GET.OBJ_{wire.BUCKET_WEIGHTS}"
        await (await trainer.create_object_store(wire.BUCKET_WEIGHTS)).put("probe", b"weights")
        store = await js.object_store(wire.BUCKET_WEIGHTS)  # stream info: a look-up it may make
        with pytest.raises(Exception):
            await store.get("probe")
    await nc.flush()
    await errors.wait_for(subject)
    # and nothing happened: no message was added, the streams are there, the env consumer unchanged, alone
    assert (await trainer.stream_info(rq)).state.messages == before
    for name in (wire.STREAM_TOKENS, rq):
        assert (await trainer.stream_info(name)).config.name == name
    info = await trainer.consumer_info(rq, env)
    assert info.config.max_deliver == wire.ConsumerSpec().max_deliver and info.config.filter_subject == wire.ENV_FILTER
    assert "rb-env-shadow" not in {c.name for c in await trainer.consumers_info(rq)}
    if case == "policy-put":
        try:
            entry = await (await trainer.key_value(wire.BUCKET_POLICY)).get(wire.WEIGHTS_POINTER_KEY)
        except nats.js.errors.KeyNotFoundError:
            entry = None
        assert entry is None or entry.value != b"999"


def test_env_permissions_shape():
    perms = auth.env_permissions(["spot"])
    allow, deny = perms["publish"]["allow"], perms["publish"]["deny"]
    lanes = [s for s in allow if s.startswith("rb.req.")]
    assert lanes == ["rb.req.spot.resume"]  # its pools' resume lanes: no fresh lane, no environment lane
    assert {"rb.req.*", "rb.req.*.env", "$KV.>", "$O.>"} <= set(deny)
    rb_env = [s for s in allow if ".rb-env" in s]
    assert rb_env == ["$JS.API.CONSUMER.INFO.RB_REQUESTS.rb-env", "$JS.API.CONSUMER.MSG.NEXT.RB_REQUESTS.rb-env",
                      "$JS.ACK.RB_REQUESTS.rb-env.>"]
    reads = ("CONSUMER.CREATE", "DIRECT.GET", "MSG.GET", "$KV", "$O.")  # no consumer of its own, no KV/object read
    assert not [s for s in allow if any(r in s for r in reads)]
    # the worker's refusals are the env role's too
    assert set(auth.worker_permissions()["publish"]["deny"]) >= set(deny) - {"rb.req.*.env", "$KV.>", "$O.>"}
    conf = auth.render_nats_conf(ServicesSettings(auth=AuthSettings(env_password="p")))
    assert 'user: "env"' in conf and 'user: "worker"' not in conf  # a role is on with its password alone
    assert "user env on >p " in auth.render_redis_acl(AuthSettings(env_password="p"))


@pytest.mark.slow
async def test_episodes_run_on_the_environment_pool_under_their_identities(secured, trainer, tmp_path):
    """The environment pool end to end with per-role identities: a generation worker (worker
    identity, `env.inline = false`) hands every tool call to its pool's environment lane, an
    environment worker (env identity) runs them and sends each episode back, the trainer
    identity collects and verifies the results. Neither rollout identity meets a refusal."""
    import episode_env
    from helpers import step_results

    from rlboost.clients import open_clients
    from rlboost.config import EnvSettings, WorkerSettings
    from rlboost.envs import calculator
    from rlboost.pool_client import PoolClient
    from rlboost.workers.counters import Counters
    from rlboost.workers.engines.scripted import ScriptedEngine
    from rlboost.workers.env_worker import EnvWorker
    from rlboost.workers.worker import RolloutWorker

    _, st = secured
    await trainer.purge_stream(wire.STREAM_REQUESTS)
    step = 41
    rows = calculator.rows("train", 3, seed=41)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, max_turns=6, max_turn_tokens=64,
                                      run=f"envid{uuid.uuid4().hex[:6]}")
    werrors, eerrors = Errors(), Errors()
    env_settings = EnvSettings(ref=episode_env.ENV_REF, inline=False)
    # the pools' consumer settings as provisioned (the rollout identities may not reconfigure them)
    async with open_clients(nats_url(st, "worker", WORKER_PW), redis_url(st, "worker", WORKER_PW), "test-gen-id",
                            wait_provisioned=True, nats_options={"error_cb": werrors}) as wc, \
            open_clients(nats_url(st, "env", ENV_PW), redis_url(st, "env", ENV_PW), "test-env-id",
                         wait_provisioned=True, nats_options={"error_cb": eerrors}) as ec, \
            open_clients(nats_url(st, "trainer", TRAINER_PW), redis_url(st, "trainer", TRAINER_PW), "test-trainer-id",
                         pools=(POOL,)) as tc:
        gen = RolloutWorker(WorkerSettings(pool=POOL, slots=4, checkpoint_tokens=4, heartbeat_s=0.2),
                            ScriptedEngine(episode_env.tokenizer(), episode_env.solver(rows)), wc,
                            worker_id=f"{POOL}-gen-id", counters=Counters(), env=env_settings)
        env = EnvWorker(WorkerSettings(heartbeat_s=0.2), env_settings, ec, worker_id="env-id-1", counters=Counters(),
                        tokenizer=episode_env.tokenizer())
        tasks = [asyncio.create_task(gen.run()), asyncio.create_task(env.run())]
        try:
            manager = PoolClient(tc, POOL)
            await manager.publish_step(reqs)
            got = await step_results(tc.js, step, len(reqs), timeout=60)
        finally:
            gen.request_drain("test over")
            env.request_drain("test over")
            await asyncio.gather(*tasks, return_exceptions=True)
            await gen.settled()
        assert sorted(got) == sorted(r.request_id for r in reqs)
        by_id = {r.request_id: r for r in reqs}
        for r in got.values():
            assert await manager.verify_result(step, r, by_id[r.request_id]) == ""
            assert r.episode.calls and {c.worker_id for c in r.episode.calls} == {env.worker_id}
    tool_turns = sum(len(row["steps"]) for row in rows)
    assert env.counters.get("tool_calls") == tool_turns
    assert env.counters.get("sent_back") == gen.counters.get("to_env_pool") > 0
    assert not werrors.refusals() and not eerrors.refusals(), (werrors.seen, eerrors.seen)


async def test_wrong_password_is_a_clear_error(secured):
    _, st = secured
    with pytest.raises(ConnectionError) as e:
        await asyncio.wait_for(bus.connect(nats_url(st, "worker", "wrong")), timeout=10)
    text = str(e.value)
    assert "refused the credentials" in text and "authorization violation" in text.lower()
    assert "wrong" not in text  # the password is not echoed


async def test_redis_acl(secured):
    _, st = secured
    trainer_store = CheckpointStore(redis_url(st, "trainer", TRAINER_PW))
    assert await trainer_store.load_scripts()  # the trainer loads the scripts, workers EVALSHA them
    await trainer_store.close()
    store = CheckpointStore(redis_url(st, "worker", WORKER_PW))
    try:
        assert not await store.load_scripts()
        await store.ping()
        rid = "acl-test-1"
        c = await store.claim(rid, "w1", policy_version=0, ttl_s=10.0)
        assert c.epoch > 0
        assert await store.append(rid, "w1", c.epoch, 0, [5, 6], [-0.1, -0.2], 10.0) == 2
        # an episode's env tokens and state, with what the worker identity may run (schema 4)
        ep = await store.claim("acl-test-ep", "w1", policy_version=0, ttl_s=10.0, episode=True)
        await store.put_episode("acl-test-ep", "w1", ep.epoch, wire.EpisodeState(turn=1), 10.0)
        assert await store.append_env("acl-test-ep", "w1", ep.epoch, 0, [7], wire.EpisodeState(turn=1, at=1), 10.0) == 1
        assert (await store.claim("acl-test-ep", "w1", 0, ttl_s=10.0, episode=True)).episode.at == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            await store.redis.set("not-a-checkpoint", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await store.redis.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            await store.redis.config_get("*")
        # a Redis restart empties the script cache: the worker's calls fail (a RedisError, which
        # the worker answers by handing the request back) until the trainer loads them again
        admin = CheckpointStore(redis_url(st, "trainer", TRAINER_PW))
        await admin.redis.script_flush()
        with pytest.raises(redis.exceptions.RedisError):
            await store.claim("acl-test-2", "w1", policy_version=0, ttl_s=10.0)
        assert await admin.load_scripts()
        await admin.close()
        assert (await store.claim("acl-test-2", "w1", policy_version=0, ttl_s=10.0)).epoch > 0
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


@pytest.mark.parametrize("command", [
    ("SCRIPT", "FLUSH"), ("SCRIPT", "LOAD", "return 1"), ("EVAL", "return redis.call('DEL', KEYS[1])", 1, "rb:x"),
    ("SCAN", 0), ("RANDOMKEY",), ("KEYS", "*"), ("DEL", "{tok}"), ("UNLINK", "{tok}"), ("RENAME", "{tok}", "rb:y"),
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "proto-max-bulk-len", "1gb"), ("DEBUG", "SLEEP", 0),
    ("SET", "rb:{x}:tok", "64MiB"), ("SET", "not-a-checkpoint", "1"), ("OBJECT", "ENCODING", "{tok}"),
])
@pytest.mark.parametrize("who", ["worker", "env"])
async def test_redis_refuses_rollout_identities(secured, command, who):
    """What a stolen worker (or environment worker) credential may not do in Redis; the
    checkpoint it aimed at survives."""
    _, st = secured
    trainer_store = CheckpointStore(redis_url(st, "trainer", TRAINER_PW))
    await trainer_store.load_scripts()
    rid = f"probe-{uuid.uuid4().hex[:8]}"
    c = await trainer_store.claim(rid, "w1", policy_version=0, ttl_s=10.0)
    await trainer_store.append(rid, "w1", c.epoch, 0, [5, 6], [-0.1, -0.2], 10.0)
    worker = aioredis.from_url(redis_url(st, who, {"worker": WORKER_PW, "env": ENV_PW}[who]))
    args = [wire.ckpt_tokens_key(rid) if a == "{tok}" else b"x" * (64 << 20) if a == "64MiB" else a for a in command]
    try:
        with pytest.raises((redis.exceptions.NoPermissionError, redis.exceptions.ConnectionError,
                            redis.exceptions.ResponseError)) as e:
            await worker.execute_command(*args)
        assert "permission" in str(e.value).lower() or "bulk" in str(e.value).lower() or isinstance(
            e.value, redis.exceptions.ConnectionError), e.value
        assert (await trainer_store.read(rid))[0] == [5, 6]
        assert await trainer_store.redis.script_exists(trainer_store._append_many.sha) == [True]
    finally:
        await worker.aclose()
        await trainer_store.close()


def test_worker_permissions_shape():
    perms = auth.worker_permissions(["spot"])
    allow, deny = perms["publish"]["allow"], perms["publish"]["deny"]
    assert "rb.req.spot.resume" in allow and "rb.req.spot" not in allow and "rb.req.*" in deny
    assert not [s for s in allow if s.startswith(("$JS.API.STREAM.DELETE", "$JS.API.STREAM.UPDATE", "$KV.rb-policy"))]
    assert perms["subscribe"]["allow"][0] == "_INBOX.>"
    assert "rb.req.spot.env" in allow and "rb.req.*.env" in auth.worker_permissions()["publish"]["allow"]
    # `*` covers every consumer of the requests stream: the environment lane's is denied by name
    assert "$JS.API.CONSUMER.MSG.NEXT.RB_REQUESTS.*" in auth.worker_permissions()["publish"]["allow"]
    assert "$JS.API.CONSUMER.MSG.NEXT.RB_REQUESTS.rb-env" in auth.worker_permissions()["publish"]["deny"]
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


# ---------------------------------------------------------------- issue 30: what a worker credential can still do


async def _wait_for_line(path: Path, text: str, proc, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = path.read_text(errors="replace")
        if text in log:
            return log
        assert proc.poll() is None, f"the worker exited ({proc.returncode}):\n{log[-3000:]}"
        await asyncio.sleep(0.1)
    raise AssertionError(f"no {text!r} in the worker's log:\n{path.read_text(errors='replace')[-3000:]}")


@pytest.mark.slow
async def test_a_worker_with_other_settings_waits_for_and_serves_its_pool(secured, trainer, tmp_path):
    """`rlboost worker --ack-wait 3` under the worker identity, started before the trainer has
    provisioned the streams and its pool: it waits (one log line each), then serves with the consumer the trainer
    provisioned (the default ack_wait) and says once that its own setting differs (main: it
    tried to create/reconfigure the consumer, which it may not, and died on `nats: timeout`)."""
    import subprocess
    import sys

    from rlboost.clients import open_clients
    from rlboost.pool_client import PoolClient

    _, st = secured
    for durable in (wire.consumer_name(POOL), wire.resume_consumer_name(POOL)):  # the pool is not provisioned yet
        await trainer.delete_consumer(wire.STREAM_REQUESTS, durable)
    await trainer.delete_stream(wire.STREAM_DLQ)  # nor all of the streams
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url(st, "worker", WORKER_PW),
           "RLBOOST_REDIS_URL": redis_url(st, "worker", WORKER_PW), "OMP_NUM_THREADS": "1"}
    path = tmp_path / "worker.log"
    with open(path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlboost.cli", "worker", "--pool", POOL, "--speed", "0",
                                 "--ack-wait", "3", "--lease-ttl", "2", "--worker-id", "spot-late-1"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        await _wait_for_line(path, "waiting for the trainer to provision the streams", proc)
        await bus.provision(trainer)  # the streams and buckets, not yet the pool
        await _wait_for_line(path, "waiting for the trainer to provision this pool", proc)
        async with open_clients(nats_url(st, "trainer", TRAINER_PW), redis_url(st, "trainer", TRAINER_PW),
                                "test-trainer-late", pools=(POOL,)) as c:  # the default ack_wait (10 s)
            reqs = [wire.RolloutRequest(request_id=wire.request_id(31, i, 0, run="late"), step=31, policy_version=0,
                                        prompt_ids=[3, 4], max_new_tokens=8, seed=i, group=i) for i in range(4)]
            manager = PoolClient(c, POOL)
            await manager.publish_step(reqs)
            got = [r async for r in manager.results(31, reqs, timeout_s=60)]
        assert sorted(r.request_id for r in got) == sorted(q.request_id for q in reqs)
        assert {r.worker_id for r in got} == {"spot-late-1"}
        assert proc.poll() is None, "the worker exited"
        info = await trainer.consumer_info(wire.STREAM_REQUESTS, wire.consumer_name(POOL))
        assert info.config.ack_wait == wire.ConsumerSpec().ack_wait_s  # the trainer's setting stands
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = path.read_text(errors="replace")
    assert log.count("differ from its pool's consumer") == 1 and "ack_wait_s: pool 10.0, worker 3.0" in log, log[-3000:]
    assert log.count("waiting for the trainer to provision the streams") == 1, log[-3000:]
    assert log.count("waiting for the trainer to provision this pool") == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.slow
async def test_an_env_worker_process_with_the_env_identity_serves_metrics_and_drains(secured, trainer, tmp_path):
    """`rlboost env-worker` as compose/k8s start it: the env identity from RLBOOST_SERVICES__*,
    plain URLs, a metrics port. It joins `rb-env` with no refusal, serves /metrics (the health
    check and readiness probe) and leaves on SIGTERM (a preemption notice) with exit 0."""
    import signal
    import subprocess
    import sys
    import urllib.request

    from rlboost.services import free_port

    _, st = secured
    port = free_port()
    env = {**os.environ, "RLBOOST_NATS_URL": f"nats://127.0.0.1:{st.nats_port}",
           "RLBOOST_REDIS_URL": f"redis://127.0.0.1:{st.redis_port}/0",
           "RLBOOST_SERVICES__NATS_USER": "env", "RLBOOST_SERVICES__NATS_PASSWORD": ENV_PW,
           "RLBOOST_SERVICES__REDIS_USER": "env", "RLBOOST_SERVICES__REDIS_PASSWORD": ENV_PW,
           "RLBOOST_METRICS__PORT": str(port), "OMP_NUM_THREADS": "1"}
    from rlboost.envs.calculator import ALPHABET
    from rlboost.trainer.model import build_tokenizer

    build_tokenizer(ALPHABET).save_pretrained(tmp_path / "model")  # its chat format: the model's tokenizer
    path = tmp_path / "env-worker.log"
    with open(path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlboost.cli", "env-worker", "--worker-id", "env-proc-1",
                                 "--model-dir", str(tmp_path / "model")],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        await _wait_for_line(path, "environment worker started", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert r.status == 200 and b"process_cpu_seconds_total" in r.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = path.read_text(errors="replace")
    assert "environment worker stopped" in log and "ermission" not in log and "Traceback" not in log, log[-3000:]


async def test_a_forged_result_cannot_pre_empt_the_genuine_one(secured, trainer):
    """A client with the worker credential watches Redis and, as each request is finished,
    publishes a result first with the genuine tokens, lease and tokens' digest but false
    provenance (other weights) or a false finish reason. The genuine result still counts, at
    once (main: the forgery took the genuine result's message id, the stream dropped the
    genuine one as a duplicate and the manager handed the forgery to the trainer, whose weights
    check then failed the step)."""
    import time

    import msgspec

    from rlboost.clients import open_clients
    from rlboost.pool_client import PoolClient
    from rlboost.weights.ledger import check_weights

    _, st = secured
    step, weights = 32, "emulated-v0"
    reqs = [wire.RolloutRequest(request_id=wire.request_id(step, i, 0, run=f"forge{uuid.uuid4().hex[:6]}"), step=step,
                                policy_version=0, prompt_ids=[3, 4], max_new_tokens=4, seed=i, group=i)
            for i in range(2)]
    wnc = await bus.connect(nats_url(st, "worker", WORKER_PW), name="test-forger")
    wjs = wnc.jetstream()
    store = CheckpointStore(redis_url(st, "worker", WORKER_PW))
    try:
        async with open_clients(nats_url(st, "trainer", TRAINER_PW), redis_url(st, "trainer", TRAINER_PW),
                                "test-trainer-forge", pools=(POOL,)) as c:
            manager = PoolClient(c, POOL)
            await manager.publish_step(reqs)
            genuine = {}
            for i, q in enumerate(reqs):  # what a worker does: claim, append, finish, then publish
                claim = await store.claim(q.request_id, "spot-honest", 0, ttl_s=10, weights=weights)
                await store.append(q.request_id, "spot-honest", claim.epoch, 0, [7, 8, 9, 5], [-0.5] * 4, 10.0)
                (segments,) = await store.finish_many([(q.request_id, claim.epoch, 4)])
                genuine[q.request_id] = wire.RolloutResult(
                    request_id=q.request_id, step=step, group=q.group, prompt_ids=[3, 4], token_ids=[7, 8, 9, 5],
                    logprobs=[-0.5] * 4, segments=segments, finish_reason="length", worker_id="spot-honest",
                    ts=time.time(), epoch=claim.epoch)
                # the forger: finished in Redis, so it reads the tokens and the lease and goes first
                tokens, logprobs = await store.read(q.request_id)
                owner, epoch, _ = await store.owner(q.request_id)
                forged = msgspec.structs.replace(genuine[q.request_id], token_ids=tokens, logprobs=logprobs,
                                                 worker_id=owner, epoch=epoch)
                forged = (msgspec.structs.replace(forged, segments=[msgspec.structs.replace(s, weights="evil-v0")
                                                                    for s in segments]) if i == 0
                          else msgspec.structs.replace(forged, finish_reason="stop"))
                await wjs.publish(wire.result_subject(step), wire.encode(forged),
                                  headers={wire.HDR_MSG_ID: wire.result_msg_id(forged)})
            for r in genuine.values():
                await wjs.publish(wire.result_subject(step), wire.encode(r), headers={wire.HDR_MSG_ID: wire.result_msg_id(r)})
            t0 = time.monotonic()
            got = {r.request_id: r async for r in manager.results(step, reqs, timeout_s=20)}
            assert time.monotonic() - t0 < 10
        assert got == genuine
        for r in got.values():
            check_weights(r, 0, weights)  # what the trainer checks: it would not have failed the step
    finally:
        await store.close()
        await wnc.close()


async def test_phantom_workers_are_not_counted(secured, worker):
    """With the worker credential: an entry stamped a day ahead and one filed under another
    worker's id. Neither counts as a live worker (main: the first counted for a day, the second
    doubled a worker), each is counted and logged once; a genuine heartbeat counts."""
    from rlboost.clients import open_clients
    from rlboost.pool_client import PoolClient

    _, st = secured
    _, js, _ = worker
    tag = uuid.uuid4().hex[:6]
    real, phantom = f"spot-real-{tag}", f"spot-phantom-{tag}"

    def heartbeat(worker_id: str, ts: float) -> bytes:
        return wire.encode(wire.WorkerHeartbeat(worker_id=worker_id, pool=POOL, engine="emulated", pid=1, host="h",
                                                state="running", policy_version=0, inflight=0, slots=8,
                                                tokens_generated=0, ts=ts))

    kv = await js.key_value(wire.BUCKET_WORKERS)
    await kv.put(phantom, heartbeat(phantom, time.time() + 86400))
    await kv.put(f"spot-alias-{tag}", heartbeat(real, time.time()))
    await kv.put(real, heartbeat(real, time.time()))
    async with open_clients(nats_url(st, "trainer", TRAINER_PW), redis_url(st, "trainer", TRAINER_PW),
                            "test-trainer-registry") as c:
        manager = PoolClient(c, POOL)
        for _ in range(3):  # sampled every 0.25 s in a step: each entry is reported once
            live = [hb.worker_id for hb in await manager.live_workers()]
            assert live.count(real) == 1 and phantom not in live, live
    ignored = {key for key, _ in manager._ignored_seen}
    assert {phantom, f"spot-alias-{tag}"} <= ignored
    assert manager.ignored["heartbeat time disagrees with the server's"] >= 1
    assert manager.ignored["filed under another worker id"] >= 1
    assert sum(manager.ignored.values()) == len(manager._ignored_seen)
    from rlboost.status import gather_status  # `rlboost status`: ages by the server's clock, no aliases

    shown = [w for w in (await gather_status(nats_url(st, "trainer", TRAINER_PW)))["workers"] if tag in w["worker_id"]]
    assert sorted(w["worker_id"] for w in shown) == [phantom, real]
    assert all(0 <= w["age_s"] < 60 for w in shown), shown
