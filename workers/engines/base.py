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
from typing import TYPE_CHECKING

from rlboost.errors import RlboostError

if TYPE_CHECKING:
    from rlboost.weights.source import WeightSource


class EngineError(RlboostError, RuntimeError):
    """The engine as a whole failed: the worker drains (hands its requests to others)."""


class RequestError(EngineError):
    """One request the engine cannot serve (its context overflows, a token id is outside the
    vocabulary): that request gets an `error` result, the worker serves on."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id}: {reason}")
        self.request_id, self.reason = request_id, reason


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    seed: int
    max_new_tokens: int
    eos_id: int = -1
    stop_ids: list[int] = field(default_factory=list)  # every EOS id (with eos_id)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    token_ids: list[int] = field(default_factory=list)  # generated so far (resumed + new)

    @property
    def stops(self) -> frozenset[int]:
        return frozenset(self.stop_ids) | ({self.eos_id} if self.eos_id >= 0 else frozenset())

    def done(self) -> bool:
        return len(self.token_ids) >= self.max_new_tokens or (bool(self.token_ids) and self.token_ids[-1] in self.stops)


@dataclass(slots=True)
class Generated:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool


class Engine(abc.ABC):
    name: str = "engine"
    policy_version: int = 0
    # Which weights are loaded: the version's manifest digest once pulled from the weight
    # store (the worker sets it), "" for start-up weights of unknown provenance.
    weights_id: str = ""

    @abc.abstractmethod
    async def generate(self, batch: list[Sequence], max_tokens: int,
                       stop: threading.Event | None = None) -> list[Generated]:
        """Extend every sequence by up to `max_tokens` tokens (one `Generated` per sequence, in
        order). Return early, with the tokens made so far, once `stop` is set: that is how a
        worker with a preemption notice hands off without losing a token. Must not block the
        event loop for long: compute runs in a thread (`asyncio.to_thread`)."""

    def check(self, seq: Sequence) -> str | None:
        """Why this engine cannot serve `seq` (None: it can). Called before a request is
        admitted, so a bad request gets its `error` result instead of failing a whole batch."""
        return None

    def set_token_callback(self, fn: Callable[[int], None]) -> bool:
        """Ask the engine to report tokens as each step produces them (crash-proof counting of
        what a killed worker had generated). Returns False if it only reports per call."""
        return False

    async def load_weights(self, weights_dir: Path, version: int) -> None:
        """Swap in the weights of `version` from a directory of verified safetensors shards."""
        self.policy_version = version

    def weight_source(self) -> WeightSource | None:
        """Where this engine's versions come from when its owner names none: nowhere (a real
        engine serves its start-up weights only); the emulated engine's are virtual."""
        return None

    async def close(self) -> None:
        return None
