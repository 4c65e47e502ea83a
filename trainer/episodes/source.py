"""A step's episode requests (`rlboost run --env`), and the preflight that some row opens one.

Each request is one episode (`rlboost.episodes.request`: the opening in the model's chat format
is the prompt, the `[env]` bounds travel in its `EpisodeSpec`), `samples` episodes per row (a
GRPO group); ids, seeds, the data position, resume and redraw are `rlboost.trainer.request_source`'s.
"""

from __future__ import annotations

import asyncio

from rlboost import episodes, wire
from rlboost.config import EnvSettings
from rlboost.episodes.runner import EpisodeRunner
from rlboost.trainer.data import DataError, DataExhausted
from rlboost.trainer.episodes.data import EpisodeData
from rlboost.trainer.episodes.runner import make_runner
from rlboost.trainer.request_source import RequestSource, request_seed

DROPS_LOGGED = 3  # rows dropped in a row that each get a warning line; the rest are counted (`filtered`)


class EpisodeSource(RequestSource):
    """A step's episode requests: `groups` rows, `samples` episodes each, ids and seeds as for
    single-turn requests (`request_seed`), so a step drawn again is the same step. A row whose
    opening does not fit the episode budget (or whose environment cannot open it) is dropped,
    counted, logged and replaced. `sample(key)` is the data row group `key`'s episodes started from."""

    def __init__(self, data: EpisodeData, runner: EpisodeRunner, *, run_id: str, seed: int, samples: int,
                 temperature: float, life: str = "") -> None:
        super().__init__(data, run_id=run_id, seed=seed, samples=samples, temperature=temperature, life=life,
                         component="episode-requests")
        self.runner = runner

    async def _draw(self, step: int, version: int, groups: int, run: str) -> list[wire.RolloutRequest]:
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
                    self._dropped()
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
                self._keep((step, p), row)
                out += made
                p += 1
        return out


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

    problem = asyncio.run(first_problem())
    if problem is not None:
        tried = f"the first {len(samples)}" if len(data.iterator.samples) > len(samples) else f"all {len(samples)}"
        raise DataError(f"--env {env_settings.ref}: no training row opens an episode ({tried} tried): {problem}")
