"""The calculator environment, counting its tool calls, and a scripted policy that solves it:
what the episode tests run in worker processes (`episode_env:make`, with tests/ on the path).

`CountingCalculator` (benchmarks/chaos_episodes.py) appends each call's idempotency key and pid to `log` (one `write` of one
line, O_APPEND: a killed process leaves whole lines) before it answers, after `delay_s`.
`solver(rows)` is a policy for workers.engines.scripted: it finds the row's question in the
context, calls `calc` for each worked step with the results the tool gave (read back from the
context: a wrong tool result gives a wrong answer), then answers.
"""

from __future__ import annotations

from typing import Any

from rlboost.benchmarks import agent, chaos_episodes
from rlboost import episodes, wire
from rlboost.envs.calculator import ALPHABET, CALC, CalculatorEnv
from rlboost.envs.chat import chat_format
from rlboost.episodes.runner import EpisodeRunner
from rlboost.config import EnvSettings

ENV_REF = "episode_env:make"


CountingCalculator = chaos_episodes.CountingCalculator  # each call's key (and pid) appended to `log`


def make(log: str, delay_s: float = 0.0) -> CountingCalculator:
    return CountingCalculator(log, delay_s)


def calls(log: str) -> list[str]:
    """Every tool call the environment ran, by key, in order."""
    try:
        with open(log, encoding="utf-8") as f:
            return [line.split()[0] for line in f if line.strip()]
    except FileNotFoundError:
        return []


solver = agent.solver  # the scripted policy that solves the rows (benchmarks/agent.py)


def tokenizer():
    from rlboost.trainer.model import build_tokenizer

    return build_tokenizer(ALPHABET)


async def requests(step: int, rows: list[dict[str, Any]], log: str, delay_s: float = 0.0, max_new: int = 600,
                   run: str = "", max_turns: int = 8, max_turn_tokens: int = 256) -> list[wire.RolloutRequest]:
    """One episode request per row (`rlboost.episodes.request`), its prompt the opening in the
    fallback chat format (what a worker with the same tokenizer renders)."""
    fmt = chat_format(tokenizer())
    options = {"log": log, "delay_s": delay_s}
    out = []
    for i, row in enumerate(rows):
        rid = wire.request_id(step, i, 0, run)
        prompt = fmt.prompt_ids(*_opening(row))
        settings = EnvSettings(max_turns=max_turns, max_episode_tokens=len(prompt) + max_new)
        runner = EpisodeRunner(make(log, delay_s), fmt, settings, max_turn_tokens=max_turn_tokens)
        out.append(await episodes.request(runner, ENV_REF, row, request_id=rid, step=step, policy_version=0,
                                          seed=100 + i, group=i, env_options=options))
    return out


def _opening(row: dict[str, Any]):
    env = CalculatorEnv()
    return env.opening_messages(row), [CALC]
