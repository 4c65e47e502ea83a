"""GRPO maths against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from rlboost.trainer.grpo import group_advantages, grpo_loss, token_logprobs
from rlboost.trainer.model import build_model

torch.set_num_threads(1)


def test_group_advantages_normalise_within_each_group():
    # group 7: rewards 1,0,1,0 -> mean .5, population std .5 -> +-1
    # group 3: all equal -> 0 (no signal, no NaN); group 9: 0, 1 -> -1, +1
    rewards = [1, 0, 1, 1, 1, 0, 1, 0, 1]
    groups = [7, 7, 3, 3, 7, 9, 3, 7, 9]
    adv = group_advantages(rewards, groups, eps=0.0)
    assert adv.tolist() == [1, -1, 0, 0, 1, -1, 0, -1, 1]


def test_group_advantages_use_eps_and_population_std():
    # rewards 0, 1, 2: mean 1, population std sqrt(2/3)
    adv = group_advantages([0.0, 1.0, 2.0], [0, 0, 0], eps=0.1)
    s = math.sqrt(2 / 3)
    assert adv.tolist() == pytest.approx([-1 / (s + 0.1), 0.0, 1 / (s + 0.1)])
    assert group_advantages([0.5], [4]).tolist() == [0.0]  # a group of one


def _lp(values):
    return torch.tensor(values, dtype=torch.float64)


def test_clipped_surrogate_by_hand():
    # four tokens of two responses; ratio = exp(logp - behaviour)
    behaviour = _lp([[-1.0, -1.0], [-1.0, -1.0]])
    ratios = [[1.5, 0.5], [0.5, 1.5]]
    logp = (behaviour + torch.log(_lp(ratios))).requires_grad_(True)
    adv = _lp([1.0, -1.0])
    mask = torch.ones(2, 2, dtype=torch.float64)
    loss, stats = grpo_loss(logp, behaviour, adv, mask, clip_eps=0.2)
    # A=+1: ratio 1.5 -> min(1.5, 1.2) = 1.2; ratio .5 -> min(.5, .8) = .5
    # A=-1: ratio .5 -> min(-.5, -.8) = -.8; ratio 1.5 -> min(-1.5, -1.2) = -1.5
    expected = -(1.2 + 0.5 - 0.8 - 1.5) / 4
    assert loss.item() == pytest.approx(expected)
    assert stats.clip_fraction == pytest.approx(0.5) and stats.tokens == 4
    assert stats.ratio_mean == pytest.approx(1.0)
    loss.backward()
    # d/dlogp of -ratio*A/4 = -ratio*A/4 where the unclipped term is the min, else 0
    assert logp.grad.flatten().tolist() == pytest.approx([0.0, -0.5 / 4, 0.0, 1.5 / 4])


def test_mask_and_micro_batch_token_mean():
    behaviour = _lp([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    logp = behaviour + _lp([[0.1, -0.1, 0.0], [0.05, 0.0, 0.0]])
    mask = _lp([[1, 1, 0], [1, 0, 0]])
    adv = _lp([2.0, -1.0])
    full, stats = grpo_loss(logp, behaviour, adv, mask)
    r = [math.exp(0.1), math.exp(-0.1), math.exp(0.05)]
    # all three ratios lie inside [0.8, 1.2]: nothing is clipped, the surrogate is ratio * A
    expected = -(r[0] * 2 + r[1] * 2 - r[2]) / 3
    assert full.item() == pytest.approx(expected) and stats.tokens == 3 and stats.clip_fraction == 0
    halves = [grpo_loss(logp[i:i + 1], behaviour[i:i + 1], adv[i:i + 1], mask[i:i + 1], num_tokens=3)[0]
              for i in range(2)]
    assert (halves[0] + halves[1]).item() == pytest.approx(full.item())


def test_kl_to_reference_is_k3():
    logp = _lp([[-1.0, -2.0]])
    ref = _lp([[-1.5, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.float64)
    loss, stats = grpo_loss(logp, logp, _lp([0.0]), mask, ref_logprobs=ref, kl_coef=0.1)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]
    assert stats.kl == pytest.approx(sum(k3) / 2)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2)


def test_batched_token_logprobs_equal_one_at_a_time():
    model = build_model(vocab_size=12, hidden=32, layers=2, heads=2, mlp=64, seed=3).eval()
    prompts = [[2, 3, 4], [5], [6, 7, 8, 9, 10]]
    responses = [[11, 2], [3, 4, 5, 6], [7]]
    logp, mask = token_logprobs(model, prompts, responses, temperature=0.7)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    with torch.no_grad():
        for b, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(input_ids=torch.tensor([p + r])).logits[0]
            want = torch.log_softmax(logits / 0.7, dim=-1)
            for j, tok in enumerate(r):
                assert logp[b, j].item() == pytest.approx(want[len(p) + j - 1, tok].item(), abs=1e-5)
    assert (logp * (1 - mask)).abs().sum() == 0
    logp.sum().backward()  # differentiable: this is what the trainer optimises
    assert model.model.embed_tokens.weight.grad is not None
