"""Episodes on rollout workers against real NATS and Redis: calculator episodes with inline
tools, the transcript of an undisturbed run whatever happens to the workers, every tool call
run once per idempotency key."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import episode_env
import pytest
from helpers import step_results

from rlboost.benchmarks import chaos_episodes
from rlboost import episodes, wire
from rlboost.clients import open_clients
from rlboost.config import WorkerSettings
from rlboost.envs import calculator
from rlboost.envs.chat import chat_format
from rlboost.episodes.runner import EpisodeRunner
from rlboost.config import EnvSettings
from rlboost.pool_client import PoolClient
from rlboost.workers.counters import Counters
from rlboost.workers.engines.scripted import ScriptedEngine
from rlboost.workers.worker import RolloutWorker

TESTS = Path(__file__).resolve().parent


@pytest.fixture
async def clients(nats_url, redis_url, js):
    async with open_clients(nats_url, redis_url, "test-episodes") as c:
        yield c


def _worker(clients, pool: str, rows, token_s: float = 0.0, name: str = "w") -> RolloutWorker:
    engine = ScriptedEngine(episode_env.tokenizer(), episode_env.solver(rows), token_s=token_s)
    settings = WorkerSettings(pool=pool, slots=8, checkpoint_tokens=4, ack_wait_s=3.0, lease_ttl_s=2.0,
                              heartbeat_s=0.2)
    return RolloutWorker(settings, engine, clients, worker_id=f"{pool}-{name}", counters=Counters(),
                         env=EnvSettings(ref=episode_env.ENV_REF))


async def _reference(reqs: list[wire.RolloutRequest], rows, log: str) -> dict[str, tuple[list[int], list, list[int]]]:
    """Each episode run undisturbed by the runner alone (no worker, no store): its tokens after
    the prompt, its messages and its training mask (bench chaos --episodes' reference)."""
    ref = await chaos_episodes.reference(reqs, rows, log)
    return {rid: (tokens, messages, mask) for rid, (tokens, mask, _, messages) in ref.items()}


def _check(got: dict[str, wire.RolloutResult], reqs, rows, reference, log: str, rerun: frozenset = frozenset()) -> None:
    """Every result is its undisturbed transcript, with env tokens masked, a solved problem, and
    every tool call of it run exactly once (those in `rerun`: twice, with the same key)."""
    ran = Counter(episode_env.calls(log))
    for key in rerun:
        assert ran[key] == 2, (key, ran)
        ran[key] = 1
    assert set(got) == {r.request_id for r in reqs}
    for req, row in zip(reqs, rows, strict=True):
        r = got[req.request_id]
        tokens, messages, mask = reference[req.request_id]
        assert r.finish_reason == "stop" and r.token_ids == tokens
        assert wire.trainable_mask(r.segments, len(r.token_ids)) == mask
        assert [lp for lp, m in zip(r.logprobs, mask) if not m] == [0.0] * mask.count(False)
        snap = episodes.snapshot(r.episode)
        assert r.episode.done and r.episode.reason == "done" and snap.messages == messages
        keys = [c.key for c in r.episode.calls]
        assert len(keys) == len(row["steps"]) and [ran[k] for k in keys] == [1] * len(keys), (keys, ran)
        env = calculator.make()
        assert env.score(snap.messages, snap.state, None).reward == 1.0
    assert sum(ran.values()) == sum(len(row["steps"]) for row in rows)


async def test_a_worker_serves_calculator_episodes_as_an_undisturbed_run_would(clients, tmp_path):
    js, step, pool = clients.js, 501, "ep"
    rows = calculator.rows("train", 6, seed=1)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, max_turns=6, max_turn_tokens=64)
    assert [r.max_new_tokens for r in reqs] == [600] * 6 and reqs[0].episode.max_turn_tokens == 64
    reference = await _reference(reqs, rows, str(tmp_path / "reference.log"))
    w = _worker(clients, pool, rows)
    task = asyncio.create_task(w.run())
    manager = PoolClient(clients, pool)
    await manager.publish_step(reqs)
    got = await step_results(js, step, len(reqs))
    w.request_drain("test over")
    await task
    _check(got, reqs, rows, reference, log)
    by_id = {r.request_id: r for r in reqs}
    for r in got.values():  # the trainer takes them: tokens, provenance and final state are the checkpoint's
        assert await manager.verify_result(step, r, by_id[r.request_id]) == ""
        kinds = [s.kind for s in r.segments]
        assert kinds.count("env") == len(r.episode.calls) and all(s.worker_id == w.worker_id for s in r.segments)
    forged = msgspec_replace(next(iter(got.values())), "episode", reward_state="done")
    assert "episode state differs" in await manager.verify_result(step, forged, by_id[forged.request_id])
    assert w.counters.get("episode_turns") == sum(len(row["steps"]) for row in rows)


def msgspec_replace(r: wire.RolloutResult, field: str, reward_state: str) -> wire.RolloutResult:
    import msgspec

    return msgspec.structs.replace(r, episode=msgspec.structs.replace(r.episode, reason=reward_state + "!"))


async def test_a_notice_during_a_tool_call_fences_its_result_and_no_tool_runs_twice(clients, tmp_path):
    """SIGTERM-like drain while a (slow) tool runs: the worker lets the call finish, fences its
    result, hands the episode back; the next worker continues it without calling that tool
    again, and nothing is regenerated."""
    js, step, pool = clients.js, 502, "epdrain"
    rows = calculator.rows("train", 2, seed=2)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, delay_s=0.4, max_turns=6, max_turn_tokens=64)
    reference = await _reference(reqs, rows, str(tmp_path / "reference.log"))
    first = _worker(clients, pool, rows, name="first")
    task = asyncio.create_task(first.run())
    await PoolClient(clients, pool).publish_step(reqs)
    deadline = time.monotonic() + 20
    while not episode_env.calls(log) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert episode_env.calls(log), "no tool call started"
    first.request_drain("spot notice")  # a tool call is under way now
    await asyncio.wait_for(task, 10)
    handed = first.counters.get("handed_off")
    assert handed >= 1 and first.counters.get("results") + handed == len(reqs)
    assert first.counters.get("generated") == first.counters.get("checkpointed")
    second = _worker(clients, pool, rows, name="second")
    task = asyncio.create_task(second.run())
    got = await step_results(js, step, len(reqs))
    second.request_drain("test over")
    await task
    _check(got, reqs, rows, reference, log)
    assert any(s.worker_id == second.worker_id for r in got.values() for s in r.segments)


@pytest.mark.slow
@pytest.mark.parametrize("parked", [32, 0])
async def test_an_episode_waiting_on_its_tools_holds_no_generation_slot(clients, tmp_path, parked):
    """Two slots, four episodes, each tool call 6 s: with parking every episode reaches its first
    tool call before any call returns (the slots of those in their tools serve the others); with
    `parked_episodes = 0` (each episode holds its slot) the third waits for a call to return."""
    step, pool = 507 + (parked > 0), f"park{parked}"
    rows = calculator.rows("train", 4, seed=5)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, delay_s=6.0, max_turns=6, max_turn_tokens=64)
    engine = ScriptedEngine(episode_env.tokenizer(), episode_env.solver(rows))
    settings = WorkerSettings(pool=pool, slots=2, checkpoint_tokens=4, ack_wait_s=30.0, lease_ttl_s=20.0,
                              heartbeat_s=0.2, parked_episodes=parked)
    w = RolloutWorker(settings, engine, clients, worker_id=f"{pool}-w", counters=Counters(),
                      env=EnvSettings(ref=episode_env.ENV_REF))
    task = asyncio.create_task(w.run())
    await PoolClient(clients, pool).publish_step(reqs)

    def started() -> set[str]:  # the episodes that have called a tool
        return {key.split("/")[0] for key in episode_env.calls(log)}

    deadline = time.monotonic() + 60
    while len(started()) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    returned = w.counters.get("episode_turns")  # tool phases over, before the fourth episode's first call
    w.request_drain("test over")
    await task
    assert len(started()) == 4
    if parked:
        assert returned == 0
    else:
        assert returned >= 1


async def test_an_environment_the_worker_does_not_run_is_refused_with_a_reason(clients, tmp_path):
    js, step, pool = clients.js, 503, "epbad"
    rows = calculator.rows("train", 1, seed=3)
    (req,) = await episode_env.requests(step, rows, str(tmp_path / "calls.log"))
    req = wire.RolloutRequest(**{**{f: getattr(req, f) for f in req.__struct_fields__},
                                 "episode": wire.EpisodeSpec(env="os:system", row=req.episode.row)})
    w = _worker(clients, pool, rows)
    task = asyncio.create_task(w.run())
    await PoolClient(clients, pool).publish_step([req])
    got = await step_results(js, step, 1)
    w.request_drain("test over")
    await task
    r = got[req.request_id]
    assert r.finish_reason == "error" and "not one this worker runs" in r.error and r.token_ids == []


def _spawn(nats_url, redis_url, pool, wid, rows_file, token_s, logs: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"}
    out = open(logs / f"{wid}.log", "w")
    return subprocess.Popen([sys.executable, str(TESTS / "episode_worker.py"), nats_url, redis_url, pool, wid,
                             str(rows_file), str(token_s)], env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow
@pytest.mark.parametrize("during", ["generation", "tool"])
async def test_sigkill_mid_episode_a_second_worker_process_resumes_it_exactly(clients, nats_url, redis_url, tmp_path,
                                                                           during):
    """A worker process is SIGKILLed mid-episode: while it generates a model turn after a tool
    result was fenced in, or while a tool call runs. A second process resumes every episode:
    each transcript token-identical to an undisturbed run, each tool call run once per key, but
    the one running at the kill, which runs again with the same key (the environment can
    de-duplicate on it); the resumed turn continues at the checkpoint."""
    js, step, pool = clients.js, 504 if during == "generation" else 506, f"epkill{during[0]}"
    rows = calculator.rows("train", 4, seed=4)
    rows_file = tmp_path / "rows.json"
    rows_file.write_text(json.dumps(rows))
    log = str(tmp_path / "calls.log")
    delay = 0.0 if during == "generation" else 0.6
    reqs = await episode_env.requests(step, rows, log, delay_s=delay, max_turns=6, max_turn_tokens=64)
    reference = await _reference(reqs, rows, str(tmp_path / "reference.log"))
    first = _spawn(nats_url, redis_url, pool, "epkill-first", rows_file, 0.02 if during == "generation" else 0.0,
                   tmp_path)
    second, running = None, frozenset()
    try:
        await PoolClient(clients, pool).publish_step(reqs)
        deadline, target = time.monotonic() + 60, None
        while target is None and time.monotonic() < deadline and first.poll() is None:
            for req in reqs:
                state = await clients.store.episode(req.request_id)
                if state is None:
                    continue
                tokens, _ = await clients.store.read(req.request_id)
                if during == "generation" and state.calls and not state.pending and len(tokens) > state.at + 2:
                    target = req.request_id  # a tool result fenced in, the next turn under way
                elif during == "tool" and state.calls and state.pending and state.pending[0].key in \
                        episode_env.calls(log):
                    target = req.request_id  # its second call (or later) runs now
                if target:
                    break
            await asyncio.sleep(0.02)
        assert target is not None, f"no episode reached a {during} to kill it in"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        killed_at = {r.request_id: len((await clients.store.read(r.request_id))[0]) for r in reqs}
        # the calls that had started and had no result fenced in (the process is dead: stable)
        pending = {p.key for r in reqs if (st := await clients.store.episode(r.request_id)) for p in st.pending}
        running = frozenset(pending & set(episode_env.calls(log)))
        assert running or during == "generation"
        second = _spawn(nats_url, redis_url, pool, "epkill-second", rows_file, 0.0, tmp_path)
        got = await step_results(js, step, len(reqs), timeout=60)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(20)
    _check(got, reqs, rows, reference, log, rerun=running)
    resumed = got[target]
    assert resumed.segments[0].worker_id == "epkill-first" and resumed.segments[-1].worker_id == "epkill-second"
    # the second worker continued at the checkpoint: nothing before it was generated again
    assert [s for s in resumed.segments if s.worker_id == "epkill-second"][0].offset == killed_at[target]

async def test_the_stored_snapshot_holds_no_tokens_and_comes_back_whole_from_the_checkpoint(tmp_path):
    """rlboost.episodes: the state keeps segment kinds and lengths, not tokens; the checkpoint's
    tokens and float32 logprobs make the same snapshot again; a state that does not describe
    its checkpoint is refused."""
    rows = calculator.rows("train", 1, seed=5)
    (req,) = await episode_env.requests(305, rows, str(tmp_path / "calls.log"))
    ref = await _reference([req], rows, str(tmp_path / "reference.log"))
    engine = ScriptedEngine(episode_env.tokenizer(), episode_env.solver(rows))
    runner = EpisodeRunner(episode_env.make(str(tmp_path / "calls2.log")), chat_format(engine.tokenizer),
                           EnvSettings(max_episode_tokens=len(req.prompt_ids) + req.max_new_tokens))
    snap = await runner.begin(req.request_id, rows[0])
    tokens, _, _ = ref[req.request_id]
    turn = tokens[:tokens.index(engine.stop_id) + 1]
    lps = [engine.logprob(req.seed, i) for i in range(len(turn))]
    snap = runner.model_turn(snap, (turn, lps))
    snap = await runner.run_tools(snap)
    at = snap.n_tokens - len(req.prompt_ids)
    state = wire.EpisodeState(turn=snap.turn, at=at, env_state=episodes.pack(snap))
    assert "token_ids" not in state.env_state.replace('"token_ids":[]', "")
    assert len(state.env_state) < len(json.dumps(snap.token_ids)) + 2000  # no second copy of the stream
    stream = snap.token_ids[len(req.prompt_ids):]
    back = episodes.unpack(state, list(req.prompt_ids), stream + [7, 7], lps + [0.0] * (len(stream) - len(lps)) + [-1, -1])
    assert back == snap  # tokens past `at` (a turn under way) are not the snapshot's
    assert episodes.snapshot(state).messages == snap.messages
    with pytest.raises(episodes.EpisodeStateError, match="describes"):
        episodes.unpack(state, list(req.prompt_ids), stream[:-1], lps)
    with pytest.raises(episodes.EpisodeStateError, match="prompt"):
        episodes.unpack(state, list(req.prompt_ids)[1:], [0] + stream, [0.0] + lps + [0.0] * (len(stream) - len(lps)))
    with pytest.raises(episodes.EpisodeStateError, match="not a snapshot"):
        episodes.unpack(wire.EpisodeState(at=0, env_state='{"x": 1}'), list(req.prompt_ids), [], [])


async def test_replay_shows_an_episode_turn_by_turn_with_its_tool_calls_hand_offs_and_reward(clients, nats_url,
                                                                                           redis_url, tmp_path, capsys):
    """`rlboost replay REQUEST_ID` of an episode handed off during a tool call: its turns in
    stream order (model, env, model, ...) covering every token, who generated each model turn
    (worker, version), each tool call with its key, runner and latency, in the order the episode
    made them, the hand-off and the claim at the turn where they happened, and the reward."""
    import argparse

    from rlboost import replay
    from rlboost.config import EnvSettings as Env

    js, step, pool = clients.js, 519, "eprep"
    rows = calculator.rows("train", 2, seed=7)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, delay_s=0.3, max_turns=6, max_turn_tokens=64)
    first = _worker(clients, pool, rows, name="first")
    task = asyncio.create_task(first.run())
    await PoolClient(clients, pool).publish_step(reqs)
    deadline = time.monotonic() + 20
    while not episode_env.calls(log) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    first.request_drain("spot notice")  # a tool call is under way
    await asyncio.wait_for(task, 10)
    env = Env(ref=episode_env.ENV_REF, options={"log": str(tmp_path / "score.log")})
    # no result yet: replay shows the turns so far from the checkpoint store
    waiting = [r for r in reqs if not await clients.store.is_finished(r.request_id)]
    assert waiting, "the drain handed nothing back"
    capsys.readouterr()
    a = argparse.Namespace(request=waiting[0].request_id, step=step, json=True)
    assert await replay.run(nats_url, a, env=env, redis_url=redis_url) == 0
    running = json.loads(capsys.readouterr().out)
    assert running["running"] and not running["finished"] and running["reward"] is None
    kinds = [t["kind"] for t in running["turns"]]
    assert kinds[0] == "model" and all(x != y for x, y in zip(kinds, kinds[1:]))
    assert {p["worker"] for t in running["turns"] if t["kind"] == "model" for p in t["parts"]} == {first.worker_id}
    assert any(e["kind"] == "release" for t in running["turns"] for e in t.get("events", []))
    a.json = False
    assert await replay.run(nats_url, a, env=env, redis_url=redis_url) == 0
    text = capsys.readouterr().out.splitlines()
    assert "(running, from the checkpoint store)" in text[0] and text[-1].strip().startswith("no result yet")
    second = _worker(clients, pool, rows, name="second")
    task = asyncio.create_task(second.run())
    got = await step_results(js, step, len(reqs))
    second.request_drain("test over")
    await task
    handed = [rid for rid in got if any(e.kind == "release" for e in (await replay.life_of(js, step, rid)).events)]
    assert handed, "no episode was handed off"
    rid, r = handed[0], got[handed[0]]

    async def show(json_out: bool) -> str:
        capsys.readouterr()
        a = argparse.Namespace(request=rid, step=step, json=json_out)
        assert await replay.run(nats_url, a, env=env) == 0
        return capsys.readouterr().out

    out = json.loads(await show(True))
    turns = out["turns"]
    kinds = [t["kind"] for t in turns]
    assert kinds == ["model", "env"] * (len(kinds) // 2) + ["model"] * (len(kinds) % 2) and kinds[-1] == "model"
    assert [t["turn"] for t in turns if t["kind"] == "model"] == list(range(len(kinds) // 2 + 1))
    assert turns[0]["start"] == 0 and turns[-1]["end"] == len(r.token_ids)
    assert all(a["end"] == b["start"] for a, b in zip(turns, turns[1:]))
    for t in turns:  # every token is accounted for by who made it
        assert sum(p["tokens"] for p in t["parts" if t["kind"] == "model" else "appended_by"]) == t["tokens"] > 0
    calls = [c for t in turns if t["kind"] == "env" for c in t["calls"]]
    assert [c["key"] for c in calls] == [c.key for c in r.episode.calls] == \
        [wire.tool_call_key(rid, i, 0) for i in range(len(calls))]
    assert len(calls) == len(rows[int(rid.split("-p")[1][:5])]["steps"]) >= 2
    assert all(c["tool"] == "calc" and c["latency_s"] >= 0.3 and c["worker"] in (first.worker_id, second.worker_id)
               and c["result_chars"] for c in calls)
    workers = [p["worker"] for t in turns if t["kind"] == "model" for p in t["parts"]]
    assert workers[0] == first.worker_id and workers[-1] == second.worker_id
    assert all(p["policy_version"] == 0 for t in turns if t["kind"] == "model" for p in t["parts"])
    events = [(i, e["kind"], e["worker"]) for i, t in enumerate(turns) for e in t.get("events", [])]
    release = [i for i, k, w in events if k == "release" and w == first.worker_id]
    claim = [i for i, k, w in events if k == "claim" and w == second.worker_id]
    assert release and claim and claim[0] >= release[0] and turns[release[0]]["start"] > 0
    n_turns = len(calls) + 1  # a call per step, then the answer: each the right next step
    assert out["reward"] == {"env": episode_env.ENV_REF, "reward": 1.0, "turn_rewards": [1.0] * n_turns}
    assert out["handoffs"] >= 1 and out["finished"]
    text = (await show(False)).splitlines()
    turn_lines = [line.split()[:3] for line in text if line.strip().startswith("turn ")]
    assert turn_lines == [["turn", str(t["turn"]), t["kind"]] for t in turns]
    tool_lines = [line for line in text if line.strip().startswith("tool calc")]
    assert [line.split(" key ")[1].split()[0] for line in tool_lines] == [c["key"] for c in calls]
    assert any("handed off by " + first.worker_id in line for line in text)
    assert text[-1].strip().startswith("reward: 1.0")


@pytest.mark.slow
async def test_bench_chaos_episodes_keeps_every_invariant_under_sigkill_and_sigterm(nats_url, redis_url, js, tmp_path):
    """`rlboost bench chaos --episodes` in small: worker processes SIGKILLed while they generate
    a turn or run a tool call, and SIGTERMed; every episode completes once, token-identical to
    an undisturbed run, each tool call run once per key but where a SIGKILL interrupted it, 0
    tokens regenerated after a SIGTERM, at most K per held episode after a SIGKILL."""
    import argparse

    from rlboost.benchmarks import chaos_episodes

    # seed 4: the first action is a SIGKILL during generation, the second one during a tool call
    a = argparse.Namespace(episodes=8, workers=2, k=8, every=0.5, chaos_until=0.9, timeout=150.0, seed=4,
                           tool_s=0.4, token_s=0.02, actions=2)
    out = await chaos_episodes.run(a, nats_url, redis_url, tmp_path)
    assert out["ok"], out
    assert out["completed"] == 8 and out["tool_call_keys"] == out["tool_calls_expected"] > 8
    assert out["kills_during_generation"] == 1, out["actions"]


async def test_a_turn_cut_by_its_budget_ends_the_episode_length_not_as_a_finished_turn(clients, tmp_path):
    """The worker's turn budget cuts the scripted tool call mid-way: the episode ends `length`,
    the half-written call never reaches the environment (no tool runs)."""
    js, step, pool = clients.js, 502, "cut"
    rows = calculator.rows("train", 3, seed=2)
    log = str(tmp_path / "calls.log")
    reqs = await episode_env.requests(step, rows, log, max_turns=6, max_turn_tokens=6)
    w = _worker(clients, pool, rows)
    task = asyncio.create_task(w.run())
    await PoolClient(clients, pool).publish_step(reqs)
    got = await step_results(js, step, len(reqs))
    w.request_drain("test over")
    await task
    for r in got.values():
        assert r.episode.reason == "length", r.episode.reason
        assert len(r.token_ids) == 6 and not r.episode.calls
    assert episode_env.calls(log) == []
