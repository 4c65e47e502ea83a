"""The rollout worker against real NATS and Redis: exactly one correct result per request."""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec
import pytest
from helpers import step_results

import torch

from rlboost.weights import FileBlobStore, WeightCache, WeightPublisher
from rlboost.weights.source import StoreWeights, WeightSource
from rlboost import bus, wire
from rlboost.clients import open_clients
from rlboost.config import WorkerSettings
from rlboost.pool_client import PoolClient
from rlboost.benchmarks.chaos import chaos
from rlboost.workers.counters import Counters
from rlboost.workers.engines.emulated import EmulatedEngine, LengthModel, reference_tokens
from rlboost.workers.worker import RolloutWorker


def _req(step: int, i: int, version: int = 0, max_new: int = 40) -> wire.RolloutRequest:
    return wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step, policy_version=version,
                               prompt_ids=[5, 6, 7], max_new_tokens=max_new, seed=11, group=i)


@pytest.fixture
async def clients(nats_url, redis_url, js):
    async with open_clients(nats_url, redis_url, "test-worker") as c:
        yield c


async def _counted(w: RolloutWorker, counter: str, n: int, timeout: float = 10.0) -> None:
    """Until the worker's `counter` reaches `n` (a state, not a sleep), or `timeout`."""
    deadline = time.monotonic() + timeout
    while w.counters.get(counter) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def _worker(clients, pool: str, speed: float = 0.0, name: str = "w", **engine) -> RolloutWorker:
    settings = WorkerSettings(pool=pool, slots=8, ack_wait_s=3.0, lease_ttl_s=2.0, heartbeat_s=0.2)
    return RolloutWorker(settings, EmulatedEngine(speed=speed, **engine), clients, worker_id=f"{pool}-{name}",
                         counters=Counters())


async def test_malformed_requests_are_dead_lettered_and_the_worker_keeps_serving(clients):
    js, step = clients.js, 101
    w = _worker(clients, "bad")
    task = asyncio.create_task(w.run())
    await js.publish(wire.request_subject("bad"), b"\xff\x00garbage")
    await js.publish(wire.request_subject("bad"), msgspec.msgpack.encode({"v": 42}))
    for i in range(5):
        await js.publish(wire.request_subject("bad"), wire.encode(_req(step, i)))
    got = await step_results(js, step, 5)
    w.request_drain("test over")
    await task
    assert len(got) == 5
    assert (await js.stream_info(wire.STREAM_DLQ)).state.messages == 2
    assert w.counters.get("dead_lettered") == 2


async def test_results_match_the_uninterrupted_reference(clients):
    js, step = clients.js, 102
    w = _worker(clients, "ref")
    task = asyncio.create_task(w.run())
    reqs = [_req(step, i, max_new=20 + 7 * i) for i in range(12)]
    for r in reqs:
        await js.publish(wire.request_subject("ref"), wire.encode(r))
    got = await step_results(js, step, len(reqs))
    w.request_drain("test over")
    await task
    lengths = LengthModel()
    for r in reqs:
        n = min(r.max_new_tokens, lengths.length(r.seed, r.request_id))
        assert got[r.request_id].token_ids == reference_tokens(r.seed, r.request_id, 0, n)[0]
        assert got[r.request_id].finish_reason == ("length" if n == r.max_new_tokens else "stop")


async def test_a_flush_is_one_token_message_and_each_request_is_rebuilt_from_them(clients):
    """Schema 3: the chunks of every request of a flush travel as one TokenFlush; replay and
    collection rebuild each request's tokens from them exactly."""
    from rlboost.replay import read_chunks, read_subject

    js, step = clients.js, 108
    w = _worker(clients, "flush", lengths=LengthModel(median=1e9))
    task = asyncio.create_task(w.run())
    reqs = [_req(step, i, max_new=400) for i in range(8)]
    await PoolClient(clients, "flush").publish_step(reqs)
    got = await step_results(js, step, len(reqs))
    w.request_drain("test over")
    await task
    flushes = await read_subject(js, wire.token_steps_subject(step), wire.TokenFlush)
    chunks = await read_chunks(js, step)
    assert len(chunks) == sum(len(f.chunks) for f in flushes) >= 8 * 400 // w.cfg.checkpoint_tokens
    assert 2 * len(flushes) <= len(chunks)  # before: one message per chunk
    for r in reqs:
        mine = sorted((c for c in chunks if c.request_id == r.request_id), key=lambda c: c.offset)
        assert [t for c in mine for t in c.token_ids] == got[r.request_id].token_ids
        assert [p for c in mine for p in c.logprobs] == got[r.request_id].logprobs
        assert [c.offset for c in mine] == [sum(len(c.token_ids) for c in mine[:i]) for i in range(len(mine))]


async def test_drain_hands_every_request_back_with_nothing_to_regenerate(clients):
    js, step = clients.js, 103
    slow = _worker(clients, "drain", speed=2.0, name="slow", lengths=LengthModel(median=1e9))
    task = asyncio.create_task(slow.run())
    for i in range(6):
        await js.publish(wire.request_subject("drain"), wire.encode(_req(step, i, max_new=2000)))
    for _ in range(100):
        if slow.counters.get("checkpointed") >= 6 * 16:
            break
        await asyncio.sleep(0.05)
    kv = await js.key_value(wire.BUCKET_CONTROL)
    await kv.put(slow.worker_id, wire.encode(wire.control("drain", slow.worker_id, "spot notice")))
    await asyncio.wait_for(task, timeout=5.0)
    c = slow.counters.snapshot()
    assert c["handed_off"] == 6 and c["results"] == 0
    assert c["generated"] == c["checkpointed"]  # every token made before the notice is durable
    info = await js.consumer_info(wire.STREAM_REQUESTS, wire.resume_consumer_name("drain"))
    assert info.num_pending == 6  # waiting on the resume lane for the next worker
    fast = _worker(clients, "drain", name="fast", lengths=LengthModel(median=1e9))
    task2 = asyncio.create_task(fast.run())
    got = await step_results(js, step, 6)
    fast.request_drain("test over")
    await task2
    assert len(got) == 6
    assert all(r.segments[0].worker_id == slow.worker_id and r.segments[1].offset > 0 for r in got.values())


def wrap_fresh_lane(js, monkeypatch, pool: str, wrap) -> list:
    """Workers of `pool` that start from now on get `wrap(psub)` for their fresh lane's real
    pull subscription; returns the wrappers, in order (undo with `monkeypatch.undo()`)."""
    bind, pulls = js.pull_subscribe_bind, []

    async def wrapped_bind(*args, **kw):
        psub = await bind(*args, **kw)
        if kw.get("durable") == wire.consumer_name(pool):
            pulls.append(wrap(psub))
            return pulls[-1]
        return psub

    monkeypatch.setattr(js, "pull_subscribe_bind", wrapped_bind)
    return pulls


class HeldPull:
    """A worker's real pull subscription whose fetch, once the server delivered requests to it,
    returns them only after the worker started draining: a notice landing while a fetch holds
    delivered requests (in a live worker: the fetch's wake-up overtaken by the drain, or a
    lingering batch pull still waiting for the rest of its batch)."""

    def __init__(self, psub, worker: RolloutWorker) -> None:
        self.psub, self.worker, self.held = psub, worker, asyncio.Event()

    async def fetch(self, batch: int, timeout: float):
        msgs = await self.psub.fetch(batch=batch, timeout=timeout)
        self.held.set()
        await self.worker.draining.wait()
        await asyncio.sleep(0.2)  # the worker gets on with its drain meanwhile (and cancelled it)
        return msgs

    def __getattr__(self, name):
        return getattr(self.psub, name)


async def test_a_drain_leaves_nothing_its_last_pull_brought_waiting_for_ack_wait(clients, monkeypatch):
    """Requests the server delivered to a worker's fetch as its notice came go back to the pool
    at once (cancelling the fetch left them neither admitted nor nak'ed: they waited out
    ack_wait), and the next worker takes them long before ack_wait."""
    js, step, pool, ack_wait = clients.js, 112, "lastpull", 30.0
    first = _worker(clients, pool, name="first")
    first.cfg.ack_wait_s = ack_wait
    pulls = wrap_fresh_lane(js, monkeypatch, pool, lambda psub: HeldPull(psub, first))
    task = asyncio.create_task(first.run())
    try:
        for i in range(3):
            await js.publish(wire.request_subject(pool), wire.encode(_req(step, i)))
        deadline = time.monotonic() + 10
        while not (pulls and pulls[0].held.is_set()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # its fetch got requests (by state)
        assert pulls and pulls[0].held.is_set()
        monkeypatch.undo()
    finally:
        first.request_drain("spot notice")
        await asyncio.wait_for(task, timeout=5.0)
    assert first.counters.get("claims") == 0
    t0 = time.monotonic()
    second = _worker(clients, pool, name="second")
    second.cfg.ack_wait_s = ack_wait  # (a worker sets its pool consumer's ack_wait)
    task = asyncio.create_task(second.run())
    got = await step_results(js, step, 3, timeout=ack_wait / 3)
    second.request_drain("test over")
    await task
    assert len(got) == 3 and time.monotonic() - t0 < ack_wait / 3  # long before ack_wait
    assert all([s.worker_id for s in r.segments] == [second.worker_id] for r in got.values())


class OverDelivered:
    """A worker's real pull subscription to which the server delivers 3 more requests than its
    first fetch took, after that fetch returned: what nats-py's `fetch(n)` leaves in the
    subscription when its timeout cuts a batch short (the rest is for the next fetch). The
    extra pull is the one nats-py's fetch sends, to the same inbox."""

    def __init__(self, psub) -> None:
        self.psub, self.delivered = psub, asyncio.Event()

    async def fetch(self, batch: int, timeout: float):
        msgs = await self.psub.fetch(batch=batch, timeout=timeout)
        if not self.delivered.is_set():
            await self.psub._nc.publish(self.psub._nms, b'{"batch": 3, "no_wait": true}', self.psub._deliver)
            self.delivered.set()
        return msgs

    def __getattr__(self, name):
        return getattr(self.psub, name)


async def test_requests_delivered_to_a_worker_at_capacity_go_back_at_its_drain(clients, monkeypatch):
    """A worker at capacity makes no next fetch, so what the server delivered to its
    subscription beyond the last fetch waits there. At its drain (a seeding engine's hand-off,
    a notice) those requests go back to the pool at once: the next worker takes them long
    before ack_wait (they used to sit it out unclaimed: a 10 s stall of a whole step)."""
    js, step, pool, ack_wait = clients.js, 113, "overdelivered", 30.0
    first = _worker(clients, pool, speed=2.0, name="first")  # 40 tokens take 20 s: stays busy
    first.cfg.ack_wait_s, first.cfg.slots = ack_wait, 2
    pulls = wrap_fresh_lane(js, monkeypatch, pool, OverDelivered)
    task = asyncio.create_task(first.run())
    try:
        for i in range(5):
            await js.publish(wire.request_subject(pool), wire.encode(_req(step, i)))
        deadline = time.monotonic() + 10
        while not (first.counters.get("claims") == 2 and pulls and pulls[0].delivered.is_set()
                   and pulls[0].pending_msgs >= 3) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert first.counters.get("claims") == 2 and pulls[0].pending_msgs >= 3  # at capacity, 3 waiting
        monkeypatch.undo()
    finally:
        first.request_drain("spot notice")
        await asyncio.wait_for(task, timeout=5.0)
    t0 = time.monotonic()
    second = _worker(clients, pool, name="second")
    second.cfg.ack_wait_s = ack_wait
    task = asyncio.create_task(second.run())
    got = await step_results(js, step, 5, timeout=ack_wait / 3)
    second.request_drain("test over")
    await task
    assert len(got) == 5 and time.monotonic() - t0 < ack_wait / 3  # long before ack_wait
    assert first.counters.get("claims") == 2  # the 3 were never its own


async def test_a_request_is_never_generated_with_another_policy_version(clients):
    """A worker that cannot load the version a request needs hands the request back."""
    js, step = clients.js, 104

    class Unreachable(WeightSource):
        async def path(self, version: int):
            raise ConnectionError("weight store unreachable")

        def weights_id(self, path, version: int) -> str:
            raise AssertionError("never loaded")

    no_weights = Unreachable()

    settings = WorkerSettings(pool="ver", slots=4, ack_wait_s=3.0, lease_ttl_s=2.0)
    engine = EmulatedEngine(speed=0)
    w = RolloutWorker(settings, engine, clients, worker_id="ver-w", counters=Counters(), weights=no_weights)
    task = asyncio.create_task(w.run())
    await js.publish(wire.request_subject("ver"), wire.encode(_req(step, 0, version=3)))
    await asyncio.sleep(1.5)
    assert w.counters.get("claims") == 0 and engine.policy_version == 0
    assert await step_results(js, step, 1, timeout=0.5) == {}
    w.request_drain("test over")
    await task


async def test_a_request_naming_a_garbage_collected_version_is_dead_lettered_at_once(clients, tmp_path):
    """A request left in the queue by a killed run names a version the store dropped since (a
    newer one is there): no wait brings it. Before, each delivery waited 5 s for the weights,
    20 deliveries per request, while the live run's requests queued behind them."""
    js, step, pool = clients.js, 116, "gone"
    store = FileBlobStore(tmp_path / "store", create=True)
    await WeightPublisher(store, None).publish({"w": torch.ones(4)}, 7)
    weights = StoreWeights(WeightCache(tmp_path / "cache", store), wait_s=60.0)
    w = RolloutWorker(WorkerSettings(pool=pool, slots=4, ack_wait_s=3.0, lease_ttl_s=2.0), EmulatedEngine(speed=0),
                      clients, worker_id="gone-w", counters=Counters(), weights=weights)
    task = asyncio.create_task(w.run())
    dlq_before = (await js.stream_info(wire.STREAM_DLQ)).state.messages
    await js.publish(wire.request_subject(pool), wire.encode(_req(step, 0, version=3)))  # the dead run's
    await js.publish(wire.request_subject(pool), wire.encode(_req(step, 1, version=7)))  # the live run's
    got = await step_results(js, step, 1, timeout=20)
    w.request_drain("test over")
    await task
    assert [r.segments[0].policy_version for r in got.values()] == [7]
    assert w.counters.get("dead_lettered") == 1
    assert (await js.stream_info(wire.STREAM_DLQ)).state.messages == dlq_before + 1
    info = await js.consumer_info(wire.STREAM_REQUESTS, wire.consumer_name(pool))
    assert info.delivered.consumer_seq == 2 and info.num_pending == 0 and info.num_ack_pending == 0


@pytest.mark.slow
async def test_a_request_of_the_next_version_is_handed_back_once_not_every_half_second(clients):
    """An async run's request published a step ahead meets a worker still generating the
    previous version: handed back, after which the worker fetches nothing until its engine can
    switch (or for ack_wait), then takes it. It used to be fetched and handed back every 0.5 s through the
    whole tail, each time one more delivery: on GPUs (minutes of tail) past max_deliver, into
    the dead-letter queue."""
    js, step, pool = clients.js, 115, "nextver"
    w = _worker(clients, pool, speed=0.5, lengths=LengthModel(median=1e9))  # 400 tokens: ~5 s
    task = asyncio.create_task(w.run())
    await js.publish(wire.request_subject(pool), wire.encode(_req(step, 0, version=0, max_new=400)))
    await _counted(w, "claims", 1)
    await js.publish(wire.request_subject(pool), wire.encode(_req(step, 1, version=1)))
    got = await step_results(js, step, 2, timeout=15)
    w.request_drain("test over")
    await task
    assert sorted(r.segments[0].policy_version for r in got.values()) == [0, 1]
    info = await js.consumer_info(wire.STREAM_REQUESTS, wire.consumer_name(pool))
    # the first once; the second handed back at most once per ack_wait (3 s) of the ~5 s tail,
    # then taken: 4 deliveries at most (before: one every 0.5 s, 12 in all)
    assert info.delivered.consumer_seq <= 4


@pytest.mark.slow
def test_chaos_with_real_processes_loses_duplicates_and_corrupts_nothing(services, tmp_path):
    """SIGKILL, SIGTERM, SIGSTOP/SIGCONT and restarts of real worker processes."""
    nats_url, redis_url = services
    a = argparse.Namespace(requests=150, workers=3, slots=8, k=16, speed=2.0, min_new=48, max_new=400,
                           every=1.2, chaos_until=0.85, min_actions=3, ack_wait=2.0, timeout=150.0, seed=7)
    out = asyncio.run(chaos(a, nats_url, redis_url, tmp_path))
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["mismatched"] == 0
    assert out["history_violations"] == 0 and out["history_ops"] > 0, out  # benchmarks/history.py
    assert out["kills"] >= 1 and out["terms"] >= 1 and out["stops"] >= 1
    assert out["regenerated_tokens_term"] == 0
    assert out["regenerated_tokens_kill"] <= a.k * out["killed_inflight"]


async def test_replay_tells_the_life_of_a_handed_off_request(clients):
    from rlboost.replay import life_of, migrations

    js, step = clients.js, 105
    slow = _worker(clients, "replay", speed=2.0, name="first", lengths=LengthModel(median=1e9))
    task = asyncio.create_task(slow.run())
    await PoolClient(clients, "replay").publish_step([_req(step, 0, max_new=300)])
    while slow.counters.get("checkpointed") < 32:
        await asyncio.sleep(0.02)
    slow.request_drain("SIGTERM")
    await task
    fast = _worker(clients, "replay", name="second", lengths=LengthModel(median=1e9))
    task = asyncio.create_task(fast.run())
    await step_results(js, step, 1)
    fast.request_drain("test over")
    await task
    life = await life_of(js, step, wire.request_id(step, 0, 0))
    assert [e.kind for e in life.events] == ["publish", "claim", "release", "claim", "finish"]
    by_worker = life.tokens_by_worker()
    assert set(by_worker) == {"replay-first", "replay-second"} and sum(by_worker.values()) == 300
    assert life.handoffs() == 1 and len(life.result.token_ids) == 300
    [(left, claimed)] = migrations(life.events)
    assert (left.kind, left.worker_id, claimed.worker_id) == ("release", "replay-first", "replay-second")
    assert claimed.offset == left.offset  # resumed exactly where it was handed off


async def test_metrics_endpoint_reports_a_serving_worker(clients):
    import urllib.request

    from rlboost import metrics

    js, step = clients.js, 106
    port = metrics.start_metrics_server(0)
    w = _worker(clients, "metered", name="m")
    w.cfg.heartbeat_s = 0.1
    task = asyncio.create_task(w.run())
    for i in range(6):
        await js.publish(wire.request_subject("metered"), wire.encode(_req(step, i, max_new=64)))
    await step_results(js, step, 6)
    await asyncio.sleep(0.3)  # one more heartbeat exports the counters
    w.request_drain("test over")
    await task
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['rlboost_worker_results_total{pool="metered"}'] == 6
    generated = values['rlboost_worker_tokens_generated_total{engine="emulated",pool="metered"}']
    assert generated == values['rlboost_worker_tokens_checkpointed_total{pool="metered"}'] > 0
    assert values['rlboost_worker_slots{pool="metered"}'] == 8


async def test_a_finished_checkpoint_whose_message_returns_is_republished_not_redone(clients):
    """The finisher died between marking the checkpoint finished and publishing the result."""
    js, step = clients.js, 107
    req = _req(step, 0, max_new=5)
    claim = await clients.store.claim(req.request_id, "dead-worker", 0, ttl_s=5)
    await clients.store.append(req.request_id, "dead-worker", claim.epoch, 0, [9, 8, 7, 6, 5], [-0.5] * 5, ttl_s=5)
    await clients.store.finish(req.request_id, claim.epoch, 5)
    w = _worker(clients, "refinish", name="w")
    task = asyncio.create_task(w.run())
    await js.publish(wire.request_subject("refinish"), wire.encode(req))
    got = await step_results(js, step, 1)
    w.request_drain("test over")
    await task
    r = got[req.request_id]
    assert r.token_ids == [9, 8, 7, 6, 5] and r.logprobs == [-0.5] * 5
    assert r.segments[0].worker_id == "dead-worker"
    assert w.counters.get("generated") == 0 and w.counters.get("claims") == 0
    assert (await js.consumer_info(wire.STREAM_REQUESTS, wire.consumer_name("refinish"))).num_ack_pending == 0


async def test_a_seeding_engine_hands_its_whole_share_off_on_sigusr2_and_serves_on(clients, nats_url, redis_url,
                                                                                  tmp_path):
    """The reserved cluster's seeding engine: its own queue, hand-offs to the preemptible pool.
    SIGUSR2 ends the seeding window: started requests go to the pool's resume lane from their
    checkpoints, queued ones are forwarded unstarted, and the same process serves the next step."""
    import signal

    from rlboost.workers.fleet import WorkerFleet

    js, step = clients.js, 109
    await bus.ensure_pool_consumer(js, "spot", wire.ConsumerSpec(ack_wait_s=3.0, max_deliver=20))
    fleet = WorkerFleet(nats_url, redis_url, tmp_path, "seed", worker_args=[
        "--engine", "emulated", "--speed", "2", "--slots", "4", "--handoff-pool", "spot",
        "--ack-wait", "3", "--lease-ttl", "2"], env={"RLBOOST_WORKER__HEARTBEAT_S": "0.2"})
    seeder = fleet.start(prefix="seed")
    try:
        share = [_req(step, i, max_new=5000) for i in range(10)]
        for r in share:
            await js.publish(wire.request_subject("seed"), wire.encode(r))
        deadline = time.monotonic() + 30
        while seeder.counters()["checkpointed"] < 4 * 16 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        seeder.proc.send_signal(signal.SIGUSR2)
        while seeder.counters()["handoff_rounds"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        c = seeder.counters()
        assert c["handoff_rounds"] == 1 and c["handed_off"] == 10 and c["results"] == 0
        assert seeder.proc.poll() is None  # it serves on
        info = await js.consumer_info(wire.STREAM_REQUESTS, wire.resume_consumer_name("spot"))
        assert info.num_pending == 10  # the whole share waits on the preemptible pool's resume lane

        nxt = [_req(step + 1, i) for i in range(2)]  # the next step's share: the same process
        for r in nxt:
            await js.publish(wire.request_subject("seed"), wire.encode(r))
        got_next = await step_results(js, step + 1, 2)
        assert {r.segments[0].worker_id for r in got_next.values()} == {seeder.worker_id}

        spot = _worker(clients, "spot", name="spot")
        task = asyncio.create_task(spot.run())
        got = await step_results(js, step, 10)
        spot.request_drain("test over")
        await task
    finally:
        fleet.stop_all()
    assert set(got) == {r.request_id for r in share}
    started = [r for r in got.values() if r.segments[0].worker_id == seeder.worker_id]
    assert len(started) == 4 and all(r.segments[1].offset > 0 for r in started)  # resumed, not redone
    n = min(5000, LengthModel().length(11, ""))
    assert all(r.token_ids == reference_tokens(11, r.request_id, 0, n)[0] for r in got.values())  # as if never moved


async def test_a_request_being_finished_is_not_dropped_by_its_own_lease_renewal(clients, monkeypatch):
    """A finish whose result publish is slow outlives a heartbeat: the quiet-lease renewal meets
    the request's own finished mark. It is ours: no lost lease, no "fenced" event, the request
    stays until its ack."""
    js, step, pool = clients.js, 131, "slowfinish"
    publish_batch = bus.publish_batch

    async def slow_results(js_, items, **kw):
        if any(subject == wire.result_subject(step) for subject, _, _ in items):
            await asyncio.sleep(1.5)  # > lease_ttl_s / 3 + a heartbeat: the renewal runs meanwhile
        return await publish_batch(js_, items, **kw)

    monkeypatch.setattr(bus, "publish_batch", slow_results)
    w = _worker(clients, pool)
    drops = []
    drop_fenced = w._drop_fenced

    async def spy(a, why):
        drops.append((a.req.request_id, str(why)))
        await drop_fenced(a, why)

    w._drop_fenced = spy
    task = asyncio.create_task(w.run())
    reqs = [_req(step, i, max_new=30) for i in range(4)]
    for r in reqs:
        await js.publish(wire.request_subject(pool), wire.encode(r))
    got = await step_results(js, step, len(reqs), timeout=15)
    w.request_drain("test over")
    await task
    assert len(got) == len(reqs)
    assert drops == [] and w.counters.get("fenced") == 0
    assert w.counters.get("results") == len(reqs)


def test_worker_flags_and_any_setting_land_in_the_settings_tree_validated():
    """`rlboost worker` flags are shorthands for `[worker]` keys, any key goes as
    --section.key, and the tree's invariants hold on the result (lease TTL < ack_wait)."""
    from rlboost.config import Settings
    from rlboost.workers.main import parse_args

    s = Settings()
    parse_args(["--pool", "p1", "--ack-wait", "20", "--lease-ttl", "12", "--worker.fetch_batch", "4",
                "--slots", "3"], s)
    assert (s.worker.pool, s.worker.ack_wait_s, s.worker.lease_ttl_s, s.worker.fetch_batch, s.worker.slots) == \
        ("p1", 20.0, 12.0, 4, 3)
    with pytest.raises(SystemExit):
        parse_args(["--ack-wait", "3"], Settings())  # the default lease TTL (8 s) is not < 3 s


async def test_the_next_versions_requests_outlast_a_long_tail_of_the_old_one(clients):
    """A worker finishing a long request of version 0 hands version-1 requests back (it serves
    one version at a time). Handed back 0.5 s each time, with a pause of one ack_wait between
    fetches, the next version's requests were bounced into the dead-letter queue through a tail
    of ~max_deliver ack_waits (the trace bench's reserved side hung a run so). The hand-back's
    delay now grows with the request's deliveries: every request is answered, through a tail of
    ~27 ack_waits with max_deliver 9."""
    js, step, pool = clients.js, 141, "vswitch"
    await bus.ensure_pool_consumer(js, pool, wire.ConsumerSpec(ack_wait_s=0.3, max_deliver=9))
    settings = WorkerSettings(pool=pool, slots=8, ack_wait_s=0.3, lease_ttl_s=0.25, heartbeat_s=0.1, max_deliver=9)
    w = RolloutWorker(settings, EmulatedEngine(speed=0.5), clients, worker_id="vswitch-w", counters=Counters())
    task = asyncio.create_task(w.run())
    try:
        # ~8 s of decoding: 1,149 tokens drawn for seed 11, 700 of them at ~6 ms each, half speed
        tail = wire.RolloutRequest(request_id=wire.request_id(step, 0, 0), step=step, policy_version=0,
                                   prompt_ids=[5, 6, 7], max_new_tokens=700, seed=11, group=0)
        await js.publish(wire.request_subject(pool), wire.encode(tail))
        await _counted(w, "claims", 1)
        nxt = [_req(step, i, version=1, max_new=5) for i in range(1, 4)]
        for r in nxt:
            await js.publish(wire.request_subject(pool), wire.encode(r))
        got = await step_results(js, step, 4, timeout=40)
    finally:
        w.request_drain("test over")
        await task
    assert set(got) == {tail.request_id, *(r.request_id for r in nxt)}
    assert got[tail.request_id].segments[0].weights == "emulated-v0"
    assert all(got[r.request_id].segments[0].weights == "emulated-v1" for r in nxt)


async def test_an_async_worker_carries_its_unfinished_requests_to_the_next_version(clients):
    """Async's in-flight update: a worker halfway through a long upgradable request of version 0
    meets the next version's requests. It does not hand them back until the long one ends: it
    moves its engine to version 1 at once and continues the long request under it, a segment of
    its own with version 1's weights, nothing regenerated. Each segment's tokens are exactly what
    its version's weights make from that offset."""
    js, step, pool = clients.js, 142, "carry"
    w = RolloutWorker(WorkerSettings(pool=pool, slots=8, ack_wait_s=3.0, lease_ttl_s=2.0, heartbeat_s=0.2),
                      EmulatedEngine(speed=0.5), clients, worker_id="carry-w", counters=Counters())
    task = asyncio.create_task(w.run())
    try:
        # ~8 s of decoding at half speed (700 of seed 11's 1,149 tokens)
        tail = wire.RolloutRequest(request_id=wire.request_id(step, 0, 0), step=step, policy_version=0,
                                   prompt_ids=[5, 6, 7], max_new_tokens=700, seed=11, group=0, upgradable=True)
        await js.publish(wire.request_subject(pool), wire.encode(tail))
        await _counted(w, "checkpointed", 50)
        nxt = [msgspec.structs.replace(_req(step, i, version=1, max_new=5), upgradable=True) for i in range(1, 4)]
        for r in nxt:
            await js.publish(wire.request_subject(pool), wire.encode(r))
        got = await step_results(js, step, 4, timeout=30)
    finally:
        w.request_drain("test over")
        await task
    assert set(got) == {tail.request_id, *(r.request_id for r in nxt)}
    long = got[tail.request_id]
    assert [(s.policy_version, s.weights) for s in long.segments] == [(0, "emulated-v0"), (1, "emulated-v1")]
    at = long.segments[1].offset
    assert 50 <= at < 700 and len(long.token_ids) == 700
    assert long.token_ids[:at] == reference_tokens(11, tail.request_id, 0, at)[0]
    assert long.token_ids[at:] == reference_tokens(11, tail.request_id, at, 700 - at, policy_version=1)[0]
    assert all(got[r.request_id].segments[0].weights == "emulated-v1" for r in nxt)
    assert w.counters.get("carried") == 1 and w.counters.get("wrong_weights") == 0


async def test_control_reaches_a_worker_between_its_heartbeats(clients):
    """The control keys are watched, not read at the heartbeat: with a 60 s heartbeat an idle
    worker still takes a new version floor and a drain as they are written (before, each key
    was read every tick: ~6 of an idle worker's ~23 NATS messages a second)."""
    settings = WorkerSettings(pool="watched", slots=2, ack_wait_s=3.0, lease_ttl_s=2.0, heartbeat_s=60.0)
    w = RolloutWorker(settings, EmulatedEngine(), clients, worker_id="watched-w", counters=Counters())
    task = asyncio.create_task(w.run())
    kv = await clients.js.key_value(wire.BUCKET_CONTROL)
    deadline = time.monotonic() + 10
    while not (w.liveness is not None and w.liveness.watching) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert w.liveness.watching
    await kv.put(wire.version_floor_key("watched"), wire.encode(wire.VersionFloor(version=7, ts=time.time())))
    while w.st.floor != 7 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert w.st.floor == 7 and w.liveness.ticks == 0  # no heartbeat tick has run
    await kv.put(w.worker_id, wire.encode(wire.control("drain", w.worker_id, "watched")))
    await asyncio.wait_for(task, timeout=10.0)
    assert w.st.drain_reason == "control drain: watched" and w.liveness.ticks == 0
