"""A user's own model, data and reward, end to end: `rlboost run` on tiny Llama and Qwen3 folders
(BPE tokenizers with a chat template, built here), chat-message JSONL data and a reward file.

The model folders are read-only input: the SHA-256 of every file is the same afterwards.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import build_hf_model, tree_sha256

ROOT = Path(__file__).resolve().parents[1]

FLAKY_REWARD = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's shape. Raises on one prompt's samples; sleeps past the timeout exactly once."""
    if extra_info["behaviour"] == "raise":
        raise RuntimeError("this reward is broken for this prompt")
    if extra_info["behaviour"] == "sleep":
        marker = os.path.join(os.path.dirname(__file__), "slept-once")
        if not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(60)
    assert extra_info["finish_reason"] in ("stop", "length")
    return float(ground_truth in solution_str) + 0.1 * (extra_info["finish_reason"] == "stop")
'''


def _env(services) -> dict:
    nats_url, redis_url = services
    return {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}


def _chat(question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": question}]


@pytest.mark.slow
def test_qwen3_with_a_flaky_reward_trains_and_counts_failures(services, tmp_path):
    model = build_hf_model(tmp_path / "qwen3-tiny", "qwen3", tied=True)
    before = tree_sha256(model)
    rows = [{"messages": _chat(f"What is {a} plus 2?"), "answer": str(a + 2), "behaviour": behaviour}
            for a, behaviour in ((1, "ok"), (2, "raise"), (3, "sleep"), (4, "ok"))]
    rows.append({"messages": _chat("blue " * 80), "answer": "0", "behaviour": "ok"})  # > 64 tokens: filtered
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps({"messages": _chat(f"What is {a}?"), "ground_truth": str(a),
                                                             "behaviour": "ok"}) + "\n" for a in (5, 6)))
    (tmp_path / "reward.py").write_text(FLAKY_REWARD)
    run_dir = tmp_path / "run"
    p = subprocess.run(["rlboost", "run", "--model-dir", str(model), "--data", "train.jsonl", "--eval-data",
                        "test.jsonl", "--reward", "reward.py:compute_score", "--reward-timeout", "5",
                        "--max-prompt-tokens", "64", "--max-response-tokens", "12", "--steps", "2", "--prompts", "4",
                        "--samples", "2", "--workers", "1", "--slots", "8", "--eval-every", "1", "--run-dir",
                        str(run_dir)], cwd=tmp_path, env=_env(services), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert out["steps"] == 2 and [r["policy"] for r in steps] == ["hybrid", "hybrid"]
    assert all(r["live_workers"] == 1 for r in steps)  # a torch worker process took part
    assert out["eval_first"] is not None and out["eval_last"] is not None  # 2 held-out rows < eval_size 256
    # the 4 short prompts are all in each step; the long one is filtered each time it comes up
    assert all(r["prompts"] == 4 for r in steps) and out["filtered_prompts"] >= 1
    assert sum(r["filtered_prompts"] for r in steps) == out["filtered_prompts"]
    # the raising prompt's 2 samples in each step score 0 and are counted; the sleep is cut once
    assert [r["reward_errors"] for r in steps] == [2, 2]
    # (a loaded machine may cut a slow healthy call too: at least the one sleep, and the rows add up)
    assert out["reward_timeouts"] >= 1 and sum(r["reward_timeouts"] for r in steps) == out["reward_timeouts"]
    assert out["data"]["served"] >= 8
    assert tree_sha256(model) == before


@pytest.mark.slow
def test_run_on_a_folder_that_is_not_a_model_is_one_line_and_touches_nothing(tmp_path):
    """The bug this section started from: a run used to bootstrap the toy model into a user's folder."""
    user = tmp_path / "my-model"
    user.mkdir()
    (user / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (user / "model-00001-of-00002.safetensors").write_bytes(b"not really")
    before = tree_sha256(user)
    p = subprocess.run(["rlboost", "run", "--model-dir", str(user), "--steps", "1"], cwd=tmp_path,
                       env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"rlboost run: error: {user} has no tokenizer: need tokenizer.json "
                                             "(or tokenizer.model, or vocab.json + merges.txt)"]
    assert tree_sha256(user) == before


def _readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your model, your data, your reward", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", section, re.S)[0]


@pytest.mark.slow
def test_the_readme_commands_run_as_written_on_a_sharded_bf16_llama(services, tmp_path):
    """The README's block, as written, in a folder where `my-model` is a user's Llama."""
    model = build_hf_model(tmp_path / "my-model", "llama", dtype="bfloat16", shard="60KB")
    assert len(list(model.glob("*.safetensors"))) > 1
    before = tree_sha256(model)
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", _readme_block()], cwd=tmp_path, env=_env(services),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["steps"] == 2 and out["policy"] == "hybrid"
    steps = [json.loads(line) for line in (tmp_path / out["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert all(r["live_workers"] >= 1 for r in steps) and all(r["tokens"] > 0 for r in steps)
    assert tree_sha256(model) == before


@pytest.mark.slow
def test_a_512_context_model_trains_with_no_budget_flags(services, tmp_path):
    """The response budget used to be 512 whatever the model: a 512-token model had a prompt budget
    of 0 and every prompt was refused. Now it defaults from the context (256 + 256)."""
    model = build_hf_model(tmp_path / "ctx512", "llama", context=512)
    before = tree_sha256(model)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"messages": _chat(f"What is {a} plus 2?"),
                                                              "answer": str(a + 2)}) + "\n" for a in range(20)))
    (tmp_path / "reward.py").write_text("def score(solution_str, ground_truth):\n"
                                        "    return float(ground_truth in solution_str)\n")
    run_dir = tmp_path / "run"
    p = subprocess.run(["rlboost", "run", "--model-dir", str(model), "--data", "train.jsonl", "--reward",
                        "reward.py:score", "--steps", "1", "--prompts", "2", "--samples", "2", "--workers", "1",
                        "--run-dir", str(run_dir)], cwd=tmp_path, env=_env(services), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert out["steps"] == 1 and row["prompts"] == 2 and row["filtered_prompts"] == 0 and row["tokens"] > 0
    assert 0 < row["max_response_tokens"] <= 256  # half the context
    assert tree_sha256(model) == before
