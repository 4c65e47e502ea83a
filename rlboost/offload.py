"""The adaptive seeding window: how long the reserved cluster generates before handing off.

At the start of a step every engine, reserved ones included, generates. After `T_seed` the
reserved engines hand their unfinished responses to the preemptible pool and switch to
training on the completed ones. If the trainer then sat idle waiting for the pool, the window
was too short (the reserved side should have generated longer); if the pool sat idle waiting
for the trainer, it was too long. The published rule moves T_seed by a third of the difference:

    T_seed += (t_trainer_waiting - t_preemptible_waiting) / 3,   T_seed >= floor

and remembers, per number of live preemptible workers, an EMA of the T_seed that worked, so
that when the fleet shrinks or grows the window jumps to what suited that fleet size before.
With no live preemptible worker there is no one to hand off to: the window is infinite and
the step runs colocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SeedWindow:
    initial_s: float = 10.0
    floor_s: float = 5.0
    ema: float = 0.5  # weight of the newest value in the per-fleet-size memory
    ceiling_s: float = math.inf
    t_seed: float = field(init=False)
    memory: dict[int, float] = field(default_factory=dict)
    _workers: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.t_seed = max(self.floor_s, self.initial_s)

    def window(self, live_workers: int) -> float:
        """T_seed for a step about to start with `live_workers` preemptible workers."""
        if live_workers <= 0:
            return math.inf
        if live_workers != self._workers:
            if live_workers in self.memory:
                self.t_seed = self.memory[live_workers]
            elif self.memory:  # never seen this size: start from the nearest one we know
                nearest = min(self.memory, key=lambda n: abs(n - live_workers))
                self.t_seed = self.memory[nearest]
            self._workers = live_workers
        return self.t_seed

    def update(self, live_workers: int, trainer_waiting_s: float, preemptible_waiting_s: float) -> float:
        """After a step: apply the rule and remember the result for this fleet size."""
        if live_workers <= 0:
            return self.t_seed
        self.t_seed = min(self.ceiling_s, max(self.floor_s, self.t_seed + (trainer_waiting_s - preemptible_waiting_s) / 3))
        old = self.memory.get(live_workers)
        self.memory[live_workers] = self.t_seed if old is None else (1 - self.ema) * old + self.ema * self.t_seed
        self._workers = live_workers
        return self.t_seed

    def state(self) -> dict:
        """What a checkpoint keeps (JSON: the memory's fleet sizes as strings)."""
        return {"t_seed": self.t_seed, "memory": {str(k): v for k, v in self.memory.items()}, "workers": self._workers}

    def load_state(self, state: dict) -> None:
        self.t_seed = state["t_seed"]
        self.memory = {int(k): v for k, v in state["memory"].items()}
        self._workers = state["workers"]
