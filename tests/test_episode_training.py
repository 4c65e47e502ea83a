"""Training on episodes: environment tokens are context, never trained (no loss, no ratio, no
token count); single-turn training is bit-identical to before; an episode's result becomes a
training sample with the environment's reward."""

from __future__ import annotations

import random

import pytest
import torch

from rlboost import wire
from rlboost.config import AlgorithmSettings, TrainerSettings
from trainer.grpo import group_advantages, grpo_loss, token_logprobs
from trainer.grpo_trainer import GRPOTrainer, sample_of, trained_mask
from trainer.model import init_model_dir
from trainer.run import weights_sha256
from trainer.tasks import Addition


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_model_dir(tmp_path_factory.mktemp("m") / "model", Addition(), seed=3))


def _trainer(model_dir: str, off_policy: str = "none") -> GRPOTrainer:
    return GRPOTrainer(model_dir, TrainerSettings(device="cpu", precision="fp64", lr=1e-3),
                       AlgorithmSettings(off_policy=off_policy), seed=0)


def _episode(p: int, g: int, prompt: list[int], rng: random.Random, env_logprob: float = 0.0) -> wire.RolloutResult:
    """model turn, env tokens (a tool result), model turn, env tokens, model turn."""
    turns = [[rng.randrange(2, 16) for _ in range(rng.randint(3, 6))] for _ in range(5)]
    tokens, logprobs, segments = [], [], []
    for i, t in enumerate(turns):
        env = i % 2 == 1
        segments.append(wire.Segment(len(tokens), "w", 1, 0, kind="env" if env else "model"))
        tokens += t
        logprobs += [env_logprob if env else -2.0 - 0.01 * j for j in range(len(t))]
    return wire.RolloutResult(request_id=wire.request_id(0, p, g), step=0, group=p, prompt_ids=prompt,
                              token_ids=tokens, logprobs=logprobs, segments=segments, finish_reason="stop",
                              worker_id="w", ts=0.0)


def _single(p: int, g: int, prompt: list[int], rng: random.Random, segments: list) -> wire.RolloutResult:
    toks = [rng.randrange(2, 16) for _ in range(rng.randint(3, 9))]
    return wire.RolloutResult(request_id=wire.request_id(0, p, g), step=0, group=p, prompt_ids=prompt, token_ids=toks,
                              logprobs=[-2.5 + 0.01 * i for i in range(len(toks))], segments=segments,
                              finish_reason="length", worker_id="w", ts=0.0)


def _grads(t: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.grad is not None}


def test_an_all_trainable_mask_leaves_the_loss_bit_identical():
    torch.manual_seed(0)
    logp = torch.randn(3, 7, dtype=torch.float64).clamp(max=-0.1).requires_grad_()
    behaviour = logp.detach() + 0.3 * torch.randn(3, 7, dtype=torch.float64)
    mask = torch.ones(3, 7, dtype=torch.float64)
    mask[1, 5:] = 0  # padding
    adv = torch.tensor([1.0, -0.5, 0.2])
    rows = [([1], [2] * 7, [], False, [], None), ([1], [2] * 5, [], False, [], [True] * 5),
            ([1], [2] * 7, [], False, [], None)]
    assert trained_mask(mask, [r[:5] + (None,) for r in rows]) is mask  # single-turn rows: the same tensor
    m2 = trained_mask(mask, rows)  # an episode whose tokens are all the model's
    assert torch.equal(m2, mask)
    for mode in ("none", "tis", "decoupled"):
        a, _ = grpo_loss(logp, behaviour, adv, mask, off_policy=mode)
        b, _ = grpo_loss(logp, behaviour, adv, m2, off_policy=mode)
        ga, = torch.autograd.grad(a, logp)
        gb, = torch.autograd.grad(b, logp)
        assert a.item() == b.item() and torch.equal(ga, gb)


def test_single_turn_results_train_bit_identically_with_or_without_model_segments(model_dir):
    """A single-turn result (no segments, or model segments only) is trained exactly as before
    episodes: same step report, same weights to the bit."""
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 16) for _ in range(5)] for _ in range(2)]
    shas, reports = [], []
    for segs in ([], [wire.Segment(0, "w", 1, 0)], [wire.Segment(0, "w", 1, 0), wire.Segment(2, "v", 1, 0)]):
        rng = random.Random(2)
        t = _trainer(model_dir)
        t.start_step(0)
        for p in range(2):
            group = [_single(p, g, prompts[p], rng, segs) for g in range(4)]
            t.add_group(p, group, [float(g % 2) for g in range(4)])
        reports.append(t.finish_step())
        shas.append(weights_sha256(t.state_dict(torch.float64)))
    assert shas[0] == shas[1] == shas[2]
    assert reports[0].loss == reports[1].loss == reports[2].loss and reports[0].tokens == reports[2].tokens


@pytest.mark.parametrize("off_policy", ["none", "tis"])
def test_environment_tokens_contribute_no_gradient(model_dir, off_policy):
    """The trainer's gradient on episodes is the hand-computed loss over model tokens only: env
    tokens (whatever behaviour logprob they carry: here one that would blow up a ratio) add
    nothing, and are not counted in the step's tokens."""
    rng = random.Random(5)
    prompt = [rng.randrange(2, 16) for _ in range(4)]
    results = [_episode(0, g, prompt, rng, env_logprob=-40.0) for g in range(4)]
    rewards = [1.0, 0.0, 0.0, 1.0]

    t = _trainer(model_dir, off_policy)
    t.start_step(0)
    t.add_group(0, results, rewards)  # fp64: ordered streaming, group 0 is back-propagated now
    got = _grads(t)

    ref = _trainer(model_dir, off_policy)
    ordered = sorted(results, key=lambda r: r.request_id)
    logp, mask = token_logprobs(ref.model, [r.prompt_ids for r in ordered], [r.token_ids for r in ordered])
    behaviour, mask = torch.zeros_like(logp), mask.clone()
    for b, r in enumerate(ordered):
        mask[b, : len(r.token_ids)] *= torch.tensor(wire.trainable_mask(r.segments, len(r.token_ids)),
                                                    dtype=mask.dtype)
        behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=logp.dtype)
    adv = group_advantages([rewards[results.index(r)] for r in ordered], [0] * 4)
    loss, _ = grpo_loss(logp, behaviour, adv, mask, num_tokens=1.0, off_policy=off_policy)
    loss.backward()
    want = _grads(ref)
    assert set(got) == set(want)
    assert max(float((got[k] - want[k]).abs().max()) for k in got) < 1e-12

    # the env tokens' logprobs are never read: any value gives the same gradient
    t2 = _trainer(model_dir, off_policy)
    t2.start_step(0)
    t2.add_group(0, [msgspec_env_logprobs(r, 0.0) for r in results], rewards)
    again = _grads(t2)
    assert all(torch.equal(again[k], got[k]) for k in got)

    rep = t.finish_step()
    model_tokens = sum(sum(wire.trainable_mask(r.segments, len(r.token_ids))) for r in results)
    assert rep.tokens == model_tokens < sum(len(r.token_ids) for r in results)


def msgspec_env_logprobs(r: wire.RolloutResult, value: float) -> wire.RolloutResult:
    import msgspec

    mask = wire.trainable_mask(r.segments, len(r.token_ids))
    return msgspec.structs.replace(r, logprobs=[lp if m else value for lp, m in zip(r.logprobs, mask, strict=True)])


def test_sample_of_carries_the_trainable_mask_only_for_episodes():
    rng = random.Random(0)
    ep = _episode(0, 0, [3, 4], rng)
    s = sample_of(ep, 0)
    assert s[5] == wire.trainable_mask(ep.segments, len(ep.token_ids)) and not all(s[5])
    assert sample_of(_single(0, 0, [3], rng, []), 0)[5] is None
