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

import redis.asyncio as aioredis

from rlboost import wire
from rlboost.checkpoint import pack
from rlboost.clients import open_clients
from rlboost.config import Settings
from rlboost.services import EmbeddedServices, running_services
from rlboost.benchmarks import report
from rlboost.workers.fleet import WorkerFleet

POOL = "throughput"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chunk_records(i: int, r: int, k: int) -> tuple[list[int], list[float]]:
    return [(i * 7 + r * k + j) % 50000 for j in range(k)], [-0.5] * k



async def raw_rounds(client: aioredis.Redis, rids: list[str], tokens: int, k: int, groups: int) -> float:
    async def group(members: list[str]) -> None:
        for r in range(tokens // k):
            async with client.pipeline(transaction=False) as pipe:
                for i, rid in enumerate(members):
                    pipe.append(f"raw:{rid}", pack(*chunk_records(i, r, k)))
                await pipe.execute()

    t0 = time.perf_counter()
    await asyncio.gather(*(group(rids[g::groups]) for g in range(groups)))
    return time.perf_counter() - t0


async def raw_rates(nats_url: str, redis_url: str, a: argparse.Namespace, seconds: float = 2.0) -> dict:
    """The servers' own ceilings, on the same servers in the same run (after the fleet stopped):
    pipelined `APPEND` of the same packed K-token records (no fencing), from as many
    concurrent pipelines as there were workers; and JetStream `publish_async` of one
    K-token chunk per message (the old wire: one message per request per flush)."""
    raw = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(redis_url,
                                                                                max_connections=a.workers + 2))
    try:
        rids = [f"raw-{i}" for i in range(a.requests)]
        per_round = max(1, round(seconds * 60_000 / a.requests))  # ~`seconds` at ~60K APPEND/s
        raw_s = await raw_rounds(raw, rids, per_round * a.chunk, a.chunk, a.workers)
        redis_appends = a.requests * per_round / raw_s
    finally:
        await raw.aclose()
    chunk = wire.TokenChunk(request_id=wire.request_id(1, 0, 0), step=1, worker_id="raw-bench", epoch=2**50,
                            offset=0, token_ids=list(range(1000, 1000 + a.chunk)), logprobs=[-1.5] * a.chunk,
                            policy_version=0, ts=time.time())
    payload = wire.encode(chunk)
    async with open_clients(nats_url, redis_url, "rlboost-bench-raw", pools=(POOL,)) as c:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            await asyncio.gather(*[await c.js.publish_async(wire.token_subject(0, "raw-bench"), payload)
                                   for _ in range(1000)])
            n += 1000
        nats_msgs = n / (time.perf_counter() - t0)
    return {"raw_redis_append_per_s": round(redis_appends), "raw_redis_tokens_per_s": round(redis_appends * a.chunk),
            "raw_nats_publish_per_s": round(nats_msgs), "raw_nats_tokens_per_s": round(nats_msgs * a.chunk),
            "raw_chunk_message_bytes": len(payload)}


async def measure(a: argparse.Namespace, nats_url: str, redis_url: str, workdir: Path,
                  server_pids: dict[str, int]) -> dict:
    slots = max(1, a.requests // a.workers)
    fleet = WorkerFleet(nats_url, redis_url, workdir, POOL, worker_args=[
        "--engine", "emulated", "--speed", "0", "--slots", str(slots), "--checkpoint-tokens", str(a.chunk)],
        env={"RLBOOST_LOG_LEVEL": "warning"})
    async with open_clients(nats_url, redis_url, "rlboost-bench-throughput", pools=(POOL,)) as c:
        # A backlog, so finished requests are replaced and `requests` stay in flight for the whole
        # run: enough for 1M tokens/s through warm-up and window (responses average ~1,600 tokens).
        total = max(a.requests * 4, int((a.warmup + a.seconds) * 1_000_000 / 1_000))
        acks = [await c.js.publish_async(wire.request_subject(POOL), wire.encode(wire.RolloutRequest(
            request_id=wire.request_id(1, i, 0), step=1, policy_version=0, prompt_ids=[1] * 64,
            max_new_tokens=a.tokens, seed=i, group=i))) for i in range(total)]
        await asyncio.gather(*acks)
        for _ in range(a.workers):
            fleet.start()

        def checkpointed() -> int:
            return sum(w.counters()["checkpointed"] for w in fleet.workers.values())

        async def token_messages() -> int:
            return (await c.js.stream_info(wire.STREAM_TOKENS)).state.messages

        await asyncio.sleep(a.warmup)

        def cpu() -> dict[str, float]:
            out = {name: cpu_seconds(pid) for name, pid in server_pids.items()}
            out["workers"] = sum(cpu_seconds(w.proc.pid) for w in fleet.workers.values())
            out["bench"] = cpu_seconds(os.getpid())
            return out

        n0, m0, t0, c0 = checkpointed(), await token_messages(), time.perf_counter(), cpu()
        await asyncio.sleep(a.seconds)
        n1, t1, c1 = checkpointed(), time.perf_counter(), cpu()
        m1 = await token_messages()
        results = sum(w.counters()["results"] for w in fleet.workers.values())
        fleet.stop_all()
    window = t1 - t0
    chunks = max(1, (n1 - n0) / a.chunk)
    out = {"tokens_per_s": round((n1 - n0) / window), "workers": a.workers, "concurrent_requests": a.requests,
           "cpu_cores_used": {k: round((c1[k] - c0[k]) / window, 2) for k in c1},
           "cpu_us_per_chunk": {k: round((c1[k] - c0[k]) / chunks * 1e6, 1) for k in c1 if k != "bench"},
           "chunks_per_token_message": round(chunks / max(1, m1 - m0), 1),
           "slots_per_worker": slots, "chunk": a.chunk, "window_s": a.seconds, "results": results}
    out.update(await raw_rates(nats_url, redis_url, a))
    return out


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
          f"{out['tokens_per_s']:,} checkpointed tokens/s (K={out['chunk']}, "
          f"{out['chunks_per_token_message']} chunks per token message)")
    print(f"CPU per {out['chunk']}-token chunk: "
          + ", ".join(f"{k} {v} us" for k, v in out["cpu_us_per_chunk"].items())
          + "  (cores busy: " + ", ".join(f"{k} {v}" for k, v in out["cpu_cores_used"].items()) + ")")
    print(f"same servers, same run: raw pipelined Redis APPEND {out['raw_redis_tokens_per_s']:,} tokens/s "
          f"({out['raw_redis_append_per_s']:,} appends/s); raw JetStream publish {out['raw_nats_publish_per_s']:,} "
          f"msgs/s (= {out['raw_nats_tokens_per_s']:,} tokens/s at one {out['raw_chunk_message_bytes']}-byte "
          f"message per chunk)")
    return report.finish("dataflow", out, report.out_dir(a))  # `bench dataflow --workers N`
