"""Which requests a rollout worker takes, and how one becomes active on it.

Pull is the load balancer: each lane (fresh, resume) is fetched only for as many requests as
there are free slots (`feed`). Each request fetched is admitted in a task of its own (`admit`):
decoded (else dead-lettered), its policy version served (else handed back, with a delay that
grows with its deliveries), its lease claimed (a new epoch) and its checkpoint loaded, checked
by the engine (else refused with an error result), and then it is active: the generate loop
continues it from its prompt plus the tokens so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import redis.exceptions
from nats.aio.msg import Msg

from rlboost import bus, wire
from rlboost.checkpoint import AlreadyFinished, CheckpointError, CorruptCheckpoint, LeaseHeld
from rlboost.episodes import EpisodeStateError
from rlboost.weights.errors import VersionGone
from rlboost.workers.episode_phase import EpisodePhase
from rlboost.workers.episodes import EpisodeHost, EpisodeRefused, EpisodeRun
from rlboost.workers.finish import Finisher
from rlboost.workers.inflight import Active, InFlight, is_complete, make_sequence
from rlboost.workers.versions import Versions

_ORPHANS: set[asyncio.Task] = set()  # fetches drained workers stopped waiting for (Admission.feed)


async def settled() -> None:
    """Every fetch a drain stopped waiting for has handed back what it brought (each within its
    linger): what a worker process awaits before it exits."""
    await asyncio.gather(*_ORPHANS, return_exceptions=True)


class Admission:
    def __init__(self, st: InFlight, versions: Versions, finisher: Finisher, host: EpisodeHost,
                 phase: EpisodePhase) -> None:
        self.st = st
        self.versions = versions
        self.finisher = finisher
        self.host = host
        self.phase = phase
        self.tasks: set[asyncio.Task] = set()  # admissions under way

    async def feed(self, psub, capacity: int, max_batch: int, linger_s: float, idle_s: float = 0.0) -> None:
        """Keep up to `capacity` requests in flight from one lane (fresh or resume).

        nats-py's `fetch(n)` returns at once with whatever is queued, but when nothing is, its
        lingering pull waits until all n arrived or `linger_s` passed. Hand-offs trickle in a
        few at a time, so the resume lane pulls one at a time: each returns on arrival.

        A lane that came back empty is idle: its next pull asks for one request and waits up to
        `idle_s` (> linger_s) for it, returned on arrival, so an idle worker sends a pull every
        `idle_s` instead of every `linger_s`; the first request back makes the lane busy again
        (batched pulls that return at once with what is queued)."""
        st = self.st
        idle = False
        slot_freed = asyncio.Event()
        st.slot_events.append(slot_freed)
        while not st.draining.is_set():
            free = capacity - st.holding_slots() - st.admitting
            # a worker making no progress takes no more work, nor one waiting for its engine to
            # be free to switch versions
            if free <= 0 or st.stalled() or st.switch_pending():
                slot_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(slot_freed.wait(), timeout=0.5)
                continue
            # The fetch is a task of its own, shielded: a drain cancels this feeder, and a
            # cancelled fetch would drop what the server already delivered to it (a lingering
            # pull holds its first requests while it waits for the rest of its batch), left
            # unacknowledged until ack_wait. The fetch finishes within its linger instead, and
            # what it brings is nak'ed back to the pool at once (`_nak_when_fetched`).
            waiting = idle and idle_s > linger_s
            fetch = asyncio.ensure_future(psub.fetch(batch=1 if waiting else min(free, max_batch),
                                                     timeout=idle_s if waiting else linger_s))
            try:
                msgs = await asyncio.shield(fetch)
            except asyncio.CancelledError:
                _ORPHANS.add(orphan := asyncio.ensure_future(self._nak_when_fetched(fetch)))
                orphan.add_done_callback(_ORPHANS.discard)
                raise
            except (TimeoutError, asyncio.TimeoutError):
                idle = True
                continue
            except Exception as e:  # server gone for a moment: back off, do not crash
                st.log.warning("fetch failed", error=str(e))
                await asyncio.sleep(0.5)
                continue
            idle = not msgs
            for msg in msgs:
                if st.draining.is_set():
                    await msg.nak()  # arrived after the notice: straight back to the pool
                    continue
                st.admitting += 1
                task = asyncio.create_task(self.admit(msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _nak_when_fetched(self, fetch: asyncio.Future) -> None:
        """A fetch its feeder stopped waiting for (a drain): hand back whatever it brings. In the
        background (a hand-off does not wait out a fetch's linger); a process that is about to
        exit waits for these first (`settled`)."""
        with contextlib.suppress(Exception):
            for msg in await fetch:
                with contextlib.suppress(Exception):
                    await msg.nak()

    async def _dead_letter(self, msg: Msg, why: str) -> None:
        await bus.dead_letter(self.st.c.js, msg, why, wire.STREAM_REQUESTS)
        self.st.counters.add("dead_lettered")

    async def admit(self, msg: Msg) -> None:
        st, engine = self.st, self.st.engine
        reserved: int | None = None
        try:
            try:
                req = wire.decode(wire.RolloutRequest, msg.data)
            except wire.WireError as e:
                await self._dead_letter(msg, str(e))
                return
            if req.policy_version < st.floor:  # continued from its checkpoint under the floor's version
                req = msgspec.structs.replace(req, policy_version=st.floor)
            if req.upgradable and req.policy_version < engine.policy_version and req.episode is None:
                # async's in-flight update: a request of an older version is continued (or
                # started) under the newer one the engine holds, never the other way round
                req = msgspec.structs.replace(req, policy_version=engine.policy_version)
            log = st.log.bind(request_id=req.request_id, step=req.step, policy_version=req.policy_version)
            try:
                ready = await self.versions.ensure(req.policy_version)
                if not ready and req.upgradable and await self.versions.carried_to(req.policy_version):
                    ready = await self.versions.ensure(req.policy_version)
            except VersionGone as e:  # left by a dead life or another run: it would wait forever
                await self._dead_letter(msg, f"stale request: {e}")
                return
            if not ready:
                if any(n > 0 for v, n in st.version_users.items() if v != req.policy_version):
                    st.switch_wanted = time.monotonic()  # and fetch nothing until it can switch
                await msg.nak(delay=self.bounce_delay(msg))  # never generate with another version: hand it back
                return
            reserved = req.policy_version  # released below unless the request becomes active
            try:
                # a hand-off is taken only for the request the trainer published (its fresh claim
                # recorded the spec): one planted on the resume lane is refused and dead-lettered
                claim = await st.c.store.claim(req.request_id, st.worker_id, req.policy_version,
                                               st.cfg.lease_ttl_s, weights=engine.weights_id,
                                               episode=req.episode is not None, spec=wire.spec_digest(req),
                                               handoff=wire.is_handoff_subject(msg.subject))
            except AlreadyFinished:
                await self.finisher.republish_finished(req)
                await msg.ack()
                return
            except LeaseHeld as e:
                await msg.nak(delay=max(0.05, e.retry_after_s))
                return
            except CorruptCheckpoint as e:  # no retry can fix it: dead-letter now, with the reason
                await self._dead_letter(msg, f"corrupt checkpoint: {e}")
                return
            st.counters.add("claims")
            await st.outbox.event(req, claim.epoch, "claim", len(claim.token_ids))
            log.info("claimed", epoch=claim.epoch, resume_at=len(claim.token_ids))
            seq = make_sequence(req, claim.token_ids)
            run: EpisodeRun | None = None
            if req.episode is not None:
                try:
                    run = await self.host.open(req, claim.episode, claim.token_ids, claim.logprobs,
                                               self.phase.put(req, claim.epoch))
                except EpisodeRefused as e:
                    await self.finisher.refuse(msg, req, claim.epoch, claim.token_ids, claim.logprobs, str(e))
                    return
                seq.stop_ids, seq.eos_id, seq.max_new_tokens = run.stop_ids, -1, run.turn_limit()
            reason = engine.check(seq)
            if reason is not None:  # answered now, under this lease: it never reaches a batch
                await self.finisher.refuse(msg, req, claim.epoch, claim.token_ids, claim.logprobs, reason)
                return
            if (stale := st.active.get(req.request_id)) is not None:
                st.forget(stale)  # redelivered to us while we held it: the new claim replaces it
            a = st.active[req.request_id] = Active(
                msg=msg, req=req, seq=seq, epoch=claim.epoch, durable=len(claim.token_ids),
                logprobs=list(claim.logprobs),
                done=is_complete(req, claim.token_ids) if run is None else run.turn_done(claim.token_ids),
                weights=engine.weights_id, stops=req.stops() if run is None else frozenset(run.stop_ids),
                episode=run)
            reserved = None  # the request holds its version until it leaves `active`
            if run is not None and a.done:
                self.phase.start(a)  # a turn over, tools half run, or the end: on with it
            elif claim.token_ids:
                st.join_soon()
        except (CorruptCheckpoint, EpisodeStateError) as e:  # a finished request whose tokens do not parse
            with contextlib.suppress(Exception):
                await self._dead_letter(msg, f"corrupt checkpoint: {e}")
        except (redis.exceptions.RedisError, CheckpointError, OSError, TimeoutError, bus.PublishFailed) as e:
            st.log.warning("admission failed, handing back", error=str(e))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
        finally:
            if reserved is not None:
                st.unreserve(reserved)
            st.admitting -= 1
            st.wake.set()
            st.notify_slots()

    def bounce_delay(self, msg: Msg) -> float:
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
        return min(0.5 * 2 ** max(0, n - 3), 16 * self.st.cfg.ack_wait_s)
