"""`rlboost run` (and `rlboost demo`): RL training with rollout offloaded to preemptible workers.

One process is the reserved cluster: the GRPO trainer plus a seeding engine. Preemptible
workers are separate processes (`rlboost worker --engine torch`) that can vanish at any time.
A step of the `hybrid` policy:

1. the manager publishes the step's P x G requests (policy version v) to the pool;
2. the reserved engine joins the pool as a worker and generates for T_seed seconds, side by
   side with the preemptible workers;
3. at T_seed it drains: its unfinished responses go to the resume lane with their tokens so far
   (checkpoint store), and the trainer starts training on complete groups as they arrive;
4. when every group is in, one optimizer step; the new weights are published (version v+1);
5. T_seed moves by (trainer waiting - preemptible waiting) / 3.

`colocated` keeps everything on the reserved side (generate all, then train); `disaggregated`
never seeds (T_seed = 0). With no live preemptible worker the hybrid step runs colocated, and if
the pool dies mid-step the reserved engine takes the work back: a step never stalls.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import random
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rlboost import metrics, wire
from rlboost.cli import print_result
from rlboost.clients import Clients, open_clients
from rlboost.config import Settings, WorkerSettings
from rlboost.logs import configure_logging, get_logger
from rlboost.manager import RolloutManager
from rlboost.offload import SeedWindow
from rlboost.services import running_services
from rlboost.weight_cache import WeightCache
from rlboost.weights import VersionPointer, WeightPublisher, open_store
from trainer.grpo_trainer import GRPOTrainer
from trainer.model import encode, read_meta
from trainer.report import RunReport
from trainer.tasks import get_task
from workers.counters import Counters
from workers.engines.torch_engine import TorchEngine
from workers.fleet import WorkerFleet
from workers.worker import RolloutWorker

POOL = "spot"
RESERVED_POOL = "reserved"


@dataclass
class RunConfig:
    policy: str = "hybrid"
    steps: int = 40
    max_minutes: float = 0.0  # stop after the step that crosses this (0 = no limit)
    prompts: int = 32
    samples: int = 8
    workers: int = 2
    slots: int = 32
    checkpoint_tokens: int = 16
    lr: float = 1e-4
    temperature: float = 1.0
    seed: int = 0
    eval_every: int = 5
    t_seed_initial: float = 2.0
    t_seed_floor: float = 0.5
    shuffle_rewards: bool = False
    chaos: dict[int, list[str]] = field(default_factory=dict)  # step -> ["term", "kill"]
    model_dir: str = ""
    run_dir: str = ""
    bootstrap_target: float = 0.35
    metrics_port: int = 0  # Prometheus /metrics of the trainer/manager (settings [metrics])
    metrics_bind: str = "127.0.0.1"
    save_rollouts: bool = False  # rollouts.jsonl: every response of every step, for comparisons
    bootstrap_seconds: float = 240.0


@dataclass
class StepTiming:
    trainer_wait_s: float = 0.0
    spot_idle_s: float = 0.0
    handoffs: int = 0
    fallback: bool = False
    reserved_tokens: int = 0


def request_seed(run_seed: int, step: int, prompt: int, sample: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{run_seed}/{step}/{prompt}/{sample}".encode(), digest_size=4).digest(),
                          "little")


def weights_sha256(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class Run:
    def __init__(self, cfg: RunConfig, c: Clients, nats_url: str, redis_url: str, run_dir: Path, report: RunReport):
        self.cfg, self.c, self.run_dir, self.report = cfg, c, run_dir, report
        self.log = get_logger(component="run", policy=cfg.policy)
        self.task = get_task("addition")
        self.trainer = GRPOTrainer(cfg.model_dir, self.task, lr=cfg.lr, temperature=cfg.temperature, seed=cfg.seed,
                                   shuffle_rewards=cfg.shuffle_rewards)
        self.eos = self.trainer.tokenizer.eos_token_id
        self.manager = RolloutManager(c, POOL)
        self.window = SeedWindow(initial_s=cfg.t_seed_initial, floor_s=cfg.t_seed_floor)
        self.fleet = WorkerFleet(nats_url, redis_url, run_dir / "workers", POOL, worker_args=[
            "--engine", "torch", "--model-dir", cfg.model_dir, "--slots", str(cfg.slots),
            "--checkpoint-tokens", str(cfg.checkpoint_tokens)],
            env={"RLBOOST_WORKER__CACHE_DIR": str(run_dir / "weight-cache"), "RLBOOST_LOG_LEVEL": "warning"})
        (run_dir / "workers").mkdir(parents=True, exist_ok=True)
        self.reserved_engine = TorchEngine(cfg.model_dir)
        self.reserved_counters = Counters()
        self.handoffs_total = 0
        self.run_id = wire.new_run_id()
        self.base_version = 0  # policy versions continue from what the weight store already holds

    @property
    def version(self) -> int:
        return self.base_version + self.trainer.version

    async def setup(self) -> None:
        store = await open_store(js=self.c.js)
        pointer = await VersionPointer.open(self.c.js)
        self.publisher = WeightPublisher(store, pointer)
        self.cache = WeightCache(self.run_dir / "weight-cache" / "reserved", store)
        latest = await pointer.get()
        self.base_version = 0 if latest is None else latest + 1
        await self.publisher.publish(self.trainer.state_dict(), version=self.base_version)
        if self.cfg.policy != "colocated" and self.cfg.workers:
            for _ in range(self.cfg.workers):
                self.fleet.start()
            deadline = time.monotonic() + 90.0  # torch import + model load take a while
            while len(await self.manager.live_workers()) < self.cfg.workers and time.monotonic() < deadline:
                await asyncio.sleep(0.25)

    async def _weights(self, version: int) -> Path:
        return (await self.cache.ensure(version, wait_s=30.0)).path

    def _reserved_worker(self, pool: str, step: int, tag: str) -> tuple[RolloutWorker, asyncio.Task]:
        w = RolloutWorker(WorkerSettings(pool=pool, slots=self.cfg.slots, checkpoint_tokens=self.cfg.checkpoint_tokens),
                          self.reserved_engine, self.c, worker_id=f"reserved-{tag}-s{step}",
                          counters=self.reserved_counters, weights=self._weights)
        return w, asyncio.create_task(w.run())

    def _requests(self, step: int, prompt_ids: list[list[int]]) -> list[wire.RolloutRequest]:
        max_new = self.task.max_response_chars + 1
        return [wire.RolloutRequest(
            request_id=wire.request_id(step, p, g, run=self.run_id), step=step, policy_version=self.version,
            prompt_ids=ids, max_new_tokens=max_new, seed=request_seed(self.cfg.seed, step, p, g),
            sampling=wire.SamplingParams(temperature=self.cfg.temperature), eos_id=self.eos, group=p)
            for p, ids in enumerate(prompt_ids) for g in range(self.cfg.samples)]

    async def step(self, step: int) -> dict:
        cfg = self.cfg
        t_step = time.monotonic()
        problems = self.task.prompts(cfg.prompts, seed=cfg.seed * 1_000_003 + step)
        self.trainer.start_step(step, problems)
        requests = self._requests(step, [encode(self.trainer.tokenizer, p.prompt) for p in problems])
        live = 0 if cfg.policy == "colocated" else len(await self.manager.live_workers())
        if cfg.policy == "colocated":
            t_seed, pool = math.inf, RESERVED_POOL
        elif cfg.policy == "disaggregated":
            t_seed, pool = (0.0 if live else math.inf), POOL
        else:
            t_seed, pool = self.window.window(live), POOL
        timing = StepTiming()
        stop_sampler = asyncio.Event()
        sampler = asyncio.create_task(self.manager.sample_idle(stop_sampler))
        await self.manager.publish_step(requests, pool)
        reserved = self._reserved_worker(pool, step, "seed") if t_seed > 0 else None
        groups: dict[int, list[wire.RolloutResult]] = defaultdict(list)
        ready: asyncio.Queue[int] = asyncio.Queue()
        arrived = 0

        async def collect() -> None:
            nonlocal arrived
            async for r in self.manager.results(step, {q.request_id for q in requests}):
                arrived += 1
                groups[r.group].append(r)
                if len(groups[r.group]) == cfg.samples:
                    ready.put_nowait(r.group)
                self.report.progress(step, arrived, len(requests))
                if arrived == len(requests) // 2 + 1 and step in cfg.chaos:  # mid-step
                    self._chaos(step)

        collector = asyncio.create_task(collect())
        seeding_ends = time.monotonic() + t_seed
        while time.monotonic() < seeding_ends and not collector.done():  # 2. seeding window
            await asyncio.sleep(min(0.05, max(0.0, seeding_ends - time.monotonic())))
        if reserved is not None:  # 3. hand off, unless nobody is there to take it
            if cfg.policy != "colocated" and await self.manager.live_workers(exclude={reserved[0].worker_id}):
                before = self.reserved_counters.get("handed_off")
                reserved[0].request_drain("seeding window over")
                await reserved[1]
                timing.handoffs = self.reserved_counters.get("handed_off") - before
                reserved = None
            # else: the reserved engine keeps generating to the end of the step (colocated)
        trained = 0
        while trained < cfg.prompts:  # 4. train on complete groups as they come
            t_wait = time.monotonic()
            while True:
                try:
                    group = await asyncio.wait_for(ready.get(), timeout=0.5)
                    break
                except asyncio.TimeoutError:
                    if collector.done():
                        collector.result()  # raise what went wrong
                    reserved = await self._guard_against_stall(reserved, step, timing)
            timing.trainer_wait_s += time.monotonic() - t_wait
            await asyncio.to_thread(self.trainer.add_group, group, groups[group])
            trained += 1
        await collector
        if reserved is not None:
            reserved[0].request_drain("step complete")
            await reserved[1]
        if cfg.save_rollouts:
            self._save_rollouts(groups)
        rep = await asyncio.to_thread(self.trainer.finish_step)
        pub = await self.publisher.publish(self.trainer.state_dict(), version=self.version)
        metrics.POLICY_VERSION.labels("trainer").set(self.version)
        await self.publisher.gc(keep=3)
        stop_sampler.set()
        timing.spot_idle_s = await sampler
        step_s = time.monotonic() - t_step  # held-out evaluation is bookkeeping, not the step
        eval_acc = None
        if step % cfg.eval_every == 0 or step == cfg.steps - 1:
            eval_acc = await asyncio.to_thread(self.trainer.evaluate)
        self.handoffs_total += timing.handoffs
        if cfg.policy == "hybrid" and live:
            self.window.update(live, timing.trainer_wait_s, timing.spot_idle_s)
        row = {"step": step, "policy": cfg.policy, "version": self.version, "run_id": self.run_id, "t_seed": None if math.isinf(t_seed) else
               round(t_seed, 3), "live_workers": live, "reward": round(rep.reward_mean, 4), "eval_acc": eval_acc,
               "tokens": rep.tokens, "step_s": round(step_s, 3), "tokens_per_s": round(rep.tokens / step_s, 1),
               "trainer_wait_s": round(timing.trainer_wait_s, 3), "spot_idle_s": round(timing.spot_idle_s, 3),
               "handoffs": timing.handoffs, "fallback": timing.fallback, "mean_response_tokens":
               round(rep.mean_response_tokens, 2), "clip_fraction": round(rep.clip_fraction, 4),
               "weights_bytes_uploaded": getattr(pub, "bytes_uploaded", None), "chaos": cfg.chaos.get(step, [])}
        return row

    def _save_rollouts(self, groups: dict[int, list[wire.RolloutResult]]) -> None:
        with open(self.run_dir / "rollouts.jsonl", "a") as f:
            for r in sorted((r for g in groups.values() for r in g), key=lambda r: r.request_id):
                f.write(json.dumps({"id": r.request_id.removeprefix(f"{self.run_id}-"), "tokens": r.token_ids,
                                    "logprobs": r.logprobs, "workers": [seg.worker_id for seg in r.segments]}) + "\n")

    async def _guard_against_stall(self, reserved, step: int, timing: StepTiming):
        """If no preemptible worker is alive while results are outstanding, the reserved engine
        takes the work back (fresh and resume lanes alike)."""
        if reserved is not None or self.cfg.policy == "colocated":
            return reserved
        if await self.manager.live_workers():
            return None
        self.log.warning("no live preemptible worker: the reserved engine takes the step back", step=step)
        timing.fallback = True
        return self._reserved_worker(POOL, step, "fallback")

    def _chaos(self, step: int) -> None:
        for kind in self.cfg.chaos.get(step, []):
            live = [w for w in self.fleet.live() if w.fate == "running"]
            if not live:
                return
            w = live[0]
            if kind == "kill":
                self.fleet.kill(w)
            else:
                self.fleet.terminate(w)
            self.log.warning("chaos", step=step, action=kind, worker_id=w.worker_id)
            self.fleet.start()

    async def close(self) -> None:
        self.fleet.stop_all()
        await self.reserved_engine.close()


async def train(cfg: RunConfig, nats_url: str, redis_url: str, run_dir: Path) -> dict:
    report = RunReport(run_dir, cfg.steps)
    async with open_clients(nats_url, redis_url, "rlboost-trainer", pools=(POOL, RESERVED_POOL)) as c:
        run = Run(cfg, c, nats_url, redis_url, run_dir, report)
        t0 = time.monotonic()
        stop_metrics = asyncio.Event()
        if cfg.metrics_port:
            metrics.start_metrics_server(cfg.metrics_port, cfg.metrics_bind)
            asyncio.create_task(metrics.poll_queue_pending(c.js, (POOL,), stop_metrics))
        try:
            await run.setup()
            eval_first = await asyncio.to_thread(run.trainer.evaluate)
            report.start(eval_first)
            rows = []
            for step in range(cfg.steps):
                row = await run.step(step)
                rows.append(row)
                report.step(row)
                if cfg.max_minutes and time.monotonic() - t0 > cfg.max_minutes * 60 and step < cfg.steps - 1:
                    if row["eval_acc"] is None:
                        row["eval_acc"] = await asyncio.to_thread(run.trainer.evaluate)
                    break
        finally:
            stop_metrics.set()
            await run.close()
            report.close()
        evals = [r["eval_acc"] for r in rows if r["eval_acc"] is not None]
        return {"steps": len(rows), "policy": cfg.policy, "reward_first": rows[0]["reward"],
                "reward_last": rows[-1]["reward"], "eval_first": round(eval_first, 4),
                "eval_last": round(evals[-1], 4) if evals else None, "handoffs": run.handoffs_total,
                "tokens_per_s": round(sum(r["tokens"] for r in rows) / sum(r["step_s"] for r in rows), 1),
                "wall_s": round(time.monotonic() - t0, 1), "final_weights_sha256": weights_sha256(run.trainer.state_dict()),
                "run_dir": str(run_dir)}


def ensure_model(cfg: RunConfig, s: Settings) -> str:
    """The model directory, bootstrapped (built + warm-started) if it does not exist yet."""
    model_dir = Path(cfg.model_dir or Path(s.services.data_dir).expanduser() / "model")
    if not (model_dir / "config.json").exists() or not read_meta(model_dir).get("trained"):
        from trainer.bootstrap import warm_start

        print(f"bootstrapping the model into {model_dir} (build + supervised warm start)...", flush=True)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)  # nothing else runs yet: both cores
        configure_logging(json=s.log_json, level="info")  # its progress lines
        try:
            out = warm_start(get_task("addition"), model_dir, cfg.bootstrap_target, cfg.bootstrap_seconds, seed=0)
        finally:
            torch.set_num_threads(threads)
            configure_logging(json=s.log_json, level=os.environ.get("RLBOOST_LOG_LEVEL", "warning"))
        print(f"model ready: held-out greedy accuracy {out['eval_acc']:.3f} after {out['seconds']} s", flush=True)
    return str(model_dir)


def parse_chaos(spec: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        step, _, kind = part.partition(":")
        if kind not in ("term", "kill"):
            raise argparse.ArgumentTypeError(f"chaos {part!r}: use STEP:term or STEP:kill")
        out[int(step)].append(kind)
    return dict(out)


def parse(argv: list[str], demo: bool = False) -> RunConfig:
    d = RunConfig()
    p = argparse.ArgumentParser(prog="rlboost demo" if demo else "rlboost run", description=__doc__.splitlines()[0])
    p.add_argument("--policy", choices=["hybrid", "colocated", "disaggregated"], default=d.policy)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--max-minutes", type=float, default=3.0 if demo else d.max_minutes)
    p.add_argument("--prompts", type=int, default=d.prompts)
    p.add_argument("--samples", type=int, default=d.samples)
    p.add_argument("--workers", type=int, default=d.workers, help="preemptible worker processes to start")
    p.add_argument("--slots", type=int, default=d.slots)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--t-seed", type=float, default=d.t_seed_initial, help="initial seeding window (s)")
    p.add_argument("--t-seed-floor", type=float, default=d.t_seed_floor)
    p.add_argument("--shuffle-rewards", action="store_true", help="control: rewards shuffled within each group")
    p.add_argument("--chaos", type=parse_chaos, default={}, help="e.g. 3:term,5:kill (mid-step, then restart)")
    p.add_argument("--save-rollouts", action="store_true", help="write every response to rollouts.jsonl")
    p.add_argument("--model-dir", default="")
    p.add_argument("--run-dir", default="")
    a = p.parse_args(argv)
    return RunConfig(policy=a.policy, steps=a.steps, max_minutes=a.max_minutes, prompts=a.prompts, samples=a.samples,
                     workers=a.workers, slots=a.slots, lr=a.lr, seed=a.seed, eval_every=a.eval_every,
                     t_seed_initial=a.t_seed, t_seed_floor=a.t_seed_floor, shuffle_rewards=a.shuffle_rewards,
                     chaos=a.chaos, model_dir=a.model_dir, run_dir=a.run_dir, save_rollouts=a.save_rollouts)


def execute(cfg: RunConfig, s: Settings) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    random.seed(cfg.seed)
    run_dir = Path(cfg.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.metrics_port, cfg.metrics_bind = s.metrics.port, s.metrics.bind
    with running_services(s.services) as (nats_url, redis_url):
        cfg.model_dir = ensure_model(cfg, s)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
        return asyncio.run(train(cfg, nats_url, redis_url, run_dir))


def main(argv: list[str], s: Settings, demo: bool = False) -> int:
    cfg = parse(argv, demo)
    if "RLBOOST_LOG_LEVEL" not in os.environ:  # the live table is the interface; logs only warn
        configure_logging(json=s.log_json, level="warning")
    out = execute(cfg, s)
    print_result(out)
    return 0
