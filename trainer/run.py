"""`rlboost run` (and `rlboost demo`): RL training with rollout offloaded to preemptible workers.

One process is the reserved cluster: the GRPO trainer plus a seeding engine (in this process by
default, or an `rlboost worker` process on the reserved pool: `[rollout] seeding`, `seeding_engine`).
Preemptible workers are separate processes (`rlboost worker --engine torch`) that can vanish at any
time. The step itself (hybrid / colocated / disaggregated policies, the seeding window, hand-off,
fallback, rollout modes sync / partial / async) is `rlboost.orchestrator.Orchestrator`, the same
code `rlboost bench trace` measures; this module supplies its parts: the real trainer as its
`TrainerClock` (score with the user's reward, back-propagate each group, optimizer step and publish
the weights) and real seeding engines (`workers/seeding.py`).

Model, data and reward are the user's (README "Your model, your data, your reward"): any
Hugging Face causal-LM folder (read, never written), a dataset file (trainer.data) or the
built-in `addition` generator, and a reward function run in a process pool (trainer.rewards).
Prompts are token ids (chat template for chat data); a prompt over its token budget is
filtered before the step, counted and logged; requests carry every EOS id of the model.

Settings: the whole tree (`rlboost.config`); the flags below are shorthands for its keys and
any `--section.key value` / `section.key=value` overrides one. The effective settings are
written to `<run_dir>/settings.toml`. Checkpoints every `run.checkpoint_every` steps and at the
end (`trainer.checkpoint`); `--resume RUN_DIR` continues that run: same run id, the step after
its last checkpoint, the data position restored. A step interrupted by the trainer's death is
published again under the same request ids: JetStream drops the duplicates whose originals are
still queued or in flight (those come back to a worker after ack_wait and resume from their
Redis checkpoints), results already in the results stream are taken from there, and a request
whose original was already acked comes back as a fresh message that a worker finds finished in
Redis and republishes without generating. Under torchrun (`--nproc N`) rank 0 is this run;
other ranks follow (`trainer.distributed`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch
from rlboost import metrics, wire
from rlboost.logs import print_result
from rlboost.clients import Clients, open_clients
from rlboost.config import ConfigError, Settings, WorkerSettings, apply_overrides, dump_toml, load_settings, \
    parse_overrides
from rlboost.logs import configure_logging, get_logger
from rlboost.manager import RolloutManager, check_segments, check_weights
from rlboost.modeldir import ModelDirError, check_model_dir, stop_ids
from rlboost.offload import SeedWindow
from rlboost.orchestrator import Orchestrator
from rlboost.services import running_services
from rlboost.weights import WeightCache
from rlboost.weights.source import StoreWeights
from rlboost.weights import Manifest, StoreError, VersionPointer, WeightPublisher, open_store, published_versions
from trainer.data import (DataError, DataExhausted, FieldMap, FileData, GeneratedData, PromptBudget, Sample,
                          encode_prompt)
from trainer import checkpoint as ckpt
from trainer import distributed
from trainer.grpo_trainer import GRPOTrainer
from trainer.loggers import Loggers
from trainer.model import META_FILE, decode_response, pad_id, read_meta
from trainer.report import RunReport
from trainer.rewards import Item, RewardError, RewardPool
from trainer.tasks import TASKS, get_task
from workers.counters import Counters, read_counters
from workers.engines import EngineError
from workers.fleet import WorkerFleet
from workers.seeding import InProcessSeeding, ProcessSeeding, make_seeding_engine

POOL = "spot"
RESERVED_POOL = "reserved"


@dataclass
class RunConfig:
    policy: str = "hybrid"
    steps: int = 40
    max_minutes: float = 0.0  # stop after the step that crosses this (0 = no limit)
    prompts: int = 32
    samples: int = 8
    workers: int = 2
    slots: int = 32
    checkpoint_tokens: int = 16
    lr: float = 1e-4
    temperature: float = 1.0
    seed: int = 0
    eval_every: int = 5
    t_seed_initial: float = 2.0
    t_seed_floor: float = 0.5
    shuffle_rewards: bool = False
    chaos: dict[int, list[str]] = field(default_factory=dict)  # step -> ["term", "kill"]
    model_dir: str = ""
    init_model: bool = False  # build the demo model into model_dir if missing (a folder of rlboost's own)
    run_dir: str = ""
    bootstrap_target: float = 0.35
    metrics_port: int = 0  # Prometheus /metrics of the trainer/manager (settings [metrics])
    metrics_bind: str = "127.0.0.1"
    save_rollouts: bool = False  # rollouts.jsonl: every response of every step, for comparisons
    bootstrap_seconds: float = 900.0
    # data and reward (settings [data]; flags override)
    task: str = ""
    data: str = ""
    eval_data: str = ""
    reward: str = ""
    max_prompt_tokens: int = 1024
    max_response_tokens: int = 0
    eval_size: int = 256
    eval_fraction: float = 0.1
    shuffle: bool = True
    epochs: int = 0
    fields: dict = field(default_factory=dict)  # FieldMap keys
    reward_workers: int = 2
    reward_timeout_s: float = 10.0
    resume: bool = False  # continue run_dir from its last checkpoint
    settings: Settings = field(default_factory=Settings)  # the whole tree ([trainer], [algorithm], [run] ...)

    @classmethod
    def from_settings(cls, s: Settings, resume: bool = False) -> RunConfig:
        r, ro, ds = s.run, s.rollout, s.data
        return cls(policy=r.policy, steps=r.steps, max_minutes=r.max_minutes, prompts=ro.prompts, samples=ro.samples,
                   workers=r.workers, slots=ro.slots, checkpoint_tokens=ro.checkpoint_tokens, lr=s.trainer.lr,
                   temperature=ro.temperature, seed=r.seed, eval_every=r.eval_every, t_seed_initial=ro.t_seed,
                   t_seed_floor=ro.t_seed_floor, shuffle_rewards=r.shuffle_rewards, chaos=parse_chaos(r.chaos),
                   model_dir=r.model_dir, init_model=r.init_model, run_dir=r.run_dir,
                   bootstrap_target=r.bootstrap_target, metrics_port=s.metrics.port, metrics_bind=s.metrics.bind,
                   save_rollouts=r.save_rollouts, bootstrap_seconds=r.bootstrap_seconds,
                   task=ds.task, data=ds.train, eval_data=ds.eval, reward=ds.reward,
                   max_prompt_tokens=ds.max_prompt_tokens, max_response_tokens=ds.max_response_tokens,
                   eval_size=ds.eval_size, eval_fraction=ds.eval_fraction, shuffle=ds.shuffle, epochs=ds.epochs,
                   fields={"prompt": ds.prompt_key, "messages": ds.messages_key,
                           "ground_truth": ds.ground_truth_key, "data_source": ds.data_source_key},
                   reward_workers=ds.reward_workers, reward_timeout_s=ds.reward_timeout_s, resume=resume, settings=s)


def request_seed(run_seed: int, step: int, prompt: int, sample: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{run_seed}/{step}/{prompt}/{sample}".encode(), digest_size=4).digest(),
                          "little")


def weights_sha256(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def make_trainer(cfg: RunConfig, ranks: distributed.Ranks = distributed.SINGLE) -> GRPOTrainer:
    s = cfg.settings
    return GRPOTrainer(cfg.model_dir, s.trainer, s.algorithm, temperature=cfg.temperature, seed=cfg.seed,
                       shuffle_rewards=cfg.shuffle_rewards, total_steps=cfg.steps, ranks=ranks)


class Run:
    def __init__(self, cfg: RunConfig, c: Clients, nats_url: str, redis_url: str, run_dir: Path, report: RunReport,
                 run_id: str, trainer: GRPOTrainer):
        self.cfg, self.c, self.run_dir, self.report = cfg, c, run_dir, report
        self.log = get_logger(component="run", policy=cfg.policy, run_id=run_id)
        self.trainer = trainer
        self.ops = distributed.Lockstep(trainer, trainer.ranks)  # what every rank must run, rank 0 announces
        self.tokenizer = self.trainer.tokenizer
        self.stops = stop_ids(cfg.model_dir, self.tokenizer)
        self.pad = pad_id(self.tokenizer, self.stops)
        self.data, self.reward_spec, self.max_response_tokens = make_data(cfg)
        self.budget = PromptBudget(cfg.max_prompt_tokens, self.max_response_tokens,
                                   check_model_dir(cfg.model_dir).max_context)
        self.rewards = RewardPool(self.reward_spec, workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s)
        self.eval_set = [(smp, ids) for smp in self.data.eval_samples()
                         if len(ids := encode_prompt(self.tokenizer, smp)) <= self.budget.limit]
        self.manager = RolloutManager(c, POOL)
        self.window = SeedWindow(initial_s=cfg.t_seed_initial, floor_s=cfg.t_seed_floor)
        # one folder and one worker-id prefix per life of the trainer: a resumed run's workers
        # neither reuse a killed one's id nor its crash-proof counters
        attempt = sum(1 for _ in (run_dir / "workers").glob("life-*")) if (run_dir / "workers").exists() else 0
        workdir = run_dir / "workers" / f"life-{attempt}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.worker_prefix = f"l{attempt}w"
        self.fleet = WorkerFleet(nats_url, redis_url, workdir, POOL, worker_args=[
            "--engine", "torch", "--model-dir", cfg.model_dir, "--slots", str(cfg.slots),
            "--checkpoint-tokens", str(cfg.checkpoint_tokens)],
            env={"RLBOOST_WORKER__CACHE_DIR": str(run_dir / "weight-cache"), "RLBOOST_LOG_LEVEL": "warning"},
            die_with_parent=True)  # the run's own workers go with a killed trainer; a resume starts new ones
        self.reserved_counters = Counters(workdir / "reserved.counters")
        self.seeding = self._seeding_engines(nats_url, redis_url, workdir)
        ro = cfg.settings.rollout
        self.orchestrator = Orchestrator(c, POOL, self.seeding, self, policy=cfg.policy, window=self.window,
                                         mode=ro.mode, max_staleness=ro.max_staleness,
                                         overprovision=ro.overprovision, samples=cfg.samples,
                                         on_result=self._on_result)
        if ro.mode != "sync" and cfg.settings.algorithm.off_policy == "none":
            # not switched on behind the user's back (none is a valid choice); said once, loudly
            self.log.warning("rollout.mode trains stale tokens: algorithm.off_policy = \"tis\" corrects them "
                             "with the behaviour logprobs (none only clips around them)", mode=ro.mode)
        self._samples: dict[tuple[int, int], Sample] = {}  # (step, group) -> its prompt, until trained
        # step -> (data position, filtered, groups drawn, version published under), the first two from
        # before its draw: what a checkpoint needs to make a resumed life draw the same prompts
        self._drawn_from: dict[int, tuple[dict, int, int, int]] = {}
        self._resumed_draws: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})  # see restore()
        self._batch_position = 0
        self.handoffs_total = 0
        self.filtered_total = 0
        self.dollars = 0.0
        self.resumed_weights: dict | None = None  # {"version", "digest"} of the checkpoint being resumed
        self.resumed_step = -1  # the first step after that checkpoint
        self.republish_through = -1  # the last step a previous life may have published (see restore)
        self.run_id = run_id
        self.base_version = 0  # policy versions continue from what the weight store already holds

    def _seeding_engines(self, nats_url: str, redis_url: str, workdir: Path) -> InProcessSeeding | ProcessSeeding:
        """The reserved side's seeding engine (`[rollout] seeding`, `seeding_engine`): in this
        process (default: nothing to start, the weights cache is the trainer's) or as an
        `rlboost worker` process on the reserved pool handing off to the preemptible one."""
        cfg, ro = self.cfg, self.cfg.settings.rollout
        # disaggregated: the reserved side only trains; its engine serves only with no live worker
        weight = 0.0 if cfg.policy == "disaggregated" else 1.0

        def settings(pool: str, handoff_pool: str) -> WorkerSettings:
            return WorkerSettings(pool=pool, handoff_pool=handoff_pool, slots=cfg.slots,
                                  checkpoint_tokens=cfg.checkpoint_tokens)

        if ro.vllm_sleep and ro.seeding != "in_process":
            raise EngineError("rollout.vllm_sleep needs rollout.seeding = in_process (the engine shares the trainer's GPUs)")
        engine = make_seeding_engine(ro.seeding_engine, cfg.model_dir, self.cfg.settings.worker, sleep=ro.vllm_sleep)
        if ro.seeding == "process":
            fleet = WorkerFleet(nats_url, redis_url, workdir, RESERVED_POOL, worker_args=[
                "--engine", ro.seeding_engine, "--model-dir", cfg.model_dir, "--slots", str(cfg.slots),
                "--checkpoint-tokens", str(cfg.checkpoint_tokens), "--handoff-pool", POOL],
                env={"RLBOOST_WORKER__CACHE_DIR": str(self.run_dir / "weight-cache"), "RLBOOST_LOG_LEVEL": "warning"},
                die_with_parent=True)
            return ProcessSeeding(self.c, POOL, fleet, [()], engine, settings, self.reserved_counters,
                                  weights=None, weight=weight)
        return InProcessSeeding(self.c, POOL, RESERVED_POOL, engine, settings, self.reserved_counters,
                                weights=None, weight=weight, sleep=ro.vllm_sleep)

    @property
    def version(self) -> int:
        return self.base_version + self.trainer.version

    async def setup(self) -> None:
        store = await open_store(js=self.c.js)
        pointer = await VersionPointer.open(self.c.js)
        self.publisher = WeightPublisher(store, pointer, **self.cfg.settings.weights.publisher_options())
        self.publisher_pointer = pointer
        self.weights = StoreWeights(WeightCache(self.run_dir / "weight-cache" / "reserved", store), wait_s=30.0)
        self.seeding.weights = self.weights  # the reserved engine pulls what the trainer published
        latest = await pointer.get()
        resumed = self.resumed_weights
        if resumed and resumed["version"] in await published_versions(store):
            # a resumed run goes on with the checkpoint's published version: the results its
            # previous life finished for the interrupted step name it (and its digest)
            self.base_version = resumed["version"] - self.trainer.version
            self.weights_digest = {resumed["version"]: resumed["digest"]}
            # async: the requests published ahead name up to max_staleness older versions
            kept = await published_versions(store)
            self.weights_digest |= {int(v): d for v, d in resumed.get("recent", {}).items() if int(v) in kept}
            if self.orchestrator.mode != "sync":
                # a previous life that ran past its last checkpoint published newer versions, and
                # requests it had in flight were generated with them (their results come back):
                # versions of this run's own store, trusted as its own
                for v in (v for v in kept if v > resumed["version"]):
                    with contextlib.suppress(StoreError):
                        self.weights_digest[v] = Manifest.decode(
                            await store.read_all(wire.weights_manifest_key(v))).digest()
        else:
            # a resumed trainer already counts its steps: the next version is still a new one
            self.base_version = (0 if latest is None else latest + 1) - self.trainer.version
            pub = await self.publisher.publish(await self._weights_to_publish(), version=self.version)
            self.weights_digest = {self.version: pub.manifest_digest}  # what results' segments must name
        self._carry_over()
        if isinstance(self.seeding, ProcessSeeding):
            await self.seeding.start(timeout_s=90.0)
        if self.cfg.policy != "colocated" and self.cfg.workers:
            for _ in range(self.cfg.workers):
                self.fleet.start(prefix=self.worker_prefix)
            deadline = time.monotonic() + 90.0  # torch import + model load take a while
            while len(await self.manager.live_workers()) < self.cfg.workers and time.monotonic() < deadline:
                await asyncio.sleep(0.25)

    def _carry_over(self) -> None:
        """A resumed partial run: draw again what its previous life drew from the checkpoint's
        data position on (the same prompts under the same request ids) and hand the groups it had
        not trained to the orchestrator, which publishes and collects them with the next step."""
        draws, carried = self._resumed_draws
        for s in sorted(draws):
            (groups, version), keep = draws[s], set(carried.get(s, ()))
            requests = self._make_requests(s, self.version, groups)  # the floor is this version anyway
            self._drawn_from[s] = (*self._drawn_from[s][:3], version)  # what its tokens may be as old as
            for g in set(range(groups)) - keep:
                self._samples.pop((s, g), None)  # trained before the checkpoint
            if keep:
                self.orchestrator.carry(s, [q for q in requests if q.group in keep])
        if carried:
            self.log.info("carried over from the checkpoint", groups=sum(map(len, carried.values())),
                          steps=sorted(carried))

    async def _weights_to_publish(self) -> dict[str, torch.Tensor]:
        """The full weights in the publish dtype, gathered tensor by tensor (every rank takes part)."""
        return await asyncio.to_thread(self.ops.call, "state_dict")

    def regenerated_tokens(self) -> int:
        """Tokens generated and never made durable, so generated again by someone (crash-proof
        counters of every worker and reserved engine of every life of this run)."""
        return sum(max(0, c["generated"] - c["checkpointed"])
                   for c in map(read_counters, sorted((self.run_dir / "workers").rglob("*.counters"))))

    def _requests(self, step: int, prompt_ids: list[list[int]], version: int) -> list[wire.RolloutRequest]:
        return [wire.RolloutRequest(
            request_id=wire.request_id(step, p, g, run=self.run_id), step=step, policy_version=version,
            prompt_ids=ids, max_new_tokens=self.max_response_tokens, seed=request_seed(self.cfg.seed, step, p, g),
            sampling=wire.SamplingParams(temperature=self.cfg.temperature),
            eos_id=self.stops[0] if self.stops else -1, stop_ids=self.stops, group=p)
            for p, ids in enumerate(prompt_ids) for g in range(self.cfg.samples)]

    def _prompts(self, step: int, n: int) -> tuple[list[Sample], list[list[int]], int]:
        """The step's prompts within the token budget; the ones over it are dropped and replaced."""
        filtered = 0

        def dropped(smp: Sample, n_tokens: int) -> None:
            nonlocal filtered
            filtered += 1
            self.log.warning("prompt over the token budget: filtered", step=step, sample=smp.index, tokens=n_tokens,
                             limit=self.budget.limit)

        chosen = self.budget.fill(self.data.next_batch, lambda smp: encode_prompt(self.tokenizer, smp),
                                  n, dropped)
        return [smp for smp, _ in chosen], [ids for _, ids in chosen], filtered

    def _items(self, sample: Sample, results: list[wire.RolloutResult]) -> list[Item]:
        return [Item(prompt=sample.prompt_for_reward(), response=decode_response(self.tokenizer, r.token_ids, self.stops),
                     ground_truth=sample.ground_truth, data_source=sample.data_source, finish_reason=r.finish_reason,
                     extra=sample.extra, chat=sample.messages is not None) for r in results]

    async def _score(self, sample: Sample, results: list[wire.RolloutResult]) -> tuple[list[float], int, int]:
        """Rewards of one group, in `results` order; an `error` result (a request no engine could
        serve) scores 0 without a call. Returns (rewards, reward errors, reward timeouts)."""
        ok = [i for i, r in enumerate(results) if r.finish_reason != "error"]
        rewards = [0.0] * len(results)
        scored = await self.rewards.ascore(self._items(sample, [results[i] for i in ok]),
                                           [results[i].request_id for i in ok])
        for i, v in zip(ok, scored.values, strict=True):
            rewards[i] = v
        return rewards, scored.errors, scored.timeouts

    async def evaluate(self) -> float | None:
        """Mean reward of greedy responses on the held-out set (None: there is none)."""
        if not self.eval_set:
            return None
        rows = await asyncio.to_thread(self.ops.call, "greedy", [ids for _, ids in self.eval_set],
                                       self.max_response_tokens, self.stops, self.pad)
        items = [Item(prompt=smp.prompt_for_reward(), response=decode_response(self.tokenizer, row, self.stops),
                      ground_truth=smp.ground_truth, data_source=smp.data_source,
                      finish_reason="stop" if any(t in self.stops for t in row) else "length", extra=smp.extra,
                      chat=smp.messages is not None) for (smp, _), row in zip(self.eval_set, rows, strict=True)]
        scored = await self.rewards.ascore(items, [f"eval-{smp.index}" for smp, _ in self.eval_set])
        return sum(scored.values) / len(scored.values)

    async def step(self, step: int) -> dict:
        """One step of the product's orchestration (rlboost/orchestrator.py) with the real trainer."""
        cfg = self.cfg
        t_step = time.monotonic()
        self.trainer.start_step(step, policy_version=self.version)  # token staleness is counted from it
        self._step_counts = {"reward_errors": 0, "reward_timeouts": 0, "request_errors": 0, "filtered": 0}
        # the steps a dead trainer published past its checkpoint go out again under the same request ids
        o = await self.orchestrator.step(step, self.version, self._make_requests, cfg.prompts,
                                         republish=step <= self.republish_through)
        rep, pub = o.report
        counts = {k: v for k, v in self._step_counts.items() if k != "filtered"}
        filtered = self._step_counts["filtered"]
        live = o.live
        if cfg.save_rollouts:
            self._save_rollouts({k: results for k, results in o.trained})
        step_s = time.monotonic() - t_step  # held-out evaluation is bookkeeping, not the step
        eval_acc = None
        if step % cfg.eval_every == 0 or step == cfg.steps - 1:
            eval_acc = await self.evaluate()
        self.handoffs_total += o.handoffs
        metrics.WORKERS_LIVE.labels(POOL).set(live)
        rs = self.cfg.settings.run
        if rs.gpu_hour_dollars or rs.worker_hour_dollars:  # reserved ranks + live preemptible workers, by uptime
            reserved_cost = step_s / 3600 * rs.gpu_hour_dollars * self.trainer.ranks.world
            spot_cost = step_s / 3600 * rs.worker_hour_dollars * live
            metrics.COST_DOLLARS.labels(RESERVED_POOL).inc(reserved_cost)
            metrics.COST_DOLLARS.labels(POOL).inc(spot_cost)
            self.dollars += reserved_cost + spot_cost
        regenerated = self.regenerated_tokens()
        row = {"step": step, "policy": cfg.policy, "mode": self.orchestrator.mode, "version": self.version,
               "run_id": self.run_id, "t_seed": None if o.t_seed is None else round(o.t_seed, 3), "live_workers": live,
               "reward": round(rep.reward_mean, 4), "eval_acc": eval_acc,
               "tokens": rep.tokens, "step_s": round(step_s, 3), "tokens_per_s": round(rep.tokens / step_s, 1),
               "trainer_wait_s": round(o.trainer_wait_s, 3), "spot_idle_s": round(o.spot_waiting_s, 3),
               "rollout_ahead_s": round(o.rollout_ahead_s, 3),
               "handoffs": o.handoffs, "fallback": o.fallback, "mean_response_tokens":
               round(rep.mean_response_tokens, 2), "max_response_tokens": rep.max_response_tokens,
               "truncation_rate": round(rep.truncation_rate, 4), "reward_std": round(rep.reward_std, 4),
               "loss": round(rep.loss, 6), "kl": round(rep.kl, 6), "entropy": round(rep.entropy, 4),
               "grad_norm": round(rep.grad_norm, 6), "lr": rep.lr, "clip_fraction": round(rep.clip_fraction, 4),
               "trained_tokens_per_s": round(rep.trained_tokens_per_s, 1), "regenerated_tokens": regenerated,
               "dollars": round(self.dollars, 4) if (rs.gpu_hour_dollars or rs.worker_hour_dollars) else None,
               "weights_bytes_uploaded": getattr(pub, "bytes_uploaded", None), "chaos": cfg.chaos.get(step, []),
               "prompts": len(o.trained), "filtered_prompts": filtered, **counts,
               "carried_groups": o.carried_groups, "data": self.data.state()}
        row.update(rep.off_policy_row())  # IS ratio and per-token staleness statistics (algorithm.off_policy)
        metrics.observe_training(row)
        return row

    # ------------------------------------------------------------------ the orchestrator's parts

    def _make_requests(self, step: int, version: int, groups: int) -> list[wire.RolloutRequest]:
        """The orchestrator asks for a step's requests (`groups` prompts, under `version`)."""
        # where the data stood before the step's draw: an async run publishes steps ahead, and a
        # checkpoint keeps the position of its first untrained step (`checkpoint_meta`)
        self._drawn_from.setdefault(step, (self.data.state(), self.filtered_total, groups, version))
        samples, prompt_ids, filtered = self._prompts(step, groups)
        self.filtered_total += filtered
        if hasattr(self, "_step_counts"):
            self._step_counts["filtered"] += filtered
        for p, smp in enumerate(samples):
            self._samples[(step, p)] = smp
        return self._requests(step, prompt_ids, version)

    def _on_result(self, r: wire.RolloutResult, arrived: int, total: int) -> None:
        if self.orchestrator.mode == "sync":
            check_weights(r, self.version, self.weights_digest.get(self.version, ""))  # on-policy or refused
        else:  # each segment from a version this run published, with exactly its weights
            check_segments(r, self.weights_digest)
        if r.finish_reason == "error":
            self._step_counts["request_errors"] += 1
            self.log.warning("request failed on the engine", request_id=r.request_id, error=r.error)
        self.report.progress(r.step, arrived, total)
        if arrived == total // 2 + 1 and r.step in self.cfg.chaos:  # mid-step
            self._chaos(r.step)

    async def score(self, key: tuple[int, int], results: list[wire.RolloutResult]) -> list[float]:
        rewards, errors, timeouts = await self._score(self._samples[key], results)
        self._step_counts["reward_errors"] += errors
        self._step_counts["reward_timeouts"] += timeouts
        return rewards

    async def train_group(self, key: tuple[int, int], results: list[wire.RolloutResult], rewards: list[float],
                          start: float) -> float:
        # sync / async: the group's index in its own step (ordered streaming stays reproducible);
        # partial mixes steps in one batch: its position in the batch
        index = key[1] if self.orchestrator.mode != "partial" else self._batch_position
        self._batch_position += 1
        self._samples.pop(key, None)
        await asyncio.to_thread(self.trainer.add_group, index, results, rewards)
        return time.monotonic()

    async def finish_step(self, step: int):
        self._batch_position = 0
        rep = await asyncio.to_thread(self.trainer.finish_step)
        latest = await self.publisher_pointer.get()
        if latest is not None and self.version <= latest:  # resumed: never reuse a number a dead life published
            self.base_version += latest + 1 - self.version
        pub = await self.publisher.publish(await self._weights_to_publish(), version=self.version)
        self.weights_digest[self.version] = pub.manifest_digest
        metrics.POLICY_VERSION.labels("trainer").set(self.version)
        # async: requests published k versions back are still generated with their weights
        # [weights] keep_versions, and every base a kept delta needs; async: requests published k
        # versions back are still generated with their weights
        await self.publisher.gc(keep=self.cfg.settings.weights.keep_versions + self.orchestrator.max_staleness)
        return rep, pub

    def _save_rollouts(self, groups: dict[int, list[wire.RolloutResult]]) -> None:
        with open(self.run_dir / "rollouts.jsonl", "a") as f:
            for r in sorted((r for g in groups.values() for r in g), key=lambda r: r.request_id):
                f.write(json.dumps({"id": r.request_id.removeprefix(f"{self.run_id}-"), "tokens": r.token_ids,
                                    "logprobs": r.logprobs, "workers": [seg.worker_id for seg in r.segments]}) + "\n")

    def _chaos(self, step: int) -> None:
        for kind in self.cfg.chaos.get(step, []):
            live = [w for w in self.fleet.live() if w.fate == "running"]
            if not live:
                return
            w = live[0]
            if kind == "kill":
                self.fleet.kill(w)
            else:
                self.fleet.terminate(w)
            self.log.warning("chaos", step=step, action=kind, worker_id=w.worker_id)
            self.fleet.start(prefix=self.worker_prefix)

    async def close(self) -> None:
        await self.orchestrator.close()  # first: groups still being scored need the reward pool
        await self.seeding.close()
        self.fleet.stop_all()
        self.rewards.close()
        if self.seeding.engine is not None:
            await self.seeding.engine.close()

    def checkpoint_meta(self, eval_first: float | None, step: int) -> dict:
        """The run's state after `step`. An async run has drawn and published the prompts of the
        steps after it already; a partial run holds groups of earlier steps in flight (`carried`).
        The data position saved is the one before the first draw whose groups are not all trained,
        with each draw's size since (`draws`), so a resumed life draws the same prompts under the
        same request ids; and the digests of the versions those requests may name are saved with
        the newest one."""
        w = self.window
        carried = self.orchestrator.untrained() if self.orchestrator.mode == "partial" else {}
        first = min(carried, default=step + 1)
        for s in [s for s in self._drawn_from if s < first]:
            del self._drawn_from[s]
        data_state, filtered_total, _, _ = self._drawn_from.get(
            first, (self.data.state(), self.filtered_total, 0, self.version))
        if carried:  # partial: a carried response may hold tokens of every version since its draw
            oldest = min(self._drawn_from[s][3] for s in carried)
        else:
            oldest = self.version - self.orchestrator.max_staleness
        return {"run_id": self.run_id, "eval_first": eval_first, "handoffs_total": self.handoffs_total,
                "published": {"version": self.version, "digest": self.weights_digest.get(self.version, ""),
                              "recent": {str(v): d for v, d in self.weights_digest.items() if oldest <= v < self.version}},
                "carried": {str(s): gs for s, gs in carried.items()},
                "draws": {str(s): list(self._drawn_from[s][2:]) for s in range(first, step + 1)} if carried else {},
                "filtered_total": filtered_total, "dollars": self.dollars, "data_state": data_state,
                "seed_window": {"t_seed": w.t_seed, "memory": {str(k): v for k, v in w.memory.items()},
                                "workers": w._workers}}

    def restore(self, state: dict) -> None:
        """The run's own state from a checkpoint (the trainer's is restored by trainer.checkpoint)."""
        if state.get("data_state") is not None:
            self.data.load_state(state["data_state"])
        self.resumed_weights = state.get("published")
        self.resumed_step = state["step"] + 1
        # A previous life that ran past its checkpoint (checkpoint_every > 1) published later steps
        # too, under the same ids as this life will: up to the step after its last row in
        # metrics.jsonl (the one it died in), plus the k steps async publishes ahead.
        reached = self.resumed_step
        with contextlib.suppress(OSError):
            for line in (self.run_dir / "metrics.jsonl").read_text().splitlines():
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    reached = max(reached, int(json.loads(line)["step"]) + 1)
        self.republish_through = reached + self.orchestrator.max_staleness
        self._resumed_draws = ({int(s): n for s, n in (state.get("draws") or {}).items()},
                               {int(s): gs for s, gs in (state.get("carried") or {}).items()})
        w = state.get("seed_window") or {}
        if w:
            self.window.t_seed = w["t_seed"]
            self.window.memory = {int(k): v for k, v in w["memory"].items()}
            self.window._workers = w["workers"]
        self.handoffs_total = state.get("handoffs_total", 0)
        self.filtered_total = state.get("filtered_total", 0)
        self.dollars = state.get("dollars", 0.0)


def make_data(cfg: RunConfig) -> tuple[GeneratedData | FileData, str, int]:
    """(prompt source, reward spec, max response tokens) from the task / data / reward settings."""
    task = cfg.task or ("addition" if not cfg.data else "")
    if task and task not in TASKS and task != "math":
        raise DataError(f"unknown task {task!r}; built in: addition, math")
    if not cfg.data:
        if task != "addition":
            raise DataError(f"the {task} task needs --data (a JSONL/Parquet file or a datasets folder)")
        generator = get_task("addition")
        return (GeneratedData(generator, seed=cfg.seed), cfg.reward or "addition",
                cfg.max_response_tokens or generator.max_response_chars + 1)  # + EOS: never truncates an answer
    reward = cfg.reward or task
    if not reward:
        raise RewardError("--data needs a reward: --reward module:fn or path/to/file.py:fn (or --task math)")
    data = FileData(cfg.data, cfg.eval_data, FieldMap(**cfg.fields), seed=cfg.seed, shuffle=cfg.shuffle,
                    epochs=cfg.epochs, eval_size=cfg.eval_size, eval_fraction=cfg.eval_fraction)
    return data, reward, cfg.max_response_tokens or 512


def run_identity(run_dir: Path, resume: bool, wanted: str = "") -> str:
    """The run id: kept in <run_dir>/run.json, so a resumed run (even one killed before its first
    checkpoint) publishes under the same request ids."""
    path = run_dir / "run.json"
    if resume and path.exists():
        return json.loads(path.read_text())["run_id"]
    if resume:
        raise ConfigError(f"--resume {run_dir}: no run.json there (not a run folder)")
    run_id = wire.check_name("run id", wanted) if wanted else wire.new_run_id()
    path.write_text(json.dumps({"run_id": run_id}) + "\n")
    return run_id


async def train(cfg: RunConfig, nats_url: str, redis_url: str, run_dir: Path, settings: Settings | None = None,
                ranks: distributed.Ranks = distributed.SINGLE) -> dict:
    report = RunReport(run_dir, cfg.steps)
    rs = cfg.settings.run
    run_id = run_identity(run_dir, cfg.resume, rs.run_id)
    trainer = make_trainer(cfg, ranks)
    ops = distributed.Lockstep(trainer, ranks)
    async with open_clients(nats_url, redis_url, "rlboost-trainer", settings=settings,
                            pools=(POOL, RESERVED_POOL)) as c:
        run = None
        loggers = None
        rows: list[dict] = []
        t0 = time.monotonic()
        stop_metrics = asyncio.Event()
        if cfg.metrics_port:
            metrics.start_metrics_server(cfg.metrics_port, cfg.metrics_bind)
            asyncio.create_task(metrics.poll_queue_pending(c.js, (POOL,), stop_metrics))
        first_step, last_saved, eval_first, resumed = 0, -1, None, False
        try:
            run = Run(cfg, c, nats_url, redis_url, run_dir, report, run_id, trainer)
            loggers = Loggers(rs.loggers, run_dir, run_id, rs.wandb_project, rs.wandb_mode,
                              config={k: v for k, v in msgspec.to_builtins(cfg.settings).items() if k != "services"})
            last = ckpt.latest(run_dir) if cfg.resume else None
            if last is not None:
                state = await asyncio.to_thread(ops.call, "load_checkpoint", str(last))
                run.restore(state)
                first_step, last_saved, eval_first, resumed = state["step"] + 1, state["step"], state.get("eval_first"), True
                run.log.warning("resumed", checkpoint=str(last), step=first_step, version=trainer.version)
            await run.setup()
            if not resumed:
                eval_first = await run.evaluate()
            report.start(eval_first)

            async def save(step: int) -> None:
                nonlocal last_saved
                await asyncio.to_thread(ops.call, "save_checkpoint", str(run_dir), step, run.checkpoint_meta(eval_first, step),
                                        rs.keep_checkpoints)
                last_saved = step

            for step in range(first_step, cfg.steps):
                try:
                    row = await run.step(step)
                except DataExhausted as e:
                    run.log.warning("data exhausted: the run ends here", step=step, reason=str(e))
                    if rows and rows[-1]["eval_acc"] is None:
                        rows[-1]["eval_acc"] = await run.evaluate()
                    break
                rows.append(row)
                report.step(row)
                loggers.log(row)
                stop_early = cfg.max_minutes and time.monotonic() - t0 > cfg.max_minutes * 60 and step < cfg.steps - 1
                if stop_early and row["eval_acc"] is None:
                    row["eval_acc"] = await run.evaluate()
                if rs.checkpoint_every and (step + 1) % rs.checkpoint_every == 0:
                    await save(step)
                if stop_early:
                    break
            if rows and last_saved != rows[-1]["step"]:
                await save(rows[-1]["step"])  # and always at the end
            final_sha = None if ranks.distributed else weights_sha256(trainer.state_dict(torch.float32))
        finally:
            stop_metrics.set()
            ops.stop()  # followers (FSDP ranks) leave their loop
            if loggers is not None:
                loggers.close()
            if run is not None:
                await run.close()
            report.close()
        if not rows:
            raise DataError("no step ran: the data was exhausted before the first one")
        evals = [r["eval_acc"] for r in rows if r["eval_acc"] is not None]
        final = ckpt.latest(run_dir)
        return {"steps": rows[-1]["step"] + 1, "steps_this_life": len(rows),
                "resumed_from_step": first_step if resumed else None, "policy": cfg.policy, "run_id": run_id,
                "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
                "eval_first": None if eval_first is None else round(eval_first, 4),
                "eval_last": round(evals[-1], 4) if evals else None, "handoffs": run.handoffs_total,
                "regenerated_tokens": run.regenerated_tokens(), "precision": trainer.precision,
                "device": str(trainer.device), "ranks": ranks.world,
                "tokens_per_s": round(sum(r["tokens"] for r in rows) / max(1e-9, sum(r["step_s"] for r in rows)), 1),
                "wall_s": round(time.monotonic() - t0, 1), "final_weights_sha256": final_sha,
                "filtered_prompts": run.filtered_total, "reward_errors": run.rewards.errors,
                "reward_timeouts": run.rewards.timeouts,
                "request_errors": sum(r["request_errors"] for r in rows), "data": run.data.state(),
                "checkpoint": str(final) if final else None, "run_dir": str(run_dir)}


def follow(cfg: RunConfig, ranks: distributed.Ranks) -> None:
    """A rank other than 0: the same trainer, driven by rank 0 until it stops."""
    trainer = make_trainer(cfg, ranks)
    distributed.Lockstep(trainer, ranks).follow()


def resolve_model(cfg: RunConfig, s: Settings) -> str:
    """A user's `--model-dir` is checked and used as it is: read, never written. Without one
    (or with `--init-model`, for a folder of rlboost's own such as a container volume), the
    demo's model, built and warm-started on first use."""
    if cfg.model_dir and not cfg.init_model:
        return str(check_model_dir(cfg.model_dir).path)
    model_dir = Path(cfg.model_dir or Path(s.services.data_dir).expanduser() / "model").expanduser()
    if model_dir.exists() and any(model_dir.iterdir()) and not (model_dir / META_FILE).exists():
        raise ModelDirError(f"{model_dir} holds files that rlboost init-model did not make: "
                            "not building the demo model there")
    if not (model_dir / "config.json").exists() or not read_meta(model_dir).get("trained"):
        from trainer.bootstrap import warm_start

        print(f"bootstrapping the model into {model_dir} (build + supervised warm start)...", flush=True)
        threads = torch.get_num_threads()
        # One thread: with the cores shared (other jobs, a CPU hog) two OpenMP threads ran a step
        # of this ~1M-parameter model 5-7x slower than one (2.1-4.5 s against 0.44-0.62 s), and
        # the warm start hit its time cap at step 112 of the ~400 it needs
        torch.set_num_threads(1)
        configure_logging(json=s.log_json, level="info")  # its progress lines
        try:
            out = warm_start(get_task("addition"), model_dir, cfg.bootstrap_target, cfg.bootstrap_seconds, seed=0)
        finally:
            torch.set_num_threads(threads)
            configure_logging(json=s.log_json, level=os.environ.get("RLBOOST_LOG_LEVEL", "warning"))
        print(f"model ready: held-out greedy accuracy {out['eval_acc']:.3f} after {out['seconds']} s", flush=True)
    return str(model_dir)


def parse_chaos(spec: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        step, _, kind = part.partition(":")
        if kind not in ("term", "kill"):
            raise argparse.ArgumentTypeError(f"chaos {part!r}: use STEP:term or STEP:kill")
        out[int(step)].append(kind)
    return dict(out)


# `rlboost run` flags: shorthands for settings keys (any key: --section.key VALUE or section.key=VALUE)
FLAGS = {"policy": "run.policy", "steps": "run.steps", "max_minutes": "run.max_minutes", "prompts": "rollout.prompts",
         "samples": "rollout.samples", "workers": "run.workers", "slots": "rollout.slots", "lr": "trainer.lr",
         "seed": "run.seed", "eval_every": "run.eval_every", "t_seed": "rollout.t_seed",
         "t_seed_floor": "rollout.t_seed_floor", "mode": "rollout.mode", "max_staleness": "rollout.max_staleness", "shuffle_rewards": "run.shuffle_rewards", "chaos": "run.chaos",
         "save_rollouts": "run.save_rollouts", "model_dir": "run.model_dir", "init_model": "run.init_model",
         "run_dir": "run.run_dir", "nproc": "run.nproc", "precision": "trainer.precision", "device": "trainer.device",
         "task": "data.task", "data": "data.train", "eval_data": "data.eval", "reward": "data.reward",
         "max_prompt_tokens": "data.max_prompt_tokens", "max_response_tokens": "data.max_response_tokens",
         "eval_size": "data.eval_size", "epochs": "data.epochs", "reward_timeout": "data.reward_timeout_s"}


DEMO_STEPS = 20  # from the warm start's 0.44, GRPO reached 0.71 by step 15 and 0.75 by step 20


def parse(argv: list[str], demo: bool = False, s: Settings | None = None) -> RunConfig:
    """The command line on top of the settings tree `s` (defaults < TOML < environment < this)."""
    s = s or Settings()
    p = argparse.ArgumentParser(prog="rlboost demo" if demo else "rlboost run", description=__doc__.splitlines()[0],
                                epilog="Any setting: --section.key VALUE or section.key=VALUE (e.g. --trainer.lr 1e-5).")
    p.add_argument("--policy", choices=["hybrid", "colocated", "disaggregated"])
    p.add_argument("--steps", type=int)
    p.add_argument("--max-minutes", type=float)
    p.add_argument("--prompts", type=int)
    p.add_argument("--samples", type=int)
    p.add_argument("--workers", type=int, help="preemptible worker processes to start")
    p.add_argument("--slots", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--t-seed", type=float, help="initial seeding window (s)")
    p.add_argument("--t-seed-floor", type=float)
    p.add_argument("--mode", choices=["sync", "partial", "async"], help="rollout mode (rlboost/orchestrator.py)")
    p.add_argument("--max-staleness", type=int, help="async: versions a trained token may lag")
    p.add_argument("--shuffle-rewards", action="store_true", default=None,
                   help="control: rewards shuffled within each group")
    p.add_argument("--chaos", type=lambda v: (parse_chaos(v), v)[1], help="e.g. 3:term,5:kill (mid-step, then restart)")
    p.add_argument("--save-rollouts", action="store_true", default=None, help="write every response to rollouts.jsonl")
    p.add_argument("--model-dir", help="a Hugging Face causal-LM folder (read only; default: the "
                   "demo model in the data dir, built on first use)")
    p.add_argument("--init-model", action="store_true", default=None, help="build the demo model into --model-dir "
                   "first if it is missing (like `rlboost init-model --out`; refused for a folder init-model did not make)")
    p.add_argument("--run-dir")
    p.add_argument("--nproc", type=int, help="trainer ranks: FSDP2 under torchrun (launched for you)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32", "fp64"])
    p.add_argument("--device")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its last checkpoint")
    g = p.add_argument_group("data and reward (settings [data])")
    g.add_argument("--task", help="built-in task: addition (generated) | math")
    g.add_argument("--data", help="training data: JSONL, Parquet or a datasets folder")
    g.add_argument("--eval-data", help="held-out data (default: a split of --data)")
    g.add_argument("--reward", help="module:fn | path/to/file.py:fn | addition | math")
    g.add_argument("--max-prompt-tokens", type=int)
    g.add_argument("--max-response-tokens", type=int)
    g.add_argument("--eval-size", type=int)
    g.add_argument("--epochs", type=int, help="0 = as many as the steps need")
    g.add_argument("--reward-timeout", type=float, help="seconds per reward call")
    a, rest = p.parse_known_args(argv)
    overrides = parse_overrides(rest)
    for name, key in FLAGS.items():
        value = getattr(a, name)
        if value is not None:
            section, _, k = key.partition(".")
            overrides.setdefault(section, {})[k] = value
    if demo and a.steps is None:
        # a number of steps, not minutes: a time cap gave a busy box too few steps to show learning
        overrides.setdefault("run", {}).setdefault("steps", DEMO_STEPS)
    if a.resume:
        # the run's own effective settings first, then the environment, then this command line
        saved = Path(a.resume) / "settings.toml"
        if not saved.exists():
            raise ConfigError(f"--resume {a.resume}: no settings.toml there (not a run folder)")
        s = load_settings(saved, overrides=overrides)
        saved_ro = load_settings(saved).rollout
        ro, kept = s.rollout, ("mode", "prompts", "overprovision")
        if "partial" in (saved_ro.mode, ro.mode) and any(getattr(ro, k) != getattr(saved_ro, k) for k in kept):
            # a resumed life draws again what its previous one drew since the checkpoint and carries
            # its groups in flight over (`Run._carry_over`): the same draws need the same sizes
            raise ConfigError(f"--resume {a.resume}: the run is in rollout.mode = '{saved_ro.mode}' with prompts = "
                              f"{saved_ro.prompts} and overprovision = {saved_ro.overprovision:g}; a partial run's "
                              "resume keeps all three (it draws its groups in flight again under the same ids)")
        if saved_ro.mode == "async" and (s.rollout.mode, s.rollout.max_staleness) != ("async", saved_ro.max_staleness):
            # the steps it published ahead are republished as they were: same mode, same k
            raise ConfigError(f"--resume {a.resume}: the run is in rollout.mode = 'async' with max_staleness = "
                              f"{saved_ro.max_staleness}; a resume keeps both (it republishes the steps published "
                              "ahead of its checkpoint)")
        s.run.run_dir = a.resume
    else:
        s = apply_overrides(s, overrides)
    return RunConfig.from_settings(s, resume=bool(a.resume))


def effective_settings(cfg: RunConfig) -> str:
    """settings.toml of a run: start a new run from it (`rlboost --config settings.toml run`) and
    it is the same run (a new id and folder); `--resume` reads it back for this one."""
    s = msgspec.convert(msgspec.to_builtins(cfg.settings), Settings)
    s.run.run_dir, s.run.run_id, s.run.model_dir, s.run.init_model = "", "", cfg.model_dir, False
    return dump_toml(s)


def execute(cfg: RunConfig, s: Settings | None = None) -> dict:
    s = cfg.settings if s is None else s
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    random.seed(cfg.seed)
    ranks = distributed.init_from_env(cfg.settings.trainer.device)
    try:
        if ranks.leader:  # before anything starts: a folder that is not a model fails fast
            cfg.model_dir = resolve_model(cfg, s)
        cfg.model_dir = distributed.broadcast(cfg.model_dir, ranks)
        if not ranks.leader:
            follow(cfg, ranks)
            return {}
        run_dir = Path(cfg.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.metrics_port, cfg.metrics_bind = s.metrics.port, s.metrics.bind
        with running_services(s.services) as (nats_url, redis_url):
            if not cfg.resume:
                (run_dir / "settings.toml").write_text(effective_settings(cfg))
            return asyncio.run(train(cfg, nats_url, redis_url, run_dir, s, ranks))
    finally:
        distributed.shutdown()


RANKS_ARGV = "RLBOOST_RANKS_ARGV"


def launch_ranks(argv: list[str], nproc: int) -> int:
    """`rlboost run --nproc N ...` = `torchrun --standalone --nproc-per-node N -m rlboost.cli run ...`.

    The command line travels in the environment: torchrun's own parser would otherwise take
    `--nproc` (and any prefix of its options) for one of its own."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "trainer.run"]
    return subprocess.call(cmd, env={**os.environ, RANKS_ARGV: json.dumps(argv)})


def main(argv: list[str], s: Settings, demo: bool = False) -> int:
    cfg = parse(argv, demo, s)
    if cfg.settings.run.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch_ranks(sys.argv[1:], cfg.settings.run.nproc)
    if "RLBOOST_LOG_LEVEL" not in os.environ:  # the live table is the interface; logs only warn
        configure_logging(json=s.log_json, level="warning")
    try:
        out = execute(cfg)
    except (ModelDirError, DataError, RewardError, EngineError) as e:  # the user's input: one line, no traceback
        print(f"rlboost {'demo' if demo else 'run'}: error: {e}", file=sys.stderr)
        code = 2
    else:
        if out:
            print_result(out)
        code = 0
    if distributed.torchrun_rank():  # the ranks have left the group together (execute's shutdown)
        distributed.exit_rank(code)
    return code


if __name__ == "__main__":  # one rank under torchrun, started by `launch_ranks`
    from rlboost import cli

    sys.exit(cli.main(json.loads(os.environ[RANKS_ARGV])))
