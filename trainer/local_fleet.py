"""The local fleet: the rollout processes one `rlboost run` starts and supervises on this box,
and the chaos it injects into them.

- The preemptible pool's workers: `rlboost worker --engine torch` processes (`rlboost.workers.fleet`),
  started at setup and killed with the trainer (`die_with_parent`): a resumed run starts new
  ones. Each life of the trainer gets its own folder and worker-id prefix (`life-N`, `lNw`), so a
  resumed run's workers neither reuse a killed one's id nor its crash-proof counters.
- The reserved side's seeding engine (`[rollout] seeding`, `seeding_engine`): in this process
  (default: nothing to start, the weights cache is the trainer's) or an `rlboost worker` process
  on the reserved pool handing off to the preemptible one.
- The environment pool (`[env] inline = false`): `env.env_workers` `rlboost env-worker` processes.
- `regenerated_tokens`: what every worker and engine of every life generated and never made
  durable (their crash-proof counters), so generated again by someone.
- `supervise`: every process above that exits on its own (a crash, an OOM kill, a SIGKILL from
  outside) is reaped, reported in one log line and restarted with backoff (`rlboost.workers.fleet.Supervisor`):
  a run whose only environment worker died does not wait on a lane nobody serves.

`Chaos` is the `--chaos STEP:term|kill` switch: mid-step (the first result past half the step's
requests) a running worker is terminated or killed and a fresh one started in its place.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rlboost import wire
from rlboost.clients import Clients
from rlboost.config import ConfigError, EnvSettings, RolloutSettings, WorkerSettings
from rlboost.logs import get_logger
from rlboost.pool_client import PoolClient
from rlboost.weights.source import WeightSource
from rlboost.workers.counters import Counters, read_counters
from rlboost.workers.engines import EngineError
from rlboost.workers.fleet import Supervisor, WorkerFleet
from rlboost.workers.seeding import InProcessSeeding, ProcessSeeding, make_seeding_engine


class LocalFleet:
    def __init__(self, nats_url: str, redis_url: str, run_dir: Path, *, pool: str, reserved_pool: str,
                 model_dir: str, slots: int, checkpoint_tokens: int, env: dict[str, str] | None = None) -> None:
        """`env`: more environment for every process (the weight store's keys, `WeightsSettings.store_env`)."""
        self.nats_url, self.redis_url, self.run_dir = nats_url, redis_url, run_dir
        self.env = env or {}
        self.pool, self.reserved_pool = pool, reserved_pool
        self.model_dir, self.slots, self.checkpoint_tokens = model_dir, slots, checkpoint_tokens
        # one folder and one worker-id prefix per life of the trainer: a resumed run's workers
        # neither reuse a killed one's id nor its crash-proof counters
        workers = run_dir / "workers"
        attempt = sum(1 for _ in workers.glob("life-*")) if workers.exists() else 0
        self.workdir = workers / f"life-{attempt}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.life = f"l{attempt}"  # also the tag of request ids this life cannot take from a previous one
        self.prefix = f"{self.life}w"
        self.workers = self._processes(pool, "torch")
        # the environment pool (`env.inline = false`): processes that run episodes' tool calls
        self.env_workers = WorkerFleet(nats_url, redis_url, self.workdir, pool, command="env-worker",
                                       worker_args=["--model-dir", model_dir],  # its chat format: the model's
                                       env={"RLBOOST_LOG_LEVEL": "warning", **self.env}, die_with_parent=True)
        self.reserved_counters = Counters(self.workdir / "reserved.counters")
        self.supervisor = Supervisor([self.workers, self.env_workers], get_logger(component="supervisor"))

    async def supervise(self, period_s: float = 0.5) -> None:
        """Reap and restart exited processes until cancelled (`Supervisor`)."""
        while True:
            self.supervisor.poll()
            await asyncio.sleep(period_s)

    def _processes(self, pool: str, engine: str, *extra: str) -> WorkerFleet:
        return WorkerFleet(self.nats_url, self.redis_url, self.workdir, pool, worker_args=[
            "--engine", engine, "--model-dir", self.model_dir, "--slots", str(self.slots),
            "--checkpoint-tokens", str(self.checkpoint_tokens), *extra],
            env={"RLBOOST_WORKER__CACHE_DIR": str(self.run_dir / "weight-cache"), "RLBOOST_LOG_LEVEL": "warning",
                 **self.env},
            die_with_parent=True)  # the run's own workers go with a killed trainer; a resume starts new ones

    def seeding_engines(self, c: Clients, ro: RolloutSettings, worker: WorkerSettings, serves: bool, *,
                        weights: WeightSource | None = None, env: EnvSettings | None = None
                        ) -> InProcessSeeding | ProcessSeeding:
        """The reserved side's seeding engine. `serves`: it takes a share of every step (else,
        disaggregated, the reserved side only trains and its engine serves only with no live worker).
        `weights`: where its in-process engine pulls versions from; `env`: the run's environments."""
        capacity = 1.0 if serves else 0.0

        def settings(pool: str, handoff_pool: str) -> WorkerSettings:
            return WorkerSettings(pool=pool, handoff_pool=handoff_pool, slots=self.slots,
                                  checkpoint_tokens=self.checkpoint_tokens,
                                  model_dir=self.model_dir)  # episodes: the chat format is the model's

        if ro.vllm_sleep and ro.seeding != "in_process":
            raise EngineError("rollout.vllm_sleep needs rollout.seeding = in_process (the engine shares the trainer's GPUs)")
        engine = make_seeding_engine(ro.seeding_engine, self.model_dir, worker, sleep=ro.vllm_sleep)
        if ro.seeding == "process":
            fleet = self._processes(self.reserved_pool, ro.seeding_engine, "--handoff-pool", self.pool)
            self.supervisor.fleets.append(fleet)
            return ProcessSeeding(c, self.pool, fleet, [()], engine, settings, self.reserved_counters,
                                  weights=weights, capacity=capacity, env=env)
        return InProcessSeeding(c, self.pool, self.reserved_pool, engine, settings, self.reserved_counters,
                                weights=weights, capacity=capacity, sleep=ro.vllm_sleep, env=env)

    async def start_workers(self, n: int, manager: PoolClient, timeout_s: float = 90.0) -> None:
        """Start `n` preemptible workers and wait (at most `timeout_s`: torch import + model load
        take a while) until they heartbeat on the pool."""
        for _ in range(n):
            self.workers.start(prefix=self.prefix)
        deadline = time.monotonic() + timeout_s
        while len(await manager.live_workers()) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.25)

    def start_env_workers(self, n: int) -> None:
        """Start `n` environment workers. Nothing waits for them: an episode's tool calls wait on
        the environment lane until one takes them."""
        for _ in range(n):
            self.env_workers.start(prefix=f"{self.life}e")

    def preempt(self, kind: str) -> str | None:
        """Terminate (`term`) or kill (`kill`) a running worker and start a fresh one in its place.
        Returns the preempted worker's id (None: none was running)."""
        live = [w for w in self.workers.live() if w.fate == "running"]
        if not live:
            return None
        w = live[0]
        if kind == "kill":
            self.workers.kill(w)
        else:
            self.workers.terminate(w)
        self.workers.start(prefix=self.prefix)
        return w.worker_id

    def regenerated_tokens(self) -> int:
        """Tokens generated and never made durable, so generated again by someone (crash-proof
        counters of every worker and reserved engine of every life of this run)."""
        return sum(max(0, c["generated"] - c["checkpointed"])
                   for c in map(read_counters, sorted((self.run_dir / "workers").rglob("*.counters"))))

    def stop(self) -> None:
        self.workers.stop_all()
        self.env_workers.stop_all()


class Chaos:
    """`--chaos`: step -> ["term" | "kill", ...], injected mid-step."""

    def __init__(self, fleet: LocalFleet, plan: dict[int, list[str]], run_id: str = "") -> None:
        self.fleet, self.plan = fleet, plan
        self.log = get_logger(component="chaos", run_id=run_id)

    def on_result(self, r: wire.RolloutResult, arrived: int, total: int) -> None:
        if arrived == total // 2 + 1 and r.step in self.plan:  # mid-step
            for kind in self.plan[r.step]:
                worker_id = self.fleet.preempt(kind)
                if worker_id is None:
                    return
                self.log.warning("chaos", step=r.step, action=kind, worker_id=worker_id)


def parse_chaos(spec: str) -> dict[int, list[str]]:
    """`--chaos 3:term,5:kill`: the steps in which a worker is SIGTERMed / SIGKILLed mid-step."""
    out: dict[int, list[str]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        step, _, kind = part.partition(":")
        if kind not in ("term", "kill") or not step.strip().isdigit():
            raise ConfigError(f"chaos {part!r}: use STEP:term or STEP:kill (STEP a step number)")
        out.setdefault(int(step), []).append(kind)
    return out
