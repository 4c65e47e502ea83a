"""`rlboost bench endpoint`: calls/s and latency of `rlboost serve-openai` over HTTP, each call a checkpointed request.

An emulated worker at unlimited speed generates, so what is measured is the endpoint and the
dataflow around it: HTTP (aiohttp), the chat template, the publish on the work queue, the worker's
claim, checkpoint appends and result, the result's verification against Redis, the session
record (fsynced) and the answer. Everything runs in this process on one event loop (client,
endpoint and worker), against embedded NATS and Redis (or the configured ones).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import httpx
import numpy as np

from rlboost.clients import open_clients
from rlboost.config import EndpointSettings, Settings, WorkerSettings
from rlboost.endpoint import OpenAIEndpoint, read_sessions
from rlboost.envs import calculator as calc
from rlboost.services import running_services
from rlboost.benchmarks import report
from rlboost.trainer.model import build_tokenizer
from rlboost.workers.counters import Counters
from rlboost.workers.engines.emulated import EmulatedEngine, LengthModel
from rlboost.workers.worker import RolloutWorker

TOKEN = "bench-token"


async def run(nats_url: str, redis_url: str, calls: int, concurrency: int, tokens: int, run_dir: str) -> dict:
    tok = build_tokenizer(calc.ALPHABET)
    pool = "bench-endpoint"
    async with open_clients(nats_url, redis_url, "rlboost-bench-endpoint", pools=(pool,)) as c:
        engine = EmulatedEngine(speed=0, vocab=len(tok), lengths=LengthModel(median=1e9))
        worker = RolloutWorker(WorkerSettings(pool=pool, slots=max(32, concurrency)), engine, c,
                               worker_id=f"{pool}-w0", counters=Counters())
        wtask = asyncio.create_task(worker.run())
        ep = OpenAIEndpoint(c, EndpointSettings(port=0, pool=pool, max_inflight=max(256, concurrency)), tok,
                            [tok.eos_token_id], run_dir, token=TOKEN)
        await ep.start()
        latencies: list[float] = []
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(calls):
            queue.put_nowait(i)

        async def client(h: httpx.AsyncClient) -> None:
            while not queue.empty():
                i = queue.get_nowait()
                body = {"messages": [{"role": "user", "content": f"{i} + {i} = ?"}], "max_tokens": tokens,
                        "seed": i, "tools": [calc.CALC.openai()]}
                t0 = time.perf_counter()
                r = await h.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"s{i % 64}"})
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"call {i}: {r.status_code} {r.text[:200]}")

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ep.address[1]}", limits=limits, timeout=120,
                                         headers={"Authorization": f"Bearer {TOKEN}"}) as h:
                await client_warmup(h)
                latencies.clear()
                t0 = time.perf_counter()
                await asyncio.gather(*(client(h) for _ in range(concurrency)))
                wall = time.perf_counter() - t0
        finally:
            await ep.close()
            worker.request_drain("bench over")
            await wtask
            await RolloutWorker.settled()
    recorded = sum(len(s.calls) for s in read_sessions(run_dir))
    lat = np.asarray(latencies) * 1000
    return {"calls": calls, "concurrency": concurrency, "tokens_per_call": tokens, "calls_per_s": round(calls / wall, 1),
            "tokens_per_s": round(calls * tokens / wall), "p50_ms": round(float(np.percentile(lat, 50)), 1),
            "p99_ms": round(float(np.percentile(lat, 99)), 1), "recorded": recorded - 1}


async def client_warmup(h: httpx.AsyncClient) -> None:
    """One call first: the stream and consumer look-ups of the first publish are not the rate."""
    r = await h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1 + 1 = ?"}],
                                                   "max_tokens": 4}, headers={"X-Session-Id": "warmup"})
    r.raise_for_status()


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench endpoint", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16, help="calls in flight at once (HTTP connections)")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per call")
    report.add_out(p)
    a = p.parse_args(argv)
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-bench-")
    run_dir = tempfile.mkdtemp(prefix="rlboost-bench-endpoint-")
    with running_services(s.services) as (nats_url, redis_url):
        out = asyncio.run(run(nats_url, redis_url, a.calls, a.concurrency, a.tokens, run_dir))
    print(f"{out['calls']} calls, {out['concurrency']} at once, {out['tokens_per_call']} tokens each: "
          f"{out['calls_per_s']} calls/s, p50 {out['p50_ms']} ms, p99 {out['p99_ms']} ms; "
          f"{out['recorded']} recorded")
    return report.finish("endpoint", out, report.out_dir(a), ok=out["recorded"] == out["calls"])
