"""A fleet of real worker subprocesses that a harness can start, signal and restart.

Used by the chaos bench, the throughput bench and trace replay: each worker is
`python -m rlboost.cli worker ...` with its own id and crash-proof counters file, so what a
killed worker did can still be read after it is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlboost.workers.counters import FIELDS, read_counters


def _die_with_parent() -> None:
    """In the child, before exec: PR_SET_PDEATHSIG = SIGKILL (a no-op where prctl is missing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class WorkerProc:
    worker_id: str
    proc: subprocess.Popen
    counters_path: Path
    started: float
    fate: str = "running"  # running | killed | terminated | stopped (a zombie that was resumed) | exited
    stopped_now: bool = False
    prefix: str = "w"  # how it was started: a restart starts its replacement alike
    extra_args: tuple[str, ...] = ()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def counters(self) -> dict[str, int]:
        """Zeros if the worker died before creating its file (killed during start-up)."""
        if not self.counters_path.exists():
            return dict.fromkeys(FIELDS, 0)
        return read_counters(self.counters_path)


@dataclass
class WorkerFleet:
    nats_url: str
    redis_url: str
    workdir: Path
    pool: str
    worker_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    workers: dict[str, WorkerProc] = field(default_factory=dict)
    die_with_parent: bool = False  # Linux: the kernel SIGKILLs the workers when this process dies
    command: str = "worker"  # or "env-worker" (an environment pool: no pool of its own, every pool's lane)
    # What the interpreter runs: the CLI, or a script that wraps it (a test's worker with a
    # deliberately broken fence, tests/broken_fence_worker.py)
    launcher: tuple[str, ...] = ("-m", "rlboost.cli")
    # Put before the interpreter on the next start: e.g. `ip netns exec NS`, which execs, so the
    # process is still the worker itself (benchmarks/netns.py)
    exec_prefix: list[str] = field(default_factory=list)
    stopping: bool = False  # `stop_all` under way: its exits are not for a `Supervisor` to restart
    _n: int = 0

    def start(self, prefix: str = "w", extra_args: tuple[str, ...] = ()) -> WorkerProc:
        """`extra_args` follow `worker_args`, so a flag given in both takes this value."""
        self._n += 1
        self.stopping = False
        wid = f"{prefix}{self._n:03d}"
        self.workdir.mkdir(parents=True, exist_ok=True)
        counters = self.workdir / f"{wid}.counters"
        log = open(self.workdir / f"{wid}.log", "wb")
        env = {**os.environ, "RLBOOST_NATS_URL": self.nats_url, "RLBOOST_REDIS_URL": self.redis_url,
               "OMP_NUM_THREADS": "1", "RLBOOST_LOG_JSON": "1", **self.env}
        pool = ["--pool", self.pool] if self.command == "worker" else []
        cmd = [*self.exec_prefix, sys.executable, *self.launcher, self.command, *pool, "--worker-id", wid,
               "--counters", str(counters), *self.worker_args, *extra_args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=_die_with_parent if self.die_with_parent else None)
        log.close()
        w = WorkerProc(worker_id=wid, proc=proc, counters_path=counters, started=time.time(), prefix=prefix,
                       extra_args=tuple(extra_args))
        self.workers[wid] = w
        return w

    def live(self) -> list[WorkerProc]:
        return [w for w in self.workers.values() if w.proc.poll() is None]

    def kill(self, w: WorkerProc) -> float:
        t = time.time()
        w.proc.send_signal(signal.SIGKILL)
        w.fate = "killed"
        w.proc.wait()
        return t

    def terminate(self, w: WorkerProc) -> float:
        t = time.time()
        w.proc.send_signal(signal.SIGTERM)
        if w.fate == "running":
            w.fate = "terminated"
        return t

    def pause(self, w: WorkerProc) -> float:
        t = time.time()
        w.proc.send_signal(signal.SIGSTOP)
        w.fate, w.stopped_now = "stopped", True
        return t

    def resume(self, w: WorkerProc) -> None:
        w.proc.send_signal(signal.SIGCONT)
        w.stopped_now = False

    def stop_all(self, timeout: float = 20.0) -> None:
        self.stopping = True
        for w in self.live():
            if w.stopped_now:
                self.resume(w)
            w.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + timeout
        for w in self.workers.values():
            try:
                w.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()


class Supervisor:
    """Restarts the processes of some fleets that exit on their own (a crash, an OOM kill, a
    SIGKILL from outside): each exit is reaped and reported in one log line within `poll`'s
    period, and a replacement started alike (same prefix and arguments, a new worker id) after
    a backoff that doubles while replacements keep dying young (`base_s`, capped at `cap_s`; a
    process that lived `stable_s` resets it). Processes the fleet itself killed, terminated or
    stopped (chaos, `stop_all`) are not its business. Synchronous and non-blocking: the owner
    calls `poll()` every second or so from its loop."""

    def __init__(self, fleets: list[WorkerFleet], log, base_s: float = 0.5, cap_s: float = 30.0,
                 stable_s: float = 60.0) -> None:
        self.fleets, self.log = fleets, log
        self.base_s, self.cap_s, self.stable_s = base_s, cap_s, stable_s
        self.restarts = 0
        self._young_deaths: dict[tuple[int, str, tuple[str, ...]], int] = {}
        self._due: list[tuple[float, WorkerFleet, WorkerProc]] = []

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for fleet in self.fleets:
            for w in list(fleet.workers.values()):
                if fleet.stopping or w.fate != "running" or w.proc.poll() is None:
                    continue
                w.fate = "exited"
                slot = (id(fleet), w.prefix, w.extra_args)
                deaths = self._young_deaths.get(slot, 0) if now - w.started < self.stable_s else 0
                self._young_deaths[slot] = deaths + 1
                delay = min(self.cap_s, self.base_s * 2 ** deaths)
                code = w.proc.returncode
                self.log.warning("a supervised process exited: restarting it", worker_id=w.worker_id,
                                 command=fleet.command, pool=fleet.pool,
                                 exit=f"signal {-code}" if code < 0 else f"code {code}",
                                 lived_s=round(now - w.started, 1), restart_in_s=delay, restarts=self.restarts + 1)
                self._due.append((now + delay, fleet, w))
                self.restarts += 1
        due, self._due = [d for d in self._due if d[0] <= now], [d for d in self._due if d[0] > now]
        for _, fleet, w in due:
            if not fleet.stopping:
                fleet.start(prefix=w.prefix, extra_args=w.extra_args)

    def live(self, fleet: WorkerFleet) -> int:
        """Processes of `fleet` running now, or about to be restarted (a consumer that is coming)."""
        return len(fleet.live()) + sum(1 for _, f, _ in self._due if f is fleet)
