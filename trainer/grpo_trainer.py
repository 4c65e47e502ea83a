"""GRPOTrainer: consumes a step's results group by group, steps the optimizer once per step.

Results stream in while rollout is still running; each prompt's group (its G samples) is
scored and back-propagated as soon as it is complete, so training overlaps the long tail of
generation. The optimizer step waits until every group of the step is in: training stays
on-policy. Gradients are kept per group and summed in group order at the end, so the update
is bit-for-bit the same whatever order the groups arrived in — a run is reproducible from its
seeds even when preemptions reshuffle who finishes first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from rlboost import wire
from trainer.grpo import group_advantages, grpo_loss, token_logprobs
from trainer.model import accuracy, decode_response, load_model, load_tokenizer
from trainer.tasks import Problem, Task


@dataclass
class StepReport:
    step: int
    version: int  # the policy version after this step's update
    reward_mean: float
    tokens: int  # response tokens trained on
    responses: int
    loss: float
    clip_fraction: float
    ratio_mean: float
    mean_response_tokens: float


@dataclass
class _StepState:
    step: int
    problems: list[Problem]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    rewards: dict[int, list[float]] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    loss_sum: float = 0.0
    clipped: float = 0.0
    ratio_sum: float = 0.0


class GRPOTrainer:
    def __init__(self, model_dir: str, task: Task, lr: float = 1e-4, clip_eps: float = 0.2, kl_coef: float = 0.0,
                 temperature: float = 1.0, seed: int = 0, shuffle_rewards: bool = False) -> None:
        torch.manual_seed(seed)
        self.task, self.seed, self.shuffle_rewards = task, seed, shuffle_rewards
        self.clip_eps, self.kl_coef, self.temperature = clip_eps, kl_coef, temperature
        self.model = load_model(model_dir).train()
        self.tokenizer = load_tokenizer(model_dir)
        self.ref = load_model(model_dir) if kl_coef > 0 else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        self.version = 0
        self._state: _StepState | None = None

    # ---------------------------------------------------------------- one step

    def start_step(self, step: int, problems: list[Problem]) -> None:
        self._state = _StepState(step=step, problems=problems)

    def add_group(self, group: int, results: list[wire.RolloutResult]) -> float:
        """Score one prompt's samples and accumulate their gradient. Returns the mean reward."""
        st = self._state
        assert st is not None, "start_step first"
        results = sorted(results, key=lambda r: r.request_id)  # arrival order must not matter
        problem = st.problems[group]
        rewards = [self.task.reward(problem, decode_response(self.tokenizer, r.token_ids)) for r in results]
        trained_rewards = list(rewards)
        if self.shuffle_rewards:  # the control: same reward statistics, no link to the response
            random.Random(hash((self.seed, st.step, group))).shuffle(trained_rewards)
        adv = group_advantages(trained_rewards, [0] * len(results))
        prompts = [list(r.prompt_ids) for r in results]
        responses = [list(r.token_ids) for r in results]
        logp, mask = token_logprobs(self.model, prompts, responses, temperature=self.temperature)
        behaviour = torch.zeros_like(logp)
        for b, r in enumerate(results):
            behaviour[b, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=logp.dtype)
        ref = None
        if self.ref is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(self.ref, prompts, responses, temperature=self.temperature)
        # num_tokens=1: a token *sum*; finish_step divides by the step's total token count.
        loss, stats = grpo_loss(logp, behaviour, adv, mask, self.clip_eps, ref, self.kl_coef, num_tokens=1.0)
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        st.grads[group] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                     for p in self.params])
        st.rewards[group] = rewards
        st.tokens[group] = stats.tokens
        st.loss_sum += stats.loss
        st.clipped += stats.clip_fraction * stats.tokens
        st.ratio_sum += stats.ratio_mean * stats.tokens
        return sum(rewards) / len(rewards)

    def finish_step(self) -> StepReport:
        """Sum the group gradients in group order, take the optimizer step."""
        st = self._state
        assert st is not None and st.grads, "no group was added"
        total = max(1, sum(st.tokens.values()))
        flat = torch.zeros_like(next(iter(st.grads.values())))
        for g in sorted(st.grads):
            flat += st.grads[g]
        flat /= total
        at = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[at: at + n].view_as(p).clone()
            at += n
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.version += 1
        all_rewards = [x for g in sorted(st.rewards) for x in st.rewards[g]]
        report = StepReport(step=st.step, version=self.version, reward_mean=sum(all_rewards) / len(all_rewards),
                            tokens=total, responses=len(all_rewards), loss=st.loss_sum / total,
                            clip_fraction=st.clipped / total, ratio_mean=st.ratio_sum / total,
                            mean_response_tokens=total / len(all_rewards))
        self._state = None
        return report

    # ---------------------------------------------------------------- outside the step

    def evaluate(self) -> float:
        """Greedy accuracy on the task's held-out set."""
        return accuracy(self.model, self.tokenizer, self.task)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
