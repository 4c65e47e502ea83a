"""The scorer of single-turn prompts: the user's reward for a group of results, and for the
held-out set's greedy answers (the episodes' is `rlboost.trainer.episodes.scoring.EpisodeScorer`, the same shape).

It owns the reward function's process pool (`rlboost.trainer.rewards.RewardPool`: a slow or crashing
reward never blocks or kills the trainer) and turns token ids back into the text a reward
function reads (`Item`: prompt, response, ground truth, finish reason). A result no engine could
serve (`finish_reason == "error"`) scores 0 without a call: there is no response to judge.
Errors and timeouts are counted for the run (`errors`, `timeouts`) and per step (`step_errors`,
`step_timeouts`, set back to 0 at a step's start: `begin_step`).
"""

from __future__ import annotations

from rlboost import wire
from rlboost.orchestrator import GroupScores
from rlboost.trainer.data import Sample
from rlboost.trainer.model import decode_response
from rlboost.trainer.rewards import Item, RewardPool


class Scorer:
    def __init__(self, reward_spec: str, tokenizer, stops: list[int], *, workers: int, timeout_s: float) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.pool = RewardPool(reward_spec, workers=workers, timeout_s=timeout_s)
        self.step_errors = self.step_timeouts = 0

    @property
    def errors(self) -> int:
        return self.pool.errors

    @property
    def timeouts(self) -> int:
        return self.pool.timeouts

    def _item(self, sample: Sample, token_ids: list[int], finish_reason: str) -> Item:
        return Item(prompt=sample.prompt_for_reward(), response=decode_response(self.tokenizer, token_ids, self.stops),
                    ground_truth=sample.ground_truth, data_source=sample.data_source, finish_reason=finish_reason,
                    extra=sample.extra, chat=sample.messages is not None)

    def begin_step(self) -> None:
        self.step_errors = self.step_timeouts = 0

    async def group(self, sample: Sample, results: list[wire.RolloutResult]) -> GroupScores:
        """Rewards of one group (every result answers `sample`), in `results` order."""
        ok = [i for i, r in enumerate(results) if r.finish_reason != "error"]
        rewards = [0.0] * len(results)
        items = [self._item(sample, results[i].token_ids, results[i].finish_reason) for i in ok]
        scored = await self.pool.ascore(items, [results[i].request_id for i in ok])
        for i, v in zip(ok, scored.values, strict=True):
            rewards[i] = v
        self.step_errors += scored.errors
        self.step_timeouts += scored.timeouts
        return GroupScores(rewards)

    def step_fields(self, trained: list) -> dict:
        """More fields of a step's row, of the groups it trained: none for single-turn prompts."""
        return {}

    async def greedy(self, samples: list[Sample], rows: list[list[int]]) -> list[float]:
        """Rewards of greedy responses (`rows`, one per sample; held-out evaluation)."""
        items = [self._item(smp, row, "stop" if any(t in self.stops for t in row) else "length")
                 for smp, row in zip(samples, rows, strict=True)]
        scored = await self.pool.ascore(items, [f"eval-{smp.index}" for smp in samples])
        return scored.values

    def close(self) -> None:
        self.pool.close()
