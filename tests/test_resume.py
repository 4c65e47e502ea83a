"""A trainer SIGKILLed mid-step resumes: same run id and step, finished responses taken from the
results stream, partial ones continued from their Redis checkpoints, and a checkpoint folder that
Hugging Face loads and generates from."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlboost import bus, wire
from rlboost.trainer.model import init_model_dir
from rlboost.trainer.tasks import get_task

K = 16  # checkpoint interval (tokens) of the run's workers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = init_model_dir(tmp_path_factory.mktemp("m") / "model", get_task("addition"), seed=4)
    meta = d / "rlboost.json"  # pretend it was warm-started: this test is about the dataflow
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "trained": True}))
    return d


async def _kill_at_first_result(nats_url: str, step: int, run_id: str, proc: subprocess.Popen, deadline: float) -> None:
    """SIGKILL `proc` the moment the first result of `step` of this run is published: one
    subscription held from before, so the kill lands while most of the step is still in flight
    (polling with a new connection each time let a quick step finish before the kill)."""
    nc = await bus.connect(nats_url)
    try:
        sub = await nc.jetstream().subscribe(wire.result_subject(step), ordered_consumer=True)
        while True:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                m = await sub.next_msg(timeout=0.2)
            except TimeoutError:
                continue
            if wire.decode(wire.RolloutResult, m.data).request_id.startswith(run_id + "-"):
                proc.send_signal(signal.SIGKILL)
                return
    finally:
        await nc.close()


def _rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start_then_kill(tmp_path, run_dir, args: list[str], env: dict, nats_url: str, kill_in: int,
                     ready=None) -> str:
    """Start `rlboost run`, wait for its step-1 checkpoint (or for `ready(run_dir)`), SIGKILL it at
    the first result of step `kill_in`; returns the run id. Its workers die with it (PDEATHSIG):
    whatever they published is in the streams once this returns."""
    ready = ready or (lambda d: (d / "checkpoints" / "step-000001").exists())  # steps 0 and 1 are done
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen([sys.executable, "-m", "rlboost.cli", "run", *args], stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 300
        while not ready(run_dir):
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
        asyncio.run(_kill_at_first_result(nats_url, kill_in, run_id, first, deadline))
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
    time.sleep(1.0)
    return run_id


def _resume(run_dir, env: dict, run_id: str, steps: int) -> list[dict]:
    """`rlboost run --resume` to the end: the same run, all its steps; returns metrics.jsonl's rows."""
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--resume", str(run_dir)],
                       capture_output=True, text=True, env=env, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["run_id"] == run_id and out["steps"] == steps
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


async def _results(nats_url: str, step: int, run_id: str) -> dict[str, wire.RolloutResult]:
    """Every result of `step` of this run in the results stream now."""
    nc = await bus.connect(nats_url)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(wire.result_subject(step), ordered_consumer=True)
        got: dict[str, wire.RolloutResult] = {}
        while True:
            try:
                m = await sub.next_msg(timeout=0.2)
            except TimeoutError:
                break
            r = wire.decode(wire.RolloutResult, m.data)
            if r.request_id.startswith(run_id + "-"):
                got[r.request_id] = r
        await sub.unsubscribe()
        return got
    finally:
        await nc.close()


@pytest.mark.slow
def test_sigkill_of_the_trainer_mid_step_then_resume(services, tmp_path, model_dir):
    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    args = ["--model-dir", str(model_dir), "--run-dir", str(run_dir), "--steps", "3", "--prompts", "16",
            "--samples", "8", "--workers", "2", "--slots", "8", "--eval-every", "100", "--save-rollouts",
            "--t-seed", "0.5", "--t-seed-floor", "0.5", "run.checkpoint_every=1", f"rollout.checkpoint_tokens={K}"]
    run_id = _start_then_kill(tmp_path, run_dir, args, env, nats_url, kill_in=2)
    finished = asyncio.run(_results(nats_url, 2, run_id))
    in_flight = 16 * 8 - len(finished)
    assert 0 < in_flight and finished
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]

    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--resume", str(run_dir)],
                       capture_output=True, text=True, env=env, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["run_id"] == run_id and out["resumed_from_step"] == 2 and out["steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and {r["run_id"] for r in rows} == {run_id}
    # finished responses were taken from the results stream, never generated again
    rollouts = {r["id"]: r for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}
    for rid, r in finished.items():
        again = rollouts[rid.removeprefix(run_id + "-")]
        assert again["tokens"] == r.token_ids and again["workers"] == [s.worker_id for s in r.segments]
    # partial ones resumed from their checkpoints: at most one interval lost per request in flight
    assert 0 <= out["regenerated_tokens"] <= K * in_flight
    print(f"in flight at the kill: {in_flight} requests; regenerated tokens: {out['regenerated_tokens']} "
          f"(bound {K * in_flight})")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = run_dir / "checkpoints" / "step-000002" / "model"
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok("12+34:", return_tensors="pt", add_special_tokens=False)["input_ids"]
    gen = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]


@pytest.mark.slow
def test_sigkill_of_an_async_run_then_resume_trains_the_steps_published_ahead_once(services, tmp_path, model_dir):
    """An async run (k = 1) publishes step s+1 during step s. Killed in step 2, with steps 2 and 3
    published, it resumes from its step-1 checkpoint: the data position saved is the one before
    step 2's draw, so the resumed life republishes the same prompts under the same request ids,
    takes what its previous life finished, and trains every request once, none staler than k."""
    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    args = ["--model-dir", str(model_dir), "--run-dir", str(run_dir), "--steps", "4", "--prompts", "8",
            "--samples", "4", "--workers", "2", "--slots", "8", "--eval-every", "100", "--save-rollouts",
            "--mode", "async", "--max-staleness", "1", "--t-seed", "0.5", "--t-seed-floor", "0.5",
            "run.checkpoint_every=1", f"rollout.checkpoint_tokens={K}"]
    run_id = _start_then_kill(tmp_path, run_dir, args, env, nats_url, kill_in=2)
    done_before = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert done_before in ([0, 1], [0, 1, 2])  # killed in step 2, or in 3 if 2 was quick
    finished = asyncio.run(_results(nats_url, done_before[-1] + 1, run_id))
    assert finished  # the kill came once results of the step resumed were in

    rows = _resume(run_dir, env, run_id, steps=4)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["staleness_max"] is None or r["staleness_max"] <= 1 for r in rows)
    ids = [json.loads(line)["id"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 4 * 8 * 4  # every request of every step trained once
    # what the previous life finished was taken from the results stream, never generated again
    rollouts = {r["id"]: r for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())}
    for rid, r in finished.items():
        assert rollouts[rid.removeprefix(run_id + "-")]["tokens"] == r.token_ids


@pytest.mark.slow
@pytest.mark.parametrize("every,kill_in", [(1, 2), (2, 3)])
def test_sigkill_of_a_partial_run_then_resume_trains_its_carried_groups_once(services, tmp_path, model_dir, every,
                                                                            kill_in):
    """A partial run keeps prompts + overprovision groups in flight; its checkpoint carries the
    ones not trained yet (from earlier steps). Killed in step 2 (or in 3, having checkpointed
    only after step 1), it resumes from its step-1 checkpoint: it draws the same prompts again
    under the same ids, publishes the carried groups with step 2 (workers go on from their
    checkpoints, with tokens of versions the dead life published past its checkpoint too; what
    it finished comes from the results stream) and trains every group once from there."""
    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    args = ["--model-dir", str(model_dir), "--run-dir", str(run_dir), "--steps", "4", "--prompts", "8",
            "--samples", "4", "--workers", "2", "--slots", "8", "--eval-every", "100", "--save-rollouts",
            "--mode", "partial", "--t-seed", "0.5", "--t-seed-floor", "0.5",
            f"run.checkpoint_every={every}", "rollout.overprovision=0.5", f"rollout.checkpoint_tokens={K}"]
    run_id = _start_then_kill(tmp_path, run_dir, args, env, nats_url, kill_in=kill_in)
    done_before = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert done_before in (list(range(kill_in)), list(range(kill_in + 1)))  # or one step later if quick
    saved = [int(d.name.split("-")[1]) for d in (run_dir / "checkpoints").glob("step-*")]
    resumed_from = max(saved)
    assert resumed_from == (1 if every == 2 and done_before[-1] < 3 else done_before[-1])
    lines_before = len((run_dir / "rollouts.jsonl").read_text().splitlines())
    state = json.loads((run_dir / "checkpoints" / f"step-{resumed_from:06d}" / "trainer_state.json").read_text())
    carried = {(int(s), g) for s, gs in state["carried"].items() for g in gs}
    assert len(carried) == 4  # 8 + 4 groups in flight, 8 trained per step
    finished = {rid: r for s in range(done_before[-1] + 2) for rid, r in asyncio.run(_results(nats_url, s, run_id)).items()}
    if every > 1 and resumed_from < done_before[-1]:  # the dead life published versions past its checkpoint
        assert any(seg.policy_version > state["published"]["version"] for r in finished.values() for seg in r.segments)

    rows = _resume(run_dir, env, run_id, steps=4)
    # (metrics.jsonl and rollouts.jsonl keep what the dead life did past its checkpoint too)
    kept = [r for r in rows[:len(done_before)] if r["step"] <= resumed_from] + rows[len(done_before):]
    assert [r["step"] for r in kept] == [0, 1, 2, 3] and all(r["prompts"] == 8 for r in kept)
    lines = (run_dir / "rollouts.jsonl").read_text().splitlines()
    lines = lines[:(resumed_from + 1) * 8 * 4] + lines[lines_before:]
    rollouts = {r["id"]: r for r in map(json.loads, lines)}
    ids = [json.loads(line)["id"] for line in lines]
    assert len(ids) == len(set(ids)) == 4 * 8 * 4  # every trained request once, over both lives
    trained_groups = {(int(i[1:6]), int(i.split("-p")[1][:5])) for i in ids}
    # the carried groups were trained by the resumed life, or are carried on by its last checkpoint
    # (a partial step trains the groups that complete first: a long one may still be in flight)
    last = json.loads((run_dir / "checkpoints" / "step-000003" / "trainer_state.json").read_text())
    still = {(int(s), g) for s, gs in last["carried"].items() for g in gs}
    assert carried <= trained_groups | still and not trained_groups & still
    assert len(still) == 4  # nothing lost: 4 in flight at the end too
    # what the previous life finished was taken from the results stream, never generated again
    for rid, r in finished.items():
        if rid.removeprefix(run_id + "-") in rollouts:
            assert rollouts[rid.removeprefix(run_id + "-")]["tokens"] == r.token_ids


def test_resume_of_a_partial_run_keeps_its_mode_prompts_and_overprovision(tmp_path):
    """A resumed partial run draws its groups in flight again under the same ids: the draws
    must have the same sizes, so a resume that changes the mode, prompts or overprovision is
    refused (in either direction)."""
    from rlboost.config import ConfigError, Settings, dump_toml
    from rlboost.trainer.command import parse

    s = Settings()
    s.rollout.mode = "partial"
    (tmp_path / "settings.toml").write_text(dump_toml(s))
    assert parse(["--resume", str(tmp_path)], False, Settings()).settings.rollout.mode == "partial"
    for switch in (["--mode", "sync"], ["--prompts", "7"], ["rollout.overprovision=0.5"]):
        with pytest.raises(ConfigError, match="rollout.mode = 'partial'.*keeps all three"):
            parse(["--resume", str(tmp_path), *switch], False, Settings())
    s.rollout.mode = "sync"
    (tmp_path / "settings.toml").write_text(dump_toml(s))
    assert parse(["--resume", str(tmp_path)], False, Settings()).resume
    with pytest.raises(ConfigError, match="rollout.mode = 'sync'"):  # nor into partial
        parse(["--resume", str(tmp_path), "--mode", "partial"], False, Settings())


def test_resume_of_an_async_run_keeps_its_mode_and_staleness(tmp_path):
    """The steps an async run published ahead are republished as they were: a resume that
    switches the mode or k is refused."""
    from rlboost.config import ConfigError, Settings, dump_toml
    from rlboost.trainer.command import parse

    s = Settings()
    s.rollout.mode, s.rollout.max_staleness = "async", 2
    (tmp_path / "settings.toml").write_text(dump_toml(s))
    assert parse(["--resume", str(tmp_path)], False, Settings()).settings.rollout.max_staleness == 2
    for switch in (["--mode", "sync"], ["--max-staleness", "1"]):
        with pytest.raises(ConfigError, match="mode = 'async' with max_staleness = 2"):
            parse(["--resume", str(tmp_path), *switch], False, Settings())


@pytest.mark.slow
@pytest.mark.parametrize("mode,every,gone", [("sync", 10, False), ("sync", 2, False), ("async", 10, False),
                                             ("async", 2, False), ("partial", 10, False), ("sync", 10, True)])
def test_sigkill_before_a_checkpoint_or_between_two_then_resume(services, tmp_path, model_dir, mode, every, gone):
    """Killed in step 2 before its first checkpoint (the default checkpoint_every), or in step 3
    with a checkpoint after step 1 and step 2 trained past it. The resumed life restarts from the
    run's start (or the checkpoint) under the version that step's requests name, takes what the
    dead life finished for it from the results stream, and trains every request of every step once
    (sync: on-policy; async: at most k versions old). Later steps, which the dead life published
    with weights the resumed life never has, are generated again under its own ids (sync, async);
    partial takes them off-policy. (Before: `PublishFailed` at step 0, "Nats-Msg-Id ... already
    taken"; between two checkpoints, `WrongWeights` in sync.) `gone`: the version it restarts from
    was garbage-collected (one version kept, no deltas): it publishes its weights anew and
    generates every step under its own ids."""
    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    steps, kill_in = (4, 2) if every == 10 else (5, 3)
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    args = ["--model-dir", str(model_dir), "--run-dir", str(run_dir), "--steps", str(steps), "--prompts", "4",
            "--samples", "4", "--workers", "2", "--slots", "8", "--eval-every", "100", "--save-rollouts",
            "--mode", mode, "--max-staleness", "1", "--t-seed", "0.5", "--t-seed-floor", "0.5",
            f"rollout.checkpoint_tokens={K}", "rollout.overprovision=0.5"]
    if every != 10:
        args.append(f"run.checkpoint_every={every}")
    if gone:
        args += ["weights.deltas=false", "weights.keep_versions=1"]
    run_id = _start_then_kill(tmp_path, run_dir, args, env, nats_url, kill_in,
                              ready=lambda d: len(_rows(d)) >= kill_in)
    done_before = [r["step"] for r in _rows(run_dir)]
    saved = [int(d.name.split("-")[1]) for d in (run_dir / "checkpoints").glob("step-*")]
    assert saved == ([] if every == 10 else [1]) and done_before[:kill_in] == list(range(kill_in))
    restart = 0 if every == 10 else 2  # the step the resumed life restarts from
    finished = asyncio.run(_results(nats_url, restart, run_id))  # all of it: the dead life trained it
    assert len(finished) == (4 + 2 if mode == "partial" else 4) * 4  # partial: with its overprovision
    lines_before = len((run_dir / "rollouts.jsonl").read_text().splitlines())

    rows = _resume(run_dir, env, run_id, steps=steps)
    mine = rows[len(done_before):]
    assert [r["step"] for r in mine] == list(range(restart, steps)) and {r["run_id"] for r in rows} == {run_id}
    if mode != "partial":
        assert all(r["staleness_max"] is None or r["staleness_max"] <= (1 if mode == "async" else 0) for r in mine)
    lines = (run_dir / "rollouts.jsonl").read_text().splitlines()[lines_before:]
    rollouts = {r["id"]: r for r in map(json.loads, lines)}
    if mode == "partial":  # groups of the last steps may still be in flight, carried by the last checkpoint
        assert len(rollouts) == len(lines) == (steps - restart) * 4 * 4
    else:  # every request of every step from the restart on, trained once by the resumed life; those the
        # dead life published with weights of its own (trained past the restart) under the resumed life's ids
        assert sorted(rollouts) == sorted(wire.request_id(s, p, g, run="l1" if s > restart or gone else "")
                                          for s in range(restart, steps) for p in range(4) for g in range(4))
    # what the dead life finished for the step the resumed one restarts was taken, never generated again
    for rid, r in ({} if gone else finished).items():
        if mode == "partial" and rid.removeprefix(run_id + "-") not in rollouts:
            continue  # a group still in flight at the end (carried by the last checkpoint)
        again = rollouts[rid.removeprefix(run_id + "-")]
        assert again["tokens"] == r.token_ids and again["workers"] == [s.worker_id for s in r.segments]


@pytest.mark.slow
def test_sigkill_mid_step_of_an_episode_run_then_resume_keeps_its_episodes(services, tmp_path, calc_model_dir):
    """`rlboost run --env calculator` killed at the first episode result of step 2 resumes from its
    step-1 checkpoint: the episodes the dead life finished come from the results stream (never
    played again, their transcripts as they were), those in flight are finished from their
    checkpoints, and every step trains each of its episodes once."""
    nats_url, redis_url = services
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    args = ["--env", "calculator", "--model-dir", str(calc_model_dir), "--run-dir", str(run_dir), "--steps", "3",
            "--prompts", "4", "--samples", "4", "--workers", "2", "--slots", "8", "--eval-every", "100",
            "--save-rollouts", "--max-response-tokens", "24", "--env.max_turns", "3", "--env.describe_tools", "false",
            "--env.options.instructions", "false", "--t-seed", "0.5", "--t-seed-floor", "0.5",
            "run.checkpoint_every=1", f"rollout.checkpoint_tokens={K}"]
    run_id = _start_then_kill(tmp_path, run_dir, args, env, nats_url, kill_in=2)
    finished = asyncio.run(_results(nats_url, 2, run_id))
    assert finished and all(r.episode is not None for r in finished.values())

    rows = _resume(run_dir, env, run_id, steps=3)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["episodes"] == 16 for r in rows)
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    ids = [r["id"] for r in rollouts]
    assert len(ids) == len(set(ids)) == 3 * 16  # every episode of every step trained once
    by_id = {r["id"]: r for r in rollouts}
    for rid, r in finished.items():  # the dead life's finished episodes, as they were
        assert by_id[rid.removeprefix(run_id + "-")]["tokens"] == r.token_ids
