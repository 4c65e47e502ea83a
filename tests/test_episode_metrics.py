"""An environment's metrics reach the step rows (issue 40): `Score.metrics` and the runner's
tool errors, tool timeouts and environment errors, averaged over the episodes a step trained,
on an environment that is not the calculator (two tools, one that counts, one that breaks)."""

from __future__ import annotations

import pytest

from rlboost import episodes, wire
from rlboost.config import EnvSettings
from rlboost.envs.calculator import ALPHABET
from rlboost.envs.chat import chat_format
from rlboost.episodes.runner import EpisodeRunner
from rlboost.envs.protocol import Env, Opening, Score, ToolResult, ToolSpec, user

LOOKUP = ToolSpec(name="lookup", description="a city's population",
                  parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
BROKEN = ToolSpec(name="broken", description="always fails",
                  parameters={"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]})


class Census(Env):
    """Answer with a city's population: `lookup` counts in the state (a side effect the score
    reports as `lookups`), `broken` raises (a tool error the runner counts)."""

    def start(self, row, ctx):
        return Opening(messages=[user(f"population of {row['city']}?")], tools=[LOOKUP, BROKEN],
                       state={"answer": str(row["population"]), "lookups": 0})

    def tool_lookup(self, state, ctx, city):
        return ToolResult(content="1000", state={**state, "lookups": state["lookups"] + 1}, set_state=True)

    def tool_broken(self, state, ctx, x):
        raise RuntimeError("the tool broke")

    def score(self, transcript, state, ctx):
        return Score(reward=float(state["answer"] in transcript[-1].content), metrics={"lookups": state["lookups"]})


def _runner() -> EpisodeRunner:
    from rlboost.trainer.model import build_tokenizer

    fmt = chat_format(build_tokenizer(ALPHABET), describe_tools=False)
    return EpisodeRunner(Census(), fmt, EnvSettings(max_turns=6, max_episode_tokens=512), max_turn_tokens=64)


async def _result(runner: EpisodeRunner, rid: str, turns: list[str]) -> wire.RolloutResult:
    """A worker's result of an episode whose model turns are `turns` (the final state carried,
    as a worker sends it)."""
    fmt = runner.fmt
    script = iter(turns)
    last = {}

    async def generate(ids, budget, stops):
        new = fmt.encode(next(script)) + [fmt.turn_end_id]
        return new, [-0.5] * len(new), "stop"

    await runner.run(generate, rid, {"city": "Oslo", "population": 1000}, on_checkpoint=lambda s: last.update(snap=s))
    snap = last["snap"]
    tokens, logprobs, segments = [], [], []
    for seg in snap.segments[1:]:
        segments.append(wire.Segment(len(tokens), "w", 1, 0, kind=seg.kind))
        tokens += seg.token_ids
        logprobs += seg.logprobs if seg.kind == "model" else [0.0] * len(seg.token_ids)
    state = wire.EpisodeState(turn=snap.turn, at=len(tokens), env_state=episodes.pack(snap), done=True,
                              reason=snap.end_reason)
    return wire.RolloutResult(request_id=rid, step=0, group=0, prompt_ids=snap.segments[0].token_ids, token_ids=tokens,
                              logprobs=logprobs, segments=segments, finish_reason="stop", worker_id="w", ts=0.0,
                              episode=state)


async def test_step_rows_carry_the_environments_metrics_of_the_episodes_they_trained():
    from rlboost.trainer.episodes.scoring import EpisodeScorer

    runner = _runner()
    call = '<tool_call>{{"name": "{}", "arguments": {{"{}": "Oslo"}}}}</tool_call>'
    two = await _result(runner, "s1-a", [call.format("lookup", "city"), call.format("lookup", "city"), "1000"])
    broke = await _result(runner, "s1-b", [call.format("broken", "x"), call.format("lookup", "city"), "no idea"])
    failed = wire.RolloutResult(request_id="s1-c", step=0, group=0, prompt_ids=[1], token_ids=[2], logprobs=[0.0],
                                segments=[], finish_reason="error", error="engine broke", worker_id="w", ts=0.0)
    scorer = EpisodeScorer(runner)
    assert (await scorer.group({}, [two, broke, failed])).rewards == [1.0, 0.0, 0.0]
    # async mode: these groups are scored during step 0 and trained by step 1; step 0's row has
    # none of their metrics, step 1's has them all
    before = scorer.trained([]).row()
    assert before["episodes"] == 0 and "env/lookups" not in before and before["tool_errors_mean"] == 0.0
    row = scorer.trained([((1, 0), [two, broke, failed])]).row()
    assert row["episodes"] == 3
    # the environment's own metric: over the episodes it scored (the failed result has none)
    assert row["env/lookups"] == 1.5
    # the runner's counts: over every episode, as tool_calls_mean is
    assert row["tool_errors_mean"] == round(1 / 3, 4) and row["tool_timeouts_mean"] == 0.0
    assert row["env_errors_mean"] == 0.0
    assert row["tool_calls_mean"] == round(4 / 3, 3)


def test_the_loggers_show_the_episode_fields_and_the_environments_metrics():
    from rlboost.trainer.loggers import scalars

    row = {"step": 3, "reward": 0.5, "episodes": 4, "tool_calls_mean": 1.5, "tool_errors_mean": 0.25,
           "env/lookups": 1.5, "episode_ends": {"done": 3, "length": 1}, "data": {"epoch": 0}}
    got = scalars(row)
    assert got["env/lookups"] == 1.5 and got["episode/tool_errors_mean"] == 0.25
    assert got["episode/ends/done"] == 3.0 and got["episode/ends/length"] == 1.0
    assert got["episode/episodes"] == 4.0 and got["rollout/reward"] == 0.5
    assert not any(k.startswith("misc/data") for k in got)


@pytest.mark.slow
def test_rlboost_run_env_writes_the_environments_metrics_in_every_step_row(services, tmp_path, calc_model_dir):
    """`rlboost run --env calculator`: each metrics.jsonl row carries the calculator's own
    metrics (`correct`, `calc_calls`) and the runner's error counts."""
    import json
    import os
    import subprocess
    import sys

    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--env", "calculator", "--model-dir",
                        str(calc_model_dir), "--run-dir", str(run_dir), "--steps", "2", "--prompts", "1",
                        "--samples", "2", "--workers", "1", "--eval-every", "100", "--eval-size", "2",
                        "--max-response-tokens", "16", "--env.max_turns", "2", "--env.describe_tools", "false",
                        "--env.options.instructions", "false", "--t-seed", "0.5", "--t-seed-floor", "0.5"],
                       capture_output=True, text=True, env=env, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["episodes"] == 2 and {"tool_errors_mean", "tool_timeouts_mean", "env_errors_mean"} <= set(r)
        # an untrained model's turns are cut (`length`) and scored: the calculator's metrics are there
        assert "env/calc_calls" in r and "env/correct" in r, r
