"""A step's metrics row: what `metrics.jsonl`, the live table, the loggers and Prometheus show.

It assembles the row from what the parts report (the orchestrator's `StepOutcome`, the
trainer's `StepReport`, the ledger's publish report, the scorer's and the request source's
per-step counts) and keeps the run's running totals a checkpoint carries: hand-offs, failed
requests per step, and the dollars (reserved ranks and live preemptible workers by uptime, at
`run.gpu_hour_dollars` / `run.worker_hour_dollars`; none counted when both are 0).
With `[fleet]` set it also holds the fleet policy's decision on the step's measured signals
(`fleet_desired`, `fleet_reason`; the gauge `rlboost_fleet_desired_workers`).
`save_rollouts` is `--save-rollouts`: every trained response, for comparisons between runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from rlboost import fleet_policy, metrics, wire
from rlboost.config import FleetSettings, RunSettings
from rlboost.logs import get_logger
from rlboost.orchestrator import StepOutcome


class StepMetrics:
    def __init__(self, run_id: str, policy: str, mode: str, prices: RunSettings, reserved_ranks: int, *,
                 pool: str, reserved_pool: str, fleet: FleetSettings | None = None,
                 reserved_ids: Callable[[], set[str]] = set, t_seed_floor_s: float = 0.0) -> None:
        """`fleet`: the fleet policy whose decision each row carries (hybrid runs); `reserved_ids`:
        the reserved side's worker ids (not counted as preemptible); `t_seed_floor_s`: the window's floor."""
        self.run_id, self.policy, self.mode, self.reserved_ranks = run_id, policy, mode, reserved_ranks
        self.pool, self.reserved_pool = pool, reserved_pool
        self.gpu_hour, self.worker_hour = prices.gpu_hour_dollars, prices.worker_hour_dollars
        self.log = get_logger(component="run", policy=policy, run_id=run_id)
        self.handoffs_total = 0
        self.dollars = 0.0
        self.request_errors = 0  # this step's
        self.fleet = fleet
        self.fleet_signals: fleet_policy.Signals | None = None
        self.reserved_ids = reserved_ids
        self.t_seed_floor_s = t_seed_floor_s

    def begin_step(self) -> None:
        self.request_errors = 0

    def on_result(self, r: wire.RolloutResult) -> None:
        if r.finish_reason == "error":
            self.request_errors += 1
            self.log.warning("request failed on the engine", request_id=r.request_id, error=r.error)

    def row(self, step: int, o: StepOutcome, step_s: float, *, version: int, eval_acc: float | None,
            regenerated: int, chaos: list[str], filtered: int, reward_errors: int, reward_timeouts: int,
            data_state: dict) -> dict:
        rep, pub = o.report
        live = o.live
        self.handoffs_total += o.handoffs
        metrics.WORKERS_LIVE.labels(self.pool).set(live)
        priced = bool(self.gpu_hour or self.worker_hour)
        if priced:  # reserved ranks + live preemptible workers, by uptime
            reserved_cost = step_s / 3600 * self.gpu_hour * self.reserved_ranks
            spot_cost = step_s / 3600 * self.worker_hour * live
            metrics.COST_DOLLARS.labels(self.reserved_pool).inc(reserved_cost)
            metrics.COST_DOLLARS.labels(self.pool).inc(spot_cost)
            self.dollars += reserved_cost + spot_cost
        row = {"step": step, "policy": self.policy, "mode": self.mode, "version": version,
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
               "dollars": round(self.dollars, 4) if priced else None,
               "weights_bytes_uploaded": getattr(pub, "bytes_uploaded", None), "chaos": chaos,
               "prompts": len(o.trained), "filtered_prompts": filtered, "reward_errors": reward_errors,
               "reward_timeouts": reward_timeouts, "request_errors": self.request_errors,
               "carried_groups": o.carried_groups, "data": data_state}
        row.update(rep.off_policy_row())  # IS ratio and per-token staleness statistics (algorithm.off_policy)
        if self.fleet is not None:
            row.update(self.fleet_decision(o, step_s, rep.trained_tokens_per_s))
        metrics.observe_training(row)
        return row

    def fleet_decision(self, o: StepOutcome, step_s: float, trained_tokens_per_s: float) -> dict:
        """The fleet policy on this step's measured signals (rlboost/fleet_policy.py): the number of
        preemptible workers it wants, exported as `rlboost_fleet_desired_workers` for a scaler.
        What could be rented is unknown here: `fleet.max_instances`, or one more than live (0)."""
        f = self.fleet
        available = f.max_instances or o.live + 1
        self.fleet_signals = fleet_policy.measure(
            self.fleet_signals, trained=o.trained, live=o.live, rollout_s=o.rollout_s, step_s=step_s,
            t_seed_s=o.t_seed, reserved_ids=self.reserved_ids(), available=available,
            trainer_s_per_token=1.0 / trained_tokens_per_s if trained_tokens_per_s else 0.0,
            t_seed_floor_s=self.t_seed_floor_s, sync=self.mode == "sync")
        d = fleet_policy.decide(f, self.fleet_signals)
        metrics.FLEET_DESIRED.labels(self.pool, f.policy).set(d.desired)
        return {"fleet_desired": d.desired, "fleet_reason": d.reason}

    def state(self) -> dict:
        return {"handoffs_total": self.handoffs_total, "dollars": self.dollars}

    def restore(self, state: dict) -> None:
        self.handoffs_total = state.get("handoffs_total", 0)
        self.dollars = state.get("dollars", 0.0)


def save_rollouts(path: Path, run_id: str, trained: list[tuple[tuple[int, int], list[wire.RolloutResult]]]) -> None:
    """Append every trained response of a step (ids without the run prefix, tokens, logprobs,
    the workers that generated it) to `path`, in request id order."""
    with open(path, "a") as f:
        for r in sorted((r for _, g in trained for r in g), key=lambda r: r.request_id):
            f.write(json.dumps({"id": r.request_id.removeprefix(f"{run_id}-"), "tokens": r.token_ids,
                                "logprobs": r.logprobs, "workers": [seg.worker_id for seg in r.segments]}) + "\n")
