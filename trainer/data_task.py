"""A run's task: what its steps consume (the orchestrator's `RolloutTask`), made of three parts.

- a request source (`rlboost.trainer.request_source`): data rows -> a step's requests, their ids, seeds
  and the data position a checkpoint keeps;
- a scorer: a complete group's `GroupScores` (single-turn prompts: the user's reward in a
  process pool, `rlboost.trainer.scoring`; episodes: the environment on the trainer,
  `rlboost.trainer.episodes.scoring`);
- a held-out evaluation (`rlboost.trainer.evaluation`, `rlboost.trainer.episodes.evaluation`).

Single-turn prompts (`prompt_task`), episodes (`episode_task`) and an agent harness's sessions
(`harness_task`, `rlboost.trainer.harness_task`) are the same task with other parts, so the step
(`rlboost.trainer.run.step`) never asks which; `make_task` picks them from the settings
(`[harness] command`: a harness's sessions; `[env] ref`: episodes).
"""

from __future__ import annotations

from typing import Any, Protocol

from rlboost import wire
from rlboost.config import DataSettings, Settings
from rlboost.orchestrator import Evaluated, GroupKey, GroupScores
from rlboost.trainer.data import DataError, FieldMap, FileData, GeneratedData, PromptBudget
from rlboost.trainer.episodes.data import make_episode_data
from rlboost.trainer.episodes.evaluation import EpisodeEvaluation
from rlboost.trainer.episodes.runner import episode_runner
from rlboost.trainer.episodes.scoring import EpisodeScorer
from rlboost.trainer.episodes.source import EpisodeSource
from rlboost.trainer.evaluation import Evaluation
from rlboost.trainer.harness_task import harness_parts, harness_rows
from rlboost.trainer.model import pad_id
from rlboost.trainer.request_source import PromptSource, RequestSource
from rlboost.trainer.rewards import RewardError
from rlboost.trainer.scoring import Scorer
from rlboost.trainer.tasks import TASKS, get_task


class GroupScorer(Protocol):
    """A task's scorer: a group's scores from the row it answers, and its counts (errors and
    timeouts of the reward, run totals and this step's, from `begin_step` on)."""

    errors: int
    timeouts: int
    step_errors: int
    step_timeouts: int

    async def group(self, row: Any, results: list[wire.RolloutResult]) -> GroupScores: ...

    def begin_step(self) -> None: ...

    def step_fields(self, trained: list[tuple[GroupKey, list[wire.RolloutResult]]]) -> dict:
        """A step row's fields of its own, of the groups the step trained."""

    def close(self) -> None: ...


class HeldOut(Protocol):
    async def evaluate(self) -> Evaluated | None: ...


class DataTask:
    """Data rows drawn into requests, scored and evaluated (see the module doc)."""

    def __init__(self, source: RequestSource, scorer: GroupScorer, evaluation: HeldOut) -> None:
        self.source, self.scorer, self.evaluation = source, scorer, evaluation

    # ------------------------------------------------------------------ RolloutTask

    async def requests(self, step: int, version: int, groups: int) -> list[wire.RolloutRequest]:
        return await self.source.requests(step, version, groups)

    async def score(self, key: GroupKey, results: list[wire.RolloutResult]) -> GroupScores:
        scores = await self.scorer.group(self.source.sample(key), results)
        self.source.scored(key)
        return scores

    async def evaluate(self) -> Evaluated | None:
        return await self.evaluation.evaluate()

    # ------------------------------------------------------------------ a step's row, the run's totals

    def begin_step(self) -> None:
        """A step starts: its counts (rows dropped, reward errors and timeouts) from 0."""
        self.source.step_filtered = 0
        self.scorer.begin_step()

    def step_counts(self) -> dict:
        """This step's counts, as `StepMetrics.row` takes them."""
        return {"filtered": self.source.step_filtered, "reward_errors": self.scorer.step_errors,
                "reward_timeouts": self.scorer.step_timeouts, "data_state": self.source.data.state()}

    def step_fields(self, trained: list[tuple[GroupKey, list[wire.RolloutResult]]]) -> dict:
        """The step row's fields of this task's own (episodes: tool calls, turns, success, ends)."""
        return self.scorer.step_fields(trained)

    def close(self) -> None:
        self.scorer.close()


def prompt_task(s: Settings, data, reward_spec: str, task_tokens: int, tokenizer, stops: list[int], context: int,
                ops, *, run_id: str, life: str) -> DataTask:
    """Single-turn prompts: the user's data within the model's token budget, the user's reward
    (`[data] reward`), held-out accuracy of greedy answers (generated on the trainer, `ops`)."""
    ds, ro = s.data, s.rollout
    budget = PromptBudget.for_model(ds.max_prompt_tokens, ds.max_response_tokens, context, task_tokens)
    scorer = Scorer(reward_spec, tokenizer, stops, workers=ds.reward_workers, timeout_s=ds.reward_timeout_s)
    return DataTask(PromptSource(data, tokenizer, budget, stops, run_id=run_id, seed=s.run.seed, samples=ro.samples,
                                 temperature=ro.temperature, life=life),
                    scorer,
                    Evaluation(data.eval_samples(), tokenizer, budget, stops, pad_id(tokenizer, stops), ops, scorer))


def episode_task(s: Settings, data, tokenizer, stops: list[int], context: int, ops, *, run_id: str,
                 life: str) -> DataTask:
    """Episodes of the run's environment (`[env]`): a row's episodes, scored by the environment on
    the trainer, held-out success of greedy episodes."""
    runner = episode_runner(s, tokenizer, context, run_id)
    ro = s.rollout
    return DataTask(EpisodeSource(data, runner, run_id=run_id, seed=s.run.seed, samples=ro.samples,
                                  temperature=ro.temperature, life=life),
                    EpisodeScorer(runner),
                    EpisodeEvaluation(data.eval_samples(), runner, ops, pad_id(tokenizer, stops), run_id=run_id,
                                      life=life))


def harness_task(s: Settings, data, tokenizer, stops: list[int], context: int, *, clients, run_dir, pool: str,
                 run_id: str, life: str) -> DataTask:
    """Sessions of the user's agent harness (`[harness] command`) through the run's endpoint:
    the requests are the calls of a step's sessions, each scored with its session's reward,
    held-out the mean reward of greedy sessions (`rlboost.trainer.harness_task`)."""
    return DataTask(*harness_parts(s, data, tokenizer, stops, context, clients=clients, run_dir=run_dir, pool=pool,
                                   run_id=run_id, life=life))


def make_task(s: Settings, prepared: tuple | None, tokenizer, stops: list[int], context: int, ops, *, run_id: str,
              life: str, clients=None, run_dir=None, pool: str = "spot") -> DataTask:
    """The run's task from its settings: a harness's sessions where `[harness] command` names one,
    episodes where `[env] ref` names an environment, else single-turn prompts. `prepared`:
    `read_data`'s answer if a preflight read it already (it is not read twice). `clients`,
    `run_dir`, `pool`: the run's servers, folder and preemptible pool (a harness's endpoint
    publishes there and records its sessions here)."""
    data, reward_spec, task_tokens = prepared or read_data(s)
    if s.harness.command:
        if clients is None or run_dir is None:
            raise DataError("--harness needs the run's servers and folder (make_task's clients and run_dir)")
        return harness_task(s, data, tokenizer, stops, context, clients=clients, run_dir=run_dir, pool=pool,
                            run_id=run_id, life=life)
    if s.env.ref:
        return episode_task(s, data, tokenizer, stops, context, ops, run_id=run_id, life=life)
    return prompt_task(s, data, reward_spec, task_tokens, tokenizer, stops, context, ops, run_id=run_id, life=life)


def read_data(s: Settings) -> tuple:
    """(rows, reward spec, the task's response budget) of the run's task: a harness's or an
    environment's rows (no reward function: the harness reports it, the environment scores), or
    `make_data`'s."""
    if s.harness.command:
        return harness_rows(s), "", 0
    if s.env.ref:
        return make_episode_data(s.env, s.data, s.run.seed), "", 0
    return make_data(s.data, s.run.seed)


def make_data(ds: DataSettings, seed: int) -> tuple[GeneratedData | FileData, str, int]:
    """(prompt source, reward spec, the task's response budget: 0 = none, the model's context
    decides, `PromptBudget.for_model`) from the task / data / reward settings."""
    task = ds.task or ("addition" if not ds.train else "")
    if task and task not in TASKS and task != "math":
        raise DataError(f"unknown task {task!r}; built in: addition, math")
    if not ds.train:
        if task != "addition":
            raise DataError(f"the {task} task needs --data (a JSONL/Parquet file or a datasets folder)")
        generator = get_task("addition")
        return (GeneratedData(generator, seed=seed), ds.reward or "addition",
                generator.max_response_chars + 1)  # + EOS: never truncates an answer
    reward = ds.reward or task
    if not reward:
        raise RewardError("--data needs a reward: --reward module:fn or path/to/file.py:fn (or --task math)")
    fields = FieldMap(prompt=ds.prompt_key, messages=ds.messages_key, ground_truth=ds.ground_truth_key,
                      data_source=ds.data_source_key)
    data = FileData(ds.train, ds.eval, fields, seed=seed, shuffle=ds.shuffle, epochs=ds.epochs,
                    eval_size=ds.eval_size, eval_fraction=ds.eval_fraction)
    return data, reward, 0
