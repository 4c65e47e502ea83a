"""Many emulated preemptible instances in one process: a fleet host.

A real process per emulated instance costs a Python interpreter, its imports and its own event
loop; nine of them fill this 2-core box, so the trace bench could rent only 3 of the ~14
instances a spot trace offers. Here one `python -m rlboost.benchmarks.fleet_host` process runs any number
of the product's own `RolloutWorker`s (workers/worker.py, unchanged), one per instance, each
with its own worker id, engine, counters file and NATS / Redis connections, in one asyncio loop.

A preemption still reaches exactly that instance's requests:

- without notice (`kill ID`, what SIGKILL is to a worker process): each instance talks to NATS
  and Redis through its own pair of TCP relays in this process. A kill first cuts them (every
  connection aborted, the listeners closed: the servers see that instance's connections drop,
  as when the kernel closes a killed process's sockets, and nothing it sends afterwards can
  arrive), then cancels every task the instance created (tagged by a task factory). So no more
  acks, heartbeats, appends or results from it: its messages come back after `ack_wait`, its
  leases expire, other workers resume its requests from their checkpoints. The other
  instances in the process, on their own connections, go on untouched;
- with notice (`term ID`, what SIGTERM is): the worker drains as on SIGTERM (flush, release the
  leases, put every request on the resume lane); past `--drain-grace` it is killed as above
  (where a worker process would `os._exit`).

Protocol (lines): stdin `start ID`, `kill ID`, `term ID`, `quit`; stdout `gone ID FATE` once an
instance has stopped (FATE: killed, terminated, exited). The host's arguments are the worker's
(`rlboost worker --help`), shared by all its instances; `HostedFleet` drives hosts from a bench
with the surface of `rlboost.workers.fleet.WorkerFleet`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from rlboost.workers.counters import FIELDS, Counters, read_counters

QUIT_GRACE_S = 10.0
INSTANCE: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlboost_instance", default=None)


# ---------------------------------------------------------------------------- the host process


class _Side(asyncio.Protocol):
    """One end of a relayed connection; writes what it receives to its peer, with flow control."""

    def __init__(self, relay: Relay) -> None:
        self.relay, self.peer, self.transport = relay, None, None
        self.early: list[bytes] = []  # received before the peer was connected

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.relay.transports.add(transport)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self.early.append(data)
            return
        peer.transport.write(data)

    def pause_writing(self) -> None:  # our buffer is full: stop reading the peer
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        self.relay.transports.discard(self.transport)
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


class Relay:
    """A TCP relay from a local port to one server: an instance's own path to NATS or Redis,
    so that cutting it is what a SIGKILL does to that instance's sockets and nothing else."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.transports: set[asyncio.BaseTransport] = set()
        self.server: asyncio.Server | None = None
        self.cut_off = False

    async def open(self) -> int:
        self.server = await asyncio.get_running_loop().create_server(self._accepted, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def _accepted(self) -> _Side:
        near = _Side(self)
        asyncio.get_running_loop().create_task(self._connect(near))
        return near

    async def _connect(self, near: _Side) -> None:
        try:
            _, far = await asyncio.get_running_loop().create_connection(lambda: _Side(self), self.host, self.port)
        except OSError:
            if near.transport is not None:
                near.transport.close()
            return
        if self.cut_off or near.transport is None or near.transport.is_closing():  # cut, or the client left
            far.transport.abort()
            return
        near.peer, far.peer = far, near
        for data in near.early:
            far.transport.write(data)
        near.early = []

    def cut(self) -> None:
        """Synchronous: from here on nothing of this instance reaches the server."""
        self.cut_off = True
        if self.server is not None:
            self.server.close()
        for t in list(self.transports):
            t.abort()
        self.transports.clear()


def _relayed(url: str, port: int) -> str:
    p = urlsplit(url)
    auth = p.netloc.rpartition("@")[0]
    return urlunsplit((p.scheme, f"{auth}@127.0.0.1:{port}" if auth else f"127.0.0.1:{port}", p.path, p.query, p.fragment))


def _endpoint(url: str, default_port: int) -> tuple[str, int]:
    p = urlsplit(url.split(",")[0].strip())
    return p.hostname or "127.0.0.1", p.port or default_port


class Instance:
    """One emulated preemptible instance: a `RolloutWorker` on its own engine and connections."""

    def __init__(self, host: Host, worker_id: str) -> None:
        self.host, self.worker_id = host, worker_id
        self.tasks: set[asyncio.Task] = set()  # every task it created (Host._task_factory)
        self.relays: list[Relay] = []
        self.worker = None
        self.fate = "exited"
        self.root: asyncio.Task | None = None
        self.grace_s: float | None = None

    def start(self) -> None:
        ctx = contextvars.copy_context()
        ctx.run(INSTANCE.set, self.worker_id)
        self.root = asyncio.get_running_loop().create_task(self._serve(), context=ctx)
        self.root.add_done_callback(lambda _: self.host.gone(self))

    async def _serve(self) -> None:
        import copy

        from rlboost.clients import open_clients
        from rlboost.workers.engines import engine_from_settings
        from rlboost.workers.worker import RolloutWorker

        h = self.host
        s = copy.deepcopy(h.settings)
        urls = []
        for url, port in ((h.nats_url, 4222), (h.redis_url, 6379)):
            relay = Relay(*_endpoint(url, port))
            self.relays.append(relay)
            urls.append(_relayed(url.split(",")[0].strip(), await relay.open()))
        engine = engine_from_settings(s.worker)
        counters = Counters(h.workdir / f"{self.worker_id}.counters")
        try:
            async with open_clients(urls[0], urls[1], f"rlboost-worker-{self.worker_id}", settings=s) as c:
                self.worker = RolloutWorker(s.worker, engine, c, worker_id=self.worker_id, counters=counters)
                watchdog = asyncio.create_task(self._kill_after_grace())
                try:
                    await self.worker.run()
                finally:
                    watchdog.cancel()
        finally:
            for relay in self.relays:
                relay.cut()

    async def _kill_after_grace(self) -> None:
        """A notice gives `drain_grace_s`; past it the instance goes as a process would (os._exit)."""
        await self.worker.draining.wait()
        await asyncio.sleep(self.grace_s if self.grace_s is not None else self.worker.cfg.drain_grace_s)
        self.kill()

    def terminate(self, grace_s: float | None = None) -> None:
        """`grace_s`: instead of the worker's `drain_grace_s` (the host's own shutdown)."""
        if self.worker is None:  # still starting: nothing to hand off
            self.kill()
            return
        self.fate, self.grace_s = "terminated", grace_s
        self.worker.request_drain("SIGTERM")

    def kill(self) -> None:
        """No notice: cut the connections first (synchronously: nothing more can reach the
        servers), then cancel everything the instance runs."""
        self.fate = "killed"
        for relay in self.relays:
            relay.cut()
        # Cancelled again until it is gone: a cleanup path that awaits (a drain of the cut NATS
        # connection) must not keep it. The reaper is nobody's task (an empty context).
        asyncio.get_running_loop().create_task(self._reap(), context=contextvars.Context())

    async def _reap(self) -> None:
        while self.root is not None and not self.root.done():
            for t in list(self.tasks):
                t.cancel()
            await asyncio.sleep(0.05)


class Host:
    def __init__(self, argv: list[str]) -> None:
        from rlboost.config import load_settings
        from rlboost.services import resolve_urls
        from rlboost.workers.main import parse_args

        self.settings = load_settings(None)
        parse_args(argv, self.settings)
        self.nats_url, self.redis_url = resolve_urls(self.settings.services)
        self.workdir = Path(os.environ.get("RLBOOST_FLEET_HOST_DIR", "."))
        self.instances: dict[str, Instance] = {}
        self.done = asyncio.Event()
        self.quitting = False

    def _task_factory(self, loop, coro, context=None) -> asyncio.Task:
        task = asyncio.Task(coro, loop=loop, context=context)
        wid = context.get(INSTANCE) if context is not None else INSTANCE.get()
        if wid is not None and (inst := self.instances.get(wid)) is not None:
            inst.tasks.add(task)
            task.add_done_callback(inst.tasks.discard)
        return task

    def gone(self, inst: Instance) -> None:
        for t in list(inst.tasks):  # a killed instance's stragglers (nats-py's reconnect loop, ...)
            t.cancel()
        self.instances.pop(inst.worker_id, None)
        print(f"gone {inst.worker_id} {inst.fate}", flush=True)
        if self.quitting and not self.instances:
            self.done.set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_task_factory(self._task_factory)
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = (await reader.readline()).decode()
            cmd, _, wid = line.strip().partition(" ")
            inst = self.instances.get(wid)
            if cmd == "start" and wid and inst is None:
                inst = self.instances[wid] = Instance(self, wid)
                inst.start()
            elif cmd == "kill" and inst is not None:
                inst.kill()
            elif cmd == "term" and inst is not None:
                inst.terminate()
            elif cmd == "quit" or not line:  # quit, or the bench is gone
                break
        # The end of a run, not a preemption: every instance drains, with time to finish (its
        # drain grace models a spot notice; a bench counts what a kill past it regenerates)
        self.quitting = True
        for inst in list(self.instances.values()):
            inst.terminate(grace_s=QUIT_GRACE_S)
        if self.instances:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.done.wait(), timeout=QUIT_GRACE_S + 5)
        for inst in list(self.instances.values()):
            inst.kill()


# Not named `main`: a module with a top-level `main` is a `rlboost bench NAME` (rlboost/cli.py),
# and a host is a process the benches start, not a bench.
def host_main(argv: list[str] | None = None) -> int:
    from rlboost.logs import configure_logging

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    configure_logging(json=True, level=os.environ.get("RLBOOST_LOG_LEVEL", "warning"))
    asyncio.run(Host(sys.argv[1:] if argv is None else argv).serve())
    return 0


# ---------------------------------------------------------------------------- the bench's side


@dataclass
class HostedInstance:
    """What `WorkerFleet` calls a `WorkerProc`, for an instance inside a host process."""

    worker_id: str
    host: subprocess.Popen
    counters_path: Path
    started: float
    fate: str = "running"
    gone: threading.Event = field(default_factory=threading.Event)

    def counters(self) -> dict[str, int]:
        if not self.counters_path.exists():
            return dict.fromkeys(FIELDS, 0)
        return read_counters(self.counters_path)

    def alive(self) -> bool:
        return not self.gone.is_set()


@dataclass
class HostedFleet:
    """Emulated instances spread over `hosts` fleet-host processes (the least loaded takes the
    next one); same calls as `WorkerFleet` where the trace bench uses them."""

    nats_url: str
    redis_url: str
    workdir: Path
    pool: str
    worker_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    hosts: int = 2
    workers: dict[str, HostedInstance] = field(default_factory=dict)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _n: int = 0

    def open(self) -> None:
        """Start the host processes (an instance starts in one at once, not after its imports)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "RLBOOST_NATS_URL": self.nats_url, "RLBOOST_REDIS_URL": self.redis_url,
               "OMP_NUM_THREADS": "1", "RLBOOST_LOG_JSON": "1", "RLBOOST_FLEET_HOST_DIR": str(self.workdir),
               **self.env}
        while len(self._procs) < max(1, self.hosts):
            log = open(self.workdir / f"host{len(self._procs)}.log", "wb")
            proc = subprocess.Popen([sys.executable, "-m", "rlboost.benchmarks.fleet_host", "--pool", self.pool, *self.worker_args],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True)
            log.close()
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
            self._procs.append(proc)

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            parts = line.split()
            if len(parts) == 3 and parts[0] == "gone" and (w := self.workers.get(parts[1])) is not None:
                w.gone.set()
        for w in list(self.workers.values()):  # the host itself is gone: so are its instances
            if w.host is proc:
                w.gone.set()

    def _send(self, proc: subprocess.Popen, line: str) -> None:
        with self._lock, contextlib.suppress(BrokenPipeError, ValueError):
            proc.stdin.write(line + "\n")
            proc.stdin.flush()

    def start(self, prefix: str = "w") -> HostedInstance:
        self.open()
        self._n += 1
        wid = f"{prefix}{self._n:03d}"
        load = {p: 0 for p in self._procs}
        for w in self.live():
            load[w.host] += 1
        proc = min(self._procs, key=lambda p: load[p])
        w = HostedInstance(worker_id=wid, host=proc, counters_path=self.workdir / f"{wid}.counters",
                           started=time.time())
        self.workers[wid] = w
        self._send(proc, f"start {wid}")
        return w

    def live(self) -> list[HostedInstance]:
        return [w for w in self.workers.values() if w.alive()]

    def kill(self, w: HostedInstance, timeout: float = 10.0) -> float:
        """Returns when the instance has stopped (as `WorkerFleet.kill` after its `wait`)."""
        t = time.time()
        self._send(w.host, f"kill {w.worker_id}")
        w.fate = "killed"
        w.gone.wait(timeout)
        return t

    def terminate(self, w: HostedInstance) -> float:
        t = time.time()
        self._send(w.host, f"term {w.worker_id}")
        if w.fate == "running":
            w.fate = "terminated"
        return t

    def stop_all(self, timeout: float = 20.0) -> None:
        for proc in self._procs:
            self._send(proc, "quit")
        deadline = time.time() + timeout
        for proc in self._procs:
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for w in self.workers.values():
            w.gone.set()
        self._procs = []


if __name__ == "__main__":
    sys.exit(host_main())
