"""TensorBoard and W&B (offline, no network) receive every step's numbers."""

from __future__ import annotations

import pytest

from rlboost.trainer.loggers import Loggers, scalars

ROW = {"step": 3, "reward": 0.5, "loss": -0.01, "grad_norm": 0.3, "lr": 1e-4, "live_workers": 2, "t_seed": None,
       "policy": "hybrid", "fallback": False, "chaos": []}


def test_rows_become_sectioned_scalars():
    assert scalars(ROW) == {"rollout/reward": 0.5, "train/loss": -0.01, "train/grad_norm": 0.3, "train/lr": 1e-4,
                            "fleet/live_workers": 2.0}


def test_tensorboard_writes_event_files_that_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lg = Loggers(["tensorboard"], tmp_path, "rtest")
    lg.log(ROW)
    lg.log({**ROW, "step": 4, "reward": 0.75})
    lg.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward")] == [(3, 0.5), (4, 0.75)]


@pytest.mark.slow
def test_wandb_offline_run_in_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "")
    lg = Loggers(["wandb"], tmp_path, "rtest1", wandb_mode="offline", config={"trainer": {"lr": 1e-4}})
    lg.log(ROW)
    lg.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*-rtest1"))
    assert runs and list(runs[0].glob("*.wandb"))
