"""The runner of a run's environment (`[env] ref`, `rlboost run --env`): its chat format, its
bounds, one model turn's bound, and the `[env]` settings its worker processes need.

The trainer's runner opens rows into episode requests (`rlboost.trainer.episodes.source`), scores
finished episodes (`rlboost.trainer.episodes.scoring`) and plays the held-out ones
(`rlboost.trainer.episodes.evaluation`); the workers build their own from each request's `EpisodeSpec`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rlboost.config import EnvSettings
from rlboost.envs import load_env
from rlboost.envs.chat import ChatFormat, chat_format
from rlboost.episodes.runner import EpisodeRunner


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


def max_turn_tokens(data) -> int:
    """One model turn's bound: `data.max_response_tokens` where set, else 256."""
    return data.max_response_tokens if data.max_response_tokens > 0 else 256


def episode_runner(s, tokenizer, max_context: int, run_id: str) -> EpisodeRunner:
    """The runner of a run whose settings `s` name an environment (`[env] ref`): `[env]`'s
    bounds, a model turn at most `data.max_response_tokens` (`max_turn_tokens`)."""
    return make_runner(s.env, tokenizer, max_context, max_turn_tokens(s.data), run_id=run_id)


def worker_env(env: EnvSettings) -> dict[str, str]:
    """`[env]` for the run's worker processes (they read `s.env`: which environment they may load,
    the chat format), as RLBOOST_ENV__* variables. `options` are not among them: they travel in
    each request (`EpisodeSpec.config`), and so do an episode's bounds (`max_turns`, ...): a worker
    runs each episode under its request's."""
    if not env.ref:
        return {}
    return {"RLBOOST_ENV__REF": env.ref, "RLBOOST_ENV__DESCRIBE_TOOLS": str(env.describe_tools).lower(),
            "RLBOOST_ENV__MAX_EPISODE_TOKENS": str(env.max_episode_tokens),
            "RLBOOST_ENV__TOOL_TIMEOUT_S": repr(env.tool_timeout_s), "RLBOOST_ENV__ON_TOOL_ERROR": env.on_tool_error,
            "RLBOOST_ENV__INLINE": str(env.inline).lower()}
