"""One `rlboost run` per set of servers: the run lease.

A run's pools (`spot`, `reserved`), its version pointer, weight store, worker registry and
control entries live in NATS under fixed names. Two runs on the same NATS would take each
other's requests, which then fail to load the other run's weights and end in the dead-letter
queue. So a run takes this lease before it touches any of them, and a second run is refused.

Where: a JetStream key-value bucket (`wire.BUCKET_RUN`, one key), in NATS and not in Redis,
because NATS is what two runs share in a harmful way: every name that collides is a NATS name,
while Redis only holds checkpoints under request ids that carry the run id. A run on a shared
NATS cluster with its own (embedded) Redis still collides, and only a NATS lease sees it. The
bucket also gives the three operations a lease needs: create-only (`kv.create`: exactly one
holder), compare-and-set renewal (`kv.update(last=revision)`), and expiry kept by the server
(the bucket's max age: a SIGKILLed holder's entry is removed after the TTL, whatever the clocks
of the clients say).

Life of a lease (`hold`):

- taken at start (`RunLease.take`); held by another run: `RunLeaseHeld` names it and the run
  exits 2 with that line. A holder provably dead (this process shares its pid space and its pid
  is gone or now another process: a run SIGKILLed on this machine) is taken over at once; a
  resumed run (`--resume`) of the holder's own run id waits for its previous life's lease to
  lapse, at most one TTL, and is refused if the holder renews it meanwhile (that life is alive);
- renewed every third of the TTL by a task of the run's event loop. A renewal that finds the
  lease lapsed (the loop or the servers stalled past the TTL) takes it again if nobody did;
  if another run took it, this run is stopped with `RunLeaseLost`;
- released (deleted, only if still its own) when the run ends, cleanly or by an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from rlboost import wire
from rlboost.errors import RunLeaseError, RunLeaseHeld, RunLeaseLost
from rlboost.logs import get_logger

log = get_logger(component="runlease")

KEY = wire.RUN_LEASE_KEY
POLL_S = 0.25  # how often a resumed run looks whether its previous life's lease has lapsed
ROUNDS = 20  # tries of `take`: each one loses only to another run's take, release or lapse in between


# ---------------------------------------------------------------- who holds it, and is it alive


def _read_first_line(path: str) -> str:
    try:
        return Path(path).read_text().split("\n", 1)[0].strip()
    except OSError:
        return ""


def pid_space() -> str:
    """Where a pid means the same process: this host, this boot, this pid namespace. Empty where
    any part is unknown (no /proc): then nobody is proven dead here and a lease only lapses."""
    boot = _read_first_line("/proc/sys/kernel/random/boot_id")
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}|{boot}|{ns}" if boot and ns else ""


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat from field 3 (the state) on; empty: unknown or no such process. The
    command name (field 2) may hold spaces and parentheses: split after its last one."""
    stat = _read_first_line(f"/proc/{pid}/stat")
    return stat.rsplit(")", 1)[1].split() if ")" in stat else []


def proc_start(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot (0: unknown or no such process).
    With the pid it names one process: a pid reused by another process has another start."""
    fields = _stat(pid)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else 0


def holder_dead(h: wire.RunLease) -> bool:
    """True only where it is proven: the holder ran in this pid space and its process is gone
    (its pid unused, or used by a process started at another time). False: alive or unknown."""
    if not h.pid_space or h.pid_space != pid_space() or h.pid <= 0:
        return False
    try:
        os.kill(h.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a live process of another user
        pass
    fields = _stat(h.pid)
    if fields and fields[0] in ("Z", "X"):  # exited, not yet reaped by its parent
        return True
    start = proc_start(h.pid)
    return bool(h.proc_start and start and start != h.proc_start)


def describe(h: wire.RunLease, lapses_in_s: float) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(h.started))
    except (OverflowError, ValueError, OSError):  # a time from the wire that is no date
        since = "?"
    where = f", data dir {h.data_dir}" if h.data_dir else ""
    return (f"run {h.run_id} (host {h.host}, pid {h.pid}, run dir {h.run_dir or '?'}{where}, since {since}; "
            f"if it died, its lease lapses in {max(0.0, lapses_in_s):.0f} s)")


# ---------------------------------------------------------------- the lease


async def open_bucket(js: JetStreamContext, ttl_s: float, replicas: int = 1) -> KeyValue:
    """The lease's bucket (created with this TTL if missing; an existing one keeps its own until
    a run holding the lease sets it, `RunLease.take`)."""
    try:
        return await js.key_value(wire.BUCKET_RUN)
    except (NotFoundError, BadRequestError):
        pass
    try:
        return await js.create_key_value(KeyValueConfig(bucket=wire.BUCKET_RUN, history=1, ttl=ttl_s,
                                                        replicas=replicas,
                                                        description="the run lease: one rlboost run per servers"))
    except BadRequestError:  # created meanwhile by another run
        return await js.key_value(wire.BUCKET_RUN)


async def _bucket_ttl(kv: KeyValue) -> float:
    return float((await kv.status()).ttl or 0.0)


async def _set_bucket_ttl(js: JetStreamContext, ttl_s: float) -> None:
    """The bucket's max age = the lease TTL. Changed only by the holder: no other lease is in the
    bucket then, so nobody's entry expires sooner or later than it was told."""
    info = await js.stream_info(f"KV_{wire.BUCKET_RUN}")
    cfg = info.config
    if cfg.max_age is not None and abs(float(cfg.max_age) - ttl_s) < 1e-3:
        return
    cfg.max_age = ttl_s
    if cfg.duplicate_window and float(cfg.duplicate_window) > ttl_s:
        cfg.duplicate_window = ttl_s  # the server refuses a duplicate window past the max age
    await js.update_stream(cfg)


async def read(kv: KeyValue) -> tuple[int, wire.RunLease] | None:
    """(revision, record) of the lease now, or None: nobody holds it."""
    try:
        entry = await kv.get(KEY)
    except KeyNotFoundError:  # never taken, released (a delete marker) or lapsed
        return None
    if not entry.value:
        return None
    try:
        return entry.revision, wire.decode(wire.RunLease, entry.value)
    except wire.WireError as e:  # another rlboost version's lease, or an entry written by hand
        raise RunLeaseError(f"the run lease on these servers ({wire.BUCKET_RUN}/{KEY}) is not one this rlboost "
                            f"reads ({e}): a run of another rlboost version may hold them. Stop it, or wait: an "
                            "entry nobody renews lapses after the bucket's TTL") from None


class RunLease:
    """This run's lease on its servers, once taken (`take`)."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, me: wire.RunLease, revision: int) -> None:
        self.js, self.kv, self.me, self.revision = js, kv, me, revision
        self.lost: RunLeaseLost | None = None
        self.retaken = 0  # renewals that found the lease lapsed and took it again

    @property
    def ttl_s(self) -> float:
        return self.me.ttl_s

    @property
    def renew_every_s(self) -> float:
        return self.me.ttl_s / 3  # two renewals may fail before it lapses

    @classmethod
    async def take(cls, js: JetStreamContext, run_id: str, *, ttl_s: float, run_dir: str = "", data_dir: str = "",
                   resume: bool = False, replicas: int = 1) -> RunLease:
        """Take the lease, or raise `RunLeaseHeld` naming its live holder (module docstring)."""
        kv = await open_bucket(js, ttl_s, replicas)
        now = time.time()
        pid = os.getpid()
        me = wire.RunLease(run_id=wire.check_name("run id", run_id), token=uuid.uuid4().hex, host=socket.gethostname(),
                           pid=pid, started=now, renewed=now, ttl_s=ttl_s, data_dir=data_dir, run_dir=run_dir,
                           pid_space=pid_space(), proc_start=proc_start(pid))
        waited_on: int | None = None  # the revision of our own run's previous life we waited on
        for _ in range(ROUNDS):
            try:
                revision = await kv.create(KEY, wire.encode(me))
                break
            except KeyWrongLastSequenceError:
                pass
            held = await read(kv)
            if held is None:
                continue  # released or lapsed between the two calls: try again
            rev, holder = held
            if holder_dead(holder):
                try:
                    revision = await kv.update(KEY, wire.encode(me), last=rev)
                except KeyWrongLastSequenceError:
                    continue  # renewed or taken meanwhile: look again
                log.warning("took over the run lease of a dead run on this machine", holder=holder.run_id,
                            pid=holder.pid)
                break
            bucket_ttl = await _bucket_ttl(kv) or holder.ttl_s
            lapses_in = bucket_ttl - (time.time() - holder.renewed)
            if resume and holder.run_id == run_id and waited_on is None:
                # our own run's previous life, dead (a crash, a lost machine) or alive (resumed
                # twice): a dead one's entry lapses within one TTL, a live one renews it sooner
                waited_on = rev
                log.warning("waiting for the previous life of this run to let go of the servers",
                            run_id=run_id, pid=holder.pid, host=holder.host, lapses_in_s=round(max(lapses_in, 0), 1))
                deadline = time.monotonic() + bucket_ttl + 2.0
                while time.monotonic() < deadline and (now_held := await read(kv)) is not None \
                        and now_held[0] == rev:
                    await asyncio.sleep(POLL_S)
                continue
            renewed = waited_on is not None and rev != waited_on
            alive = " (it renewed its lease while this resume waited: it is alive)" if renewed else ""
            raise RunLeaseHeld(
                f"these servers are held by {describe(holder, lapses_in)}{alive}: two runs on the same NATS "
                f"take each other's requests. Stop that run or wait for it to end, or give this one other "
                f"servers (RLBOOST_DATA_DIR=/another/dir, or RLBOOST_NATS_URL / RLBOOST_REDIS_URL)",
                holder, lapses_in)
        else:
            raise RunLeaseError(f"the run lease kept changing hands over {ROUNDS} tries: more runs are starting "
                                "on these servers at once")
        lease = cls(js, kv, me, revision)
        try:
            await _set_bucket_ttl(js, ttl_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await lease.release()
            raise
        return lease

    async def renew(self) -> None:
        """One renewal. A lease found lapsed is taken again if free; `RunLeaseLost` if another
        run holds it now."""
        for _ in range(3):
            self.me = msgspec.structs.replace(self.me, renewed=time.time())
            value = wire.encode(self.me)
            try:
                self.revision = await self.kv.update(KEY, value, last=self.revision)
                return
            except KeyWrongLastSequenceError:
                pass
            held = await read(self.kv)
            if held is not None and held[1].token == self.me.token:
                self.revision = held[0]  # our own write, its answer lost: go on from it
                continue
            if held is not None:
                _, other = held
                raise RunLeaseLost(f"this run's lease on its servers lapsed (not renewed for over {self.ttl_s:g} s: "
                                   f"the process or the servers stalled) and {describe(other, other.ttl_s)} took "
                                   "them: this run stops, two runs must not share them")
            try:
                self.revision = await self.kv.create(KEY, value)
            except KeyWrongLastSequenceError:
                continue  # someone took it meanwhile: the next round names them
            self.retaken += 1
            log.warning("the run lease had lapsed (not renewed within its TTL); nobody took it: taken again",
                        ttl_s=self.ttl_s)
            return
        raise RunLeaseLost("this run's lease on its servers changed hands while it renewed it: this run stops")

    async def keep(self, task: asyncio.Task | None) -> None:
        """Renew until cancelled. Lost: remember why and cancel `task` (the run), which `hold`
        turns into `RunLeaseLost`. A renewal that fails otherwise (NATS away for a moment) is
        retried at the next one; the lease lapses if NATS stays away past the TTL."""
        while True:
            await asyncio.sleep(self.renew_every_s)
            try:
                await self.renew()
            except RunLeaseLost as e:
                self.lost = e
                log.error("run lease lost", error=str(e))
                if task is not None:
                    task.cancel()
                return
            except Exception as e:
                log.warning("run lease: a renewal failed; the next one tries again", error=str(e) or type(e).__name__)

    async def release(self) -> bool:
        """Delete the lease if it is still this run's (a successor's is left alone). True: deleted."""
        try:
            await self.kv.delete(KEY, last=self.revision)
            return True
        except KeyWrongLastSequenceError:
            return False


@contextlib.asynccontextmanager
async def hold(js: JetStreamContext, run_id: str, *, ttl_s: float, run_dir: str = "", data_dir: str = "",
               resume: bool = False, replicas: int = 1) -> AsyncIterator[RunLease]:
    """The lease, taken, kept and released around the block (module docstring). A lease lost
    while the block runs cancels it and raises `RunLeaseLost` in its place."""
    lease = await RunLease.take(js, run_id, ttl_s=ttl_s, run_dir=run_dir, data_dir=data_dir, resume=resume,
                                replicas=replicas)
    task = asyncio.current_task()
    keeper = asyncio.create_task(lease.keep(task))
    try:
        yield lease
    except asyncio.CancelledError:
        if lease.lost is None:
            raise
        if task is not None:
            task.uncancel()
        raise lease.lost from None
    finally:
        keeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        if lease.lost is None:
            try:
                await lease.release()
            except Exception as e:  # NATS away: the lease lapses after its TTL instead
                log.warning("run lease: not released; it lapses by itself", ttl_s=lease.ttl_s,
                            error=str(e) or type(e).__name__)
