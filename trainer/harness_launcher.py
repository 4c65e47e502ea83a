"""The harness processes of `rlboost run --harness CMD`: one process per session, each in its own
process group, with its session in its environment, bounded in time, its output in a log file.

A harness is the user's program and is not trusted to behave: it may exit non-zero, never
report, hang, or leave children behind. Each is run by the shell (`CMD` as the user wrote it)
with stdin closed and stdout and stderr in `<run dir>/harness/<session>.log`; one that runs past
`harness.session_timeout_s` gets SIGTERM on its whole group, then SIGKILL after
`harness.kill_grace_s`; when it exits, whatever it left in its group is killed too. Nothing a
harness does fails the run from here: its outcome (`Exit`) says what happened, and the task
decides what its session is worth. While sessions run, a line every `REPORT_S` says how many
are still running (a run never waits silently).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from rlboost.logs import get_logger

REPORT_S = 30.0  # a progress line this often while sessions run
TAIL_BYTES = 1500  # of a lost session's log, quoted in its warning


@dataclass
class Launch:
    """One harness process to start: its session and its environment."""

    session: str
    env: dict[str, str]


@dataclass
class Exit:
    """How a harness process ended. `returncode` None: it could not start (`error` says why)."""

    session: str
    returncode: int | None
    timed_out: bool
    seconds: float
    log: Path
    error: str = ""

    def tail(self) -> str:
        """The end of its output, for the line that says why its session was lost."""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Launcher:
    """Runs `command` once per `Launch`, at most `concurrency` at a time (0: all at once)."""

    def __init__(self, command: str, log_dir: Path, *, concurrency: int, timeout_s: float, grace_s: float,
                 cwd: str | None = None) -> None:
        self.command, self.log_dir, self.concurrency = command, log_dir, concurrency
        self.timeout_s, self.grace_s, self.cwd = timeout_s, grace_s, cwd
        self.log = get_logger(component="harness")
        self._groups: set[int] = set()  # process groups started and not yet reaped

    async def run(self, launches: list[Launch]) -> list[Exit]:
        """Every launch run to its end (or killed at its timeout), in `launches` order."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        gate = asyncio.Semaphore(self.concurrency or max(1, len(launches)))
        tasks = [asyncio.create_task(self._one(x, gate)) for x in launches]
        try:
            t0 = time.monotonic()
            pending = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=REPORT_S)
                if pending:
                    self.log.warning("waiting for harness sessions", running=len(pending), done=len(tasks) - len(pending),
                                     seconds=round(time.monotonic() - t0), timeout_s=self.timeout_s)
            return [t.result() for t in tasks]
        finally:  # cancelled (the run stops): nothing of ours outlives it
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.kill_all()

    def kill_all(self) -> None:
        """SIGKILL to every process group still running (the run is stopping)."""
        for pid in list(self._groups):
            _kill_group(pid, signal.SIGKILL)
        self._groups.clear()

    async def _one(self, x: Launch, gate: asyncio.Semaphore) -> Exit:
        async with gate:
            log = self.log_dir / f"{x.session}.log"
            t0 = time.monotonic()
            try:
                with open(log, "wb") as out:
                    proc = await asyncio.create_subprocess_shell(
                        self.command, env=x.env, cwd=self.cwd, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            except OSError as e:  # e.g. a task row too large for the environment (E2BIG)
                return Exit(x.session, None, False, 0.0, log, error=f"{type(e).__name__}: {e}")
            self._groups.add(proc.pid)
            timed_out = False
            try:
                try:
                    await asyncio.wait_for(proc.wait(), self.timeout_s)
                except TimeoutError:
                    timed_out = True
                    _kill_group(proc.pid, signal.SIGTERM)
                    try:
                        await asyncio.wait_for(proc.wait(), self.grace_s)
                    except TimeoutError:
                        _kill_group(proc.pid, signal.SIGKILL)
                        await proc.wait()
            finally:
                _kill_group(proc.pid, signal.SIGKILL)  # what it left behind in its group
                if proc.returncode is None:  # cancelled while it ran
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                self._groups.discard(proc.pid)
            return Exit(x.session, proc.returncode, timed_out, time.monotonic() - t0, log)
