"""The `rlboost` command line: `bench` lists what it can run, and runs only that."""

from __future__ import annotations

import subprocess
import sys

from rlboost import cli


def _rlboost(*args: str) -> subprocess.CompletedProcess:
    """In a process of its own: the CLI configures logging globally (onto its stderr)."""
    return subprocess.run([sys.executable, "-m", "rlboost.cli", *args], capture_output=True, text=True, timeout=60)


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
