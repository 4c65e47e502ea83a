"""Experiment tracking beside metrics.jsonl: TensorBoard and Weights & Biases, per step.

`[run] loggers = ["tensorboard", "wandb"]`. TensorBoard event files go to `<run_dir>/tensorboard`;
W&B runs offline by default (`[run] wandb_mode`), into `<run_dir>/wandb`, needing no network
or account (`wandb sync <run_dir>/wandb/offline-run-*` uploads later). Both log every numeric
field of a step's row under `train/`, `rollout/`, `fleet/` or `episode/`, at the step number
(an environment's own metrics keep their `env/` names; why episodes ended, `episode_ends`, as
`episode/ends/<reason>`); a resumed run continues the same W&B run (its id is the run id) and
appends to the same event folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# where a row's field is shown: the rest of the numeric fields land in "misc/"
SECTIONS = {
    "train": ("loss", "kl", "entropy", "grad_norm", "clip_fraction", "ratio_mean", "lr", "trained_tokens_per_s",
              "train_s", "tokens", "is_ratio_mean", "is_ratio_max", "is_capped", "staleness_mean", "staleness_max"),
    "rollout": ("reward", "reward_std", "eval_acc", "mean_response_tokens", "max_response_tokens",
                "truncation_rate", "tokens_per_s", "step_s", "regenerated_tokens"),
    "fleet": ("live_workers", "fleet_desired", "t_seed", "handoffs", "trainer_wait_s", "spot_idle_s", "rollout_ahead_s",
              "dollars"),
    # a run on episodes (trainer/episodes/scoring.py `EpisodeStats.row`)
    "episode": ("episodes", "tool_calls_mean", "turns_mean", "episode_success", "tool_errors_mean",
                "tool_timeouts_mean", "env_errors_mean", "eval_tool_calls"),
}
_WHERE = {k: s for s, keys in SECTIONS.items() for k in keys}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalars(row: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if k == "episode_ends" and isinstance(v, dict):  # a count per reason: one curve each
            out.update({f"episode/ends/{reason}": float(n) for reason, n in v.items() if _number(n)})
        if not _number(v) or k == "step":
            continue
        # a name with its own section (`env/<metric>`, an environment's) keeps it
        out[k if "/" in k else f"{_WHERE.get(k, 'misc')}/{k}"] = float(v)
    return out


class TensorBoardLogger:
    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run_dir: Path, run_id: str, project: str, mode: str, config: dict[str, Any]) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.run = wandb.init(project=project, id=run_id, name=run_id, dir=str(run_dir), mode=mode, config=config,
                              resume="allow", reinit="finish_previous")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Loggers:
    """Fan-out to the configured loggers; none configured = nothing to do."""

    def __init__(self, names: list[str], run_dir: Path, run_id: str, project: str = "rlboost",
                 wandb_mode: str = "offline", config: dict[str, Any] | None = None) -> None:
        self.sinks: list[Any] = []
        for name in names:
            if name == "tensorboard":
                self.sinks.append(TensorBoardLogger(run_dir))
            elif name == "wandb":
                self.sinks.append(WandbLogger(run_dir, run_id, project, wandb_mode, config or {}))
            else:
                raise ValueError(f"unknown logger {name!r}")

    def log(self, row: dict[str, Any]) -> None:
        values = scalars(row)
        for sink in self.sinks:
            sink.log(int(row["step"]), values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
