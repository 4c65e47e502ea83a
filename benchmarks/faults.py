"""`rlboost bench faults`: the servers fail, not just the workers. Real embedded NATS and Redis
(killed with SIGKILL and restarted on the same port and store), real worker processes, every
result checked against the uninterrupted reference of the version it names.

Scenarios (each on fresh servers, one after the other):
- `redis_restart`: Redis kill -9 + restart under load (the AOF keeps the checkpoints);
- `redis_restart_paused`: a worker is SIGSTOPped, Redis is restarted having lost its data (a
  lost AOF tail, a wiped volume, a failover to an empty replica), the paused worker's requests
  are taken over, then it wakes: every write it still attempts must be refused;
- `nats_restart_low` / `nats_restart_high` (x `--repeats`): NATS kill -9 + restart with the
  JetStream store kept, at low and at high load: no worker may stall;
- `publish_restart`: the trainer's `publish_step` of many requests with NATS killed and
  restarted in the middle: it returns with every request stored once, or raises naming them;
- `long_sigstop`: a worker paused for several ack waits, then resumed;
- `kill_during_pull`: a worker SIGKILLed while it pulls a policy version's shards, restarted;
- `mixed_versions`: one version-1 request published among twelve version-0 ones, repeatedly.
- `redis_failover`: `rlboost up --sentinel` (Redis primary + replica + sentinel) loses its primary
  for good mid-step;
- `nats_node_lost`: `rlboost up --cluster 3` (JetStream on 3 nodes, replication 3) loses the node
  leading the work queue, for good, mid-step.
- `redis_cluster`: `rlboost up --redis-cluster 3` (checkpoints sharded over 3 masters by their
  `{rid}` hash tag): one master is killed mid-step and restarted from its append-only file.

Per scenario: lost / duplicated (results per request id in RB_RESULTS), mismatched (tokens or
logprobs that differ from the emulated reference of the request's version: the emulated
engine's tokens depend on the loaded version's "weights"), wrong_version_tokens (tokens equal
to another version's reference: generated with the wrong weights), stale_writes_accepted
(token chunks and finishes of a lease after another worker claimed the request), epochs_reused
((request, epoch) pairs claimed by two workers), stalled_workers (workers alive with requests
and no progress when the run ends unfinished), recovery_s (fault injected -> the next result).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import signal
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from rlboost import wire
from rlboost.checkpoint import LeaseLost
from rlboost.clients import open_clients
from rlboost.config import ServicesSettings, Settings
from rlboost.pool_client import PoolClient
from rlboost.replay import read_chunks, read_subject
from rlboost.services import EmbeddedServices, provision_cluster
from rlboost.benchmarks import report
from rlboost.workers.engines.emulated import LengthModel, reference_tokens
from rlboost.workers.fleet import WorkerFleet

POOL = "faults"


class Servers:
    """Embedded NATS + Redis of one scenario, in a data dir of their own."""

    def __init__(self, root: Path, cluster: int = 1, sentinel: bool = False, redis_cluster: int = 0) -> None:
        self.dir = root
        self.svc = EmbeddedServices(ServicesSettings(data_dir=str(root / "data"), nats_cluster=cluster,
                                                     redis_sentinel=sentinel, redis_cluster=redis_cluster))
        st, _ = self.svc.up()
        self.nats_url, self.redis_url = self.svc.nats_url(st), self.svc.redis_url(st)
        if cluster > 1:
            asyncio.run(provision_cluster(self.nats_url, min(3, cluster)))

    async def restart(self, which: str, lose_data: bool = False, down_s: float = 0.5, node: int = 0) -> None:
        await asyncio.to_thread(self.svc.restart, which, signal.SIGKILL, lose_data, down_s, node)

    def close(self) -> None:
        self.svc.stop_recorded()


def make_requests(step: int, n: int, rng: random.Random, min_new: int, max_new: int,
                  versions: list[int] | None = None) -> list[wire.RolloutRequest]:
    return [wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step,
                                policy_version=versions[i] if versions else 0,
                                prompt_ids=[rng.randrange(32000) for _ in range(16)],
                                max_new_tokens=rng.randint(min_new, max_new), seed=rng.randrange(1 << 30), group=i)
            for i in range(n)]


def reference(q: wire.RolloutRequest, version: int | None = None) -> tuple[list[int], list[float]]:
    n = min(q.max_new_tokens, LengthModel().length(q.seed, q.request_id))
    v = q.policy_version if version is None else version
    return reference_tokens(q.seed, q.request_id, 0, n, policy_version=v)


async def _results_so_far(js, step: int) -> int:
    subject = wire.result_subject(step)
    try:
        info = await asyncio.wait_for(js.stream_info(wire.STREAM_RESULTS, subjects_filter=subject), 3.0)
        return int((info.state.subjects or {}).get(subject, 0))
    except Exception:  # NATS down for the moment
        return -1


async def run_load(srv: Servers, workdir: Path, name: str, requests: list[wire.RolloutRequest], workers: int,
                   fault, at: float = 0.3, timeout_s: float = 120.0, slots: int = 16, speed: float = 4.0,
                   ack_wait: float = 3.0, worker_env: dict[str, str] | None = None,
                   extra_args: tuple[str, ...] = (), weights: dict[int, str] | None = None,
                   worker_urls: list[tuple[str, str]] | None = None,
                   worker_prefix: list[list[str]] | None = None,
                   launcher: tuple[str, ...] = ("-m", "rlboost.cli"), publish=None) -> dict:
    """Publish `requests`, start `workers` worker processes, call `fault(ctx)` once `at` of the
    results are in, wait for the rest; then analyse everything the streams recorded.
    `worker_urls`: the (NATS, Redis) URLs of each worker in start order (a fault relay's), where
    they are not the servers' own; `worker_prefix`: what to run each in (a network namespace's
    `ip netns exec`). `launcher`: what the worker processes run (`WorkerFleet`).
    `publish(requests)`: who puts the step on the wire (a trainer of the caller's, through a link
    of its own, in `rlboost bench partitions`); by default this harness's own PoolClient."""
    step = requests[0].step
    fleet = WorkerFleet(srv.nats_url, srv.redis_url, workdir / name, POOL, worker_args=[
        "--engine", "emulated", "--speed", str(speed), "--slots", str(slots), "--checkpoint-tokens", "16",
        "--ack-wait", str(ack_wait), "--lease-ttl", str(ack_wait * 0.6), *extra_args],
        env={"RLBOOST_WORKER__HEARTBEAT_S": "0.3", "RLBOOST_WORKER__STALL_S": str(ack_wait), **(worker_env or {})},
        launcher=launcher)
    ctx: dict = {"fleet": fleet, "srv": srv, "ack_wait": ack_wait}
    t_fault = t_recovered = None
    async with open_clients(srv.nats_url, srv.redis_url, f"rlboost-faults-{name}", pools=(POOL,)) as c:
        await (publish or PoolClient(c, POOL).publish_step)(requests)
        for i in range(workers):
            if worker_urls:
                fleet.nats_url, fleet.redis_url = worker_urls[i]
            if worker_prefix:
                fleet.exec_prefix = worker_prefix[i]
            fleet.start()
        t0 = time.monotonic()
        done, injected, last_done = 0, False, 0
        progress = {w.worker_id: (0, t0) for w in fleet.workers.values()}
        try:
            while time.monotonic() - t0 < timeout_s:
                await asyncio.sleep(0.25)
                n = await _results_so_far(c.js, step)
                if n < 0:
                    continue
                done = n
                if injected and t_recovered is None and done > last_done:
                    t_recovered = time.monotonic()
                if not injected and done >= at * len(requests):
                    injected, last_done, t_fault = True, done, time.monotonic()
                    await fault(ctx)
                    after = await _results_so_far(c.js, step)
                    if after > last_done:  # results came in while the fault ran (after the restart)
                        t_recovered = time.monotonic()
                    last_done = max(last_done, after)
                for w in fleet.live():
                    g = w.counters()["generated"]
                    if progress.get(w.worker_id, (None,))[0] != g:
                        progress[w.worker_id] = (g, time.monotonic())
                if done >= len(requests):
                    break
        finally:
            for w in fleet.live():
                if w.stopped_now:
                    fleet.resume(w)
            now = time.monotonic()
            stalled = 0 if done >= len(requests) else sum(
                1 for w in fleet.live() if now - progress.get(w.worker_id, (0, t0))[1] > 3 * ack_wait)
            fleet.stop_all()
        results = await read_subject(c.js, wire.result_subject(step), wire.RolloutResult)
        events = await read_subject(c.js, f"rb.evt.{step}.>", wire.LeaseEvent)
        chunks = await read_chunks(c.js, step)
    out = analyse(requests, results, events, chunks, weights)
    out.update(scenario=name, workers_stalled=stalled, seconds=round(time.monotonic() - t0, 1),
               recovery_s=None if t_fault is None or t_recovered is None else round(t_recovered - t_fault, 2),
               stalls=sum(w.counters()["stalls"] for w in fleet.workers.values()),
               # What the fault cost: tokens generated beyond those in the results (redone).
               regenerated_tokens=sum(w.counters()["generated"] for w in fleet.workers.values())
               - sum(len(r.token_ids) for r in {r.request_id: r for r in results}.values()),
               wrong_weights_refused=sum(w.counters()["wrong_weights"] for w in fleet.workers.values()))
    out.update(ctx.get("extra", {}))
    return out


def analyse(requests, results, events, chunks, weights: dict[int, str] | None = None) -> dict:
    """`weights`: the weights id each version's segments must name (default: the emulated
    engine's virtual `emulated-v<N>`)."""
    by_rid: dict[str, list[wire.RolloutResult]] = defaultdict(list)
    for r in results:
        by_rid[r.request_id].append(r)
    versions = sorted({q.policy_version for q in requests})
    mismatched = wrong_version = 0
    for q in requests:
        for r in by_rid.get(q.request_id, [])[:1]:
            toks, lps = reference(q)
            if r.token_ids != toks or r.logprobs != np.asarray(lps, dtype=np.float32).tolist():
                mismatched += 1
                for v in versions:
                    if v == q.policy_version:
                        continue
                    other = reference(q, v)[0]
                    wrong_version += sum(1 for a, b, c in zip(r.token_ids, other, toks, strict=False) if a == b != c)
            for s in r.segments:
                want = (weights or {}).get(q.policy_version, f"emulated-v{q.policy_version}")
                if s.policy_version != q.policy_version or s.weights not in ("", want):  # "": an older worker
                    wrong_version += 1  # a segment that says so itself
    # Fencing: a lease (worker, epoch) is superseded by the next claim of its request by
    # another worker; any chunk or finish of it stamped after that was a stale write accepted.
    claims: dict[str, list[wire.LeaseEvent]] = defaultdict(list)
    finishes: list[wire.LeaseEvent] = []
    for e in events:
        if e.kind == "claim":
            claims[e.request_id].append(e)
        elif e.kind == "finish":
            finishes.append(e)
    reused = 0
    for cl in claims.values():
        owners: dict[int, set[str]] = defaultdict(set)
        for e in cl:
            owners[e.epoch].add(e.worker_id)
        reused += sum(1 for w in owners.values() if len(w) > 1)

    def superseded_at(rid: str, worker: str, epoch: int, ts: float) -> float | None:
        mine = [e.ts for e in claims.get(rid, []) if e.worker_id == worker and e.epoch == epoch and e.ts <= ts]
        if not mine:
            return None
        later = [e.ts for e in claims[rid] if e.worker_id != worker and e.ts > max(mine)]
        return min(later) if later else None

    stale = 0
    for w in [*chunks, *finishes]:
        at = superseded_at(w.request_id, w.worker_id, w.epoch, w.ts)
        if at is not None and w.ts > at:
            stale += 1
    return {"requests": len(requests), "lost": sum(1 for q in requests if q.request_id not in by_rid),
            "duplicated": sum(len(v) - 1 for v in by_rid.values()), "mismatched": mismatched,
            "wrong_version_tokens": wrong_version, "stale_writes_accepted": stale, "epochs_reused": reused}


# ---------------------------------------------------------------- scenarios


async def scenario_redis_restart(srv, workdir, a, rng, lose_data=False) -> dict:
    async def fault(ctx):
        await srv.restart("redis", lose_data=lose_data)

    reqs = make_requests(1, a.requests, rng, a.min_new, a.max_new)
    return await run_load(srv, workdir, "redis_restart", reqs, a.workers, fault, timeout_s=a.timeout)


async def scenario_redis_restart_paused(srv, workdir, a, rng) -> dict:
    """The paused worker holds leases of epochs the restarted store no longer knows."""

    async def fault(ctx):
        fleet = ctx["fleet"]
        victim = next(w for w in fleet.live() if w.counters()["claims"] > 0)
        fleet.pause(victim)
        await srv.restart("redis", lose_data=True)
        await asyncio.sleep(ctx["ack_wait"] * 2.5)  # its requests come back and are taken over
        fleet.resume(victim)
        ctx["victim"] = victim

    reqs = make_requests(2, a.requests, rng, a.min_new * 2, a.max_new * 2)
    return await run_load(srv, workdir, "redis_restart_paused", reqs, a.workers, fault, at=0.15,
                          timeout_s=a.timeout, speed=a.speed / 2)


async def scenario_nats_restart(srv, workdir, a, rng, high: bool, rep: int) -> dict:
    async def fault(ctx):
        await srv.restart("nats")

    n = a.requests * (4 if high else 1)
    reqs = make_requests(10 + rep + (5 if high else 0), n, rng, a.min_new, a.max_new)
    return await run_load(srv, workdir, f"nats_restart_{'high' if high else 'low'}_{rep}", reqs, a.workers, fault,
                          timeout_s=a.timeout, slots=64 if high else 16, speed=0.0 if high else a.speed)


async def scenario_nats_node_lost(srv, workdir, a, rng) -> dict:
    """A JetStream cluster of 3 (replication 3) loses the node that leads the work queue,
    for good, mid-step: the others elect a new leader and the step completes."""
    async def fault(ctx):
        from rlboost import bus

        nc = await bus.connect(srv.nats_url)
        try:
            leader = (await nc.jetstream().stream_info(wire.STREAM_REQUESTS)).cluster.leader
        finally:
            await nc.close()
        node = int(leader.removeprefix("rb-n"))
        await asyncio.to_thread(srv.svc.kill, "nats", signal.SIGKILL, node)
        ctx["extra"] = {"node_lost": leader}

    reqs = make_requests(7, a.requests, rng, a.min_new, a.max_new)
    return await run_load(srv, workdir, "nats_node_lost", reqs, a.workers, fault, timeout_s=a.timeout)


async def scenario_redis_failover(srv, workdir, a, rng) -> dict:
    """Redis primary + replica + sentinel (`rlboost up --sentinel`): the primary is killed for
    good mid-step; the sentinel promotes the replica, clients follow it."""
    async def fault(ctx):
        await asyncio.to_thread(srv.svc.kill, "redis")

    reqs = make_requests(8, a.requests, rng, a.min_new, a.max_new)
    return await run_load(srv, workdir, "redis_failover", reqs, a.workers, fault, timeout_s=a.timeout)


async def scenario_redis_cluster(srv, workdir, a, rng) -> dict:
    """A Redis Cluster of 3 masters: one is SIGKILLed mid-step and restarted from its AOF after
    a second down. Requests on the other masters go on; those on the lost one are retried or
    handed back, and resume from what its AOF kept (fencing covers a lost last second)."""
    async def fault(ctx):
        await srv.restart("redis", down_s=1.0, node=1)
        ctx["extra"] = {"master_restarted": 1}

    reqs = make_requests(9, a.requests, rng, a.min_new, a.max_new)
    out = await run_load(srv, workdir, "redis_cluster", reqs, a.workers, fault, timeout_s=a.timeout)
    async with open_clients(srv.nats_url, srv.redis_url, "rlboost-faults-cluster-check", pools=(POOL,)) as c:
        # The trainer's check of every result against the checkpoint on its master.
        out["verified_by_manager"] = 0
        with contextlib.suppress(TimeoutError):
            async for _ in PoolClient(c, POOL).results(9, reqs, timeout_s=20.0):
                out["verified_by_manager"] += 1
        # Fencing on the cluster, on requests spread over every master: after a new claim,
        # the old epoch's appends are refused; the new owner's, pipelined across slots, land.
        rids = [f"cluster-fence-s9-p{i}" for i in range(24)]
        old = [await c.store.claim(r, "old", 0, ttl_s=5) for r in rids]
        new = [await c.store.claim(r, "new", 0, ttl_s=5, steal=True) for r in rids]
        stale = await c.store.append_many([(r, "old", o.epoch, 0, [1], [0.0]) for r, o in zip(rids, old)], 5)
        fresh = await c.store.append_many([(r, "new", n.epoch, 0, [2], [0.0]) for r, n in zip(rids, new)], 5)
        released = await c.store.release_many([(r, n.epoch) for r, n in zip(rids, new)])
        out["stale_writes_accepted"] += sum(1 for x in stale if not isinstance(x, LeaseLost))
        out["fenced_appends_refused"] = sum(1 for x in stale if isinstance(x, LeaseLost))
        out["cluster_pipeline_ok"] = fresh == [1] * len(rids) and all(released)
    return out


async def scenario_long_sigstop(srv, workdir, a, rng) -> dict:
    async def fault(ctx):
        fleet = ctx["fleet"]
        victim = next(w for w in fleet.live() if w.counters()["claims"] > 0)
        fleet.pause(victim)
        await asyncio.sleep(ctx["ack_wait"] * 4)
        fleet.resume(victim)

    reqs = make_requests(3, a.requests, rng, a.min_new, a.max_new)
    return await run_load(srv, workdir, "long_sigstop", reqs, a.workers, fault, timeout_s=a.timeout)


async def scenario_mixed_versions(srv, workdir, a, rng) -> dict:
    """Groups of twelve version-0 requests with one version-1 request among them, published
    together: a worker must not switch to version 1 while version-0 admissions are in flight."""
    versions = [1 if i % 13 == 6 else 0 for i in range(13 * max(1, a.requests // 13))]

    async def fault(ctx):
        return None

    reqs = make_requests(4, len(versions), rng, a.min_new, a.max_new, versions=versions)
    return await run_load(srv, workdir, "mixed_versions", reqs, a.workers, fault, at=1.0, timeout_s=a.timeout,
                          slots=16)


async def scenario_publish_restart(srv, workdir, a, rng) -> dict:
    """The trainer's publish of a large step across a NATS kill -9 + restart."""
    n = a.publish_requests
    reqs = make_requests(5, n, rng, 16, 16)
    outcome, t0 = "returned", time.monotonic()
    async with open_clients(srv.nats_url, srv.redis_url, "rlboost-faults-publish", pools=(POOL,)) as c:
        manager = PoolClient(c, POOL)
        publish = asyncio.create_task(asyncio.wait_for(manager.publish_step(reqs), a.timeout))
        while not publish.done():  # kill it mid-publish: once a share of the step is stored
            await asyncio.sleep(0.01)
            with contextlib.suppress(Exception):
                if (await c.js.stream_info(wire.STREAM_REQUESTS)).state.messages >= n * a.publish_kill_at:
                    break
        await srv.restart("nats")
        t_restarted = time.monotonic()
        named: list[str] = []
        try:
            await publish
        except TimeoutError:
            outcome = f"hung: no return in {a.timeout:g} s"
        except Exception as e:
            outcome, named = f"raised: {str(e)[:200]}", list(getattr(e, "ids", []))
        t_done = time.monotonic()
        ids = await _stored_request_ids(c.js)
    unique = set(ids)
    missing = {q.request_id for q in reqs} - unique
    return {"scenario": "publish_restart", "requests": n, "outcome": outcome,
            "lost": len(missing - set(named)), "not_stored_named": len(named),
            "duplicated": len(ids) - len(unique), "mismatched": 0, "wrong_version_tokens": 0,
            "stale_writes_accepted": 0, "epochs_reused": 0, "workers_stalled": 0,
            "recovery_s": round(t_done - t_restarted, 2), "seconds": round(t_done - t0, 1)}


async def _stored_request_ids(js) -> list[str]:
    """Every request in the work queue (no worker consumed them), by direct reads: a work-queue
    stream allows no second consumer to look."""
    state = (await js.stream_info(wire.STREAM_REQUESTS)).state
    ids = []
    for seq in range(state.first_seq, state.last_seq + 1):
        try:
            raw = await js.get_msg(wire.STREAM_REQUESTS, seq)
        except Exception:
            continue  # a gap
        ids.append(wire.decode(wire.RolloutRequest, raw.data).request_id)
    return ids


async def scenario_kill_during_pull(srv, workdir, a, rng) -> dict:
    """Workers that pull real shards (virtual engine): one is killed mid-pull and restarted;
    its cache must come back clean (no `.part` left) and its requests complete once."""
    import torch

    from rlboost.weights import VersionPointer, WeightPublisher, open_store

    async with open_clients(srv.nats_url, srv.redis_url, "rlboost-faults-weights") as c:
        store = await open_store(js=c.js)
        pub = WeightPublisher(store, await VersionPointer.open(c.js), target_shard_bytes=8 << 20)
        g = torch.Generator().manual_seed(0)
        state = {f"layer{i}.weight": torch.randn(1024, 2048, generator=g) for i in range(a.pull_mb // 8)}
        published = await pub.publish(state, version=1)
    cache = workdir / "kill_during_pull" / "cache"
    extra: dict = {}

    async def fault(ctx):
        fleet = ctx["fleet"]
        deadline = time.monotonic() + 30
        victim = None
        while victim is None and time.monotonic() < deadline:
            for w in fleet.live():
                if any((cache / w.worker_id / "tmp").glob("*.part")):
                    victim = w
                    break
            await asyncio.sleep(0.005)
        if victim is None:
            extra["killed_mid_pull"] = False
            return
        fleet.kill(victim)
        extra["killed_mid_pull"] = True
        extra["part_files_left_by_kill"] = len(list((cache / victim.worker_id / "tmp").glob("*.part")))
        fleet.start(extra_args=("--worker-id", victim.worker_id))  # same cache dir: opened again

    reqs = make_requests(6, a.requests // 2, rng, a.min_new, a.max_new, versions=[1] * (a.requests // 2))
    ctx_extra = {"extra": extra}
    out = await run_load(srv, workdir, "kill_during_pull", reqs, a.workers, fault, at=0.0, timeout_s=a.timeout,
                         worker_env={"RLBOOST_WORKER__CACHE_DIR": str(cache), "RLBOOST_WORKER__EMULATED_PULLS": "1"},
                         weights={1: published.manifest_digest})
    out.update(ctx_extra["extra"])
    out["part_files_after"] = len(list(cache.glob("*/tmp/*.part")))
    return out


SCENARIOS = ("redis_restart", "redis_restart_paused", "nats_restart_low", "nats_restart_high", "publish_restart",
             "long_sigstop", "kill_during_pull", "mixed_versions", "nats_node_lost", "redis_failover",
             "redis_cluster")


async def run_scenario(name: str, a: argparse.Namespace, root: Path, rep: int = 0) -> dict:
    rng = random.Random(a.seed + rep)
    srv = await asyncio.to_thread(Servers, root / f"{name}-{rep}", 3 if name == "nats_node_lost" else 1,
                                  name == "redis_failover", 3 if name == "redis_cluster" else 0)
    try:
        if name == "redis_cluster":
            return await scenario_redis_cluster(srv, root, a, rng)
        if name == "redis_failover":
            return await scenario_redis_failover(srv, root, a, rng)
        if name == "nats_node_lost":
            return await scenario_nats_node_lost(srv, root, a, rng)
        if name == "redis_restart":
            return await scenario_redis_restart(srv, root, a, rng)
        if name == "redis_restart_paused":
            return await scenario_redis_restart_paused(srv, root, a, rng)
        if name in ("nats_restart_low", "nats_restart_high"):
            return await scenario_nats_restart(srv, root, a, rng, high=name.endswith("high"), rep=rep)
        if name == "publish_restart":
            return await scenario_publish_restart(srv, root, a, rng)
        if name == "long_sigstop":
            return await scenario_long_sigstop(srv, root, a, rng)
        if name == "kill_during_pull":
            return await scenario_kill_during_pull(srv, root, a, rng)
        if name == "mixed_versions":
            return await scenario_mixed_versions(srv, root, a, rng)
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    finally:
        srv.close()


def clean(out: dict) -> bool:
    return (out["lost"] == out["duplicated"] == out["mismatched"] == out["wrong_version_tokens"]
            == out["stale_writes_accepted"] == out["epochs_reused"] == out["workers_stalled"] == 0
            and out.get("part_files_after", 0) == 0 and out.get("outcome", "returned") == "returned"
            and out.get("verified_by_manager", out["requests"]) == out["requests"]
            and out.get("cluster_pipeline_ok", True))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlboost bench faults", description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--repeats", type=int, default=3, help="NATS restarts: runs per load level")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--min-new", type=int, default=48)
    p.add_argument("--max-new", type=int, default=320)
    p.add_argument("--speed", type=float, default=4.0, help="emulated engine speed (x H100)")
    p.add_argument("--publish-requests", type=int, default=20000)
    p.add_argument("--publish-kill-at", type=float, default=0.2, help="publish_restart: kill NATS once this share is stored")
    p.add_argument("--pull-mb", type=int, default=128, help="kill_during_pull: size of the policy version")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the servers' data dirs and worker logs")
    report.add_out(p)
    return p


def main(argv: list[str], s: Settings) -> int:
    a = parser().parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="rlboost-faults-"))
    rows = []
    try:
        for name in a.scenarios.split(","):
            reps = a.repeats if name.startswith("nats_restart") else 1
            for rep in range(reps):
                out = asyncio.run(run_scenario(name, a, root, rep))
                out["ok"] = clean(out)
                rows.append(out)
                print(f"{out['scenario']:<24} lost {out['lost']} dup {out['duplicated']} mismatched "
                      f"{out['mismatched']} wrong-version {out['wrong_version_tokens']} stale "
                      f"{out['stale_writes_accepted']} epochs-reused {out['epochs_reused']} stalled "
                      f"{out['workers_stalled']} recovery {out['recovery_s']} s regenerated "
                      f"{out.get('regenerated_tokens', 0)} tokens  -> {'OK' if out['ok'] else 'VIOLATED'}",
                      flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    ok = all(r["ok"] for r in rows)
    return report.finish("faults", {"ok": ok, "scenarios": rows}, report.out_dir(a), ok=ok)

