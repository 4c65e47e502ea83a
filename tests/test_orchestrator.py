"""The step orchestrator (rlboost/orchestrator.py) on real NATS, Redis and in-process workers with
the emulated engine: fallback with no preemptible worker in every rollout mode, the pool's work
taken back when it dies mid-step, a preemptible worker process SIGKILLed mid-step in every mode,
partial responses continued under the next version, async staleness bounded on every trained
sample, and the trace bench driving this very code."""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import math
import re
import threading
import time
from collections import Counter

import numpy as np
import pytest

from rlboost import orchestrator as orch
from rlboost import wire
from rlboost.clients import open_clients
from rlboost.config import RolloutSettings, WorkerSettings
from rlboost.benchmarks.costs import Prices
from rlboost.offload import SeedWindow
from rlboost.replay import read_subject
from rlboost.benchmarks import trace as bench
from rlboost.benchmarks.trace_model import MAX_NEW_TOKENS
from rlboost.workers.counters import Counters
from rlboost.workers.engines.emulated import EmulatedEngine, LengthModel, TimingModel, reference_tokens
from rlboost.workers.fleet import WorkerFleet
from rlboost.workers.seeding import InProcessSeeding
from rlboost.workers.worker import RolloutWorker

R = 64  # modelled tokens per emulated token, as the trace bench: median ~23 emulated tokens
K = 4  # checkpoint_tokens of every worker here


def engine(speed: float = 100.0) -> EmulatedEngine:
    return EmulatedEngine(speed=speed, timing=TimingModel().on_gpus(2).per_emulated_token(R),
                          lengths=LengthModel().per_emulated_token(R))


def settings(pool: str, handoff_pool: str = "") -> WorkerSettings:
    return WorkerSettings(pool=pool, handoff_pool=handoff_pool, slots=64, checkpoint_tokens=K, heartbeat_s=0.25,
                          ack_wait_s=2.0, lease_ttl_s=1.0)


class Clock:
    """A trainer that takes `train_s` per group (none by default) and makes a new policy
    version per step."""

    def __init__(self, train_s: float = 0.0) -> None:
        self.version, self.train_s = 0, train_s
        self.trained_at: list[float] = []  # when each group's training started (monotonic)

    async def train_group(self, key, results, scores, start: float) -> float:
        self.trained_at.append(time.monotonic())
        await asyncio.sleep(self.train_s)
        return time.monotonic()

    async def finish_step(self, step: int) -> int:
        self.version += 1
        return self.version


class Requests:
    """A task (`orch.RolloutTask`): 4 samples of a 4-token prompt per group, scored 0."""

    def __init__(self, run: str) -> None:
        self.run = run

    async def requests(self, step: int, version: int, groups: int) -> list[wire.RolloutRequest]:
        return [wire.RolloutRequest(request_id=wire.request_id(step, p, g, run=self.run), step=step,
                                    policy_version=version, prompt_ids=[7] * 4, max_new_tokens=MAX_NEW_TOKENS // R,
                                    seed=1000 * step + 10 * p + g, group=p) for p in range(groups) for g in range(4)]

    async def score(self, key, results) -> orch.GroupScores:
        return orch.GroupScores([0.0] * len(results))

    async def evaluate(self) -> None:
        return None


async def drive(services, mode: str, steps: int, preemptible: int = 0, policy: str = "hybrid", t_seed: float = 0.2,
                at_handoff=None, prompts: int = 6, max_staleness: int = 1, overprovision: float = 0.5,
                train_s: float = 0.0, spy=None):
    """`steps` steps of `policy` in `mode`, with `preemptible` in-process workers on the pool."""
    nats_url, redis_url = services
    run = wire.new_run_id()
    pool, reserved = f"orch-{run}", f"orch-{run}-reserved"
    async with open_clients(nats_url, redis_url, "test-orch") as c:
        workers = [RolloutWorker(settings(pool), engine(), c, worker_id=f"{run}-spot{i}") for i in range(preemptible)]
        tasks = [asyncio.create_task(w.run()) for w in workers]
        seeding = InProcessSeeding(c, pool, reserved, engine(), settings, Counters(), capacity=1.0 if policy != "disaggregated" else 0.0)
        if at_handoff is not None:  # e.g. the whole pool goes as the seeding window closes
            hand_off = seeding.hand_off

            async def hand_off_then() -> int:
                # before the hand-off, not after: a fast pool could otherwise finish every
                # request it holds while the seeding engines hand theirs off (a loaded box)
                at_handoff(workers)
                return await hand_off()
            seeding.hand_off = hand_off_then
        clock = Clock(train_s)
        if spy is not None:
            spy(seeding)
        ro = RolloutSettings(mode=mode, prompts=prompts, samples=4, max_staleness=max_staleness,
                             overprovision=overprovision)
        o = orch.Orchestrator(ro, orch.OrchestratorPorts(c, pool, seeding, Requests(run), clock,
                                                         window=SeedWindow(initial_s=t_seed, floor_s=0.1)),
                              policy=policy)
        deadline = time.monotonic() + 10
        while await o.live() < preemptible and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        outs = []
        try:
            for step in range(steps):
                outs.append(await asyncio.wait_for(o.step(step, clock.version), 60))
        finally:
            await o.close()
            await seeding.close()
            for w in workers:
                w.request_drain("test over")
            await asyncio.gather(*tasks, return_exceptions=True)
        return outs, clock


@pytest.mark.parametrize("mode", orch.MODES)
def test_with_no_preemptible_worker_every_mode_completes_colocated(services, mode):
    outs, clock = asyncio.run(drive(services, mode, steps=3))
    assert clock.version == 3
    for o in outs:
        assert o.live == 0 and o.t_seed is None and o.handoffs == 0 and not o.fallback
        assert len(o.trained) == 6 and all(len(results) == 4 for _, results in o.trained)
        # async publishes nothing ahead with no preemptible worker (the reserved GPUs would
        # generate it while they train): every step on-policy, as in sync
        assert mode == "partial" or max(o.staleness) == 0


@pytest.mark.parametrize("mode", orch.MODES)
def test_the_pool_dies_at_the_hand_off_and_the_reserved_side_takes_it_back(services, mode):
    def everyone_leaves(workers):
        for w in workers:
            w.request_drain("preempted")  # hands its requests back to the resume lane and goes

    serving: list[tuple[float, float]] = []  # when the reserved side served the pool: take-back to end_step

    def spy(seeding):
        take_back, end_step = seeding.take_back, seeding.end_step

        async def took_back(step):
            serving.append((time.monotonic(), math.inf))
            await take_back(step)

        async def ended():
            if serving and serving[-1][1] == math.inf:
                serving[-1] = (serving[-1][0], time.monotonic())
            await end_step()
        seeding.take_back, seeding.end_step = took_back, ended

    outs, clock = asyncio.run(drive(services, mode, steps=1, preemptible=1, at_handoff=everyone_leaves, t_seed=0.05,
                                    prompts=8, spy=spy))
    o = outs[0]
    assert o.live == 1 and o.fallback and len(o.trained) == 8
    # the reserved GPUs either generate the pool's work or train, never both: the rest of the
    # step runs colocated (the batch in, the pool no longer served, then training)
    (start, end), = serving
    assert end < math.inf and not any(start <= t < end for t in clock.trained_at)


def reference(r: wire.RolloutResult) -> tuple[list[int], list[float]]:
    """What undisturbed emulated engines make for `Requests`'s request, each token under the
    policy version its result's segments name (the checkpoints keep float32 logprobs)."""
    step, p, g = map(int, re.search(r"s(\d+)-p(\d+)-g(\d+)$", r.request_id).groups())
    seed = 1000 * step + 10 * p + g
    n = min(MAX_NEW_TOKENS // R, LengthModel().per_emulated_token(R).length(seed, r.request_id))
    toks, lps, at = [], [], 0
    for version, run in itertools.groupby(wire.token_versions(r.segments, n)):
        count = len(list(run))
        t, lp = reference_tokens(seed, r.request_id, at, count, policy_version=version)
        toks, lps, at = toks + t, lps + np.asarray(lp, dtype=np.float32).tolist(), at + count
    return toks, lps


class KillWhenBusy(threading.Thread):
    """SIGKILLs (`how="kill"`) or SIGTERMs (`"terminate"`: a notice) a worker process the moment
    its crash-proof counters say it holds leases on at least 3 requests, has checkpointed a few
    flushes of each, and is mid-generation (tokens made, not durable yet: what a kill costs):
    chosen by state, and by a thread, so a busy event loop in the test cannot make it miss the
    moment."""

    def __init__(self, fleet: WorkerFleet, victim, how: str = "kill") -> None:
        super().__init__(daemon=True)
        self.fleet, self.victim, self.how = fleet, victim, how
        self.killed, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            c = self.victim.counters()
            if (c["claims"] - c["results"] >= 3 and c["checkpointed"] >= 2 * K * c["claims"]
                    and c["generated"] > c["checkpointed"]):
                getattr(self.fleet, self.how)(self.victim)
                self.killed.set()
                return
            time.sleep(0.002)


async def drive_with_a_kill(services, tmp_path, mode: str, steps: int, how: str = "kill"):
    """`steps` steps of the hybrid policy in `mode` with one preemptible worker, a real
    `rlboost worker` process, SIGKILLed (or SIGTERMed: `how`) mid-step; an in-process worker
    replaces it (the spot capacity comes back) and resumes its requests from their checkpoints
    (after ack_wait; at once from the resume lane after a SIGTERM's hand-off)."""
    nats_url, redis_url = services
    run = wire.new_run_id()
    pool, reserved = f"orch-{run}", f"orch-{run}-reserved"
    fleet = WorkerFleet(nats_url, redis_url, tmp_path, pool, die_with_parent=True, worker_args=[
        "--engine", "emulated", "--speed", "50", "--gpus", "2", "--token-scale", str(R), "--slots", "64",
        "--checkpoint-tokens", str(K), "--ack-wait", "2", "--lease-ttl", "1"],
        env={"RLBOOST_WORKER__HEARTBEAT_S": "0.25"})
    async with open_clients(nats_url, redis_url, "test-orch-kill") as c:
        victim = fleet.start(prefix=f"{run}-spot")
        seeding = InProcessSeeding(c, pool, reserved, engine(), settings, Counters())
        clock = Clock()
        ro = RolloutSettings(mode=mode, prompts=6, samples=4, max_staleness=1, overprovision=0.0)
        o = orch.Orchestrator(ro, orch.OrchestratorPorts(c, pool, seeding, Requests(run), clock,
                                                         window=SeedWindow(initial_s=0.2, floor_s=0.1)))
        deadline = time.monotonic() + 30
        while await o.live() < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        killer = KillWhenBusy(fleet, victim, how)
        killer.start()
        replacement: list[tuple[RolloutWorker, asyncio.Task]] = []

        async def replace() -> None:
            while not killer.killed.is_set():
                await asyncio.sleep(0.01)
            w = RolloutWorker(settings(pool), engine(), c, worker_id=f"{run}-spot-new")
            replacement.append((w, asyncio.create_task(w.run())))

        replacing = asyncio.create_task(replace())
        outs = []
        try:
            for step in range(steps):
                outs.append(await asyncio.wait_for(o.step(step, clock.version), 60))
        finally:
            killer.stop.set()
            replacing.cancel()
            await o.close()
            await seeding.close()
            for w, _ in replacement:
                w.request_drain("test over")
            await asyncio.gather(*(t for _, t in replacement), return_exceptions=True)
            fleet.stop_all()
        published: Counter[str] = Counter()  # results on the stream, by request id (steps share subjects: this run's)
        for out in outs:
            published.update(r.request_id for r in await read_subject(c.js, wire.result_subject(out.step),
                                                                      wire.RolloutResult) if r.request_id.startswith(run))
    return outs, killer.killed.is_set(), victim, published


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "terminate"])
@pytest.mark.parametrize("mode", orch.MODES)
def test_a_preemptible_worker_sigkilled_or_sigtermed_mid_step_loses_duplicates_and_corrupts_nothing_in_every_mode(
        services, tmp_path, mode, how):
    """The SIGKILL and SIGTERM invariants in every rollout mode: the step completes with every
    request trained exactly once, every token the one an undisturbed engine makes under the
    version its segment names, at most K tokens regenerated per request the killed worker had
    in flight (none after a SIGTERM: its notice), and the mode's staleness bound held. `partial`
    runs without over-provisioning and `async` two steps, so that every request the stopped
    worker held is trained and checked here."""
    outs, killed, victim, published = asyncio.run(drive_with_a_kill(services, tmp_path, mode,
                                                                     steps=2 if mode == "async" else 1, how=how))
    assert killed, "the worker process was never busy enough to be killed"
    trained = [r for o in outs for _, results in o.trained for r in results]
    assert len(trained) == 24 * len(outs) and len({r.request_id for r in trained}) == len(trained)
    assert all(published[r.request_id] == 1 for r in trained)  # and one result each on the stream
    for r in trained:
        assert (r.token_ids, r.logprobs) == reference(r), r.request_id
    # the requests it had in flight were resumed by another worker from their checkpoints...
    held = [r for r in trained if victim.worker_id in {s.worker_id for s in r.segments[:-1]}]
    assert held
    # ...regenerating at most K tokens each: what it generated that no result kept
    kept = sum(end - s.offset for r in trained
               for s, end in zip(r.segments, [s.offset for s in r.segments[1:]] + [len(r.token_ids)], strict=True)
               if s.worker_id == victim.worker_id)
    assert 0 <= victim.counters()["generated"] - kept <= (K * len(held) if how == "kill" else 0)
    for o in outs:
        assert o.staleness == [orch.staleness(r, o.step) for _, results in o.trained for r in results]
        assert mode == "partial" or max(o.staleness) <= (0 if mode == "sync" else 1)


def test_a_partial_response_continues_under_the_next_version(services):
    """Groups still in flight when a step's batch is in carry over; the version floor moves
    them on to the next version from their checkpoints: a result with both versions' segments."""
    for attempt in range(3):  # it needs a response in flight at the boundary: the long tail gives one
        outs, _ = asyncio.run(drive(services, "partial", steps=4, preemptible=1, policy="disaggregated",
                                    prompts=4, overprovision=1.0))
        trained = [(o.step, r) for o in outs for _, results in o.trained for r in results]
        both = [r for _, r in trained if len({s.policy_version for s in r.segments}) > 1]
        if both:
            break
    assert both, "no response spanned a step boundary"
    for r in both:
        versions = [s.policy_version for s in r.segments]
        assert versions == sorted(versions)  # moved on, never back
        assert r.segments[0].offset == 0 and len(r.token_ids) > r.segments[-1].offset
    assert any(o.carried_groups for o in outs)
    # every trained result's staleness is what its segments say
    for o in outs:
        for (_, results), s in zip(o.trained, [o.staleness[i:i + 4] for i in range(0, len(o.staleness), 4)]):
            assert s == [orch.staleness(r, o.step) for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_async_staleness_never_exceeds_k_on_any_trained_sample(services, k):
    outs, clock = asyncio.run(drive(services, "async", steps=4, preemptible=1, max_staleness=k))
    seen = []
    for o in outs:
        for _, results in o.trained:
            for r in results:
                lag = max(o.step - s.policy_version for s in r.segments)  # the trained version is the step
                assert 0 <= lag <= k
                seen.append(lag)
    assert max(seen) == k  # the bound is reached (steps published ahead), never passed


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_published_ahead_gives_the_seeding_engines_the_share_their_window_was_open(services, mode):
    """The seeding engines generate only in the seeding window: a step async publishes ahead puts
    their capacity times the share of the last step the window was open on their queue, not their
    whole capacity share (which would wait for the window, then be handed off). Sync publishes
    each step as its window opens: the capacity share."""
    n, live = 6 * 4, 1
    outs, _ = asyncio.run(drive(services, mode, steps=3, preemptible=live, t_seed=0.2, train_s=0.05))
    full = orch.dispatch_share(n, live, "hybrid", 1.0)
    if mode == "sync":
        assert [o.on_reserved for o in outs] == [{0: full}, {1: full}, {2: full}]
        return
    assert outs[0].on_reserved == {0: full, 1: full}  # no step measured yet: the capacity share
    for prev, o in zip(outs, outs[1:]):
        duty = prev.window_s / prev.step_s
        assert 0 < duty < 1  # the trainer trained after the window
        assert o.on_reserved == {o.step + 1: orch.dispatch_share(n, live, "hybrid", duty)}
        assert o.on_reserved[o.step + 1] < full


@pytest.mark.slow
@pytest.mark.parametrize("mode", orch.MODES)
def test_a_pool_running_ahead_of_the_trainer_counts_as_waiting_in_the_seeding_rule(services, mode):
    """In partial and async the pool always has later work (extra groups, steps published
    ahead), so it is never seen idle; the time it ran ahead (the step's batch in, the trainer
    still at it) is its waiting in the rule, or T_seed could only grow and a trainer that is the
    bottleneck would sit out a seeding window with its batch in. Sync keeps the sampled idle time."""
    floor = 0.1
    outs, _ = asyncio.run(drive(services, mode, steps=4, preemptible=1, t_seed=1.0, train_s=0.1))
    for o, nxt in zip(outs, outs[1:]):
        if mode == "sync":
            assert o.rollout_ahead_s == 0.0
        else:
            assert o.rollout_ahead_s >= 0.1  # at least the last group's training: the batch was in
        waiting = max(o.spot_waiting_s, o.rollout_ahead_s)
        assert nxt.t_seed == pytest.approx(max(floor, o.t_seed + (o.trainer_wait_s - waiting) / 3))
    if mode != "sync":
        assert any(o.rollout_ahead_s > o.spot_waiting_s for o in outs)  # the pool ran ahead, unseen idle
        assert outs[-1].t_seed < outs[0].t_seed


@pytest.mark.slow
def test_the_trace_bench_runs_the_products_orchestration(services, tmp_path, monkeypatch):
    """The bench has no step logic of its own: each of its steps is Orchestrator.step."""
    calls = []
    real = orch.Orchestrator.step

    async def spy(self, *args, **kw):
        calls.append(self)
        return await real(self, *args, **kw)

    monkeypatch.setattr(orch.Orchestrator, "step", spy)
    nats_url, redis_url = services
    a = argparse.Namespace(speed=150.0, chunk=8, token_scale=64, notice=30.0, prompts=8, samples=4, t_seed=10.0,
                           prices=Prices(), max_instances=0)

    async def go():
        async with open_clients(nats_url, redis_url, "test-trace") as c:
            return await bench.Emulation(a, c, nats_url, redis_url, tmp_path, "col", "colocated", []).run(300.0)

    out = asyncio.run(go())
    assert out["steps"] >= 1 and len(calls) >= out["steps"]
    assert all(isinstance(o, orch.Orchestrator) for o in calls)
    source = inspect.getsource(bench.Emulation)
    for step_logic in ("publish_step", ".results(", "send_signal", "window.update", "hand_off(", "RolloutWorker("):
        assert step_logic not in source, step_logic


def test_vllm_sleep_is_refused_where_the_engine_cannot_sleep():
    import torch

    from rlboost.workers.engines import EngineError
    from rlboost.workers.seeding import make_seeding_engine

    with pytest.raises(EngineError, match="seeding_engine = vllm"):
        make_seeding_engine("torch", "/nonexistent", WorkerSettings(), sleep=True)
    if not torch.cuda.is_available():
        with pytest.raises(EngineError, match="no CUDA GPU"):
            make_seeding_engine("vllm", "/nonexistent", WorkerSettings(), sleep=True)
