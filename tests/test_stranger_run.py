"""`rlboost run` on a stranger's model and environment (issue 40's acceptance): a tiny Llama with
a 512-token context and a byte-level BPE tokenizer carrying Hermes-2-Pro's chat template
(tests/stranger_models.py), the bank environment (tests/stranger_env.py: two tools with JSON
schemas, one with side effects, feedback and a retry). Episodes end for their true reasons, not
`env_error` (the environment does nothing wrong), and every step row carries the environment's
metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def stranger_model(tmp_path_factory):
    """The Llama, tuned for a few seconds to open the bank's episodes with a balance call in
    Hermes syntax (the brief tool descriptions `env.describe_tools = false` gives a templated
    model: the full schemas take 488 of the 512 positions), with a data file of bank rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import stranger_env
    import stranger_models
    from rlboost.envs.chat import chat_format
    from rlboost.envs.protocol import Context

    tok = stranger_models.tokenizer("hermes")
    fmt, env = chat_format(tok, describe_tools=False), stranger_env.make()
    rows = [{"checking": 100 + 10 * i, "savings": 50 + 5 * i, "amount": 10 + i} for i in range(64)]
    prompts = []
    for r in rows:
        opening = env.start(r, Context(episode_id="x", turn=0, seed=0))
        prompts.append(fmt.prompt_ids(opening.messages, opening.tools))
    call = tok('<tool_call>\n{"name": "balance", "arguments": {"account": "savings"}}\n</tool_call>',
               add_special_tokens=False)["input_ids"] + [fmt.stop_ids[0]]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for i in range(150):  # a few seconds
        qs = [prompts[(8 * i + j) % len(prompts)] for j in range(8)]
        x = torch.full((len(qs), max(map(len, qs)) + len(call)), tok.pad_token_id)
        y = torch.full_like(x, -100)
        for k, q in enumerate(qs):
            x[k, :len(q) + len(call)] = torch.tensor(q + call)
            y[k, len(q) - 1:len(q) + len(call) - 1] = torch.tensor(call)
        loss = torch.nn.functional.cross_entropy(model(x).logits.reshape(-1, len(tok)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("stranger") / "llama"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    data = out.parent / "bank.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out, data


@pytest.mark.slow
def test_a_512_context_llama_with_a_hermes_template_trains_on_the_bank_without_env_errors(
        services, tmp_path, stranger_model):
    model_dir, data = stranger_model
    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--env", "stranger_env:make", "--model-dir",
                        str(model_dir), "--data.train", str(data), "--run-dir", str(run_dir), "--steps", "3",
                        "--prompts", "4", "--samples", "4", "--workers", "1", "--eval-every", "100",
                        "--eval-size", "4", "--max-response-tokens", "40", "--env.max_turns", "3",
                        "--env.describe_tools", "false", "--t-seed", "0.5", "--t-seed-floor", "0.5"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ends = {}
    for r in rows:
        for reason, n in r["episode_ends"].items():
            ends[reason] = ends.get(reason, 0) + n
    assert sum(ends.values()) == 3 * 16 and ends.get("env_error", 0) < 0.1 * 48, ends
    assert all("env/lookups" in r and "env/transfers" in r and "env_errors_mean" in r for r in rows), rows[0]
    assert sum(r["tool_calls_mean"] for r in rows) > 0  # the tuned call reached the bank's tools
