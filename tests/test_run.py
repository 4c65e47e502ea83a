"""`rlboost run` end to end on a tiny model: real trainer, real worker processes, real hand-offs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlboost.trainer.model import init_model_dir
from rlboost.trainer.tasks import get_task


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = init_model_dir(tmp_path_factory.mktemp("m") / "model", get_task("addition"), seed=2)
    meta = d / "rlboost.json"  # pretend it was warm-started: this test is about the dataflow
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "trained": True}) if meta.exists()
                    else json.dumps({"trained": True}))
    return d


def _run(services, tmp_path, model_dir, *args: str) -> tuple[dict, list[dict]]:
    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "run.log"  # stderr in a file: a run past the timeout still shows where it stood
    with open(log, "w") as err:
        try:
            p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--model-dir", str(model_dir), "--run-dir",
                                str(run_dir), "--prompts", "4", "--samples", "4", "--eval-every", "100", *args],
                               stdout=subprocess.PIPE, stderr=err, text=True, env=env, timeout=270)
        except subprocess.TimeoutExpired:
            pytest.fail("rlboost run took over 270 s:\n" + log.read_text()[-4000:])
    assert p.returncode == 0, log.read_text()[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert (run_dir / "curves.png").stat().st_size > 0
    return out, rows


@pytest.mark.slow
def test_hybrid_hands_off_at_the_end_of_the_seeding_window(services, tmp_path, model_dir):
    out, rows = _run(services, tmp_path, model_dir, "--policy", "hybrid", "--steps", "2", "--workers", "1",
                     "--t-seed", "0.5", "--t-seed-floor", "0.5", "--slots", "8", "--prompts", "16",
                     "--samples", "8")
    assert out["steps"] == 2 and len(rows) == 2
    assert out["handoffs"] > 0  # the reserved engine drained with responses in flight
    assert all(r["live_workers"] == 1 for r in rows)
    # the fleet policy's target in each row (`[fleet] policy = "all"`: one more than live, nothing capped)
    assert [(r["fleet_desired"], r["fleet_reason"]) for r in rows] == [(2, "all: 2 available")] * 2


@pytest.mark.slow
def test_with_no_preemptible_worker_the_run_completes_colocated(services, tmp_path, model_dir):
    out, rows = _run(services, tmp_path, model_dir, "--policy", "hybrid", "--steps", "1", "--workers", "0",
                     "--algorithm.off_policy", "tis")
    assert out["steps"] == 1 and rows[0]["live_workers"] == 0 and rows[0]["t_seed"] is None
    # sync rollout: every token sampled by the trained version; the engine's mu is the trainer's pi_old
    # up to kernel rounding (a ratio off by a position or a temperature would be far from 1)
    assert rows[0]["off_policy"] == "tis" and rows[0]["staleness_mean"] == 0 and rows[0]["staleness_max"] == 0
    assert abs(rows[0]["is_ratio_mean"] - 1) < 0.01 and rows[0]["is_capped"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["partial", "async"])
def test_rollout_modes_train_with_the_real_trainer(services, tmp_path, model_dir, mode):
    """`rlboost run --mode partial|async`: steps complete with a real trainer and torch workers,
    every result's segments name versions this run published, within the bound in async."""
    out, rows = _run(services, tmp_path, model_dir, "--policy", "hybrid", "--steps", "3", "--workers", "1",
                     "--mode", mode, "--max-staleness", "1", "--prompts", "4", "--samples", "4",
                     "--algorithm.off_policy", "tis")
    assert out["steps"] == 3 and len(rows) == 3
    assert all(r["mode"] == mode and r["prompts"] == 4 and r["off_policy"] == "tis" for r in rows)
    if mode == "async":  # per trained token (the trainer's count): steps published ahead, one version behind
        assert max(r["staleness_max"] for r in rows) == 1
