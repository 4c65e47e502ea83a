"""Episodes on the trainer side (issue 25): data rows -> episode requests, a finished episode ->
its reward and training sample, held-out success, and a supervised warm start.

- `EpisodeData`: the rows episodes start from: the environment's own (`rows(split, n, seed)`:
  `train` for training, `test` held out) or a data file (`--data`, JSONL / Parquet / datasets
  folder; held out: `--eval-data` or a seeded fraction), in seeded shuffled passes whose position
  a checkpoint keeps (`trainer.data.DataIterator`).
- `EpisodeSource`: a step's requests, the orchestrator's `RequestSource` port: each request is
  one episode (`rlboost.episodes.request`: the opening in the model's chat format is the prompt,
  the `[env]` bounds travel in its `EpisodeSpec`), `samples` episodes per row (a GRPO group).
- `EpisodeScorer`: a group's rewards. The reward is computed **here, on the trainer**, by the
  environment loaded from `[env] ref` (`EpisodeRunner.finish` on the final snapshot the result
  carries, `rlboost.episodes.snapshot`), never taken from a score a worker recorded: rollout
  workers are preemptible capacity the trainer does not trust with its reward (a worker's
  tokens, provenance and episode state are checked against the fenced checkpoint by the
  manager; a score is not part of that), and the single-turn reward is the trainer's too. An
  episode's result gives the training sample as any result does (`grpo_trainer.sample_of`): the
  prompt is the opening, the response everything after it (model and environment tokens), the
  environment tokens masked out of the loss (`wire.trainable_mask`), per-token behaviour
  logprobs and versions from the segments (`training_episode` shows it in one place).
- `EpisodeEvaluation`: held-out success: greedy episodes of the trainer's policy on held-out
  rows, turn by turn in batches (`greedy_episodes`), scored by the environment.
- `warm_start`: the demo's model for an environment: a character model on the environment's
  alphabet, trained on the environment's worked solutions (`solution(row)`) in the episode's
  own chat format (`ChatFormat.conversation_ids`, loss on the assistant's tokens only) until
  its held-out success reaches a target.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rlboost import episodes, wire
from rlboost.config import EnvSettings
from rlboost.envs import load_env
from rlboost.envs.chat import ChatFormat, chat_format
from rlboost.envs.episode import EpisodeRunner, Generation, Snapshot
from rlboost.logs import get_logger
from trainer.data import DataError, DataExhausted, DataIterator, read_rows
from trainer.request_source import RequestSource, request_seed

log = get_logger(component="episodes")

# the demo's model for an environment: smaller than the single-turn demo's (episodes are ~270
# characters, not ~40, and this box's two cores are shared)
DEMO_ARCH = {"hidden": 96, "layers": 3, "heads": 4, "mlp": 256}
DEMO_ENV_CONTEXT = 512  # the demo's model for an environment: its max_position_embeddings (`warm_start`)
TRAIN_ROWS = 4096  # rows drawn from an environment's own generator for training (seeded passes over them)


def run_sync(coro: Coroutine) -> Any:
    """A coroutine to its end from plain code, also while an event loop runs in this thread (the
    orchestrator's port is synchronous): in a thread of its own with its own loop."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def episode_format(tokenizer, env: EnvSettings) -> ChatFormat:
    """The chat format of a run's episodes, the one its workers build (`workers/episodes.py`):
    the model's own template, else the fallback with `[env] describe_tools`. Warm-start data
    writes one-parameter calls compactly (`<tool_call>calc 4*23</tool_call>`: short turns for a
    small model; the parser reads both forms, so workers need not know)."""
    return chat_format(tokenizer, describe_tools=env.describe_tools, compact_calls=True)


def make_runner(env_settings: EnvSettings, tokenizer, max_context: int, max_turn_tokens: int,
                **log_ids: Any) -> EpisodeRunner:
    """The runner of a run's environment: its bounds are `[env]`'s, `max_episode_tokens` no more
    than the model's context."""
    env = load_env(env_settings.ref, **env_settings.options)
    bounded = msgspec.structs.replace(env_settings, max_episode_tokens=min(env_settings.max_episode_tokens, max_context)
                                      if max_context else env_settings.max_episode_tokens)
    return EpisodeRunner(env, episode_format(tokenizer, env_settings), bounded, max_turn_tokens=max_turn_tokens,
                         **log_ids)


# ---------------------------------------------------------------- data rows


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


# ---------------------------------------------------------------- requests


DROPS_LOGGED = 3  # rows dropped in a row that each get a warning line; the rest are counted (`filtered`)


class EpisodeSource(RequestSource):
    """A step's episode requests (the orchestrator's `RequestSource` port): `groups` rows,
    `samples` episodes each, ids and seeds as for single-turn requests (`request_seed`), so a
    step drawn again is the same step; the data position, resume and redraw are the single-turn
    source's (`trainer.request_source`). A row whose opening does not fit the episode budget (or
    whose environment cannot open it) is dropped, counted, logged and replaced. `sample(key)` is
    the data row group `key`'s episodes started from."""

    def __init__(self, data: EpisodeData, runner: EpisodeRunner, *, run_id: str, seed: int, samples: int,
                 temperature: float, life: str = "") -> None:
        super().__init__(data, None, None, list(runner.fmt.stop_ids), run_id=run_id, seed=seed, samples=samples,
                         temperature=temperature, life=life)
        self.runner = runner
        self.log = get_logger(component="episode-requests", run_id=run_id)

    def requests(self, step: int, version: int, groups: int) -> list[wire.RolloutRequest]:
        self._drawn_from.setdefault(step, (self.data.state(), self.filtered_total, groups, version))
        run = "-".join(filter(None, (self.run_id, self.tag(step))))
        return run_sync(self._requests(step, version, groups, run))

    async def _requests(self, step: int, version: int, groups: int, run: str) -> list[wire.RolloutRequest]:
        env_ref = self.runner.settings.ref
        out: list[wire.RolloutRequest] = []
        p = 0
        dropped_in_a_row = 0
        while p < groups:
            try:
                batch = self.data.next_batch(groups - p)
            except DataExhausted:
                if p:  # the last epoch's last, short batch
                    break
                raise
            for row in batch:
                made = await asyncio.gather(*[episodes.request(
                    self.runner, env_ref, row, request_id=wire.request_id(step, p, g, run=run), step=step,
                    policy_version=version, seed=request_seed(self.seed, step, p, g), group=p,
                    sampling=wire.SamplingParams(temperature=self.temperature)) for g in range(self.samples)],
                    return_exceptions=True)
                bad = next((m for m in made if isinstance(m, BaseException)), None)
                if bad is not None or any(m.max_new_tokens < 2 for m in made):
                    self.filtered_total += 1
                    self.step_filtered += 1
                    dropped_in_a_row += 1
                    # `bad` is None where the row opened but left no room: say so, never "None"
                    reason = str(bad) if bad is not None else (
                        f"its opening is {len(made[0].prompt_ids)} tokens: no room left for the model's turns "
                        f"in {self.runner.settings.max_episode_tokens}")
                    if dropped_in_a_row <= DROPS_LOGGED:  # a long run of them is one cause, not a line a row
                        self.log.warning("episode row dropped: its opening does not fit or does not open", step=step,
                                         reason=reason, **({"note": "more in a row are counted, not logged"}
                                                           if dropped_in_a_row == DROPS_LOGGED else {}))
                    if dropped_in_a_row >= max(64 * groups, 1024):
                        why = await opening_problem(self.runner, row, "the last row") if bad is None else None
                        raise DataError(f"{dropped_in_a_row} rows in a row could not open an episode; the last: "
                                        f"{why or reason}")
                    continue
                dropped_in_a_row = 0
                self._samples[(step, p)] = row
                out += made
                p += 1
        return out


# ---------------------------------------------------------------- results -> rewards and samples


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


class EpisodeRewards(list):
    """A group's episode rewards (a list of floats, as every scorer returns) with each episode's
    per-model-turn rewards beside them (None where its environment gives none): the trainer's
    turn credit (`algorithm.turn_reward_coef`)."""

    def __init__(self, rewards: list[float], turn_rewards: list[list[float] | None]) -> None:
        super().__init__(rewards)
        self.turn_rewards = turn_rewards


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

    async def group(self, row: dict, results: list[wire.RolloutResult]) -> list[float]:
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
        return EpisodeRewards([e.reward for e in scored], [e.turn_rewards for e in scored])

    def begin_step(self) -> None:
        self.step_errors = self.step_timeouts = 0

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- greedy episodes


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

    def __init__(self, rows: list[dict], runner: EpisodeRunner, ops, pad: int) -> None:
        self.rows, self.runner, self.ops, self.pad = rows, runner, ops, pad
        self.last: dict = {}

    def _generate(self, prompts: list[list[int]], max_new: int, stops: list[int]) -> list[list[int]]:
        return self.ops.call("greedy", prompts, max_new, stops, self.pad)

    async def accuracy(self) -> float | None:
        if not self.rows:
            return None
        t0 = time.monotonic()
        done = await greedy_episodes(self.runner, self.rows, self._generate)
        n = len(done)
        self.last = {"eval_success": sum(d.reward for d in done) / n,
                     "eval_tool_calls": round(sum(d.tool_calls for d in done) / n, 3),
                     "eval_s": round(time.monotonic() - t0, 1)}
        return self.last["eval_success"]


# ---------------------------------------------------------------- a warm start for the demo's model


def solutions(env: Any, rows: list[dict]) -> list[list]:
    """The environment's worked conversations for `rows` (its `solution(row)`), for a warm start."""
    fn = getattr(env, "solution", None)
    if not callable(fn):
        raise DataError(f"the {getattr(env, 'name', type(env).__name__)} environment has no solution(row): "
                        "no warm start for the demo model; train a model of your own (--model-dir)")
    return [fn(r) for r in rows]


def untooled(messages: list) -> list:
    """A worked conversation without its tool turns: the opening, then the final answer at once
    (a demonstrator that answers from its head)."""
    opening = list(itertools.takewhile(lambda m: m.role != "assistant", messages))
    last = messages[-1] if messages else None
    if last is None or last.role != "assistant" or last.tool_calls or not last.content:
        raise DataError("a worked solution that does not end in a plain answer: no untooled demonstration of it "
                        "for the warm start's guessing phase (--run.bootstrap_guess_steps 0 leaves it out)")
    return opening + [last]


def warm_start(env_settings: EnvSettings, out_dir: Path, target: float, max_seconds: float, *, seed: int = 0,
               context: int = DEMO_ENV_CONTEXT, batch: int = 16, lr: float = 3e-3, eval_every: int = 100,
               eval_rows: int = 64, max_steps: int = 0, guess_steps: int = 0, guess_share: float = 0.8,
               **arch: int) -> dict:
    """Build the demo's character model for `[env] ref` (its alphabet: the environment's
    `alphabet`) with `context` positions and train it on the environment's worked solutions until
    the greedy held-out success reaches `target`, `max_seconds` pass or `max_steps` steps are done
    (0: no step cap; a step cap stops at the same model however loaded the box).

    Then, for `guess_steps` steps at a tenth of the rate, on demonstrations of which `guess_share`
    answer at once without the tools (`untooled`): the model keeps the skill but seldom uses it,
    as a base model that guesses where it should call a tool. Greedy, it guesses (held-out success
    near 0); sampled, about 1 - `guess_share` of its episodes call the tools and mostly succeed:
    what RL then has to teach is when the tools pay. Without this phase RL starts from a model
    that already imitates the tool use, and its gain hangs on where the warm start stopped in the
    copying transition (docs/concepts/environments.md, "Learning on this box")."""
    import torch

    from trainer import model as M
    from trainer.bootstrap import sft_step

    env = load_env(env_settings.ref, **env_settings.options)
    alphabet = getattr(env, "alphabet", "")
    if not alphabet:
        raise DataError(f"--env {env_settings.ref}: the environment names no alphabet: the demo's character model "
                        "cannot read it; train a model of your own (--model-dir)")
    tokenizer = M.build_tokenizer(alphabet)
    model = M.build_model(len(tokenizer), seed=seed, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                          max_positions=context, **{**DEMO_ARCH, **arch})
    runner = make_runner(env_settings, tokenizer, context, max_turn_tokens=64)
    fmt = runner.fmt
    data = EpisodeData(env, env_settings.ref, seed=seed, eval_size=eval_rows)
    held = data.eval_samples()
    tools = run_sync(runner.begin("tools", held[0])).tools

    guesses = random.Random(f"guess/{seed}")

    def batch_of(rows: list[dict], share: float = 0.0):
        demos = [untooled(m) if share and guesses.random() < share else m for m in solutions(env, rows)]
        convs = [fmt.conversation_ids(m, tools) for m in demos]
        width = max(len(ids) for ids, _ in convs)
        ids_t = torch.full((len(convs), width), tokenizer.pad_token_id)
        labels = torch.full((len(convs), width), -100)
        attn = torch.zeros((len(convs), width), dtype=torch.long)
        for i, (ids, mask) in enumerate(convs):
            ids_t[i, :len(ids)] = torch.tensor(ids)
            labels[i, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
            attn[i, :len(ids)] = 1
        return ids_t, attn, labels

    def success() -> tuple[float, float]:
        def gen(prompts, max_new, stops):
            return M.greedy_ids(model, prompts, max_new, stops, tokenizer.pad_token_id)
        done = run_sync(greedy_episodes(runner, held, gen))
        return sum(d.reward for d in done) / len(done), sum(d.tool_calls for d in done) / len(done)

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    t0, step, acc, calls, loss = time.monotonic(), 0, 0.0, 0.0, float("nan")
    while True:
        step += 1
        loss = sft_step(model, optimizer, *batch_of(data.next_batch(batch)))
        elapsed = time.monotonic() - t0
        last = elapsed >= max_seconds or step == max_steps
        if step % eval_every == 0 or last:
            acc, calls = success()
            elapsed = time.monotonic() - t0
            log.info("env warm start", env=env_settings.ref, step=step, loss=round(loss, 4), eval_success=round(acc, 3),
                     tool_calls=round(calls, 2), seconds=round(elapsed, 1))
            if acc >= target or last or elapsed >= max_seconds:
                break
    tool_acc, reached = acc, acc >= target
    if guess_steps:
        if not reached:
            log.warning("env warm start below its target: the guessing phase leaves RL little to find",
                        env=env_settings.ref, eval_success=round(acc, 3), target=target)
        # a fresh optimizer: the warm start's second moments are of a converged loss, and the
        # guesses' larger gradients over them would take steps far above the rate
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr / 10, weight_decay=0.01)
        for _ in range(guess_steps):
            step += 1
            loss = sft_step(model, optimizer, *batch_of(data.next_batch(batch), guess_share))
        acc, calls = success()
        log.info("env warm start, guessing", env=env_settings.ref, step=step, loss=round(loss, 4),
                 eval_success=round(acc, 3), tool_calls=round(calls, 2), seconds=round(time.monotonic() - t0, 1))
    seconds = round(time.monotonic() - t0, 1)
    meta = {"task": f"env:{env_settings.ref}", "env": env_settings.ref, "env_options": json.dumps(env_settings.options),
            "trained": True, "eval_acc": acc, "eval_tool_calls": calls, "steps": step, "seconds": seconds,
            "tool_eval_acc": tool_acc, "guess_steps": guess_steps, "guess_share": guess_share if guess_steps else 0.0,
            "context": context, "params": sum(p.numel() for p in model.parameters())}
    M.save(model, tokenizer, out_dir, meta=meta)
    return {"out": str(out_dir), "target": target, "reached": reached, "loss": round(loss, 4), **meta}


# ---------------------------------------------------------------- what `rlboost run --env` wires


def worker_env(env: EnvSettings) -> dict[str, str]:
    """`[env]` for the run's worker processes (they read `s.env`: which environment they may load,
    the chat format), as RLBOOST_ENV__* variables. `options` are not among them: they travel in
    each request (`EpisodeSpec.config`)."""
    if not env.ref:
        return {}
    return {"RLBOOST_ENV__REF": env.ref, "RLBOOST_ENV__DESCRIBE_TOOLS": str(env.describe_tools).lower(),
            "RLBOOST_ENV__MAX_TURNS": str(env.max_turns), "RLBOOST_ENV__MAX_EPISODE_TOKENS": str(env.max_episode_tokens),
            "RLBOOST_ENV__TOOL_TIMEOUT_S": repr(env.tool_timeout_s), "RLBOOST_ENV__ON_TOOL_ERROR": env.on_tool_error,
            "RLBOOST_ENV__INLINE": str(env.inline).lower()}


def demo_model_dir(data_dir: str | Path, ref: str) -> Path:
    """Where the demo's model for environment `ref` lives (one per environment: its alphabet and
    warm start are the environment's)."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in ref)[:60]
    return Path(data_dir).expanduser() / f"model-env-{name}"


def check_demo_model(model_dir: Path, env: EnvSettings, guess_steps: int = 0, guess_share: float = 0.8) -> bool:
    """True if `model_dir` holds the demo's model warm-started for this environment and options,
    with this guessing phase (`warm_start`)."""
    from trainer.model import read_meta

    meta = read_meta(model_dir)
    return bool(meta.get("trained")) and meta.get("env") == env.ref and \
        meta.get("env_options") == json.dumps(env.options) and \
        meta.get("guess_steps", 0) == guess_steps and meta.get("guess_share", 0.0) == (guess_share if guess_steps else 0.0)


def make_data(env_settings: EnvSettings, data, seed: int) -> EpisodeData:
    """A run's episode rows from `[env]` and `[data]` (`train`, `eval`, `eval_size`, ...)."""
    env = load_env(env_settings.ref, **env_settings.options)
    return EpisodeData(env, env_settings.ref, data.train, data.eval, seed=seed, shuffle=data.shuffle,
                       epochs=data.epochs, eval_size=data.eval_size, eval_fraction=data.eval_fraction)


def max_turn_tokens(data) -> int:
    """One model turn's bound: `data.max_response_tokens` where set, else 256."""
    return data.max_response_tokens if data.max_response_tokens > 0 else 256


def ensure_demo_model(env_settings: EnvSettings, model_dir: Path, target: float, seconds: float,
                      steps: int = 0, *, guess_steps: int = 0, guess_share: float = 0.8) -> dict | None:
    """The demo's model for the run's environment in `model_dir`, built and warm-started on
    first use (one thread: on a shared box more threads only wait on each other; `steps`: the
    warm start's step cap, 0 = none; `guess_*`: its guessing phase). None if it was there already."""
    import torch

    if check_demo_model(model_dir, env_settings, guess_steps, guess_share):
        return None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return warm_start(env_settings, model_dir, target, seconds, max_steps=steps, guess_steps=guess_steps,
                          guess_share=guess_share)
    finally:
        torch.set_num_threads(threads)



def episode_runner(s, tokenizer, max_context: int, run_id: str) -> EpisodeRunner:
    """The runner of a run whose settings `s` name an environment (`[env] ref`): `[env]`'s
    bounds, a model turn at most `data.max_response_tokens` (`max_turn_tokens`)."""
    return make_runner(s.env, tokenizer, max_context, max_turn_tokens(s.data), run_id=run_id)


# ---------------------------------------------------------------- an opening that does not fit

PREFLIGHT_ROWS = 64  # training rows a preflight opens, at most (it stops at the first that fits)


def context_words(env_settings: EnvSettings, max_context: int) -> str:
    """What bounds an episode's tokens, for an error: `[env] max_episode_tokens` or the model's
    context (`make_runner` takes the smaller); unknown (0) for a runner whose context is not known here."""
    if not max_context:
        return "env.max_episode_tokens, no more than the model's max_position_embeddings"
    if env_settings.max_episode_tokens < max_context:
        return f"env.max_episode_tokens; the model's max_position_embeddings is {max_context}"
    return "the model's max_position_embeddings"


async def opening_problem(runner: EpisodeRunner, row: dict, where: str, max_context: int = 0,
                          env_settings: EnvSettings | None = None) -> str | None:
    """Why `row` (named `where`, e.g. "row 3") opens no episode the model can write in, as one
    line with the way forward; None if it opens one. The same test a step's requests make
    (`EpisodeSource`): the environment opens it, and its opening leaves the model 2 tokens or more."""
    snap = await runner.begin(f"preflight-{where.replace(' ', '-')}", row)
    if not snap.segments:
        return f"the environment could not open {where}: {'; '.join(snap.errors) or 'no reason given'}"
    prompt, limit = len(snap.segments[0].token_ids), runner.settings.max_episode_tokens
    if limit - prompt >= 2:
        return None
    s = env_settings or runner.settings
    # what the tool descriptions cost: the same opening rendered without them
    tools = prompt - len(runner.fmt.prompt_ids(snap.messages, [])) if snap.tools else 0
    fixes = []
    if tools > 0 and s.describe_tools:
        fixes.append("set env.describe_tools = false (shorter tool descriptions: each tool's name, first line "
                     "and arguments)")
    if max_context and s.max_episode_tokens < max_context:
        fixes.append(f"raise env.max_episode_tokens (up to {max_context})")
    fixes += ["use a model with a longer context", "shorten the environment's opening"]
    share = f", of which the tool descriptions take {tools}" if tools > 0 else ""
    return (f"the opening of {where} is {prompt} tokens against a context of {limit} "
            f"({context_words(s, max_context)}){share}: no room for the model's turns; "
            f"{', '.join(fixes[:-1])} or {fixes[-1]}")


def check_openings(env_settings: EnvSettings, data: EpisodeData, tokenizer, max_context: int,
                   turn_tokens: int, rows: int = PREFLIGHT_ROWS) -> None:
    """Before anything slow starts (the demo's warm start, the held-out evaluation, the servers,
    the workers): DataError unless one of the first `rows` training rows opens an episode the
    model can write in, naming the first row's problem (its opening's length against the
    context and what the tool descriptions take, or why the environment could not open it).
    A run whose rows all fail would otherwise evaluate episodes that never open ("accuracy
    0.000") and drop rows a thousand times before stopping. Rows that fail while others fit
    are the run's to drop and count, as it does."""
    runner = make_runner(env_settings, tokenizer, max_context, turn_tokens)
    samples = data.iterator.samples[:rows]

    async def first_problem() -> str | None:
        first = None
        for i, row in enumerate(samples):
            problem = await opening_problem(runner, row, f"training row {i}", max_context, env_settings)
            if problem is None:
                return None
            first = first or problem
        return first

    problem = run_sync(first_problem())
    if problem is not None:
        tried = f"the first {len(samples)}" if len(data.iterator.samples) > len(samples) else f"all {len(samples)}"
        raise DataError(f"--env {env_settings.ref}: no training row opens an episode ({tried} tried): {problem}")
