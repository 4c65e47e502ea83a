"""The environment pool (`env.inline = false`) against real NATS and Redis: a generation worker
hands each episode to the environment lane at every tool call and holds nothing of it while the
tools run; environment workers run the calls, fenced, and send it back. Every transcript is the
undisturbed one, every tool call runs once per idempotency key, whatever happens to an
environment worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import episode_env
import pytest
from helpers import step_results
from test_episodes import _check, _reference

from rlboost import wire
from rlboost.clients import open_clients
from rlboost.config import EnvSettings, WorkerSettings
from rlboost.envs import calculator
from rlboost.pool_client import PoolClient
from rlboost.workers.counters import Counters
from rlboost.workers.engines.scripted import ScriptedEngine
from rlboost.workers.env_worker import EnvWorker
from rlboost.workers.worker import RolloutWorker

TESTS = Path(__file__).resolve().parent


@pytest.fixture
async def clients(nats_url, redis_url, js):
    async with open_clients(nats_url, redis_url, "test-env-pool") as c:
        yield c


@pytest.fixture
async def gen_worker(clients):
    """Factory: a generation worker of `pool` running in this process with `env.inline = false`;
    drained (and awaited) at the end."""
    started: list[tuple[RolloutWorker, asyncio.Task]] = []

    def start(pool: str, rows, slots: int = 8) -> RolloutWorker:
        engine = ScriptedEngine(episode_env.tokenizer(), episode_env.solver(rows))
        settings = WorkerSettings(pool=pool, slots=slots, checkpoint_tokens=4, ack_wait_s=3.0, lease_ttl_s=2.0,
                                  heartbeat_s=0.2)
        w = RolloutWorker(settings, engine, clients, worker_id=f"{pool}-gen", counters=Counters(),
                          env=EnvSettings(ref=episode_env.ENV_REF, inline=False))
        started.append((w, asyncio.create_task(w.run())))
        return w

    yield start
    for w, task in started:
        w.request_drain("test over")
    await asyncio.gather(*(t for _, t in started), return_exceptions=True)
    for w, _ in started:
        await w.settled()


@pytest.fixture
async def env_worker(clients):
    """Factory: an environment worker in this process; drained (and awaited) at the end."""
    started: list[tuple[EnvWorker, asyncio.Task]] = []

    def start(name: str = "env-a", slots: int = 64) -> EnvWorker:
        w = EnvWorker(WorkerSettings(ack_wait_s=3.0, lease_ttl_s=2.0, heartbeat_s=0.2, drain_grace_s=10.0),
                      EnvSettings(ref=episode_env.ENV_REF, inline=False, pool_slots=slots), clients, worker_id=name,
                      counters=Counters(), tokenizer=episode_env.tokenizer())
        started.append((w, asyncio.create_task(w.run())))
        return w

    yield start
    for w, _ in started:
        w.request_drain("test over")
    await asyncio.gather(*(t for _, t in started), return_exceptions=True)


async def test_tool_calls_run_on_the_environment_pool_and_each_transcript_is_the_undisturbed_one(
        clients, gen_worker, env_worker, tmp_path, nats_url, capsys):
    js, step, pool = clients.js, 701, "envpool"
    rows = calculator.rows("train", 6, seed=11)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, max_turns=6, max_turn_tokens=64)
    reference = await _reference(reqs, rows, str(tmp_path / "reference.log"))
    gen = gen_worker(pool, rows)
    env = env_worker()
    manager = PoolClient(clients, pool)
    await manager.publish_step(reqs)
    got = await step_results(js, step, len(reqs))
    _check(got, reqs, rows, reference, log)
    by_id = {r.request_id: r for r in reqs}
    tool_turns = sum(len(row["steps"]) for row in rows)
    for r in got.values():  # the trainer takes them: the env worker's history lines keep the model's labels
        assert await manager.verify_result(step, r, by_id[r.request_id]) == ""
        assert {c.worker_id for c in r.episode.calls} == {env.worker_id}  # every call ran on the pool
        assert {s.worker_id for s in r.segments if s.kind == "model"} == {gen.worker_id}
        assert all(s.kind == "model" or s.worker_id == env.worker_id for s in r.segments)
    # every turn with tool calls went to the pool; the answer (no call) got its reply on the worker
    assert gen.counters.get("to_env_pool") == tool_turns == env.counters.get("tool_phases")
    assert env.counters.get("sent_back") == tool_turns == env.counters.get("tool_calls")
    assert gen.counters.get("results") == len(rows)
    # replay: each env turn appended and each call run by the environment worker, its claims shown
    import argparse
    import json

    from rlboost import replay

    rid = reqs[0].request_id
    capsys.readouterr()
    assert await replay.run(nats_url, argparse.Namespace(request=rid, step=step, json=True)) == 0
    turns = json.loads(capsys.readouterr().out)["turns"]
    env_turns = [t for t in turns if t["kind"] == "env"]
    assert env_turns and all({p["worker"] for p in t["appended_by"]} == {env.worker_id} for t in env_turns)
    assert {c["worker"] for t in env_turns for c in t["calls"]} == {env.worker_id}
    events = [(e["kind"], e["worker"]) for t in turns for e in t.get("events", [])]
    assert ("claim", env.worker_id) in events and ("release", gen.worker_id) in events


async def test_a_slow_tool_holds_no_generation_slot_nor_lease(clients, gen_worker, env_worker, tmp_path):
    """One generation slot, four episodes, every call 1.5 s: each episode reaches its first call
    while the others' calls run (the slot is free the moment a turn ends in a call), and no
    generation worker holds an episode whose calls run."""
    step, pool = 702, "envslow"
    rows = calculator.rows("train", 4, seed=12)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, delay_s=1.5, max_turns=6, max_turn_tokens=64)
    gen = gen_worker(pool, rows, slots=1)
    env_worker()
    await PoolClient(clients, pool).publish_step(reqs)
    deadline = time.monotonic() + 30
    while len({k.split("/")[0] for k in episode_env.calls(log)}) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert len({k.split("/")[0] for k in episode_env.calls(log)}) == 4
    assert gen.counters.get("episode_turns") == 0  # no tool phase had come back yet: nothing waited for one
    assert not gen.active  # and the generation worker holds none of them
    got = await step_results(clients.js, step, len(reqs), timeout=60)
    assert all(r.finish_reason == "stop" for r in got.values())


async def test_bad_messages_on_the_environment_lane_are_dead_lettered_and_the_worker_serves_on(
        clients, gen_worker, env_worker, tmp_path):
    js, step, pool = clients.js, 703, "envbad"
    rows = calculator.rows("train", 1, seed=13)
    (req,) = await episode_env.requests(step, rows, str(tmp_path / "calls.log"), max_turns=6, max_turn_tokens=64)
    single = wire.RolloutRequest(request_id="envbad-single", step=step, policy_version=0, prompt_ids=[1, 2],
                                 max_new_tokens=4, seed=1)
    env = env_worker()
    await js.publish(wire.env_subject(pool), b"\x00not msgpack")
    await js.publish(wire.env_subject(pool), wire.encode(single))  # not an episode
    deadline = time.monotonic() + 20
    while env.counters.get("dead_lettered") < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert env.counters.get("dead_lettered") == 2
    gen_worker(pool, rows)
    await PoolClient(clients, pool).publish_step([req])
    got = await step_results(js, step, 1)
    assert got[req.request_id].finish_reason == "stop" and env.counters.get("tool_phases") >= 1


def _spawn_env(nats_url, redis_url, wid: str, logs: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"}
    out = open(logs / f"{wid}.log", "w")
    return subprocess.Popen([sys.executable, str(TESTS / "episode_env_worker.py"), nats_url, redis_url, wid],
                            env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_an_environment_worker_stopped_during_a_tool_call(clients, gen_worker, nats_url, redis_url, tmp_path,
                                                                  sig):
    """An environment worker process is killed (SIGKILL) or given notice (SIGTERM) while a call
    runs. Notice: it lets the call finish and fences its result: no call runs twice. Kill: a
    second environment worker reruns only the call that was running, with the same key. Every
    transcript is the undisturbed one either way, and nothing is regenerated."""
    js, step, pool = clients.js, 704 + (sig == signal.SIGTERM), f"envstop{int(sig)}"
    rows = calculator.rows("train", 4, seed=14)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, delay_s=0.8, max_turns=6, max_turn_tokens=64)
    reference = await _reference(reqs, rows, str(tmp_path / "reference.log"))
    gen = gen_worker(pool, rows)
    first = _spawn_env(nats_url, redis_url, "envstop-first", tmp_path)
    second = None
    try:
        await PoolClient(clients, pool).publish_step(reqs)
        deadline = time.monotonic() + 30
        while not episode_env.calls(log) and time.monotonic() < deadline and first.poll() is None:
            await asyncio.sleep(0.01)
        assert episode_env.calls(log), "no tool call started"
        first.send_signal(sig)  # a call (of 0.8 s) is under way now
        first.wait(20)
        pending = {p.key for r in reqs if (st := await clients.store.episode(r.request_id)) for p in st.pending}
        running = frozenset(pending & set(episode_env.calls(log)))
        if sig == signal.SIGTERM:
            assert first.returncode == 0 and not running  # every started call finished and was fenced in
        else:
            assert running
        second = _spawn_env(nats_url, redis_url, "envstop-second", tmp_path)
        got = await step_results(js, step, len(reqs), timeout=60)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(20)
    _check(got, reqs, rows, reference, log, rerun=running)
    assert gen.counters.get("generated") == gen.counters.get("checkpointed")  # no token made twice
    runners = {c.worker_id for r in got.values() for c in r.episode.calls}
    assert "envstop-second" in runners and ("envstop-first" in runners or sig == signal.SIGKILL)


@pytest.mark.slow
async def test_bench_chaos_episodes_on_the_environment_pool_keeps_every_invariant(nats_url, redis_url, js, tmp_path):
    """`rlboost bench chaos --episodes --env-pool` in small: an environment worker SIGKILLed
    during a tool call, another SIGTERMed during one, a generation worker SIGKILLed during a
    turn: every episode completes once, token-identical to an undisturbed run, each tool call
    run once per key but the one a SIGKILL interrupted, 0 tokens regenerated but at most K per
    episode the killed generation worker held."""
    import argparse

    from rlboost.benchmarks import chaos_episodes

    # seed 4: the actions are kill-tool (an env worker), term-env, kill-gen, in that order
    a = argparse.Namespace(episodes=8, workers=2, k=8, every=0.5, chaos_until=0.95, timeout=150.0, seed=4,
                           tool_s=0.5, token_s=0.02, actions=3, env_pool=True, env_workers=2)
    out = await chaos_episodes.run(a, nats_url, redis_url, tmp_path)
    assert out["ok"], out
    assert out["completed"] == 8 and out["tool_call_keys"] == out["tool_calls_expected"] > 8
    kinds = [x["kind"] for x in out["actions"]]
    assert kinds[:1] == ["kill-tool"] and out["actions"][0]["worker"].startswith("ep-e"), out["actions"]
    assert out["tool_calls_rerun"] == out["tool_calls_rerun_after_kill"] <= out["tool_calls_running_at_kill"]


def test_an_environment_worker_without_a_model_directory_stops_with_the_reason(tmp_path):
    """Its chat format is the model's tokenizer: without one it takes nothing and says why
    (before its first pull), instead of refusing every episode it would take."""
    import subprocess

    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "--data-dir", str(tmp_path / "data"), "env-worker",
                        "--worker-id", "env-nomodel"],
                       env={**os.environ, "RLBOOST_NATS_URL": "nats://127.0.0.1:1", "RLBOOST_REDIS_URL": "redis://127.0.0.1:1/0"},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no model directory" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_an_environment_worker_preloads_another_librarys_environment():
    """`--env verifiers:...` / `openenv:...` on the environment pool: the worker imports the
    scheme's loader at start (before, it took the ref for `module:fn` and refused to start)."""
    from rlboost.config import EnvSettings
    from rlboost.envs import calculator
    from rlboost.trainer.model import build_tokenizer
    from rlboost.workers.episodes import EpisodeHost, EpisodeRefused

    for ref in ("verifiers:tests/verifiers_envs.py", "openenv:http://127.0.0.1:9"):
        host = EpisodeHost(None, "", EnvSettings(ref=ref), "pool-w", tokenizer=build_tokenizer(calculator.ALPHABET))
        host.preload(ref)  # imports the loader; nothing is started or connected yet
    with pytest.raises(EpisodeRefused, match="cannot import"):
        EpisodeHost(None, "", EnvSettings(ref="nosuchmodule:make"), "pool-w",
                    tokenizer=build_tokenizer(calculator.ALPHABET)).preload("nosuchmodule:make")
