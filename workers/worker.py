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
import collections
import contextlib
import itertools
import math
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np
import redis.exceptions
from nats.aio.msg import Msg

from rlboost import bus, metrics, wire
from rlboost.checkpoint import AlreadyFinished, CheckpointError, CorruptCheckpoint, LeaseHeld, LeaseLost
from rlboost.checkpoint import pack as checkpoint_pack
from rlboost.clients import Clients
from rlboost.config import EnvSettings, WorkerSettings
from rlboost.episodes import EpisodeStateError
from rlboost.logs import get_logger
from rlboost.weights.errors import VersionGone
from rlboost.weights.source import WeightSource
from workers.counters import Counters
from workers.engines.base import Engine, RequestError, Sequence
from workers.episodes import EpisodeHost, EpisodeRefused, EpisodeRun

T = TypeVar("T")
JOIN_COALESCE_S = 0.05  # hand-offs arriving together interrupt the engine once per this

_ORPHANS: set[asyncio.Task] = set()  # fetches drained workers stopped waiting for (RolloutWorker._feed)

STARTUP_WEIGHTS = "startup"  # the weights id of an engine's start-up weights, no manifest behind them


def make_worker_id(pool: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{pool}-{host}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


@dataclass
class Active:
    """One in-flight request on this worker."""

    msg: Msg
    req: wire.RolloutRequest
    seq: Sequence
    epoch: int
    durable: int  # tokens already in the checkpoint
    logprobs: list[float]
    pending_tokens: list[int] = field(default_factory=list)
    pending_logprobs: list[float] = field(default_factory=list)
    done: bool = False
    finishing: bool = False  # its finish (fenced finish, result, ack) is under way in the background
    last_write: float = field(default_factory=time.monotonic)
    weights: str = ""  # the engine weights this request's tokens are generated with (its segment's)
    stops: frozenset[int] = frozenset()  # req.stops(), computed once: checked after every engine call
    episode: EpisodeRun | None = None  # an episode: its runner and state (workers/episodes.py)
    in_env: float = 0.0  # an episode's environment phase runs (since this monotonic time; 0: not)


def pack_flush(dirty: list[Active]) -> tuple[list[bytes], list[list[float]]]:
    """Every request's pending tokens as packed checkpoint records, with one numpy pass for the
    whole flush (per request it cost more than the Redis call). Also each request's logprobs as
    float32 values: what the checkpoint keeps."""
    counts = [len(a.pending_tokens) for a in dirty]
    total = sum(counts)
    rec = np.empty(total, dtype=wire.RECORD)
    rec["token"] = np.fromiter(itertools.chain.from_iterable(a.pending_tokens for a in dirty), np.int32, total)
    rec["logprob"] = np.fromiter(itertools.chain.from_iterable(a.pending_logprobs for a in dirty), np.float32, total)
    blob, lps = rec.tobytes(), rec["logprob"].tolist()
    size = wire.RECORD.itemsize
    records, logprobs, at = [], [], 0
    for n in counts:
        records.append(blob[at * size:(at + n) * size])
        logprobs.append(lps[at:at + n])
        at += n
    return records, logprobs


finish_reason, is_complete = wire.finish_reason, wire.is_complete  # (the manager checks results with them)


async def retrying(op: Callable[[], Awaitable[T]], log) -> T:
    """Redis unreachable for a moment: back off and retry instead of crashing. Nothing is lost
    meanwhile: pending tokens stay in memory, messages stay in progress."""
    delay = 0.05
    while True:
        try:
            return await op()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            log.warning("checkpoint store unreachable, retrying", error=str(e), delay_s=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def make_result(req: wire.RolloutRequest, tokens: list[int], logprobs: list[float], worker_id: str, epoch: int,
                segments: list[wire.Segment], error: str = "",
                episode: wire.EpisodeState | None = None) -> wire.RolloutResult:
    """The result names the lease it was finished under (worker id, epoch): the trainer
    takes it only if Redis agrees (rlboost/pool_client.py). `error`: the request could not be
    served. `episode`: an episode's final state, as its checkpoint holds it."""
    return wire.RolloutResult(
        request_id=req.request_id, step=req.step, group=req.group, prompt_ids=list(req.prompt_ids),
        token_ids=tokens, logprobs=logprobs, segments=segments,
        finish_reason="error" if error else finish_reason(req, tokens),  # type: ignore[arg-type]
        worker_id=worker_id, ts=time.time(), epoch=epoch, error=error, episode=episode)


async def publish_result(c: Clients, req: wire.RolloutRequest, tokens: list[int], logprobs: list[float],
                         worker_id: str, epoch: int, error: str, timeout_s: float) -> None:
    """One result (see `make_result`), its provenance and episode state read from the checkpoint.
    Bounded, retried with the same id: stored once however often sent."""
    episode = await c.store.episode(req.request_id) if req.episode is not None else None
    result = make_result(req, tokens, logprobs, worker_id, epoch, await c.store.segments(req.request_id), error,
                         episode=episode)
    (out,) = await bus.publish_batch(c.js, [(wire.result_subject(req.step), wire.encode(result),
                                             {wire.HDR_MSG_ID: wire.result_msg_id(result)})],
                                     ack_timeout_s=timeout_s, deadline_s=timeout_s * 3)
    if not out.ok:
        raise bus.PublishFailed("results", [req.request_id], str(out.error))


def make_sequence(req: wire.RolloutRequest, token_ids: list[int]) -> Sequence:
    p = req.sampling
    return Sequence(request_id=req.request_id, prompt_ids=list(req.prompt_ids), seed=req.seed,
                    max_new_tokens=req.max_new_tokens, eos_id=req.eos_id, stop_ids=list(req.stop_ids),
                    temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, token_ids=list(token_ids))


class RolloutWorker:
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
        self._engine_counts = engine.set_token_callback(self._tokens_made)
        self._metrics = metrics.CounterSync(self.pool, engine.name)
        # where policy versions come from: the owner's source, else the engine's own (virtual
        # weights for the emulated engine, none for a real engine: its start-up weights only)
        self.weights = weights if weights is not None else engine.weight_source()
        self.log = get_logger(worker_id=self.worker_id, pool=self.pool, engine=engine.name)
        self.active: dict[str, Active] = {}
        self.admitting = 0
        self.draining = asyncio.Event()
        self.drain_reason = ""
        self.continue_after = False  # a hand-off (SIGUSR2), not a shutdown
        self.stop_engine = threading.Event()  # tells the engine to return between steps
        self._wake = asyncio.Event()  # work arrived (or drain): the generate loop looks again
        self._slot_events: list[asyncio.Event] = []  # one per feeder: a request left, fetch again
        self._version_lock = asyncio.Lock()
        # Requests admitted per policy version (claiming or in flight): the engine switches
        # version only when no request of another version is admitted, not just when none is
        # active yet, or a request still claiming would be generated with the new weights.
        self._version_users: collections.Counter[int] = collections.Counter()
        self._switch_wanted = 0.0  # when a request was handed back for its version (`_switch_pending`)
        self._carry_to = 0  # a newer version an upgradable request waits for (`_carry_forward`)
        self._version_moved = asyncio.Event()  # set (and cleared) at each in-flight update
        self._outbox: list[bus.Outgoing] = []  # token chunks and lease events to publish at the next flush
        self._publishing: asyncio.Task | None = None  # the outbox publish in flight (_publish_outbox_soon)
        self._progress_at = time.monotonic()  # the generate loop's (or the engine's) last sign of life
        self._admissions: set[asyncio.Task] = set()
        self._finishing: set[asyncio.Task] = set()
        self._started_at = time.time()
        self._join_pending = False
        self._last_join = 0.0
        self._floor = 0  # the pool's version floor (wire.VersionFloor): partial / async rollout
        # episodes: the environments this worker runs (built-ins and its own [env] ref); their tool
        # calls run here (`env.inline`, the default) or on the environment pool (workers/env_worker.py)
        self.episodes = EpisodeHost(engine, settings.model_dir, env, self.worker_id)
        self.env_pool = env is not None and not env.inline
        self._env_tasks: set[asyncio.Task] = set()

    @staticmethod
    async def settled() -> None:
        """Every fetch a drain stopped waiting for has handed back what it brought (each within
        its linger): what a worker process awaits before it exits."""
        await asyncio.gather(*_ORPHANS, return_exceptions=True)

    def _tokens_made(self, n: int) -> None:
        """(engine thread) tokens made: a sign of life as good as a finished flush."""
        self.counters.add("generated", n)
        self._progress_at = time.monotonic()

    def stalled(self) -> bool:
        """No engine step and no flush for `stall_s`: something this worker waits on does not
        answer. It then stops extending its requests (no in_progress, no lease renewal, no
        heartbeat), so they are redelivered to a worker that can make progress."""
        now = time.monotonic()
        if any(a.in_env and now - a.in_env < a.req.episode.tool_timeout_s + self.cfg.stall_s  # type: ignore[union-attr]
               for a in self.active.values()):
            return False  # a tool runs (bounded by its timeout): a sign of life of its own
        return now - self._progress_at > self.cfg.stall_s

    # ------------------------------------------------------------------ lifecycle

    def request_drain(self, reason: str) -> None:
        if not self.draining.is_set():
            self.drain_reason = reason
            self.log.info("drain requested", reason=reason)
            self.draining.set()
            self.stop_engine.set()
            self._wake.set()

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
        fresh = await js.pull_subscribe_bind(durable=wire.consumer_name(self.pool), stream=wire.STREAM_REQUESTS)
        resume = await js.pull_subscribe_bind(durable=wire.resume_consumer_name(self.pool),
                                              stream=wire.STREAM_REQUESTS)
        await self._heartbeat("running")
        reserve = max(1, math.ceil(self.cfg.slots * self.cfg.resume_reserve))
        self.log.info("worker started", slots=self.cfg.slots, resume_reserve=reserve,
                      checkpoint_tokens=self.cfg.checkpoint_tokens)
        stop_aux = asyncio.Event()
        feeder = asyncio.gather(self._feed(fresh, self.cfg.slots, self.cfg.fetch_batch or self.cfg.slots, 0.25),
                                self._feed(resume, self.cfg.slots + reserve, 1, 0.5))
        # (poison messages past max_deliver are moved to the DLQ by the trainer's manager: the
        # worker identity may not delete stream messages, rlboost/auth.py)
        aux = [asyncio.create_task(self._heartbeat_loop(stop_aux))]
        try:
            await self._generate_loop()
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
            await asyncio.gather(*self._admissions, *self._finishing, *self._env_tasks, return_exceptions=True)
            await self._hand_back_all()
            if self.handoff_pool != self.pool:
                await self._forward_own_queue()
            if self.continue_after:
                self.counters.add("handoff_rounds")
        finally:
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await feeder
            stop_aux.set()
            await asyncio.gather(*aux, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._outbox_sent()
                await self._publish_outbox()
            with contextlib.suppress(Exception):
                await self.registry.delete(self.worker_id)
            self.log.info("worker stopped", reason=self.drain_reason, **self.counters.snapshot())

    # ------------------------------------------------------------------ intake

    async def _feed(self, psub, capacity: int, max_batch: int, linger_s: float) -> None:
        """Keep up to `capacity` requests in flight from one lane (fresh or resume).

        nats-py's `fetch(n)` returns at once with whatever is queued, but when nothing is, its
        lingering pull waits until all n arrived or `linger_s` passed. Hand-offs trickle in a
        few at a time, so the resume lane pulls one at a time: each returns on arrival."""
        slot_freed = asyncio.Event()
        self._slot_events.append(slot_freed)
        while not self.draining.is_set():
            free = capacity - self._holding_slots() - self.admitting
            # a worker making no progress takes no more work, nor one waiting for its engine to
            # be free to switch versions
            if free <= 0 or self.stalled() or self._switch_pending():
                slot_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(slot_freed.wait(), timeout=0.5)
                continue
            # The fetch is a task of its own, shielded: a drain cancels this feeder, and a
            # cancelled fetch would drop what the server already delivered to it (a lingering
            # pull holds its first requests while it waits for the rest of its batch), left
            # unacknowledged until ack_wait. The fetch finishes within its linger instead, and
            # what it brings is nak'ed back to the pool at once (`_nak_when_fetched`).
            fetch = asyncio.ensure_future(psub.fetch(batch=min(free, max_batch), timeout=linger_s))
            try:
                msgs = await asyncio.shield(fetch)
            except asyncio.CancelledError:
                _ORPHANS.add(orphan := asyncio.ensure_future(self._nak_when_fetched(fetch)))
                orphan.add_done_callback(_ORPHANS.discard)
                raise
            except (TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as e:  # server gone for a moment: back off, do not crash
                self.log.warning("fetch failed", error=str(e))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                if self.draining.is_set():
                    await msg.nak()  # arrived after the notice: straight back to the pool
                    continue
                self.admitting += 1
                task = asyncio.create_task(self._admit(msg))
                self._admissions.add(task)
                task.add_done_callback(self._admissions.discard)

    async def _nak_when_fetched(self, fetch: asyncio.Future) -> None:
        """A fetch its feeder stopped waiting for (a drain): hand back whatever it brings. In the
        background (a hand-off does not wait out a fetch's linger); a process that is about to
        exit waits for these first (`settled`)."""
        with contextlib.suppress(Exception):
            for msg in await fetch:
                with contextlib.suppress(Exception):
                    await msg.nak()

    async def _admit(self, msg: Msg) -> None:
        reserved: int | None = None
        try:
            try:
                req = wire.decode(wire.RolloutRequest, msg.data)
            except wire.WireError as e:
                await bus.dead_letter(self.c.js, msg, str(e), wire.STREAM_REQUESTS)
                self.counters.add("dead_lettered")
                return
            if req.policy_version < self._floor:  # continued from its checkpoint under the floor's version
                req = msgspec.structs.replace(req, policy_version=self._floor)
            if req.upgradable and req.policy_version < self.engine.policy_version and req.episode is None:
                # async's in-flight update: a request of an older version is continued (or
                # started) under the newer one the engine holds, never the other way round
                req = msgspec.structs.replace(req, policy_version=self.engine.policy_version)
            log = self.log.bind(request_id=req.request_id, step=req.step, policy_version=req.policy_version)
            try:
                ready = await self._ensure_version(req.policy_version)
                if not ready and req.upgradable and await self._carried_to(req.policy_version):
                    ready = await self._ensure_version(req.policy_version)
            except VersionGone as e:  # left by a dead life or another run: it would wait forever
                await bus.dead_letter(self.c.js, msg, f"stale request: {e}", wire.STREAM_REQUESTS)
                self.counters.add("dead_lettered")
                return
            if not ready:
                if any(n > 0 for v, n in self._version_users.items() if v != req.policy_version):
                    self._switch_wanted = time.monotonic()  # and fetch nothing until it can switch
                await msg.nak(delay=self._bounce_delay(msg))  # never generate with another version: hand it back
                return
            reserved = req.policy_version  # released below unless the request becomes active
            try:
                # a hand-off is taken only for the request the trainer published (its fresh claim
                # recorded the spec): one planted on the resume lane is refused and dead-lettered
                claim = await self.c.store.claim(req.request_id, self.worker_id, req.policy_version,
                                                 self.cfg.lease_ttl_s, weights=self.engine.weights_id,
                                                 episode=req.episode is not None, spec=wire.spec_digest(req),
                                                 handoff=wire.is_handoff_subject(msg.subject))
            except AlreadyFinished:
                await self._republish_finished(req)
                await msg.ack()
                return
            except LeaseHeld as e:
                await msg.nak(delay=max(0.05, e.retry_after_s))
                return
            except CorruptCheckpoint as e:  # no retry can fix it: dead-letter now, with the reason
                await bus.dead_letter(self.c.js, msg, f"corrupt checkpoint: {e}", wire.STREAM_REQUESTS)
                self.counters.add("dead_lettered")
                return
            self.counters.add("claims")
            await self._event(req, claim.epoch, "claim", len(claim.token_ids))
            log.info("claimed", epoch=claim.epoch, resume_at=len(claim.token_ids))
            seq = make_sequence(req, claim.token_ids)
            run: EpisodeRun | None = None
            if req.episode is not None:
                try:
                    run = await self.episodes.open(req, claim.episode, claim.token_ids, claim.logprobs,
                                                   self._episode_put(req, claim.epoch))
                except EpisodeRefused as e:
                    await self._refuse(msg, req, claim.epoch, claim.token_ids, claim.logprobs, str(e))
                    return
                seq.stop_ids, seq.eos_id, seq.max_new_tokens = run.stop_ids, -1, run.turn_limit()
            reason = self.engine.check(seq)
            if reason is not None:  # answered now, under this lease: it never reaches a batch
                await self._refuse(msg, req, claim.epoch, claim.token_ids, claim.logprobs, reason)
                return
            if (stale := self.active.get(req.request_id)) is not None:
                self._forget(stale)  # redelivered to us while we held it: the new claim replaces it
            a = self.active[req.request_id] = Active(
                msg=msg, req=req, seq=seq, epoch=claim.epoch, durable=len(claim.token_ids),
                logprobs=list(claim.logprobs),
                done=is_complete(req, claim.token_ids) if run is None else run.turn_done(claim.token_ids),
                weights=self.engine.weights_id, stops=req.stops() if run is None else frozenset(run.stop_ids),
                episode=run)
            reserved = None  # the request holds its version until it leaves `active`
            if run is not None and a.done:
                self._start_env_phase(a)  # a turn over, tools half run, or the end: on with it
            elif claim.token_ids:
                self._join_soon()
        except (CorruptCheckpoint, EpisodeStateError) as e:  # a finished request whose tokens do not parse
            with contextlib.suppress(Exception):
                await bus.dead_letter(self.c.js, msg, f"corrupt checkpoint: {e}", wire.STREAM_REQUESTS)
                self.counters.add("dead_lettered")
        except (redis.exceptions.RedisError, CheckpointError, OSError, TimeoutError, bus.PublishFailed) as e:
            self.log.warning("admission failed, handing back", error=str(e))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
        finally:
            if reserved is not None:
                self._unreserve(reserved)
            self.admitting -= 1
            self._wake.set()
            self._notify_slots()

    def _join_soon(self) -> None:
        """A hand-off joins the batch now, not after the current engine call: interrupt it. A
        burst of hand-offs (a drained seeding engine's whole batch) is coalesced into one
        interruption per JOIN_COALESCE_S, or each arrival would cost a flush of every request."""
        if self._join_pending:
            return
        self._join_pending = True

        def join() -> None:
            self._join_pending = False
            self._last_join = time.monotonic()
            self.stop_engine.set()

        delay = self._last_join + JOIN_COALESCE_S - time.monotonic()
        if delay <= 0:
            join()
        else:
            asyncio.get_running_loop().call_later(delay, join)

    def _loaded(self, version: int) -> bool:
        """The engine holds `version`'s weights, and knows which ones (a real engine's start-up
        weights from the model dir are unnamed: the version is pulled once to name them)."""
        return version == self.engine.policy_version and (
            self.weights is None or self.weights.virtual or bool(self.engine.weights_id))

    def _unreserve(self, version: int) -> None:
        self._version_users[version] -= 1
        if self._version_users[version] <= 0 and self._switch_wanted:
            self._switch_wanted = 0.0  # the engine can switch: fetch again
            self._notify_slots()

    def _switch_pending(self) -> bool:
        """This worker handed a request back because its engine serves another version: it
        fetches nothing until that version's last request leaves (`_unreserve`), or for one
        ack_wait, then fetches again (a request of its own version may be queued). Each hand-back
        is a delivery, so the hand-back's delay grows with the request's deliveries
        (`_bounce_delay`), not this pause: a pause that grew (it doubled per pause, up to 32
        ack_waits) starved a small fleet, every worker paused for a tail of one or two requests
        with its slots free (the g4dn trace: steps of 300-600 s with 2-4 instances)."""
        if self._switch_wanted and time.monotonic() - self._switch_wanted > self.cfg.ack_wait_s:
            self._switch_wanted = 0.0
        return bool(self._switch_wanted)

    def _bounce_delay(self, msg: Msg) -> float:
        """How long a request handed back for its version stays hidden: 0.5 s for its first three
        deliveries (a worker that switched takes it at once), then doubling up to 16 ack_waits.
        Through a long tail of the old version (an async run's requests published ahead, on GPUs
        through minutes of tail) the next version's requests would otherwise be bounced towards
        max_deliver (20) and the dead-letter queue: with these delays 20 deliveries take ~26 min at
        the default 10 s ack_wait (~150 ack_waits), ~5 min in the trace bench (1.5 s: ~200); 20 x
        0.5 s and the pauses between fetches once took ~20 ack_waits (the trace bench's reserved
        side taking a step back hung a run so)."""
        try:
            n = int(msg.metadata.num_delivered or 1)
        except Exception:  # not a JetStream delivery: the first
            n = 1
        return min(0.5 * 2 ** max(0, n - 3), 16 * self.cfg.ack_wait_s)

    async def _carried_to(self, version: int) -> bool:
        """An upgradable request of a newer version than the engine's: ask the generate loop to
        move the engine to it, carrying the requests in flight along (`_carry_forward`), and
        wait for that (at most half an ack_wait: the message is not extended meanwhile).
        False: nothing to wait for (the engine is not older), or it did not happen in time."""
        if version <= self.engine.policy_version or self.weights is None:
            return False
        if not self.weights.virtual:
            try:  # the download here, not in the generate loop: it keeps generating meanwhile
                await self.weights.path(version)
            except VersionGone:
                raise
            except Exception as e:
                self.log.warning("weight pull failed", version=version, error=str(e))
                return False
        self._carry_to = max(self._carry_to, version)
        self.stop_engine.set()  # the move happens between two engine calls: end this one
        self._wake.set()
        deadline = time.monotonic() + self.cfg.ack_wait_s / 2
        while self.engine.policy_version < version and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._version_moved.wait(), timeout=left)
        return self.engine.policy_version >= version

    async def _carry_forward(self) -> None:
        """Async rollout's in-flight update (as PipelineRL's): move the engine to the newer
        version an upgradable request asked for, and continue the requests in flight under it
        instead of finishing them first. Each is re-claimed under its lease (a new epoch, a
        history line with the new version and weights: its later tokens are a segment of their
        own), so a resume anywhere keeps the labels right; the staleness bound is the oldest
        segment's, unchanged. Without this a worker holding one long response of the old version
        could take none of the next version's requests until it ended: on the trace bench, ~13
        responses a step at the 14K-token cap kept most instances so at every step boundary.

        Runs between engine calls, after a flush (nothing pending). Not now (tried again after
        the next call) while a request of another version that cannot move is in flight (not
        upgradable, an episode) or still being admitted (it holds its version's reservation)."""
        target = self._carry_to
        if target <= self.engine.policy_version:
            self._carry_to = 0
            return
        moving = [a for a in self.active.values() if a.req.policy_version != target and not a.done]
        if any(not a.req.upgradable or a.episode is not None or a.pending_tokens or a.req.policy_version > target
               for a in moving):
            return
        held = collections.Counter(a.req.policy_version for a in self.active.values())
        if any(n > held[v] for v, n in self._version_users.items() if v != target):
            return  # an admission of another version is claiming: it would land on the wrong weights
        path: Path | None = None
        if not self.weights.virtual:
            try:  # pulled by the request that asked (`_carried_to`): a cache hit
                path = await self.weights.path(target)
            except Exception as e:  # gone meanwhile: the waiting requests are handed back
                self.log.warning("in-flight update: weight pull failed", version=target, error=str(e))
                self._carry_to = 0
                return
        async with self._version_lock:
            if any(n > held[v] for v, n in self._version_users.items() if v != target):
                return
            if not await self._load(path, target):
                self._carry_to = 0
                return
            self._carry_to = 0
            claims = await asyncio.gather(*(
                self.c.store.claim(a.req.request_id, self.worker_id, target, self.cfg.lease_ttl_s,
                                   weights=self.engine.weights_id) for a in moving), return_exceptions=True)
            for a, claim in zip(moving, claims, strict=True):
                old = a.req.policy_version
                if isinstance(claim, BaseException) or len(claim.token_ids) != a.durable:
                    # lost meanwhile (another worker holds or finished it, or the store failed):
                    # it is no longer ours to continue here
                    why = (claim if isinstance(claim, Exception)
                           else LeaseLost(f"{a.req.request_id}: the checkpoint moved on meanwhile"))
                    if not isinstance(claim, BaseException):
                        with contextlib.suppress(Exception):
                            await self.c.store.release(a.req.request_id, claim.epoch)
                    await self._drop_fenced(a, why)
                    continue
                a.req = msgspec.structs.replace(a.req, policy_version=target)
                a.epoch, a.weights = claim.epoch, self.engine.weights_id
                self._version_users[target] += 1
                self._unreserve(old)
                self.counters.add("carried")
                await self._event(a.req, a.epoch, "claim", a.durable, detail=f"in-flight update from version {old}")
        self.log.info("in-flight update", policy_version=target, weights=self.engine.weights_id, carried=len(moving))
        self._switch_wanted = 0.0
        self._version_moved.set()
        self._version_moved.clear()
        self._notify_slots()

    async def _load(self, path: Path | None, version: int) -> bool:
        """Put `version`'s weights in the engine (under `_version_lock`); False if that failed."""
        try:
            if path is None:
                self.engine.policy_version = version  # virtual weights: only a label
            else:
                await self.engine.load_weights(path, version)
            self.engine.weights_id = self.weights.weights_id(path, version)
        except Exception as e:
            self.log.warning("weight load failed", version=version, error=str(e))
            return False
        return True

    async def _ensure_version(self, version: int) -> bool:
        """Serve one policy version at a time. On True the caller holds a reservation of
        `version` (`_version_users`): the engine cannot switch away until it is released.

        The switch waits until no request of another version is admitted, active or still
        claiming. The download happens before the lock (a version that is not published yet
        keeps only its own request waiting, never the lock: the cache waits boundedly)."""
        path: Path | None = None
        if not self._loaded(version):
            if self.weights is None:
                self.log.error("request needs a policy version this worker cannot load", version=version,
                               loaded=self.engine.policy_version)
                return False
            if self.weights.virtual:
                pass  # nothing to pull: the switch below only relabels the engine
            elif version == self.engine.policy_version and not await self.weights.published(version):
                # Start-up weights (the model dir) of a version the store does not hold: serve
                # them, labelled as such: a trainer that published the version refuses them.
                self.engine.weights_id = STARTUP_WEIGHTS
            else:
                try:
                    path = await self.weights.path(version)
                except VersionGone:
                    raise  # the request is a leftover: `_admit` dead-letters it
                except Exception as e:
                    self.log.warning("weight pull failed", version=version, error=str(e))
                    return False
        async with self._version_lock:
            if not self._loaded(version):
                if any(n > 0 for v, n in self._version_users.items() if v != version):
                    return False
                if path is None and not self.weights.virtual:
                    return False  # another version was loaded meanwhile: pull again next delivery
                if not await self._load(path, version):
                    return False
                self.log.info("policy version loaded", policy_version=version, weights=self.engine.weights_id)
            self._version_users[version] += 1
            return True

    # ------------------------------------------------------------------ generation

    async def _generate_loop(self) -> None:
        k = self.cfg.checkpoint_tokens
        while True:
            self._wake.clear()  # before looking: whatever arrives from here on wakes the wait below
            if self._carry_to and not self.draining.is_set():
                await self._carry_forward()  # after the last call's flush: nothing is pending
            if not self.active:
                self._progress_at = time.monotonic()
                if self.draining.is_set() and self.admitting == 0:
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                continue
            batch = [a for a in self.active.values() if not a.done]
            if not batch and not self.draining.is_set() and not any(a.pending_tokens for a in self.active.values()):
                # Only requests being finished: wait for one to leave or for new work. No sign of
                # life here: a finish that cannot complete (the store gone) must let this worker
                # look stalled, as when finishing held up the loop itself.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                continue
            self._progress_at = time.monotonic()
            for a in [a for a in batch if a.weights != self.engine.weights_id]:
                # Cannot happen while the version reservation holds; if it ever did, the tokens
                # would carry the wrong label: refuse to generate them, hand the request back.
                self.log.error("request is not on the loaded weights; handing back", request_id=a.req.request_id,
                               request_weights=a.weights, loaded=self.engine.weights_id)
                self.counters.add("wrong_weights")
                batch.remove(a)
                self._forget(a)
                with contextlib.suppress(Exception):
                    await self.c.store.release(a.req.request_id, a.epoch)
                    await a.msg.nak()
            if not self.draining.is_set():
                self.stop_engine.clear()
            if batch and not self.draining.is_set():
                try:
                    outs = await self.engine.generate([a.seq for a in batch], k, stop=self.stop_engine)
                except RequestError as e:  # one request's fault: answer it, serve the rest on
                    bad = self.active.get(e.request_id)
                    if bad is None:  # not one of ours: the engine is confused, not the request
                        self.log.error("engine failed", error=repr(e))
                        self.request_drain(f"engine failure: {e!r}")
                    else:
                        await self._fail_active(bad, e.reason)
                    outs = []
                except Exception as e:  # an engine failure must not take the process down silently
                    self.log.error("engine failed", error=repr(e))
                    self.request_drain(f"engine failure: {e!r}")
                    outs = []
                for a, g in zip(batch, outs, strict=False):
                    toks = a.seq.token_ids
                    toks.extend(g.token_ids)
                    a.pending_tokens.extend(g.token_ids)
                    a.pending_logprobs.extend(g.logprobs)
                    # (seq.max_new_tokens: the request's, or an episode's turn limit)
                    a.done = g.finished or len(toks) >= a.seq.max_new_tokens or (bool(toks) and toks[-1] in a.stops)
                if not self._engine_counts:
                    self.counters.add("generated", sum(len(g.token_ids) for g in outs))
            await self._flush()
            if self.draining.is_set():
                return
            await self._hand_back_below_floor()

    async def _flush(self) -> None:
        """Checkpoint every pending token (one fenced script call), publish them as one token
        message per step, finish what is done."""
        dirty = [a for a in self.active.values() if a.pending_tokens]
        if dirty:
            # Stamped before the append is sent: a write accepted under a lease can only have been
            # sent before its supersession, so a pause (SIGSTOP) between the store's answer and
            # here cannot make an accepted write look like one sent after a takeover.
            now, mono = time.time(), time.monotonic()
            records, logprobs32 = pack_flush(dirty)
            outcomes = await self._retrying(lambda: self.c.store.append_packed(
                [(a.req.request_id, self.worker_id, a.epoch, a.durable, rec) for a, rec in zip(dirty, records)],
                self.cfg.lease_ttl_s))
            by_step: dict[int, list[wire.FlushChunk]] = {}
            checkpointed = 0
            for a, out, rec, lps in zip(dirty, outcomes, records, logprobs32, strict=True):
                if type(out) is int:
                    pass
                elif isinstance(out, (LeaseLost, AlreadyFinished)):
                    await self._drop_fenced(a, out)
                    continue
                if isinstance(out, Exception):
                    self.log.error("checkpoint append failed", request_id=a.req.request_id, error=str(out))
                    self._forget(a)
                    with contextlib.suppress(Exception):
                        await a.msg.nak(delay=1.0)
                    continue
                by_step.setdefault(a.req.step, []).append(wire.FlushChunk(
                    a.req.request_id, a.epoch, a.durable, a.req.policy_version, rec))
                checkpointed += len(lps)
                a.durable = out
                # What is durable is float32: keep exactly that, so a result does not depend on
                # whether its tokens came from memory or from the checkpoint after a hand-off.
                a.logprobs.extend(lps)
                a.pending_tokens, a.pending_logprobs = [], []
                a.last_write = mono
            self.counters.add("checkpointed", checkpointed)
            for step, chunks in by_step.items():
                for part in wire.split_flush(chunks):
                    msg = wire.TokenFlush(step=step, worker_id=self.worker_id, ts=now, chunks=part)
                    self._outbox.append((wire.token_subject(step, self.worker_id), wire.encode(msg),
                                         {wire.HDR_MSG_ID: wire.flush_msg_id(part[0])}))
        # Finished requests are finished in the background: each finish is a few round trips
        # (fenced finish, provenance, result publish, ack) that the next engine call need not
        # wait for. A finishing request keeps its slot until it leaves `active`; a drain waits
        # for these before handing the rest back (run).
        done = [a for a in self.active.values() if a.done and not a.pending_tokens and not a.finishing and not a.in_env]
        if any(a.episode is not None for a in done):
            for a in [a for a in done if a.episode is not None and not a.episode.ended]:
                self._start_env_phase(a)  # a model turn is over and durable: its tools, the env's reply
            done = [a for a in done if a.episode is None or a.episode.ended]
        if done:
            for a in done:
                a.finishing = True
            task = asyncio.create_task(self._finish_batch_safely(done))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)
        await self._publish_outbox_soon()

    # ------------------------------------------------------------------ episodes

    def _episode_put(self, req: wire.RolloutRequest, epoch: int) -> Callable[[wire.EpisodeState], Awaitable[None]]:
        """An episode's state, fenced into its checkpoint under lease `epoch` (retried while the
        store is unreachable; a lost lease raises)."""
        async def put(state: wire.EpisodeState) -> None:
            await self._retrying(lambda: self.c.store.put_episode(req.request_id, self.worker_id, epoch, state,
                                                                  self.cfg.lease_ttl_s))
            if (a := self.active.get(req.request_id)) is not None and a.epoch == epoch:
                a.last_write = time.monotonic()  # the script renewed the lease
        return put

    def _holding_slots(self) -> int:
        """Requests that hold a generation slot: all active ones but the episodes parked in their
        environment phase (up to `parked_episodes`). A tool that takes a minute then never keeps
        the engine's batch short: the slot takes another request, and the episode's next turn
        joins the batch when its tools are done (the batch may run over `slots` until then)."""
        parked = sum(1 for a in self.active.values() if a.in_env)
        return len(self.active) - min(parked, self.cfg.parked_episodes)

    def _start_env_phase(self, a: Active) -> None:
        """Run an episode's environment phase beside the engine (the batch goes on without it)."""
        a.in_env = time.monotonic()
        task = asyncio.create_task(self._env_phase(a))
        self._env_tasks.add(task)
        task.add_done_callback(self._env_tasks.discard)
        self._notify_slots()  # parked: its slot is free for another request

    async def _env_phase(self, a: Active) -> None:
        """After a durable model turn: its tool calls and the environment's reply, each fenced in
        (`EpisodeRun.advance`); then the next turn joins the batch, or the episode is finished."""
        run, rid = a.episode, a.req.request_id
        assert run is not None

        async def append_env(tokens: list[int], state: wire.EpisodeState) -> int:
            offset, sent = a.durable, time.time()
            n = await self._retrying(lambda: self.c.store.append_env(rid, self.worker_id, a.epoch, offset, tokens,
                                                                     state, self.cfg.lease_ttl_s))
            a.seq.token_ids.extend(tokens)
            a.logprobs.extend([0.0] * len(tokens))
            a.durable, a.last_write = n, time.monotonic()
            self.counters.add("env_tokens", len(tokens))
            chunk = wire.FlushChunk(rid, a.epoch, offset, a.req.policy_version,
                                    checkpoint_pack(tokens, [0.0] * len(tokens)), True)
            msg = wire.TokenFlush(step=a.req.step, worker_id=self.worker_id, ts=sent, chunks=[chunk])
            self._outbox.append((wire.token_subject(a.req.step, self.worker_id), wire.encode(msg),
                                 {wire.HDR_MSG_ID: wire.flush_msg_id(chunk)}))
            return n

        def alive() -> None:
            a.in_env = time.monotonic()

        try:
            # env.inline = false: a turn's tool calls go to the environment pool, and nothing of the
            # episode stays here meanwhile; a turn without calls gets the environment's reply here
            if self.env_pool:
                await run.record_turn(a.seq.token_ids[:a.durable], list(a.logprobs), a.req.policy_version, a.weights,
                                      self._episode_put(a.req, a.epoch))
                if run.snap.phase == "tools" and run.snap.pending is not None and run.snap.pending.turn.tool_calls:
                    await self._to_env_pool(a)
                    return
            more = await run.advance(a.seq.token_ids[:a.durable], list(a.logprobs), a.req.policy_version, a.weights,
                                     self._episode_put(a.req, a.epoch), append_env, alive)
        except (LeaseLost, AlreadyFinished) as e:
            a.in_env = 0.0
            await self._drop_fenced(a, e)
            return
        except Exception as e:  # the store refused a write (a bug, never silent) or the runner broke
            a.in_env = 0.0
            self.log.error("episode step failed; handing the request back", request_id=rid, error=repr(e))
            self._forget(a)
            with contextlib.suppress(Exception):
                await self.c.store.release(rid, a.epoch)
                await a.msg.nak(delay=1.0)
            return
        a.in_env = 0.0
        self._progress_at = time.monotonic()
        if more:
            a.seq.max_new_tokens = run.turn_limit()
            a.done = False
            self.counters.add("episode_turns")
            if self.active.get(rid) is a and not self.draining.is_set():
                self._join_soon()  # the next turn joins the running batch now
            self._wake.set()
            return
        a.done = a.finishing = True
        await self._finish_batch_safely([a])

    async def _to_env_pool(self, a: Active) -> None:
        """The model turn ended in tool calls, fenced in with them (`record_turn`): the episode
        goes to its pool's environment lane for an environment worker (workers/env_worker.py),
        which sends it back to the resume lane once its tool results are in. Release, publish,
        then ack (as a hand-off): a crash in between leaves the request's message to come back,
        and its claim finds the calls pending and sends the episode again."""
        rid = a.req.request_id
        self._forget(a)  # first: no heartbeat renews (or extends) what is being let go
        try:
            released = await self._retrying(lambda: self.c.store.release(rid, a.epoch))
        except Exception as e:
            released = False
            self.log.warning("could not release for the environment pool", request_id=rid, error=repr(e))
        if not released:  # fenced out (or the store refused): the message comes back, or is someone else's
            return
        (out,) = await bus.publish_batch(
            self.c.js, [(wire.env_subject(self.handoff_pool), a.msg.data,
                         {wire.HDR_MSG_ID: wire.env_handoff_msg_id(rid, a.epoch)})],
            ack_timeout_s=self.cfg.publish_timeout_s, deadline_s=self.cfg.publish_timeout_s * 2)
        if not out.ok:  # released, not sent: the next claim finds the calls pending and sends it again
            self.log.warning("could not send to the environment pool", request_id=rid, error=str(out.error))
            with contextlib.suppress(Exception):
                await a.msg.nak(delay=1.0)
            return
        with contextlib.suppress(Exception):
            await a.msg.ack()
        self.counters.add("to_env_pool")
        await self._event(a.req, a.epoch, "release", a.durable, detail="tool calls: environment pool")

    async def _publish_outbox_soon(self) -> None:
        """Publish the outbox while the engine makes the next tokens: token messages and events
        are not on the durability path (the checkpoint is), so the next engine call need not
        wait for their acks. One publish in flight at a time: a flush first waits for the
        previous one (bounded, and the outbox cannot grow without limit)."""
        await self._outbox_sent()
        if self._outbox:
            self._publishing = asyncio.create_task(self._publish_outbox())

    async def _outbox_sent(self) -> None:
        """Wait for the publish `_publish_outbox_soon` left in flight (its failures are counted there)."""
        task, self._publishing = self._publishing, None
        if task is not None:
            with contextlib.suppress(Exception):
                await task

    async def _publish_outbox(self) -> None:
        """Token chunks and lease events: for live collection and replay, not for correctness
        (the checkpoint is the truth). Bounded: retried with their ids, then given up."""
        msgs, self._outbox = self._outbox, []
        if not msgs:
            return
        outcomes = await bus.publish_batch(self.c.js, msgs, ack_timeout_s=self.cfg.publish_timeout_s,
                                           deadline_s=self.cfg.publish_timeout_s * 2)
        lost = sum(1 for o in outcomes if not o.ok)
        if lost:
            self.counters.add("publishes_given_up", lost)
            self.log.warning("token chunks / events not stored", count=lost, error=str(outcomes[0].error or ""))

    async def _finish_batch_safely(self, batch: list[Active]) -> None:
        """`_finish_batch` in the background: whatever escapes it, no request stays `finishing`
        in a slot forever (it is handed back, and its redelivery finds the checkpoint's state)."""
        try:
            await self._finish_batch(batch)
        except Exception as e:
            self.log.error("finishing failed", requests=len(batch), error=repr(e))
            for a in batch:
                if self.active.get(a.req.request_id) is a:
                    self._forget(a)
                    with contextlib.suppress(Exception):
                        await a.msg.nak(delay=1.0)

    async def _finish_batch(self, batch: list[Active]) -> None:
        """Finish the requests a flush completed, together: one Redis round trip for every fenced
        finish and its provenance, the results published with their acks in flight together,
        then the messages acked. Per request, as before: a lost lease drops it; a result that
        could not be stored leaves the message un-acked (its redelivery republishes it from the
        finished checkpoint, never redoes it)."""
        sent = time.time()  # the finish events' time: when the fenced finish was sent (see _flush)
        try:
            outs: list = await self._retrying(lambda: self.c.store.finish_many(
                [(a.req.request_id, a.epoch, a.durable) for a in batch]))
        except Exception as e:  # not a connection problem (those are retried): fail each, do not vanish
            outs = [CheckpointError(repr(e))] * len(batch)
        ready: list[tuple[Active, wire.RolloutResult]] = []
        for a, out in zip(batch, outs, strict=True):
            if isinstance(out, (LeaseLost, AlreadyFinished)):
                await self._drop_fenced(a, out)
            elif isinstance(out, Exception):
                self.log.error("checkpoint finish failed", request_id=a.req.request_id, error=str(out))
                self._forget(a)
                with contextlib.suppress(Exception):
                    await a.msg.nak(delay=1.0)
            else:
                ready.append((a, make_result(a.req, a.seq.token_ids[: a.durable], a.logprobs, self.worker_id,
                                              a.epoch, out, episode=a.episode.stored if a.episode else None)))
        if not ready:
            return
        published = await bus.publish_batch(
            self.c.js, [(wire.result_subject(r.step), wire.encode(r), {wire.HDR_MSG_ID: wire.result_msg_id(r)})
                        for _, r in ready],
            ack_timeout_s=self.cfg.publish_timeout_s, deadline_s=self.cfg.publish_timeout_s * 3)
        for (a, _), pub in zip(ready, published, strict=True):
            rid = a.req.request_id
            try:
                if not pub.ok:
                    raise bus.PublishFailed("results", [rid], str(pub.error))
                await a.msg.ack()
            except Exception as e:  # the checkpoint says finished: redelivery republishes it, never redoes it
                self.log.warning("result publish failed; it is republished when the request comes back",
                                 request_id=rid, error=repr(e))
                self._forget(a)
                continue
            await self._event(a.req, a.epoch, "finish", a.durable, ts=sent)
            self.counters.add("results")
            self._forget(a)
            self.log.info("finished", request_id=rid, step=a.req.step, tokens=a.durable)

    async def _publish_result(self, req: wire.RolloutRequest, tokens: list[int], logprobs: list[float],
                              worker_id: str, epoch: int, error: str = "") -> None:
        await publish_result(self.c, req, tokens, logprobs, worker_id, epoch, error, self.cfg.publish_timeout_s)

    async def _refuse(self, msg: Msg, req: wire.RolloutRequest, epoch: int, tokens: list[int], logprobs: list[float],
                      reason: str) -> None:
        """A request this engine cannot serve: finished in the checkpoint under our lease with
        the tokens it has (none, mostly), then an `error` result naming that lease (the trainer
        verifies it like any result), then the ack. A redelivery finds it finished and
        republishes the same error result (`_republish_finished`)."""
        rid = req.request_id
        self.counters.add("request_errors")
        self.log.warning("request refused", request_id=rid, step=req.step, reason=reason)
        try:
            await self._retrying(lambda: self.c.store.finish(rid, epoch, len(tokens)))
        except (LeaseLost, AlreadyFinished) as e:  # someone else's now: their answer stands
            self.log.warning("refused request lost its lease", request_id=rid, reason=str(e))
            return
        try:
            await self._publish_result(req, tokens, logprobs, self.worker_id, epoch, error=reason)
            await msg.ack()
        except Exception as e:  # finished in the checkpoint: redelivery republishes it
            self.log.warning("error result publish failed", request_id=rid, error=repr(e))
            return
        await self._event(req, epoch, "finish", len(tokens), detail=f"error: {reason}")

    async def _fail_active(self, a: Active, reason: str) -> None:
        """An admitted request the engine failed on mid-batch: answered with an error, with the
        tokens already in its checkpoint."""
        self._forget(a)
        await self._refuse(a.msg, a.req, a.epoch, a.seq.token_ids[: a.durable], list(a.logprobs), reason)

    async def _republish_finished(self, req: wire.RolloutRequest) -> None:
        """The checkpoint says finished but the message came back: the finisher died between
        finishing and acking. Publish the result from the checkpoint (the stream drops it if
        it is a duplicate) so it is never lost."""
        tokens, logprobs = await self.c.store.read(req.request_id)
        owner, epoch, _ = await self.c.store.owner(req.request_id)
        error = self.engine.check(make_sequence(req, tokens)) or ""  # deterministic: the same refusal
        await self._publish_result(req, tokens, logprobs, owner, epoch, error=error)
        self.log.info("republished finished result", request_id=req.request_id, tokens=len(tokens))

    async def _drop_fenced(self, a: Active, why: Exception) -> None:
        """Another worker owns the request now: drop it without acking (the message is theirs)."""
        self.counters.add("fenced", len(a.pending_tokens))
        await self._event(a.req, a.epoch, "fenced", a.durable, detail=str(why))
        self.log.warning("lease lost, dropping request", request_id=a.req.request_id, epoch=a.epoch, reason=str(why))
        self._forget(a)

    def _forget(self, a: Active) -> None:
        if self.active.get(a.req.request_id) is a:  # not a newer claim of the same request
            del self.active[a.req.request_id]
            self._unreserve(a.req.policy_version)
        self._notify_slots()
        self._wake.set()

    def _notify_slots(self) -> None:
        for event in self._slot_events:
            event.set()

    # ------------------------------------------------------------------ hand-off

    async def _hand_back_all(self) -> None:
        """After the final flush: release every lease and put every request on the resume lane,
        so a worker with a spare slot claims it at once and continues from the checkpoint with
        nothing to regenerate. Publish first, then ack: a crash in between leaves two messages
        for one request, which the lease and the finished mark resolve, never zero. Batched (one
        Redis round trip, publishes in flight together): a seeding engine hands back hundreds."""
        leftover = list(self.active.values())
        try:
            released = await self.c.store.release_many([(a.req.request_id, a.epoch) for a in leftover])
        except (redis.exceptions.RedisError, OSError) as e:  # they come back after ack_wait, like after a kill
            self.log.warning("hand-off failed: could not release", requests=len(leftover), error=str(e))
            released = [False] * len(leftover)
        mine = [a for a, ok in zip(leftover, released, strict=True) if ok]  # the rest: fenced out, not ours
        subject = wire.resume_subject(self.handoff_pool)
        # a request carried to a newer version (`_carry_forward`) goes on under it: its message
        # says so, or the next worker could continue it under the older one again
        outcomes = await bus.publish_batch(
            self.c.js, [(subject, wire.encode(a.req) if a.req.upgradable else a.msg.data,
                         {wire.HDR_MSG_ID: wire.handoff_msg_id(a.req.request_id, a.epoch)})
                        for a in mine], ack_timeout_s=self.cfg.publish_timeout_s,
            deadline_s=min(self.cfg.publish_timeout_s * 2, self.cfg.drain_grace_s / 2))
        for a, out in zip(mine, outcomes, strict=True):
            if not out.ok:  # not acked: it comes back after ack_wait, like after a kill
                self.log.warning("hand-off failed", request_id=a.req.request_id, error=str(out.error))
                continue
            with contextlib.suppress(Exception):
                await a.msg.ack()
            self.counters.add("handed_off")
            await self._event(a.req, a.epoch, "release", a.durable, detail=self.drain_reason)
            self.log.info("handed off", request_id=a.req.request_id, at=a.durable)
        await self._outbox_sent()
        await self._publish_outbox()
        self.active.clear()
        self._version_users.clear()
        self._switch_wanted = 0.0

    async def _forward_own_queue(self) -> None:
        """A seeding engine (its own queue, another hand-off pool) hands off its whole share:
        what is still queued for it (not fetched yet, or given back as the notice landed) goes
        to the hand-off pool's resume lane as well."""
        js = self.c.js
        sub = await js.pull_subscribe_bind(durable=wire.consumer_name(self.pool), stream=wire.STREAM_REQUESTS)
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch=256, timeout=0.05)
                except (TimeoutError, asyncio.TimeoutError):
                    msgs = []
                # done when nothing is queued, nor delivered to us past a fetch (the rest of a
                # batch its timeout cut short: the next fetch takes those first)
                if not msgs and not sub.pending_msgs and not (await sub.consumer_info()).num_pending:
                    await bus.hand_back_buffered(sub)  # what arrived since: back to our own queue
                    return
                rids = [(m.headers or {}).get(wire.HDR_MSG_ID) or f"forwarded-{uuid.uuid4().hex}" for m in msgs]
                await self._vouch(msgs)
                outcomes = await bus.publish_batch(
                    js, [(wire.resume_subject(self.handoff_pool), m.data, {wire.HDR_MSG_ID: wire.handoff_msg_id(rid, 0)})
                         for m, rid in zip(msgs, rids, strict=True)], ack_timeout_s=self.cfg.publish_timeout_s,
                    deadline_s=self.cfg.publish_timeout_s * 2)
                for msg, rid, out in zip(msgs, rids, outcomes, strict=True):
                    if not out.ok:  # not acked: it returns to our queue after ack_wait
                        self.log.warning("forward failed", request_id=rid, error=str(out.error))
                        continue
                    with contextlib.suppress(Exception):
                        await msg.ack()
                    self.counters.add("handed_off")
                    self.log.info("forwarded unstarted request", request_id=rid, to_pool=self.handoff_pool)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # ------------------------------------------------------------------ liveness

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.cfg.heartbeat_s)
            if stop.is_set():
                return
            # before the stall check, so a stalled worker's tasks are still seen (bench soak)
            self.counters.set("asyncio_tasks", len(asyncio.all_tasks()))
            if self.stalled():
                # Keeping our requests alive while making no progress would hold them forever.
                self.counters.add("stalls")
                self.log.warning("no progress; not extending requests", inflight=len(self.active),
                                 stalled_s=round(time.monotonic() - self._progress_at, 1))
                continue
            try:
                await asyncio.wait_for(self._beat(), timeout=max(self.cfg.heartbeat_s, self.cfg.publish_timeout_s))
            except Exception as e:
                self.log.warning("heartbeat failed", error=str(e))

    async def _beat(self) -> None:
        await asyncio.gather(*(a.msg.in_progress() for a in list(self.active.values())))
        await self._renew_quiet_leases()
        await self._heartbeat("draining" if self.draining.is_set() else "running")
        await self._check_control()

    async def _renew_quiet_leases(self) -> None:
        """Appends renew leases; a request that has not written for a while renews here."""
        quiet = time.monotonic() - self.cfg.lease_ttl_s / 3
        for a in [a for a in self.active.values() if a.last_write < quiet]:
            try:
                await self.c.store.renew(a.req.request_id, self.worker_id, a.epoch, self.cfg.lease_ttl_s)
                a.last_write = time.monotonic()
            except AlreadyFinished as e:
                # While its result is being published and acked, a request is finished by us: the
                # renewal meets our own finish. Dropping it then logged a lost lease, recorded a
                # "fenced" event in its provenance and forgot it before its ack.
                if not a.finishing:
                    await self._drop_fenced(a, e)
            except LeaseLost as e:
                await self._drop_fenced(a, e)

    async def _heartbeat(self, state: str) -> None:
        hb = wire.WorkerHeartbeat(worker_id=self.worker_id, pool=self.pool, engine=self.engine.name, pid=os.getpid(),
                                  host=socket.gethostname(), state=state,  # type: ignore[arg-type]
                                  policy_version=self.engine.policy_version, inflight=len(self.active),
                                  slots=self.cfg.slots, tokens_generated=self.counters.get("generated"),
                                  ts=time.time())
        await self.registry.put(self.worker_id, wire.encode(hb))
        self._metrics(self.counters.snapshot())
        metrics.observe_worker(self.pool, inflight=len(self.active), slots=self.cfg.slots,
                               policy_version=self.engine.policy_version, draining=state == "draining")

    async def _check_floor(self) -> None:
        """Read the pool's version floor; a request generated with an older version is to move
        on to the floor's version at the next engine call's end (interrupted for it)."""
        try:
            entry = await self.control.get(wire.version_floor_key(self.pool))
            floor = wire.decode(wire.VersionFloor, entry.value).version if entry is not None and entry.value else 0
        except Exception:  # no floor set (sync rollout), or unreadable: keep the last one
            return
        if floor > self._floor:
            self._floor = floor
            if any(a.req.policy_version < floor for a in self.active.values()):
                self.stop_engine.set()

    async def _vouch(self, msgs: list[Msg]) -> None:
        """Record the specs of fresh-lane requests forwarded unstarted, as their fresh claim
        would (`CheckpointStore.vouch_many`), so the hand-off pool takes them. What does not
        decode is forwarded as it is: the worker that takes it dead-letters it."""
        specs = []
        for m in msgs:
            with contextlib.suppress(wire.WireError):
                req = wire.decode(wire.RolloutRequest, m.data)
                specs.append((req.request_id, wire.spec_digest(req)))
        if specs:
            try:
                await self._retrying(lambda: self.c.store.vouch_many(specs))
            except (redis.exceptions.RedisError, OSError) as e:  # forwarded anyway: a refused one is redone
                self.log.warning("could not record the specs of forwarded requests", requests=len(specs),
                                 error=str(e))

    async def _hand_back_below_floor(self) -> None:
        """After a flush: release the requests older than the floor and put them on the pool's
        resume lane (checkpointed, nothing to regenerate); their next claim continues them
        under the floor's version (`_admit`), a new segment of the result."""
        old = [a for a in self.active.values() if a.req.policy_version < self._floor and not a.done]
        if not old:
            return
        try:
            released = await self.c.store.release_many([(a.req.request_id, a.epoch) for a in old])
        except (redis.exceptions.RedisError, OSError) as e:  # keep generating them; try again next flush
            self.log.warning("version floor: could not release", requests=len(old), error=str(e))
            return
        mine = [a for a, ok in zip(old, released, strict=True) if ok]
        outcomes = await bus.publish_batch(
            self.c.js, [(wire.resume_subject(self.pool), a.msg.data,
                         {wire.HDR_MSG_ID: wire.handoff_msg_id(a.req.request_id, a.epoch)}) for a in mine],
            ack_timeout_s=self.cfg.publish_timeout_s, deadline_s=self.cfg.publish_timeout_s * 2)
        for a, out in zip(mine, outcomes, strict=True):
            self._forget(a)
            if out.ok:  # else: it comes back after ack_wait, like after a kill
                with contextlib.suppress(Exception):
                    await a.msg.ack()
                self.counters.add("handed_off")
                await self._event(a.req, a.epoch, "release", a.durable, detail=f"version floor {self._floor}")
        for a in old:
            if a not in mine:
                self._forget(a)  # fenced out: not ours any more

    async def _check_control(self) -> None:
        await self._check_floor()
        for key in (self.worker_id, wire.CONTROL_ALL):
            try:
                entry = await self.control.get(key)
            except Exception:
                continue
            if entry is None or not entry.value:
                continue
            try:
                ctl = wire.decode(wire.Control, entry.value)
            except wire.WireError as e:
                self.log.warning("ignoring malformed control message", key=key, error=str(e))
                continue
            if ctl.target != key or ctl.deadline <= time.time():
                continue  # bounded control: it names this key and has not expired (wire.control)
            if key == wire.CONTROL_ALL and ctl.ts < self._started_at:
                continue  # a fleet-wide drain from before this worker started
            if ctl.command in ("drain", "abort"):
                self.request_drain(f"control {ctl.command}: {ctl.reason}")

    async def _event(self, req: wire.RolloutRequest, epoch: int, kind: str, offset: int, detail: str = "",
                     ts: float | None = None) -> None:
        ev = wire.LeaseEvent(request_id=req.request_id, step=req.step, worker_id=self.worker_id, epoch=epoch,
                             kind=kind, offset=offset, ts=time.time() if ts is None else ts,
                             detail=detail)  # type: ignore[arg-type]
        self._outbox.append((wire.event_subject(req.step, req.request_id), wire.encode(ev),
                             {wire.HDR_MSG_ID: wire.event_msg_id(req.request_id, kind, epoch, offset)}))
        if len(self._outbox) >= 256:
            await self._publish_outbox()

    async def _retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        return await retrying(op, self.log)
