"""`rlboost replay` of an episode shows each model turn's text, decoded with the run's tokenizer,
and why the episode ended `env_error` (the snapshot's `errors`) (issue 40). The episode is one
an environment broke: its `respond` raises after a tool call. Its result goes onto the real
results stream as a worker publishes it, and replay reads it back from there."""

from __future__ import annotations

import argparse
import json

from rlboost import episodes, replay, wire
from rlboost.config import EnvSettings
from rlboost.envs.calculator import ALPHABET
from rlboost.envs.chat import chat_format
from rlboost.episodes.runner import EpisodeRunner
from rlboost.envs.protocol import Env, Opening, Score, ToolResult, ToolSpec, user

LOOKUP = ToolSpec(name="lookup", description="a city's population",
                  parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>'


class BrokenFeedback(Env):
    """A lookup tool, then a feedback service that is down: `respond` raises (env_error)."""

    def start(self, row, ctx):
        return Opening(messages=[user("population of Oslo?")], tools=[LOOKUP], state={})

    def tool_lookup(self, state, ctx, city):
        return ToolResult(content="709000")

    def respond(self, transcript, turn, state, ctx):
        raise ConnectionError("the feedback service is down")

    def score(self, transcript, state, ctx):
        return Score(reward=1.0)


async def _publish_episode(js, tokenizer, rid: str, step: int) -> wire.RolloutResult:
    """The env_error episode run to its end, published on the results stream as a worker does."""
    fmt = chat_format(tokenizer, describe_tools=False)
    runner = EpisodeRunner(BrokenFeedback(), fmt, EnvSettings(max_turns=4, max_episode_tokens=512), max_turn_tokens=96)
    last = {}

    async def generate(ids, budget, stops):
        new = fmt.encode(CALL) + [fmt.turn_end_id]
        return new, [-0.5] * len(new), "stop"

    done = await runner.run(generate, rid, {}, on_checkpoint=lambda s: last.update(snap=s))
    assert done.end_reason == "env_error"
    snap = last["snap"]
    tokens, logprobs, segments = [], [], []
    for seg in snap.segments[1:]:
        segments.append(wire.Segment(len(tokens), "w-replay", 1, 0, kind=seg.kind))
        tokens += seg.token_ids
        logprobs += seg.logprobs if seg.kind == "model" else [0.0] * len(seg.token_ids)
    state = wire.EpisodeState(turn=snap.turn, at=len(tokens), env_state=episodes.pack(snap), done=True,
                              reason=snap.end_reason)
    result = wire.RolloutResult(request_id=rid, step=step, group=0, prompt_ids=snap.segments[0].token_ids,
                                token_ids=tokens, logprobs=logprobs, segments=segments, finish_reason="stop",
                                worker_id="w-replay", ts=1.0, episode=state)
    await js.publish(wire.result_subject(step), wire.encode(result))
    return result


async def test_replay_shows_each_model_turns_text_and_why_the_episode_ended_env_error(js, nats_url, tmp_path, capsys):
    from rlboost.trainer.model import build_tokenizer

    step = 77
    rid = wire.request_id(step, 0, 0)
    tokenizer = build_tokenizer(ALPHABET)
    model_dir = tmp_path / "model"  # a run's model folder: its tokenizer is what replay needs of it
    tokenizer.save_pretrained(model_dir)
    await _publish_episode(js, tokenizer, rid, step)

    async def show(json_out: bool, model: str) -> str:
        capsys.readouterr()
        assert await replay.run(nats_url, argparse.Namespace(request=rid, step=step, json=json_out),
                                model_dir=model) == 0
        return capsys.readouterr().out

    out = json.loads(await show(True, str(model_dir)))
    model_turns = [t for t in out["turns"] if t["kind"] == "model"]
    assert model_turns and all(t["text"] == CALL + tokenizer.decode([tokenizer.eos_token_id]) for t in model_turns)
    assert out["errors"] == ["respond: ConnectionError: the feedback service is down"]
    text = await show(False, str(model_dir))
    assert f"           | {CALL}<eos>" in text.splitlines()
    assert "  environment error: respond: ConnectionError: the feedback service is down" in text.splitlines()
    assert "episode ended: env_error" in text

    # no tokenizer: one line says so, and the turns show their token counts as before
    text = (await show(False, "")).splitlines()
    assert sum("no tokenizer" in line for line in text) == 1 and not any("| " in line for line in text)
    assert any(line.strip().startswith("turn 0 model  tokens 0..") for line in text)
    bad = (await show(False, str(tmp_path / "nowhere"))).splitlines()
    assert sum("no tokenizer" in line for line in bad) == 1
    assert any("environment error: respond" in line for line in bad)


async def test_replay_finds_the_runs_tokenizer_from_its_run_folder(js, nats_url, redis_url, tmp_path, capsys):
    """`rlboost replay ID --run-dir RUN`: the model (and so the tokenizer) the run's
    settings.toml names, as `rlboost run` writes it there."""
    import asyncio

    from rlboost.config import Settings, dump_toml
    from rlboost.trainer.model import build_tokenizer

    step = 78
    rid = wire.request_id(step, 0, 0)
    tokenizer = build_tokenizer(ALPHABET)
    tokenizer.save_pretrained(tmp_path / "model")
    await _publish_episode(js, tokenizer, rid, step)
    ran = Settings()
    ran.run.model_dir = str(tmp_path / "model")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "settings.toml").write_text(dump_toml(ran))
    here = Settings()
    here.services.nats_url, here.services.redis_url = nats_url, redis_url
    capsys.readouterr()
    # main runs its own event loop: in a thread, as from the command line
    assert await asyncio.to_thread(replay.main, [rid, "--run-dir", str(tmp_path / "run")], here) == 0
    text = capsys.readouterr().out.splitlines()
    assert f"           | {CALL}<eos>" in text and not any("no tokenizer" in line for line in text)
