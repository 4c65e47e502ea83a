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
"""

from __future__ import annotations

import asyncio
import contextlib
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

import numpy as np
import redis.exceptions
from nats.aio.msg import Msg

from rlboost import bus, metrics, wire
from rlboost.checkpoint import AlreadyFinished, CheckpointError, LeaseHeld, LeaseLost
from rlboost.clients import Clients
from rlboost.config import WorkerSettings
from rlboost.logs import get_logger
from workers.counters import Counters
from workers.engines.base import Engine, Sequence

T = TypeVar("T")
JOIN_COALESCE_S = 0.05  # hand-offs arriving together interrupt the engine once per this

# Returns the directory of verified weights for a policy version (pulled if needed).
WeightSource = Callable[[int], Awaitable[Path]]


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
    last_write: float = field(default_factory=time.monotonic)


def finish_reason(req: wire.RolloutRequest, tokens: list[int]) -> str:
    if req.eos_id >= 0 and tokens and tokens[-1] == req.eos_id:
        return "stop"
    return "length" if len(tokens) >= req.max_new_tokens else "stop"


def is_complete(req: wire.RolloutRequest, tokens: list[int]) -> bool:
    return len(tokens) >= req.max_new_tokens or (req.eos_id >= 0 and bool(tokens) and tokens[-1] == req.eos_id)


class RolloutWorker:
    def __init__(self, settings: WorkerSettings, engine: Engine, clients: Clients, worker_id: str | None = None,
                 counters: Counters | None = None, weights: WeightSource | None = None) -> None:
        self.cfg = settings
        self.engine = engine
        self.c = clients
        self.pool = wire.check_name("pool", settings.pool)
        self.handoff_pool = wire.check_name("hand-off pool", settings.handoff_pool or settings.pool)
        self.worker_id = wire.check_name("worker id", worker_id or make_worker_id(self.pool))
        self.counters = counters or Counters()
        self._engine_counts = engine.set_token_callback(lambda n: self.counters.add("generated", n))
        self._metrics = metrics.CounterSync(self.pool, engine.name)
        self.weights = weights
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
        self._token_acks: list[asyncio.Future] = []
        self._admissions: set[asyncio.Task] = set()
        self._started_at = time.time()
        self._join_pending = False
        self._last_join = 0.0

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
        await bus.ensure_pool_consumer(js, self.pool, wire.ConsumerSpec(ack_wait_s=self.cfg.ack_wait_s,
                                                                       max_deliver=self.cfg.max_deliver))
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
        aux = [asyncio.create_task(self._heartbeat_loop(stop_aux)),
               asyncio.create_task(bus.dead_letter_max_deliveries(js, self.c.nc, stop_aux))]
        try:
            await self._generate_loop()
            # Stop pulling before handing back, or our own parked pull requests would be
            # handed the very requests we put on the resume lane.
            feeder.cancel()
            for sub in (fresh, resume):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await asyncio.gather(*self._admissions, return_exceptions=True)
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
            free = capacity - len(self.active) - self.admitting
            if free <= 0:
                slot_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(slot_freed.wait(), timeout=0.5)
                continue
            try:
                msgs = await psub.fetch(batch=min(free, max_batch), timeout=linger_s)
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

    async def _admit(self, msg: Msg) -> None:
        try:
            try:
                req = wire.decode(wire.RolloutRequest, msg.data)
            except wire.WireError as e:
                await bus.dead_letter(self.c.js, msg, str(e), wire.STREAM_REQUESTS)
                self.counters.add("dead_lettered")
                return
            log = self.log.bind(request_id=req.request_id, step=req.step, policy_version=req.policy_version)
            if not await self._ensure_version(req.policy_version):
                await msg.nak(delay=0.5)  # never generate with another version: hand it back
                return
            try:
                claim = await self.c.store.claim(req.request_id, self.worker_id, req.policy_version, self.cfg.lease_ttl_s)
            except AlreadyFinished:
                await self._republish_finished(req)
                await msg.ack()
                return
            except LeaseHeld as e:
                await msg.nak(delay=max(0.05, e.retry_after_s))
                return
            self.counters.add("claims")
            await self._event(req, claim.epoch, "claim", len(claim.token_ids))
            log.info("claimed", epoch=claim.epoch, resume_at=len(claim.token_ids))
            p = req.sampling
            seq = Sequence(request_id=req.request_id, prompt_ids=list(req.prompt_ids), seed=req.seed,
                           max_new_tokens=req.max_new_tokens, eos_id=req.eos_id, temperature=p.temperature,
                           top_p=p.top_p, top_k=p.top_k, token_ids=list(claim.token_ids))
            self.active[req.request_id] = Active(msg=msg, req=req, seq=seq, epoch=claim.epoch,
                                                 durable=len(claim.token_ids), logprobs=list(claim.logprobs),
                                                 done=is_complete(req, claim.token_ids))
            if claim.token_ids:
                self._join_soon()
        except (redis.exceptions.RedisError, CheckpointError, OSError) as e:
            self.log.warning("admission failed, handing back", error=str(e))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
        finally:
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

    async def _ensure_version(self, version: int) -> bool:
        """Serve one policy version at a time; switch only when no request of another is in flight."""
        if version == self.engine.policy_version:
            return True
        async with self._version_lock:
            if version == self.engine.policy_version:
                return True
            if any(a.req.policy_version != version for a in self.active.values()):
                return False
            if self.weights is None:
                if self.engine.name != "emulated":
                    self.log.error("request needs a policy version this worker cannot load", version=version,
                                   loaded=self.engine.policy_version)
                    return False
                self.engine.policy_version = version  # emulated weights are virtual
                return True
            try:
                path = await self.weights(version)
                await self.engine.load_weights(path, version)
            except Exception as e:
                self.log.warning("weight pull failed", version=version, error=str(e))
                return False
            self.log.info("policy version loaded", policy_version=version)
            return True

    # ------------------------------------------------------------------ generation

    async def _generate_loop(self) -> None:
        k = self.cfg.checkpoint_tokens
        while True:
            if not self.active:
                if self.draining.is_set() and self.admitting == 0:
                    return
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                continue
            batch = [a for a in self.active.values() if not a.done]
            if not self.draining.is_set():
                self.stop_engine.clear()
            if batch and not self.draining.is_set():
                try:
                    outs = await self.engine.generate([a.seq for a in batch], k, stop=self.stop_engine)
                except Exception as e:  # an engine failure must not take the process down silently
                    self.log.error("engine failed", error=repr(e))
                    self.request_drain(f"engine failure: {e!r}")
                    outs = []
                for a, g in zip(batch, outs, strict=False):
                    a.seq.token_ids.extend(g.token_ids)
                    a.pending_tokens.extend(g.token_ids)
                    a.pending_logprobs.extend(g.logprobs)
                    a.done = g.finished or is_complete(a.req, a.seq.token_ids)
                if not self._engine_counts:
                    self.counters.add("generated", sum(len(g.token_ids) for g in outs))
            await self._flush()
            if self.draining.is_set():
                return

    async def _flush(self) -> None:
        """Checkpoint every pending token (one pipeline), publish the chunks, finish what is done."""
        dirty = [a for a in self.active.values() if a.pending_tokens]
        if dirty:
            outcomes = await self._retrying(lambda: self.c.store.append_many(
                [(a.req.request_id, self.worker_id, a.epoch, a.durable, a.pending_tokens, a.pending_logprobs)
                 for a in dirty], self.cfg.lease_ttl_s))
            now = time.time()
            for a, out in zip(dirty, outcomes, strict=True):
                if isinstance(out, (LeaseLost, AlreadyFinished)):
                    await self._drop_fenced(a, out)
                    continue
                if isinstance(out, Exception):
                    self.log.error("checkpoint append failed", request_id=a.req.request_id, error=str(out))
                    self._forget(a)
                    with contextlib.suppress(Exception):
                        await a.msg.nak(delay=1.0)
                    continue
                chunk = wire.TokenChunk(request_id=a.req.request_id, step=a.req.step, worker_id=self.worker_id,
                                        epoch=a.epoch, offset=a.durable, token_ids=a.pending_tokens,
                                        logprobs=a.pending_logprobs, policy_version=a.req.policy_version, ts=now)
                self._token_acks.append(await self.c.js.publish_async(
                    wire.token_subject(a.req.step, a.req.request_id), wire.encode(chunk)))
                self.counters.add("checkpointed", len(a.pending_tokens))
                a.durable = out
                # What is durable is float32: keep exactly that, so a result does not depend on
                # whether its tokens came from memory or from the checkpoint after a hand-off.
                a.logprobs.extend(np.asarray(a.pending_logprobs, dtype=np.float32).tolist())
                a.pending_tokens, a.pending_logprobs = [], []
                a.last_write = time.monotonic()
            acks, self._token_acks = self._token_acks, []
            await asyncio.gather(*acks, return_exceptions=True)
        done = [a for a in self.active.values() if a.done and not a.pending_tokens]
        if done:  # concurrently: each finish is a few round trips, a flush may finish hundreds
            await asyncio.gather(*(self._finish(a) for a in done))

    async def _finish(self, a: Active) -> None:
        rid = a.req.request_id
        try:
            await self._retrying(lambda: self.c.store.finish(rid, a.epoch, a.durable))
        except (LeaseLost, AlreadyFinished) as e:
            await self._drop_fenced(a, e)
            return
        tokens = a.seq.token_ids[: a.durable]
        try:
            await self._publish_result(a.req, tokens, a.logprobs, self.worker_id)
            await a.msg.ack()
        except Exception as e:  # the checkpoint says finished: redelivery republishes it, never redoes it
            self.log.warning("result publish failed; it is republished when the request comes back",
                             request_id=rid, error=repr(e))
            self._forget(a)
            return
        await self._event(a.req, a.epoch, "finish", a.durable)
        self.counters.add("results")
        self._forget(a)
        self.log.info("finished", request_id=rid, step=a.req.step, tokens=a.durable)

    async def _publish_result(self, req: wire.RolloutRequest, tokens: list[int], logprobs: list[float],
                              worker_id: str) -> None:
        result = wire.RolloutResult(
            request_id=req.request_id, step=req.step, group=req.group, prompt_ids=list(req.prompt_ids),
            token_ids=tokens, logprobs=logprobs, segments=await self.c.store.segments(req.request_id),
            finish_reason=finish_reason(req, tokens), worker_id=worker_id, ts=time.time())  # type: ignore[arg-type]
        await self.c.js.publish(wire.result_subject(req.step), wire.encode(result),
                                headers={wire.HDR_MSG_ID: req.request_id})

    async def _republish_finished(self, req: wire.RolloutRequest) -> None:
        """The checkpoint says finished but the message came back: the finisher died between
        finishing and acking. Publish the result from the checkpoint (the stream drops it if
        it is a duplicate) so it is never lost."""
        tokens, logprobs = await self.c.store.read(req.request_id)
        segs = await self.c.store.segments(req.request_id)
        await self._publish_result(req, tokens, logprobs, segs[-1].worker_id if segs else self.worker_id)
        self.log.info("republished finished result", request_id=req.request_id, tokens=len(tokens))

    async def _drop_fenced(self, a: Active, why: Exception) -> None:
        """Another worker owns the request now: drop it without acking (the message is theirs)."""
        self.counters.add("fenced", len(a.pending_tokens))
        await self._event(a.req, a.epoch, "fenced", a.durable, detail=str(why))
        self.log.warning("lease lost, dropping request", request_id=a.req.request_id, epoch=a.epoch, reason=str(why))
        self._forget(a)

    def _forget(self, a: Active) -> None:
        self.active.pop(a.req.request_id, None)
        self._notify_slots()

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
        pubs = []
        for a in mine:
            pubs.append(await self.c.js.publish_async(
                subject, a.msg.data, headers={wire.HDR_MSG_ID: wire.handoff_msg_id(a.req.request_id, a.epoch)}))
        outcomes = await asyncio.gather(*pubs, return_exceptions=True)
        for a, out in zip(mine, outcomes, strict=True):
            if isinstance(out, Exception):  # not acked: it comes back after ack_wait, like after a kill
                self.log.warning("hand-off failed", request_id=a.req.request_id, error=str(out))
                continue
            with contextlib.suppress(Exception):
                await a.msg.ack()
            self.counters.add("handed_off")
            await self._event(a.req, a.epoch, "release", a.durable, detail=self.drain_reason)
            self.log.info("handed off", request_id=a.req.request_id, at=a.durable)
        acks, self._token_acks = self._token_acks, []
        await asyncio.gather(*acks, return_exceptions=True)
        self.active.clear()

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
                if not msgs and not (await sub.consumer_info()).num_pending:
                    return
                rids = [(m.headers or {}).get(wire.HDR_MSG_ID) or f"forwarded-{uuid.uuid4().hex}" for m in msgs]
                pubs = [await js.publish_async(wire.resume_subject(self.handoff_pool), m.data,
                                               headers={wire.HDR_MSG_ID: wire.handoff_msg_id(rid, 0)})
                        for m, rid in zip(msgs, rids, strict=True)]
                outcomes = await asyncio.gather(*pubs, return_exceptions=True)
                for msg, rid, out in zip(msgs, rids, outcomes, strict=True):
                    if isinstance(out, Exception):  # not acked: it returns to our queue after ack_wait
                        self.log.warning("forward failed", request_id=rid, error=str(out))
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
            try:
                await asyncio.gather(*(a.msg.in_progress() for a in list(self.active.values())))
                await self._renew_quiet_leases()
                await self._heartbeat("draining" if self.draining.is_set() else "running")
                await self._check_control()
            except Exception as e:
                self.log.warning("heartbeat failed", error=str(e))

    async def _renew_quiet_leases(self) -> None:
        """Appends renew leases; a request that has not written for a while renews here."""
        quiet = time.monotonic() - self.cfg.lease_ttl_s / 3
        for a in [a for a in self.active.values() if a.last_write < quiet]:
            try:
                await self.c.store.renew(a.req.request_id, self.worker_id, a.epoch, self.cfg.lease_ttl_s)
                a.last_write = time.monotonic()
            except (LeaseLost, AlreadyFinished) as e:
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

    async def _check_control(self) -> None:
        for key in (self.worker_id, "all"):
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
            if key == "all" and ctl.ts and ctl.ts < self._started_at:
                continue  # a fleet-wide drain from before this worker started
            if ctl.command in ("drain", "abort"):
                self.request_drain(f"control {ctl.command}: {ctl.reason}")

    async def _event(self, req: wire.RolloutRequest, epoch: int, kind: str, offset: int, detail: str = "") -> None:
        ev = wire.LeaseEvent(request_id=req.request_id, step=req.step, worker_id=self.worker_id, epoch=epoch,
                             kind=kind, offset=offset, ts=time.time(), detail=detail)  # type: ignore[arg-type]
        with contextlib.suppress(Exception):
            self._token_acks.append(await self.c.js.publish_async(wire.event_subject(req.step, req.request_id),
                                                                  wire.encode(ev)))

    async def _retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        """Redis unreachable for a moment: back off and retry instead of crashing. Nothing is
        lost meanwhile: pending tokens stay in memory, messages stay in progress."""
        delay = 0.05
        while True:
            try:
                return await op()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                self.log.warning("checkpoint store unreachable, retrying", error=str(e), delay_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
