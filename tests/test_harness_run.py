"""`rlboost run --harness CMD` (issue 41): an agent harness of the user's own (tests/harness_agent.py:
the official `openai` client, several turns, a tool offered, streamed answers, its own reward)
trained in the run's step loop through the run's OpenAI-compatible endpoint.

Fast: the harness processes (real ones: an exit code, a hang killed at its timeout with its
children, output kept), the grouping of sessions into GRPO groups and what a lost session costs
(the task's own logic, with the sessions' outcomes given), and the session keys' pinning on a
real endpoint. Slow: five steps of `rlboost run --harness` on a tiny Llama with a real worker,
one harness process SIGKILLed mid-session: every step completes, the loss is counted in its row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import build_hf_model
from test_endpoint import _url, _worker

from rlboost import wire
from rlboost.clients import open_clients
from rlboost.config import EndpointSettings, Settings
from rlboost.endpoint import OpenAIEndpoint
from rlboost.modeldir import load_tokenizer, stop_ids
from rlboost.trainer.data_task import make_task
from rlboost.trainer.harness_launcher import Launch, Launcher
from rlboost.trainer.harness_task import HarnessError, HarnessScorer, HarnessSource, Outcome, Spec, harness_rows
from rlboost.workers.worker import RolloutWorker

TESTS = Path(__file__).resolve().parent


def test_harness_processes_exit_hang_and_leave_children_all_bounded(tmp_path):
    """Real processes: an exit code is reported, a hang is killed at the timeout (its whole group:
    the child it started too), the output is kept in the session's log."""
    launcher = Launcher('echo "session $RLBOOST_SESSION"; if [ "$MODE" = hang ]; then sleep 300 & echo $! > '
                        '"$PIDFILE"; wait; fi; exit "$CODE"', tmp_path / "logs", concurrency=2, timeout_s=1.5,
                        grace_s=0.5)
    base = {"PATH": os.environ["PATH"]}
    exits = asyncio.run(launcher.run([
        Launch("ok", {**base, "RLBOOST_SESSION": "ok", "CODE": "0"}),
        Launch("bad", {**base, "RLBOOST_SESSION": "bad", "CODE": "3"}),
        Launch("hang", {**base, "RLBOOST_SESSION": "hang", "CODE": "0", "MODE": "hang",
                        "PIDFILE": str(tmp_path / "child.pid")})]))
    ok, bad, hang = exits
    assert (ok.returncode, ok.timed_out) == (0, False) and ok.tail() == "session ok"
    assert (bad.returncode, bad.timed_out) == (3, False)
    assert hang.timed_out and hang.returncode != 0 and hang.seconds < 10
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the child went with its group (reaped by init: poll for it)
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the hung harness's child outlived it")


class PlayedRunner:
    """The task's runner with the sessions' outcomes given (the slow test plays real ones):
    `lose` names (group, sample) pairs whose session is lost, every kept one makes `calls` calls."""

    def __init__(self, lose: set[tuple[int, int]], calls: int = 2, tmp: Path = Path(".")) -> None:
        self.lose, self.calls, self.run_dir = lose, calls, tmp
        self.played = []

    async def play(self, specs, version, evaluation=False):
        self.played += specs
        out = []
        for sp in specs:
            k = int(sp.session.split("-k")[1].split("-")[0])
            o = Outcome(sp)
            if (sp.group, k) in self.lose:
                o.lost = "it exited with -9 (killed by signal 9)"
            else:
                o.reward = float(k)
                o.metrics = {"turns": k + 1, "note": "not a number", "flag": True}  # only numbers are averaged
                o.requests = [wire.RolloutRequest(
                    request_id=wire.request_id(sp.step, sp.group, c, run=sp.run), step=sp.step, policy_version=version,
                    prompt_ids=[1, 2], max_new_tokens=4, seed=0, group=sp.group) for c in range(self.calls)]
            out.append(o)
        return out


class Rows:
    def __init__(self, rows):
        self.rows, self.at = rows, 0

    def next_batch(self, n):
        got = self.rows[self.at:self.at + n]
        self.at += n
        return got

    def state(self):
        return {"at": self.at}


def _result(q: wire.RolloutRequest) -> wire.RolloutResult:
    return wire.RolloutResult(request_id=q.request_id, step=q.step, group=q.group, prompt_ids=q.prompt_ids,
                              token_ids=[3], logprobs=[-0.1], segments=[], finish_reason="stop", worker_id="w",
                              epoch=1, ts=0.0)


def test_sessions_group_by_row_and_a_lost_session_is_counted_not_trained():
    runner = PlayedRunner(lose={(0, 1), (2, 0), (2, 1)})  # one of row 0's sessions, both of row 2's
    source = HarnessSource(Rows([{"q": i} for i in range(8)]), runner, run_id="rh", seed=0, samples=2,
                           temperature=1.0)
    scorer = HarnessScorer(source)
    reqs = asyncio.run(source.requests(3, 7, 3))
    # rows 0..2, 2 sessions each; the kept sessions' calls are requests of their row's group, under
    # the step's version, with ids of their own per session
    assert len(runner.played) == 6 and {sp.group for sp in runner.played} == {0, 1, 2}
    assert sorted({q.group for q in reqs}) == [0, 1] and len(reqs) == 3 * 2
    assert all(q.step == 3 and q.policy_version == 7 for q in reqs) and len({q.request_id for q in reqs}) == 6
    # row 2 lost every session: no group to score, its row forgotten; row 0 is scored on the one left
    assert source.sample((3, 0)) == {"q": 0} and (3, 2) not in source._samples
    by_group = {g: [_result(q) for q in sorted(reqs, key=lambda q: q.request_id) if q.group == g] for g in (0, 1)}
    scores = {g: asyncio.run(scorer.group(source.sample((3, g)), rs)).rewards for g, rs in by_group.items()}
    assert scores == {0: [0.0, 0.0], 1: [0.0, 0.0, 1.0, 1.0]}  # each call its session's reward
    trained = [((3, g), rs) for g, rs in by_group.items()]
    assert scorer.step_fields(trained) == {"harness_sessions": 6, "harness_lost": 3, "harness_calls_mean": 2.0,
                                           "harness/turns": round(4 / 3, 4)}
    assert scorer.step_fields(trained) == {"harness_sessions": 0, "harness_lost": 0, "harness_calls_mean": 0.0}
    # a step that loses every session fails with why, instead of training on nothing
    every = HarnessSource(Rows([{"q": 1}]), PlayedRunner(lose={(0, 0), (0, 1)}), run_id="rh", seed=0, samples=2,
                          temperature=1.0)
    with pytest.raises(HarnessError, match="every one of its 2 harness sessions was lost.*killed by signal 9"):
        asyncio.run(every.requests(0, 0, 1))


def test_the_task_is_chosen_from_settings_and_rows_come_from_data(tmp_path, model_dir, monkeypatch):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": str(i)}) + "\n" for i in range(20)))
    s = Settings()
    s.harness.command = "true"
    s.data.train = str(tmp_path / "rows.jsonl")
    data = harness_rows(s)
    assert len(data.eval_samples()) == 2 and data.next_batch(3)[0].keys() == {"question"}
    task = make_task(s, (data, "", 0), load_tokenizer(model_dir), [0], 256, None, run_id="rh", life="", clients=object(),
                     run_dir=tmp_path, pool="spot")
    assert isinstance(task.source, HarnessSource)
    # a harness gets its session and its row, never the run's own settings (the servers' passwords)
    monkeypatch.setenv("RLBOOST_SERVICES__AUTH__TRAINER_PASSWORD", "secret")
    sp = task.source.runner
    env = sp._env(Spec(session="s1", row={"question": "é"}, step=2, group=0, run="rh"), "rb-key", "http://h/v1", False)
    assert not any(k.startswith("RLBOOST_") and k not in {"RLBOOST_SESSION", "RLBOOST_TASK", "RLBOOST_REWARD_URL",
                                                          "RLBOOST_STEP", "RLBOOST_EVAL"} for k in env)
    assert (env["OPENAI_API_KEY"], json.loads(env["RLBOOST_TASK"]), env["RLBOOST_EVAL"]) == \
        ("rb-key", {"question": "é"}, "0")
    assert env["RLBOOST_REWARD_URL"] == "http://h/v1/rlboost/sessions/s1/reward"
    s.data.train = ""
    with pytest.raises(Exception, match="--harness needs rows"):
        harness_rows(s)
    s.env.ref = "calculator"  # without --data: the environment's own rows
    row = harness_rows(s).next_batch(1)[0]
    assert isinstance(row, dict) and "question" in row


@contextlib.asynccontextmanager
async def bindable(nats_url, redis_url, tokenizer, model_dir, tmp_path, pool: str):
    """A run's endpoint (bindable: it follows every step's results) and one real worker on `pool`."""
    async with open_clients(nats_url, redis_url, f"test-bind-{pool}", pools=(pool,)) as c:
        worker = _worker(c, tokenizer, pool, "w0")
        task = asyncio.create_task(worker.run())
        cfg = EndpointSettings(port=0, pool=pool, max_tokens=256, default_max_tokens=64, request_timeout_s=30.0)
        ep = OpenAIEndpoint(c, cfg, tokenizer, stop_ids(model_dir, tokenizer), tmp_path / "run", token="run-token",
                            max_context=1024, bindable=True)
        await ep.start()
        try:
            yield ep
        finally:
            await ep.close()
            worker.request_drain("test over")
            await asyncio.gather(task, return_exceptions=True)
            await RolloutWorker.settled()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_hf_model(tmp_path_factory.mktemp("harness-model"), context=1024)


async def test_a_session_key_pins_its_calls_and_its_reward_to_its_session(nats_url, redis_url, js, model_dir,
                                                                          tmp_path):
    tokenizer = load_tokenizer(model_dir)
    async with bindable(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-bind") as ep:
        a = ep.bind("bound-a", step=5, group=1, version=0, run="rb1-x")
        ep.bind("bound-b", step=5, group=2, version=0, run="rb1-y")
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=a.key, max_retries=0)
        msgs = [{"role": "user", "content": "What is 2 * 3 + 4?"}]
        r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=40)  # no session header
        assert r.model_extra["rlboost"]["session"] == "bound-a"
        assert r.choices[0].model_extra["rlboost"]["request_id"] == "rb1-x-s00005-p00001-g000"
        with pytest.raises(openai.PermissionDeniedError, match="session 'bound-a'"):
            await client.chat.completions.create(model="m", messages=msgs, extra_headers={"X-Session-Id": "bound-b"})
        async with httpx.AsyncClient() as h:
            url = _url(ep) + "/v1/rlboost/sessions/{}/reward"
            auth = {"Authorization": f"Bearer {a.key}"}
            assert (await h.post(url.format("bound-b"), headers=auth, json={"reward": 1})).status_code == 403
            assert (await h.post(url.format("bound-a"), headers=auth, json={"reward": 1})).status_code == 200
            assert (await h.post(url.format("bound-a"), headers={"Authorization": "Bearer rb-nope"},
                                 json={"reward": 1})).status_code == 401
        await client.close()
    assert [q.request_id for q in a.recorded] == ["rb1-x-s00005-p00001-g000"]
    assert a.recorded[0].step == 5 and a.recorded[0].group == 1


@pytest.mark.slow
def test_rlboost_run_harness_trains_five_steps_and_a_killed_harness_loses_only_its_session(services, tmp_path,
                                                                                           model_dir):
    nats_url, redis_url = services
    rows = [{"question": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(2, 8) for b in range(3, 6)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    victims = tmp_path / "victims"
    victims.mkdir()
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1",
           "HARNESS_VICTIM_DIR": str(victims)}
    cmd = [sys.executable, "-m", "rlboost.cli", "run", "--model-dir", str(model_dir), "--data",
           str(tmp_path / "rows.jsonl"), "--harness", f"{sys.executable} {TESTS / 'harness_agent.py'}",
           "--run-dir", str(run_dir), "--steps", "5", "--prompts", "2", "--samples", "3", "--workers", "1",
           "--eval-every", "100", "--eval-size", "2", "--t-seed", "0.5", "--t-seed-floor", "0.5",
           "--harness.session_timeout_s", "120", "--services.data_dir", str(tmp_path / "data")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        victim = victims / "victim"
        deadline = time.monotonic() + 300
        while not (victim.exists() and victim.read_text().strip()) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert victim.exists(), "no harness session got as far as its first answer"
        os.kill(int(victim.read_text()), signal.SIGKILL)  # mid-session: after its first call, before its reward
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert result["steps"] == 5 and len(steps) == 5
    assert sum(r["harness_lost"] for r in steps) == 1, [(r["step"], r["harness_lost"]) for r in steps]
    assert all(r["harness_sessions"] == 6 for r in steps)
    # each step trained the calls of its kept sessions (3 model turns each), grouped by row
    assert all(r["harness_calls_mean"] == 3.0 for r in steps)
    assert all(r["harness/turns"] == 3.0 and "harness/tool_calls" in r for r in steps)  # the harness's own metrics
    assert result["eval_first"] is not None and result["eval_last"] is not None
    assert all(r.get("eval_harness_lost", 0) == 0 for r in steps)
    assert len({r["version"] for r in steps}) == 5  # the endpoint served each step's own, new version
    # every session's calls are in its file, with the run's step and the row's group in their ids
    sessions = sorted((run_dir / "sessions").glob("*.jsonl"))
    assert len(sessions) >= 30
    killed = [p for p in (run_dir / "harness").glob("*.log") if "Traceback" in p.read_text()]
    assert not killed, killed[0].read_text()[-2000:]
