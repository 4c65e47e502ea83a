"""The emulated engine: takes the time an H100 would take, computes nothing.

Everything around it is real (NATS, Redis, processes, signals, hand-offs); only the GPU is
replaced by a timing model, so a 2-core box can run a fleet of "H100" workers honestly.
Tokens, logprobs and response lengths are pure functions of (seed, position), so
a request resumed on another worker continues with exactly the tokens it would have produced.

Timing model constants (defaults: one H100 SXM serving an 8B dense model, bf16, vLLM-style
continuous batching; Llama-3-8B shape: 32 layers, 8 KV heads x 128 dims):
- `step_base_s` 6 ms: a decode step streams all 16 GB of weights from HBM at 3.35 TB/s
  (4.8 ms) plus kernel-launch/scheduler overhead; matches the ~150-200 tok/s single-stream
  decode reported for 8B models on one H100.
- `step_per_seq_s` 35 us: 2 x 8e9 FLOP per token at ~46% of the 989 TFLOP/s bf16 peak.
- `step_per_ctx_token_s` 40 ns: each context token's KV (2 x 32 x 8 x 128 x 2 B = 128 KiB) is
  read once per step at 3.35 TB/s.
- `prefill_per_token_s` 30 us: prompt (and resumed prefix) tokens cost like decode compute,
  without the per-step weight read. A resumed request re-prefills its prefix: that is the real
  cost of migration.
Response lengths are log-normal (median 1,500, sigma 1.0, capped at 14,336), the long tail of
reasoning RL rollouts (DESIGN §1, §5). `rlboost bench trace` calibrates the fleet against the
published throughputs (issue 6); these defaults are the single-GPU physics.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rlboost.weights.source import EmulatedWeights
from rlboost.workers.engines.base import Engine, Generated, Sequence

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class TimingModel:
    step_base_s: float = 6.0e-3
    step_per_seq_s: float = 3.5e-5
    step_per_ctx_token_s: float = 4.0e-8
    prefill_per_token_s: float = 3.0e-5

    def decode_step(self, batch: int, context_tokens: int) -> float:
        return self.step_base_s + self.step_per_seq_s * batch + self.step_per_ctx_token_s * context_tokens

    def prefill(self, tokens: int) -> float:
        return self.prefill_per_token_s * tokens

    def per_emulated_token(self, scale: int) -> TimingModel:
        """Each emulated token stands for `scale` modelled tokens (so the wire carries 1/scale of
        the messages): an emulated step is `scale` decode steps, and each emulated context token
        is `scale` tokens read in each of them."""
        return TimingModel(self.step_base_s * scale, self.step_per_seq_s * scale,
                           self.step_per_ctx_token_s * scale * scale, self.prefill_per_token_s * scale)

    def on_gpus(self, gpus: int) -> TimingModel:
        """`gpus` data-parallel replicas behind one engine: the batch and its KV reads are split
        between them, the per-step weight read is paid by each in parallel."""
        return TimingModel(self.step_base_s, self.step_per_seq_s / gpus, self.step_per_ctx_token_s / gpus,
                           self.prefill_per_token_s / gpus)


@dataclass(frozen=True)
class LengthModel:
    median: float = 1500.0
    sigma: float = 1.0
    max_tokens: int = 14336

    def per_emulated_token(self, scale: int) -> LengthModel:
        return LengthModel(self.median / scale, self.sigma, max(1, self.max_tokens // scale))

    def length(self, seed: int, request_id: str) -> int:
        u = (_key(seed, salt=0x5EED) >> 11) / float(1 << 53)
        z = _normal_ppf(min(max(u, 1e-12), 1 - 1e-12))
        return int(min(self.max_tokens, max(1, round(self.median * math.exp(self.sigma * z)))))


def _key(seed: int, salt: int = 0) -> int:
    """The seed is the sampling key (engines/base.py); the request id is not part of it."""
    x = np.array([(seed * 0x9E3779B97F4A7C15 + salt) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
    return int(_splitmix(x)[0])


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


def _normal_ppf(p: float) -> float:
    """Acklam's rational approximation of the standard normal quantile (|error| < 1.2e-9)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02, 1.383577518672690e02,
         -3.066479806614716e01, 2.506628274631000e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02, 6.680131188771972e01,
         -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00, -2.549671010422700e00,
         4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00, 3.754408661907416e00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
               ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - 0.02425:
        return -_normal_ppf(1 - p)
    q = p - 0.5
    r = q * q
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
           (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


def _weights_key(seed: int, policy_version: int) -> int:
    """The emulated "weights" of a version shape its tokens (version 0: the plain seed key), so
    tokens generated with another version's weights than the request names show up as a
    mismatch against the reference, exactly as they would with a real model."""
    return _key(seed, salt=0) if policy_version == 0 else _key(seed, salt=0x7E45 * policy_version)


def reference_tokens(seed: int, request_id: str, start: int, n: int, vocab: int = 32000,
                     policy_version: int = 0) -> tuple[list[int], list[float]]:
    """Tokens [start, start+n) of a request and their logprobs: what any worker produces."""
    ((toks, lps),) = _tokens_for([_weights_key(seed, policy_version)], [start], [n], vocab)
    return toks, lps


def _tokens_for(keys: list[int], starts: list[int], counts: list[int], vocab: int) -> list[tuple[list[int], list[float]]]:
    """Vectorised over a whole batch: one numpy pass instead of one per sequence."""
    counts_a = np.asarray(counts, dtype=np.int64)
    which = np.repeat(np.arange(len(counts)), counts_a)
    first = np.repeat(np.cumsum(counts_a) - counts_a, counts_a)
    pos = np.asarray(starts, dtype=np.int64)[which] + (np.arange(len(which)) - first)
    h = _splitmix(pos.astype(np.uint64) + np.asarray(keys, dtype=np.uint64)[which])
    tokens = (h % np.uint64(vocab)).astype(np.int64).tolist()
    logprobs = (-((h >> np.uint64(40)) % np.uint64(4096)).astype(np.float32) / np.float32(1024.0)).tolist()
    out, at = [], 0
    for c in counts:
        out.append((tokens[at:at + c], logprobs[at:at + c]))
        at += c
    return out


def target_length(seq: Sequence, lengths: LengthModel) -> int:
    return min(seq.max_new_tokens, lengths.length(seq.seed, seq.request_id))


class EmulatedEngine(Engine):
    """`speed` > 1 runs that many times faster than the modelled GPU; 0 = no sleeping at all."""

    name = "emulated"

    def __init__(self, speed: float = 1.0, timing: TimingModel | None = None, lengths: LengthModel | None = None,
                 vocab: int = 32000, on_tokens: Callable[[int], None] | None = None) -> None:
        self.speed = speed
        self.timing = timing or TimingModel()
        self.lengths = lengths or LengthModel()
        self.vocab = vocab
        self.on_tokens = on_tokens  # called as tokens come off each emulated step
        self.weights_id = "emulated-v0"
        self._prefilled: set[str] = set()  # request ids whose KV cache this engine holds
        self._kv_version = 0  # the version that KV cache was computed with
        self._gpu_free_at: float | None = None  # wall clock when the last call's modelled GPU work ended
        self._last_gpu_s = 0.0  # real duration of the last call's modelled GPU work
        # Per sequence of the batch: (request id, seed, max new, version) -> (target length, key).
        # Both are pure functions of that tuple; computed once per request, not once per call
        # (at unlimited speed they were most of this engine's cost).
        self._per_seq: dict[tuple[str, int, int, int], tuple[int, int]] = {}

    def set_token_callback(self, fn: Callable[[int], None]) -> bool:
        self.on_tokens = fn
        return True

    def weight_source(self) -> EmulatedWeights:
        return EmulatedWeights()

    async def _pace(self, batch: list[Sequence], remaining: list[int], steps: int,
                    stop: threading.Event | None, t0: float) -> int:
        """Take the modelled time of `steps` decode steps (vectorised: live count and context
        of every step from the sorted remaining lengths), in slices of >= 2 ms so a kill or a
        stop lands between steps. Returns the steps completed; tokens count as generated once
        their step's time has passed."""
        rem = np.asarray(remaining, dtype=np.int64)
        order = np.argsort(rem, kind="stable")
        rem_sorted = rem[order]
        ctx_sorted = np.asarray([len(s.prompt_ids) + len(s.token_ids) for s in batch], dtype=np.float64)[order]
        suffix = np.concatenate([np.cumsum(ctx_sorted[::-1])[::-1], [0.0]])
        j = np.arange(steps)
        first_live = np.searchsorted(rem_sorted, j, side="right")  # sequences still generating at step j
        live = len(batch) - first_live
        t = self.timing
        step_s = t.step_base_s + t.step_per_seq_s * live + t.step_per_ctx_token_s * (suffix[first_live] + j * live)
        cum = np.cumsum(step_s) / self.speed
        cum_tokens = np.cumsum(live)
        # Paced against the wall clock from `t0`, not by summing sleeps: a late wake-up (a busy
        # event loop) is caught up on the next slice instead of accumulating.
        at = 0
        while at < steps and not (stop is not None and stop.is_set()):
            now = time.monotonic() - t0
            end = min(steps, max(at + 1, int(np.searchsorted(cum, now + 0.002, side="left")) + 1))
            delay = float(cum[end - 1]) - (time.monotonic() - t0)
            await asyncio.sleep(max(0.0, delay))
            if self.on_tokens:
                self.on_tokens(int(cum_tokens[end - 1] - (cum_tokens[at - 1] if at else 0)))
            at = end
        self._gpu_free_at = t0 + (float(cum[at - 1]) if at else 0.0)
        return at

    async def _sleep(self, seconds: float) -> None:
        if self.speed > 0 and seconds > 0:
            await asyncio.sleep(seconds / self.speed)

    async def generate(self, batch: list[Sequence], max_tokens: int,
                       stop: threading.Event | None = None) -> list[Generated]:
        now = time.monotonic()
        if self._kv_version != self.policy_version:  # new weights: no KV of the old ones is reused
            self._prefilled.clear()  # (vLLM resets its prefix cache likewise): prefilled again
            self._kv_version = self.policy_version
        ids = {s.request_id for s in batch}
        continuing = bool(self._prefilled & ids)
        self._prefilled &= ids  # sequences that left the batch free their KV cache
        cold = [s for s in batch if s.request_id not in self._prefilled]
        prefill_s = self.timing.prefill(sum(len(s.prompt_ids) + len(s.token_ids) for s in cold))
        self._prefilled |= {s.request_id for s in cold}
        # Host and GPU overlap (a pipelined engine, like vLLM's async scheduling): the host work
        # between two calls on a continuing batch (checkpoint flush, results, admissions) ran
        # while the GPU kept decoding, up to one call's worth of GPU time. Without this, a
        # compressed run (speed S) would charge every host millisecond S times.
        t0 = now
        if continuing and self._gpu_free_at is not None:
            t0 = max(now - self._last_gpu_s, min(now, self._gpu_free_at))

        per_seq = {}
        for s in batch:
            k = (s.request_id, s.seed, s.max_new_tokens, self.policy_version)
            per_seq[k] = self._per_seq.get(k) or (target_length(s, self.lengths), _weights_key(s.seed, self.policy_version))
        self._per_seq = per_seq  # sequences that left the batch are forgotten
        known = list(per_seq.values())
        remaining = [max(0, n - len(s.token_ids)) for s, (n, _) in zip(batch, known, strict=True)]
        steps = min(max_tokens, max(remaining, default=0))
        if not continuing and self.speed > 0:
            # A batch forming from scratch: admissions are still landing. Like a continuous-
            # batching scheduler (new requests join at every step), return after one step so the
            # next call takes everyone who arrived meanwhile.
            steps = min(steps, 1)
        if self.speed <= 0:
            done_steps = steps
        else:
            start = t0 + prefill_s / self.speed
            done_steps = await self._pace(batch, remaining, steps, stop, start)
            self._last_gpu_s = self._gpu_free_at - t0
        done = [min(r, done_steps) for r in remaining]
        if self.speed <= 0 and self.on_tokens:
            self.on_tokens(sum(done))
        made = _tokens_for([key for _, key in known],
                           [len(s.token_ids) for s in batch], done,
                           self.vocab)
        return [Generated(t, lp, n >= rem)
                for (t, lp), n, rem in zip(made, done, remaining, strict=True)]
