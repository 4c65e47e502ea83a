"""Real partitions on this box (benchmarks/netns.py): network namespaces joined by veth pairs,
whose links go down and up on demand, and which are gone again when the test is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from rlboost.benchmarks import netns

WHY = netns.unavailable()
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")


def ours(pid: int | None = None) -> list[str]:
    return [n for n in netns.namespaces() if n.startswith(f"rb-{pid or os.getpid()}-")]


def gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent was killed, and pid 1 of a container may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def reach(t: netns.Topology, frm: str, addr: str, port: int) -> str:
    """From namespace `frm`, connect to addr:port: 'ok' or the error's name."""
    code = (f"import socket\ntry:\n socket.create_connection(({addr!r}, {port}), timeout=2); print('ok')\n"
            f"except OSError as e:\n print(type(e).__name__, e.errno)")
    return subprocess.run([*t.prefix(frm), sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_without_root_the_reason_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in netns.unavailable()


@needs_netns
def test_a_cut_link_partitions_exactly_its_pair_and_restore_heals_it(tmp_path):
    with netns.Topology() as t:
        for name in ("srv", "a", "b"):
            t.add(name)
        to_a, to_b = t.link("a", "srv"), t.link("b", "srv")
        # one listener on every address of srv's namespace
        srv = t.spawn("srv", [sys.executable, "-m", "http.server", "--bind", "0.0.0.0", "18080"], tmp_path / "srv.log")
        for _ in range(200):  # until it listens
            if reach(t, "a", to_a.addr_b, 18080) == "ok":
                break
        assert reach(t, "a", to_a.addr_b, 18080) == reach(t, "b", to_b.addr_b, 18080) == "ok"
        assert reach(t, "a", to_b.addr_b, 18080) != "ok", "a reached srv over b's link: not a point-to-point pair"

        to_a.cut()
        assert not to_a.carrier()
        assert reach(t, "a", to_a.addr_b, 18080) == "OSError 101"  # ENETUNREACH: the route went with the link
        assert reach(t, "b", to_b.addr_b, 18080) == "ok"  # the other pair is untouched
        to_a.restore()
        assert to_a.carrier() and reach(t, "a", to_a.addr_b, 18080) == "ok"
        names = list(t.names.values())
    assert srv.poll() is not None, "a process the topology started outlived it"
    assert not set(names) & set(netns.namespaces())
    assert f"rb{os.getpid():x}-" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


@needs_netns
def test_a_dead_runs_namespaces_and_processes_are_cleaned_up_by_the_next(tmp_path):
    """A bench SIGKILLed mid-run leaves its namespaces (and what runs in them): the next
    `Topology` removes those of runs whose pid is gone, and only those."""
    code = ("import sys, time; from rlboost.benchmarks import netns; t = netns.Topology(); t.add('x'); "
            f"p = t.spawn('x', ['sleep', '600'], __import__('pathlib').Path({str(tmp_path / 'x.log')!r})); "
            "print(p.pid, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        sleeper = int(child.stdout.readline())  # its namespace is up and the sleeper runs in it
        assert len(ours(child.pid)) == 1
    finally:
        child.send_signal(signal.SIGKILL)  # no atexit, no close(): a crash
        child.wait()
    with netns.Topology() as t:  # cleans up on the way in
        t.add("mine")
        assert ours(child.pid) == []
        assert len(ours()) == 1
        assert gone(sleeper)
    assert ours() == []
