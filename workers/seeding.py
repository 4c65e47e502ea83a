"""The reserved cluster's seeding engines, behind `rlboost.orchestrator.SeedingEngines`.

Two ways to run them, one behaviour (serve the reserved queue during the seeding window, hand
off to the preemptible pool's resume lane at its end, take the pool's work back when no
preemptible worker is left):

- `InProcessSeeding`: a `RolloutWorker` in this process on a given engine (torch, vLLM or
  emulated) on the reserved queue; drained at each hand-off and started again at once, so it
  serves on like the processes (idle during training: the queue is empty by then). `rlboost run`'s default: on the demo's CPU box the trainer and
  the engine share the process's weights cache and nothing has to start.
- `ProcessSeeding`: real `rlboost worker` processes on the reserved pool (`--handoff-pool`),
  started once and serving on; the hand-off is SIGUSR2 (the worker hands everything off and
  serves on in a new round). The trace bench's 4 x 2-GPU emulated engines, and `rlboost run
  --rollout.seeding process`.

The fallback (`take_back`) is an in-process `RolloutWorker` on the preemptible pool in both.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import msgspec

from rlboost.clients import Clients
from rlboost.config import EnvSettings, WorkerSettings
from rlboost.workers.counters import Counters
from rlboost.workers.engines.base import Engine
from rlboost.workers.fleet import WorkerFleet
from rlboost.workers.worker import RolloutWorker, WeightSource


class _Fallback:
    """Shared by both: the reserved side serves the preemptible pool itself."""

    def __init__(self, clients: Clients, pool: str, reserved_pool: str, engine: Engine | None,
                 settings: Callable[[str, str], WorkerSettings], counters: Counters, weights: WeightSource | None,
                 capacity: float, env: EnvSettings | None = None) -> None:
        self.c, self.pool, self.reserved_pool, self.engine = clients, pool, reserved_pool, engine
        self.settings, self.counters, self.weights, self.capacity = settings, counters, weights, capacity
        self.fallback: tuple[RolloutWorker, asyncio.Task] | None = None
        self.handoffs = 0
        self.env = env  # [env]: the environments (and chat format) the workers here run episodes in

    def _worker(self, pool: str, handoff_pool: str, worker_id: str) -> tuple[RolloutWorker, asyncio.Task]:
        w = RolloutWorker(self.settings(pool, handoff_pool), self.engine, self.c, worker_id=worker_id,
                          counters=self.counters, weights=self.weights, env=self.env)
        return w, asyncio.create_task(w.run())

    async def take_back(self, step: int) -> None:
        await self.hand_off()  # what the reserved queue still holds goes to the pool first
        if self.fallback is None:
            self.fallback = self._worker(self.pool, self.pool, f"reserved-fallback-s{step}")

    async def end_step(self) -> None:
        if self.fallback is not None:
            self.fallback[0].request_drain("step complete")
            await self.fallback[1]
            self.fallback = None

    def worker_ids(self) -> set[str]:
        return {self.fallback[0].worker_id} if self.fallback is not None else set()

    async def hand_off(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError


class InProcessSeeding(_Fallback):
    """A seeding engine in this process: a `RolloutWorker` on the reserved queue per step."""

    def __init__(self, clients: Clients, pool: str, reserved_pool: str, engine: Engine,
                 settings: Callable[[str, str], WorkerSettings], counters: Counters,
                 weights: WeightSource | None = None, capacity: float = 1.0, tag: str = "reserved",
                 sleep: bool = False, env: EnvSettings | None = None) -> None:
        super().__init__(clients, pool, reserved_pool, engine, settings, counters, weights, capacity, env)
        self.tag = tag
        self.seeder: tuple[RolloutWorker, asyncio.Task] | None = None
        self.sleep = sleep  # vLLM sleep mode: GPU memory back to the trainer between windows
        self.asleep = False
        self._step, self._n = 0, 0

    async def _wake(self) -> None:
        if self.sleep and self.asleep:  # GPU-only, unverified here (make_seeding_engine)
            await asyncio.to_thread(self.engine.llm.wake_up)  # type: ignore[union-attr]
            self.asleep = False

    async def _sleep(self) -> None:
        if self.sleep and not self.asleep and self.fallback is None:
            await asyncio.to_thread(self.engine.llm.sleep, 1)  # type: ignore[union-attr]
            self.asleep = True

    async def take_back(self, step: int) -> None:
        await self._wake()
        await self._stop_seed("the pool is gone: taking its work back")  # its unfinished work to the pool
        self._serve_on(step, self.pool)  # the reserved queue stays served
        if self.fallback is None:
            self.fallback = self._worker(self.pool, self.pool, f"reserved-fallback-s{step}")

    def _serve_on(self, step: int, handoff_pool: str) -> None:
        """A worker on the reserved queue, from now on: a share published later, and a request
        that a drained worker's last fetch hands back (nak'ed as it returns), must find
        someone serving the queue, or the step would wait for them forever. Idle, it costs a
        pull every 0.25 s. (Not with vLLM sleep: the engine sleeps between windows.)"""
        if self.seeder is None and not self.sleep:
            self.seeder = self._worker(self.reserved_pool, handoff_pool, f"{self.tag}-seed-s{step}-{self._n}")
            self._n += 1

    async def _stop_seed(self, reason: str) -> int:
        if self.seeder is None:
            return 0
        before = self.counters.get("handed_off")
        self.seeder[0].request_drain(reason)
        await self.seeder[1]
        self.seeder = None
        return self.counters.get("handed_off") - before

    async def begin_step(self, step: int, handoff: bool) -> None:
        await self._wake()
        self._step = step
        # with nobody to hand off to, what it gives back stays on its own queue's resume lane
        target = self.pool if handoff else self.reserved_pool
        if self.seeder is not None and self.seeder[0].handoff_pool != target:
            await self._stop_seed("hand-off target changed")
        if self.seeder is None:
            self.seeder = self._worker(self.reserved_pool, target, f"{self.tag}-seed-s{step}-{self._n}")
            self._n += 1

    async def hand_off(self) -> int:
        n = await self._stop_seed("seeding window over")
        self._serve_on(self._step, self.pool)
        await self._sleep()
        return n

    async def end_step(self) -> None:
        await super().end_step()
        if self.sleep:  # the sleeping engine serves nothing until the next window
            await self._stop_seed("step complete")
            await self._sleep()

    async def close(self) -> None:
        await super().end_step()
        await self._stop_seed("closing")


class ProcessSeeding(_Fallback):
    """Seeding engines as `rlboost worker` processes on the reserved pool, serving on."""

    def __init__(self, clients: Clients, pool: str, fleet: WorkerFleet, starts: list[tuple[str, ...]],
                 fallback_engine: Engine | None, settings: Callable[[str, str], WorkerSettings], counters: Counters,
                 weights: WeightSource | None = None, capacity: float = 1.0, env: EnvSettings | None = None) -> None:
        super().__init__(clients, pool, fleet.pool, fallback_engine, settings, counters, weights, capacity, env)
        self.fleet, self.starts = fleet, starts
        self.handed_off = False  # this step: a take-back after the hand-off signals nobody again

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start the processes (`extra_args` per engine) and wait until each heartbeats."""
        from rlboost.pool_client import PoolClient

        for extra in self.starts:
            self.fleet.start(prefix="reserved", extra_args=extra)
        reserved = PoolClient(self.c, self.reserved_pool)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(await reserved.live_workers()) < len(self.fleet.workers):
            await asyncio.sleep(0.1)

    async def begin_step(self, step: int, handoff: bool) -> None:
        self.handed_off = False  # they serve on: started once

    async def hand_off(self, timeout_s: float = 30.0) -> int:
        """SIGUSR2 to every live engine; returns once all have handed off, with the count."""
        if self.handed_off:
            return 0
        self.handed_off = True
        procs = [w for w in self.fleet.workers.values() if w.proc.poll() is None]
        before = {w.worker_id: w.counters() for w in procs}
        for w in procs:
            w.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
                w.counters()["handoff_rounds"] <= before[w.worker_id]["handoff_rounds"] for w in procs):
            await asyncio.sleep(0.005)
        return sum(w.counters()["handed_off"] - before[w.worker_id]["handed_off"] for w in procs)

    async def close(self) -> None:
        await self.end_step()
        await asyncio.to_thread(self.fleet.stop_all)


def make_seeding_engine(kind: str, model_dir: str, w: WorkerSettings, sleep: bool = False) -> Engine:
    """The reserved side's engine, chosen by `[rollout] seeding_engine`: torch (float64, as the
    workers), vLLM (the worker's engine options) or emulated (benches). `sleep` (vLLM sleep mode,
    the engine freeing its GPU memory while the trainer trains, as verl does) is GPU-only: this
    code refuses it where it cannot work, and it has not been run here (no GPU on the CPU box)."""
    from rlboost.workers.engines import EngineError, engine_from_settings

    if sleep:
        if kind != "vllm":
            raise EngineError(f"rollout.vllm_sleep needs rollout.seeding_engine = vllm (not {kind})")
        import torch

        if not torch.cuda.is_available():
            raise EngineError("rollout.vllm_sleep: vLLM sleep mode frees GPU memory; this machine has no CUDA "
                              "GPU (a CPU build of vLLM cannot sleep). Leave it off here.")
    # the emulated seeding engine runs at the modelled speed on one GPU, whatever the worker flags
    if kind == "emulated":
        w = WorkerSettings()
    return engine_from_settings(msgspec.structs.replace(w, engine=kind, model_dir=model_dir), sleep=sleep)
