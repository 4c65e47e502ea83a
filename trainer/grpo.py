"""GRPO as a pure library: advantages, per-token logprobs, and the clipped policy loss.

No loop, no optimizer, no I/O: the trainer streams completed responses in micro-batches and
calls these functions; the optimizer step happens once the whole batch has been consumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch


def group_advantages(rewards: Sequence[float] | torch.Tensor, groups: Sequence[int] | torch.Tensor,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps) for each response, grouped by prompt.

    The population std (divide by n) is used, so a group of one response (or one where all
    rewards are equal) gets advantage 0, never NaN: it carries no signal about which sample
    was better."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    _, g = torch.unique(torch.as_tensor(groups), return_inverse=True)
    n = torch.zeros(int(g.max()) + 1, dtype=torch.float64).index_add_(0, g, torch.ones_like(r))
    mean = torch.zeros_like(n).index_add_(0, g, r) / n
    var = torch.zeros_like(n).index_add_(0, g, (r - mean[g]) ** 2) / n
    std = var.sqrt()[g]
    adv = torch.where(std > 0, (r - mean[g]) / (std + eps), torch.zeros_like(r))
    return adv.to(torch.float32)


def turn_advantages(turn_rewards: Sequence[Sequence[float | None] | None], eps: float = 1e-6) -> list[list[float]]:
    """Per episode of one group, per model turn t: (r_t - mean_t) / (std_t + eps) over the
    group's episodes that reached turn t (population std; 0 where they all agree, or where an
    episode is alone at its turn). A missing reward (None, or no list at all) counts as 0."""
    rows = [[float(x or 0.0) for x in (r or [])] for r in turn_rewards]
    out = [[0.0] * len(r) for r in rows]
    for t in range(max((len(r) for r in rows), default=0)):
        at = [i for i, r in enumerate(rows) if t < len(r)]
        vals = [rows[i][t] for i in at]
        mean = sum(vals) / len(vals)
        std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
        if std > 0:
            for i in at:
                out[i][t] = (rows[i][t] - mean) / (std + eps)
    return out


def token_logprobs(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]],
                   temperature: float = 1.0, pad_id: int = 0, with_entropy: bool = False,
                   entropy_grad: bool = False, device: torch.device | str | None = None) -> tuple[torch.Tensor, ...]:
    """Logprobs of each response token under `model`, batched: (logprobs, mask[, entropy]), each
    (batch, longest response), zero where mask is 0. `entropy` (of the sampling distribution at
    each response position) is returned when `with_entropy`; it is differentiable only with
    `entropy_grad` (an entropy bonus), since its graph holds a second full-vocab tensor.

    Sequences are right-padded, so real tokens keep positions 0..n-1 as in generation. Logits
    are divided by the sampling temperature, so the result is comparable with the engine's
    behaviour logprobs. Memory: the head runs only on the positions from the shortest prompt's
    last token on (`logits_to_keep`), and logprob = logit - logsumexp(logits) reads the logits
    in place: one (batch, positions, vocab) tensor, not the two or three copies a gather +
    log_softmax would hold for backward. Gradients flow unless the caller wraps this in
    `torch.no_grad()`."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    rows = [p + r for p, r in zip(prompts, responses, strict=True)]
    width, longest = max(map(len, rows)), max(1, max(map(len, responses)))
    first = min(map(len, prompts)) - 1  # the first position whose logits predict a response token
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    where = torch.zeros((len(rows), longest), dtype=torch.long)  # kept-logit index predicting each token
    mask = torch.zeros((len(rows), longest))
    targets = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        attn[b, : len(p) + len(r)] = 1
        where[b, : len(r)] = torch.arange(len(p) - 1 - first, len(p) + len(r) - 1 - first)
        mask[b, : len(r)] = 1.0
        targets[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    if device is not None:
        ids, attn, where, mask, targets = (t.to(device) for t in (ids, attn, where, mask, targets))
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=width - first, use_cache=False).logits
    if temperature != 1.0:
        logits = logits / temperature  # the head's own output is then freed: still one copy held
    picked = logits.gather(1, where[:, :, None].expand(-1, -1, logits.size(-1)))  # (B, T, V) of kept positions
    del logits
    if picked.dtype not in (torch.float32, torch.float64):  # bf16/fp16 compute: reduce in fp32
        picked = picked.float()
    lse = torch.logsumexp(picked, dim=-1)
    logp = picked.gather(2, targets[:, :, None])[:, :, 0] - lse
    mask = mask.to(logp.dtype)
    if not with_entropy:
        return logp * mask, mask
    # H = lse - sum(p * logit), p = exp(logit - lse): differentiable, for an entropy bonus
    with nullcontext() if entropy_grad else torch.no_grad():
        probs = torch.exp(picked - lse[:, :, None])
        entropy = lse - (probs * picked).sum(-1)
    return logp * mask, mask, entropy * mask


OFF_POLICY = ("none", "tis", "decoupled")


@dataclass
class LossStats:
    loss: float
    policy_loss: float
    kl: float
    entropy: float
    clip_fraction: float
    ratio_mean: float  # of the ratio the clip acts on (none: pi/mu; tis, decoupled: pi/pi_old)
    tokens: int
    # the behaviour ratio pi_old/mu before truncation, in every mode (none: only reported)
    is_ratio_mean: float = 1.0
    is_ratio_max: float = 1.0
    is_capped_fraction: float = 0.0  # tokens whose behaviour ratio exceeds is_cap
    staleness_mean: float = 0.0  # policy versions behind, over the tokens whose version is known
    staleness_max: int = -1  # -1: no token's version known
    versioned_tokens: int = 0


def behaviour_weights(log_ratio: torch.Tensor, off_policy: str, is_cap: float) -> torch.Tensor:
    """Per-token weight of the policy gradient from log(pi_old/mu). `tis` truncates at is_cap
    (verl); `decoupled` drops the token above it (AReaL): a weight of 0. A NaN ratio (a
    behaviour logprob that is not a number) weighs 0 in both: nothing is known of that token."""
    w = torch.exp(log_ratio)
    if off_policy == "tis":
        return torch.where(torch.isnan(w), torch.zeros_like(w), w.clamp(max=is_cap))
    if off_policy == "decoupled":
        return torch.where(w <= is_cap, w, torch.zeros_like(w))  # NaN <= cap is False: dropped too
    raise ValueError(f"off_policy {off_policy!r}: use {', '.join(OFF_POLICY)}")


def grpo_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, ref_logprobs: torch.Tensor | None = None,
              kl_coef: float = 0.0, num_tokens: float | None = None, entropy: torch.Tensor | None = None,
              entropy_coef: float = 0.0, off_policy: str = "none", is_cap: float = 2.0,
              proximal_logprobs: torch.Tensor | None = None,
              staleness: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
    """PPO-clipped surrogate, plus an optional KL to a reference, minus an optional entropy
    bonus, averaged over tokens.

    Shapes: logprobs/behaviour/ref/mask (batch, T); advantages (batch,), one per response, or
    (batch, T), one per token (an episode whose turns carry rewards of their own).
    `mask` is the trainable mask: 1 on a token the loss trains, 0 on padding and on an
    episode's environment tokens (`grpo_trainer.trained_mask`): a masked token adds no loss,
    no ratio, KL or entropy term and no gradient, and is not counted in any statistic.
    `off_policy = "none"`: per token -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A) with
    ratio = exp(logp - behaviour), the behaviour logprobs mu being the sampling engine's.
    `tis` / `decoupled`: the ratio is taken against the proximal policy pi_old instead
    (`proximal_logprobs`, default `logprobs.detach()`: the trainer takes one optimizer step per
    batch, so the forward that builds the gradient *is* the policy at the step's start and no
    second pass is needed), and each token's term is multiplied by `behaviour_weights`
    (pi_old/mu truncated or dropped at `is_cap`): tokens sampled by an older version, or by an
    engine whose numerics differ, each get their own importance weight from their own mu.
    With mu == pi_old the weight is exactly 1 and all three modes give the same loss and gradient.
    KL: kl_coef * (exp(ref - logp) - (ref - logp) - 1) (the k3 estimator: unbiased, >= 0).
    `num_tokens` is the denominator of the token mean: pass the token count of the whole
    batch when it is split into micro-batches whose gradients are accumulated, so the sum of
    micro-batch losses equals the loss of the whole batch. `staleness` (batch, T): policy
    versions between each token's sampler and the trained policy, -1 where unknown; statistics only."""
    mask = mask.to(logprobs.dtype)
    denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
    denom = max(denom, 1.0)
    adv = advantages.to(logprobs.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv  # one per response, or one per token (turn credit)
    behaviour = behaviour_logprobs.to(logprobs.dtype)
    prox = logprobs.detach() if proximal_logprobs is None else proximal_logprobs.to(logprobs.dtype).detach()
    weight = None
    if off_policy == "none":
        ratio = torch.exp(logprobs - behaviour)
    else:
        ratio = torch.exp(logprobs - prox)
        weight = behaviour_weights(prox - behaviour, off_policy, is_cap)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if weight is not None:
        per_token = per_token * weight
    policy = (per_token * mask).sum() / denom
    kl = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None:
        d = ref_logprobs.to(logprobs.dtype) - logprobs
        kl = ((torch.exp(d) - d - 1.0) * mask).sum() / denom
    loss = policy + kl_coef * kl
    ent = torch.zeros((), dtype=logprobs.dtype)
    if entropy is not None:
        ent = (entropy.to(logprobs.dtype) * mask).sum() / denom
        if entropy_coef:
            loss = loss - entropy_coef * ent
    n = max(float(mask.sum()), 1.0)
    with torch.no_grad():
        # tokens whose gradient the clip removed: the ones PPO stops pushing further
        is_clipped = (((ratio > 1.0 + clip_eps) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))).to(mask.dtype)
        real = mask > 0
        w_raw = torch.exp(prox - behaviour)
        w_real = w_raw[real]
        stats = LossStats(loss=loss.item(), policy_loss=policy.item(), kl=kl.item(), entropy=ent.item(),
                          clip_fraction=float((is_clipped * mask).sum() / n),
                          ratio_mean=float((ratio * mask).sum() / n), tokens=int(mask.sum()),
                          is_ratio_mean=float(w_real.sum() / n) if w_real.numel() else 1.0,
                          is_ratio_max=float(w_real.max()) if w_real.numel() else 1.0,
                          # NaN > cap is False but a NaN weighs 0 in both corrections: counted as capped
                          is_capped_fraction=float(((w_real > is_cap) | torch.isnan(w_real)).sum() / n))
        if staleness is not None:
            known = staleness.to(real.device)[real & (staleness.to(real.device) >= 0)]
            if known.numel():
                stats.staleness_mean = float(known.double().mean())
                stats.staleness_max = int(known.max())
                stats.versioned_tokens = int(known.numel())
    return loss, stats
