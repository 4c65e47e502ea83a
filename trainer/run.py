"""The training run behind `rlboost run` (and `rlboost demo`): RL training with rollout offloaded to preemptible workers.

One process is the reserved cluster: the GRPO trainer plus a seeding engine (in this process by
default, or an `rlboost worker` process on the reserved pool: `[rollout] seeding`, `seeding_engine`).
Preemptible workers are separate processes (`rlboost worker --engine torch`) that can vanish at any
time. The step itself (hybrid / colocated / disaggregated policies, the seeding window, hand-off,
fallback, rollout modes sync / partial / async) is `rlboost.orchestrator.Orchestrator`, the same
code `rlboost bench trace` measures. This module only wires parts, each owning one job
(`setup`), and drives them (`step`, `main_loop`):

- `rlboost.trainer.data_task`: the run's task, the orchestrator's `RolloutTask` (a step's requests, a
  group's scores, the held-out evaluation): single-turn prompts or episodes (`[env] ref`), the
  same parts of other kinds, so that nothing here asks which;
- `rlboost.trainer.trainer_port`: the GRPO trainer as the orchestrator's `TrainerPort`;
- `rlboost.weights.ledger`: policy versions (numbers, publish + gc, digests, result checks);
- `rlboost.trainer.local_fleet`: this box's worker processes and seeding engine, and `--chaos`;
- `rlboost.trainer.step_metrics`: a step's metrics row; `rlboost.trainer.resume`: a checkpoint's run state.

Model, data and reward are the user's (README "Your model, your data, your reward"): any
Hugging Face causal-LM folder (read, never written), a dataset file (trainer.data) or the
built-in `addition` generator, and a reward function run in a process pool (trainer.rewards).
Prompts are token ids (chat template for chat data); a prompt over its token budget is
filtered before the step, counted and logged; requests carry every EOS id of the model.

The command around it (flags, the checks before anything slow, the model it runs on, one
process or torchrun ranks) is `rlboost.trainer.command`; resuming a run is `rlboost.trainer.resume` and
docs/guides/resume.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from rlboost import metrics, pool_client, runlease, wire
from rlboost.clients import Clients, open_clients
from rlboost.config import Settings
from rlboost.logs import get_logger
from rlboost.modeldir import check_model_dir, stop_ids
from rlboost.orchestrator import Orchestrator, OrchestratorPorts
from rlboost.weights import WeightCache
from rlboost.weights.ledger import VersionLedger
from rlboost.weights.source import StoreWeights
from rlboost.trainer import training_checkpoint as ckpt
from rlboost.trainer import distributed
from rlboost.trainer.data import DataError, DataExhausted
from rlboost.trainer.data_task import DataTask, make_task, read_data
from rlboost.trainer.episodes.runner import worker_env
from rlboost.trainer.grpo_trainer import GRPOTrainer
from rlboost.trainer.local_fleet import Chaos, LocalFleet, parse_chaos
from rlboost.trainer.loggers import Loggers
from rlboost.trainer.model import weights_sha256
from rlboost.trainer.report import RunReport
from rlboost.trainer.resume import Resumed, checkpoint_meta, fresh_from, remember_start, restore, restore_start, \
    run_identity
from rlboost.trainer.step_metrics import StepMetrics, save_rollouts
from rlboost.trainer.trainer_port import GRPOPort
from rlboost.workers.seeding import ProcessSeeding

POOL = "spot"
RESERVED_POOL = "reserved"


@dataclass
class Invocation:
    """`rlboost run`'s command line, read: the settings tree (every flag is a shorthand for one of
    its keys; each part takes its own section) and whether it continues `run.run_dir` (`--resume`)."""

    settings: Settings = field(default_factory=Settings)
    resume: bool = False


def make_trainer(s: Settings, model_dir: str, ranks: distributed.Ranks = distributed.SINGLE) -> GRPOTrainer:
    return GRPOTrainer(model_dir, s.trainer, s.algorithm, temperature=s.rollout.temperature, seed=s.run.seed,
                       shuffle_rewards=s.run.shuffle_rewards, total_steps=s.run.steps, ranks=ranks)


@dataclass
class Launch:
    """What `train` brings to `setup`: the command, the model and the run's folder and id, the
    servers (connected, the run's lease held), the trainer and its ranks' lockstep, the live
    report. `prepared`: the task's data if a preflight read it already (`read_data`'s answer: it
    is not read twice)."""

    inv: Invocation
    model_dir: str
    run_dir: Path
    run_id: str
    clients: Clients
    nats_url: str
    redis_url: str
    trainer: GRPOTrainer
    ops: distributed.Lockstep  # what every rank must run, rank 0 announces
    report: RunReport
    prepared: tuple | None = None


@dataclass
class Run:
    """The parts `setup` wired, each owning one job; `step` and `main_loop` drive them."""

    settings: Settings
    run_id: str
    run_dir: Path
    trainer: GRPOTrainer
    ops: distributed.Lockstep  # what every rank must run, rank 0 announces
    report: RunReport
    loggers: Loggers
    task: DataTask  # a step's requests, a group's scores, the held-out evaluation
    fleet: LocalFleet  # this life's worker processes
    ledger: VersionLedger  # policy versions: numbers, digests, result checks
    port: GRPOPort  # the trainer as the orchestrator sees it
    orchestrator: Orchestrator  # the step
    metrics: StepMetrics  # the step's row, the run's totals
    chaos: Chaos  # --chaos
    resumed: Resumed
    log: object


async def _cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def setup(launch: Launch, stack: contextlib.AsyncExitStack) -> Run:
    """Every part of the run, wired; what must be closed goes on `stack` (closed in reverse)."""
    s, c, trainer, ops, report = launch.inv.settings, launch.clients, launch.trainer, launch.ops, launch.report
    run_dir, run_id, model_dir = launch.run_dir, launch.run_id, launch.model_dir
    rs, ro = s.run, s.rollout
    log = get_logger(component="run", policy=rs.policy, run_id=run_id)

    # the task's data, read before anything starts (a preflight read it already)
    prepared = launch.prepared or read_data(s)

    # the rollout side: this life's local workers and the reserved side's seeding engine
    fleet = LocalFleet(launch.nats_url, launch.redis_url, run_dir, pool=POOL, reserved_pool=RESERVED_POOL,
                       model_dir=model_dir, slots=ro.slots, checkpoint_tokens=ro.checkpoint_tokens,
                       env={**s.weights.store_env(),  # they pull from the store the trainer publishes to
                            **worker_env(s.env)})  # and run the run's environment ([env])
    stack.callback(fleet.stop)
    supervising = asyncio.create_task(fleet.supervise())  # stopped before the fleet is (the stack unwinds)
    stack.push_async_callback(_cancelled, supervising)
    # the task: the user's data and reward (or the environment's rows and scores) within the
    # model's context; request ids tagged with this life's tag where a resume needs it
    tokenizer = trainer.tokenizer
    stops = stop_ids(model_dir, tokenizer)
    task = make_task(s, prepared, tokenizer, stops, check_model_dir(model_dir).max_context, ops, run_id=run_id,
                     life=fleet.life, clients=c, run_dir=run_dir, pool=POOL)  # a harness's endpoint: the run's
    stack.callback(task.close)
    # policy versions (the reserved engine pulls what the trainer publishes)
    ledger = await VersionLedger.open(c.js, s.weights.store_options(), s.weights.publisher_options(),
                                      lambda: trainer.updates, off_policy=ro.mode != "sync",
                                      keep_versions=s.weights.keep_versions,
                                      staleness=0 if ro.mode == "sync" else ro.max_staleness,
                                      adopt_newer=ro.mode == "partial", run_id=run_id)
    seeding = fleet.seeding_engines(
        c, ro, s.worker, serves=rs.policy != "disaggregated",
        weights=StoreWeights(WeightCache(run_dir / "weight-cache" / "reserved", ledger.store), wait_s=30.0),
        env=s.env)  # the reserved engine's workers run the run's environment too

    async def close_engine() -> None:
        if seeding.engine is not None:
            await seeding.engine.close()

    stack.push_async_callback(close_engine)
    stack.push_async_callback(seeding.close)
    chaos = Chaos(fleet, parse_chaos(rs.chaos), run_id)

    # the trainer's port, the step
    port = GRPOPort(trainer, ops, ledger, partial=ro.mode == "partial")
    hybrid = rs.policy == "hybrid"  # the fleet policy's decision in each row and as a gauge ([fleet])
    tally = StepMetrics(run_id, rs.policy, ro.mode, rs, trainer.ranks.world, pool=POOL, reserved_pool=RESERVED_POOL,
                        fleet=s.fleet if hybrid else None, reserved_ids=seeding.worker_ids if hybrid else set,
                        t_seed_floor_s=ro.t_seed_floor if hybrid else 0.0)

    def on_result(r: wire.RolloutResult, arrived: int, total: int) -> None:
        ledger.check(r)  # may raise WrongWeights: the step fails loudly
        tally.on_result(r)
        report.progress(r.step, arrived, total)
        chaos.on_result(r, arrived, total)

    orchestrator = Orchestrator(ro, OrchestratorPorts(c, POOL, seeding, task, port, on_result=on_result),
                                policy=rs.policy)
    stack.push_async_callback(orchestrator.close)  # closed first: groups still being scored need the reward pool
    if ro.mode != "sync" and s.algorithm.off_policy == "none":
        # not switched on behind the user's back (none is a valid choice); said once, loudly
        log.warning("rollout.mode trains stale tokens: algorithm.off_policy = \"tis\" corrects them "
                    "with the behaviour logprobs (none only clips around them)", mode=ro.mode)
    loggers = Loggers(rs.loggers, run_dir, run_id, rs.wandb_project, rs.wandb_mode,
                      config={k: v for k, v in msgspec.to_builtins(s).items() if k != "services"})
    stack.callback(loggers.close)

    # a resumed run: the parts' state from its last checkpoint, or its start again
    resumed = Resumed()
    last = ckpt.latest(run_dir) if launch.inv.resume else None
    if last is not None:
        state = await asyncio.to_thread(ops.call, "load_checkpoint", str(last))
        resumed = restore(state, run_dir, max_staleness=orchestrator.max_staleness, source=task.source,
                          window=orchestrator.window, tally=tally)
        log.warning("resumed", checkpoint=str(last), step=resumed.first_step,
                    version=(resumed.published or {}).get("version"))
    elif launch.inv.resume:  # killed before its first checkpoint: from the start
        resumed = restore_start(run_dir, orchestrator.max_staleness)
        log.warning("resumed from the start: no checkpoint yet", step=0)

    # the first version (the reserved engine pulls what the trainer publishes), what a resumed
    # partial run had in flight, then the rollout processes
    how = await ledger.start(port.weights, resumed.published)
    if how == "new":
        remember_start(run_dir, ledger.current())
    if fresh := fresh_from(how, resumed, ro.mode):
        task.source.fresh_ids(fresh[0])
        log.warning("requests from this step on are generated again under this life's ids", reason=fresh[1],
                    step=fresh[0], tag=fleet.life)
    for drawn, carried in await task.source.redraw(ledger.version):
        orchestrator.carry(drawn, carried)
    if isinstance(seeding, ProcessSeeding):
        await seeding.start(timeout_s=90.0)
    if s.env.ref and not s.env.inline:
        fleet.start_env_workers(s.env.env_workers)
        if not s.env.env_workers:
            log.warning("env.inline = false and env.env_workers = 0: tool calls wait on the environment lane for "
                        "environment workers this run does not start (rlboost env-worker)")
    if rs.policy != "colocated" and rs.workers:
        await fleet.start_workers(rs.workers, orchestrator.manager)
    if not resumed.from_checkpoint:
        resumed.eval_first = await _accuracy(task)
    report.start(resumed.eval_first)
    return Run(settings=s, run_id=run_id, run_dir=run_dir, trainer=trainer, ops=ops, report=report, loggers=loggers,
               task=task, fleet=fleet, ledger=ledger, port=port, orchestrator=orchestrator, metrics=tally,
               chaos=chaos, resumed=resumed, log=log)


async def _accuracy(task: DataTask) -> float | None:
    """The held-out mean reward (None: no held-out set)."""
    evaluated = await task.evaluate()
    return None if evaluated is None else evaluated.accuracy


async def step(run: Run, step: int) -> dict:
    """One step of the product's orchestration (rlboost/orchestrator.py) with the real trainer;
    returns its metrics row."""
    rs = run.settings.run
    t_step = time.monotonic()
    run.port.start_step(step)
    run.metrics.begin_step()
    run.task.begin_step()
    # the steps a dead trainer published past its checkpoint go out again under the same request ids
    o = await run.orchestrator.step(step, run.ledger.version, republish=step <= run.resumed.republish_through,
                                    publish_ahead=run.task.source.publish_ahead(step))
    if rs.save_rollouts:
        save_rollouts(run.run_dir / "rollouts.jsonl", run.run_id, o.trained)
    step_s = time.monotonic() - t_step  # held-out evaluation is bookkeeping, not the step
    evaluated = None
    if step % rs.eval_every == 0 or step == rs.steps - 1:
        evaluated = await run.task.evaluate()
    row = run.metrics.row(step, o, step_s, version=run.ledger.version,
                          eval_acc=None if evaluated is None else evaluated.accuracy,
                          regenerated=run.fleet.regenerated_tokens(), chaos=run.chaos.plan.get(step, []),
                          **run.task.step_counts())
    row.update(run.task.step_fields(o.trained))  # the task's own (episodes: tool calls, turns, success, ends)
    if evaluated is not None:
        row.update(evaluated.fields)  # the evaluation's own (episodes: the held-out episodes' tool calls)
    return row


async def main_loop(run: Run, t0: float) -> list[dict]:
    """The steps of this life, a checkpoint every `run.checkpoint_every` and at the end; stops
    early when the data runs out or after the step that crosses `run.max_minutes`."""
    rs = run.settings.run
    rows: list[dict] = []
    last_saved = run.resumed.last_saved

    async def save(step: int) -> None:
        nonlocal last_saved
        meta = checkpoint_meta(step, run.resumed.eval_first, run_id=run.run_id, orchestrator=run.orchestrator,
                               source=run.task.source, ledger=run.ledger, window=run.orchestrator.window,
                               tally=run.metrics)
        await asyncio.to_thread(run.ops.call, "save_checkpoint", str(run.run_dir), step, meta, rs.keep_checkpoints)
        last_saved = step

    for i in range(run.resumed.first_step, rs.steps):
        try:
            row = await step(run, i)
        except DataExhausted as e:
            run.log.warning("data exhausted: the run ends here", step=i, reason=str(e))
            if rows and rows[-1]["eval_acc"] is None:
                rows[-1]["eval_acc"] = await _accuracy(run.task)
            break
        rows.append(row)
        run.report.step(row)
        run.loggers.log(row)
        stop_early = rs.max_minutes and time.monotonic() - t0 > rs.max_minutes * 60 and i < rs.steps - 1
        if stop_early and row["eval_acc"] is None:
            row["eval_acc"] = await _accuracy(run.task)
        if rs.checkpoint_every and (i + 1) % rs.checkpoint_every == 0:
            await save(i)
        if stop_early:
            break
    if rows and last_saved != rows[-1]["step"]:
        await save(rows[-1]["step"])  # and always at the end
    return rows


async def train(inv: Invocation, model_dir: str, nats_url: str, redis_url: str, run_dir: Path,
                settings: Settings | None = None, ranks: distributed.Ranks = distributed.SINGLE,
                prepared: tuple | None = None) -> dict:
    """`settings`: the servers' and the metrics endpoint's (default: the run's own)."""
    s = inv.settings
    settings = settings or s
    run_id = run_identity(run_dir, inv.resume, s.run.run_id)
    # the servers are this run's alone (rlboost/runlease.py): the lease is taken once connected,
    # before provisioning and before the model loads, so a second run on them is refused at once
    # and changes nothing there
    lease = functools.partial(runlease.hold, run_id=run_id, ttl_s=s.run.lease_ttl_s, run_dir=str(run_dir),
                              data_dir=settings.services.data_dir, resume=inv.resume,
                              replicas=settings.services.nats_replicas)
    # pings that notice a half-open link (rlboost.pool_client.NATS_OPTIONS)
    async with open_clients(nats_url, redis_url, "rlboost-trainer", settings=settings, pools=(POOL, RESERVED_POOL),
                            guard=lease, nats_options=pool_client.NATS_OPTIONS) as c, \
            contextlib.AsyncExitStack() as stack:
        # one process: the model loads off the event loop, which renews the lease meanwhile
        # (torchrun ranks build theirs together, in the thread the process group was made in)
        trainer = make_trainer(s, model_dir, ranks) if ranks.distributed else \
            await asyncio.to_thread(make_trainer, s, model_dir, ranks)
        ops = distributed.Lockstep(trainer, ranks)
        report = RunReport(run_dir, s.run.steps)
        stack.callback(report.close)
        stack.callback(ops.stop)  # followers (FSDP ranks) leave their loop
        t0 = time.monotonic()
        stop_metrics = asyncio.Event()
        stack.callback(stop_metrics.set)
        if settings.metrics.port:
            metrics.start_metrics_server(settings.metrics.port, settings.metrics.bind)
            asyncio.create_task(metrics.poll_queue_pending(c.js, (POOL,), stop_metrics))
        run = await setup(Launch(inv, model_dir, run_dir, run_id, c, nats_url, redis_url, trainer, ops, report,
                                 prepared), stack)
        rows = await main_loop(run, t0)
        final_sha = None if ranks.distributed else weights_sha256(trainer.state_dict(torch.float32))
    if not rows:
        raise DataError("no step ran: the data was exhausted before the first one")
    evals = [r["eval_acc"] for r in rows if r["eval_acc"] is not None]
    final = ckpt.latest(run_dir)
    first_step = run.resumed.first_step
    return {"steps": rows[-1]["step"] + 1, "steps_this_life": len(rows),
            "resumed_from_step": first_step if run.resumed.resumed else None, "policy": s.run.policy, "run_id": run_id,
            "reward_first": rows[0]["reward"], "reward_last": rows[-1]["reward"],
            "eval_first": None if run.resumed.eval_first is None else round(run.resumed.eval_first, 4),
            "eval_last": round(evals[-1], 4) if evals else None, "handoffs": run.metrics.handoffs_total,
            "regenerated_tokens": run.fleet.regenerated_tokens(), "precision": trainer.precision,
            "device": str(trainer.device), "ranks": ranks.world,
            "tokens_per_s": round(sum(r["tokens"] for r in rows) / max(1e-9, sum(r["step_s"] for r in rows)), 1),
            "wall_s": round(time.monotonic() - t0, 1), "final_weights_sha256": final_sha,
            "filtered_prompts": run.task.source.filtered_total, "reward_errors": run.task.scorer.errors,
            "reward_timeouts": run.task.scorer.timeouts,
            "request_errors": sum(r["request_errors"] for r in rows), "data": run.task.source.data.state(),
            "checkpoint": str(final) if final else None, "run_dir": str(run_dir)}


def follow(s: Settings, model_dir: str, ranks: distributed.Ranks) -> None:
    """A rank other than 0: the same trainer, driven by rank 0 until it stops."""
    trainer = make_trainer(s, model_dir, ranks)
    distributed.Lockstep(trainer, ranks).follow()
