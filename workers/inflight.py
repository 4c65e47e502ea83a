"""What one rollout worker holds in flight, shared by its parts (workers/worker.py wires them).

`Active` is one request on the worker; `InFlight` is the table of them with what every part
reads or changes together: the slots (who waits for one), the policy-version reservations (the
engine switches version only when no admitted request holds another), the drain, the engine's
interruption, the last sign of life, and how a request leaves (`forget`, `drop_fenced`). The
parts (admission, generation, finishing, episodes, versions, hand-off, liveness) hold this and
never the worker itself. Also the helpers an environment worker shares (`make_worker_id`,
`retrying`, `make_result`, `publish_result`, `make_sequence`).
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import redis.exceptions
from nats.aio.msg import Msg

from rlboost import bus, wire
from rlboost.clients import Clients
from rlboost.config import WorkerSettings
from rlboost.workers.counters import Counters
from rlboost.workers.engines.base import Engine, Sequence
from rlboost.workers.episodes import EpisodeRun
from rlboost.workers.outbox import Outbox

T = TypeVar("T")
JOIN_COALESCE_S = 0.05  # hand-offs arriving together interrupt the engine once per this

finish_reason, is_complete = wire.finish_reason, wire.is_complete  # (the manager checks results with them)


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


class InFlight:
    def __init__(self, settings: WorkerSettings, engine: Engine, clients: Clients, worker_id: str, pool: str,
                 handoff_pool: str, counters: Counters, log) -> None:
        self.cfg = settings
        self.engine = engine
        self.c = clients
        self.worker_id = worker_id
        self.pool = pool
        self.handoff_pool = handoff_pool
        self.counters = counters
        self.log = log
        self.outbox = Outbox(clients, worker_id, settings.publish_timeout_s, counters, log)
        self.active: dict[str, Active] = {}
        self.admitting = 0
        self.draining = asyncio.Event()
        self.drain_reason = ""
        self.stop_engine = threading.Event()  # tells the engine to return between steps
        self.wake = asyncio.Event()  # work arrived (or drain): the generate loop looks again
        self.slot_events: list[asyncio.Event] = []  # one per feeder: a request left, fetch again
        self.progress_at = time.monotonic()  # the generate loop's (or the engine's) last sign of life
        self.floor = 0  # the pool's version floor (wire.VersionFloor): partial / async rollout
        # Requests admitted per policy version (claiming or in flight): the engine switches
        # version only when no request of another version is admitted, not just when none is
        # active yet, or a request still claiming would be generated with the new weights.
        self.version_users: collections.Counter[int] = collections.Counter()
        self.switch_wanted = 0.0  # when a request was handed back for its version (`switch_pending`)
        self._join_pending = False
        self._last_join = 0.0

    def drain(self, reason: str) -> None:
        if not self.draining.is_set():
            self.drain_reason = reason
            self.log.info("drain requested", reason=reason)
            self.draining.set()
            self.stop_engine.set()
            self.wake.set()

    def tokens_made(self, n: int) -> None:
        """(engine thread) tokens made: a sign of life as good as a finished flush."""
        self.counters.add("generated", n)
        self.progress_at = time.monotonic()

    def stalled(self) -> bool:
        """No engine step and no flush for `stall_s`: something this worker waits on does not
        answer. It then stops extending its requests (no in_progress, no lease renewal, no
        heartbeat), so they are redelivered to a worker that can make progress."""
        now = time.monotonic()
        if any(a.in_env and now - a.in_env < a.req.episode.tool_timeout_s + self.cfg.stall_s  # type: ignore[union-attr]
               for a in self.active.values()):
            return False  # a tool runs (bounded by its timeout): a sign of life of its own
        return now - self.progress_at > self.cfg.stall_s

    def holding_slots(self) -> int:
        """Requests that hold a generation slot: all active ones but the episodes parked in their
        environment phase (up to `parked_episodes`). A tool that takes a minute then never keeps
        the engine's batch short: the slot takes another request, and the episode's next turn
        joins the batch when its tools are done (the batch may run over `slots` until then)."""
        parked = sum(1 for a in self.active.values() if a.in_env)
        return len(self.active) - min(parked, self.cfg.parked_episodes)

    def join_soon(self) -> None:
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

    # ------------------------------------------------------------------ version reservations

    def unreserve(self, version: int) -> None:
        self.version_users[version] -= 1
        if self.version_users[version] <= 0 and self.switch_wanted:
            self.switch_wanted = 0.0  # the engine can switch: fetch again
            self.notify_slots()

    def switch_pending(self) -> bool:
        """This worker handed a request back because its engine serves another version: it
        fetches nothing until that version's last request leaves (`unreserve`), or for one
        ack_wait, then fetches again (a request of its own version may be queued). Each hand-back
        is a delivery, so the hand-back's delay grows with the request's deliveries
        (`Admission.bounce_delay`), not this pause: a pause that grew (it doubled per pause, up to
        32 ack_waits) starved a small fleet, every worker paused for a tail of one or two requests
        with its slots free (the g4dn trace: steps of 300-600 s with 2-4 instances)."""
        if self.switch_wanted and time.monotonic() - self.switch_wanted > self.cfg.ack_wait_s:
            self.switch_wanted = 0.0
        return bool(self.switch_wanted)

    # ------------------------------------------------------------------ leaving

    async def drop_fenced(self, a: Active, why: Exception) -> None:
        """Another worker owns the request now: drop it without acking (the message is theirs)."""
        self.counters.add("fenced", len(a.pending_tokens))
        await self.outbox.event(a.req, a.epoch, "fenced", a.durable, detail=str(why))
        self.log.warning("lease lost, dropping request", request_id=a.req.request_id, epoch=a.epoch, reason=str(why))
        self.forget(a)

    def forget(self, a: Active) -> None:
        if self.active.get(a.req.request_id) is a:  # not a newer claim of the same request
            del self.active[a.req.request_id]
            self.unreserve(a.req.policy_version)
        self.notify_slots()
        self.wake.set()

    def notify_slots(self) -> None:
        for event in self.slot_events:
            event.set()

    async def retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        return await retrying(op, self.log)
