"""What a rollout worker publishes beside the checkpoint: token chunks and lease events.

They are for live collection and replay, not for correctness (the checkpoint is the truth), so
they are queued and published once per flush, while the engine makes the next tokens: the next
engine call never waits for their acks. Bounded: retried with their ids, then given up and
counted (`publishes_given_up`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from rlboost import bus, wire
from rlboost.clients import Clients
from rlboost.workers.counters import Counters


class Outbox:
    def __init__(self, c: Clients, worker_id: str, publish_timeout_s: float, counters: Counters, log) -> None:
        self.c = c
        self.worker_id = worker_id
        self.publish_timeout_s = publish_timeout_s
        self.counters = counters
        self.log = log
        self.items: list[bus.Outgoing] = []  # to publish at the next flush
        self._publishing: asyncio.Task | None = None  # the publish in flight (`publish_soon`)

    def add(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self.items.append((subject, data, headers))

    async def event(self, req: wire.RolloutRequest, epoch: int, kind: str, offset: int, detail: str = "",
                    ts: float | None = None) -> None:
        """A lease event (claim, release, fenced, finish) of `req` under lease `epoch`."""
        ev = wire.LeaseEvent(request_id=req.request_id, step=req.step, worker_id=self.worker_id, epoch=epoch,
                             kind=kind, offset=offset, ts=time.time() if ts is None else ts,
                             detail=detail)  # type: ignore[arg-type]
        self.items.append((wire.event_subject(req.step, req.request_id), wire.encode(ev),
                           {wire.HDR_MSG_ID: wire.event_msg_id(req.request_id, kind, epoch, offset)}))
        if len(self.items) >= 256:
            await self.publish()

    async def publish_soon(self) -> None:
        """Publish what is queued while the engine makes the next tokens. One publish in flight
        at a time: a flush first waits for the previous one (bounded, and the outbox cannot grow
        without limit)."""
        await self.sent()
        if self.items:
            self._publishing = asyncio.create_task(self.publish())

    async def sent(self) -> None:
        """Wait for the publish `publish_soon` left in flight (its failures are counted there)."""
        task, self._publishing = self._publishing, None
        if task is not None:
            with contextlib.suppress(Exception):
                await task

    async def publish(self) -> None:
        msgs, self.items = self.items, []
        if not msgs:
            return
        outcomes = await bus.publish_batch(self.c.js, msgs, ack_timeout_s=self.publish_timeout_s,
                                           deadline_s=self.publish_timeout_s * 2)
        lost = sum(1 for o in outcomes if not o.ok)
        if lost:
            self.counters.add("publishes_given_up", lost)
            self.log.warning("token chunks / events not stored", count=lost, error=str(outcomes[0].error or ""))
