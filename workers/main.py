"""`rlboost worker`: one rollout worker process. Scale out by starting more of them."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from rlboost import metrics
from rlboost.clients import open_clients
from rlboost.config import ConfigError, Settings, apply_overrides, parse_overrides
from rlboost.logs import get_logger
from rlboost.services import resolve_urls
from rlboost.weights import VersionPointer, WeightCache, open_store
from rlboost.weights.cache import peer_cache
from rlboost.weights.source import StoreWeights, WeightSource
from rlboost.workers.counters import Counters
from rlboost.workers.engines import EngineError, engine_from_settings
from rlboost.workers.worker import RolloutWorker, make_worker_id


# `rlboost worker` flags: shorthands for `[worker]` keys (flag dest -> key). Any setting also
# goes as `--section.key VALUE` (e.g. --worker.fetch_batch 4), validated with the whole tree.
FLAGS = {"pool": "pool", "engine": "engine", "handoff_pool": "handoff_pool", "slots": "slots",
         "checkpoint_tokens": "checkpoint_tokens", "model_dir": "model_dir", "device": "device", "dtype": "dtype",
         "max_model_len": "max_model_len", "tensor_parallel_size": "tensor_parallel_size",
         "gpu_memory_utilization": "gpu_memory_utilization", "enforce_eager": "enforce_eager", "speed": "speed",
         "gpus": "gpus", "token_scale": "token_scale", "ack_wait": "ack_wait_s", "lease_ttl": "lease_ttl_s",
         "drain_grace": "drain_grace_s"}


def parse_args(argv: list[str], s: Settings) -> argparse.Namespace:
    """The command line on top of the settings tree `s` (defaults < TOML < environment < this),
    applied to `s` in place and validated there (`WorkerSettings`' invariants)."""
    w = s.worker
    p = argparse.ArgumentParser(prog="rlboost worker", description=__doc__.splitlines()[0],
                                epilog="Any setting: --section.key VALUE or section.key=VALUE (e.g. --worker.fetch_batch 4).")
    p.add_argument("--pool", help=f"the pool whose work queue this worker consumes (default: {w.pool})")
    p.add_argument("--engine", choices=["emulated", "torch", "vllm"], help=f"default: {w.engine}")
    p.add_argument("--handoff-pool", help="hand requests off to this pool's resume lane (a reserved seeding engine; "
                   "default: own pool)")
    p.add_argument("--slots", type=int, help=f"concurrent requests in the running batch (default: {w.slots})")
    p.add_argument("--checkpoint-tokens", type=int, help=f"K: checkpoint every K tokens (default: {w.checkpoint_tokens})")
    p.add_argument("--model-dir", help="torch/vllm: local Hugging Face model directory")
    p.add_argument("--device", help=f"torch: cpu, cuda, cuda:1 ... (default: {w.device})")
    p.add_argument("--dtype", help="torch: float64 (default) | float32 | bfloat16 | float16; "
                   "vllm: auto | bfloat16 | float16 | float32")
    p.add_argument("--max-model-len", type=int, help="context limit (0 = the model's)")
    p.add_argument("--tensor-parallel-size", type=int, help="vllm: GPUs per model")
    p.add_argument("--gpu-memory-utilization", type=float, help="vllm")
    p.add_argument("--enforce-eager", type=lambda v: {"true": True, "false": False}[v.lower()],
                   metavar="true|false", help="vllm: no CUDA graphs (default: graphs on a GPU, eager on CPU)")
    p.add_argument("--speed", type=float, help="emulated: x times the modelled GPU; 0 = unlimited")
    p.add_argument("--gpus", type=int, help="emulated: GPUs behind this worker")
    p.add_argument("--token-scale", type=int, help="emulated: each emitted token stands for this many modelled tokens")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--counters", default=None, help="file for crash-proof counters (read by benchmarks)")
    p.add_argument("--ack-wait", type=float, help=f"seconds (default: {w.ack_wait_s})")
    p.add_argument("--lease-ttl", type=float, help=f"seconds, < --ack-wait (default: {w.lease_ttl_s})")
    p.add_argument("--drain-grace", type=float, help=f"seconds (default: {w.drain_grace_s})")
    a, rest = p.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        for name, key in FLAGS.items():
            if (value := getattr(a, name)) is not None:
                overrides.setdefault("worker", {})[key] = value
        new = apply_overrides(s, overrides)
    except ConfigError as e:  # an unknown argument, or e.g. lease_ttl_s not < ack_wait_s
        p.error(str(e))
    for section in s.__struct_fields__:
        setattr(s, section, getattr(new, section))
    return a


async def weight_source(s: Settings, js, worker_id: str) -> WeightSource | None:
    """Real engines (and the emulated one with `emulated_pulls`) pull each policy version from
    the weight store into a verified local cache; otherwise the engine's own source (virtual)."""
    if s.worker.engine == "emulated" and not s.worker.emulated_pulls:
        return None
    store = await open_store(js=js, **s.weights.store_options())
    root = Path(s.worker.cache_dir or Path(s.services.data_dir).expanduser() / "weight-cache") / worker_id
    if s.weights.peers:  # serve verified blobs to the other workers, pull from them first
        cache, server = await peer_cache(root, store, js, worker_id, s.weights)
        return StoreWeights(cache, wait_s=5.0, server=server)
    return StoreWeights(WeightCache(root, store), wait_s=5.0)


WORKER_NATS_OPTIONS = {"ping_interval": 2.0, "max_outstanding_pings": 2}


async def serve(s: Settings, worker_id: str, counters: Counters) -> None:
    """Serve until drained. A hand-off (SIGUSR2: a reserved seeding engine's window is over)
    gives every request away and serves on with the same engine, in a new round."""
    nats_url, redis_url = resolve_urls(s.services)
    engine = engine_from_settings(s.worker)
    # the trainer provisions the servers; a worker started first waits for it (bus.provision_or_wait)
    # Pings every 2 s, and a connection that misses 2 of them is dropped and reconnected: a link
    # left half-open (no FIN, no RST) is noticed in ~4-6 s, not nats-py's default ~4 minutes
    # (`rlboost bench partitions`, nats_half_open). The worker's loop never blocks (the engine
    # runs in a thread of its own), so a late PONG means a dead link.
    async with open_clients(nats_url, redis_url, f"rlboost-worker-{worker_id}", settings=s,
                            wait_provisioned=True, nats_options=WORKER_NATS_OPTIONS) as c:
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
                # the environment this worker may run besides the built-ins ([env] ref, once wired in Settings)
                worker = RolloutWorker(s.worker, engine, c, worker_id=worker_id, counters=counters, weights=weights,
                                       env=s.env)
                worker.install_signal_handlers()
                watchdog = asyncio.create_task(exit_after_grace(worker))
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
                await weights.aclose()
            await engine.close()


async def exit_after_grace(worker) -> None:
    """A notice gives `drain_grace_s`: past it, leave anyway (what is not flushed is covered by
    the checkpoint and ack_wait, exactly as after a kill). A rollout or an environment worker."""
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
