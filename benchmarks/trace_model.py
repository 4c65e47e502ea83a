"""The timing model of `rlboost bench trace` alone: the emulated fleet's constants, their
sources, the calibration, and the model-only step times (no wire, no host work) that bound
what the real system can measure.

Timing constants and their sources:
- decode/prefill: workers/engines/emulated.py (H100 SXM bandwidth and FLOPs for an 8B model);
  one 8-GPU step of this workload takes ~131 modelled s of rollout, ~86 s of which is the
  latency of the longest (14,336-token) responses at ~6 ms per decode step (`model_step_s`).
- `TRAIN_S_PER_TOKEN` = 3.6e-5 s per trained token on 8 GPUs (~86 s per 2.4M-token step),
  calibrated so reserved-only colocated measures ~10K tokens/s through the real wire at the
  default speed (`--calibrate`: 10,214). Cross-check: fwd+bwd (6 x 8e9 FLOP per token) plus the
  reference and old-policy forward passes (~10 x 8e9 FLOP in all) at ~28% MFU of 8 x 989
  TFLOP/s gives 3.6e-5 s/token; rollout is ~63% of the colocated step (published: over 70%).
- weights: the emulated engine's weights are virtual; a node's provisioning delay is its real
  process start-up (interpreter, connections, first heartbeat: ~0.5-2 s real, x S modelled,
  reported as `provision_s_p50`), standing for an instance's engine start and weight pull.
  Nodes already up when the segment starts were provisioned before it and start before the clock.
- prices: $10.47 per reserved GPU-hour, $2.66 per preemptible GPU-hour (RLBoost evaluation);
  reserved GPUs are charged for the whole run, each instance for its rented uptime.

Calibration (`--calibrate`: 900 modelled s each at S=20, Nov 2026 on this 2-core box), in
tokens/s, measured / published / timing model alone (`model_step_s`, `model_hybrid_throughput`:
no host work, best T_seed):
  reserved only   10.2K / ~10K / 11.0K
  + 1 instance    12.8K /  12K / 14.3K
  + 2 instances   14.4K /  14K / 16.4K
  + 3 instances   15.9K /  16K / 17.5K
  + 4 instances   16.1K /  18K / 18.3K
The model's own returns diminish: rollout is latency-bound (the longest responses take ~86 s at
any GPU count) and a group can only be trained when its slowest sample is done. The measured
gap to the model is the real system at compressed time: hand-offs, admissions and flushes on
two shared cores, which weigh more with every worker process added.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from rlboost.workers.engines.emulated import LengthModel, TimingModel

RESERVED_GPUS, INSTANCE_GPUS = 8, 2
SLOTS_PER_GPU = 128
TRAIN_S_PER_TOKEN = 3.6e-5  # per trained token on the 8 reserved GPUs (see the module docstring)
PROMPT_TOKENS, MAX_NEW_TOKENS = 256, 14336
PUBLISHED = {"reserved_only": 10_000, "static": {1: 12_000, 2: 14_000, 3: 16_000, 4: 18_000},
             "throughput_ratio": [1.51, 1.97], "cost_efficiency_gain": [0.28, 0.49]}


def seed_of(step: int, prompt: int, sample: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{step}/{prompt}/{sample}".encode(), digest_size=4).digest(), "little")


def modelled_lengths(step: int, prompts: int, samples: int) -> np.ndarray:
    lm = LengthModel()
    return np.array([[lm.length(seed_of(step, p, g), "") for g in range(samples)] for p in range(prompts)])


def model_step_s(rollout_gpus: int, train_gpus: int, streamed: bool, step: int = 0, prompts: int = 128,
                 samples: int = 8) -> float:
    """The timing model alone (no wire): a step on `rollout_gpus` generating and `train_gpus`
    training, either after the rollout (colocated) or streamed group by group."""
    lens = modelled_lengths(step, prompts, samples)
    flat = np.sort(lens.ravel())
    t = TimingModel().on_gpus(rollout_gpus)
    j = np.arange(flat.max())
    first = np.searchsorted(flat, j, side="right")
    live = len(flat) - first
    ctx = np.concatenate([np.cumsum((PROMPT_TOKENS + 0 * flat)[::-1])[::-1], [0]])
    step_s = t.step_base_s + t.step_per_seq_s * live + t.step_per_ctx_token_s * (ctx[first] + j * live)
    done_at = t.prefill(PROMPT_TOKENS * len(flat)) + np.cumsum(step_s)  # done_at[n-1]: n tokens made
    per_token = TRAIN_S_PER_TOKEN * RESERVED_GPUS / train_gpus
    if not streamed:
        return float(done_at[-1] + lens.sum() * per_token)
    trainer = 0.0
    for g in sorted(range(prompts), key=lambda g: lens[g].max()):
        trainer = max(trainer, float(done_at[lens[g].max() - 1])) + lens[g].sum() * per_token
    return trainer


def _finish_times(t: TimingModel, seqs: list[list], t_start: float, t_stop: float = math.inf,
                  joins: list[tuple[float, list]] = ()) -> tuple[dict, list[list]]:
    """One engine, continuous batching, no host overhead: `seqs` are [id, remaining, context];
    `joins` (time, seq) arrive later and are prefilled. Returns finish times by id and what was
    still running at `t_stop`."""
    now = t_start + t.prefill(sum(q[2] for q in seqs))
    active, done, pending = [list(q) for q in seqs], {}, sorted(joins, key=lambda j: j[0])
    while active or pending:
        if pending and (not active or pending[0][0] <= now):
            now = max(now, pending[0][0])
            arrived = []
            while pending and pending[0][0] <= now:
                arrived.append(list(pending.pop(0)[1]))
            now += t.prefill(sum(q[2] for q in arrived))
            active += arrived
            continue
        if now >= t_stop:
            return done, active
        k = min(q[1] for q in active)  # decode steps until the next sequence finishes ...
        live, ctx = len(active), sum(q[2] for q in active)
        steps = t.step_base_s + t.step_per_seq_s * live + t.step_per_ctx_token_s * (ctx + np.arange(k) * live)
        cum = now + np.cumsum(steps)
        limit = min(t_stop, pending[0][0] if pending else math.inf)  # ... or a join or the stop
        if cum[-1] > limit:
            k = min(k, int(np.searchsorted(cum, limit)) + 1)
        now = float(cum[k - 1])
        for q in active:
            q[1], q[2] = q[1] - k, q[2] + k
        done.update((q[0], now) for q in active if q[1] <= 0)
        active = [q for q in active if q[1] > 0]
    return done, []


def model_hybrid_step_s(instances: int, t_seed: float, step: int = 0, prompts: int = 128, samples: int = 8) -> float:
    """The timing model alone (no wire, no host work): a hybrid step with `instances` static
    instances, dispatch by capacity, hand-off at `t_seed`, groups trained as they complete.
    What the physics allows; the bench's measured figures are this plus the real system."""
    lens = modelled_lengths(step, prompts, samples)
    ids = [(p, g) for p in range(prompts) for g in range(samples)]
    n = len(ids)
    share = math.ceil(n * RESERVED_GPUS / (RESERVED_GPUS + INSTANCE_GPUS * instances))
    mine = set(np.linspace(0, n - 1, share).round().astype(int).tolist())
    done, left = _finish_times(TimingModel().on_gpus(RESERVED_GPUS),
                               [[q, int(lens[q]), PROMPT_TOKENS] for i, q in enumerate(ids) if i in mine], 0.0, t_seed)
    seeding_ends = t_seed if left else max(done.values())
    rest = [q for i, q in enumerate(ids) if i not in mine]
    for k in range(instances):
        more, _ = _finish_times(TimingModel().on_gpus(INSTANCE_GPUS),
                                [[q, int(lens[q]), PROMPT_TOKENS] for q in rest[k::instances]],
                                0.0, joins=[(seeding_ends, q) for q in left[k::instances]])
        done.update(more)
    group_done = {p: max(done[(p, g)] for g in range(samples)) for p in range(prompts)}
    trainer = seeding_ends
    for p in sorted(group_done, key=group_done.get):
        trainer = max(trainer, group_done[p]) + lens[p].sum() * TRAIN_S_PER_TOKEN
    return trainer


def model_hybrid_throughput(instances: int, t_seeds: tuple[float, ...] = (15, 30, 45, 60, 75, 90, 120),
                            prompts: int = 128, samples: int = 8) -> float:
    """Tokens/s of the model-only hybrid step at its best T_seed: the physics bound."""
    tokens = float(modelled_lengths(0, prompts, samples).sum())
    return tokens / min(model_hybrid_step_s(instances, t, prompts=prompts, samples=samples) for t in t_seeds)


def generation_gpu_s(lengths, token_scale: int = 1, timing: TimingModel | None = None) -> float:
    """The fewest GPU-seconds the emulated engines can generate these responses in (modelled
    lengths; `token_scale` modelled tokens per emulated token, as the bench runs them): every
    decode step full (SLOTS_PER_GPU sequences per GPU share its weight read), each response's
    context (prompt and what it has made) read once in each of its steps, its prompt prefilled
    once. Engine-seconds x GPUs is the same on any GPU count (`TimingModel.on_gpus`). Any real
    schedule takes more: partial batches, hand-offs (a resumed prefix is prefilled again),
    tokens generated twice or never trained."""
    t = timing or TimingModel()
    n = np.asarray(lengths, dtype=np.float64)
    per_seq = (n * (t.step_base_s / SLOTS_PER_GPU + t.step_per_seq_s)
               + t.step_per_ctx_token_s * (n * PROMPT_TOKENS + n * (n - token_scale) / 2)
               + t.prefill_per_token_s * PROMPT_TOKENS)
    return float(per_seq.sum())


def throughput_bound(tokens: float, generation_s: float, instances: float, overlap_tokens: float = 0.0,
                     s_per_token: float = TRAIN_S_PER_TOKEN) -> dict[str, float]:
    """What no hybrid run can exceed, by construction, having trained `tokens` whose generation
    takes at least `generation_s` GPU-seconds (`generation_gpu_s`) with `instances` rented on
    average. Over its T seconds:
    - trainer: the 8 reserved GPUs train one group at a time, `s_per_token` each token, so
      T >= s_per_token x tokens: at most 1 / s_per_token tokens/s (27.8K), with rollout never waiting;
    - generation: each trained token was generated, on the instances (INSTANCE_GPUS x n x T
      GPU-seconds at most) or on the reserved GPUs, which generate only in a step's seeding
      window, before its trainer starts (the step trains after the hand-off), so at most
      RESERVED_GPUS x (T - s_per_token x tokens). Hence
      tokens/T <= (8 + 2n) x tokens / (generation_s + 8 x s_per_token x tokens).
    `overlap_tokens`: tokens of steps where the reserved engines may have generated while the
    trainer trained (a fallback, or no hand-off): their training time is not taken from the
    reserved GPUs' generation time. The linear oracle is no such bound: it rates an instance's
    GPU at colocated's per-GPU rate, which pays for training and the latency tail."""
    trainer = 1.0 / s_per_token
    busy = RESERVED_GPUS * s_per_token * max(0.0, tokens - overlap_tokens)
    gpus = RESERVED_GPUS + INSTANCE_GPUS * instances
    generation = gpus * tokens / (generation_s + busy) if tokens > 0 and generation_s + busy > 0 else trainer
    return {"bound": min(trainer, generation), "trainer_bound": trainer, "generation_bound": generation}


def balanced_split() -> int:
    """Rollout GPUs of the best disaggregated split of the reserved cluster (timing model)."""
    return min(range(1, RESERVED_GPUS), key=lambda k: model_step_s(k, RESERVED_GPUS - k, streamed=True))


def availability_bound(ivs, duration_s: float, gen_s_per_token: float, reserved_only: float,
                       s_per_token: float = TRAIN_S_PER_TOKEN) -> dict[str, float]:
    """The availability-aware bound of a hybrid run on a trace (tokens/s over the segment): at
    each moment, with n preemptible instances available (offered by the trace, rented or not),
    - n = 0: `reserved_only`, the reserved cluster alone (colocated's rate);
    - else min(the trainer with rollout never waiting (1 / s_per_token), the generation those n
      instances and the reserved GPUs allow: (8 + 2n) / (gen_s_per_token + 8 x s_per_token),
      `throughput_bound`'s generation term at n instances, per token),
    integrated over the segment. Unlike `throughput_bound` it charges a run for the minutes the
    trace offers nothing and credits what it offered but the run did not rent; unlike the linear
    oracle it is a bound. `ivs`: the trace's availability intervals (`spot.intervals`)."""
    edges = sorted({0.0, duration_s, *(t for i in ivs for t in (i.up_s, i.down_s) if 0.0 <= t <= duration_s)})
    trainer = 1.0 / s_per_token
    tokens = 0.0
    zero_s = 0.0
    for a, b in zip(edges, edges[1:]):
        n = sum(1 for i in ivs if i.up_s <= a < i.down_s)
        if n == 0:
            rate = reserved_only
            zero_s += b - a
        else:
            rate = min(trainer, (RESERVED_GPUS + INSTANCE_GPUS * n) / (gen_s_per_token + RESERVED_GPUS * s_per_token))
        tokens += rate * (b - a)
    return {"availability_bound": tokens / duration_s if duration_s > 0 else 0.0,
            "none_available_s": zero_s}
