"""SIGTERM (a scheduler, Kubernetes, `timeout`) stops `rlboost run` as Ctrl-C does: the servers
it started and its worker processes go with it, and it exits 143. Before, the default action
killed the run alone and left its NATS and Redis servers running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlboost.trainer.model import init_model_dir
from rlboost.trainer.tasks import get_task


def _alive(pid: int) -> bool:
    try:  # a zombie has exited: its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _children(pid: int) -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.add(int(d.name))
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, sigint_ignored", [
    (signal.SIGTERM, 143, False),
    (signal.SIGTERM, 143, True),  # a background job of a script: bash starts it with SIGINT ignored
    (signal.SIGINT, 130, False),
])
def test_a_signalled_run_stops_the_servers_and_workers_it_started(tmp_path, sig, code, sigint_ignored):
    model_dir = init_model_dir(tmp_path / "model", get_task("addition"), seed=2)
    meta = model_dir / "rlboost.json"  # pretend it was warm-started: this test is about the processes
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "trained": True}))
    data, run_dir = tmp_path / "data", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBOOST_")}  # its own servers, none given
    env["OMP_NUM_THREADS"] = "1"
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "rlboost.cli", "run", "--model-dir", str(model_dir), "--run-dir",
                              str(run_dir), "--services.data_dir", str(data), "--prompts", "4", "--samples", "4",
                              "--workers", "1", "--eval-every", "100", "--steps", "200"],
                             stdout=out, stderr=out, env=env,
                             preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip():
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        servers = json.loads((data / "services.json").read_text())
        started = {servers["nats_pid"], servers["redis_pid"]} | _children(p.pid)
        assert len(started) >= 3 and all(_alive(pid) for pid in started)  # two servers and a worker at least
        p.send_signal(sig)
        assert p.wait(timeout=90) == code, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    deadline = time.monotonic() + 30  # the servers' last moments (pidfiles, AOF) may follow the exit
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in started if _alive(pid)]
    for pid in left:  # not to leak them into the rest of the suite when this fails
        os.kill(pid, signal.SIGKILL)
    assert not left, log.read_text()[-3000:]
