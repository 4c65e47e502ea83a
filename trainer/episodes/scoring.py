"""Episodes' scores (`rlboost run --env`): a finished episode -> its reward and training sample,
and a step row's episode fields.

The reward is computed **here, on the trainer**, by the environment loaded from `[env] ref`
(`EpisodeRunner.finish` on the final snapshot the result carries, `rlboost.episodes.snapshot`),
never taken from a score a worker recorded: rollout workers are preemptible capacity the
trainer does not trust with its reward (a worker's tokens, provenance and episode state are
checked against the fenced checkpoint by the manager; a score is not part of that), and the
single-turn reward is the trainer's too. An episode's result gives the training sample as any
result does (`grpo_trainer.sample_of`): the prompt is the opening, the response everything after
it (model and environment tokens), the environment tokens masked out of the loss
(`wire.trainable_mask`), per-token behaviour logprobs and versions from the segments
(`training_episode` shows it in one place).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rlboost import episodes, wire
from rlboost.episodes.runner import EpisodeRunner, Snapshot
from rlboost.logs import get_logger
from rlboost.orchestrator import GroupScores

log = get_logger(component="episodes")


@dataclass
class TrainingEpisode:
    """A finished episode as the trainer trains it: the opening, everything after it (model and
    environment tokens), which of those the loss trains, their behaviour logprobs and policy
    versions, and the environment's reward."""

    prompt_ids: list[int]
    response_ids: list[int]
    mask: list[bool]
    logprobs: list[float]
    versions: list[int]
    reward: float
    turn_rewards: list[float] | None
    metrics: dict[str, float]
    end_reason: str
    turns: int
    tool_calls: int


async def training_episode(runner: EpisodeRunner, result: wire.RolloutResult) -> TrainingEpisode:
    """`result` (an episode's) scored by the runner's environment on its final snapshot. An
    `error` result, or one without a finished episode, scores 0 (`metrics["unscored"]`)."""
    n = len(result.token_ids)
    base = dict(prompt_ids=list(result.prompt_ids), response_ids=list(result.token_ids),
                mask=wire.trainable_mask(result.segments, n), logprobs=list(result.logprobs),
                versions=wire.token_versions(result.segments, n))
    snap: Snapshot | None = None
    if result.finish_reason != "error" and result.episode is not None:
        try:
            snap = episodes.snapshot(result.episode)
        except episodes.EpisodeStateError as e:
            log.warning("episode state unreadable: reward 0", request_id=result.request_id, error=str(e))
    if snap is None or snap.phase != "done":
        return TrainingEpisode(**base, reward=0.0, turn_rewards=None, metrics={"unscored": 1.0},
                               end_reason=result.error or "unfinished", turns=0, tool_calls=0)
    snap.score = None  # the trainer's own verdict: never a score a worker wrote
    done = await runner.finish(snap)
    return TrainingEpisode(**base, reward=float(done.reward), turn_rewards=done.turn_rewards, metrics=done.metrics,
                           end_reason=done.end_reason, turns=done.turns, tool_calls=done.tool_calls)


# the runner's counts in an episode's metrics (`EpisodeRunner.result`) that a step row shows as
# `<name>_mean` beside `tool_calls_mean`; `turns` and `tool_calls` have their own fields, and
# `score_error` is counted by `reward_errors`. Every other key is the environment's own
# (`Score.metrics`), shown as `env/<name>` so that no name of an environment's can shadow a field of ours.
RUNNER_METRICS = ("tool_errors", "tool_timeouts", "env_errors")
NOT_SHOWN = ("turns", "tool_calls", "score_error", "unscored")


def tally(e: TrainingEpisode) -> tuple[int, int, float, int, str, dict[str, float]]:
    """What a step row keeps of an episode (not its tokens): tool calls, turns, reward, whether
    it went unscored, why it ended, and its metrics as the row names them (`RUNNER_METRICS`)."""
    shown = {(f"{k}_mean" if k in RUNNER_METRICS else f"env/{k}"): float(v) for k, v in e.metrics.items()
             if k not in NOT_SHOWN and math.isfinite(v)}  # a NaN would make metrics.jsonl invalid JSON
    return e.tool_calls, e.turns, e.reward, int(e.metrics.get("unscored", 0)), e.end_reason, shown


@dataclass
class EpisodeStats:
    """Episodes' tool calls, turns, rewards, ends and metrics, summed (a step row's episode
    fields: the episodes it trained)."""

    episodes: int = 0
    tool_calls: int = 0
    turns: int = 0
    reward: float = 0.0
    unscored: int = 0
    ends: dict[str, int] = field(default_factory=dict)
    # each metric's sum and how many episodes reported it: an environment's metric is averaged
    # over the episodes that have it (an `env_error` episode is not scored and has none of them)
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def add(self, t: tuple[int, int, float, int, str, dict[str, float]]) -> None:
        """One episode's `tally`."""
        tool_calls, turns, reward, unscored, end, metrics = t
        self.episodes += 1
        self.tool_calls += tool_calls
        self.turns += turns
        self.reward += reward
        self.unscored += unscored
        self.ends[end] = self.ends.get(end, 0) + 1
        for k, v in metrics.items():
            acc = self.metrics.setdefault(k, [0.0, 0])
            acc[0] += v
            acc[1] += 1

    def row(self) -> dict:
        n = max(1, self.episodes)
        return {"episodes": self.episodes, "tool_calls_mean": round(self.tool_calls / n, 3),
                "turns_mean": round(self.turns / n, 3), "episode_success": round(self.reward / n, 4),
                "episode_ends": dict(sorted(self.ends.items())),
                # the runner's counts are over every episode, as `tool_calls_mean` is, and in every row
                **{f"{k}_mean": round(self.metrics.get(f"{k}_mean", (0.0, 0))[0] / n, 4) for k in RUNNER_METRICS},
                **{k: round(total / count, 4) for k, (total, count) in sorted(self.metrics.items())
                   if k.startswith("env/")}}


# scored episodes waiting for the step that trains them: a group scored and then never trained
# (dropped as too stale) must not hold its episode for the rest of the run
SCORED_KEPT = 65536


class EpisodeScorer:
    """A group's rewards from the environment (see the module doc: the trainer scores)."""

    def __init__(self, runner: EpisodeRunner) -> None:
        self.runner = runner
        self.step_errors = self.step_timeouts = 0
        self.errors = self.timeouts = 0  # score errors, run total (the environment's `score_error` metric)
        self.total = EpisodeStats()
        self._scored: dict[str, tuple] = {}  # `tally` by request id, until a step trains it

    def trained(self, groups: list[tuple[Any, list[wire.RolloutResult]]]) -> EpisodeStats:
        """The episode fields of a step's row: the episodes it trained. In async and partial
        modes a group is scored while an earlier step trains, so the episodes scored during a
        step are not the ones it trains (a step's row said 64 episodes, the next 0)."""
        stats = EpisodeStats()
        for _, results in groups:
            for r in results:
                t = self._scored.pop(r.request_id, None)
                if t is not None:
                    stats.add(t)
        return stats

    async def group(self, row: dict, results: list[wire.RolloutResult]) -> GroupScores:
        """The group's rewards (every result an episode started from `row`), and each episode's
        turn rewards where its environment gives them."""
        scored = [await training_episode(self.runner, r) for r in results]
        for r, e in zip(results, scored, strict=True):
            t = self._scored[r.request_id] = tally(e)
            self.total.add(t)
        while len(self._scored) > SCORED_KEPT:
            del self._scored[next(iter(self._scored))]
        for e in scored:
            err = int(e.metrics.get("score_error", 0))
            self.step_errors += err
            self.errors += err
        return GroupScores([e.reward for e in scored], [e.turn_rewards for e in scored])

    def step_fields(self, trained: list[tuple[Any, list[wire.RolloutResult]]]) -> dict:
        """A step row's episode fields (`EpisodeStats.row`) of the groups it trained."""
        return self.trained(trained).row()

    def begin_step(self) -> None:
        self.step_errors = self.step_timeouts = 0

    def close(self) -> None:
        pass
