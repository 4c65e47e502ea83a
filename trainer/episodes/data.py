"""The rows a run's episodes start from (`rlboost run --env`): the environment's own
(`rows(split, n, seed)`: `train` for training, `test` held out) or a data file (`--data`, JSONL /
Parquet / datasets folder; held out: `--eval-data` or a seeded fraction), in seeded shuffled
passes whose position a checkpoint keeps (`rlboost.trainer.data.DataIterator`).
"""

from __future__ import annotations

import random
from typing import Any

from rlboost.config import EnvSettings
from rlboost.envs import load_env
from rlboost.trainer.data import DataError, DataIterator, read_rows

TRAIN_ROWS = 4096  # rows drawn from an environment's own generator for training (seeded passes over them)


class EpisodeData:
    """Training rows in seeded passes, and the held-out rows."""

    def __init__(self, env: Any, ref: str, train: str = "", eval_path: str = "", *, seed: int = 0,
                 shuffle: bool = True, epochs: int = 0, eval_size: int = 256, eval_fraction: float = 0.1,
                 train_rows: int = TRAIN_ROWS) -> None:
        own = getattr(env, "rows", None)
        if train:
            rows = read_rows(train)
            if eval_path:
                held = read_rows(eval_path)[:eval_size]
            else:
                order = list(range(len(rows)))
                random.Random(seed + 7919).shuffle(order)
                n = min(eval_size, int(len(rows) * eval_fraction)) if len(rows) > 1 else 0
                chosen = set(order[:n])
                held = [r for i, r in enumerate(rows) if i in chosen]
                rows = [r for i, r in enumerate(rows) if i not in chosen]
        elif callable(own):
            rows = list(own("train", train_rows, seed))
            held = list(own("test", eval_size, 0))  # the same held-out rows whatever the run's seed
        else:
            raise DataError(f"--env {ref}: the environment has no rows(split, n, seed): give its data rows with "
                            "--data (JSONL / Parquet / a datasets folder)")
        bad = next((r for r in rows + held if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataError(f"--env {ref}: a data row must be an object, got {type(bad).__name__}")
        self.iterator = DataIterator(rows, seed=seed, shuffle=shuffle, epochs=epochs)
        self._eval = held

    def next_batch(self, n: int) -> list[dict]:
        return self.iterator.next_batch(n)

    def state(self) -> dict:
        return self.iterator.state()

    def load_state(self, state: dict) -> None:
        self.iterator.load_state(state)

    def eval_samples(self) -> list[dict]:
        return self._eval


def make_episode_data(env_settings: EnvSettings, data, seed: int) -> EpisodeData:
    """A run's episode rows from `[env]` and `[data]` (`train`, `eval`, `eval_size`, ...)."""
    env = load_env(env_settings.ref, **env_settings.options)
    return EpisodeData(env, env_settings.ref, data.train, data.eval, seed=seed, shuffle=data.shuffle,
                       epochs=data.epochs, eval_size=data.eval_size, eval_fraction=data.eval_fraction)
