"""A run on episodes (`rlboost run --env`), the trainer's part: `runner` (the run's environment
runner and the `[env]` its workers get), `data` (the rows), `source` (a step's episode requests,
and the preflight that some row opens one), `scoring` (the environment's scores and a step row's
episode fields), `evaluation` (held-out success of greedy episodes), `warm_start` (the demo's
model for an environment). `rlboost.episodes` has the runner itself; `rlboost.workers.episodes`
the worker's side."""
