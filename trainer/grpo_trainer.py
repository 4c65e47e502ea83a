"""GRPOTrainer: consumes a step's results group by group, steps the optimizer once per step.

Results stream in while rollout is still running; the caller scores each prompt's group (its
G samples) and hands it over with its rewards (`add_group`). The optimizer step waits until
every group of the step is in: every group's gradient is taken at the same weights, the policy
at the step's start (pi_old). Tokens sampled by another policy (an older version under partial
or async rollout, per each result's segments) are corrected per token from the engine's
recorded logprobs by `algorithm.off_policy` (`grpo.grpo_loss`); the step report carries the
importance-ratio and staleness statistics.

Memory is O(parameters): gradients accumulate in the parameters' own `.grad` (no per-group
copy), a group is cut into micro-batches of at most `micro_batch_tokens` tokens, layers may
recompute their activations in backward, and logprobs read the logits in place. Groups are
back-propagated as they arrive, overlapping the rollout tail; with `group_order = "ordered"`
(the default in fp64, the deterministic mode) in group order instead — a group that arrives
early waits (as token lists, not gradients) until the groups before it are done — so the sum of
gradients is formed in the same order whatever order the groups arrived in, and a run is
bit-for-bit a function of its seeds even when preemptions reshuffle who finishes first.

With FSDP2 (`rlboost.trainer.distributed`) the groups are scattered over the ranks when the step is
complete and every rank trains its share; the update equals one process's within rounding.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from rlboost import wire
from rlboost.config import AlgorithmSettings, TrainerSettings
from rlboost.modeldir import check_model_dir
from rlboost.trainer import distributed
from rlboost.trainer.distributed import SINGLE, Ranks
from rlboost.trainer.grpo import group_advantages, grpo_loss, token_logprobs, turn_advantages
from rlboost.trainer.model import load_model, load_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    """auto: bf16 on CUDA (fp32 master weights and optimizer state), fp32 on CPU."""
    if name == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return name


@dataclass
class StepReport:
    step: int
    updates: int  # optimizer updates taken so far (the published version is the ledger's: base + updates)
    reward_mean: float
    reward_std: float
    tokens: int  # response tokens trained on
    responses: int
    loss: float
    kl: float
    entropy: float
    clip_fraction: float
    ratio_mean: float
    grad_norm: float
    lr: float
    mean_response_tokens: float
    max_response_tokens: int
    truncation_rate: float  # responses cut by max_new_tokens
    train_s: float  # forward/backward/optimizer time of this trainer (not waiting)
    trained_tokens_per_s: float
    # off-policy statistics (algorithm.off_policy): the behaviour ratio pi_old/mu of the trained
    # tokens, the share of them over algorithm.is_cap, and how many policy versions behind the
    # trained one their sampler was (over the tokens whose segments name a version; None if none do)
    off_policy: str = "none"
    is_ratio_mean: float = 1.0
    is_ratio_max: float = 1.0
    is_capped: float = 0.0
    staleness_mean: float | None = None
    staleness_max: int | None = None

    def off_policy_row(self) -> dict:
        """The step row's (metrics.jsonl, loggers, Prometheus) off-policy fields; a ratio that
        is not finite (a behaviour logprob of -inf or NaN) shows as None, keeping the row JSON."""
        def num(x: float, digits: int) -> float | None:
            return round(x, digits) if math.isfinite(x) else None

        return {"off_policy": self.off_policy, "ratio_mean": num(self.ratio_mean, 6),
                "is_ratio_mean": num(self.is_ratio_mean, 6), "is_ratio_max": num(self.is_ratio_max, 6),
                "is_capped": round(self.is_capped, 6), "staleness_mean":
                None if self.staleness_mean is None else round(self.staleness_mean, 4),
                "staleness_max": self.staleness_max}


# One response as the trainer needs it: plain lists, cheap to hold and to scatter. Prompt,
# response, behaviour logprobs, truncated, per token the policy versions between the one that
# sampled it and the one trained (-1: unknown), and which tokens the loss trains (None: all of
# them, a single-turn response; else False on an episode's environment tokens).
Sample = tuple[list[int], list[int], list[float], bool, list[int], list[bool] | None]
# A response's advantage: one number, or one per response token (turn credit, `_advantages`).
Advantage = float | list[float]


def sample_of(result: wire.RolloutResult, policy_version: int) -> Sample:
    """What the trainer keeps of a result, with each token's staleness against `policy_version`
    (the version this step trains) from the result's segments. A token that claims a version
    newer than the trained one is marked unknown, not stale by a negative count. An episode's
    environment tokens (segments of kind "env": tool results, environment turns) stay in the
    response as context but are masked out of the loss (`wire.trainable_mask`)."""
    n = len(result.token_ids)
    versions = wire.token_versions(result.segments, n)
    staleness = [policy_version - v if 0 <= v <= policy_version else -1 for v in versions]
    trainable = wire.trainable_mask(result.segments, n)
    return (list(result.prompt_ids), list(result.token_ids), list(result.logprobs), result.finish_reason == "length",
            staleness, None if all(trainable) else trainable)


def trained_mask(mask: torch.Tensor, rows: list[Sample]) -> torch.Tensor:
    """`mask` (1 on each response token, 0 on padding) with the environment tokens of episode
    rows set to 0: they get no loss, no ratio, no KL or entropy term, and do not count in the
    step's token total. Rows without a trainable mask (single-turn) are left as they are, so a
    batch of them is the very same tensor: the loss is bit-identical to before episodes."""
    if all(s[5] is None for s in rows):
        return mask
    mask = mask.clone()
    for b, s in enumerate(rows):
        if s[5] is not None:
            mask[b, : len(s[5])] *= torch.tensor(s[5], dtype=mask.dtype, device=mask.device)
    return mask


@dataclass
class _StepState:
    step: int
    policy_version: int = 0  # the version trained in this step: staleness is counted from it
    pending: dict[int, tuple[list[Sample], list[Advantage]]] = field(default_factory=dict)
    next_group: int = 0
    rewards: dict[int, list[float]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("tokens", "loss", "kl", "entropy", "clipped", "ratio", "is_ratio", "capped", "staleness", "versioned"), 0.0))
    maxes: dict[str, float] = field(default_factory=lambda: {"is_ratio": -math.inf, "staleness": -1.0})
    lengths: list[int] = field(default_factory=list)
    truncated: int = 0
    train_s: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0


class GRPOTrainer:
    def __init__(self, model_dir: str, trainer: TrainerSettings | None = None,
                 algorithm: AlgorithmSettings | None = None, *, seed: int = 0, total_steps: int = 0,
                 temperature: float = 1.0, shuffle_rewards: bool = False, ranks: Ranks = SINGLE) -> None:
        self.cfg = trainer or TrainerSettings()
        self.alg = algorithm or AlgorithmSettings()
        self.seed, self.shuffle_rewards, self.temperature, self.ranks = seed, shuffle_rewards, temperature, ranks
        self.device = resolve_device(self.cfg.device)
        if self.device.type == "cuda" and ranks.distributed:
            self.device = torch.device("cuda", ranks.local_rank)
        self.precision = resolve_precision(self.cfg.precision, self.device)
        if self.precision == "fp64":  # the deterministic mode: no nondeterministic kernels either
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.master_dtype = torch.float64 if self.precision == "fp64" else torch.float32
        self.ordered = self.cfg.group_order == "ordered" or (self.cfg.group_order == "auto" and self.precision == "fp64")
        torch.manual_seed(seed)
        self.model = self._load(model_dir).train()
        self.model_dtype = check_model_dir(model_dir).dtype  # its serving dtype on disk (publish_dtype auto)
        if self.cfg.activation_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tokenizer = load_tokenizer(model_dir)
        # the KL reference costs a second model: loaded only when its coefficient is > 0
        self.ref = self._load(model_dir).eval().requires_grad_(False) if self.alg.kl_coef > 0 else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.ndim >= 2]  # matrices; norms and biases are not decayed
        rest = [p for p in self.params if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=self.cfg.lr, betas=tuple(self.cfg.betas), eps=self.cfg.adam_eps)
        self.total_steps = total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        # Optimizer updates taken. Not a policy version: the run's `VersionLedger` numbers those
        # (base + updates, unique in the weight store across lives) and is their one owner.
        self.updates = 0
        self._state: _StepState | None = None
        self._outgoing: list | None = None  # rank 0: the step's shares, while they are scattered

    def _load(self, model_dir: str) -> torch.nn.Module:
        model = load_model(model_dir, dtype=self.master_dtype).to(self.device)
        if self.ranks.distributed:
            distributed.shard(model, torch.bfloat16 if self.precision == "bf16" else None)
        return model

    def _lr_factor(self, step: int) -> float:
        """Linear warm-up over `warmup_steps`, then constant, cosine or linear decay to
        `min_lr_ratio` at `total_steps`."""
        warm = self.cfg.warmup_steps
        if step < warm:
            return (step + 1) / (warm + 1)
        if self.cfg.lr_schedule == "constant" or self.total_steps <= warm:
            return 1.0
        done = min(1.0, (step - warm) / max(1, self.total_steps - warm))
        shape = 0.5 * (1 + math.cos(math.pi * done)) if self.cfg.lr_schedule == "cosine" else 1 - done
        return self.cfg.min_lr_ratio + (1 - self.cfg.min_lr_ratio) * shape

    def _autocast(self):
        # bf16 without FSDP: autocast over fp32 master weights (FSDP casts through its policy)
        if self.precision in ("bf16", "fp16") and not self.ranks.distributed:
            return torch.autocast(self.device.type, dtype=DTYPES[self.precision])
        return nullcontext()

    # ---------------------------------------------------------------- one step

    def start_step(self, step: int, problems: object = None, policy_version: int | None = None) -> None:
        """`problems` is accepted for callers that pass the step's prompts; rewards come from
        the caller (`add_group`), so the trainer does not need them. `policy_version`: the
        published version this step trains (a run's numbering may start above the trainer's
        own count: the ledger's); the staleness of each token is counted from it. Default: the trainer's
        update count (a trainer used without a ledger, whose versions are its updates)."""
        self._state = _StepState(step=step, policy_version=self.updates if policy_version is None else policy_version)

    def add_group(self, group: int, results: list[wire.RolloutResult], rewards: list[float],
                  turn_rewards: list[list[float | None] | None] | None = None) -> float:
        """One prompt's samples and their rewards (in the order of `results`; `turn_rewards`: an
        episode's per-model-turn rewards, in the same order, where its environment gives them).
        Back-propagated now (`group_order` arrival), or once every group before it is done
        (ordered). Returns the mean reward."""
        st = self._state
        assert st is not None, "start_step first"
        if len(rewards) != len(results):
            raise ValueError(f"group {group}: {len(results)} results but {len(rewards)} rewards")
        if turn_rewards is not None and len(turn_rewards) != len(results):
            raise ValueError(f"group {group}: {len(results)} results but {len(turn_rewards)} turn reward lists")
        turns = turn_rewards if turn_rewards is not None else [None] * len(results)
        paired = sorted(zip(results, rewards, turns, strict=True), key=lambda x: x[0].request_id)  # arrival order must not matter
        samples = [sample_of(r, st.policy_version) for r, _, _ in paired]
        rewards = [float(x) for _, x, _ in paired]
        st.rewards[group] = rewards
        st.lengths += [len(s[1]) for s in samples]
        st.truncated += sum(s[3] for s in samples)
        trained, trained_turns = self._trained_rewards(st.step, group, rewards, [t for _, _, t in paired])
        st.pending[group] = (samples, self._advantages([r for r, _, _ in paired], trained, trained_turns))
        if self.ranks.distributed:  # FSDP trains at finish_step
            pass
        elif self.ordered:  # streamed in group order: the same gradient sum whatever the arrival
            while st.next_group in st.pending:
                self._backward_group(*st.pending.pop(st.next_group))
                st.next_group += 1
        else:  # streamed as it comes: training overlaps the rollout tail
            self._backward_group(*st.pending.pop(group))
        return sum(rewards) / len(rewards)

    def _trained_rewards(self, step: int, group: int, rewards: list[float], turns: list) -> tuple[list[float], list]:
        order = list(range(len(rewards)))
        if self.shuffle_rewards:  # the control: same reward statistics, no link to the response
            random.Random(hash((self.seed, step, group))).shuffle(order)
        return [rewards[i] for i in order], [turns[i] for i in order]

    def _advantages(self, results: list[wire.RolloutResult], rewards: list[float],
                    turn_rewards: list[list[float | None] | None]) -> list[Advantage]:
        """The group's advantages: GRPO's one per response (normalised over the whole group); an
        episode whose environment rewarded its turns gets one per token instead, its turn's
        normalised reward (`grpo.turn_advantages`) times `algorithm.turn_reward_coef` added to
        every token of that model turn (environment tokens are masked out of the loss anyway)."""
        adv: list[Advantage] = group_advantages(rewards, [0] * len(rewards)).tolist()
        coef = self.alg.turn_reward_coef
        if not coef or not any(any(x for x in (t or [])) for t in turn_rewards):
            return adv
        by_turn = turn_advantages(turn_rewards)
        for i, (r, b) in enumerate(zip(results, by_turn, strict=True)):
            if any(b):
                a = adv[i]
                adv[i] = [a + coef * b[t] if t < len(b) else a for t in wire.token_turns(r.segments, len(r.token_ids))]
        return adv

    def _micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        """Row indices cut by the token budget (prompt + response); a row never splits."""
        out: list[list[int]] = [[]]
        used = 0
        for i, s in enumerate(samples):
            n = len(s[0]) + len(s[1])
            if out[-1] and used + n > self.cfg.micro_batch_tokens:
                out.append([])
                used = 0
            out[-1].append(i)
            used += n
        return out

    def _plan(self, samples: list[Sample], advantages: list[Advantage]) -> list[tuple[list[Sample], list[Advantage]]]:
        """The group's micro-batches with their advantages."""
        return [([samples[i] for i in rows], [advantages[i] for i in rows]) for rows in self._micro_batches(samples)]

    def _backward_group(self, samples: list[Sample], advantages: list[Advantage]) -> None:
        """Accumulate the group's token-sum loss gradient into .grad."""
        for rows, adv in self._plan(samples, advantages):
            self._backward_rows(rows, adv)

    def _backward_rows(self, rows: list[Sample], advantages: list[Advantage]) -> None:
        st = self._state
        t0 = time.perf_counter()
        prompts, responses = [s[0] for s in rows], [s[1] for s in rows]
        with self._autocast():
            logp, mask, ent = token_logprobs(self.model, prompts, responses, temperature=self.temperature,
                                             with_entropy=True, entropy_grad=self.alg.entropy_coef > 0,
                                             device=self.device)
            ref = None
            if self.ref is not None:
                with torch.no_grad():
                    ref, _ = token_logprobs(self.ref, prompts, responses, temperature=self.temperature,
                                            device=self.device)
        behaviour = torch.zeros_like(logp)
        staleness = torch.full(logp.shape, -1, dtype=torch.long)  # per token; -1: unknown (and padding)
        for b, s in enumerate(rows):
            behaviour[b, : len(s[2])] = torch.tensor(s[2], dtype=logp.dtype)
            staleness[b, : len(s[4])] = torch.tensor(s[4], dtype=torch.long)
        mask = trained_mask(mask, rows)
        if all(isinstance(a, float) for a in advantages):  # one per response (single-turn: as always)
            adv = torch.tensor(advantages, dtype=torch.float32)
        else:  # one per token where an episode's turns were rewarded; padding's value is masked
            adv = torch.zeros(logp.shape, dtype=torch.float32)
            for b, a in enumerate(advantages):
                if isinstance(a, float):
                    adv[b] = a
                else:
                    adv[b, :len(a)] = torch.tensor(a, dtype=torch.float32)
        # num_tokens=1: a token *sum*; the optimizer step divides by the step's total token count.
        # tis/decoupled: pi_old is this very forward (detached): the weights change only at the
        # step's one optimizer step, after every group has been back-propagated.
        loss, stats = grpo_loss(logp, behaviour, adv.to(self.device), mask, self.alg.clip_eps, ref, self.alg.kl_coef,
                                num_tokens=1.0, entropy=ent, entropy_coef=self.alg.entropy_coef,
                                off_policy=self.alg.off_policy, is_cap=self.alg.is_cap, staleness=staleness)
        loss.backward()
        n = stats.tokens
        for k, v in (("tokens", n), ("loss", stats.loss), ("kl", stats.kl), ("entropy", stats.entropy),
                     ("clipped", stats.clip_fraction * n), ("ratio", stats.ratio_mean * n),
                     ("is_ratio", stats.is_ratio_mean * n), ("capped", stats.is_capped_fraction * n),
                     ("staleness", stats.staleness_mean * stats.versioned_tokens),
                     ("versioned", stats.versioned_tokens)):
            st.sums[k] += v
        if n:
            st.maxes["is_ratio"] = max(st.maxes["is_ratio"], stats.is_ratio_max)
        st.maxes["staleness"] = max(st.maxes["staleness"], stats.staleness_max)
        st.train_s += time.perf_counter() - t0

    def _empty_pass(self) -> None:
        """A forward/backward that contributes nothing: keeps FSDP collectives matched when
        this rank has fewer micro-batches than another."""
        with self._autocast():
            logits = self.model(input_ids=torch.ones((1, 1), dtype=torch.long, device=self.device),
                                logits_to_keep=1, use_cache=False).logits
        (logits.sum() * 0.0).backward()

    def train_share(self, share: list[tuple[int, list[Sample], list[Advantage]]]) -> None:
        """Every rank (FSDP): back-propagate this rank's groups, then as many empty passes as
        it takes to match the rank with the most."""
        plan = [mb for _, samples, advs in sorted(share, key=lambda x: x[0]) for mb in self._plan(samples, advs)]
        passes = distributed.max_over_ranks(len(plan), self.ranks)  # agreed before any pass: each is a collective
        for rows, adv in plan:
            self._backward_rows(rows, adv)
        for _ in range(passes - len(plan)):
            self._empty_pass()

    def finish_step(self) -> StepReport:
        """Train what is left in group order (FSDP: scatter the groups and train on every
        rank), then one optimizer step."""
        st = self._state
        assert st is not None and st.rewards, "no group was added"
        if self.ranks.distributed:
            shares: list[list] = [[] for _ in range(self.ranks.world)]
            for g in sorted(st.pending):
                shares[g % self.ranks.world].append((g, *st.pending[g]))
            st.pending.clear()
            self._outgoing = shares
            distributed.Lockstep(self, self.ranks).call("follower_step", st.step)
            self._outgoing = None
        else:
            for g in sorted(st.pending):
                self._backward_group(*st.pending.pop(g))
            self.optimizer_step(st.step)
        return self._report()

    def follower_step(self, step: int) -> None:
        """Every rank (FSDP): receive this rank's share of the step, train it, take the
        optimizer step. The token count is summed first: every rank divides by the global one."""
        if self._state is None or self._state.step != step:
            self._state = _StepState(step=step)  # a follower: it only ever sees its share
        st = self._state
        self.train_share(distributed.scatter(self._outgoing if self.ranks.leader else None, self.ranks))
        for k in list(st.sums):
            st.sums[k] = distributed.sum_over_ranks(st.sums[k], self.ranks)
        for k in list(st.maxes):
            st.maxes[k] = distributed.max_float_over_ranks(st.maxes[k], self.ranks)
        self.optimizer_step(step)
        if not self.ranks.leader:
            self._state = None

    def optimizer_step(self, step: int) -> None:
        """Divide the accumulated token-sum gradient by the step's tokens, clip, step, schedule."""
        st = self._state
        t0 = time.perf_counter()
        total = max(1.0, st.sums["tokens"]) / self.ranks.world  # FSDP has averaged over ranks
        for p in self.params:
            if p.grad is not None:
                p.grad.div_(total)
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip or math.inf)
        st.grad_norm = float(distributed.full_tensor(norm))
        st.lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.model.zero_grad(set_to_none=True)
        self.updates += 1
        st.train_s += time.perf_counter() - t0

    def _report(self) -> StepReport:
        st = self._state
        total = max(1.0, st.sums["tokens"])
        rewards = [x for g in sorted(st.rewards) for x in st.rewards[g]]
        mean = sum(rewards) / len(rewards)
        train_s = st.train_s
        report = StepReport(
            step=st.step, updates=self.updates, reward_mean=mean,
            reward_std=math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)), tokens=int(st.sums["tokens"]),
            responses=len(rewards), loss=st.sums["loss"] / total, kl=st.sums["kl"] / total,
            entropy=st.sums["entropy"] / total, clip_fraction=st.sums["clipped"] / total,
            ratio_mean=st.sums["ratio"] / total, grad_norm=st.grad_norm, lr=st.lr,
            mean_response_tokens=sum(st.lengths) / len(st.lengths), max_response_tokens=max(st.lengths),
            truncation_rate=st.truncated / len(st.lengths), train_s=train_s,
            trained_tokens_per_s=st.sums["tokens"] / train_s if train_s > 0 else 0.0,
            off_policy=self.alg.off_policy, is_ratio_mean=st.sums["is_ratio"] / total,
            is_ratio_max=st.maxes["is_ratio"] if st.sums["tokens"] else 1.0, is_capped=st.sums["capped"] / total,
            staleness_mean=st.sums["staleness"] / st.sums["versioned"] if st.sums["versioned"] else None,
            staleness_max=int(st.maxes["staleness"]) if st.sums["versioned"] else None)
        self._state = None
        return report

    # ---------------------------------------------------------------- outside the step

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, stops: list[int], pad_id: int) -> list[list[int]]:
        """Greedy responses (token ids) of the policy, for held-out evaluation: the caller scores
        them. A collective under FSDP2 (every rank generates the same batch)."""
        from rlboost.trainer.model import greedy_ids

        return greedy_ids(self.model, prompts, max_new_tokens, stops, pad_id)

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The full weights on the CPU in `dtype` (default: the publish dtype), gathered tensor by
        tensor: with FSDP2 at most one unsharded tensor is on the device at a time (a collective:
        every rank calls it; only rank 0 keeps the result, the others return an empty dict)."""
        dtype = dtype or self.publish_dtype
        out = {}
        for k, v in self.model.state_dict().items():
            full = distributed.full_tensor(v.detach())
            if self.ranks.leader:  # the other ranks only take part in the gather
                out[k] = full.to(device="cpu", dtype=dtype if full.is_floating_point() else full.dtype).clone()
            del full
        return out

    def save_checkpoint(self, run_dir: str, step: int, meta: dict, keep: int) -> str:
        from rlboost.trainer import training_checkpoint as checkpoint

        return str(checkpoint.save(self, run_dir, step, meta, keep))

    def load_checkpoint(self, path: str) -> dict:
        from rlboost.trainer import training_checkpoint as checkpoint

        return checkpoint.load(self, path)

    @property
    def publish_dtype(self) -> torch.dtype:
        """The serving dtype versions are published in, cast from the master weights: auto =
        bf16 for a bf16 model (config.json's torch_dtype) or bf16 training, else fp32."""
        if self.cfg.publish_dtype != "auto":
            return DTYPES[self.cfg.publish_dtype]
        return torch.bfloat16 if self.precision == "bf16" or self.model_dtype == "bfloat16" else torch.float32
