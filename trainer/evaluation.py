"""Held-out evaluation of single-turn prompts: the mean reward of the trainer's greedy responses
on the eval set (the episodes' is `rlboost.trainer.episodes.evaluation.EpisodeEvaluation`, the same shape).

The eval set is the data's held-out samples whose prompts fit the token budget (a prompt over
it could not be answered within the context). Generation runs on the trainer itself, every rank
taking part (`distributed.Lockstep`), in a thread so the event loop keeps collecting results.
"""

from __future__ import annotations

import asyncio

from rlboost.orchestrator import Evaluated
from rlboost.trainer.data import PromptBudget, Sample, encode_prompt
from rlboost.trainer.scoring import Scorer


class Evaluation:
    def __init__(self, samples: list[Sample], tokenizer, budget: PromptBudget, stops: list[int], pad: int,
                 ops, scorer: Scorer) -> None:
        self.eval_set = [(smp, ids) for smp in samples if len(ids := encode_prompt(tokenizer, smp)) <= budget.limit]
        self.max_response_tokens, self.stops, self.pad = budget.max_response_tokens, stops, pad
        self.ops, self.scorer = ops, scorer

    async def evaluate(self) -> Evaluated | None:
        """Mean reward of greedy responses on the held-out set (None: there is none)."""
        if not self.eval_set:
            return None
        rows = await asyncio.to_thread(self.ops.call, "greedy", [ids for _, ids in self.eval_set],
                                       self.max_response_tokens, self.stops, self.pad)
        values = await self.scorer.greedy([smp for smp, _ in self.eval_set], rows)
        return Evaluated(sum(values) / len(values))
