"""The pool client: the trainer's side of one pool on the wire. It puts a step's requests on
the wire and collects its results.

It owns the step-level view of the dataflow: publish the G samples of every prompt to the
pool's work queue (each with its own seed, so the step is reproducible), stream the results
back de-duplicated by request id, and tell how many preemptible workers are alive (from the
registry heartbeats) so the offload policy knows whom it can hand off to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable

import numpy as np

from rlboost import bus, episodes, metrics, wire
from rlboost.checkpoint import CheckpointError, CorruptCheckpoint
from rlboost.clients import Clients
from rlboost.errors import RequestsDeadLettered
from rlboost.logs import get_logger


# How far a heartbeat's own time may be from the NATS server's time of its put: clock skew
# between a worker and the server (NTP keeps it to well under a second). Only a lie is further.
REGISTRY_SKEW_S = 30.0

# The NATS connection options of whoever owns a PoolClient (the trainer): a ping every 5 s, and
# a connection that misses 2 in a row is dropped and reconnected (then `results` follows again),
# so a link left half-open (no FIN, no RST) is noticed in ~10-15 s, not nats-py's default ~4
# minutes, during which the step waited for results it could not hear (`rlboost bench
# partitions`, trainer_nats_half_open). Looser than a worker's 2 s (workers/main.py): a false
# alarm costs the trainer a reconnect mid-step. A loop held up by a long call costs at most one
# missed ping: the PONGs that came meanwhile are read as soon as it runs again.
NATS_OPTIONS = {"ping_interval": 5.0, "max_outstanding_pings": 2}

# A dead-lettered request of a step is published again (`PoolClient.redo`); its corrupt
# checkpoint is reset at most REDO_LIMIT times (junk planted again and again: the step fails with
# the reason), and dead letters of one request within REDO_MIN_INTERVAL_S count once.
REDO_LIMIT = 3
REDO_MIN_INTERVAL_S = 2.0
REDO_TRIES = 5


class PoolClient:
    def __init__(self, clients: Clients, pool: str) -> None:
        self.c = clients
        self.pool = wire.check_name("pool", pool)
        self.log = get_logger(component="manager", pool=pool)
        self._results_after: dict[int, int] = {}  # step -> results stream sequence before it was published
        self._dlq_after: dict[int, int] = {}  # step -> dead-letter stream sequence before it was published
        self._subjects: dict[str, str] = {}  # request id -> the lane it was published on (its redo goes there)
        self.redone: dict[str, int] = {}  # request id -> times its corrupt checkpoint was reset and redone
        self._why: dict[str, RequestsDeadLettered] = {}  # request id -> why it cannot be redone
        self.ignored: dict[str, int] = {}  # registry entries not counted as workers, by reason (`live_workers`)
        self._ignored_seen: set[tuple[str, int]] = set()
        # request ids that any of this manager's `results` calls moved to the DLQ: one call may
        # move another step's (a message is moved once, by whichever call sees it first)
        self.dead_lettered: set[str] = set()

    async def publish_step(self, requests: list[wire.RolloutRequest], pool: str | None = None,
                           deadline_s: float = 60.0, batch: int = 1024, republish: bool = False) -> None:
        """Return only once every request is stored in the work queue, or raise
        `bus.PublishFailed` naming the requests that are not.

        Each ack is awaited for a bounded time; an unacknowledged request is published again
        with the same Nats-Msg-Id (its request id) until `deadline_s`, so a NATS restart in the
        middle costs a retry, never a lost or a doubled request. A request whose id the stream
        already held at the first attempt is someone else's message (an earlier run or step
        with the same id): refused loudly, since the workers would never see ours — unless
        `republish`: a resumed run publishes its interrupted step again under the same ids, and
        the messages already there are its own (queued, in flight, or done)."""
        subject = wire.request_subject(pool or self.pool)
        if requests and requests[0].step not in self._results_after:
            # What is on the results subject already (earlier runs on these servers) answers none
            # of these requests: `results` skips it instead of dead-lettering it on every run.
            last = (await asyncio.wait_for(self.c.js.stream_info(wire.STREAM_RESULTS), deadline_s)).state.last_seq
            self._results_after[requests[0].step] = last
            dlq = (await asyncio.wait_for(self.c.js.stream_info(wire.STREAM_DLQ), deadline_s)).state.last_seq
            self._dlq_after[requests[0].step] = dlq
        self._subjects.update((r.request_id, subject) for r in requests)
        deadline = time.monotonic() + deadline_s
        missing: list[str] = []
        taken: list[str] = []
        cause = ""
        for start in range(0, len(requests), batch):
            part = requests[start:start + batch]
            now = time.time()
            msgs: list[bus.Outgoing] = [(subject, wire.encode(r), {wire.HDR_MSG_ID: r.request_id}) for r in part]
            msgs += [(wire.event_subject(r.step, r.request_id),
                      wire.encode(wire.LeaseEvent(request_id=r.request_id, step=r.step, worker_id="manager", epoch=0,
                                                  kind="publish", offset=0, ts=now, detail=subject)),
                      {wire.HDR_MSG_ID: wire.event_msg_id(r.request_id, "publish", 0, 0)}) for r in part]
            outcomes = await bus.publish_batch(self.c.js, msgs, ack_timeout_s=5.0,
                                               deadline_s=max(1.0, deadline - time.monotonic()))
            for r, out in zip(part, outcomes[:len(part)], strict=True):
                if not out.ok:
                    missing.append(r.request_id)
                    cause = str(out.error)
                elif out.taken_before:
                    taken.append(r.request_id)
        if taken and not republish:
            raise bus.PublishFailed("requests", taken, "their Nats-Msg-Id was already taken by another message "
                                    "in the de-duplication window: a request id must be new")
        if missing:
            raise bus.PublishFailed("requests", missing, f"no ack within {deadline_s:g} s: {cause}")
        if requests:
            self.log.info("published step", step=requests[0].step, requests=len(requests),
                          policy_version=requests[0].policy_version)

    async def results(self, step: int, expect: Iterable[str] | Iterable[wire.RolloutRequest],
                      timeout_s: float | None = None) -> AsyncIterator[wire.RolloutResult]:
        """Each expected result exactly once, in arrival order, until all have arrived.

        The results stream is writable by every worker credential, so nothing on it is taken on
        trust: a result is accepted only if it answers a request of this step (with the
        request's group and prompt when `expect` holds the requests themselves) and its lease
        binding holds in Redis (`verify_result`). Everything else is dead-lettered with the
        reason and logged; the genuine result, published under its own message id, still comes."""
        known: dict[str, wire.RolloutRequest | None] = {
            (q if isinstance(q, str) else q.request_id): (None if isinstance(q, str) else q) for q in expect}
        pending = set(known)
        subject = wire.result_subject(step)
        sub = await bus.follow(self.c.js, subject)
        # A reconnect (the trainer's link to NATS was cut, or went half-open and its pings gave up
        # on it) leaves the ordered consumer dead: the server dropped the ephemeral consumer
        # while nobody listened, or sent what came meanwhile into the void. nats-py notices only
        # after two missed idle heartbeats (~10 s) and recreates it once; one that fails (the link
        # still down) waits another 10. So after every reconnect the consumer is recreated here,
        # from the message after the last one read: nothing is skipped, and what comes twice is
        # taken once (`pending`).
        reconnects, last_seq = self.c.nc.stats["reconnects"], 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        stop = asyncio.Event()
        chores = [asyncio.create_task(self._keep_scripts(stop)),
                  asyncio.create_task(bus.dead_letter_max_deliveries(self.c.js, self.c.nc, stop, self._dead))]
        if all(q is not None for q in known.values()):  # the published specs are here: a dead letter is redone
            chores.append(asyncio.create_task(self._redo_dead_letters(step, known, pending, stop)))
        try:
            while pending:
                if lost := pending & self.dead_lettered:  # never coming: fail now, not hang
                    if why := next((self._why[rid] for rid in sorted(lost) if rid in self._why), None):
                        raise why
                    raise RequestsDeadLettered(step, sorted(lost))
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"step {step}: {len(pending)} results missing after {timeout_s} s")
                if self.c.nc.stats["reconnects"] != reconnects and self.c.nc.is_connected:
                    seen = self.c.nc.stats["reconnects"]
                    try:
                        fresh = await bus.follow(self.c.js, subject, within_s=5.0, from_seq=last_seq + 1)
                    except Exception as e:  # no leader yet, or the link went again: the next turn retries
                        self.log.warning("results: cannot follow again yet", step=step,
                                         error=str(e) or type(e).__name__)
                        continue
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                    sub, reconnects = fresh, seen
                    self.log.info("results: following again after a reconnect", step=step, from_seq=last_seq + 1)
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except TimeoutError:
                    continue
                last_seq = msg.metadata.sequence.stream
                # published before this step's requests: history, not an answer — unless it answers
                # one of them (a resumed run publishes a step again under the same request ids, and
                # what its previous life finished is verified and taken like any other result)
                history = msg.metadata.sequence.stream <= self._results_after.get(step, 0)
                try:
                    r = wire.decode(wire.RolloutResult, msg.data)
                except wire.WireError as e:
                    if not history:
                        await self._refuse(msg, f"malformed result: {e}")
                    continue
                if r.request_id not in known:
                    if not history:
                        await self._refuse(msg, f"result for unknown request {r.request_id}")
                    continue
                if r.request_id not in pending:
                    continue  # a duplicate of an accepted result
                reason = await self.verify_result(step, r, known[r.request_id])
                if reason:
                    await self._refuse(msg, f"result for {r.request_id} refused: {reason}")
                    continue
                pending.discard(r.request_id)
                yield r
        finally:
            stop.set()
            await asyncio.gather(*chores, return_exceptions=True)
            await sub.unsubscribe()
            if not pending:
                for rid in known:
                    self._subjects.pop(rid, None)
                    self.redone.pop(rid, None)

    async def _redo_dead_letters(self, step: int, known: dict[str, wire.RolloutRequest | None], pending: set[str],
                                 stop: asyncio.Event) -> None:
        """Every dead letter of a request still pending in this step, whatever its reason (a
        worker found its checkpoint corrupt, e.g. junk planted at its key before it was
        published; its message did not decode; its version was gone), is acted on within a
        second: the request is published again from the spec the trainer published (never the
        dead letter's payload, which any worker credential can write), its checkpoint reset first
        if it is corrupt. A dead letter is only a hint: a forged one costs nothing while a worker
        holds the request's lease, else a duplicate message (the copy finds it taken or finished
        and is acked). Only
        `REDO_LIMIT` resets of a corrupt checkpoint per request: then the step fails with the
        reason instead of redoing forever. (Dead letters after `max_deliver` deliveries come from
        the server's advisory, `_dead`: the step fails at once, the request is poison.)"""
        subject = wire.dlq_subject(wire.STREAM_REQUESTS)
        start = self._dlq_after.get(step, 0) + 1
        try:
            sub = await bus.follow(self.c.js, subject, within_s=10.0, from_seq=start)
        except ConnectionError as e:
            self.log.warning("dead letters: cannot follow; a dead-lettered request is noticed only by its step's "
                             "timeout", step=step, error=str(e))
            return
        wanted: dict[str, str] = {}  # request id -> the latest dead letter's reason, not yet acted on
        redoing: dict[str, asyncio.Task] = {}

        async def redo_loop(req: wire.RolloutRequest) -> None:
            """One request's redos, one at a time and at most one per REDO_MIN_INTERVAL_S: a
            burst of dead letters (forged, or one per lane) is one redo, and none is dropped."""
            rid = req.request_id
            while rid in wanted and rid in pending and not stop.is_set():
                reason = wanted.pop(rid)
                for attempt in range(REDO_TRIES):  # the store or NATS away for a moment: try again
                    try:
                        if not await self.redo(req, reason):  # a worker holds it: look again later
                            wanted.setdefault(rid, reason)
                        break
                    except RequestsDeadLettered as e:
                        self.dead_lettered.add(rid)  # `results` fails the step with the reason
                        self._why[rid] = e
                        return
                    except Exception as e:
                        self.log.warning("redo failed", request_id=rid, step=step, attempt=attempt + 1,
                                         error=str(e) or type(e).__name__)
                        await asyncio.sleep(1.0)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), REDO_MIN_INTERVAL_S)
            redoing.pop(rid, None)

        try:
            while not stop.is_set():
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except TimeoutError:
                    continue
                try:
                    rid = wire.decode(wire.RolloutRequest, msg.data).request_id
                except wire.WireError:
                    continue  # not a request of ours: the DLQ keeps it with its reason
                req = known.get(rid)
                if req is None or rid not in pending:
                    continue
                wanted[rid] = (msg.headers or {}).get(wire.HDR_DLQ_REASON, "")
                if rid not in redoing:
                    redoing[rid] = asyncio.create_task(redo_loop(req))
        finally:
            for task in redoing.values():
                task.cancel()
            await asyncio.gather(*redoing.values(), return_exceptions=True)
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def redo(self, req: wire.RolloutRequest, reason: str = "") -> bool:
        """Publish `req` again from its spec (a new message id: the first is in the de-duplication
        window), after resetting its checkpoint if that holds junk. One log line. False: a worker
        holds its lease now, nothing was done (the caller looks again later: its holder may go)."""
        rid = req.request_id
        corrupt = ""
        try:
            await self.c.store.check(rid)
            if req.episode is not None and (state := await self.c.store.episode(rid)) is not None:
                tokens, logprobs = await self.c.store.read(rid)
                episodes.unpack(state, list(req.prompt_ids), tokens, logprobs)  # what a worker's claim does
        except (CorruptCheckpoint, episodes.EpisodeStateError) as e:
            corrupt = str(e)
        if corrupt:
            n = self.redone.get(rid, 0) + 1
            self.redone[rid] = n
            if n > REDO_LIMIT:
                raise RequestsDeadLettered(req.step, [rid], f"its checkpoint was found corrupt {n} times ({corrupt})")
            await self.c.store.reset(rid)
        elif await self.c.store.is_finished(rid):
            return True  # its result is on the way (a worker republishes a finished one when it meets it)
        elif await self.c.store.is_held(rid):
            return False  # a worker has it (a readable checkpoint is not dead-lettered after a claim)
        subject = self._subjects.get(rid, wire.request_subject(self.pool))
        out = await bus.publish_batch(self.c.js, [(subject, wire.encode(req),
                                                   {wire.HDR_MSG_ID: f"{rid}.redo{time.time_ns()}"})],
                                      ack_timeout_s=5.0, deadline_s=15.0)
        if not out[0].ok:
            raise bus.PublishFailed("requests", [rid], str(out[0].error))
        metrics.REDONE.inc()
        self.log.warning("request published again after a dead letter", request_id=rid, step=req.step,
                         dead_letter=reason[:200], checkpoint_reset=bool(corrupt))
        return True

    def _dead(self, payload: bytes) -> None:
        try:
            self.dead_lettered.add(wire.decode(wire.RolloutRequest, payload).request_id)
        except wire.WireError:
            pass  # not a request of ours: the DLQ keeps it with its reason

    async def _keep_scripts(self, stop: asyncio.Event, period_s: float = 2.0) -> None:
        """Workers may only EVALSHA the checkpoint scripts; a Redis restart empties the script
        cache, so the trainer loads them again while it waits for results."""
        while not stop.is_set():
            with contextlib.suppress(Exception):
                await self.c.store.load_scripts()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=period_s)

    async def verify_result(self, step: int, r: wire.RolloutResult, req: wire.RolloutRequest | None) -> str:
        """Why `r` is not the genuine result of its request ('' if it is): it must match the
        request, and Redis must say the request is finished under the lease the result names
        (worker id and epoch) with exactly these tokens and logprobs and this provenance (the
        segments, from the checkpoint's history, which fencing decides). What Redis does not
        hold is checked against the request: the finish reason (an `error` result must be an
        incomplete response). A forgery with the genuine tokens and false provenance is refused
        here, not by the trainer's weights check, and the genuine result (another message id,
        `wire.result_msg_id`) is taken when it comes."""
        if r.step != step:
            return f"step {r.step}, expected {step}"
        if req is not None:
            if r.group != req.group or r.prompt_ids != list(req.prompt_ids):
                return "group or prompt differ from the request"
            if len(r.token_ids) > req.max_new_tokens:
                return f"{len(r.token_ids)} tokens, more than the {req.max_new_tokens} asked for"
            if r.finish_reason == "error" and wire.is_complete(req, r.token_ids):
                return "an error result with a complete response"
            if r.finish_reason != "error" and r.finish_reason != wire.finish_reason(req, r.token_ids):
                return f"finish reason {r.finish_reason}, the tokens say {wire.finish_reason(req, r.token_ids)}"
        try:
            owner, epoch, finished = await self.c.store.owner(r.request_id)
            tokens, logprobs = await self.c.store.read(r.request_id)
            segments = await self.c.store.segments(r.request_id)
        except CheckpointError as e:
            return f"checkpoint unreadable: {e}"
        if not finished:
            return "the checkpoint is not finished"
        if (owner, epoch) != (r.worker_id, r.epoch):
            return f"lease is {owner}/{epoch}, the result names {r.worker_id}/{r.epoch}"
        if tokens != r.token_ids or np.float32(logprobs).tobytes() != np.float32(r.logprobs).tobytes():
            return "tokens or logprobs differ from the checkpoint"
        if list(r.segments) != segments:
            return "segments (who generated which tokens, with which weights) differ from the checkpoint's history"
        if r.episode is not None or (req is not None and req.episode is not None):
            try:  # an episode's final state (what its reward is computed from) is the checkpoint's
                if r.episode != await self.c.store.episode(r.request_id):
                    return "the episode state differs from the checkpoint's"
            except CheckpointError as e:
                return f"episode state unreadable: {e}"
        return ""

    async def _refuse(self, msg, reason: str) -> None:
        with contextlib.suppress(Exception):
            await bus.dead_letter(self.c.js, msg, reason, wire.STREAM_RESULTS, ack=False)
        self.log.warning("result refused", reason=reason)

    async def live_workers(self, exclude: set[str] = frozenset(), max_age_s: float = 5.0) -> list[wire.WorkerHeartbeat]:
        """Workers of this pool whose heartbeat is fresh and who are not draining.

        Any worker credential can put any entry in the registry, so an entry counts only if it
        is what a worker writes: filed under its own worker id, with a `ts` within
        `REGISTRY_SKEW_S` of the NATS server's time of the put. Freshness is the server's time
        of the put (a writer cannot choose it; main trusted the payload's `ts`, and one entry
        stamped a day ahead was a live worker for a day). Other entries are ignored, each
        revision logged and counted once (`rlboost_registry_entries_ignored_total`)."""
        try:
            keys = await bus.worker_keys(self.c.js)
        except Exception as e:
            self.log.warning("cannot list workers", error=str(e))
            return []
        out = []
        for key in keys:
            if key in exclude:
                continue
            try:
                entry = await bus.registry_entry(self.c.js, key)
            except Exception:
                continue
            if entry is None:
                continue
            value, put_at, revision = entry
            try:
                hb = wire.decode(wire.WorkerHeartbeat, value)
            except wire.WireError:
                self._ignore(key, revision, "undecodable")
                continue
            if hb.worker_id != key:
                self._ignore(key, revision, "filed under another worker id")
                continue
            if abs(hb.ts - put_at) > REGISTRY_SKEW_S:
                self._ignore(key, revision, "heartbeat time disagrees with the server's")
                continue
            if hb.pool == self.pool and hb.state == "running" and time.time() - put_at <= max_age_s:
                out.append(hb)
        return out

    def _ignore(self, key: str, revision: int, reason: str) -> None:
        if (key, revision) in self._ignored_seen:
            return
        if len(self._ignored_seen) > 10_000:  # bounded: a flood of entries costs memory once
            self._ignored_seen.clear()
        self._ignored_seen.add((key, revision))
        self.ignored[reason] = self.ignored.get(reason, 0) + 1
        metrics.REGISTRY_IGNORED.labels(reason).inc()
        self.log.warning("registry entry ignored", key=key[:128], revision=revision, reason=reason)

    async def sample_idle(self, stop: asyncio.Event, period_s: float = 0.25) -> float:
        """Preemptible waiting: the idle share of live workers' slots, integrated over time
        until `stop` (the t_preemptible_waiting of the seeding-window rule)."""
        idle_s = 0.0
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=period_s)
            live = await self.live_workers()
            if live:
                idle_s += period_s * sum(1 - min(1.0, hb.inflight / max(1, hb.slots)) for hb in live) / len(live)
        return idle_s

    async def sample_waiting(self, stop: asyncio.Event, period_s: float = 0.25,
                             exclude: set[str] = frozenset()) -> float:
        """t_preemptible_waiting of the seeding-window rule: how long the live workers sat with
        nothing at all in flight (mean over workers), until `stop`. A worker finishing a few long
        responses is not waiting: the tail is latency-bound, and counting its empty slots as
        idle (`sample_idle`) keeps T_seed from growing."""
        waiting = 0.0
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=period_s)
            live = await self.live_workers(exclude=exclude)
            if live:
                waiting += period_s * sum(hb.inflight == 0 for hb in live) / len(live)
        return waiting

    async def lanes(self) -> dict[str, dict[str, int]]:
        """The pool's lanes of work, each as `waiting` (not delivered yet), `in_flight` (delivered,
        not acknowledged) and `pulling` (fetches open now: 0 while work waits means nobody serves
        the lane). The environment lane is every pool's. A lane whose consumer does not answer
        within 2 s is left out (this is for a report, never a wait)."""
        out: dict[str, dict[str, int]] = {}
        for lane, name in (("fresh", wire.consumer_name(self.pool)), ("resume", wire.resume_consumer_name(self.pool)),
                           ("env", wire.ENV_CONSUMER)):
            try:
                info = await asyncio.wait_for(self.c.js.consumer_info(wire.STREAM_REQUESTS, name), 2.0)
            except Exception:
                continue
            out[lane] = {"waiting": info.num_pending or 0, "in_flight": info.num_ack_pending or 0,
                         "pulling": info.num_waiting or 0}
        return out

    async def queue_depth(self) -> int:
        """Requests of the pool not yet delivered (fresh + resume lanes)."""
        total = 0
        for name in (wire.consumer_name(self.pool), wire.resume_consumer_name(self.pool)):
            try:
                total += (await self.c.js.consumer_info(wire.STREAM_REQUESTS, name)).num_pending
            except Exception:
                pass
        return total
