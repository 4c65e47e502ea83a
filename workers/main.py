"""`rlboost worker`: one rollout worker process. Scale out by starting more of them."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from rlboost import metrics
from rlboost.clients import open_clients
from rlboost.config import Settings
from rlboost.logs import get_logger
from rlboost.services import resolve_urls
from rlboost.weights import VersionPointer, WeightCache, open_store
from rlboost.weights.source import StoreWeights, WeightSource
from workers.counters import Counters
from workers.engines import EngineError, make_engine
from workers.worker import RolloutWorker, make_worker_id


def parse_args(argv: list[str], s: Settings) -> argparse.Namespace:
    w = s.worker
    p = argparse.ArgumentParser(prog="rlboost worker", description=__doc__.splitlines()[0])
    p.add_argument("--pool", default=w.pool, help="the pool whose work queue this worker consumes")
    p.add_argument("--engine", default=w.engine, choices=["emulated", "torch", "vllm"])
    p.add_argument("--handoff-pool", default=w.handoff_pool,
                   help="hand requests off to this pool's resume lane (a reserved seeding engine; default: own pool)")
    p.add_argument("--slots", type=int, default=w.slots, help="concurrent requests in the running batch")
    p.add_argument("--checkpoint-tokens", type=int, default=w.checkpoint_tokens, help="K: checkpoint every K tokens")
    p.add_argument("--model-dir", default=w.model_dir, help="torch/vllm: local Hugging Face model directory")
    p.add_argument("--device", default=w.device, help="torch: cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default=w.dtype, help="torch: float64 (default) | float32 | bfloat16 | float16; "
                   "vllm: auto | bfloat16 | float16 | float32")
    p.add_argument("--max-model-len", type=int, default=w.max_model_len, help="context limit (0 = the model's)")
    p.add_argument("--tensor-parallel-size", type=int, default=w.tensor_parallel_size, help="vllm: GPUs per model")
    p.add_argument("--gpu-memory-utilization", type=float, default=w.gpu_memory_utilization, help="vllm")
    p.add_argument("--enforce-eager", default=w.enforce_eager, type=lambda v: {"true": True, "false": False}[v.lower()],
                   metavar="true|false", help="vllm: no CUDA graphs (default: graphs on a GPU, eager on CPU)")
    p.add_argument("--speed", type=float, default=w.speed, help="emulated: x times the modelled GPU; 0 = unlimited")
    p.add_argument("--gpus", type=int, default=w.gpus, help="emulated: GPUs behind this worker")
    p.add_argument("--token-scale", type=int, default=w.token_scale,
                   help="emulated: each emitted token stands for this many modelled tokens")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--counters", default=None, help="file for crash-proof counters (read by benchmarks)")
    p.add_argument("--ack-wait", type=float, default=w.ack_wait_s)
    p.add_argument("--lease-ttl", type=float, default=w.lease_ttl_s)
    p.add_argument("--drain-grace", type=float, default=w.drain_grace_s)
    a = p.parse_args(argv)
    if a.lease_ttl >= a.ack_wait:
        p.error("--lease-ttl must be shorter than --ack-wait, or redelivered requests find the lease still held")
    w.pool, w.engine, w.slots, w.checkpoint_tokens, w.model_dir, w.speed = (
        a.pool, a.engine, a.slots, a.checkpoint_tokens, a.model_dir, a.speed)
    w.ack_wait_s, w.lease_ttl_s, w.drain_grace_s, w.gpus = a.ack_wait, a.lease_ttl, a.drain_grace, a.gpus
    w.token_scale, w.handoff_pool = a.token_scale, a.handoff_pool
    w.device, w.dtype, w.max_model_len, w.tensor_parallel_size = a.device, a.dtype, a.max_model_len, a.tensor_parallel_size
    w.gpu_memory_utilization, w.enforce_eager = a.gpu_memory_utilization, a.enforce_eager
    return a


def build_engine(s: Settings):
    w = s.worker
    if w.engine == "emulated":
        from workers.engines.emulated import TimingModel

        from workers.engines.emulated import LengthModel

        return make_engine("emulated", speed=w.speed, timing=TimingModel().on_gpus(w.gpus).per_emulated_token(
            w.token_scale), lengths=LengthModel().per_emulated_token(w.token_scale))
    if not w.model_dir:
        raise SystemExit(f"rlboost worker: --model-dir is required for the {w.engine} engine")
    if w.engine == "torch":
        return make_engine("torch", model_dir=w.model_dir, device=w.device, dtype=w.dtype or "float64",
                           max_model_len=w.max_model_len)
    return make_engine(w.engine, model_dir=w.model_dir, dtype=w.dtype or None, max_model_len=w.max_model_len,
                       tensor_parallel_size=w.tensor_parallel_size, gpu_memory_utilization=w.gpu_memory_utilization,
                       enforce_eager=w.enforce_eager)


async def weight_source(s: Settings, js, worker_id: str) -> WeightSource | None:
    """Real engines (and the emulated one with `emulated_pulls`) pull each policy version from
    the weight store into a verified local cache; otherwise the engine's own source (virtual)."""
    if s.worker.engine == "emulated" and not s.worker.emulated_pulls:
        return None
    store = await open_store(js=js)
    root = Path(s.worker.cache_dir or Path(s.services.data_dir).expanduser() / "weight-cache") / worker_id
    return StoreWeights(WeightCache(root, store), wait_s=5.0)


async def serve(s: Settings, worker_id: str, counters: Counters) -> None:
    """Serve until drained. A hand-off (SIGUSR2: a reserved seeding engine's window is over)
    gives every request away and serves on with the same engine, in a new round."""
    nats_url, redis_url = resolve_urls(s.services)
    engine = build_engine(s)
    # the trainer provisions the servers; a worker started first waits for it (bus.provision_or_wait)
    async with open_clients(nats_url, redis_url, f"rlboost-worker-{worker_id}", settings=s,
                            wait_provisioned=True) as c:
        weights = await weight_source(s, c.js, worker_id)
        if s.metrics.port:
            port = metrics.start_metrics_server(s.metrics.port, s.metrics.bind)
            get_logger(worker_id=worker_id).info("metrics served", url=f"http://{s.metrics.bind}:{port}/metrics")
        stop_prefetch = asyncio.Event()
        # pull each new version ahead of the requests that will need it
        prefetcher = asyncio.create_task(weights.follow(await VersionPointer.open(c.js), stop_prefetch)) \
            if weights else None
        try:
            while True:
                worker = RolloutWorker(s.worker, engine, c, worker_id=worker_id, counters=counters, weights=weights)
                worker.install_signal_handlers()
                watchdog = asyncio.create_task(_exit_after_grace(worker))
                try:
                    await worker.run()
                finally:
                    watchdog.cancel()
                if not worker.continue_after:
                    await worker.settled()  # what its last fetches brought is handed back first
                    return
        finally:
            stop_prefetch.set()
            if prefetcher:
                await asyncio.gather(prefetcher, return_exceptions=True)
            if weights:
                weights.close()
            await engine.close()


async def _exit_after_grace(worker: RolloutWorker) -> None:
    """A notice gives `drain_grace_s`: past it, leave anyway (what is not flushed is covered by
    the checkpoint and ack_wait, exactly as after a kill)."""
    await worker.draining.wait()
    await asyncio.sleep(worker.cfg.drain_grace_s)
    worker.log.error("drain grace period exceeded, exiting now", grace_s=worker.cfg.drain_grace_s)
    os._exit(3)


def main(argv: list[str], s: Settings) -> int:
    a = parse_args(argv, s)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_id = a.worker_id or make_worker_id(s.worker.pool)
    counters = Counters(a.counters)
    try:
        asyncio.run(serve(s, worker_id, counters))
    except ConnectionError as e:
        get_logger(worker_id=worker_id).error("cannot connect", error=str(e))
        return 1
    except EngineError as e:
        get_logger(worker_id=worker_id).error("cannot start the engine", error=str(e))
        return 1
    return 0
