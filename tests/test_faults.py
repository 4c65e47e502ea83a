"""Service faults: NATS and Redis killed and restarted under real workers, the trainer's publish
across a restart, fencing that survives a store that forgot, one version's weights per request."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import step_results

from rlboost import bus, wire
from rlboost.checkpoint import CheckpointStore, LeaseLost
from rlboost.clients import open_clients
from rlboost.config import ServicesSettings, WorkerSettings
from rlboost.pool_client import PoolClient
from rlboost.services import EmbeddedServices
from rlboost.benchmarks import faults
from rlboost.workers.counters import Counters
from rlboost.workers.engines.emulated import EmulatedEngine
from rlboost.workers.worker import RolloutWorker


def _bench_args(**over) -> argparse.Namespace:
    a = faults.parser().parse_args([])
    for k, v in over.items():
        setattr(a, k, v)
    return a


@pytest.fixture
def own_services(tmp_path):
    """Servers of this test alone: it kills and restarts them."""
    svc = EmbeddedServices(ServicesSettings(data_dir=str(tmp_path / "data")))
    st, _ = svc.up()
    yield svc, svc.nats_url(st), svc.redis_url(st)
    svc.stop_recorded()


# ---------------------------------------------------------------- 1. bounded waits


@pytest.mark.slow
def test_a_nats_restart_under_load_stalls_no_worker_and_loses_nothing(tmp_path):
    """kill -9 of NATS with acks in flight: before, lost acks froze every busy worker's flush
    while its heartbeats kept its requests from redelivery (stalled 3 of 3, requests lost)."""
    a = _bench_args(requests=120, workers=3, timeout=90.0)
    out = asyncio.run(faults.run_scenario("nats_restart_high", a, tmp_path))
    assert out["requests"] == 480
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["mismatched"] == 0
    assert out["workers_stalled"] == 0 and out["recovery_s"] is not None


@pytest.mark.slow
async def test_a_worker_that_makes_no_progress_stops_extending_its_requests(nats_url, redis_url, js):
    """An engine that hangs (here: an emulated GPU 10,000x too slow for one step to end): its
    worker stops sending in_progress and renewing leases, so the requests go to a worker that
    can generate them. Before, heartbeats kept them on the hung worker for good."""
    async with open_clients(nats_url, redis_url, "test-stall") as c:
        settings = dict(pool="stall", slots=4, ack_wait_s=2.0, lease_ttl_s=1.2, heartbeat_s=0.2, stall_s=1.0)
        hung = RolloutWorker(WorkerSettings(**settings), EmulatedEngine(speed=1e-4), c, worker_id="stall-hung",
                             counters=Counters())
        hung_task = asyncio.create_task(hung.run())
        reqs = [wire.RolloutRequest(request_id=wire.request_id(203, i, 0), step=203, policy_version=0,
                                    prompt_ids=[1, 2], max_new_tokens=32, seed=i) for i in range(2)]
        for r in reqs:
            await c.js.publish(wire.request_subject("stall"), wire.encode(r))
        while hung.counters.get("claims") < 2:
            await asyncio.sleep(0.05)
        healthy = RolloutWorker(WorkerSettings(**settings), EmulatedEngine(speed=0), c, worker_id="stall-ok",
                                counters=Counters())
        healthy_task = asyncio.create_task(healthy.run())
        got = await step_results(c.js, 203, 2, timeout=30)
        healthy.request_drain("test over")
        await healthy_task
        hung_task.cancel()
        await asyncio.gather(hung_task, return_exceptions=True)
    assert set(got) == {r.request_id for r in reqs}
    assert all(r.segments[-1].worker_id == "stall-ok" for r in got.values())
    assert hung.counters.get("stalls") > 0


def test_the_trainer_refuses_a_result_generated_with_other_weights():
    from rlboost.weights.ledger import WrongWeights, check_weights

    def result(*segs: wire.Segment) -> wire.RolloutResult:
        return wire.RolloutResult(request_id="r-s1-p0", step=1, group=0, prompt_ids=[1], token_ids=[2, 3],
                                  logprobs=[0.0, 0.0], segments=list(segs), finish_reason="length", worker_id="w",
                                  ts=0.0)

    good = wire.Segment(offset=0, worker_id="w1", epoch=5, policy_version=3, weights="abc")
    check_weights(result(good), 3, "abc")
    with pytest.raises(WrongWeights, match="from 1 on .* version 2"):
        check_weights(result(good, wire.Segment(offset=1, worker_id="w2", epoch=6, policy_version=2, weights="abc")),
                      3, "abc")
    with pytest.raises(WrongWeights, match="weights xyz"):
        check_weights(result(wire.Segment(offset=0, worker_id="w1", epoch=5, policy_version=3, weights="xyz")), 3, "abc")


@pytest.mark.slow
def test_a_nats_cluster_that_loses_its_work_queue_leader_completes_the_step(tmp_path):
    """`rlboost up --cluster 3`: streams at replication 3; the node leading RB_REQUESTS is
    killed for good mid-step."""
    a = _bench_args(requests=90, workers=2, timeout=90.0)
    out = asyncio.run(faults.run_scenario("nats_node_lost", a, tmp_path))
    assert out["node_lost"].startswith("rb-n")
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["mismatched"] == 0 and out["workers_stalled"] == 0


@pytest.mark.slow
def test_a_sentinel_failover_mid_step_loses_nothing_and_accepts_no_stale_write(tmp_path):
    """`rlboost up --sentinel`: the Redis primary is killed for good; the sentinel promotes the
    replica (asynchronously replicated: the last writes may be gone, fencing covers that)."""
    a = _bench_args(requests=90, workers=2, timeout=90.0)
    out = asyncio.run(faults.run_scenario("redis_failover", a, tmp_path))
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["mismatched"] == 0
    assert out["stale_writes_accepted"] == 0 and out["epochs_reused"] == 0 and out["workers_stalled"] == 0


@pytest.mark.slow
def test_a_redis_cluster_master_killed_mid_step_loses_nothing_and_accepts_no_stale_write(tmp_path):
    """`rlboost up --redis-cluster 3`: checkpoints sharded over 3 masters by their `{rid}` tag;
    one master is SIGKILLed mid-step and restarted from its AOF. Every result is verified by the
    manager against its master; an old epoch's appends, after a new claim, are refused on every
    master; pipelines across slots (append_many, release_many) land."""
    a = _bench_args(requests=90, workers=2, timeout=90.0)
    out = asyncio.run(faults.run_scenario("redis_cluster", a, tmp_path))
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["mismatched"] == 0 and out["workers_stalled"] == 0
    assert out["verified_by_manager"] == out["requests"] == 90
    assert out["stale_writes_accepted"] == 0 and out["epochs_reused"] == 0
    assert out["fenced_appends_refused"] == 24 and out["cluster_pipeline_ok"]
    assert faults.clean(out)


# ---------------------------------------------------------------- 2. the trainer's publish


@pytest.mark.slow
def test_publish_step_stores_every_request_once_across_a_nats_restart(tmp_path):
    a = _bench_args(publish_requests=8000, publish_kill_at=0.2, timeout=90.0)
    out = asyncio.run(faults.run_scenario("publish_restart", a, tmp_path))
    assert out["outcome"] == "returned"  # before: hung, with 1-2k requests missing and no error
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["not_stored_named"] == 0


async def test_a_request_whose_id_was_taken_first_is_refused_not_dropped(nats_url, redis_url, js):
    """The stream de-duplicates by Nats-Msg-Id: a genuine request published under an id that
    another message already took would silently never reach a worker."""
    req = wire.RolloutRequest(request_id="taken-s1-p0", step=1, policy_version=0, prompt_ids=[1, 2],
                              max_new_tokens=4, seed=1)
    other = wire.RolloutRequest(request_id="fresh-s1-p1", step=1, policy_version=0, prompt_ids=[1, 2],
                                max_new_tokens=4, seed=2)
    await js.publish(wire.request_subject("taken"), b"someone else's", headers={wire.HDR_MSG_ID: req.request_id})
    async with open_clients(nats_url, redis_url, "test-taken") as c:
        with pytest.raises(bus.PublishFailed, match="taken-s1-p0") as e:
            await PoolClient(c, "taken").publish_step([req, other])
    assert e.value.ids == [req.request_id]


# ---------------------------------------------------------------- 3. one version per request


def _mixed(step: int, groups: int) -> list[wire.RolloutRequest]:
    return [wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step,
                                policy_version=1 if i % 13 == 6 else 0, prompt_ids=[3, 4, 5], max_new_tokens=64,
                                seed=100 + i, group=i) for i in range(13 * groups)]


async def test_a_version_admitted_alongside_never_generates_another_versions_requests(nats_url, redis_url, js):
    """Before: the switch to version 1 ignored version-0 admissions still claiming, which were
    then generated with version 1's weights and labelled version 0."""
    async with open_clients(nats_url, redis_url, "test-mixed") as c:
        w = RolloutWorker(WorkerSettings(pool="mixed", slots=8, ack_wait_s=3.0, lease_ttl_s=2.0), EmulatedEngine(speed=0),
                          c, worker_id="mixed-w", counters=Counters())
        task = asyncio.create_task(w.run())
        reqs = _mixed(251, 3)
        for r in reqs:
            await c.js.publish(wire.request_subject("mixed"), wire.encode(r))
        got = await step_results(c.js, 251, len(reqs), timeout=30)
        w.request_drain("test over")
        await task
    assert len(got) == len(reqs)
    for q in reqs:
        r = got[q.request_id]
        assert (r.token_ids, [s.weights for s in r.segments]) == (
            faults.reference(q)[0], [f"emulated-v{q.policy_version}"] * len(r.segments)), q.request_id
    assert w.counters.get("wrong_weights") == 0


async def test_a_request_for_an_unpublished_version_does_not_hold_up_the_others(nats_url, redis_url, js, tmp_path):
    """Before: the pull waited for the missing manifest while holding the version lock (30 s
    per delivery), so every request of a published version waited behind it."""
    import torch

    from rlboost.weights import WeightCache
    from rlboost.weights import VersionPointer, VersionUnavailable, WeightPublisher, open_store
    from rlboost.weights.source import StoreWeights

    unpublished_wait = asyncio.Event()
    async with open_clients(nats_url, redis_url, "test-unpublished") as c:
        store = await open_store(js=c.js, bucket="test-unpublished")
        pointer = await VersionPointer.open(c.js)  # shared with earlier tests: publish past what they left
        v = (await pointer.get() or 0) + 1
        await WeightPublisher(store, pointer).publish({"w": torch.ones(4, 4)}, version=v)
        cache = WeightCache(tmp_path / "cache", store)

        class Waiting(StoreWeights):
            async def path(self, version: int):
                if version == v + 100:  # never published: the store keeps the request waiting
                    await unpublished_wait.wait()
                    raise VersionUnavailable(f"weights version {version} is not in the store")
                return await super().path(version)

        weights = Waiting(cache, wait_s=0.0)

        w = RolloutWorker(WorkerSettings(pool="unpub", slots=8, ack_wait_s=30.0, lease_ttl_s=2.0),
                          EmulatedEngine(speed=0), c, worker_id="unpub-w", counters=Counters(), weights=weights)
        task = asyncio.create_task(w.run())
        stray = wire.RolloutRequest(request_id="s00202-p09999-g000", step=202, policy_version=v + 100, prompt_ids=[1],
                                    max_new_tokens=8, seed=1)
        await c.js.publish(wire.request_subject("unpub"), wire.encode(stray))
        await asyncio.sleep(0.3)
        reqs = [wire.RolloutRequest(request_id=wire.request_id(202, i, 0), step=202, policy_version=v,
                                    prompt_ids=[1, 2], max_new_tokens=32, seed=i) for i in range(4)]
        for r in reqs:
            await c.js.publish(wire.request_subject("unpub"), wire.encode(r))
        got = await step_results(c.js, 202, len(reqs), timeout=15)  # the stray one keeps waiting meanwhile
        unpublished_wait.set()
        w.request_drain("test over")
        await task
        cache.close()
    assert set(got) == {r.request_id for r in reqs}
    digest = [s.weights for r in got.values() for s in r.segments]
    assert len(set(digest)) == 1 and len(digest[0]) == 64  # the manifest digest of version v


# ---------------------------------------------------------------- 4. fencing that survives the store


async def test_a_stale_writer_is_refused_after_a_redis_restart_that_lost_the_epochs(own_services):
    """Redis restarted without its data (no persistence, a lost AOF tail, an empty replica):
    before, epochs started again at 1 and a paused writer's append and finish were accepted."""
    svc, _, redis_url = own_services
    rid = "fence-s1-p0"
    paused = CheckpointStore(redis_url)
    old = await paused.claim(rid, "paused", 0, ttl_s=5)
    await paused.append(rid, "paused", old.epoch, 0, [1, 2], [0.0, 0.0], ttl_s=5)
    await asyncio.to_thread(svc.restart, "redis", signal.SIGKILL, True)
    newcomer = CheckpointStore(redis_url)
    new = await newcomer.claim(rid, "newcomer", 0, ttl_s=5)
    assert new.epoch > old.epoch and new.token_ids == []
    with pytest.raises(LeaseLost):
        await paused.append(rid, "paused", old.epoch, 0, [9, 9], [0.0, 0.0], ttl_s=5)
    with pytest.raises(LeaseLost):
        await paused.finish(rid, old.epoch, 0)
    await newcomer.append(rid, "newcomer", new.epoch, 0, [3], [0.0], ttl_s=5)
    assert (await newcomer.read(rid))[0] == [3]
    await paused.close()
    await newcomer.close()


async def test_the_embedded_redis_keeps_checkpoints_across_a_kill(own_services):
    svc, _, redis_url = own_services
    store = CheckpointStore(redis_url)
    c = await store.claim("aof-s1-p0", "w", 0, ttl_s=5)
    await store.append("aof-s1-p0", "w", c.epoch, 0, [7, 8, 9], [0.0] * 3, ttl_s=5)
    await asyncio.sleep(1.5)  # appendfsync everysec
    await asyncio.to_thread(svc.restart, "redis")
    assert (await store.read("aof-s1-p0"))[0] == [7, 8, 9]
    await store.close()


@pytest.mark.slow
def test_a_worker_paused_across_a_redis_restart_has_its_stale_writes_refused(tmp_path):
    """Real processes: SIGSTOP a worker, restart Redis without its data, let the paused
    worker's requests be taken over, SIGCONT it."""
    a = _bench_args(requests=60, workers=2, timeout=90.0)
    out = asyncio.run(faults.run_scenario("redis_restart_paused", a, tmp_path))
    assert out["epochs_reused"] == 0 and out["stale_writes_accepted"] == 0
    assert out["lost"] == 0 and out["duplicated"] == 0 and out["mismatched"] == 0


# ---------------------------------------------------------------- 5. loose ends


async def test_token_checkpoints_expire_like_the_rest_of_the_request(store, rid):
    c = await store.claim(rid, "w1", 0, ttl_s=5)
    await store.append(rid, "w1", c.epoch, 0, [1], [0.0], ttl_s=5)
    assert 0 < await store.redis.ttl(wire.ckpt_tokens_key(rid)) <= store.keep_s


async def test_a_pull_killed_midway_leaves_no_partial_file_once_the_cache_reopens(nats_url, js, tmp_path):
    import torch

    from rlboost.weights import WeightCache
    from rlboost.weights import WeightPublisher, open_store

    store = await open_store(js=js, bucket="test-killed-pull")
    g = torch.Generator().manual_seed(1)
    await WeightPublisher(store, target_shard_bytes=16 << 20).publish(
        {f"t{i}": torch.randn(2048, 2048, generator=g) for i in range(6)}, version=1)  # 6 x 16 MB
    root = tmp_path / "cache"
    puller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import asyncio
        from rlboost import bus
        from rlboost.weights import WeightCache
        from rlboost.weights import open_store
        async def main():
            nc = await bus.connect({nats_url!r})
            await WeightCache({str(root)!r}, await open_store(js=nc.jetstream(), bucket="test-killed-pull"), parallel=2).ensure(1)
        asyncio.run(main())""")], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(3000):
            if list((root / "tmp").glob("*.part")):
                break
            await asyncio.sleep(0.005)
        puller.send_signal(signal.SIGKILL)
    finally:
        puller.wait()
    assert list((root / "tmp").glob("*.part")), "the kill did not land mid-pull"
    cache = WeightCache(root, store)
    assert list((root / "tmp").glob("*.part")) == []
    assert (await cache.ensure(1)).version == 1
    cache.close()


def test_down_returns_only_once_the_servers_are_gone(tmp_path):
    """A server that does not exit on SIGTERM (here: stopped) is killed, and waited for."""
    svc = EmbeddedServices(ServicesSettings(data_dir=str(tmp_path)))
    st, _ = svc.up()
    os.kill(st.nats_pid, signal.SIGSTOP)
    stopped = svc.stop_recorded(timeout=0.3)
    assert sorted(stopped) == sorted([st.nats_pid, st.redis_pid])
    for pid in stopped:
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().split(")")[-1].split()[0] == "Z", f"pid {pid} still running"
        except FileNotFoundError:
            pass
