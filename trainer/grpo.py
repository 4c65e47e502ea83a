"""GRPO as a pure library: advantages, per-token logprobs, and the clipped policy loss.

No loop, no optimizer, no I/O: the trainer streams completed responses in micro-batches and
calls these functions; the optimizer step happens once the whole batch has been consumed.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def token_logprobs(model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]],
                   temperature: float = 1.0, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of each response token under `model`, batched: (logprobs, mask), both
    (batch, longest response), zero where mask is 0.

    Sequences are right-padded, so real tokens keep positions 0..n-1 as in generation. Logits
    are divided by the sampling temperature, so the result is comparable with the engine's
    behaviour logprobs. Gradients flow unless the caller wraps this in `torch.no_grad()`."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    rows = [p + r for p, r in zip(prompts, responses, strict=True)]
    width, longest = max(map(len, rows)), max(map(len, responses))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    where = torch.zeros((len(rows), max(longest, 1)), dtype=torch.long)  # logit index predicting each token
    mask = torch.zeros((len(rows), max(longest, 1)))
    targets = torch.full((len(rows), max(longest, 1)), pad_id, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not p:
            raise ValueError("every prompt needs at least one token")
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        attn[b, : len(p) + len(r)] = 1
        where[b, : len(r)] = torch.arange(len(p) - 1, len(p) + len(r) - 1)
        mask[b, : len(r)] = 1.0
        targets[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    logits = model(input_ids=ids, attention_mask=attn).logits
    picked = logits.gather(1, where[:, :, None].expand(-1, -1, logits.size(-1)))
    logp = torch.log_softmax(picked.float() / temperature, dim=-1).gather(2, targets[:, :, None])[:, :, 0]
    return logp * mask, mask


@dataclass
class LossStats:
    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    tokens: int


def grpo_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, ref_logprobs: torch.Tensor | None = None,
              kl_coef: float = 0.0, num_tokens: float | None = None) -> tuple[torch.Tensor, LossStats]:
    """PPO-clipped surrogate against the behaviour logprobs, plus an optional KL to a
    reference, averaged over tokens.

    Shapes: logprobs/behaviour/ref/mask (batch, T); advantages (batch,), one per response.
    Per token: -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A) with ratio = exp(logp - behaviour),
    plus kl_coef * (exp(ref - logp) - (ref - logp) - 1) (the k3 estimator: unbiased, >= 0).
    `num_tokens` is the denominator of the token mean: pass the token count of the whole
    batch when it is split into micro-batches whose gradients are accumulated, so the sum of
    micro-batch losses equals the loss of the whole batch."""
    mask = mask.to(logprobs.dtype)
    denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
    denom = max(denom, 1.0)
    adv = advantages.to(logprobs.dtype)[:, None]
    ratio = torch.exp(logprobs - behaviour_logprobs.to(logprobs.dtype))
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    policy = (per_token * mask).sum() / denom
    kl = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None:
        d = ref_logprobs.to(logprobs.dtype) - logprobs
        kl = ((torch.exp(d) - d - 1.0) * mask).sum() / denom
    loss = policy + kl_coef * kl
    n = max(float(mask.sum()), 1.0)
    with torch.no_grad():
        # tokens whose gradient the clip removed: the ones PPO stops pushing further
        is_clipped = (((ratio > 1.0 + clip_eps) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))).to(mask.dtype)
        stats = LossStats(loss=loss.item(), policy_loss=policy.item(), kl=kl.item(),
                          clip_fraction=float((is_clipped * mask).sum() / n),
                          ratio_mean=float((ratio * mask).sum() / n), tokens=int(mask.sum()))
    return loss, stats
