"""Helpers shared by test modules (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from rlboost import bus, wire
from rlboost.trainer.model import build_model, build_tokenizer, save
from rlboost.trainer.tasks import Addition
from rlboost.workers.engines.base import EngineError, Sequence


def engine_requests(n: int, rng: random.Random, max_new: int, sampling: list[dict], **overrides) -> list[Sequence]:
    """`n` engine sequences with random short prompts, cycling through `sampling` settings."""
    out = []
    for i in range(n):
        prompt = [rng.randrange(2, 16) for _ in range(rng.randint(3, 9))]
        kw = {"max_new_tokens": max_new, "eos_id": -1, **sampling[i % len(sampling)], **overrides}
        out.append(Sequence(request_id=f"s00001-p{i:05d}-g000", prompt_ids=prompt, seed=1234 + i, **kw))
    return out


def fresh(s: Sequence, tokens: list[int] | None = None) -> Sequence:
    """A copy of `s` that starts from `tokens` (none: from the prompt)."""
    return Sequence(request_id=s.request_id, prompt_ids=list(s.prompt_ids), seed=s.seed,
                    max_new_tokens=s.max_new_tokens, eos_id=s.eos_id, temperature=s.temperature, top_p=s.top_p,
                    top_k=s.top_k, token_ids=list(tokens or []))


async def step_results(js, step: int, n: int, timeout: float = 20.0) -> dict[str, wire.RolloutResult]:
    """The results of `step` published so far, by request id, once `n` arrived (or on timeout)."""
    got: dict[str, wire.RolloutResult] = {}
    sub = await bus.follow(js, wire.result_subject(step))
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        try:
            m = await sub.next_msg(timeout=0.5)
        except TimeoutError:
            continue
        r = wire.decode(wire.RolloutResult, m.data)
        got[r.request_id] = r
    await sub.unsubscribe()
    return got


async def assert_wrong_shape_refused_untouched(engine, seqs: list[Sequence], one_go, where: Path, heads: int) -> None:
    """Weights of another architecture are refused; the engine keeps generating with its own."""
    before = await one_go(engine, seqs)
    tok = build_tokenizer(Addition().alphabet)
    save(build_model(len(tok), seed=5, hidden=32, layers=2, heads=heads, mlp=128), tok, where)
    with pytest.raises(EngineError, match="wrong shape"):
        await engine.load_weights(where, version=1)
    assert engine.policy_version == 0
    assert [g.token_ids for g in await one_go(engine, seqs)] == [g.token_ids for g in before]


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def build_hf_model(out: Path, arch: str = "llama", *, tied: bool = False, dtype: str = "float32",
                   shard: str | None = None, seed: int = 0, context: int = 256) -> Path:
    """A tiny Hugging Face model folder as a user would bring it: a byte-level BPE tokenizer
    trained with `tokenizers`, a chat template, two EOS ids in generation_config.json (the
    chat turn end and the text end), saved with save_pretrained (`shard`: max_shard_size);
    `context`: max_position_embeddings."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["What is 12 plus 30? The answer is 42.", "Name a colour: blue, red, green.",
              "user assistant system hello world", "0 1 2 3 4 5 6 7 8 9 + = ?"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=HF_SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>",
                                        chat_template=CHAT_TEMPLATE)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in HF_SPECIALS}
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                  tie_word_embeddings=tied, eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<pad>"],
                  bos_token_id=None)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = ids["<pad>"]
    model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    tokenizer.save_pretrained(out)
    return out


def tree_sha256(root: Path) -> dict[str, str]:
    """SHA-256 of every file under `root`, by relative path."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


class PassThroughStore:
    """A real weight store behind a wrapper that tests override one call of (`read`, to damage
    or cut a transfer): every other call goes straight to the store."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.location = inner.location

    async def put(self, key, data):
        await self.inner.put(key, data)

    async def has(self, key):
        return await self.inner.has(key)

    async def delete(self, key):
        await self.inner.delete(key)

    async def list(self, prefix=""):
        return await self.inner.list(prefix)

    async def read(self, key):
        async for chunk in self.inner.read(key):
            yield chunk


def pid_of(worker_id: str) -> int | None:
    """The pid of the process started with `--worker-id worker_id` (a child of the run)."""
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                argv = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"--worker-id" in argv and argv[argv.index(b"--worker-id") + 1:][:1] == [worker_id.encode()]:
                return int(d)
    return None
