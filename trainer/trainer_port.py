"""The trainer port: the real GRPO trainer as the orchestrator's `TrainerPort`.

The orchestrator calls two things a step: `train_group` on each complete group, scored by the
run's task (`GroupScores`: the rewards, and each episode's turn rewards where there are any;
back-propagate it, the optimizer step waits for the batch) and `finish_step` (the optimizer
step, then the new weights published as the next policy version by the ledger). This adapter is
all it sees of the trainer.

Why the group index differs by mode: sync / async train a step's own groups, and the group's
index in its step keeps ordered streaming reproducible; partial mixes groups of several steps in
one batch, so there it is the group's position in the batch.
"""

from __future__ import annotations

import asyncio
import time

from rlboost import wire
from rlboost.orchestrator import GroupScores
from rlboost.weights.ledger import VersionLedger
from rlboost.trainer.grpo_trainer import GRPOTrainer


class GRPOPort:
    def __init__(self, trainer: GRPOTrainer, ops, ledger: VersionLedger, *, partial: bool) -> None:
        self.trainer, self.ops, self.ledger = trainer, ops, ledger
        self.partial = partial
        self._batch_position = 0

    def start_step(self, step: int) -> None:
        """Before the step's first group: the version it trains (token staleness is counted from it)."""
        self.trainer.start_step(step, policy_version=self.ledger.version)

    async def weights(self) -> dict:
        """The full weights in the publish dtype, gathered tensor by tensor (every rank takes part)."""
        return await asyncio.to_thread(self.ops.call, "state_dict")

    # ------------------------------------------------------------------ TrainerPort

    async def train_group(self, key: tuple[int, int], results: list[wire.RolloutResult], scores: GroupScores,
                          start: float) -> float:
        index = self._batch_position if self.partial else key[1]
        self._batch_position += 1
        await asyncio.to_thread(self.trainer.add_group, index, results, list(scores.rewards), scores.turn_rewards)
        return time.monotonic()

    async def finish_step(self, step: int):
        """The optimizer step, then the trained weights as the next version. Returns (the step's
        trainer report, the publish report)."""
        self._batch_position = 0
        rep = await asyncio.to_thread(self.trainer.finish_step)
        pub = await self.ledger.publish(self.weights)
        return rep, pub
