"""Aggregate tokens/s through real worker processes at unlimited engine speed (the wire's ceiling).

Used by `rlboost bench dataflow --workers N`. The engines compute nothing and never sleep, so
everything measured is the dataflow itself: fenced checkpoint appends (Redis), token-chunk and
result publishes (JetStream), fetch/ack. Tokens are counted from the workers' crash-proof
counters (checkpointed = made durable) over a fixed window after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from rlboost import wire
from rlboost.cli import print_result
from rlboost.clients import open_clients
from rlboost.config import Settings
from rlboost.services import EmbeddedServices, running_services
from workers.fleet import WorkerFleet

POOL = "throughput"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(a: argparse.Namespace, nats_url: str, redis_url: str, workdir: Path,
                  server_pids: dict[str, int]) -> dict:
    slots = max(1, a.requests // a.workers)
    fleet = WorkerFleet(nats_url, redis_url, workdir, POOL, worker_args=[
        "--engine", "emulated", "--speed", "0", "--slots", str(slots), "--checkpoint-tokens", str(a.chunk)],
        env={"RLBOOST_LOG_LEVEL": "warning"})
    async with open_clients(nats_url, redis_url, "rlboost-bench-throughput", pools=(POOL,)) as c:
        total = a.requests * 4  # a backlog, so finished requests are replaced and 1000 stay in flight
        acks = [await c.js.publish_async(wire.request_subject(POOL), wire.encode(wire.RolloutRequest(
            request_id=wire.request_id(1, i, 0), step=1, policy_version=0, prompt_ids=[1] * 64,
            max_new_tokens=a.tokens, seed=i, group=i))) for i in range(total)]
        await asyncio.gather(*acks)
        for _ in range(a.workers):
            fleet.start()

        def checkpointed() -> int:
            return sum(w.counters()["checkpointed"] for w in fleet.workers.values())

        await asyncio.sleep(a.warmup)

        def cpu() -> dict[str, float]:
            out = {name: cpu_seconds(pid) for name, pid in server_pids.items()}
            out["workers"] = sum(cpu_seconds(w.proc.pid) for w in fleet.workers.values())
            out["bench"] = cpu_seconds(os.getpid())
            return out

        n0, t0, c0 = checkpointed(), time.perf_counter(), cpu()
        await asyncio.sleep(a.seconds)
        n1, t1, c1 = checkpointed(), time.perf_counter(), cpu()
        results = sum(w.counters()["results"] for w in fleet.workers.values())
        fleet.stop_all()
    window = t1 - t0
    return {"tokens_per_s": round((n1 - n0) / window), "workers": a.workers, "concurrent_requests": a.requests,
            "cpu_cores_used": {k: round((c1[k] - c0[k]) / window, 2) for k in c1},
            "slots_per_worker": slots, "chunk": a.chunk, "window_s": a.seconds, "results": results}


def run_fleet(a: argparse.Namespace, s: Settings) -> int:
    a.tokens = max(a.tokens, 4096)
    a.warmup = getattr(a, "warmup", 5.0)
    a.seconds = getattr(a, "seconds", 15.0)
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-bench-")
    workdir = Path(tempfile.mkdtemp(prefix="rlboost-throughput-"))
    with running_services(s.services) as (nats_url, redis_url):
        st = EmbeddedServices(s.services).state()
        pids = {"nats-server": st.nats_pid, "redis-server": st.redis_pid} if st else {}
        out = asyncio.run(measure(a, nats_url, redis_url, workdir, pids))
    print(f"{out['workers']} workers x {out['slots_per_worker']} slots, emulated engine at unlimited speed: "
          f"{out['tokens_per_s']:,} checkpointed tokens/s (K={out['chunk']})")
    print("where the time goes (cores busy during the window): "
          + ", ".join(f"{k} {v}" for k, v in out["cpu_cores_used"].items()))
    print_result(out)
    return 0
