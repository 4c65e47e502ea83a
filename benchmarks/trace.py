"""`rlboost bench trace`: how much faster and cheaper than the reserved cluster alone, on a real spot trace.

Everything but the GPUs is real: NATS JetStream, Redis, one `RolloutWorker` (the product's,
workers/worker.py) per preemptible instance, started when the trace says the node came up and
preempted when it says it went (a drain with `--notice` modelled seconds, as on SIGTERM, then
an abrupt stop as on SIGKILL; `--notice 0` = the abrupt stop at once), hand-offs through the
resume lane, leases, fencing, the adaptive seeding window. The instances share `--hosts` (2)
fleet-host processes (benchmarks/fleet_host.py), each instance on its own NATS and Redis
connections there: a preemption reaches exactly that instance's requests (the abrupt stop cuts
its connections, then cancels its tasks: no more acks, heartbeats or appends; its leases expire
and its requests return after ACK_WAIT_S to resume elsewhere from their checkpoints). A real
process per instance (`--hosts 0`, SIGTERM / SIGKILL) filled the two cores at 9 processes,
which capped the fleet at 3 instances. The
GPUs are the emulated engine's timing model (workers/engines/emulated.py) and an emulated
trainer (`TRAIN_S_PER_TOKEN`). All figures are in modelled time.

Fleet (the published setup, DESIGN §1): a reserved cluster of 8 H100 = the trainer (emulated
in the bench process) plus its seeding engines: 4 data-parallel engines of 2 GPUs, each a real
`rlboost worker --gpus 2 --slots 256` process serving the reserved cluster's own queue and
handing off to the preemptible pool (`--handoff-pool`; SIGUSR2 = "seeding window over": hand
everything off and serve on). A preemptible instance = 2 H100 = one such worker on the
preemptible pool. Workload: 128 prompts x 8 samples per step, 256-token prompts, log-normal
response lengths (median 1,500, sigma 1.0, capped at 14,336: the long tail of reasoning RL).

Time compression and token granularity. `--speed S` (20): engines sleep 1/S of the modelled
time, the trainer too, trace events fire at t/S. At 16-token chunks the 2-core box carries
~70K checkpointed tokens/s, far below the fleet's ~0.3M modelled tokens per real second. So
each emulated token stands for `--token-scale R` (64) modelled tokens
(`TimingModel.per_emulated_token(R)`: an emulated decode step is R steps, context reads x R^2;
lengths / R; trained tokens x R), and workers checkpoint every `--chunk` (8) emulated tokens =
512 modelled tokens. Counts are honest emulated tokens x R. What this costs in fidelity: a
kill without notice regenerates up to one chunk per request, a killed worker's requests return
after ACK_WAIT_S real seconds (x S modelled), a finished response waits for the end of its
engine call (up to one chunk), and real host work (flushes, admissions, hand-offs, process
start-up) is stretched S times in modelled time. The emulated engine overlaps host work between
calls with GPU time (one call deep, like a pipelined engine), which hides most of it; what is
left shows as ~10-15% of rollout time (colocated rollout ~145 s measured vs 131 s modelled).
That overhead grows with S and with the number of processes sharing the two cores: S=30 cost
the hybrid ~2K tokens/s against S=15. Colocated and disaggregated do not depend on the trace:
they run `--baseline-duration` (900 s) of the segment; hybrid runs the whole segment.
Default: 2 h at S=20 = ~8 minutes in all.

Timing constants, their sources and the calibration: `benchmarks/trace_model.py`.

Policies (one command runs them all). The step is the product's own, `rlboost/orchestrator.py`,
the code `rlboost run` drives: this bench only plugs emulated parts into it (the seeding engines
as `rlboost.workers.seeding.ProcessSeeding` over emulated worker processes, `EmulatedTrainer` as the
trainer clock) and replays the trace. `--mode sync,partial,async` adds the hybrid in those
rollout modes to the same table, JSON and plot (`hybrid-partial`, `hybrid-async`).
- colocated (veRL-style): the 8 GPUs generate the whole step, then train on it;
- disaggregated (balanced): k GPUs generate while 8-k train on groups as they complete, k
  chosen by the timing model to minimise the step (`balanced_split`: 3 generate, as a 2-GPU and
  a 1-GPU engine, and 5 train);
- hybrid (ours): requests are dispatched by capacity: the reserved engines' GPU share
  (interleaved over prompts) on their own queue, the rest on the preemptible pool's, where free
  slots pull it (16 at a time, so a step spreads over the instances). After T_seed (adaptive
  SeedWindow, starting at `--t-seed` 60 s; seeding also ends when the reserved share is all
  done) the reserved engines hand their unfinished responses to the preemptible fleet, and the
  trainer trains on complete groups as they arrive; one optimizer step per batch (on-policy).
  The rule's waits: the trainer's idle time on its own clock, and the preemptible workers'
  time with nothing in flight. With no live preemptible worker the step runs colocated; if the
  fleet vanishes mid-step the reserved cluster takes the work back. Which of the available
  instances it rents is `--fleet` (rlboost/fleet_policy.py): `fixed:3` (the default, the
  hand-picked cap of before: 3 gave the best cost efficiency in calibration), `all` (everything
  the trace offers), or `cost` (after every step, from the run's measured signals: rent or release
  one toward the count with the best tokens/s per $/h within reach, when that count beats the
  current one by more than the hysteresis; a released
  instance drains as on a notice and is not counted as a preemption). A preempted instance is
  replaced at once when another is available. Comma-separated policies run one after the other,
  rows `hybrid-async@cost`, `hybrid-async@all`, ...;
- oracle (computed, not run): every rented GPU-second, reserved or preemptible, at the reserved
  cluster's measured per-GPU rate with zero overhead:
  oracle = colocated x (8 + 2 n) / 8, n = time-averaged instances rented in the segment
  (`oracle_all_available`: the same with every instance the trace offered); per hybrid run,
  on its own rented instances. It is not an upper bound (an instance's GPU counts at colocated's
  per-GPU rate, which pays for training and the latency tail; partial and async pass it). Each
  hybrid run's `bound` is one by construction (`trace_model.throughput_bound`): min(1 /
  TRAIN_S_PER_TOKEN, ~27.8K tokens/s: the trainer never waiting; (8 + 2n) x tokens / (G + 8 x
  TRAIN_S_PER_TOKEN x tokens): the generation its GPUs allow, G the least GPU-seconds its trained
  responses take on full batches, the reserved GPUs generating only while the trainer does not train).

`--calibrate` runs colocated and hybrid with 1, 2, 3, 4 static instances (no preemption) and
prints them next to the published ~10K / 12K / 14K / 16K / 18K tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from rlboost import wire
from rlboost.clients import Clients, open_clients
from rlboost.config import FleetSettings, RolloutSettings, Settings, WorkerSettings
from rlboost.fleet_policy import Signals, decide, remember
from rlboost.benchmarks.costs import Prices, cost_efficiency, cost_per_hour, run_cost
from rlboost.logs import configure_logging
from rlboost.pool_client import PoolClient
from rlboost.offload import SeedWindow
from rlboost.orchestrator import GroupScores, Orchestrator, OrchestratorPorts
from rlboost.replay import migrations, read_subject
from rlboost.services import running_services
from rlboost.benchmarks.spot import (Interval, TraceError, instance_seconds, intervals, parse_trace,
                          sample_nodes, static_intervals)
from rlboost.benchmarks import percentile, report
from rlboost.benchmarks.fleet_host import HostedFleet
from rlboost.benchmarks.trace_family import run_family
from rlboost.benchmarks.trace_report import plot, print_table, rented_of
from rlboost.benchmarks.trace_model import (INSTANCE_GPUS, MAX_NEW_TOKENS, PROMPT_TOKENS, PUBLISHED, RESERVED_GPUS,
                                            SLOTS_PER_GPU, TRAIN_S_PER_TOKEN, balanced_split, generation_gpu_s,
                                            availability_bound, model_hybrid_throughput, model_step_s,
                                            modelled_lengths, seed_of, throughput_bound)
from rlboost.workers.counters import Counters
from rlboost.workers.engines.emulated import EmulatedEngine, LengthModel, TimingModel
from rlboost.workers.fleet import WorkerFleet
from rlboost.workers.seeding import ProcessSeeding

# Real seconds: a request of a worker killed without notice returns after ACK_WAIT_S (x speed
# in modelled time: 30 s, against the 10 s a real deployment uses); leases must expire before
# that. Live workers extend both every 0.25 s heartbeat, so 6 missed beats mean dead. At 6 s
# (120 modelled s) each SIGKILL cost its step ~100 s (--notice 0: x1.43 instead of x1.52); at
# 1.5 s the kills cost nothing visible and no live worker was fenced (`fenced_tokens` 0).
ACK_WAIT_S, LEASE_TTL_S = 1.5, 1.0


def fleet_settings(spec: str, prices: Prices, max_instances: int = 0) -> FleetSettings:
    """`--fleet cost | all | fixed:N` as `[fleet]` settings at the bench's prices."""
    name, _, n = spec.partition(":")
    if name not in ("cost", "all", "fixed") or (name == "fixed") != bool(n) or (n and not n.isdigit()):
        raise ValueError(f"--fleet {spec!r}: use cost, all or fixed:N")
    return FleetSettings(policy=name, fixed=int(n) if n else 3, max_instances=max_instances,
                         reserved_dollars_per_hour=RESERVED_GPUS * prices.reserved_gpu_hour,
                         instance_dollars_per_hour=INSTANCE_GPUS * prices.preemptible_gpu_hour)


def prior_signals(a: argparse.Namespace, available: int) -> Signals:
    """What the cost policy assumes before the first step is measured (then replaced, step by
    step, by the run's own measurements): the timing model's rates (trace_model.py), the
    trainer's per-token time, the seeding window's floor, and the latency of the longest response (a
    14,336-token decode at the model's base step time, ~86 s) as the rollout's floor."""
    t = TimingModel()
    tokens = float(modelled_lengths(0, a.prompts, a.samples).sum())
    return Signals(instances=0, available=available, step_tokens=tokens, trainer_s_per_token=TRAIN_S_PER_TOKEN,
                   instance_tokens_per_s=3000.0, reserved_tokens_per_s=tokens / 131.0, t_seed_s=SEED_FLOOR_S,
                   tail_s=MAX_NEW_TOKENS * t.step_base_s, replace_s=30.0)


SERIES = ("series", "rented_series", "decisions", "rented_intervals")  # a run's series: trace.json only
SEED_FLOOR_S = 5.0  # modelled s: the adaptive seeding window's floor (SeedWindow floor_s x S)


class EmulatedTrainer:
    """The bench's trainer clock: a group takes its modelled training time (its tokens at
    `s_per_token` real seconds each), back to back from when the trainer could start on it."""

    def __init__(self, s_per_token: float, token_scale: int) -> None:
        self.s_per_token, self.R = s_per_token, token_scale

    async def train_group(self, key, results, scored, start: float) -> float:
        done = start + self.R * sum(len(r.token_ids) for r in results) * self.s_per_token
        await asyncio.sleep(max(0.0, done - time.monotonic()))
        return done

    async def finish_step(self, step: int) -> None:
        return None  # the optimizer step is in the per-token rate (TRAIN_S_PER_TOKEN)


class Emulation:
    """One policy over one segment: the emulated trainer in this process, the reserved seeding
    engines and the preemptible fleet (replaying the trace) as real worker processes."""

    def __init__(self, a: argparse.Namespace, c: Clients, nats_url: str, redis_url: str, workdir: Path, label: str,
                 policy: str, ivs: list[Interval], mode: str = "sync", fleet_spec: str | None = None) -> None:
        self.a, self.c, self.label, self.policy, self.ivs, self.S = a, c, label, policy, ivs, a.speed
        self.pool = wire.check_name("pool", f"trace-{label}-{wire.new_run_id()}")
        self.reserved_pool = f"{self.pool}-reserved"  # the seeding engine's own queue: its share
        self.manager = PoolClient(c, self.pool)
        self.hb_s = 0.25  # heartbeats carry in-flight counts: the seeding rule's idle measure
        # The preemptible instances: emulated workers sharing `--hosts` fleet-host processes
        # (benchmarks/fleet_host.py), or one worker process each (`--hosts 0`, as before)
        hosts = getattr(a, "hosts", 0)
        # die_with_parent: a bench stopped by a signal or an error leaves no worker behind (host
        # processes end with their stdin)
        fleet = ((lambda *args, **kw: HostedFleet(*args, hosts=hosts, **kw)) if hosts
                 else (lambda *args, **kw: WorkerFleet(*args, die_with_parent=True, **kw)))
        self.fleet = fleet(nats_url, redis_url, workdir / label, self.pool, worker_args=[
            "--engine", "emulated", "--speed", str(a.speed), "--gpus", str(INSTANCE_GPUS),
            "--slots", str(INSTANCE_GPUS * SLOTS_PER_GPU), "--checkpoint-tokens", str(a.chunk),
            "--token-scale", str(a.token_scale), "--ack-wait", str(ACK_WAIT_S), "--lease-ttl", str(LEASE_TTL_S),
            "--drain-grace", str(max(0.05, a.notice / a.speed))],
            env={"RLBOOST_LOG_LEVEL": "warning", "RLBOOST_WORKER__HEARTBEAT_S": str(self.hb_s)})
        self.split = balanced_split() if policy == "disaggregated" else RESERVED_GPUS
        # The reserved cluster's rollout GPUs: data-parallel engines of INSTANCE_GPUS each, as
        # worker processes serving its own queue and handing off to the preemptible pool.
        self.reserved_fleet = WorkerFleet(nats_url, redis_url, workdir / label, self.reserved_pool, worker_args=[
            "--engine", "emulated", "--speed", str(a.speed), "--gpus", str(INSTANCE_GPUS),
            "--slots", str(INSTANCE_GPUS * SLOTS_PER_GPU), "--checkpoint-tokens", str(a.chunk),
            "--token-scale", str(a.token_scale), "--ack-wait", str(ACK_WAIT_S), "--lease-ttl", str(LEASE_TTL_S),
            "--handoff-pool", self.pool],
            env={"RLBOOST_LOG_LEVEL": "warning", "RLBOOST_WORKER__HEARTBEAT_S": str(self.hb_s)}, die_with_parent=True)
        R = a.token_scale
        self.engine = EmulatedEngine(speed=a.speed, timing=TimingModel().on_gpus(self.split).per_emulated_token(R),
                                     lengths=LengthModel().per_emulated_token(R))
        self.train_s_per_token = TRAIN_S_PER_TOKEN * RESERVED_GPUS / (RESERVED_GPUS - self.split
                                                                       if policy == "disaggregated" else RESERVED_GPUS)
        self.window = SeedWindow(initial_s=a.t_seed / self.S, floor_s=SEED_FLOOR_S / self.S)
        self.counters = Counters()
        self.preempted: set[str] = set()
        self.notice_exceeded = 0
        self.provision_s: list[float] = []
        self.killed_at: dict[str, float] = {}  # worker id -> wall time of its SIGKILL
        self.taken_over: dict[str, tuple[str, str]] = {}  # request id -> (preempted worker, next worker)
        self.migrated_from_preempted = 0
        self.rows: list[dict] = []
        self.mode = mode
        self.staleness: list[int] = []  # of every trained response (partial / async)
        self._reserved_made = 0  # modelled tokens the seeding engines had generated at the last step's end
        self.generation_s = 0.0  # GPU-seconds its trained responses took at the least (the bound)
        self.overlap_tokens = 0  # trained in steps where reserved generation and training may overlap
        self.run_id = wire.new_run_id()
        # which instances are rented: `--fleet` (rlboost/fleet_policy.py), from what the trace offers
        self.fleet_policy = fleet_settings(fleet_spec or getattr(a, "fleet", "all"), a.prices,
                                           getattr(a, "max_instances", 0))
        self.held: dict[Interval, tuple[object, float]] = {}  # rented now -> (instance, rented since)
        self.rented: list[Interval] = []  # rented stretches that ended (released, preempted)
        self.desired = 0  # cost: the policy's last decision
        # per step: [t, available, rented, desired, reason, instance and reserved tokens/s, modelled tokens/s]
        self.decisions: list[list] = []
        self.rented_series: list[list] = []  # [t, available, rented] at every change
        self.changed = asyncio.Event()
        self.signals: Signals | None = None
        self.issued: dict[str, tuple[int, int]] = {}  # (tests) request id -> (seed, max new tokens)

    # ------------------------------------------------------------------ the trace

    async def _live(self, exclude: set[str] = frozenset()) -> int:
        return len(await self.manager.live_workers(exclude=exclude))

    async def prestart(self) -> dict:
        """The reserved engines, and the nodes up when the segment starts (provisioned before
        it), start before the clock."""
        whole, odd = divmod(self.split, INSTANCE_GPUS)
        # the seeding engines' share of a step: their GPUs against a preemptible instance's
        self.seeding = ProcessSeeding(
            self.c, self.pool, self.reserved_fleet,
            [("--gpus", str(g), "--slots", str(g * SLOTS_PER_GPU)) for g in [INSTANCE_GPUS] * whole + [odd] * (odd > 0)],
            self.engine, self._fallback_settings, self.counters, capacity=RESERVED_GPUS / INSTANCE_GPUS)
        rollout = RolloutSettings(mode=self.mode, prompts=self.a.prompts, samples=self.a.samples, max_staleness=getattr(
            self.a, "max_staleness", 1), overprovision=getattr(self.a, "overprovision", 0.25), in_flight_updates=getattr(
            self.a, "in_flight_updates", True))
        trainer = EmulatedTrainer(self.train_s_per_token / self.S, self.a.token_scale)  # self: the task (modelled prompts)
        self.orchestrator = Orchestrator(rollout, OrchestratorPorts(self.c, self.pool, self.seeding, self, trainer, window=self.window,
                                                                    on_result=self._on_result), policy=self.policy, waiting_period_s=self.hb_s)
        if self.policy == "hybrid" and self.ivs and isinstance(self.fleet, HostedFleet):
            self.fleet.open()  # the host processes start before the clock, like the nodes up at 0
        procs = {}
        if self.policy == "hybrid":
            self.signals = prior_signals(self.a, sum(iv.up_s <= 0 for iv in self.ivs))
            # cost starts at `fixed` (3) and moves on what each step measures
            self.desired = self.fleet_policy.fixed
            for iv in self._to_rent(0.0):
                procs[iv] = self.fleet.start(prefix="node")
                self.held[iv] = (procs[iv], 0.0)
            self._note(0.0)
        start = asyncio.create_task(self.seeding.start())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and await self._live() < len(procs):
            await asyncio.sleep(0.1)
        await start
        return procs

    def _available(self, t: float) -> list[Interval]:
        # (a node the segment's end cut off stays up past it: a step may end a little later)
        return [iv for iv in self.ivs if iv.up_s <= t and (t < iv.down_s or not iv.preempted)]

    def _target(self, t: float) -> int:
        up = len(self._available(t))
        if self.fleet_policy.policy == "cost":
            return min(self.desired, up)
        return decide(self.fleet_policy, Signals(len(self.held), up, 1, 1, 1, 1, 0)).desired

    def _to_rent(self, t: float) -> list[Interval]:
        free = [iv for iv in self._available(t) if iv not in self.held]
        return free[:max(0, self._target(t) - len(self.held))]

    def _note(self, t: float) -> None:
        row = [round(t, 1), len(self._available(t)), len(self.held)]
        if not self.rented_series or self.rented_series[-1][1:] != row[1:]:
            self.rented_series.append(row)

    async def replay(self, t0: float, stop: asyncio.Event, procs: dict) -> None:
        """Replay the trace (time compressed by S) and follow the fleet policy: rent available
        instances up to its target, replace a preempted one at once, release (drain, as on a
        preemption notice, but not counted as one) what it no longer wants."""
        points = sorted({i.up_s for i in self.ivs if i.up_s > 0} | {i.down_s for i in self.ivs if i.preempted})
        tasks = []
        while not stop.is_set():
            now = (time.monotonic() - t0) * self.S
            nxt = next((p for p in points if p > now), None)
            delay = (nxt - now) / self.S if nxt is not None else 3600.0
            self.changed.clear()
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.changed.wait())]
            await asyncio.wait(waits, timeout=max(0.0, delay), return_when=asyncio.FIRST_COMPLETED)
            for f in waits:
                f.cancel()
            if stop.is_set():
                break
            now = max(now, (time.monotonic() - t0) * self.S)
            if nxt is not None and now < nxt and not self.changed.is_set():
                now = nxt  # woken by the timer a hair early
            for iv in [iv for iv in self.held if iv.preempted and iv.down_s <= now]:
                w, since = self.held.pop(iv)
                procs.pop(iv, None)
                self.rented.append(Interval(iv.node, since, iv.down_s, True))
                if getattr(self.a, "preempt_busy", False):
                    await self._holding_work(w)
                self.preempted.add(w.worker_id)
                if self.a.notice > 0:
                    self.fleet.terminate(w)
                    tasks.append(asyncio.create_task(self._kill_after_notice(w)))
                else:
                    self.killed_at[w.worker_id] = await asyncio.to_thread(self.fleet.kill, w)
            for iv in self._to_rent(now):
                procs[iv] = self.fleet.start(prefix="node")
                self.held[iv] = (procs[iv], now)
                tasks.append(asyncio.create_task(self._provisioned(procs[iv].worker_id, time.monotonic())))
            while len(self.held) > self._target(now):  # release the latest rented first
                iv = max(self.held, key=lambda i: self.held[i][1])
                w, since = self.held.pop(iv)
                procs.pop(iv, None)
                self.rented.append(Interval(iv.node, since, now, False))
                self.fleet.terminate(w)
                tasks.append(asyncio.create_task(self._kill_after_notice(w)))
            self._note(now)
        await asyncio.gather(*tasks, return_exceptions=True)

    def rented_intervals(self, until_s: float) -> list[Interval]:
        """Every rented stretch, those still held ending at `until_s`."""
        return sorted(self.rented + [Interval(iv.node, since, until_s, False) for iv, (_, since) in self.held.items()],
                      key=lambda i: (i.up_s, i.node))

    def _measure(self, row: dict, o) -> None:
        """The policy's signals from the step just run (means with the previous ones), then its decision."""
        R, sig = self.a.token_scale, self.signals
        if sig is None or self.policy != "hybrid":
            return
        spot_ids = set(self.fleet.workers)
        spot = 0
        for _, results in o.trained:
            for r in results:
                segs = r.segments
                for k, seg in enumerate(segs):
                    end = segs[k + 1].offset if k + 1 < len(segs) else len(r.token_ids)
                    if seg.worker_id in spot_ids:
                        spot += R * max(0, end - seg.offset)
        n = len(self.held)
        busy = row["rollout_s"] if self.mode == "sync" else row["step_s"]
        new = dict(step_tokens=float(row["tokens"]) or sig.step_tokens)
        if n and o.live and busy > 0 and spot:
            new["instance_tokens_per_s"] = spot / (o.live * busy)
        # the seeding engines' rate: what they generated in this step's window (they are idle
        # while the trainer trains). Not the trained step's reserved tokens per second of window:
        # in async those were made in the previous step's window (published ahead), so while
        # T_seed fell from 60-90 s to its 5 s floor a long window's tokens were divided by a short
        # one's (86K tokens/s), the model saw seeding do most of a step and released instances.
        made = R * sum(w.counters()["generated"] for w in self.reserved_fleet.workers.values())
        seeded, self._reserved_made = made - self._reserved_made, made
        if row["t_seed"] and seeded > 0:
            new["reserved_tokens_per_s"] = seeded / row["t_seed"]
        now = row["t_end_s"]
        inst_h = instance_seconds(self.rented_intervals(now)) / 3600
        preempt = (len(self.preempted) / inst_h) if inst_h > 0.5 else 0.0
        mix = {k: (getattr(sig, k) + v) / 2 if k != "step_tokens" else v for k, v in new.items()}
        seen = remember(sig.seen, o.live, row["tokens"] / row["step_s"]) if o.live == n and row["step_s"] else sig.seen
        self.signals = Signals(**{**sig.__dict__, **mix, "seen": seen, "instances": n, "available": len(self._available(now)),
                                  "preemptions_per_instance_hour": preempt,
                                  "replace_s": statistics.median(self.provision_s) if self.provision_s else sig.replace_s})
        sig = self.signals
        if self.fleet_policy.policy == "cost" and n < self.desired:  # fewer available than it wants:
            self.decisions.append([now, sig.available, n, self.desired, f"cost: wants {self.desired}, "
                                   f"{sig.available} available", round(sig.instance_tokens_per_s),
                                   round(sig.reserved_tokens_per_s), 0])
            return  # its intent stands until instances come (a dip in availability is no measurement)
        d = decide(self.fleet_policy, sig)
        self.decisions.append([now, sig.available, n, d.desired, d.reason, round(sig.instance_tokens_per_s),
                               round(sig.reserved_tokens_per_s), round(d.tokens_per_s)])
        if self.fleet_policy.policy == "cost" and d.desired != self.desired:
            self.desired = d.desired
            self.changed.set()

    async def _holding_work(self, w, timeout_s: float = 30.0) -> None:
        """(tests: `preempt_busy`) Hold a preemption until the instance holds a request in
        progress with tokens of its own checkpointed and at least 3 chunks still to make, so a
        scenario never depends on how fast a loaded box ran (the state is read from Redis)."""
        lengths = LengthModel().per_emulated_token(self.a.token_scale)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rid, (seed, cap) in list(self.issued.items()):
                owner, _, finished = await self.c.store.owner(rid)
                if finished:
                    del self.issued[rid]
                elif owner == w.worker_id and (segs := await self.c.store.segments(rid)) \
                        and segs[-1].worker_id == w.worker_id:
                    made = len((await self.c.store.read(rid))[0])  # its segment: from segs[-1].offset on
                    if made > segs[-1].offset and min(cap, lengths.length(seed, rid)) - made >= 3 * self.a.chunk:
                        return
            await asyncio.sleep(0.02)

    async def _provisioned(self, worker_id: str, started: float) -> None:
        while time.monotonic() - started < 30:
            if any(hb.worker_id == worker_id for hb in await self.manager.live_workers()):
                self.provision_s.append((time.monotonic() - started) * self.S)
                return
            await asyncio.sleep(0.05)

    async def _kill_after_notice(self, w) -> None:
        await asyncio.sleep(self.a.notice / self.S + 0.2)
        if w.alive():
            self.notice_exceeded += 1
            self.killed_at[w.worker_id] = await asyncio.to_thread(self.fleet.kill, w)

    async def _migration_latency(self) -> dict:
        """Modelled seconds from a request leaving a worker to its claim by the next (read back
        from the lease events): after a release (a seeding engine's hand-off at T_seed, a
        preempted node's within its notice), or after the SIGKILL of a node that left none.
        A takeover is read from the results' segments (the checkpoint's history): lease events
        leave a worker in batches, so one killed right after claiming never sent those claims."""
        events = [e for e in await read_subject(self.c.js, "rb.evt.>", wire.LeaseEvent, idle_s=1.0)
                  if e.request_id.startswith(self.run_id)]
        handoff, takeover = [], []
        for left, claimed in migrations(events):
            if left.kind == "release":
                handoff.append((claimed.ts - left.ts) * self.S)
        claims: dict[tuple[str, str], list[float]] = defaultdict(list)  # (request, worker) -> claim times
        for e in events:
            if e.kind == "claim":
                claims[(e.request_id, e.worker_id)].append(e.ts)
        for rid, (killed, nxt) in self.taken_over.items():
            if killed in self.killed_at:  # its first claim by the next holder after the kill
                after = [ts for ts in claims.get((rid, nxt), ()) if ts >= self.killed_at[killed]]
                if after:
                    takeover.append((min(after) - self.killed_at[killed]) * self.S)

        def summary(xs: list[float]) -> dict:
            return {"n": len(xs), "p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95), "max": percentile(xs, 1.0)}

        return {"after_handoff_s": summary(handoff), "after_kill_s": summary(takeover)}

    # ------------------------------------------------------------------ one step

    def _fallback_settings(self, pool: str, handoff_pool: str) -> WorkerSettings:
        """The reserved cluster taking a vanished fleet's work back: its rollout GPUs, in this process."""
        return WorkerSettings(pool=pool, handoff_pool=handoff_pool, slots=self.split * SLOTS_PER_GPU,
                              checkpoint_tokens=self.a.chunk, heartbeat_s=self.hb_s, ack_wait_s=ACK_WAIT_S,
                              lease_ttl_s=LEASE_TTL_S)

    def _on_result(self, r: wire.RolloutResult, arrived: int, total: int) -> None:
        if any(s.worker_id in self.preempted for s in r.segments[:-1]):
            self.migrated_from_preempted += 1
            for a, b in zip(r.segments, r.segments[1:]):
                if a.worker_id in self.preempted and b.worker_id != a.worker_id:
                    self.taken_over[r.request_id] = (a.worker_id, b.worker_id)

    async def requests(self, step: int, version: int, groups: int) -> list[wire.RolloutRequest]:
        R = self.a.token_scale
        if getattr(self.a, "preempt_busy", False):  # (tests) what `_holding_work` looks at
            self.issued.update({wire.request_id(step, p, g, run=self.run_id): (seed_of(step, p, g), MAX_NEW_TOKENS // R)
                                for p in range(groups) for g in range(self.a.samples)})
        return [wire.RolloutRequest(request_id=wire.request_id(step, p, g, run=self.run_id), step=step,
                                    policy_version=version, prompt_ids=[7] * (PROMPT_TOKENS // R),
                                    max_new_tokens=MAX_NEW_TOKENS // R, seed=seed_of(step, p, g), group=p)
                for p in range(groups) for g in range(self.a.samples)]

    async def score(self, key, results: list[wire.RolloutResult]) -> GroupScores:  # tokens are trained, not rewards
        return GroupScores([0.0] * len(results))

    async def evaluate(self) -> None:  # no held-out set
        return None

    async def step(self, step: int) -> dict:
        """One step of the product's orchestration (rlboost/orchestrator.py), on emulated engines."""
        # the emulated trainer's version: the step (workers' emulated weights are virtual)
        o = await self.orchestrator.step(step, step if self.mode != "sync" else 0)
        R, S = self.a.token_scale, self.S
        tokens = R * sum(len(r.token_ids) for _, results in o.trained for r in results)  # modelled tokens
        self.staleness += o.staleness
        self._last_outcome = o
        # the bound's inputs (trace_model.throughput_bound): the least GPU time its trained
        # responses took, and the tokens of steps where the seeding engines may have generated
        # while the trainer trained: a fallback, or no hand-off (they serve their queue on)
        self.generation_s += generation_gpu_s([R * len(r.token_ids) for _, rs in o.trained for r in rs], R)
        if o.fallback or not (getattr(self.seeding, "handed_off", False) or (self.mode == "sync" and not o.live)):
            self.overlap_tokens += tokens
        return {"tokens": tokens, "live": o.live, "handoffs": o.handoffs,
                "t_seed": None if o.t_seed is None else round(o.t_seed * S, 1),
                "trainer_wait_s": round(o.trainer_wait_s * S, 1), "spot_waiting_s": round(o.spot_waiting_s * S, 1),
                "rollout_ahead_s": round(o.rollout_ahead_s * S, 1), "rollout_s": round(o.rollout_s * S, 1),
                "step_s": round(o.step_s * S, 1), "carried_groups": o.carried_groups}

    # ------------------------------------------------------------------ a whole run

    async def run(self, duration_model_s: float) -> dict:
        procs = await self.prestart()
        t0 = time.monotonic()
        stop = asyncio.Event()
        replay = asyncio.create_task(self.replay(t0, stop, procs)) if self.policy == "hybrid" else None
        tokens, t_done = 0, t0
        try:
            while time.monotonic() - t0 < duration_model_s / self.S:
                row = await self.step(len(self.rows))
                if time.monotonic() - t0 > duration_model_s / self.S * 1.05:
                    break  # a step that ran far past the segment's end does not count
                tokens, t_done = tokens + row["tokens"], time.monotonic()
                row["t_end_s"] = round((t_done - t0) * self.S, 1)
                self.rows.append(row)
                self._measure(row, self._last_outcome)
                print(f"  {self.label:14} step {len(self.rows):3d}  t={row['t_end_s']:6.0f} s  "
                      f"{row['tokens'] / row['step_s']:8,.0f} tok/s (run {tokens / row['t_end_s']:8,.0f})  "
                      f"step {row['step_s']:5.0f} s  live {row['live']:2d}  T_seed {row['t_seed'] or '-'}  "
                      f"hand-offs {row['handoffs']}  rollout {row['rollout_s']:.0f} s", flush=True)
        finally:
            stop.set()
            if replay:
                await replay
            await self.orchestrator.close()
            await asyncio.to_thread(self.fleet.stop_all)
            await self.seeding.close()
        migration = await self._migration_latency() if self.policy == "hybrid" else None
        R = self.a.token_scale
        counted = {w.worker_id: w.counters() for w in [*self.fleet.workers.values(), *self.reserved_fleet.workers.values()]}
        counted["(seeding)"] = self.counters.snapshot()
        regenerated = R * sum(max(0, c["generated"] - c["checkpointed"]) for c in counted.values())
        fenced = R * sum(c["fenced"] for c in counted.values())  # a live worker's lease lost (a spurious expiry)
        # Generated and never checkpointed, by why: its worker SIGKILLed (no notice, or the notice
        # ran out: `killed_at`), its lease lapsed under it (fenced: a starved host), or neither
        # (a worker that drained or stopped with tokens it never flushed: 0 on a healthy run)
        by_cause = {"killed": 0, "lease_lapsed": 0, "unflushed": 0}
        for wid, c in counted.items():
            lost = max(0, c["generated"] - c["checkpointed"])
            lapsed = min(c["fenced"], lost)
            by_cause["lease_lapsed"] += R * lapsed
            by_cause["killed" if wid in self.killed_at else "unflushed"] += R * (lost - lapsed)
        elapsed = (t_done - t0) * self.S
        fleet = self.rented_intervals(elapsed) if self.policy == "hybrid" else []
        inst_s = instance_seconds(fleet, until_s=elapsed)
        dollars = run_cost(elapsed, RESERVED_GPUS, inst_s, INSTANCE_GPUS, self.a.prices)
        throughput = tokens / elapsed if elapsed else 0.0
        rate = cost_per_hour(dollars, elapsed) if elapsed else 0.0
        bound = throughput_bound(tokens, self.generation_s, inst_s / elapsed if elapsed else 0.0, self.overlap_tokens,
                                 self.train_s_per_token) if self.policy == "hybrid" else {}
        return {"throughput": round(throughput, 1), "cost_per_hour": round(rate, 2),
                "cost_efficiency": round(cost_efficiency(throughput, rate), 2) if rate else 0.0,
                "preemptions": len(self.preempted), "regenerated_tokens": regenerated, "fenced_tokens": fenced,
                "regenerated_by_cause": by_cause,
                "steps": len(self.rows), "tokens": tokens, "modelled_s": round(elapsed),
                "instance_hours": round(inst_s / 3600, 2), "handoffs": self.orchestrator.handoffs,
                "migrated_from_preempted": self.migrated_from_preempted, "migration_latency": migration, "notice_exceeded": self.notice_exceeded,
                "fallbacks": self.orchestrator.fallbacks, "mode": self.mode,
                "staleness_max": max(self.staleness, default=0),
                "staleness_mean": round(statistics.fmean(self.staleness), 3) if self.staleness else 0.0,
                "workers_started": len(self.fleet.workers),
                "provision_s_p50": round(statistics.median(self.provision_s), 1) if self.provision_s else None,
                "rollout_gpus": self.split, "t_seed_last": self.rows[-1]["t_seed"] if self.rows else None,
                "fleet": self.fleet_policy.policy + (f":{self.fleet_policy.fixed}" if self.fleet_policy.policy == "fixed" else ""),
                "avg_instances_rented": round(inst_s / elapsed, 2) if elapsed else 0.0,
                **{k: round(v, 1) for k, v in bound.items()}, "overlap_tokens": self.overlap_tokens,
                "generation_s": round(self.generation_s, 1), "train_s_per_token": self.train_s_per_token,
                "rented_series": self.rented_series, "decisions": self.decisions,
                "rented_intervals": [[i.node, round(i.up_s, 1), round(i.down_s, 1), i.preempted] for i in fleet],
                "series": [[r["t_end_s"], round(r["tokens"] / r["step_s"])] for r in self.rows]}


async def evaluate(a: argparse.Namespace, nats_url: str, redis_url: str, workdir: Path, runs: list[tuple]) -> dict:
    """`runs`: (label, policy, intervals, rollout mode, fleet spec)."""
    out: dict[str, dict] = {}
    async with open_clients(nats_url, redis_url, "rlboost-trace") as c:
        for label, policy, ivs, mode, fleet in runs:
            print(f"{label}:", flush=True)
            t = time.monotonic()
            traced = a.trace or getattr(a, "traces", "")  # reserved-only runs do not depend on it: shorter
            duration = a.duration if policy == "hybrid" or not traced else min(a.duration, a.baseline_duration)
            out[label] = await Emulation(a, c, nats_url, redis_url, workdir,
                                         label.replace("@", "-").replace(":", "").replace("|", "-"),
                                         policy, ivs, mode, fleet).run(duration)
            out[label]["wall_s"] = round(time.monotonic() - t, 1)
    return out


def oracle(colocated: dict, ivs: list[Interval], duration_s: float, prices: Prices) -> dict:
    n = instance_seconds(ivs) / duration_s
    thr = colocated["throughput"] * (RESERVED_GPUS + INSTANCE_GPUS * n) / RESERVED_GPUS
    rate = cost_per_hour(run_cost(duration_s, RESERVED_GPUS, instance_seconds(ivs), INSTANCE_GPUS, prices), duration_s)
    return {"throughput": round(thr, 1), "cost_per_hour": round(rate, 2),
            "cost_efficiency": round(cost_efficiency(thr, rate), 2), "preemptions": 0, "regenerated_tokens": 0}


TRAINER_BOUND = 1.0 / TRAIN_S_PER_TOKEN  # tokens/s: the trainer with rollout never waiting (~27.8K)


def summarise(policies: dict, ivs: list[Interval], a: argparse.Namespace) -> dict:
    """Each hybrid run against colocated: `oracle` (linear: colocated x (8 + 2n) / 8 on the
    instances that run rented) and `bound` (the run's own upper bound, `trace_model.throughput_bound`:
    min(the trainer with rollout never waiting, the generation its GPU-seconds allow)), with the run's
    share of each. The `oracle` row is the first hybrid run's; `oracle_all_available` counts every
    instance-second the trace offered."""
    result: dict = {"policies": policies, "trainer_bound": round(TRAINER_BOUND, 1)}
    hybrids = [k for k, v in policies.items() if k.startswith("hybrid") and "rented_intervals" in v]
    if "colocated" not in policies or not hybrids:
        return result
    c = policies["colocated"]
    if not (c.get("throughput") and c.get("cost_efficiency")):  # nothing to compare against
        result["note"] = "colocated finished no step: give it a longer --baseline-duration"
        return result
    for k in hybrids:
        h = policies[k]
        o = oracle(c, rented_of(h), a.duration, a.prices)["throughput"]
        h.update({"throughput_ratio": round(h["throughput"] / c["throughput"], 3),
                  "cost_efficiency_gain": round(h["cost_efficiency"] / c["cost_efficiency"] - 1, 3),
                  "oracle": o, "oracle_fraction": round(h["throughput"] / o, 3)})
        bound = h.get("bound") or TRAINER_BOUND  # (a run's own: trace_model.throughput_bound)
        h.update({"bound": bound, "bound_fraction": round(h["throughput"] / bound, 3)})
        if h.get("tokens") and h.get("generation_s"):  # what the trace offered (maybe nothing), not what it rented
            ab = availability_bound(ivs, a.duration, h["generation_s"] / h["tokens"], c["throughput"],
                                    h.get("train_s_per_token", TRAIN_S_PER_TOKEN))
            h.update({"availability_bound": round(ab["availability_bound"], 1),
                      "availability_fraction": round(h["throughput"] / ab["availability_bound"], 3),
                      "none_available_s": round(ab["none_available_s"])})
    policies["oracle"] = oracle(c, rented_of(policies[hybrids[0]]), a.duration, a.prices)
    result["oracle_all_available"] = oracle(c, ivs, a.duration, a.prices)
    for k in hybrids:  # the first fleet's runs under the keys of before (`throughput_ratio`, `async_oracle_fraction`, ...)
        base = k.partition("@")[0]
        prefix = "" if base == "hybrid" else base.removeprefix("hybrid-") + "_"
        if base.startswith("hybrid") and f"{prefix}throughput_ratio" not in result:
            for key in ("throughput_ratio", "cost_efficiency_gain", "oracle_fraction", "bound", "bound_fraction",
                        "availability_bound", "availability_fraction"):
                if key in policies[k]:
                    result[prefix + key] = policies[k][key]
    return result


def _runs(a: argparse.Namespace, p: argparse.ArgumentParser, argv: list[str]) -> tuple[list[Interval], list[tuple]]:
    """The availability intervals and the runs (label, policy, intervals, mode, fleet) the
    command line asks for; prints what the trace segment holds."""
    if a.calibrate or a.static:
        a.duration = a.duration if "--duration" in argv else 1800.0
        ivs: list[Interval] = []
        counts = [int(x) for x in (a.static or "1,2,3,4").split(",") if x]
        runs = ([("colocated", "colocated", [])] if a.calibrate else []) + [
            (f"static-{n}", "hybrid", static_intervals(n, a.duration)) for n in counts]
        runs = [(label, policy, x, "sync", "all") for label, policy, x in runs]
    else:
        if not a.trace:
            p.error("--trace FILE is required (or --calibrate)")
        events = parse_trace(a.trace)  # TraceError, OSError: the caller's one line
        nodes = sample_nodes(events, a.fraction, a.seed)
        ivs = intervals([e for e in events if e.node in nodes], a.start, a.duration)
        names = [x for x in a.policies.split(",") if x]
        runs = [(x, x, [], "sync", "all") for x in names if x != "hybrid"]
        runs += [(label, "hybrid", ivs, m, f) for label, m, f in _hybrids(a, p)]
        print(f"trace {a.trace}: {len(nodes)} of {len({e.node for e in events})} nodes sampled (seed {a.seed}), "
              f"segment [{a.start:.0f}, {a.start + a.duration:.0f}) s: {len(ivs)} availability intervals, "
              f"{sum(i.preempted for i in ivs)} preemptions, {instance_seconds(ivs) / a.duration:.2f} instances up "
              f"on average; --fleet {a.fleet}" + (f" (at most {a.max_instances})" if a.max_instances else "")
              + f"; compressed {a.speed:g}x "
              f"(~{(a.duration + a.baseline_duration * (len(runs) - 1)) / a.speed / 60:.0f} min)", flush=True)
    return ivs, runs


def _hybrids(a: argparse.Namespace, p: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """The hybrid runs asked for, (label, rollout mode, fleet spec): each rollout mode under each
    fleet policy, in the same table (none where --policies leaves the hybrid out)."""
    fleets = [f for f in a.fleet.split(",") if f]
    try:
        for f in fleets:
            fleet_settings(f, a.prices)
    except ValueError as e:
        p.error(str(e))
    modes = [m for m in a.mode.split(",") if m]
    if set(modes) - {"sync", "partial", "async"}:
        p.error(f"--mode {a.mode}: use sync, partial, async (comma-separated)")
    names = [x for x in a.policies.split(",") if x]
    unknown = set(names) - {"colocated", "disaggregated", "hybrid"}
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}")
    if "hybrid" not in names:
        return []
    return [(("hybrid" if m == "sync" else f"hybrid-{m}") + (f"@{f}" if len(fleets) > 1 else ""), m, f)
            for f in fleets for m in modes]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlboost bench trace", description=__doc__.splitlines()[0])
    p.add_argument("--trace", help="a trace file: `ms,add|remove,nodeN` per line")
    p.add_argument("--traces", default="", help="instead of --trace, a family: p3, g4dn (the bundled Bamboo traces), "
                   "synthetic:SEED or synthetic:FIRST-LAST (benchmarks/trace_gen.py), trace files; comma-separated. "
                   "Each row per trace, then the median and the worst (benchmarks/trace_family.py)")
    p.add_argument("--start", type=float, default=0.0, help="segment start (s into the trace)")
    p.add_argument("--duration", type=float, default=7200.0, help="segment length (modelled s)")
    p.add_argument("--fraction", type=float, default=0.5, help="share of the trace's nodes sampled")
    p.add_argument("--seed", type=int, default=0, help="node sampling seed")
    p.add_argument("--speed", type=float, default=20.0, help="time compression (modelled s per real s)")
    p.add_argument("--notice", type=float, default=30.0, help="preemption notice (modelled s); 0 = SIGKILL")
    p.add_argument("--chunk", type=int, default=8, help="checkpoint interval in emulated tokens")
    p.add_argument("--token-scale", type=int, default=64, help="modelled tokens per emulated token")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--t-seed", type=float, default=60.0, help="initial seeding window (modelled s)")
    p.add_argument("--policies", default="colocated,disaggregated,hybrid")
    p.add_argument("--mode", default="sync", help="rollout modes of the hybrid, beside sync: e.g. sync,partial,async "
                   "(rlboost/orchestrator.py)")
    p.add_argument("--max-staleness", type=int, default=1, help="async: versions a trained token may lag")
    p.add_argument("--overprovision", type=float, default=0.25, help="partial: extra groups kept in flight")
    p.add_argument("--no-in-flight-updates", dest="in_flight_updates", action="store_false",
                   help="async: each request generated under its published version only (a worker finishes "
                        "its old version's requests before it takes the next version's)")
    p.add_argument("--calibrate", action="store_true",
                   help="colocated and hybrid with 1-4 static instances, against the published figures")
    p.add_argument("--fleet", default="fixed:3",
                   help="which available instances the hybrid rents (rlboost/fleet_policy.py): cost, all or fixed:N; "
                   "comma-separated runs each (e.g. cost,all), as rows `hybrid@cost`, `hybrid-async@all`, ...")
    p.add_argument("--max-instances", type=int, default=0, help="a cap on every --fleet policy (0 = none)")
    p.add_argument("--baseline-duration", type=float, default=900.0,
                   help="modelled s for colocated/disaggregated (reserved-only: independent of the trace)")
    p.add_argument("--hosts", type=int, default=2,
                   help="preemptible instances run as emulated workers in this many fleet-host processes "
                   "(benchmarks/fleet_host.py); 0 = one worker process per instance")
    p.add_argument("--static", default="", help="instead of a trace: hybrid with these many instances always up (1,2)")
    p.add_argument("--reserved-gpu-hour", type=float, default=Prices.reserved_gpu_hour)
    p.add_argument("--preemptible-gpu-hour", type=float, default=Prices.preemptible_gpu_hour)
    report.add_out(p, "trace.json, trace.png and the worker logs go here (default: a new temp folder)")
    return p


def main(argv: list[str], s: Settings) -> int:
    p = _parser()
    a = p.parse_args(argv)
    configure_logging(json=s.log_json, level="warning")  # progress lines and the table are the output
    a.prices = Prices(a.reserved_gpu_hour, a.preemptible_gpu_hour)
    if a.traces:
        if a.trace or a.calibrate or a.static:
            p.error("--traces replaces --trace (and is not for --calibrate / --static)")
        return run_family(a, s, _hybrids(a, p), evaluate, summarise)
    t_wall = time.monotonic()
    try:
        ivs, runs = _runs(a, p, argv)
    except (TraceError, OSError) as e:
        print(f"rlboost bench trace: {e}", flush=True)
        return 2
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-trace-")
    out_dir = report.out_dir(a, prefix="rlboost-trace-out-")
    with running_services(s.services) as (nats_url, redis_url):
        policies = asyncio.run(evaluate(a, nats_url, redis_url, out_dir, runs))
    if a.calibrate or a.static:
        published = {"colocated": PUBLISHED["reserved_only"],
                     **{f"static-{n}": v for n, v in PUBLISHED["static"].items()}}
        tokens = float(modelled_lengths(0, a.prompts, a.samples).sum())
        size = dict(prompts=a.prompts, samples=a.samples)
        model = {k: (tokens / model_step_s(RESERVED_GPUS, RESERVED_GPUS, streamed=False, **size) if k == "colocated"
                     else model_hybrid_throughput(int(k.split("-")[1]), **size)) for k in policies}
        print_table(policies, published, model)
        result = {"calibration": {k: {"throughput": v["throughput"], "published": published.get(k),
                                      "model": round(model[k])} for k, v in policies.items()},
                  "train_s_per_token": TRAIN_S_PER_TOKEN, "speed": a.speed, "token_scale": a.token_scale}
    else:
        result = summarise(policies, ivs, a)
        print_table(result["policies"])
        result.update({"avg_instances_up": round(instance_seconds(ivs) / a.duration, 2),
                       "fleet": a.fleet, "max_instances": a.max_instances,
                       "segment": [a.start, a.duration], "fraction": a.fraction, "seed": a.seed, "speed": a.speed,
                       "token_scale": a.token_scale, "notice_s": a.notice,
                       "published": {k: PUBLISHED[k] for k in ("throughput_ratio", "cost_efficiency_gain")}})
        if "throughput_ratio" in result:
            print(f"\nhybrid vs colocated: throughput x{result['throughput_ratio']:.2f} (published 1.51-1.97x), "
                  f"cost efficiency {result['cost_efficiency_gain']:+.0%} (published +28-49%), "
                  f"{result['oracle_fraction']:.0%} of the oracle")
        for name, h in policies.items():
            if "bound" in h:
                print(f"{name}: throughput x{h['throughput_ratio']:.2f}, cost efficiency {h['cost_efficiency_gain']:+.0%}, "
                      f"{h['avg_instances_rented']:.2f} instances rented on average; {h['oracle_fraction']:.0%} of the "
                      f"linear oracle, {h['bound_fraction']:.0%} of the bound {h['bound']:,.0f} (trainer "
                      f"{TRAINER_BOUND:,.0f}, generation {h.get('generation_bound', 0):,.0f}); "
                      f"staleness max {h['staleness_max']}, mean {h['staleness_mean']}")
        if (m := policies.get("hybrid", {}).get("migration_latency")) and m["after_handoff_s"]["n"]:
            h, k = m["after_handoff_s"], m["after_kill_s"]
            print(f"migration (modelled s to the next claim): {h['n']} after a hand-off p50 {h['p50']} p95 {h['p95']}"
                  + (f"; {k['n']} after a kill p50 {k['p50']} p95 {k['p95']}" if k["n"] else ""))
    result["wall_s"] = round(time.monotonic() - t_wall, 1)
    print(f"(worker logs in {out_dir})", flush=True)
    line = dict(result)  # the series stay in trace.json; the last line stays one readable JSON object
    if "policies" in result:
        line["policies"] = {name: {k: v for k, v in r.items() if k not in SERIES}
                            for name, r in result["policies"].items()}
    return report.finish("trace", result, out_dir, line=line,
                         plot=lambda path: plot(ivs if a.trace else [], a.duration, result.get("policies", policies), path))
