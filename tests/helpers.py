"""Helpers shared by test modules (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from rlboost import wire
from trainer.model import build_model, build_tokenizer, save
from trainer.tasks import Addition
from workers.engines.base import EngineError, Sequence


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
    sub = await js.subscribe(wire.result_subject(step), ordered_consumer=True)
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
