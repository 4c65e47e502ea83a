"""Every process `rlboost run` starts is supervised: one that exits on its own is reaped,
reported in one log line and restarted alike, with a backoff that doubles while replacements die
young; processes the fleet stops itself are left alone."""

from __future__ import annotations

import os
import sys
import signal
import time

import pytest
from helpers import pid_of
import structlog

from rlboost.workers.fleet import Supervisor, WorkerFleet

# a stand-in for `rlboost worker` (what the fleet launches is its business, not the supervisor's):
# a process that lives until it is signalled
SLEEPER = ("-c", "import time; time.sleep(300)")


@pytest.fixture
def fleet(tmp_path):
    f = WorkerFleet("nats://unused", "redis://unused", tmp_path, "p", launcher=SLEEPER)
    yield f
    f.stop_all(timeout=5.0)


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cond()


def _exited(w) -> bool:
    return w.proc.poll() is not None


def test_a_process_killed_from_outside_is_reported_and_restarted_with_a_doubling_backoff(fleet):
    w = fleet.start(prefix="e", extra_args=("--x", "1"))
    sup = Supervisor([fleet], structlog.get_logger(), base_s=0.5, cap_s=4.0, stable_s=60.0)
    with structlog.testing.capture_logs() as logs:
        os.kill(w.proc.pid, signal.SIGKILL)
        _until(lambda: _exited(w))
        t = time.time()
        sup.poll(now=t)  # reaped and reported at once, restarted after the backoff
        assert w.fate == "exited" and len(fleet.live()) == 0 and sup.live(fleet) == 1
        sup.poll(now=t + 0.49)
        assert len(fleet.live()) == 0
        sup.poll(now=t + 0.5)
        (second,) = fleet.live()
        assert second.worker_id != w.worker_id and second.extra_args == ("--x", "1") and second.prefix == "e"
        os.kill(second.proc.pid, signal.SIGKILL)  # died young: the next restart waits twice as long
        _until(lambda: _exited(second))
        sup.poll(now=t + 1.0)
        sup.poll(now=t + 1.9)
        assert len(fleet.live()) == 0
        sup.poll(now=t + 2.0)
        assert len(fleet.live()) == 1 and sup.restarts == 2
    reports = [e for e in logs if e["event"].startswith("a supervised process exited")]
    assert [(e["worker_id"], e["exit"], e["restart_in_s"]) for e in reports] == [
        (w.worker_id, "signal 9", 0.5), (second.worker_id, "signal 9", 1.0)]


def test_processes_the_fleet_stops_itself_are_not_restarted(fleet):
    a, b = fleet.start(), fleet.start()
    sup = Supervisor([fleet], structlog.get_logger(), base_s=0.0)
    fleet.kill(a)  # chaos: the fleet's own kill (it starts a replacement itself if it wants one)
    sup.poll()
    assert fleet.live() == [b]
    fleet.stop_all(timeout=5.0)  # the run's end
    sup.poll()
    assert fleet.live() == [] and sup.restarts == 0


def test_a_replacement_that_lived_long_resets_the_backoff(fleet):
    w = fleet.start()
    sup = Supervisor([fleet], structlog.get_logger(), base_s=0.5, cap_s=30.0, stable_s=60.0)
    for _ in range(3):  # three young deaths: 0.5, 1, 2 s
        w.proc.kill()
        _until(lambda: _exited(w))
        sup.poll(now=w.started + 1)
        sup.poll(now=w.started + 100)
        (w,) = fleet.live()
    w.proc.kill()
    _until(lambda: _exited(w))
    with structlog.testing.capture_logs() as logs:
        sup.poll(now=w.started + 61)  # it lived past stable_s: back to the base
    assert logs[0]["restart_in_s"] == 0.5




# ---------------------------------------------------------------- rlboost run, end to end


@pytest.mark.slow
def test_a_run_whose_only_env_worker_and_a_generation_worker_are_sigkilled_finishes_every_step(
        services, tmp_path, tool_calling_model_dir):
    """`rlboost run --env calculator --env.inline false` with one environment worker: SIGKILL it
    after step 0 (episodes in flight on the environment lane, nobody else to serve it), then the
    generation worker: both are restarted, one log line each, and the run trains every step."""
    import json
    import subprocess

    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    steps = 4
    p = subprocess.Popen([sys.executable, "-m", "rlboost.cli", "run", "--env", "calculator", "--model-dir",
                          str(tool_calling_model_dir), "--run-dir", str(run_dir), "--steps", str(steps),
                          "--prompts", "2", "--samples", "2", "--workers", "1", "--eval-every", "100", "--eval-size", "2",
                          "--max-response-tokens", "40", "--env.max_turns", "3", "--env.describe_tools", "false",
                          "--env.options.instructions", "false", "--t-seed", "0.5", "--t-seed-floor", "0.5",
                          "--env.inline", "false"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    rows = run_dir / "metrics.jsonl"

    def steps_done() -> int:
        return len(rows.read_text().splitlines()) if rows.exists() else 0

    try:
        _until(lambda: steps_done() >= 1 or p.poll() is not None, timeout=240)
        assert p.poll() is None, p.communicate()[1][-3000:]
        for wid in ("l0e001", "l0w001"):  # the only env worker, then the generation worker
            pid = pid_of(wid)
            assert pid is not None, wid
            os.kill(pid, signal.SIGKILL)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == steps and steps_done() == steps
    restarts = [line for line in err.splitlines() if "a supervised process exited" in line]
    assert len(restarts) == 2 and any("l0e001" in line for line in restarts), restarts
    assert pid_of("l0e002") is None  # the restarted ones went with the run


class _NoEngines:
    """The reserved side, absent: this test is about the report, not about who serves."""

    capacity = 0.0

    def worker_ids(self) -> set[str]:
        return set()


async def test_a_step_waiting_on_a_lane_nobody_pulls_says_so_within_seconds(nats_url, redis_url, js):
    """An episode sits on the environment lane and no environment worker pulls it: the waiting
    step reports it (what is missing, each lane, who pulls) once STALL_REPORT_S passed quietly."""
    from rlboost import bus, orchestrator, wire
    from rlboost.clients import open_clients
    from rlboost.config import RolloutSettings

    await bus.provision(js, pools=("watched",))  # what the trainer provisions: the pool's lanes
    async with open_clients(nats_url, redis_url, "test-watch") as c:
        o = orchestrator.Orchestrator(RolloutSettings(), orchestrator.OrchestratorPorts(
            c, "watched", _NoEngines(), task=None, trainer=None))
        await js.publish(wire.env_subject("watched"), b"an episode waiting for its tools")
        with structlog.testing.capture_logs() as logs:
            o._last_result = time.monotonic()  # the step has just begun: quiet
            await o._watch(3)
            o._last_result -= orchestrator.STALL_REPORT_S
            await o._watch(3)
            await o._watch(3)  # once per STALL_REPORT_S, not on every poll
    (report,) = [e for e in logs if e["event"] == "waiting for results"]
    assert report["step"] == 3 and report["nobody_pulls"] == ["env"], report
    assert report["lanes"]["env"] == {"waiting": 1, "in_flight": 0, "pulling": 0} and report["live_workers"] == 0
    assert report["lanes"]["fresh"] == {"waiting": 0, "in_flight": 0, "pulling": 0}


@pytest.mark.slow
def test_a_run_whose_next_step_has_a_planted_episode_snapshot_completes_it_with_one_log_line(
        services, tmp_path, tool_calling_model_dir):
    """The attack of issue 40: a credential that watches the event subjects learns the run's
    request ids from step 0 and SETs junk at step 1's first episode snapshot key before step 1
    is published. The claiming worker dead-letters it; the trainer redoes it from its spec (one
    log line) and the run trains every step."""
    import asyncio
    import json
    import subprocess

    import redis as redis_sync

    from rlboost import bus, wire

    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    steps = 3
    p = subprocess.Popen([sys.executable, "-m", "rlboost.cli", "run", "--env", "calculator", "--model-dir",
                          str(tool_calling_model_dir), "--run-dir", str(run_dir), "--steps", str(steps),
                          "--prompts", "2", "--samples", "2", "--workers", "1", "--eval-every", "100",
                          "--eval-size", "2", "--max-response-tokens", "40", "--env.max_turns", "3",
                          "--env.describe_tools", "false", "--env.options.instructions", "false",
                          "--t-seed", "0.5", "--t-seed-floor", "0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    async def plant() -> str:
        """Watch step 0's publish events (what any rollout credential may read), plant at step 1's."""
        nc = await bus.connect(nats_url)
        try:
            sub = await nc.subscribe("rb.evt.0.>")
            while True:
                msg = await sub.next_msg(timeout=240)
                event = wire.decode(wire.LeaseEvent, msg.data)
                if event.kind == "publish":
                    target = event.request_id.replace("-s00000-", "-s00001-")
                    redis_sync.Redis.from_url(redis_url).set(wire.ckpt_episode_key(target), b"\x00planted")
                    return target
        finally:
            await nc.close()

    try:
        target = asyncio.run(plant())
        out, err = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == steps
    redone = [line for line in err.splitlines() if "request published again after a dead letter" in line]
    assert len(redone) == 1 and target in redone[0], (target, redone)
