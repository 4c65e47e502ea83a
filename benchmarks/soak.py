"""`rlboost bench soak`: the hybrid dataflow for N minutes under random faults, with every
resource sampled and judged for growth that does not level off.

Real embedded NATS and Redis, real worker processes (emulated engine), each worker slot reaching
the servers through fault relays of its own (benchmarks/relay.py). A steady stream of requests
flows: batches of `--batch` requests (one step each), a new batch published whenever one
completes, `--inflight` batches at a time, so the run never drains. Every `--every` s (mean) one
fault, at random: a worker SIGKILLed or SIGTERMed (and a new one started in its slot), a worker
SIGSTOPped (SIGCONT after a few ack waits), NATS or Redis SIGKILLed and restarted on its store
(only in the first half of the run, so the servers' last lifetimes span the judged second half),
or one worker's link to NATS or Redis cut through its relay for a few seconds.

Every `--sample-s` s (default: ~30 samples a run, 10-30 s apart for runs of 5 min and more):
- per process it started (workers, nats-server, redis-server), per lifetime: RSS (VmRSS) and
  open fds (/proc/PID/fd), and per worker its live asyncio tasks (the `asyncio_tasks` gauge of
  its counters file, set at every heartbeat tick: workers/counters.py);
- Redis `DBSIZE` and `used_memory`; JetStream messages and bytes of every stream (KV buckets
  included); files (count, bytes) under the servers' data dir and the workers' cache dir.

Judgement (`judge`): least squares over the samples after `--warmup` of a series' span, as a
slope per hour. A series is flat when the fitted change over the judged window is within noise
(2 x the residual standard deviation) or a tolerance (`--rel-tol` of its mean, or an absolute
one for small counts: fds, tasks); otherwise it levels off when the slope of the last half of the
window is at most half that of the first half. A linear leak fails both; a noisy flat or sawtooth
series passes the first, a warm-up ramp that flattens the second.

What is judged, and why:
- process resources, per process lifetime, on the long-lived ones only (a lifetime spanning at
  least `--long-lived` of the run): a leak lives in a process, and a restarted one starts small,
  so fleet totals jump with every kill and hide or fake a trend. Worker slot 1 is never killed or
  terminated (it is stopped and cut off like the others) so that one worker lives the whole run;
  fleet totals are printed, not judged;
- bounded state (the work queue RB_REQUESTS, the KV buckets, the cache dir): judged;
- retained state (Redis keys and memory, RB_RESULTS / RB_TOKENS / RB_EVENTS / RB_DLQ, the data
  dir, and the servers' RSS, which holds that state and NATS' de-duplication windows: an hour of
  result ids, ten minutes of request ids) grows with the work by design: checkpoints are kept a day (`CheckpointStore.keep_s`),
  tokens and events 7 days, results forever (`[services.retention]`). Under a steady stream work and time
  are proportional, so a leak cannot be told from retention in a run shorter than the retention
  window: printed with their cost per 1000 completed requests and marked `retained`, not judged.
  `--retention S` sets every one of those windows to S seconds (the servers' config, as a user
  would: checkpoints in every worker, stream ages by the provisioner); once the judged window
  starts past 1.5 x S, the retained state is judged like the rest: it must level off too. Each
  step's results, events and token chunks are then counted a minute after it completes, before
  the stream drops them.

Correctness, from the results of every step at the end (`rlboost bench faults`' counting,
benchmarks/faults.py `analyse`): lost, duplicated, mismatched, wrong-version tokens, stale writes
accepted, epochs reused. Exit status 1 on any of those, or on a judged series that does not
level off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

from rlboost import bus, wire
from rlboost.clients import open_clients
from rlboost.config import RetentionSettings, Settings
from rlboost.pool_client import PoolClient
from rlboost.replay import read_chunks, read_subject
from rlboost.benchmarks import faults, report
from rlboost.benchmarks.relay import Relay
from rlboost.workers.fleet import WorkerFleet, WorkerProc

POOL = faults.POOL
STEP0 = 1000  # soak steps are STEP0, STEP0 + 1, ...
BUCKETS = (wire.BUCKET_WORKERS, wire.BUCKET_POLICY, wire.BUCKET_CONTROL)
RETAINED_STREAMS = (wire.STREAM_TOKENS, wire.STREAM_RESULTS, wire.STREAM_EVENTS, wire.STREAM_DLQ)
COUNT_AFTER_S = 60.0  # with --retention: a completed step is counted this long after (late duplicates included)


# ---------------------------------------------------------------- the judgement


@dataclass
class Verdict:
    slope_per_h: float  # over the judged window (after warm-up)
    first_half_per_h: float
    last_half_per_h: float
    mean: float
    samples: int
    ok: bool
    why: str  # flat | levels off | grows | too few samples


def _fit(ts: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope (per second) and residual standard deviation."""
    n = len(ts)
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    slope = sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var > 0 else 0.0
    resid = [y - (my + slope * (t - mt)) for t, y in zip(ts, ys, strict=True)]
    return slope, math.sqrt(sum(r * r for r in resid) / max(1, n - 2))


def _within(ts: list[float], ys: list[float], rel_tol: float, abs_tol: float) -> tuple[float, bool]:
    slope, sd = _fit(ts, ys)
    change = slope * (ts[-1] - ts[0])  # what the fit grew by over the window
    mean = sum(ys) / len(ys)
    return slope, change <= max(2 * sd, rel_tol * abs(mean), abs_tol)


def judge(ts: list[float], ys: list[float], warmup: float = 0.25, rel_tol: float = 0.05,
          abs_tol: float = 0.0, min_samples: int = 6) -> Verdict:
    """Does the series (times in s, values) grow without levelling off after `warmup` of its span?

    Flat: the fitted change over the window is within noise (2 residual sds), `rel_tol` of the
    mean, or `abs_tol`. Else it levels off if the last half's slope is at most half the first
    half's, or the last half is flat by the same test. A shrinking series passes."""
    pts = sorted(zip(ts, ys, strict=True))
    if pts:
        start = pts[0][0] + warmup * (pts[-1][0] - pts[0][0])
        pts = [p for p in pts if p[0] >= start]
    if len(pts) < min_samples:
        return Verdict(0.0, 0.0, 0.0, 0.0, len(pts), True, "too few samples")
    t, y = [p[0] for p in pts], [p[1] for p in pts]
    slope, flat = _within(t, y, rel_tol, abs_tol)
    half = len(pts) // 2
    s1, _ = _fit(t[:half + 1], y[:half + 1])
    s2, flat2 = _within(t[half:], y[half:], rel_tol, abs_tol)
    mean = sum(y) / len(y)
    per_h = lambda s: round(s * 3600, 3)  # noqa: E731
    if flat:
        ok, why = True, "flat"
    elif s2 <= 0.5 * s1 or flat2:
        ok, why = True, "levels off"
    else:
        ok, why = False, "grows"
    return Verdict(per_h(slope), per_h(s1), per_h(s2), round(mean, 3), len(pts), ok, why)


# ---------------------------------------------------------------- sampling


def proc_rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def dir_usage(path: Path) -> tuple[int, int]:
    """(files, bytes) under `path` (files that vanish while walking are skipped)."""
    files = size = 0
    for root, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                size += os.stat(os.path.join(root, n)).st_size
                files += 1
    return files, size


@dataclass
class Series:
    kind: str  # process | bounded | retained | total
    abs_tol: float
    points: list[tuple[float, float]]


class Sampler:
    """Collects every series; a process series is keyed by its lifetime (worker id, server pid)."""

    def __init__(self) -> None:
        self.series: dict[str, Series] = {}

    def add(self, name: str, kind: str, t: float, value: float | None, abs_tol: float = 0.0) -> None:
        if value is None:
            return
        self.series.setdefault(name, Series(kind, abs_tol, [])).points.append((t, float(value)))

    async def sample(self, t: float, fleet: WorkerFleet, srv: faults.Servers, js, redis_url: str,
                     dirs: dict[str, Path], results: int) -> None:
        self.add("results", "work", t, results)
        st = srv.svc.state()
        procs: list[tuple[str, int, WorkerProc | None]] = [(w.worker_id, w.proc.pid, w) for w in fleet.live()]
        if st is not None:
            procs += [(f"nats-server[{st.nats_pid}]", st.nats_pid, None), (f"redis-server[{st.redis_pid}]", st.redis_pid, None)]
        totals: dict[str, float] = defaultdict(float)
        for label, pid, w in procs:
            rss, fds = proc_rss_mb(pid), proc_fds(pid)
            # A server's memory holds what it keeps for us by design (Redis: the checkpoints;
            # NATS: the de-duplication windows' message ids, stream indexes), so it grows with
            # the retained state; a worker's must not.
            self.add(f"rss_mb {label}", "process" if w is not None else "retained", t, rss, abs_tol=2.0)
            self.add(f"fds {label}", "process", t, fds, abs_tol=2.0)
            if w is not None:
                tasks = w.counters().get("asyncio_tasks", 0)
                self.add(f"asyncio_tasks {label}", "process", t, tasks or None, abs_tol=3.0)
                totals["rss_mb"] += rss or 0
                totals["fds"] += fds or 0
                totals["asyncio_tasks"] += tasks
        for k, v in totals.items():
            self.add(f"{k} workers (total)", "total", t, v)
        try:
            r = aioredis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
            try:
                self.add("redis keys", "retained", t, await r.dbsize())
                self.add("redis used_memory_mb", "retained", t, (await r.info("memory"))["used_memory"] / 2**20)
            finally:
                await r.aclose()
        except Exception:  # Redis restarting: no sample this time
            pass
        names = [s.name for s in wire.STREAMS] + [f"KV_{b}" for b in BUCKETS]
        for name in names:
            try:
                state = (await asyncio.wait_for(js.stream_info(name), 2.0)).state
            except Exception:  # NATS restarting
                continue
            kind = "retained" if name in RETAINED_STREAMS else "bounded"
            # the work queue holds up to `--inflight` batches at any moment: a few messages of
            # difference between samples is where the stream is, not a trend
            self.add(f"js {name} msgs", kind, t, state.messages, abs_tol=20.0)
            self.add(f"js {name} mb", kind, t, state.bytes / 2**20, abs_tol=0.05)
        for label, path in dirs.items():
            files, size = await asyncio.to_thread(dir_usage, path)
            kind = "retained" if label == "data" else "bounded"
            self.add(f"files {label}", kind, t, files, abs_tol=2.0)
            self.add(f"mb {label}", kind, t, size / 2**20, abs_tol=0.05)


def resource_rows(sampler: Sampler, a: argparse.Namespace, run_s: float) -> tuple[list[dict], bool]:
    """One row per series; ok False if a judged one grows without levelling off."""
    rows, ok = [], True
    work = sampler.series.get("results")
    for name, s in sorted(sampler.series.items(), key=lambda kv: (kv[1].kind, kv[0])):
        if s.kind == "work":
            continue
        ts, ys = [p[0] for p in s.points], [p[1] for p in s.points]
        v = judge(ts, ys, a.warmup, a.rel_tol, s.abs_tol)
        span = ts[-1] - ts[0] if ts else 0.0
        row = {"series": name, "kind": s.kind, "samples": len(ts), "first": round(ys[0], 2), "last": round(ys[-1], 2),
               "slope_per_h": v.slope_per_h, "first_half_per_h": v.first_half_per_h,
               "last_half_per_h": v.last_half_per_h}
        judged = ("process", "bounded", "retained") if judges_retained(a) else ("process", "bounded")
        server = s.kind == "retained" and name.startswith("rss_mb")  # a server's lifetime, like a process's
        if (s.kind == "process" or server) and span < a.long_lived * run_s:
            row["verdict"] = "short-lived"
        elif s.kind in judged:
            row["verdict"] = v.why if v.why != "too few samples" else "TOO FEW SAMPLES"
            ok = ok and v.ok and v.why != "too few samples"
        elif s.kind == "retained":
            row["verdict"] = "retained"
            if work and len(work.points) > 1 and len(ts) > 1:
                done = _value_at(work.points, ts[-1]) - _value_at(work.points, ts[0])
                if done > 0:
                    row["per_1k_requests"] = round((ys[-1] - ys[0]) / done * 1000, 3)
        else:
            row["verdict"] = "total (not judged)"
        rows.append(row)
    return rows, ok


def _value_at(points: list[tuple[float, float]], t: float) -> float:
    before = [y for x, y in points if x <= t]
    return before[-1] if before else points[0][1]


def print_table(rows: list[dict]) -> None:
    short = [r for r in rows if r["verdict"] == "short-lived"]
    report.print_table([r for r in rows if r["verdict"] != "short-lived"], [
        ("series", "<34", "series"), ("kind", "<8", "kind"), ("n", ">3", "samples"), ("first", ">10", "first"),
        ("last", ">10", "last"), ("slope/h", ">10", "slope_per_h"), ("1st half/h", ">11", "first_half_per_h"),
        ("2nd half/h", ">11", "last_half_per_h"),
        (" verdict", "", lambda r: f" {r['verdict']}" + (f" ({r['per_1k_requests']} per 1k requests)"
                                                        if "per_1k_requests" in r else ""))])
    if short:
        print(f"({len(short)} series of short-lived processes not judged: restarted workers, earlier server lifetimes)")


# ---------------------------------------------------------------- the run


def judges_retained(a: argparse.Namespace) -> bool:
    """Retained state is judged when the run keeps it for a window that ends before the judgement starts."""
    return bool(a.retention) and 1.5 * a.retention <= a.warmup * a.minutes * 60


async def soak(a: argparse.Namespace, root: Path, launcher: tuple[str, ...] = ("-m", "rlboost.cli")) -> dict:
    """`launcher`: what the worker processes run (`WorkerFleet`; a test's leaking worker)."""
    rng = random.Random(a.seed)
    retention = RetentionSettings(checkpoints_s=int(a.retention), results_s=a.retention, tokens_s=a.retention,
                                  events_s=a.retention, dlq_s=a.retention) if a.retention else None
    srv = await asyncio.to_thread(faults.Servers, root / "servers")
    cache = root / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    dirs = {"data": root / "servers" / "data", "cache": cache}
    relays = [(Relay.to_url(srv.nats_url, f"nats-{i}"), Relay.to_url(srv.redis_url, f"redis-{i}"))
              for i in range(a.workers)]
    fleet = WorkerFleet(srv.nats_url, srv.redis_url, root / "workers", POOL, worker_args=[
        "--engine", "emulated", "--speed", str(a.speed), "--slots", str(a.slots), "--checkpoint-tokens", "16",
        "--ack-wait", str(a.ack_wait), "--lease-ttl", str(a.ack_wait * 0.6)],
        env={"RLBOOST_WORKER__CACHE_DIR": str(cache), "RLBOOST_WORKER__STALL_S": str(a.ack_wait),
             **({"RLBOOST_SERVICES__RETENTION__CHECKPOINTS_S": str(int(a.retention))} if retention else {})},
        die_with_parent=True, launcher=launcher)
    slots: list[WorkerProc | None] = [None] * a.workers

    def start(i: int) -> None:
        fleet.nats_url, fleet.redis_url = relays[i][0].url(srv.nats_url), relays[i][1].url(srv.redis_url)
        slots[i] = fleet.start()

    sampler = Sampler()
    actions: list[tuple[str, str, float]] = []
    requests: dict[int, list[wire.RolloutRequest]] = {}
    pending: list[int] = []  # steps published and not complete
    done_at: dict[int, float] = {}  # step -> when it completed (not yet counted)
    totals: dict[str, int] = defaultdict(int)
    completed = 0
    try:
        async with open_clients(srv.nats_url, srv.redis_url, "rlboost-soak", pools=(POOL,)) as c:
            pool = PoolClient(c, POOL)
            if retention is not None:  # the provisioner's part: the streams keep what the config says
                await bus.provision(c.js, ages=retention.stream_ages())

            async def count(step: int) -> None:
                """Lost, duplicated, ... of one step, from what the streams hold of it."""
                results = await read_subject(c.js, wire.result_subject(step), wire.RolloutResult)
                events = await read_subject(c.js, f"rb.evt.{step}.>", wire.LeaseEvent)
                chunks = await read_chunks(c.js, step)
                for k, v in faults.analyse(requests[step], results, events, chunks).items():
                    totals[k] += v
                done_at.pop(step, None)

            async def publish_next() -> None:
                step = STEP0 + len(requests)
                requests[step] = faults.make_requests(step, a.batch, rng, a.min_new, a.max_new)
                pending.append(step)
                await pool.publish_step(requests[step], deadline_s=120.0)

            for _ in range(a.inflight):
                await publish_next()
            for i in range(a.workers):
                start(i)
            t0 = time.monotonic()
            run_s = a.minutes * 60
            sample_s = a.sample_s or min(30.0, max(2.0, run_s / 30))
            next_sample, next_action = t0, t0 + rng.uniform(0.5, 1.5) * a.every
            timers: list[tuple[float, str, object]] = []  # (due, what, arg): resume a worker, heal a link
            while time.monotonic() - t0 < run_s:
                await asyncio.sleep(0.25)
                now = time.monotonic()
                for x in [x for x in timers if x[0] <= now]:
                    timers.remove(x)
                    await undo(fleet, x)
                for step in list(pending):  # a complete batch: the next one goes out
                    if await faults._results_so_far(c.js, step) >= a.batch:
                        pending.remove(step)
                        done_at[step] = now
                        completed += a.batch
                        await publish_next()
                if retention is not None:  # counted while the streams still hold it (a late duplicate: within a minute)
                    for step in [st for st, at in done_at.items() if now - at > COUNT_AFTER_S]:
                        await count(step)
                for i, w in enumerate(slots):  # a SIGTERMed worker that drained and left: replaced
                    if w is not None and not w.alive():
                        start(i)
                if now >= next_sample:
                    next_sample += sample_s
                    await sampler.sample(now - t0, fleet, srv, c.js, srv.redis_url, dirs, completed)
                if now < next_action:
                    continue
                next_action = now + rng.uniform(0.5, 1.5) * a.every
                await act(a, rng, now - t0 < run_s / 2, fleet, srv, slots, relays, start, timers, actions)
            # The end: faults stop, every link and worker comes back, the published batches finish.
            for x in timers:
                await undo(fleet, x)
            await sampler.sample(time.monotonic() - t0, fleet, srv, c.js, srv.redis_url, dirs, completed)
            drain_t = time.monotonic()
            while pending and time.monotonic() - drain_t < a.drain_timeout:
                await asyncio.sleep(0.5)
                for step in list(pending):
                    if await faults._results_so_far(c.js, step) >= a.batch:
                        pending.remove(step)
                        done_at[step] = time.monotonic()
                        completed += a.batch
            elapsed = time.monotonic() - t0
            fleet.stop_all()
            for step in sorted(set(done_at) | set(pending) if retention is not None else requests):
                await count(step)
    finally:
        fleet.stop_all()
        for n, r in relays:
            n.close()
            r.close()
        srv.close()
    rows, resources_ok = resource_rows(sampler, a, a.minutes * 60)
    count = lambda k: sum(1 for x in actions if x[0] == k)  # noqa: E731
    return {**totals, "batches": len(requests), "published": sum(len(r) for r in requests.values()), "completed": completed, "seconds": round(elapsed, 1),
            "workers_started": len(fleet.workers), "actions": {k: count(k) for k in sorted({x[0] for x in actions})},
            "resources": rows, "resources_ok": resources_ok}


async def undo(fleet: WorkerFleet, timer: tuple[float, str, object]) -> None:
    """The end of a timed fault: a stopped worker resumed, a cut link restored."""
    _, what, arg = timer
    if what == "resume" and arg.alive():  # type: ignore[union-attr]
        fleet.resume(arg)  # type: ignore[arg-type]
    elif what == "heal":
        await asyncio.to_thread(arg.restore)  # type: ignore[union-attr]


async def act(a, rng: random.Random, servers_too: bool, fleet: WorkerFleet, srv: faults.Servers,
              slots: list[WorkerProc | None], relays, start, timers: list, actions: list) -> None:
    """One random fault. Slot 0's worker is never killed or terminated (the long-lived one)."""
    kinds = ["kill", "term", "stop", "cut_nats", "cut_redis"] + (["nats_restart", "redis_restart"] if servers_too else [])
    kind = rng.choice(kinds)
    stopped = {id(arg) for _, what, arg in timers if what == "resume"}
    running = [i for i, w in enumerate(slots) if w is not None and w.alive() and id(w) not in stopped]
    t = time.time()
    if kind in ("kill", "term"):
        choices = [i for i in running if i != 0]
        if not choices:
            return
        i = rng.choice(choices)
        w = slots[i]
        assert w is not None
        if kind == "kill":
            fleet.kill(w)
            start(i)
        else:
            fleet.terminate(w)  # replaced once it has drained and left (the main loop)
        actions.append((kind, w.worker_id, t))
    elif kind == "stop":
        if len(running) < 2:
            return  # keep someone working
        w = slots[rng.choice(running)]
        fleet.pause(w)  # type: ignore[arg-type]
        timers.append((time.monotonic() + rng.uniform(a.ack_wait + 1.0, a.ack_wait + 3.0), "resume", w))
        actions.append(("stop", w.worker_id, t))  # type: ignore[union-attr]
    elif kind.startswith("cut_"):
        i = rng.randrange(len(slots))
        relay = relays[i][0 if kind == "cut_nats" else 1]
        if relay.mode != "up":
            return
        await asyncio.to_thread(relay.cut)
        timers.append((time.monotonic() + rng.uniform(2.0, 6.0), "heal", relay))
        actions.append((kind, f"slot{i}", t))
    else:
        await srv.restart(kind.removesuffix("_restart"))
        actions.append((kind, "", t))


def clean(out: dict) -> bool:
    return (out.get("lost", 1) == out.get("duplicated", 1) == out.get("mismatched", 1)
            == out.get("wrong_version_tokens", 1) == out.get("stale_writes_accepted", 1)
            == out.get("epochs_reused", 1) == 0 and out.get("requests") == out.get("published"))  # every one counted


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlboost bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0, help="how long the faults and the stream run")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--batch", type=int, default=24, help="requests per batch (one step each)")
    p.add_argument("--inflight", type=int, default=2, help="batches published and not complete")
    p.add_argument("--min-new", type=int, default=32)
    p.add_argument("--max-new", type=int, default=192)
    p.add_argument("--speed", type=float, default=2.0, help="emulated engine speed (x H100)")
    p.add_argument("--ack-wait", type=float, default=3.0)
    p.add_argument("--every", type=float, default=8.0, help="mean seconds between faults")
    p.add_argument("--sample-s", type=float, default=0.0, help="seconds between samples (0: ~30 a run, 2-30 s)")
    p.add_argument("--warmup", type=float, default=0.25, help="share of a series' span left out of the judgement")
    p.add_argument("--rel-tol", type=float, default=0.05, help="change over the window taken as flat (share of the mean)")
    p.add_argument("--long-lived", type=float, default=0.5,
                   help="a process series is judged if it spans this share of the run")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds for the last batches after the faults")
    p.add_argument("--retention", type=float, default=0.0,
                   help="seconds the servers keep checkpoints and the results/tokens/events/DLQ streams "
                        "(>= 300; 0: the production defaults, a day and more, so retained state is not judged)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the servers' data dir and worker logs")
    report.add_out(p)
    return p


def main(argv: list[str], s: Settings) -> int:
    a = parser().parse_args(argv)
    if a.retention and a.retention < 300:
        raise SystemExit("rlboost bench soak: --retention must be 0 or >= 300 s (each step is counted a minute "
                         "after it completes, while the streams still hold it)")
    root = Path(tempfile.mkdtemp(prefix="rlboost-soak-"))
    try:
        out = asyncio.run(soak(a, root))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_table(out["resources"])
    out["ok"] = clean(out) and out["resources_ok"]
    print(f"soak {a.minutes:g} min: batches {out['batches']} completed {out['completed']} requests "
          f"{out['requests']} lost {out['lost']} dup {out['duplicated']} mismatched {out['mismatched']} "
          f"wrong-version {out['wrong_version_tokens']} stale {out['stale_writes_accepted']} epochs-reused "
          f"{out['epochs_reused']} workers started {out['workers_started']} faults {out['actions']}  -> "
          f"{'OK' if out['ok'] else 'FAILED'}", flush=True)
    return report.finish("soak", out, report.out_dir(a), ok=out["ok"])
