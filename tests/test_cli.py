"""The `rlboost` command line: `bench` lists what it can run, and runs only that."""

from __future__ import annotations

import subprocess
import sys
import tempfile

from rlboost import cli


def _rlboost(*args: str) -> subprocess.CompletedProcess:
    """In a process of its own (the CLI configures logging globally, onto its stderr), run from
    outside the checkout as a user runs it: the repository's folders are not importable from
    there under their folder names, only as installed (`rlboost.benchmarks`, ...)."""
    return subprocess.run([sys.executable, "-m", "rlboost.cli", *args], capture_output=True, text=True, timeout=60,
                          cwd=tempfile.gettempdir())


def test_bench_help_lists_runnable_benchmarks():
    out = _rlboost("bench", "--help")
    assert out.returncode == 0, out.stderr
    for name in ("dataflow", "chaos", "faults", "weights"):
        assert f"  {name} " in out.stdout, out.stdout
    assert "throughput" not in out.stdout  # a helper module of benchmarks, not a benchmark


def test_bench_lists_only_modules_with_main():
    names = cli._bench_names()
    assert "dataflow" in names and "throughput" not in names


def test_bench_helper_module_is_refused_not_crashed():
    out = _rlboost("bench", "throughput")
    assert out.returncode == 2 and "unknown benchmark 'throughput'" in out.stderr, out.stderr


def test_replay_on_servers_where_nothing_ran_is_one_line(tmp_path):
    """A fresh NATS holds no rlboost stream: replay says so in one line (no NotFoundError
    traceback), exit 2; once the streams exist an empty step is an empty summary, not an error."""
    import asyncio
    import os

    from rlboost import bus
    from rlboost.config import ServicesSettings
    from rlboost.services import EmbeddedServices

    svc = EmbeddedServices(ServicesSettings(data_dir=str(tmp_path)))
    st, started = svc.up()
    assert started
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBOOST_")}
    try:
        def replay(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "rlboost.cli", "--data-dir", str(tmp_path), "replay", *args],
                                  capture_output=True, text=True, timeout=60, env=env)

        for args in (["--step", "0"], ["s00000-p00000-g000"]):
            out = replay(*args)
            assert out.returncode == 2, out.stderr
            assert out.stderr.strip().splitlines() == [
                f"rlboost: error: no rlboost streams on {svc.nats_url(st)}: nothing has run here (is this the "
                "servers' URL? RLBOOST_NATS_URL, or the data dir of `rlboost up`)"], out.stderr

        async def provision() -> None:
            nc = await bus.connect(svc.nats_url(st))
            await bus.provision(nc.jetstream())
            await nc.drain()

        asyncio.run(provision())
        out = replay("--step", "0")
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "step 0: 0 requests seen, 0 finished, 0 hand-offs"
    finally:
        svc.stop_recorded()
