"""The rollout manager: puts a step's requests on the wire and collects its results.

It owns the step-level view of the dataflow: publish the G samples of every prompt to the
pool's work queue (each with its own seed, so the step is reproducible), stream the results
back de-duplicated by request id, and tell how many preemptible workers are alive (from the
registry heartbeats) so the offload policy knows whom it can hand off to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from rlboost import bus, wire
from rlboost.clients import Clients
from rlboost.logs import get_logger


class RolloutManager:
    def __init__(self, clients: Clients, pool: str) -> None:
        self.c = clients
        self.pool = wire.check_name("pool", pool)
        self.log = get_logger(component="manager", pool=pool)

    async def publish_step(self, requests: list[wire.RolloutRequest], pool: str | None = None) -> None:
        """Publish every request once (a retried publish is dropped by its Nats-Msg-Id)."""
        subject = wire.request_subject(pool or self.pool)
        acks = []
        for r in requests:
            acks.append(await self.c.js.publish_async(subject, wire.encode(r), headers={wire.HDR_MSG_ID: r.request_id}))
            ev = wire.LeaseEvent(request_id=r.request_id, step=r.step, worker_id="manager", epoch=0, kind="publish",
                                 offset=0, ts=time.time(), detail=subject)
            acks.append(await self.c.js.publish_async(wire.event_subject(r.step, r.request_id), wire.encode(ev)))
        await asyncio.gather(*acks)
        if requests:
            self.log.info("published step", step=requests[0].step, requests=len(requests),
                          policy_version=requests[0].policy_version)

    async def results(self, step: int, expect: set[str], timeout_s: float | None = None) -> AsyncIterator[wire.RolloutResult]:
        """Each expected result exactly once, in arrival order, until all have arrived."""
        pending = set(expect)
        sub = await self.c.js.subscribe(wire.result_subject(step), ordered_consumer=True)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while pending:
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"step {step}: {len(pending)} results missing after {timeout_s} s")
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except TimeoutError:
                    continue
                try:
                    r = wire.decode(wire.RolloutResult, msg.data)
                except wire.WireError as e:
                    self.log.warning("ignoring malformed result", error=str(e))
                    continue
                if r.request_id in pending:
                    pending.discard(r.request_id)
                    yield r
        finally:
            await sub.unsubscribe()

    async def live_workers(self, exclude: set[str] = frozenset(), max_age_s: float = 5.0) -> list[wire.WorkerHeartbeat]:
        """Workers of this pool whose heartbeat is fresh and who are not draining."""
        kv = await self.c.js.key_value(wire.BUCKET_WORKERS)
        try:
            keys = await bus.worker_keys(self.c.js)
        except Exception as e:
            self.log.warning("cannot list workers", error=str(e))
            return []
        out = []
        now = time.time()
        for key in keys:
            if key in exclude:
                continue
            try:
                entry = await kv.get(key)
                hb = wire.decode(wire.WorkerHeartbeat, entry.value)
            except Exception:
                continue
            if hb.pool == self.pool and hb.state == "running" and now - hb.ts <= max_age_s:
                out.append(hb)
        return out

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

    async def queue_depth(self) -> int:
        """Requests of the pool not yet delivered (fresh + resume lanes)."""
        total = 0
        for name in (wire.consumer_name(self.pool), wire.resume_consumer_name(self.pool)):
            try:
                total += (await self.c.js.consumer_info(wire.STREAM_REQUESTS, name)).num_pending
            except Exception:
                pass
        return total
