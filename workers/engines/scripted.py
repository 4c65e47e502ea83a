"""The scripted engine: a deterministic policy that writes text through a real tokenizer.

The emulated engine's tokens are random ids: they never form a tool call, so they cannot drive
an episode. This engine's turns are a function of the conversation so far, written in a real
tokenizer's tokens: `policy(context, seed)` returns the whole text of the next model turn (the
stop token is added), given the decoded context before that turn. Everything else is what a
real engine does: tokens come `max_tokens` per call, a stop event ends a call between steps,
`token_s` seconds pass per step, and the behaviour logprobs are a pure function of (seed,
position). So a turn resumed on another worker, from any token of it, continues with exactly
the tokens an undisturbed run makes: the turn is found again from the context (it starts after
the last of `boundary_ids`, tokens the policy never writes: a newline in the fallback chat
format's environment turns) and the policy is asked again.

What it is for: episodes end to end (tool calls, environment replies, preemption mid-turn and
mid-tool) with real NATS, Redis and worker processes, where a small model would call tools
only after training.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable

from rlboost.workers.engines.base import Engine, Generated, RequestError, Sequence

Policy = Callable[[str, int], str]


class ScriptedEngine(Engine):
    name = "scripted"

    def __init__(self, tokenizer, policy: Policy, token_s: float = 0.0, boundary: str = "\n") -> None:
        self.tokenizer, self.policy, self.token_s = tokenizer, policy, token_s
        ids = tokenizer(boundary, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"the boundary {boundary!r} must be one token of this tokenizer")
        self.boundary_ids = frozenset(ids)
        if tokenizer.eos_token_id is None:
            raise ValueError("the scripted engine needs a tokenizer with an EOS token (the end of a turn)")
        self.stop_id = int(tokenizer.eos_token_id)
        self.weights_id = "scripted-v0"
        self.steps, self.busy_s = 0, 0.0  # engine steps made and the wall time they took (bench agent)
        self._on_tokens: Callable[[int], None] | None = None

    def set_token_callback(self, fn: Callable[[int], None]) -> bool:
        self._on_tokens = fn
        return True

    def turn(self, seq: Sequence) -> tuple[int, list[int]]:
        """Where the turn under way starts in `seq.token_ids`, and all of its tokens."""
        context = list(seq.prompt_ids) + list(seq.token_ids)
        start = max((i + 1 for i, t in enumerate(context) if t in self.boundary_ids), default=0)
        start = max(start, len(seq.prompt_ids))
        text = self.policy(self.tokenizer.decode(context[:start], skip_special_tokens=False), seq.seed)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.stop_id]
        if self.boundary_ids & set(ids):
            raise RequestError(seq.request_id, "the policy wrote a boundary token")
        return start - len(seq.prompt_ids), ids

    @staticmethod
    def logprob(seed: int, position: int) -> float:
        h = hashlib.sha256(f"{seed}/{position}".encode()).digest()
        return -(int.from_bytes(h[:2], "big") % 1024) / 256.0  # exact in float32

    async def generate(self, batch: list[Sequence], max_tokens: int,
                       stop: threading.Event | None = None) -> list[Generated]:
        t0 = time.monotonic()
        plans = []
        for seq in batch:
            start, ids = self.turn(seq)
            done = len(seq.token_ids) - start
            room = max(0, seq.max_new_tokens - len(seq.token_ids))
            plans.append(ids[done:done + min(room, max_tokens)] if 0 <= done <= len(ids) else [])
        steps = max((len(p) for p in plans), default=0)
        made = 0
        for made in range(1, steps + 1):
            if self.token_s > 0:
                await asyncio.sleep(self.token_s)
            if self._on_tokens:
                self._on_tokens(sum(1 for p in plans if len(p) >= made))
            if stop is not None and stop.is_set():
                break
        self.steps += made
        self.busy_s += time.monotonic() - t0
        out = []
        for seq, plan in zip(batch, plans, strict=True):
            ids = plan[:made]
            at = len(seq.token_ids)
            n = at + len(ids)
            out.append(Generated(ids, [self.logprob(seq.seed, at + i) for i in range(len(ids))],
                                 bool(ids and ids[-1] == self.stop_id) or n >= seq.max_new_tokens or not plan))
        return out
