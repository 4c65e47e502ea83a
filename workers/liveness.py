"""How a rollout worker shows it is alive, and what it is told: one tick per `heartbeat_s`.

Each tick extends its requests' messages (in_progress, at most every third of ack_wait: the
server needs no more, and one per request in flight per second was a third of the NATS
messages per token under load), renews the leases of requests that have
not written for a while and publishes its heartbeat (the workers bucket, metrics). The control
bucket's three keys of a worker (the pool's version floor, a drain or abort for this worker or
for the whole fleet) are watched (`watch_control`): what is written there arrives when it is
written, and an idle worker sends nothing for it (reading them every tick was ~6 of its ~23
NATS messages a second, docs/benchmarks/scale.md). Every `CONTROL_POLL_TICKS` ticks, and every
tick while a watch is down, the keys are read as well: a watch that broke without a word costs
a delay, never a missed drain. A stalled worker (no engine step, no flush for `stall_s`) skips the tick: keeping its
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


CONTROL_POLL_TICKS = 15  # read the control keys this often even while they are watched


class Liveness:
    def __init__(self, st: InFlight, registry, control, metrics_sync: Callable[[dict], None],
                 started_at: float) -> None:
        self.st = st
        self.registry = registry  # the workers bucket (key-value)
        self.control = control  # the control bucket (key-value)
        self.metrics_sync = metrics_sync
        self.started_at = started_at  # a fleet-wide drain from before this is not ours
        self.watching = False  # the control keys' watches are up (`watch_control`)
        self.ticks = 0
        self.extended_at = 0.0  # monotonic time of the last in_progress round

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
        if time.monotonic() - self.extended_at >= st.cfg.ack_wait_s / 3:
            self.extended_at = time.monotonic()
            await asyncio.gather(*(a.msg.in_progress() for a in list(st.active.values())))
        await self.renew_quiet_leases()
        await self.heartbeat("draining" if st.draining.is_set() else "running")
        self.ticks += 1
        if not self.watching or self.ticks % CONTROL_POLL_TICKS == 0:
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

    def control_keys(self) -> tuple[str, str, str]:
        return wire.version_floor_key(self.st.pool), self.st.worker_id, wire.CONTROL_ALL

    async def watch_control(self, stop: asyncio.Event) -> None:
        """Follow the control keys until `stop`. A watch that cannot start or dies leaves
        `watching` false: the tick reads the keys instead."""
        watchers, tasks = [], []
        try:
            for key in self.control_keys():
                watchers.append(await self.control.watch(key))
            self.watching = True
            tasks = [asyncio.ensure_future(stop.wait()),
                     *(asyncio.ensure_future(self._follow(key, w)) for key, w in zip(self.control_keys(), watchers))]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # a stop, or a watch that broke
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        except Exception as e:
            if not stop.is_set():
                self.st.log.warning("control watch down; reading the control keys every tick", error=str(e))
        finally:
            self.watching = False
            for t in tasks:
                t.cancel()
            for w in watchers:
                with contextlib.suppress(Exception):
                    await w.stop()

    async def _follow(self, key: str, watcher) -> None:
        async for entry in watcher:  # pushed by the server; ends when the watcher is stopped
            if entry is not None and entry.value and entry.operation not in ("DEL", "PURGE"):
                self.apply(key, entry.value)

    async def check_control(self) -> None:
        """Read the control keys (a missing key: nothing to do; unreadable: the last floor stays)."""
        for key in self.control_keys():
            try:
                entry = await self.control.get(key)
            except Exception:  # no such key, or the server is away for a moment
                continue
            if entry is not None and entry.value:
                self.apply(key, entry.value)

    def apply(self, key: str, value: bytes) -> None:
        """What a control key says, acted on: a higher version floor (a request generated with an
        older version moves on to the floor's version at the next engine call's end, interrupted
        for it), or a drain / abort for this worker or the fleet."""
        st = self.st
        if key == wire.version_floor_key(st.pool):
            try:
                floor = wire.decode(wire.VersionFloor, value).version
            except wire.WireError as e:
                st.log.warning("ignoring malformed version floor", key=key, error=str(e))
                return
            if floor > st.floor:
                st.floor = floor
                if any(a.req.policy_version < floor for a in st.active.values()):
                    st.stop_engine.set()
            return
        try:
            ctl = wire.decode(wire.Control, value)
        except wire.WireError as e:
            st.log.warning("ignoring malformed control message", key=key, error=str(e))
            return
        if ctl.target != key or ctl.deadline <= time.time():
            return  # bounded control: it names this key and has not expired (wire.control)
        if key == wire.CONTROL_ALL and ctl.ts < self.started_at:
            return  # a fleet-wide drain from before this worker started
        if ctl.command in ("drain", "abort") and not st.draining.is_set():
            st.drain(f"control {ctl.command}: {ctl.reason}")
