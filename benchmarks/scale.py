"""`rlboost bench scale`: the control plane's cost as the fleet grows: N emulated workers against one NATS and one Redis, per token and per worker, with claim latency and a 30% mass preemption.

For each N of `--workers` (fresh servers each time, started here on free loopback ports): N of
the product's own `RolloutWorker`s, spread over `--hosts` fleet-host processes
(benchmarks/fleet_host.py: real consumers, leases, fenced checkpoints, heartbeats and results,
each instance on its own NATS and Redis connections), generate with the emulated engine at a
fixed token rate per worker (`--rate`; `--total-rate` instead fixes the fleet's rate and divides
it by N). Tokens are the emulated reference (workers/engines/emulated.py), so every result is
checked against what any worker must produce.

Per N, three phases:

- idle (`--idle` s, the fleet up, no requests): what a worker costs by merely being there
  (heartbeats, pull requests, lease and registry traffic), per worker per second, at the servers;
- load: a backlog sized for `--warmup` + `--seconds` at the fleet's rate is published; over the
  `--seconds` window: requests and checkpointed tokens per second, NATS messages and bytes per
  token (the server's own /varz: its monitoring port is opened here), Redis commands per token
  (`INFO commandstats`), each server's CPU-seconds per million tokens (/proc/<pid>/stat) and
  resident memory (and its growth per request in flight), the fleet hosts' and this process's
  CPU, and the claim latency (every `CheckpointStore.claim` a worker makes, timed in its host);
- drain: every request finishes; each must come back exactly once with the reference tokens
  (lost / duplicated / mismatched must be 0). At the largest N (`--preempt`), when the window
  ends 30% of the fleet is preempted at once (`term`: with notice, the drain hand-off; `kill`:
  without, ack_wait and lease expiry): hand-off p99 (preemption to the next claim of each request
  the preempted workers held), time until every orphan is claimed again, tokens regenerated.

Last, each server's CPU is fitted over every phase of every N (least squares, no intercept) as
`a x tokens + b x worker-seconds`: a per-token and a per-worker part. A per-token part that
grows with N, or a poor fit, is where the control plane bends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from rlboost.benchmarks import percentile, report
from rlboost.benchmarks.fleet_host import HostedFleet
from rlboost.benchmarks.throughput import cpu_seconds
from rlboost.config import Settings
from rlboost.services import EmbeddedServices, free_port

POOL = "scale"
LAG = "__loop_lag__"  # a host's event-loop lag line in its claims file
STEP = 1


# ---------------------------------------------------------------------------- the host process


def _host_main(argv: list[str]) -> int:
    """A fleet host (benchmarks/fleet_host.py, unchanged) whose engines generate at a fixed rate
    per worker and whose claims are timed: one JSON line per claim in $RLBOOST_SCALE_CLAIMS."""
    import rlboost.workers.engines as engines
    from rlboost.benchmarks import fleet_host
    from rlboost.checkpoint import CheckpointStore
    from rlboost.workers.engines.emulated import EmulatedEngine, TimingModel

    rate = float(os.environ["RLBOOST_SCALE_RATE"])
    # A step of `live` sequences takes live / rate seconds: `rate` tokens/s whatever the batch.
    engines.engine_from_settings = lambda w, sleep=False: EmulatedEngine(
        speed=1.0, timing=TimingModel(step_base_s=0.0, step_per_seq_s=1.0 / rate, step_per_ctx_token_s=0.0,
                                      prefill_per_token_s=0.0))
    log = open(os.environ["RLBOOST_SCALE_CLAIMS"], "a", buffering=1, encoding="utf-8")
    claim = CheckpointStore.claim

    async def timed_claim(self, rid, owner, *args, **kwargs):
        at, t0 = time.time(), time.perf_counter()
        c = await claim(self, rid, owner, *args, **kwargs)
        log.write(json.dumps([rid, owner, at, time.perf_counter() - t0, c.epoch, len(c.token_ids),
                              bool(kwargs.get("handoff"))]) + "\n")
        return c

    CheckpointStore.claim = timed_claim  # type: ignore[method-assign]
    serve = fleet_host.Host.serve

    async def serve_and_time_the_loop(self) -> None:
        """Also: how late this host's event loop wakes a 50 ms sleep (every worker of the host
        shares it: a claim that waits for the loop is not a slow Redis)."""
        async def lag() -> None:
            while True:
                t0 = time.perf_counter()
                await asyncio.sleep(0.05)
                log.write(json.dumps([LAG, "", time.time(), time.perf_counter() - t0 - 0.05, 0, 0]) + "\n")

        probe = asyncio.create_task(lag(), context=contextvars.Context())  # nobody's instance
        try:
            await serve(self)
        finally:
            probe.cancel()

    fleet_host.Host.serve = serve_and_time_the_loop  # type: ignore[method-assign]
    try:
        return fleet_host.host_main(argv)
    finally:
        log.close()


class ScaleFleet(HostedFleet):
    """`HostedFleet` whose hosts are `_host_main` (fixed-rate engines, timed claims)."""

    rate: float = 100.0

    def open(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        while len(self._procs) < max(1, self.hosts):
            i = len(self._procs)
            env = {**os.environ, "RLBOOST_NATS_URL": self.nats_url, "RLBOOST_REDIS_URL": self.redis_url,
                   "OMP_NUM_THREADS": "1", "RLBOOST_LOG_JSON": "1", "RLBOOST_FLEET_HOST_DIR": str(self.workdir),
                   "RLBOOST_SCALE_RATE": str(self.rate), "RLBOOST_SCALE_CLAIMS": str(self.workdir / f"claims{i}.jsonl"),
                   **self.env}
            log = open(self.workdir / f"host{i}.log", "wb")
            proc = subprocess.Popen([sys.executable, "-m", "rlboost.benchmarks.scale", "--host", "--pool", self.pool,
                                     *self.worker_args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                    env=env, text=True)
            log.close()
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
            self._procs.append(proc)

    def claims(self, lag: bool = False) -> list[tuple]:
        """Every claim (rid, owner, wall time, seconds, epoch, tokens resumed, from the resume lane);
        `lag`: the hosts' loop lags."""
        out = []
        for path in sorted(self.workdir.glob("claims*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    row = tuple(json.loads(line))
                    if (row[0] == LAG) == lag:
                        out.append(row)
                except ValueError:  # a host killed mid-line
                    pass
        return out


# ---------------------------------------------------------------------------- the servers


class MonitoredServices(EmbeddedServices):
    """The embedded servers, NATS with its monitoring port open (/varz: messages, bytes)."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.monitor_port = free_port(settings.bind)

    def _command(self, which: str, port: int, node: int = 0) -> list[str]:
        cmd = super()._command(which, port, node)
        return [*cmd, "-m", str(self.monitor_port)] if which == "nats" else cmd


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Probe:
    """Snapshots of what the servers say they did, and the CPU of every process involved."""

    def __init__(self, monitor_port: int, redis_url: str, pids: dict[str, int], fleet: ScaleFleet) -> None:
        import redis

        self.varz_url = f"http://127.0.0.1:{monitor_port}/varz"
        self.redis = redis.Redis.from_url(redis_url)
        self.pids, self.fleet = pids, fleet

    def snap(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.varz_url, timeout=10) as r:
            varz = json.loads(r.read())
        stats = self.redis.info("commandstats")
        cmds = {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}
        usec = {k.removeprefix("cmdstat_"): {"usec": v["usec"], "calls": v["calls"]} for k, v in stats.items()}
        cpu = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        cpu["hosts"] = sum(cpu_seconds(p.pid) for p in self.fleet._procs)
        cpu["bench"] = cpu_seconds(os.getpid())
        return {"t": time.monotonic(), "msgs": varz["in_msgs"] + varz["out_msgs"], "in_msgs": varz["in_msgs"],
                "bytes": varz["in_bytes"] + varz["out_bytes"], "cmds": cmds, "usec": usec, "cpu": cpu,
                "rss": {name: rss_bytes(pid) for name, pid in self.pids.items()},
                "checkpointed": sum(w.counters()["checkpointed"] for w in self.fleet.workers.values()),
                "connections": varz.get("connections", 0)}

    def close(self) -> None:
        self.redis.close()


def _top_usec(a: dict[str, Any], b: dict[str, Any], n: int = 3) -> dict[str, dict[str, int]]:
    """Redis's own time per call of the commands it spent most time on between two snapshots."""
    d = {k: {"usec": v["usec"] - a["usec"].get(k, {}).get("usec", 0),
             "calls": v["calls"] - a["usec"].get(k, {}).get("calls", 0)} for k, v in b["usec"].items()}
    return dict(sorted(d.items(), key=lambda kv: -kv[1]["usec"])[:n])


def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    cmds = Counter(b["cmds"])
    cmds.subtract(a["cmds"])
    return {"s": b["t"] - a["t"], "msgs": b["msgs"] - a["msgs"], "in_msgs": b["in_msgs"] - a["in_msgs"], "bytes": b["bytes"] - a["bytes"],
            "cmds": +cmds, "cpu": {k: b["cpu"][k] - a["cpu"].get(k, 0.0) for k in b["cpu"]},
            "tokens": b["checkpointed"] - a["checkpointed"]}


# ---------------------------------------------------------------------------- one fleet size


def _requests(n: int, tokens: int, tag: str) -> list:
    from rlboost import wire

    return [wire.RolloutRequest(request_id=wire.request_id(STEP, i, 0, tag), step=STEP, policy_version=0,
                                prompt_ids=[1 + i % 97] * 16, max_new_tokens=tokens, seed=10_000 + i, group=i)
            for i in range(n)]


def check_results(reqs: list, got: dict[str, list]) -> dict[str, int]:
    """Every request answered exactly once, with exactly the emulated reference's tokens."""
    from rlboost.workers.engines.emulated import LengthModel, reference_tokens

    lengths = LengthModel()
    lost = dup = bad = 0
    for r in reqs:
        results = got.get(r.request_id, [])
        if not results:
            lost += 1
            continue
        dup += len(results) > 1
        res = results[0]
        n = min(r.max_new_tokens, lengths.length(r.seed, r.request_id))
        toks, lps = reference_tokens(r.seed, r.request_id, 0, n)
        if res.finish_reason == "error" or list(res.token_ids) != toks or \
                any(abs(x - y) > 1e-6 for x, y in zip(res.logprobs, lps, strict=False)) or len(res.logprobs) != n:
            bad += 1
    return {"lost": lost, "duplicated": dup, "mismatched": bad, "stray": sum(1 for k in got if k not in
                                                                          {r.request_id for r in reqs})}


async def _wait_registered(c, n: int, timeout_s: float) -> float:
    from rlboost import bus

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with_keys = len(await bus.worker_keys(c.js))
        if with_keys >= n:
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    raise TimeoutError(f"only {with_keys} of {n} workers registered within {timeout_s:.0f} s")


async def one_size(a: argparse.Namespace, n: int, preempt: bool, nats_url: str, redis_url: str,
                   monitor_port: int, pids: dict[str, int], workdir: Path) -> dict[str, Any]:
    """One fleet size on its own servers: the idle, load and drain phases, then their figures."""
    from rlboost import wire
    from rlboost.clients import open_clients

    rate = a.total_rate / n if a.total_rate else a.rate
    hosts = a.hosts or max(2, min(8, math.ceil(n / 64)))
    fleet = ScaleFleet(nats_url, redis_url, workdir, POOL, hosts=hosts, env={"RLBOOST_LOG_LEVEL": "error"},
                       worker_args=["--engine", "emulated", "--slots", str(a.slots),
                                    "--checkpoint-tokens", str(a.chunk), *shlex.split(a.worker_args)])
    fleet.rate = rate
    out: dict[str, Any] = {"workers": n, "hosts": hosts, "rate_per_worker": round(rate, 2), "slots": a.slots,
                           "chunk": a.chunk, "tokens_per_request": a.tokens}
    got: dict[str, list] = {}  # request id -> its results, as they arrive
    arrived: dict[str, float] = {}  # request id -> when its first result did (wall clock)
    async with open_clients(nats_url, redis_url, "rlboost-bench-scale", pools=(POOL,)) as c:
        probe = Probe(monitor_port, redis_url, pids, fleet)
        sub = await c.js.subscribe(wire.result_subject(STEP), ordered_consumer=True)

        async def collect() -> None:
            async for m in sub.messages:
                r = wire.decode(wire.RolloutResult, m.data)
                got.setdefault(r.request_id, []).append(r)
                arrived.setdefault(r.request_id, time.time())

        collector = asyncio.create_task(collect())
        try:
            ph = await _phases(a, n, rate, preempt, c, fleet, probe, got, out)
        finally:
            collector.cancel()
            await sub.unsubscribe()
            await asyncio.to_thread(fleet.stop_all, 30.0)
            probe.close()
        generated = sum(w.counters()["generated"] for w in fleet.workers.values())
    out.update(_figures(a, n, rate, ph, fleet, got, generated))
    if ph["pre"]:
        out["preemption"] = _handoff(ph["pre"], fleet.claims(), arrived,
                                     {rid: rs[0].worker_id for rid, rs in got.items()})
    # the points of the CPU fit: (tokens, worker-seconds, cpu-s per server) of each phase
    out["_fit"] = [(0, n * ph["idle"]["s"], ph["idle"]["cpu"]), (ph["load"]["tokens"], n * ph["load"]["s"],
                                                                   ph["load"]["cpu"])]
    return out


async def _phases(a: argparse.Namespace, n: int, rate: float, preempt: bool, c, fleet: ScaleFleet, probe: Probe,
                  got: dict[str, list], out: dict[str, Any]) -> dict[str, Any]:
    """Start the fleet; the idle phase, the load (a backlog published, the window measured), the
    preemption and the drain. Their timings go into `out`; their snapshots come back."""
    from rlboost.pool_client import PoolClient

    t_start = time.monotonic()
    for _ in range(n):
        fleet.start()
    out["startup_s"] = round(await _wait_registered(c, n, a.startup_timeout + n * 0.5), 1)
    await asyncio.sleep(2.0)  # every worker past its first heartbeat and pull
    # -- idle
    s0 = probe.snap()
    await asyncio.sleep(a.idle)
    s1 = probe.snap()
    # -- load
    m = max(n * a.slots, math.ceil(n * rate * (a.warmup + a.seconds) * 1.1 / a.tokens))
    reqs = _requests(m, a.tokens, f"scale{n}")
    t_pub, t_pub_wall = time.monotonic(), time.time()
    await PoolClient(c, POOL).publish_step(reqs)
    out["publish_s"] = round(time.monotonic() - t_pub, 2)
    await asyncio.sleep(max(0.0, a.warmup - (time.monotonic() - t_pub)))
    s2, w0, done0 = probe.snap(), time.time(), len(got)
    await asyncio.sleep(a.seconds)
    s3, w1, done1 = probe.snap(), time.time(), len(got)
    # -- preemption / drain
    pre = _preempt(a, n, fleet) if preempt else {}
    # a request takes tokens x slots / rate at the least: the drain waits for twice that
    deadline = time.monotonic() + max(a.drain_timeout, 2 * a.tokens * a.slots / rate + 30)
    while len(got) < len(reqs) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    out["drain_s"] = round(time.monotonic() - t_pub - a.warmup - a.seconds, 1)
    out["total_s"] = round(time.monotonic() - t_start, 1)
    await asyncio.sleep(0.5)  # a duplicate would come now
    return {"reqs": reqs, "idle": delta(s0, s1), "load": delta(s2, s3), "rss_idle": s1["rss"], "rss_load": s3["rss"],
            "top_usec": _top_usec(s2, s3), "t_pub_wall": t_pub_wall, "w0": w0, "w1": w1,
            "done": done1 - done0, "pre": pre}


def _preempt(a: argparse.Namespace, n: int, fleet: ScaleFleet) -> dict[str, Any]:
    """30% of the live fleet at once: with notice (`term`) or without (`kill`)."""
    live = fleet.live()
    victims = random.Random(n).sample(live, round(0.3 * len(live)))
    t_pre = time.time()
    for w in victims:
        if a.preempt_mode == "kill":  # no notice; not `fleet.kill`, which waits for each
            fleet._send(w.host, f"kill {w.worker_id}")
            w.fate = "killed"
        else:
            fleet.terminate(w)
    return {"preempted": len(victims), "mode": a.preempt_mode, "t": t_pre, "ids": {w.worker_id for w in victims}}


def _figures(a: argparse.Namespace, n: int, rate: float, ph: dict[str, Any], fleet: ScaleFleet,
             got: dict[str, list], generated: int) -> dict[str, Any]:
    """One size's figures from its phases' snapshots and the claims its hosts timed."""
    reqs, idle, load, w0, w1 = ph["reqs"], ph["idle"], ph["load"], ph["w0"], ph["w1"]
    claims = fleet.claims()
    lags = [row[3] * 1000 for row in fleet.claims(lag=True) if ph["t_pub_wall"] <= row[2] < w1]
    # every claim from the publish to the window's end: the step's first burst (N x slots at once)
    # and the steady claims of finished requests' successors
    window = [cl for cl in claims if ph["t_pub_wall"] <= cl[2] < w1]
    steady = [cl for cl in window if cl[2] >= w0]  # the window's own: no first burst
    secs = load["s"]
    tokens = max(1, load["tokens"])
    rss_idle, rss_load = ph["rss_idle"], ph["rss_load"]
    in_flight = n * a.slots
    out = {
        "requests": len(reqs),
        "requests_per_s": round(ph["done"] / secs, 1),
        "tokens_per_s": round(load["tokens"] / secs),
        "target_tokens_per_s": round(n * rate),
        "claim_p50_ms": percentile([cl[3] * 1000 for cl in window], 0.5),
        "claim_p99_ms": percentile([cl[3] * 1000 for cl in window], 0.99),
        "claims": len(window),
        "claim_steady_p50_ms": percentile([cl[3] * 1000 for cl in steady], 0.5),
        "claim_steady_p99_ms": percentile([cl[3] * 1000 for cl in steady], 0.99),
        "host_loop_lag_p50_ms": percentile(lags, 0.5), "host_loop_lag_p99_ms": percentile(lags, 0.99),
        "redis_usec_per_call": {k: round(v["usec"] / max(1, v["calls"]), 1) for k, v in ph["top_usec"].items()},
        "nats_msgs_per_token": round(load["msgs"] / tokens, 3),
        "nats_bytes_per_token": round(load["bytes"] / tokens, 1),
        "redis_cmds_per_token": round(sum(load["cmds"].values()) / tokens, 3),
        "redis_top_cmds": dict(load["cmds"].most_common(4)),
        "cpu_s_per_mtok": {k: round(load["cpu"][k] / tokens * 1e6, 1) for k in ("nats-server", "redis-server", "hosts")},
        "cores_busy": {k: round(v / secs, 2) for k, v in load["cpu"].items()},
        "rss_mb": {k: round(v / 2**20, 1) for k, v in rss_load.items()},
        "rss_kb_per_request_in_flight": {k: round((rss_load[k] - rss_idle[k]) / 1024 / in_flight, 2) for k in rss_load},
        "idle_per_worker_s": {"nats_msgs": round(idle["msgs"] / n / idle["s"], 2),
                              "nats_in_msgs": round(idle["in_msgs"] / n / idle["s"], 2),
                              "nats_bytes": round(idle["bytes"] / n / idle["s"]),
                              "redis_cmds": round(sum(idle["cmds"].values()) / n / idle["s"], 2),
                              "redis_top_cmds": dict(idle["cmds"].most_common(3)),
                              "cpu_ms": {k: round(idle["cpu"][k] / n / idle["s"] * 1000, 3)
                                         for k in ("nats-server", "redis-server", "hosts")}},
        "generated_tokens": generated,
        "result_tokens": sum(len(rs[0].token_ids) for rs in got.values()),
    }
    # generated and never in a result: regenerated (only once every request is in; until then the
    # unfinished requests' tokens count too)
    out["regenerated_tokens"] = out["generated_tokens"] - out["result_tokens"] if len(got) >= len(reqs) else None
    out.update(check_results(reqs, got))
    return out


def _handoff(pre: dict[str, Any], claims: list, arrived: dict[str, float], by: dict[str, str]) -> dict[str, Any]:
    """The requests the preempted workers held at the preemption (the highest lease epoch claimed
    before it is theirs, no result yet) and when each was next claimed by another worker."""
    t, victims = pre["t"], pre["ids"]
    held: dict[str, tuple] = {}
    for cl in claims:
        if cl[2] < t and (cl[0] not in held or cl[4] > held[cl[0]][4]):
            held[cl[0]] = cl
    orphans = {rid for rid, cl in held.items() if cl[1] in victims and arrived.get(rid, math.inf) >= t}
    after: dict[str, tuple] = {}  # an orphan's next lease: the lowest epoch above the victim's, not a victim's
    for cl in claims:
        rid = cl[0]
        if rid in orphans and cl[4] > held[rid][4] and cl[1] not in victims and \
                (rid not in after or cl[4] < after[rid][4]):
            after[rid] = cl
    waits = [max(0.0, cl[2] - t) * 1000 for cl in after.values()]
    # with notice, a preempted worker finishes what it can within its grace: not an orphan
    finished_in_grace = {rid for rid in orphans - set(after) if by.get(rid) in victims}
    orphans -= finished_in_grace
    return {"preempted_workers": pre["preempted"], "mode": pre["mode"], "orphaned_requests": len(orphans),
            "finished_in_grace": len(finished_in_grace),
            "reclaimed": len(waits), "from_resume_lane": sum(1 for cl in after.values() if len(cl) > 6 and cl[6]),
            "resumed_tokens": sum(cl[5] for cl in after.values()),
            "handoff_p50_ms": percentile(waits, 0.5), "handoff_p99_ms": percentile(waits, 0.99),
            "all_reclaimed_s": round(max(waits) / 1000, 2) if waits and len(waits) == len(orphans) else None,
            "reclaimed_after_2s": sum(1 for w in waits if w > 2000)}  # e.g. not handed off: back after ack_wait


def fit(points: list[tuple[float, float, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """cpu-s = a x tokens + b x worker-seconds, per process, least squares without intercept."""
    import numpy as np

    x = np.array([[p[0], p[1]] for p in points], dtype=float)
    out = {}
    for name in ("nats-server", "redis-server", "hosts"):
        y = np.array([p[2][name] for p in points], dtype=float)
        (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
        pred = x @ np.array([a, b])
        ss = float(((y - y.mean()) ** 2).sum()) or 1e-12
        out[name] = {"cpu_s_per_mtok": round(a * 1e6, 1), "cpu_ms_per_worker_s": round(b * 1e3, 3),
                     "r2": round(1 - float(((y - pred) ** 2).sum()) / ss, 3)}
    return out


# ---------------------------------------------------------------------------- the bench


def run(a: argparse.Namespace, s: Settings) -> dict[str, Any]:
    sizes = a.workers
    runs = []
    for n in sizes:
        s.services.nats_url = s.services.redis_url = ""  # servers of its own, never configured ones
        s.services.data_dir = tempfile.mkdtemp(prefix=f"rlboost-scale-{n}-")
        workdir = Path(tempfile.mkdtemp(prefix=f"rlboost-scale-fleet-{n}-"))
        svc = MonitoredServices(s.services)
        st, _ = svc.up()
        try:
            pids = {"nats-server": st.nats_pid, "redis-server": st.redis_pid}
            r = asyncio.run(one_size(a, n, a.preempt and n == sizes[-1], svc.nats_url(st), svc.redis_url(st),
                                     svc.monitor_port, pids, workdir))
        finally:
            svc.stop_recorded()
            if not a.keep:
                shutil.rmtree(s.services.data_dir, ignore_errors=True)
                shutil.rmtree(workdir, ignore_errors=True)
        runs.append(r)
        _print_row(r)
    points = [p for r in runs for p in r.pop("_fit")]
    out: dict[str, Any] = {"runs": runs, "fit": fit(points), "load_avg": list(os.getloadavg()),
                           "cpus": os.cpu_count(), "mode": "total_rate" if a.total_rate else "rate_per_worker"}
    out["ok"] = all(r["lost"] == r["duplicated"] == r["mismatched"] == 0 for r in runs)
    return out


def _print_row(r: dict[str, Any]) -> None:
    cpu = r["cpu_s_per_mtok"]
    idle = r["idle_per_worker_s"]
    print(f"N={r['workers']:5d} ({r['hosts']} hosts, {r['rate_per_worker']} tok/s each): "
          f"{r['tokens_per_s']:,} tok/s of {r['target_tokens_per_s']:,}, {r['requests_per_s']} req/s; "
          f"claim p50/p99 {r['claim_p50_ms']}/{r['claim_p99_ms']} ms (window only "
          f"{r['claim_steady_p50_ms']}/{r['claim_steady_p99_ms']}; hosts' loop lag p99 "
          f"{r['host_loop_lag_p99_ms']} ms); "
          f"NATS {r['nats_msgs_per_token']} msgs {r['nats_bytes_per_token']} B /tok; "
          f"Redis {r['redis_cmds_per_token']} cmds/tok; CPU-s/Mtok nats {cpu['nats-server']} redis "
          f"{cpu['redis-server']} hosts {cpu['hosts']}; cores {r['cores_busy']}; idle/worker/s: "
          f"{idle['nats_msgs']} msgs {idle['nats_bytes']} B {idle['redis_cmds']} cmds; "
          f"lost/dup/bad {r['lost']}/{r['duplicated']}/{r['mismatched']}", flush=True)
    if "preemption" in r:
        p = r["preemption"]
        print(f"   preemption ({p['mode']}) of {p['preempted_workers']} workers: {p['orphaned_requests']} orphans, "
              f"{p['reclaimed']} reclaimed ({p['from_resume_lane']} from the resume lane; {p['finished_in_grace']} "
              f"finished in their notice), hand-off p50/p99 "
              f"{p['handoff_p50_ms']}/{p['handoff_p99_ms']} ms, "
              f"all reclaimed after {p['all_reclaimed_s']} s ({p['reclaimed_after_2s']} after > 2 s), "
              f"{r['regenerated_tokens']} tokens regenerated",
              flush=True)


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench scale", description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="8,32,128", help="comma-separated fleet sizes N, one run each")
    p.add_argument("--rate", type=float, default=100.0, help="tokens/s each worker generates (fixed per worker)")
    p.add_argument("--total-rate", type=float, default=0.0,
                   help="tokens/s of the whole fleet, divided by N (instead of --rate)")
    p.add_argument("--slots", type=int, default=8, help="requests in flight per worker")
    p.add_argument("--chunk", type=int, default=16, help="K: checkpoint every K tokens")
    p.add_argument("--tokens", type=int, default=128, help="max new tokens per request")
    p.add_argument("--hosts", type=int, default=0, help="fleet-host processes (0: N/64, 2 to 8)")
    p.add_argument("--idle", type=float, default=4.0, help="seconds of the idle phase")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds from publishing to the window")
    p.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    p.add_argument("--preempt", action=argparse.BooleanOptionalAction, default=True,
                   help="at the largest N, preempt 30%% of the fleet at once when the window ends")
    p.add_argument("--preempt-mode", choices=("term", "kill"), default="term",
                   help="term: with notice (drain hand-off); kill: without (ack_wait, lease expiry)")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="seconds (+0.5 s per worker) to register")
    p.add_argument("--drain-timeout", type=float, default=120.0, help="seconds for the last requests after the window")
    p.add_argument("--worker-args", default="",
                   help="more worker arguments for every worker, e.g. \"--worker.heartbeat_s 4\" (`rlboost worker --help`)")
    p.add_argument("--keep", action="store_true", help="keep the servers' data and the hosts' logs (temp dirs)")
    report.add_out(p)
    a = p.parse_args(argv)
    try:
        a.workers = [int(x) for x in a.workers.split(",") if x.strip()]
    except ValueError:
        p.error("--workers: comma-separated integers")
    if not a.workers or min(a.workers) < 1:
        p.error("--workers: at least one size >= 1")
    out = run(a, s)
    f = out["fit"]
    print("CPU fit over every phase (cpu-s = a x tokens + b x worker-seconds): " + "; ".join(
        f"{k} {v['cpu_s_per_mtok']} s/Mtok + {v['cpu_ms_per_worker_s']} ms per worker-s (r2 {v['r2']})"
        for k, v in f.items()))
    print(f"load average {', '.join(f'{x:.1f}' for x in out['load_avg'])} on {out['cpus']} CPUs -> "
          f"{'OK' if out['ok'] else 'REQUESTS LOST, DUPLICATED OR WRONG'}")
    return report.finish("scale", out, report.out_dir(a), ok=out["ok"])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--host"]:
        sys.exit(_host_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:], Settings()))
