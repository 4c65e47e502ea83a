"""An opening that does not fit the model's context is one line before any work (issue 40).

A user's 512-token model with its own chat template (tests/stranger_models.py's Hermes-style BPE
tokenizer) and an environment whose two tools carry long JSON schemas: the template renders
every schema into the opening, which then fills the context before the model writes a token.
The run used to warm up, report a held-out "accuracy before RL: 0.000" for episodes that never
opened, log ~1,000 identical warnings and stop with "1024 rows in a row could not open an
episode: None". `rlboost run` now refuses before the evaluation, the servers and the workers,
naming the row, its opening's length, the context, the tool descriptions' share and the fix."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlboost.envs.protocol import Env, Opening, Score, ToolResult, ToolSpec, user

HERE = Path(__file__).resolve()
ENV_REF = f"{HERE}:make"


def _schema(fields: dict[str, str]) -> dict:
    # long descriptions and enums, as real tool specs have: each field a sentence or two
    return {"type": "object", "required": list(fields),
            "properties": {k: {"type": "string", "enum": [f"{k}-{i}" for i in range(12)],
                               "description": f"{v} It is one of the listed values; any other is refused "
                                              "and the call fails without changing anything in the archive."}
                           for k, v in fields.items()}}


SEARCH = ToolSpec(name="search_archive",
                  description="Search the archive of shipping records for documents that match every filter.\n"
                              "Results come back newest first, at most ten at a time, each with its record id, "
                              "title, port of origin, destination, carrier and the date it was filed.",
                  parameters=_schema({"port": "The port the shipment left from.", "carrier": "Who carried it.",
                                      "destination": "Where it went.", "decade": "When it was filed."}))
FETCH = ToolSpec(name="fetch_record",
                 description="Fetch one shipping record by its id, in full.\nIts manifest, its stops, the cargo "
                             "weight in tonnes and every amendment filed after the original record.",
                 parameters=_schema({"record": "The record's id as search_archive returned it.",
                                     "section": "Which part of the record to return.",
                                     "format": "How the record is written out."}))


class Archive(Env):
    """Two tools with long JSON schemas; a short question. Scores 1 for naming the record."""

    name = "archive"

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken  # start raises: no row opens at all

    def start(self, row: dict[str, Any], ctx) -> Opening:
        if self.broken:
            raise LookupError("the archive is offline")
        return Opening(messages=[user(f"Which record holds shipment {row['n']}?")], tools=[SEARCH, FETCH],
                       state={"answer": f"record-{row['n']}"})

    def tool_search_archive(self, state, ctx, **filters) -> ToolResult:
        return ToolResult(content=state["answer"])

    def tool_fetch_record(self, state, ctx, **args) -> ToolResult:
        return ToolResult(content="manifest: grain")

    def score(self, transcript, state, ctx) -> Score:
        return Score(reward=float(state["answer"] in transcript[-1].content))

    def rows(self, split: str, n: int, seed: int) -> list[dict]:
        return [{"n": seed * 100_000 + i} for i in range(n)]


def make(**options: Any) -> Archive:
    return Archive(**options)


@pytest.fixture(scope="module")
def hermes512(tmp_path_factory) -> Path:
    """A user's model folder: a tiny Qwen2 with a 512-token context and the Hermes-style BPE
    tokenizer with its chat template (no rlboost meta: read as the user's own)."""
    import stranger_models

    from rlboost.trainer.model import build_model, save

    tok = stranger_models.tokenizer("hermes")
    model = build_model(len(tok), hidden=32, layers=1, heads=2, mlp=64, max_positions=512, seed=0,
                        pad_id=tok.pad_token_id or 0, eos_id=tok.eos_token_id)
    return save(model, tok, tmp_path_factory.mktemp("m") / "hermes512")


def _preflight(model_dir: Path, *argv: str):
    from rlboost.trainer import command

    return command.preflight(command.parse(["--env", ENV_REF, "--model-dir", str(model_dir), *argv]))


def _lengths(model_dir: Path, describe_tools: bool = True) -> tuple[int, int]:
    """The opening's tokens with and without its tools, rendered by the model's own template."""
    from rlboost.envs.chat import chat_format
    from rlboost.trainer.model import load_tokenizer

    fmt = chat_format(load_tokenizer(model_dir), describe_tools=describe_tools)
    opening = Archive().start({"n": 0}, None)
    return len(fmt.prompt_ids(opening.messages, opening.tools)), len(fmt.prompt_ids(opening.messages, []))


def test_an_opening_that_fills_the_context_is_refused_naming_its_length_and_the_tools_share(hermes512):
    from rlboost.trainer.data import DataError

    full, bare = _lengths(hermes512)
    assert full > 512 > bare  # the tools' schemas, not the question, fill the context
    with pytest.raises(DataError) as e:
        _preflight(hermes512)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith(f"--env {ENV_REF}: no training row opens an episode (the first 64 tried): the opening "
                           f"of training row 0 is {full} tokens against a context of 512 (the model's "
                           f"max_position_embeddings), of which the tool descriptions take {full - bare}: "
                           "no room for the model's turns; "), line
    for way in ("set env.describe_tools = false", "use a model with a longer context"):
        assert way in line, line


def test_the_way_forward_it_names_works(hermes512):
    """`env.describe_tools = false` gives the template each tool's name, first line and
    arguments: the opening fits, and the same checks pass."""
    brief, _ = _lengths(hermes512, describe_tools=False)
    assert brief < 510
    data, reward, _ = _preflight(hermes512, "--env.describe_tools", "false")
    assert reward == "" and data.iterator.samples


def test_a_budget_of_the_runs_own_is_named_as_the_bound(hermes512):
    """Where `env.max_episode_tokens` is below the model's context, it is the bound to raise."""
    from rlboost.trainer.data import DataError

    brief, bare = _lengths(hermes512, describe_tools=False)
    with pytest.raises(DataError) as e:
        _preflight(hermes512, "--env.describe_tools", "false", "--env.max_episode_tokens", "200")
    line = str(e.value)
    assert (f"the opening of training row 0 is {brief} tokens against a context of 200 (env.max_episode_tokens; "
            f"the model's max_position_embeddings is 512), of which the tool descriptions take {brief - bare}: ") in line
    assert "raise env.max_episode_tokens (up to 512)" in line and "describe_tools" not in line, line


def test_an_environment_that_opens_no_row_says_why_before_the_run(hermes512):
    from rlboost.trainer.data import DataError

    with pytest.raises(DataError) as e:
        _preflight(hermes512, "--env.options.broken", "true")
    assert str(e.value) == (f"--env {ENV_REF}: no training row opens an episode (the first 64 tried): the environment "
                            "could not open training row 0: start: LookupError: the archive is offline"), str(e.value)


def test_rows_dropped_in_a_row_during_the_run_name_the_real_reason_not_none():
    """Past the preflight (e.g. rows after the first 64), a long run of rows that do not fit
    stops the run with their cause: it used to say "... could not open an episode: None"."""
    from rlboost.config import EnvSettings
    from rlboost.envs.calculator import ALPHABET
    from rlboost.trainer.data import DataError
    from rlboost.trainer.episodes.data import EpisodeData
    from rlboost.trainer.episodes.runner import make_runner
    from rlboost.trainer.episodes.source import EpisodeSource
    from rlboost.trainer.model import build_tokenizer

    # a character model's fallback format: fast to render a thousand times
    env = EnvSettings(ref=ENV_REF, max_episode_tokens=64)
    runner = make_runner(env, build_tokenizer(ALPHABET + "_{}[]\"\'"), 512, 16)
    data = EpisodeData(Archive(), ENV_REF, seed=0)
    source = EpisodeSource(data, runner, run_id="r", seed=0, samples=2, temperature=1.0)
    with pytest.raises(DataError) as e:
        asyncio.run(source.requests(1, 0, 1))
    line = str(e.value)
    assert "None" not in line and line.startswith("1024 rows in a row could not open an episode; the last: the opening "
                                                  "of the last row is "), line
    assert "against a context of 64 (env.max_episode_tokens, no more than the model's max_position_embeddings)" \
        in line and "of which the tool descriptions take" in line, line
    assert source.filtered_total == 1024


@pytest.mark.slow
def test_rlboost_run_refuses_in_one_line_before_the_evaluation_and_the_workers(services, hermes512, tmp_path):
    """The issue's run, as a user meets it: one line on stderr, exit 2, within seconds; no
    held-out accuracy of episodes that never opened, no run folder, no warnings."""
    nats_url, redis_url = services
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "--data-dir", str(tmp_path / "data"), "run", "--env",
                        ENV_REF, "--model-dir", str(hermes512), "--run-dir", str(tmp_path / "run"), "--steps", "1",
                        "--prompts", "1", "--samples", "2", "--workers", "1", "--eval-size", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr[-3000:]
    assert err[0].startswith(f"rlboost run: error: --env {ENV_REF}: no training row opens an episode"), err
    assert "of which the tool descriptions take" in err[0] and "env.describe_tools = false" in err[0], err
    assert "accuracy" not in p.stdout, p.stdout
    assert not (tmp_path / "run").exists()
