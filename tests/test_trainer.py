"""GRPOTrainer: streamed groups, one on-policy update per step, independent of arrival order,
O(parameters) memory (gradients accumulate in .grad), and the optimizer settings honoured."""

from __future__ import annotations

import random

import pytest
import torch

from rlboost import wire
from rlboost.config import AlgorithmSettings, TrainerSettings
from rlboost.trainer.grpo import group_advantages, grpo_loss, token_logprobs
from rlboost.trainer.grpo_trainer import GRPOTrainer
from rlboost.trainer.model import decode_response, init_model_dir
from rlboost.trainer.model import weights_sha256
from rlboost.trainer.tasks import Addition, Problem


class DigitSum(Addition):
    """A reward any untrained model can earn sometimes: the response starts with an even digit."""

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0 if response[:1] in "02468" and response[:1] != "" else 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(init_model_dir(tmp_path_factory.mktemp("m") / "model", DigitSum(), seed=1))


def _results(step: int, n_prompts: int, samples: int, seed: int = 0) -> list[wire.RolloutResult]:
    rng = random.Random(seed)
    out = []
    for p in range(n_prompts):
        prompt = [rng.randrange(2, 16) for _ in range(6)]
        for g in range(samples):
            toks = [rng.randrange(2, 16) for _ in range(rng.randint(3, 9))]
            out.append(wire.RolloutResult(request_id=wire.request_id(step, p, g), step=step, group=p,
                                          prompt_ids=prompt, token_ids=toks,
                                          logprobs=[-2.5 + 0.01 * i for i in range(len(toks))], segments=[],
                                          finish_reason="length", worker_id="w", ts=0.0))
    return out


def _rewards(t: GRPOTrainer, results: list[wire.RolloutResult]) -> list[float]:
    problems = DigitSum().prompts(4, seed=0)
    return [DigitSum().reward(problems[r.group], decode_response(t.tokenizer, r.token_ids)) for r in results]


def _trainer(model_dir: str, lr: float = 1e-3, **kw) -> GRPOTrainer:
    return GRPOTrainer(model_dir, TrainerSettings(lr=lr, **kw.pop("trainer", {})), seed=0, **kw)


def _train(model_dir: str, results: list[wire.RolloutResult], order: list[int], **kw) -> GRPOTrainer:
    t = _trainer(model_dir, **kw)
    t.start_step(0)
    by_group: dict[int, list] = {}
    for r in results:
        by_group.setdefault(r.group, []).append(r)
    for g in order:
        group = list(by_group[g])
        random.Random(g).shuffle(group)  # samples of a group arrive in any order too
        t.add_group(g, group, _rewards(t, group))
    t.finish_step()
    return t


@pytest.mark.parametrize("precision,order", [("fp64", "auto"), ("fp32", "ordered")])
def test_update_is_bit_identical_whatever_order_groups_arrive_in(model_dir, precision, order):
    cfg = {"precision": precision, "group_order": order}
    results = _results(0, 4, 4)
    a = _train(model_dir, results, [0, 1, 2, 3], trainer=cfg)
    b = _train(model_dir, results, [3, 1, 0, 2], trainer=cfg)
    before = _trainer(model_dir, trainer=cfg).state_dict()
    assert weights_sha256(a.state_dict()) == weights_sha256(b.state_dict())
    assert weights_sha256(a.state_dict()) != weights_sha256(before)  # it did learn something


def test_arrival_order_streams_each_group_at_once_and_equals_ordered_within_rounding(model_dir):
    """fp32's default: a group is back-propagated when it arrives (nothing waits), and the
    update differs from the ordered one only by the order of a float sum."""
    results = _results(0, 4, 4)
    t = _trainer(model_dir, trainer={"precision": "fp32"})
    t.start_step(0)
    by_group = {g: [r for r in results if r.group == g] for g in range(4)}
    t.add_group(3, by_group[3], _rewards(t, by_group[3]))
    assert not t._state.pending  # group 3 did not wait for 0, 1 and 2
    for g in (1, 0, 2):
        t.add_group(g, by_group[g], _rewards(t, by_group[g]))
    t.finish_step()
    ordered = _train(model_dir, results, [0, 1, 2, 3], trainer={"precision": "fp32", "group_order": "ordered"})
    a, b = t.state_dict(), ordered.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def test_gradient_accumulates_in_place_and_equals_one_whole_batch(model_dir):
    """Streamed group token sums in .grad (no copy per group) / all tokens == the whole batch's
    token-mean loss gradient, even when micro-batches cut every group into single rows."""
    results = _results(0, 4, 4, seed=2)
    t = _trainer(model_dir, trainer={"micro_batch_tokens": 1})
    t.start_step(0)
    for g in range(4):
        group = [r for r in results if r.group == g]
        t.add_group(g, group, _rewards(t, group))
    assert not t._state.pending  # all back-propagated, nothing held but .grad
    streamed = torch.cat([p.grad.reshape(-1) for p in t.params]) / t._state.sums["tokens"]

    t.model.zero_grad(set_to_none=True)
    rewards = _rewards(t, results)
    adv = group_advantages(rewards, [r.group for r in results])
    logp, mask = token_logprobs(t.model, [r.prompt_ids for r in results], [r.token_ids for r in results])
    behaviour = torch.zeros_like(logp)
    for b, r in enumerate(results):
        behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs)
    loss, _ = grpo_loss(logp, behaviour, adv, mask, 0.2)
    loss.backward()
    whole = torch.cat([p.grad.reshape(-1) for p in t.params])
    assert torch.allclose(streamed, whole, atol=1e-6, rtol=1e-4)


def test_ordered_groups_wait_for_their_predecessors_as_token_lists(model_dir):
    results = _results(0, 3, 2, seed=3)
    t = _trainer(model_dir, trainer={"group_order": "ordered"})
    t.start_step(0)
    for g in (2, 1):
        group = [r for r in results if r.group == g]
        t.add_group(g, group, _rewards(t, group))
    assert sorted(t._state.pending) == [1, 2] and all(p.grad is None for p in t.params)
    group = [r for r in results if r.group == 0]
    t.add_group(0, group, _rewards(t, group))
    assert not t._state.pending and any(p.grad is not None for p in t.params)


def test_shuffled_rewards_control_keeps_the_rewards_but_changes_the_update(model_dir):
    results = _results(0, 4, 4, seed=4)
    plain = _train(model_dir, results, [0, 1, 2, 3])
    control = _train(model_dir, results, [0, 1, 2, 3], shuffle_rewards=True)
    assert weights_sha256(plain.state_dict()) != weights_sha256(control.state_dict())


def test_clipping_warmup_and_report(model_dir):
    results = _results(0, 4, 4, seed=5)
    t = _trainer(model_dir, lr=1e-2, trainer={"grad_clip": 1e-6, "warmup_steps": 3, "weight_decay": 0.1})
    t.start_step(0)
    for g in range(4):
        group = [r for r in results if r.group == g]
        t.add_group(g, group, _rewards(t, group))
    rep = t.finish_step()
    assert rep.grad_norm > 1e-6  # measured before clipping
    assert rep.lr == pytest.approx(1e-2 / 4)  # warm-up: step 1 of 3 -> lr / 4
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 2 / 4)
    assert rep.truncation_rate == 1.0 and rep.responses == 16 and rep.tokens == sum(len(r.token_ids) for r in results)
    assert rep.max_response_tokens == max(len(r.token_ids) for r in results) and rep.entropy > 0


def test_kl_reference_is_loaded_only_when_its_coefficient_is_positive(model_dir):
    assert _trainer(model_dir).ref is None
    t = _trainer(model_dir, algorithm=AlgorithmSettings(kl_coef=0.1))
    assert t.ref is not None and not any(p.requires_grad for p in t.ref.parameters())


def test_bf16_mixed_precision_keeps_fp32_master_weights(model_dir):
    results = _results(0, 2, 2, seed=6)
    t = _train(model_dir, results, [0, 1], trainer={"precision": "bf16"})
    assert all(p.dtype == torch.float32 for p in t.params)
    assert all(s["exp_avg"].dtype == torch.float32 for s in t.optimizer.state.values())
    assert t.state_dict()["model.norm.weight"].dtype == torch.bfloat16  # published in bf16
