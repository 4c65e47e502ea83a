"""`rlboost bench trace`: reserved-only vs hybrid on a real spot trace, with an emulated H100 fleet.

Everything but the GPUs is real: NATS, Redis, worker processes started and preempted
(SIGTERM with notice, SIGKILL without) as the trace says, hand-offs through the resume lane.
The GPUs are the emulated engine's timing model (workers/engines/emulated.py) and a trainer
that takes `TRAIN_S_PER_TOKEN` per trained token on 8 GPUs.

Time is compressed by `--speed` S: every modelled second takes 1/S real seconds (engines
sleep 1/S of the modelled time, trace events fire at t/S). Figures are reported in modelled
time. At S=60 the fleet moves ~1M modelled tokens per real second, more than the wire can
carry at 16-token chunks on 2 cores, so the bench checkpoints every `--chunk` tokens (2048):
coarser, the same code path.

Fleet (the published setup): the reserved cluster is 8 H100 (the trainer plus its seeding
engine, modelled as one engine over 8 data-parallel GPUs, 1024 slots); a preemptible instance is
2 H100 (one worker process, `--gpus 2`, 256 slots). Workload: 128 prompts x 8 samples per step,
log-normal response lengths (median 1,500, cap 14,336), 256-token prompts.

Policies:
- colocated (veRL-style): the 8 GPUs generate the whole step, then train on it;
- disaggregated: 4 GPUs generate while 4 GPUs train on groups as they complete;
- hybrid: the 8 GPUs seed for T_seed (adaptive), hand the unfinished responses to the
  preemptible fleet and train on completed groups as they arrive;
- oracle (computed): reserved-only throughput scaled by the available GPUs, as if every
  available instance-second were used at the reserved cluster's per-GPU rate with no overhead:
  oracle = colocated x (8 + 2 n) / 8, n = time-averaged available instances.

Status (see issue 6): not calibrated yet. At S=60 the real cost of moving every emulated token
through NATS and Redis (~16 MB per reserved flush) is multiplied by S and dominates the
modelled step time, so colocated measures ~4.4K tokens/s instead of the published ~10K and
the ratios are not yet meaningful. The fix planned: a token scale R (each emulated token stands
for R modelled tokens: lengths / R, step costs x R, context costs x R^2, trained tokens x R),
then calibrate TRAIN_S_PER_TOKEN against 10K and check 1-4 static instances against 12-18K.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from rlboost import wire
from rlboost.cli import print_result
from rlboost.clients import open_clients
from rlboost.config import Settings, WorkerSettings
from rlboost.logs import configure_logging
from rlboost.costs import Prices, cost_efficiency, cost_per_hour, run_cost
from rlboost.manager import RolloutManager
from rlboost.offload import SeedWindow
from rlboost.services import running_services
from rlboost.spot import Interval, instance_seconds, intervals, parse_trace, sample_nodes
from workers.counters import Counters
from workers.engines.emulated import EmulatedEngine, LengthModel, TimingModel
from workers.fleet import WorkerFleet
from workers.worker import RolloutWorker

RESERVED_GPUS, INSTANCE_GPUS = 8, 2
TRAIN_S_PER_TOKEN = 5.0e-5  # 8 GPUs; a first estimate (2.5M tokens in ~125 s), not yet calibrated
PROMPT_TOKENS = 256


def seed_of(step: int, prompt: int, sample: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{step}/{prompt}/{sample}".encode(), digest_size=4).digest(), "little")


class Emulation:
    def __init__(self, a: argparse.Namespace, c, nats_url: str, redis_url: str, workdir: Path, policy: str,
                 ivs: list[Interval]) -> None:
        self.a, self.c, self.policy, self.ivs, self.S = a, c, policy, ivs, a.speed
        self.pool = f"trace-{policy}"
        self.manager = RolloutManager(c, self.pool)
        self.fleet = WorkerFleet(nats_url, redis_url, workdir / policy, self.pool, worker_args=[
            "--engine", "emulated", "--speed", str(a.speed), "--gpus", str(INSTANCE_GPUS), "--slots", "256",
            "--checkpoint-tokens", str(a.chunk), "--ack-wait", "5", "--lease-ttl", "3",
            "--token-scale", str(a.token_scale)],
            env={"RLBOOST_LOG_LEVEL": "warning"})
        gpus = RESERVED_GPUS // 2 if policy == "disaggregated" else RESERVED_GPUS
        R = a.token_scale
        self.engine = EmulatedEngine(speed=a.speed, timing=TimingModel().on_gpus(gpus).per_emulated_token(R),
                                     lengths=LengthModel().per_emulated_token(R))
        self.train_share = 0.5 if policy == "disaggregated" else 1.0
        self.window = SeedWindow(initial_s=a.t_seed / self.S, floor_s=5.0 / self.S)
        self.counters = Counters()
        self.preemptions = 0
        self.uptime_real = 0.0
        self.run_id = wire.new_run_id()

    async def replay(self, t0: float, stop: asyncio.Event) -> None:
        """Start and preempt worker processes as the trace says (time compressed by S)."""
        events = sorted([(i.up_s, "up", i) for i in self.ivs] + [(i.down_s, "down", i) for i in self.ivs if i.preempted],
                        key=lambda e: (e[0], e[1] == "up"))
        procs = {}
        for t_model, kind, iv in events:
            delay = t0 + t_model / self.S - time.monotonic()
            if delay > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
            if stop.is_set():
                break
            if kind == "up":
                procs[iv] = (self.fleet.start(prefix="node"), time.monotonic())
            elif iv in procs:
                w, started = procs.pop(iv)
                (self.fleet.terminate if self.a.notice > 0 else self.fleet.kill)(w)
                self.preemptions += 1
                self.uptime_real += time.monotonic() - started
        self.uptime_real += sum(time.monotonic() - started for _, started in procs.values())

    async def step(self, step: int) -> int:
        a = self.a
        reqs = [wire.RolloutRequest(request_id=wire.request_id(step, p, g, run=self.run_id), step=step,
                                    policy_version=0, prompt_ids=[7] * (PROMPT_TOKENS // a.token_scale),
                                    max_new_tokens=14336 // a.token_scale,
                                    seed=seed_of(step, p, g), group=p)
                for p in range(a.prompts) for g in range(a.samples)]
        live = len(await self.manager.live_workers()) if self.policy == "hybrid" else 0
        t_seed = self.window.window(live) if self.policy == "hybrid" else math.inf
        await self.manager.publish_step(reqs)
        reserved = self._reserved(step)
        groups: dict[int, int] = defaultdict(int)
        tokens: dict[int, int] = defaultdict(int)
        ready: asyncio.Queue[int] = asyncio.Queue()
        idle = {"trainer": 0.0}

        async def collect() -> None:
            async for r in self.manager.results(step, {q.request_id for q in reqs}):
                groups[r.group] += 1
                tokens[r.group] += len(r.token_ids) * a.token_scale  # modelled tokens
                if groups[r.group] == a.samples:
                    ready.put_nowait(r.group)

        collector = asyncio.create_task(collect())
        stop_idle = asyncio.Event()
        idle_sampler = asyncio.create_task(self.manager.sample_idle(stop_idle)) if live else None
        t_start = time.monotonic()
        if self.policy != "disaggregated":  # rollout first (seeding window, or the whole step)
            while not collector.done() and time.monotonic() - t_start < t_seed:
                await asyncio.sleep(0.01)
        if reserved and self.policy == "hybrid" and live and not collector.done():
            reserved[0].request_drain("seeding window over")
            await reserved[1]
            reserved = None
        trained, step_tokens = 0, 0
        while trained < a.prompts:
            t_wait = time.monotonic()
            while True:
                try:
                    g = await asyncio.wait_for(ready.get(), timeout=0.25)
                    break
                except asyncio.TimeoutError:
                    if reserved is None and not await self.manager.live_workers():
                        reserved = self._reserved(step, "fallback")  # nobody left: take the work back
            idle["trainer"] += time.monotonic() - t_wait
            await asyncio.sleep(tokens[g] * TRAIN_S_PER_TOKEN / self.train_share / self.S)
            step_tokens += tokens[g]
            trained += 1
        await collector
        if reserved:
            reserved[0].request_drain("step complete")
            await reserved[1]
        if idle_sampler:
            stop_idle.set()
            self.window.update(live, idle["trainer"], await idle_sampler)
        return step_tokens

    def _reserved(self, step: int, tag: str = "seed"):
        w = RolloutWorker(WorkerSettings(pool=self.pool, slots=1024, checkpoint_tokens=self.a.chunk),
                          self.engine, self.c, worker_id=f"reserved-{self.policy}-{tag}-{step}", counters=self.counters)
        return w, asyncio.create_task(w.run())

    async def run(self, duration_model_s: float) -> dict:
        t0 = time.monotonic()
        stop = asyncio.Event()
        replay = asyncio.create_task(self.replay(t0, stop)) if self.policy == "hybrid" else None
        tokens, steps, t_done = 0, 0, t0
        while time.monotonic() - t0 < duration_model_s / self.S:
            n = await self.step(steps)
            if time.monotonic() - t0 > duration_model_s / self.S * 1.05:
                break  # a step that ran far past the segment's end does not count
            tokens, steps, t_done = tokens + n, steps + 1, time.monotonic()
            print(f"  {self.policy:13} step {steps:3d}  {tokens / ((t_done - t0) * self.S):8,.0f} tokens/s  "
                  f"({len(self.fleet.live())} preemptible up)", flush=True)
        stop.set()
        if replay:
            await replay
        regenerated = self.a.token_scale * sum(max(0, w.counters()["generated"] - w.counters()["checkpointed"])
                                               for w in self.fleet.workers.values())
        self.fleet.stop_all()
        elapsed_model = (t_done - t0) * self.S
        dollars = run_cost(elapsed_model, RESERVED_GPUS, self.uptime_real * self.S, INSTANCE_GPUS, self.a.prices)
        throughput = tokens / elapsed_model if elapsed_model else 0.0
        rate = cost_per_hour(dollars, elapsed_model) if elapsed_model else 0.0
        return {"throughput": round(throughput, 1), "cost_per_hour": round(rate, 2),
                "cost_efficiency": round(cost_efficiency(throughput, rate), 2) if rate else 0.0,
                "preemptions": self.preemptions, "regenerated_tokens": regenerated, "steps": steps,
                "tokens": tokens, "modelled_s": round(elapsed_model)}


async def evaluate(a: argparse.Namespace, nats_url: str, redis_url: str, workdir: Path, ivs: list[Interval]) -> dict:
    out: dict[str, dict] = {}
    async with open_clients(nats_url, redis_url, "rlboost-trace", pools=tuple(f"trace-{p}" for p in a.policies)) as c:
        for policy in a.policies:
            print(f"{policy}:", flush=True)
            out[policy] = await Emulation(a, c, nats_url, redis_url, workdir, policy, ivs).run(a.duration)
    return out


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench trace", description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--start", type=float, default=0.0, help="segment start (s into the trace)")
    p.add_argument("--duration", type=float, default=7200.0, help="segment length (modelled s)")
    p.add_argument("--fraction", type=float, default=0.5, help="share of the trace's nodes sampled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speed", type=float, default=60.0, help="time compression")
    p.add_argument("--notice", type=float, default=30.0, help="preemption notice (modelled s); 0 = SIGKILL")
    p.add_argument("--chunk", type=int, default=64, help="checkpoint interval in emulated tokens")
    p.add_argument("--token-scale", type=int, default=64, help="modelled tokens per emulated token")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--t-seed", type=float, default=60.0, help="initial seeding window (modelled s)")
    p.add_argument("--policies", default="colocated,disaggregated,hybrid")
    p.add_argument("--reserved-gpu-hour", type=float, default=Prices.reserved_gpu_hour)
    p.add_argument("--preemptible-gpu-hour", type=float, default=Prices.preemptible_gpu_hour)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    configure_logging(json=s.log_json, level="warning")  # progress lines and the table are the output
    a.policies = [x for x in a.policies.split(",") if x]
    a.prices = Prices(a.reserved_gpu_hour, a.preemptible_gpu_hour)
    events = parse_trace(a.trace)
    nodes = sample_nodes(events, a.fraction, a.seed)
    ivs = intervals([e for e in events if e.node in nodes], a.start, a.duration)
    avg_up = instance_seconds(ivs) / a.duration
    print(f"trace {a.trace}: {len(nodes)} nodes sampled, {len(ivs)} availability intervals, "
          f"{avg_up:.2f} instances up on average; {a.duration:.0f} s compressed {a.speed:g}x", flush=True)
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-trace-")
    out_dir = Path(a.out or tempfile.mkdtemp(prefix="rlboost-trace-out-"))
    with running_services(s.services) as (nats_url, redis_url):
        policies = asyncio.run(evaluate(a, nats_url, redis_url, out_dir, ivs))
    if "colocated" in policies:
        col = policies["colocated"]["throughput"]
        oracle = col * (RESERVED_GPUS + INSTANCE_GPUS * avg_up) / RESERVED_GPUS
        policies["oracle"] = {"throughput": round(oracle, 1), "cost_per_hour": None, "cost_efficiency": None,
                              "preemptions": 0, "regenerated_tokens": 0}
    result: dict = {"policies": policies, "avg_instances_up": round(avg_up, 2), "speed": a.speed}
    if "hybrid" in policies and "colocated" in policies:
        h, c = policies["hybrid"], policies["colocated"]
        result["throughput_ratio"] = round(h["throughput"] / c["throughput"], 3)
        result["cost_efficiency_gain"] = round(h["cost_efficiency"] / c["cost_efficiency"] - 1, 3)
        result["oracle_fraction"] = round(h["throughput"] / policies["oracle"]["throughput"], 3)
    print(f"\n{'policy':14}{'tokens/s':>10}{'$/h':>9}{'tok/s per $/h':>15}{'preempt':>9}{'regen':>9}")
    for name, r in policies.items():
        print(f"{name:14}{r['throughput']:>10,.0f}{(r['cost_per_hour'] or 0):>9.2f}{(r['cost_efficiency'] or 0):>15.2f}"
              f"{r['preemptions']:>9}{r['regenerated_tokens']:>9}")
    plot(ivs, a.duration, policies, out_dir / "trace.png")
    (out_dir / "trace.json").write_text(json.dumps(result, indent=2))
    print(f"(plot and JSON in {out_dir}; published: 1.51-1.97x throughput, +28-49% cost efficiency)")
    print_result(result)
    return 0


def plot(ivs: list[Interval], duration: float, policies: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlboost.spot import available

    ts = [duration * i / 400 for i in range(401)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.step([t / 60 for t in ts], [available(ivs, t) for t in ts], where="post")
    ax1.set_xlabel("minutes")
    ax1.set_ylabel("preemptible instances up")
    ax1.set_title("availability (sampled trace segment)")
    names = list(policies)
    ax2.bar(names, [policies[n]["throughput"] for n in names])
    ax2.set_ylabel("tokens/s (modelled)")
    ax2.set_title("throughput per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
