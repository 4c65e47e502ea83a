"""`rlboost bench agent` end to end on its own servers: every arm (held, parked, the environment
pool) finishes every episode solved, no tool call runs twice, and the figures it reports are there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_agent_runs_every_arm_and_every_episode_is_solved(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "--data-dir", str(tmp_path / "data"), "bench", "agent",
                        "--episodes", "8", "--slots", "4", "--tool-median", "0.05"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for arm in ("held", "parked", "pool"):
        assert out[arm]["finished"] == out[arm]["solved"] == 8 and out[arm]["tool_calls_run_twice"] == 0
        assert out[arm]["tool_calls"] >= 8 and 0 < out[arm]["slot_use"] <= 8 / 4  # the batch may run over its slots
        assert out[arm]["engine_step_s"] > 0
    assert out["parked_speedup"] > 0 and out["pool_speedup"] > 0


@pytest.mark.slow
def test_bench_agent_gives_each_other_way_in_a_row_with_what_a_kill_costs(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "--data-dir", str(tmp_path / "data"), "bench", "agent",
                        "--episodes", "8", "--slots", "4", "--tool-median", "0.05", "--arms", "parked",
                        "--paths", "openenv,harness"], capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    openenv, harness = out["paths"]["openenv"], out["paths"]["harness"]
    assert openenv["ok"] and openenv["kill"]["episodes_lost"] == 0 and openenv["kill"]["sessions_lost"] >= 1
    assert harness["ok"] and harness["kill"]["sessions_lost"] == 1 and harness["episodes_per_s"] > 0
    assert "a kill costs" in p.stdout


def test_bench_agent_refuses_a_path_it_does_not_know(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "bench", "agent", "--paths", "gym"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--paths: choose from verifiers, openenv, harness" in p.stderr, p.stderr[-2000:]
