"""How a rollout worker shows it is alive, and what it is told: one tick per `heartbeat_s`.

Each tick extends its requests' messages (in_progress), renews the leases of requests that have
not written for a while, publishes its heartbeat (the workers bucket, metrics), and reads the
control bucket: the pool's version floor, and a drain or abort for this worker or the whole
fleet. A stalled worker (no engine step, no flush for `stall_s`) skips the tick: keeping its
requests alive while making no progress would hold them forever; they are redelivered instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable

from rlboost import metrics, wire
from rlboost.checkpoint import AlreadyFinished, LeaseLost
from rlboost.workers.inflight import InFlight


class Liveness:
    def __init__(self, st: InFlight, registry, control, metrics_sync: Callable[[dict], None],
                 started_at: float) -> None:
        self.st = st
        self.registry = registry  # the workers bucket (key-value)
        self.control = control  # the control bucket (key-value)
        self.metrics_sync = metrics_sync
        self.started_at = started_at  # a fleet-wide drain from before this is not ours

    async def loop(self, stop: asyncio.Event, tick: Callable[[], Awaitable[None]]) -> None:
        st = self.st
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=st.cfg.heartbeat_s)
            if stop.is_set():
                return
            # before the stall check, so a stalled worker's tasks are still seen (bench soak)
            st.counters.set("asyncio_tasks", len(asyncio.all_tasks()))
            if st.stalled():
                st.counters.add("stalls")
                st.log.warning("no progress; not extending requests", inflight=len(st.active),
                               stalled_s=round(time.monotonic() - st.progress_at, 1))
                continue
            try:
                await asyncio.wait_for(tick(), timeout=max(st.cfg.heartbeat_s, st.cfg.publish_timeout_s))
            except Exception as e:
                st.log.warning("heartbeat failed", error=str(e))

    async def beat(self) -> None:
        st = self.st
        await asyncio.gather(*(a.msg.in_progress() for a in list(st.active.values())))
        await self.renew_quiet_leases()
        await self.heartbeat("draining" if st.draining.is_set() else "running")
        await self.check_control()

    async def renew_quiet_leases(self) -> None:
        """Appends renew leases; a request that has not written for a while renews here."""
        st = self.st
        quiet = time.monotonic() - st.cfg.lease_ttl_s / 3
        for a in [a for a in st.active.values() if a.last_write < quiet]:
            try:
                await st.c.store.renew(a.req.request_id, st.worker_id, a.epoch, st.cfg.lease_ttl_s)
                a.last_write = time.monotonic()
            except AlreadyFinished as e:
                # While its result is being published and acked, a request is finished by us: the
                # renewal meets our own finish. Dropping it then logged a lost lease, recorded a
                # "fenced" event in its provenance and forgot it before its ack.
                if not a.finishing:
                    await st.drop_fenced(a, e)
            except LeaseLost as e:
                await st.drop_fenced(a, e)

    async def heartbeat(self, state: str) -> None:
        st, engine = self.st, self.st.engine
        hb = wire.WorkerHeartbeat(worker_id=st.worker_id, pool=st.pool, engine=engine.name, pid=os.getpid(),
                                  host=socket.gethostname(), state=state,  # type: ignore[arg-type]
                                  policy_version=engine.policy_version, inflight=len(st.active),
                                  slots=st.cfg.slots, tokens_generated=st.counters.get("generated"),
                                  ts=time.time())
        await self.registry.put(st.worker_id, wire.encode(hb))
        self.metrics_sync(st.counters.snapshot())
        metrics.observe_worker(st.pool, inflight=len(st.active), slots=st.cfg.slots,
                               policy_version=engine.policy_version, draining=state == "draining")

    async def check_floor(self) -> None:
        """Read the pool's version floor; a request generated with an older version is to move
        on to the floor's version at the next engine call's end (interrupted for it)."""
        st = self.st
        try:
            entry = await self.control.get(wire.version_floor_key(st.pool))
            floor = wire.decode(wire.VersionFloor, entry.value).version if entry is not None and entry.value else 0
        except Exception:  # no floor set (sync rollout), or unreadable: keep the last one
            return
        if floor > st.floor:
            st.floor = floor
            if any(a.req.policy_version < floor for a in st.active.values()):
                st.stop_engine.set()

    async def check_control(self) -> None:
        st = self.st
        await self.check_floor()
        for key in (st.worker_id, wire.CONTROL_ALL):
            try:
                entry = await self.control.get(key)
            except Exception:
                continue
            if entry is None or not entry.value:
                continue
            try:
                ctl = wire.decode(wire.Control, entry.value)
            except wire.WireError as e:
                st.log.warning("ignoring malformed control message", key=key, error=str(e))
                continue
            if ctl.target != key or ctl.deadline <= time.time():
                continue  # bounded control: it names this key and has not expired (wire.control)
            if key == wire.CONTROL_ALL and ctl.ts < self.started_at:
                continue  # a fleet-wide drain from before this worker started
            if ctl.command in ("drain", "abort"):
                st.drain(f"control {ctl.command}: {ctl.reason}")
