"""The engine interface: a batch of sequences, each with its token prefix -> next tokens.

The worker owns scheduling (which requests are in the batch, checkpoints, hand-offs); an engine
only extends sequences. `generate` is called with the current batch and a token budget; it
returns up to `max_tokens` new tokens per sequence, with their behaviour logprobs, and whether
the sequence finished (stop token or its max_new_tokens). Between calls the worker may add or
drop sequences: continuous batching at the granularity of one call.

Determinism contract: the token at position i of a request depends only on (seed, i,
prompt + tokens before i, weights) — never on which other sequences share the batch, nor on
the request id — so a request resumed on another worker continues exactly as it would have,
and a rerun of the same seeds reproduces the same rollout. The request's `seed` is its sampling
key: the manager derives a distinct one per (run seed, step, prompt, sample).
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class EngineError(RuntimeError):
    pass


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    seed: int
    max_new_tokens: int
    eos_id: int = -1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    token_ids: list[int] = field(default_factory=list)  # generated so far (resumed + new)


@dataclass
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool


class Engine(abc.ABC):
    name: str = "engine"
    policy_version: int = 0

    @abc.abstractmethod
    async def generate(self, batch: list[Sequence], max_tokens: int,
                       stop: threading.Event | None = None) -> list[Generated]:
        """Extend every sequence by up to `max_tokens` tokens (one `Generated` per sequence, in
        order). Return early, with the tokens made so far, once `stop` is set: that is how a
        worker with a preemption notice hands off without losing a token. Must not block the
        event loop for long: compute runs in a thread (`asyncio.to_thread`)."""

    def set_token_callback(self, fn: Callable[[int], None]) -> bool:
        """Ask the engine to report tokens as each step produces them (crash-proof counting of
        what a killed worker had generated). Returns False if it only reports per call."""
        return False

    async def load_weights(self, weights_dir: Path, version: int) -> None:
        """Swap in the weights of `version` from a directory of verified safetensors shards."""
        self.policy_version = version

    async def close(self) -> None:
        return None
