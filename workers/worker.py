"""RolloutWorker: pulls rollout requests, generates, checkpoints, and can vanish at any moment.

Life of a request on a worker:
1. `fetch` only as many requests as there are free slots (pull is the load balancer);
2. claim the request's lease (new epoch) and load its checkpoint: resume from prompt + tokens so far;
3. generate K tokens per engine call for the whole batch (continuous batching between calls),
   append each request's new tokens to its checkpoint (fenced) and publish them as a token chunk;
4. on finish: mark the checkpoint finished (fenced), publish the result (dedup by request id), ack.

Preemption:
- with notice (SIGTERM, a control `drain`, a spot notice): stop fetching, stop the engine
  between steps, flush every token made so far, release the leases and `nak` the messages so
  other workers resume them at once: zero tokens regenerated;
- without notice (SIGKILL, crash, network loss): nothing to do here. The messages come back
  after `ack_wait`, the leases have expired, another worker resumes from the last checkpoint:
  at most K tokens per request are regenerated;
- paused (SIGSTOP ... SIGCONT): the first append after waking is refused by fencing if someone
  took over; the worker drops those requests without acking (the message is someone else's now).

A request the engine cannot serve (`Engine.check` right after the claim, or a `RequestError`
from a batch: its context overflows, a token id is outside the vocabulary) is finished in its
checkpoint under its lease and answered with an `error` result that says why (verified by the
trainer like any result), counted (`request_errors`), and acked: one bad request never drains a
worker. Only an engine-wide failure (any other exception) drains it.

An episode (a request with `episode`, schema 4) is generated one model turn at a time in the same
batch; between turns its environment phase (tools, the environment's reply) runs beside the
engine, fenced step by step into its checkpoint (workers/episodes.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import time

from rlboost import bus, metrics, wire
from rlboost.clients import Clients
from rlboost.config import EnvSettings, WorkerSettings
from rlboost.logs import get_logger
from rlboost.weights.source import WeightSource
from rlboost.workers import admission
from rlboost.workers.admission import Admission
from rlboost.workers.counters import Counters
from rlboost.workers.engines.base import Engine
from rlboost.workers.episode_phase import EpisodePhase
from rlboost.workers.episodes import EpisodeHost
from rlboost.workers.finish import Finisher
from rlboost.workers.generation import Generation, pack_flush
from rlboost.workers.handoff import Handoff
from rlboost.workers.inflight import (
    JOIN_COALESCE_S,
    Active,
    InFlight,
    finish_reason,
    is_complete,
    make_result,
    make_sequence,
    make_worker_id,
    publish_result,
    retrying,
)
from rlboost.workers.liveness import Liveness
from rlboost.workers.versions import STARTUP_WEIGHTS, Versions

# (imported from here by tests, benchmarks, workers/main.py, workers/seeding.py and workers/env_worker.py)
__all__ = ["RolloutWorker", "Active", "JOIN_COALESCE_S", "STARTUP_WEIGHTS", "WeightSource", "finish_reason",
           "is_complete", "make_result", "make_sequence", "make_worker_id", "pack_flush", "publish_result",
           "retrying"]


class RolloutWorker:
    """The coordinator: builds the parts around one shared `InFlight` table and runs them. Each
    part answers one question (workers/admission.py which requests it takes, generation.py the
    engine loop and flushes, finish.py how a request is answered, episode_phase.py an episode
    between its turns, versions.py which policy version the engine serves, handoff.py how
    requests go to other workers, liveness.py the heartbeat and the control bucket)."""

    def __init__(self, settings: WorkerSettings, engine: Engine, clients: Clients, worker_id: str | None = None,
                 counters: Counters | None = None, weights: WeightSource | None = None,
                 env: EnvSettings | None = None) -> None:
        self.cfg = settings
        self.engine = engine
        self.c = clients
        self.pool = wire.check_name("pool", settings.pool)
        self.handoff_pool = wire.check_name("hand-off pool", settings.handoff_pool or settings.pool)
        self.worker_id = wire.check_name("worker id", worker_id or make_worker_id(self.pool))
        self.counters = counters or Counters()
        self.log = get_logger(worker_id=self.worker_id, pool=self.pool, engine=engine.name)
        self.continue_after = False  # a hand-off (SIGUSR2), not a shutdown
        self.st = InFlight(settings, engine, clients, self.worker_id, self.pool, self.handoff_pool, self.counters,
                           self.log)
        engine_counts = engine.set_token_callback(self.st.tokens_made)
        self._metrics = metrics.CounterSync(self.pool, engine.name)
        # where policy versions come from: the owner's source, else the engine's own (virtual
        # weights for the emulated engine, none for a real engine: its start-up weights only)
        self.weights = weights if weights is not None else engine.weight_source()
        # episodes: the environments this worker runs (built-ins and its own [env] ref); their tool
        # calls run here (`env.inline`, the default) or on the environment pool (workers/env_worker.py)
        self.episodes = EpisodeHost(engine, settings.model_dir, env, self.worker_id)
        self.versions = Versions(self.st, self.weights)
        self.finisher = Finisher(self.st)
        self.phase = EpisodePhase(self.st, self.finisher, env_pool=env is not None and not env.inline)
        self.handoff = Handoff(self.st)
        self.admission = Admission(self.st, self.versions, self.finisher, self.episodes, self.phase)
        self.generation = Generation(self.st, self.versions, self.finisher, self.phase, self.handoff, engine_counts)
        self.liveness: Liveness | None = None  # built by `run`, once the buckets are open
        self._started_at = time.time()

    # what the process and the tests look at
    active = property(lambda self: self.st.active)
    draining = property(lambda self: self.st.draining)
    drain_reason = property(lambda self: self.st.drain_reason)

    @property
    def _drop_fenced(self):
        return self.st.drop_fenced

    @_drop_fenced.setter
    def _drop_fenced(self, fn) -> None:
        self.st.drop_fenced = fn  # a spy on how requests are dropped (tests): every part calls it there

    @staticmethod
    async def settled() -> None:
        """Every fetch a drain stopped waiting for has handed back what it brought (each within
        its linger): what a worker process awaits before it exits."""
        await admission.settled()

    def stalled(self) -> bool:
        return self.st.stalled()

    # ------------------------------------------------------------------ lifecycle

    def request_drain(self, reason: str) -> None:
        self.st.drain(reason)

    def request_handoff(self, reason: str = "seeding window over") -> None:
        """Hand every request off like a drain, but the process serves on afterwards (`serve`
        starts the next round): a reserved seeding engine at the end of its window."""
        self.continue_after = True
        self.request_drain(reason)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig, why in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT"), (signal.SIGUSR1, "spot notice")):
            loop.add_signal_handler(sig, self.request_drain, why)
        loop.add_signal_handler(signal.SIGUSR2, self.request_handoff)

    async def _beat(self) -> None:
        """One heartbeat tick (`Liveness.beat`); a method here so that a test worker can wrap it."""
        assert self.liveness is not None
        await self.liveness.beat()

    async def run(self) -> None:
        """Serve until drained. Returns after every in-flight request was handed back."""
        js = self.c.js
        # the pool's consumers as the trainer provisioned them (waits for them if they are not yet)
        pool_cfg = await bus.join_pool(js, self.pool, wire.ConsumerSpec(ack_wait_s=self.cfg.ack_wait_s,
                                                                       max_deliver=self.cfg.max_deliver),
                                       stop=self.draining)
        if pool_cfg is None:
            self.log.info("drained before the pool was provisioned", reason=self.drain_reason)
            return
        if pool_cfg.ack_wait and self.cfg.lease_ttl_s >= pool_cfg.ack_wait:
            self.log.warning("lease_ttl_s is not shorter than the pool's ack_wait: a redelivered request waits "
                             "for its lease to expire", lease_ttl_s=self.cfg.lease_ttl_s, ack_wait_s=pool_cfg.ack_wait)
        self.registry = await js.key_value(wire.BUCKET_WORKERS)
        self.control = await js.key_value(wire.BUCKET_CONTROL)
        self.liveness = Liveness(self.st, self.registry, self.control, self._metrics, self._started_at)
        fresh = await js.pull_subscribe_bind(durable=wire.consumer_name(self.pool), stream=wire.STREAM_REQUESTS)
        resume = await js.pull_subscribe_bind(durable=wire.resume_consumer_name(self.pool),
                                              stream=wire.STREAM_REQUESTS)
        await self.liveness.heartbeat("running")
        reserve = max(1, math.ceil(self.cfg.slots * self.cfg.resume_reserve))
        self.log.info("worker started", slots=self.cfg.slots, resume_reserve=reserve,
                      checkpoint_tokens=self.cfg.checkpoint_tokens)
        stop_aux = asyncio.Event()
        feed = self.admission.feed
        idle_s = self.cfg.idle_pull_s
        feeder = asyncio.gather(feed(fresh, self.cfg.slots, self.cfg.fetch_batch or self.cfg.slots, 0.25, idle_s),
                                feed(resume, self.cfg.slots + reserve, 1, 0.5, idle_s))
        # (poison messages past max_deliver are moved to the DLQ by the trainer's manager: the
        # worker identity may not delete stream messages, rlboost/auth.py)
        aux = [asyncio.create_task(self.liveness.loop(stop_aux, self._beat)),
               asyncio.create_task(self.liveness.watch_control(stop_aux))]
        try:
            await self.generation.loop()
            # Stop pulling before handing back, or our own parked pull requests would be
            # handed the very requests we put on the resume lane. What the server delivered
            # to us that no fetch took goes back first, or it would sit out ack_wait.
            feeder.cancel()
            for sub in (fresh, resume):
                with contextlib.suppress(Exception):
                    if n := await bus.hand_back_buffered(sub):
                        self.log.info("handed back requests delivered and not taken", requests=n)
                    await sub.unsubscribe()
            # an episode's environment phase ends first (bounded by its tool timeout and the drain
            # grace): its results fenced in, no tool runs again after a notice
            await asyncio.gather(*self.admission.tasks, *self.generation.finishing, *self.phase.tasks,
                                 return_exceptions=True)
            await self.handoff.hand_back_all()
            if self.handoff_pool != self.pool:
                await self.handoff.forward_own_queue()
            if self.continue_after:
                self.counters.add("handoff_rounds")
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder
            stop_aux.set()
            await asyncio.gather(*aux, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.st.outbox.sent()
                await self.st.outbox.publish()
            with contextlib.suppress(Exception):
                await self.registry.delete(self.worker_id)
            self.log.info("worker stopped", reason=self.drain_reason, **self.counters.snapshot())
