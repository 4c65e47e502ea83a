"""`rlboost run` checks every flag, file and setting before anything slow starts (the demo
model's build and warm start, the servers, the workers): a mistake is one line and exit 2 within
seconds, never after minutes of work. "Slow" is made observable here: building/resolving the
model and starting the servers raise if they are reached."""

from __future__ import annotations

import json

import pytest
from helpers import build_hf_model

from rlboost import cli
from rlboost.trainer import command

REWARD = "def score(solution_str, ground_truth):\n    return float(ground_truth in solution_str)\n"


def _chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


@pytest.fixture
def nothing_slow(monkeypatch, tmp_path):
    """The model build and the servers fail the test if reached; the cwd is a scratch folder."""
    def slow(*_a, **_k):
        raise AssertionError("slow work started before the checks")

    monkeypatch.setattr(command, "resolve_model", slow)
    monkeypatch.setattr(command, "running_services", slow)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reward.py").write_text(REWARD)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": _chat(f"What is {a} plus 2?"),
                                                             "answer": str(a + 2)}) + "\n" for a in range(8)))
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+2=", "answer": str(a + 2)}) + "\n"
                                                 for a in range(8)))
    return tmp_path


@pytest.fixture(scope="module")
def model512(tmp_path_factory):
    return build_hf_model(tmp_path_factory.mktemp("m") / "ctx512", "llama", context=512)


def _refused(tmp_path, capsys, *argv: str) -> str:
    code = cli.main(["--data-dir", str(tmp_path / "data"), "run", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not (tmp_path / "data" / "model").exists()  # no demo model was built
    return err[0]


@pytest.mark.parametrize("argv, line", [
    # the case: it used to build and warm-start the demo model for minutes first
    (["--data", "missing.jsonl", "--steps", "1"],
     "rlboost run: error: --data needs a reward: --reward module:fn or path/to/file.py:fn (or --task math)"),
    (["--data", "missing.jsonl", "--reward", "reward.py:score"], "rlboost run: error: missing.jsonl: no such file"),
    (["--data", "text.jsonl", "--reward", "nofile.py:score"], "rlboost run: error: reward 'nofile.py:score': no such"),
    (["--data", "text.jsonl", "--reward", "reward.py:nothing"], "rlboost run: error: reward 'reward.py:nothing': "),
    (["--task", "poetry"], "rlboost run: error: unknown task 'poetry'"),
    # the demo's character tokenizer has no chat template: known before it is built
    (["--data", "chat.jsonl", "--reward", "reward.py:score"], "rlboost run: error: sample "),
    (["--resume", "."], "rlboost: error: --resume .: no settings.toml there"),
    (["--data.max_response_tokens", "-1"], "rlboost: error: "),
])
def test_a_mistake_is_one_line_before_any_slow_work(nothing_slow, capsys, argv, line):
    assert _refused(nothing_slow, capsys, *argv).startswith(line)


def test_a_resume_without_run_json_is_refused_before_the_servers(nothing_slow, capsys, model512):
    (nothing_slow / "old").mkdir()
    (nothing_slow / "old" / "settings.toml").write_text(f'[run]\nmodel_dir = "{model512}"\n')
    assert _refused(nothing_slow, capsys, "--resume", "old") == \
        "rlboost: error: --resume old: no run.json there (not a run folder)"


def test_a_response_budget_that_fills_the_context_says_it_was_set(nothing_slow, capsys, model512):
    line = _refused(nothing_slow, capsys, "--model-dir", str(model512), "--data", "chat.jsonl", "--reward",
                    "reward.py:score", "--max-response-tokens", "512")
    assert line == ("rlboost run: error: max_response_tokens 512 (as set) leaves no room for a prompt: the model's "
                    "context is 512 tokens (max_position_embeddings): set data.max_response_tokens "
                    "(--max-response-tokens) below that, or 0 for the default (256)")


def test_prompts_all_over_the_budget_are_refused_before_the_run(nothing_slow, capsys, model512):
    line = _refused(nothing_slow, capsys, "--model-dir", str(model512), "--data", "chat.jsonl", "--reward",
                    "reward.py:score", "--max-prompt-tokens", "3")
    assert line.startswith("rlboost run: error: none of the 8 training prompts is within the prompt budget of 3 "
                           "tokens: data.max_prompt_tokens 3; raise it (--max-prompt-tokens)"), line
    line = _refused(nothing_slow, capsys, "--model-dir", str(model512), "--data", "chat.jsonl", "--reward",
                    "reward.py:score", "--max-response-tokens", "510")
    assert "the model's context of 512 tokens less max_response_tokens 510 (as set); lower it" in line, line


def test_a_512_context_model_passes_the_checks_with_no_budget_flags(nothing_slow, model512):
    """The issue's case: the response budget used to default to 512 whatever the model, which left
    a 512-token model a prompt budget of 0 ("1024 prompts in a row are over the budget of 0")."""
    cfg = command.parse(["--model-dir", str(model512), "--data", "chat.jsonl", "--reward", "reward.py:score"])
    data, reward, task_tokens = command.preflight(cfg)
    assert reward == "reward.py:score" and task_tokens == 0 and len(data.iterator.samples) == 8
