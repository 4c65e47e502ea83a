"""GRPOTrainer: streamed groups, one on-policy update per step, independent of arrival order."""

from __future__ import annotations

import random

import pytest
import torch

from rlboost import wire
from trainer.grpo import group_advantages, grpo_loss, token_logprobs
from trainer.grpo_trainer import GRPOTrainer
from trainer.model import init_model_dir
from trainer.run import weights_sha256
from trainer.tasks import Addition, Problem


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


def _train(model_dir: str, results: list[wire.RolloutResult], order: list[int], **kw) -> GRPOTrainer:
    t = GRPOTrainer(model_dir, DigitSum(), lr=1e-3, seed=0, **kw)
    problems = DigitSum().prompts(4, seed=0)
    t.start_step(0, problems)
    by_group: dict[int, list] = {}
    for r in results:
        by_group.setdefault(r.group, []).append(r)
    for g in order:
        group = list(by_group[g])
        random.Random(g).shuffle(group)  # samples of a group arrive in any order too
        t.add_group(g, group)
    t.finish_step()
    return t


def test_update_is_bit_identical_whatever_order_groups_arrive_in(model_dir):
    results = _results(0, 4, 4)
    a = _train(model_dir, results, [0, 1, 2, 3])
    b = _train(model_dir, results, [3, 1, 0, 2])
    before = GRPOTrainer(model_dir, DigitSum()).state_dict()
    assert weights_sha256(a.state_dict()) == weights_sha256(b.state_dict())
    assert weights_sha256(a.state_dict()) != weights_sha256(before)  # it did learn something


def test_streamed_groups_equal_one_whole_batch_token_mean(model_dir):
    """Sum of per-group token sums / all tokens == the loss of the whole batch at once."""
    results = _results(0, 4, 4, seed=2)
    t = GRPOTrainer(model_dir, DigitSum(), lr=1e-3)
    problems = DigitSum().prompts(4, seed=0)
    t.start_step(0, problems)
    for g in range(4):
        t.add_group(g, [r for r in results if r.group == g])
    st = t._state
    streamed = sum(st.grads[g] for g in sorted(st.grads)) / sum(st.tokens.values())

    t.model.zero_grad(set_to_none=True)
    rewards = [DigitSum().reward(problems[r.group], t.tokenizer.decode(r.token_ids)) for r in results]
    adv = group_advantages(rewards, [r.group for r in results])
    logp, mask = token_logprobs(t.model, [r.prompt_ids for r in results], [r.token_ids for r in results])
    behaviour = torch.zeros_like(logp)
    for b, r in enumerate(results):
        behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs)
    loss, _ = grpo_loss(logp, behaviour, adv, mask, 0.2)
    loss.backward()
    whole = torch.cat([p.grad.reshape(-1) for p in t.params])
    assert torch.allclose(streamed, whole, atol=1e-6, rtol=1e-4)


def test_shuffled_rewards_control_keeps_the_rewards_but_changes_the_update(model_dir):
    results = _results(0, 4, 4, seed=4)
    plain = _train(model_dir, results, [0, 1, 2, 3])
    control = _train(model_dir, results, [0, 1, 2, 3], shuffle_rewards=True)
    assert weights_sha256(plain.state_dict()) != weights_sha256(control.state_dict())
