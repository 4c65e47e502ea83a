"""Held-out success of episodes (`rlboost run --env`): greedy episodes of the trainer's policy on
held-out rows, turn by turn in batches (`greedy_episodes`), scored by the environment.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from rlboost.episodes.runner import EpisodeRunner, Generation, Snapshot
from rlboost.orchestrator import Evaluated


GenerateBatch = Callable[[list[list[int]], int, list[int]], list[list[int]]]


async def greedy_episodes(runner: EpisodeRunner, rows: list[dict], generate: GenerateBatch,
                          prefix: str = "eval") -> list[Any]:
    """Every row's episode played to its end, the model turns of all open episodes generated in
    batches (`generate(prompts, max_new_tokens, stop_ids)` -> new ids per prompt, e.g. greedy
    decoding), tools run by the runner. Returns the runner's `EpisodeResult`s."""
    snaps = [await runner.begin(f"{prefix}-{i}", row) for i, row in enumerate(rows)]
    stops = list(runner.fmt.stop_ids)
    while True:
        open_ = [i for i, s in enumerate(snaps) if s.phase == "generate"]
        if not open_:
            break
        turns = await _turns(runner, [snaps[i] for i in open_], generate, stops)
        for i, ids in zip(open_, turns, strict=True):
            reason = "stop" if ids and ids[-1] in stops else "length"
            snaps[i] = runner.model_turn(snaps[i], Generation(token_ids=ids, logprobs=[0.0] * len(ids),
                                                              finish_reason=reason))
        for i in [i for i, s in enumerate(snaps) if s.phase == "tools"]:
            snaps[i] = await runner.run_tools(snaps[i])
    return [await runner.finish(s) for s in snaps]


async def _turns(runner: EpisodeRunner, snaps: list[Snapshot], generate: GenerateBatch,
                 stops: list[int]) -> list[list[int]]:
    """One model turn of each episode, each at most its budget, the open ones in one batch.

    A batch is left-padded to its longest context and every row of it generates the batch's
    `max_new_tokens`, also past its own budget, so a batch generated for its largest budget
    can run past the model's context (`max_episode_tokens` is no more than it, `make_runner`):
    a model with learned absolute positions (GPT-2) then fails, any other extrapolates. So a
    batch generates no further than the context, and a turn cut short of its budget by that
    goes on in the next batch (its context now longer by what it generated) until it stops or
    reaches its budget: the same turn, greedy, as one uncut generation."""
    limit = runner.settings.max_episode_tokens
    budgets = [runner.budget(s) for s in snaps]
    turns: list[list[int]] = [[] for _ in snaps]
    going = [k for k, b in enumerate(budgets) if b > 0]
    while going:
        contexts = [snaps[k].token_ids + turns[k] for k in going]
        # >= 1: a going turn has room left, and its context plus its budget fits the limit
        max_new = min(max(budgets[k] - len(turns[k]) for k in going), limit - max(map(len, contexts)))
        out = await asyncio.to_thread(generate, contexts, max_new, stops)
        over = set()
        for k, ids in zip(going, out, strict=True):
            asked = min(max_new, budgets[k] - len(turns[k]))
            ids = list(ids[:asked])
            cut = next((j + 1 for j, t in enumerate(ids) if t in stops), None)
            turns[k] += ids[:cut]
            if cut is not None or len(ids) < asked or len(turns[k]) >= budgets[k]:
                over.add(k)  # stopped, at its budget, or a `generate` that gave less than asked: no more
        going = [k for k in going if k not in over]
    return turns


class EpisodeEvaluation:
    """Held-out success: the mean reward of the policy's greedy episodes on the held-out rows
    (generated on the trainer, every rank taking part), and their mean tool calls (`last`)."""

    def __init__(self, rows: list[dict], runner: EpisodeRunner, ops, pad: int, *, run_id: str = "",
                 life: str = "") -> None:
        self.rows, self.runner, self.ops, self.pad = rows, runner, ops, pad
        self.last: dict = {}
        # Episode ids name their tool calls' idempotency keys (`<episode>/<turn>/<call>`): each
        # evaluation's are its own (run, life, round), or a tool that de-duplicates on its key
        # would answer a later evaluation's call from an earlier one's
        self.tag, self.rounds = "-".join(x for x in (run_id, life) if x), 0

    def _generate(self, prompts: list[list[int]], max_new: int, stops: list[int]) -> list[list[int]]:
        return self.ops.call("greedy", prompts, max_new, stops, self.pad)

    async def evaluate(self) -> Evaluated | None:
        if not self.rows:
            return None
        t0 = time.monotonic()
        self.rounds += 1
        prefix = f"{self.tag}-eval{self.rounds}" if self.tag else f"eval{self.rounds}"
        done = await greedy_episodes(self.runner, self.rows, self._generate, prefix=prefix)
        n = len(done)
        self.last = {"eval_success": sum(d.reward for d in done) / n,
                     "eval_tool_calls": round(sum(d.tool_calls for d in done) / n, 3),
                     "eval_s": round(time.monotonic() - t0, 1)}
        return Evaluated(self.last["eval_success"], {"eval_tool_calls": self.last["eval_tool_calls"]})
