"""OpenEnv environments (`--env openenv:TARGET`, rlboost/envs/openenv_env.py) against a real
OpenEnv server: tests/openenv_server.py, a number-guessing game served by openenv-core's own app
in a subprocess on a free loopback port. An episode's state is its seed and actions: another
environment object (another process) re-opens it by reset + replay, a killed server is restarted
and its episodes re-opened and counted, and a server that stays down ends a call with a clear
error instead of a hang."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlboost.envs import load_env
from rlboost.envs.protocol import Context, EnvError, ModelTurn
from rlboost.services import free_port

TESTS = Path(__file__).resolve().parent
SERVER = TESTS / "openenv_server.py"
pytest.importorskip("openenv")


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _healthy(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except Exception:
        return False


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """The guessing game's server, started here as a user would run it (a URL target)."""
    port = free_port()
    log = tmp_path_factory.mktemp("openenv") / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _healthy(port) or proc.poll() is not None, 120, "the openenv server")
        assert proc.poll() is None, log.read_text()[-2000:]
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, 8)


def ctx(turn: int = 0) -> Context:
    return Context(episode_id="ep-1", turn=turn, seed=0)


async def test_start_respond_and_score_play_the_servers_game(server_url):
    env = load_env(f"openenv:{server_url}")
    opening = await env.start({"seed": 3}, ctx())
    assert "guess my number from 1 to 8" in opening.messages[-1].content, opening.messages
    state, low, high, turn = opening.state, 1, 8, 0
    while True:  # binary search: the environment's answers lead to the secret
        guess = (low + high) // 2
        reply = await env.respond([], ModelTurn(text=f"I say {guess}"), state, ctx(turn))
        state, turn = reply.state, turn + 1
        if reply.done:
            break
        assert reply.messages[0].content in ("higher", "lower"), reply.messages
        low, high = (guess + 1, high) if reply.messages[0].content == "higher" else (low, guess - 1)
    assert guess == secret(3) and reply.turn_reward == 1.0
    assert [a["guess"] for a in state["actions"]][-1] == f"I say {guess}"
    score = env.score([], json.loads(json.dumps(state)), ctx())
    assert score.reward == 1.0 and score.metrics["reopens"] == 0 and score.metrics["finished"] == 1.0
    # the trainer scores from state alone: the same numbers without a server
    assert env.score([], state, ctx()).metrics["steps"] == turn


async def test_another_process_reopens_the_episode_by_reset_and_replay(server_url):
    """The trainer opens an episode, a worker plays a turn, another worker (after a hand-off)
    plays the next: each environment object stands for a process, with sessions of its own."""
    trainer, first, second = (load_env(f"openenv:{server_url}") for _ in range(3))
    wrong = 1 if secret(5) != 1 else 2
    opening = await trainer.start({"seed": 5}, ctx())
    r1 = await first.respond([], ModelTurn(text=str(wrong)), opening.state, ctx(0))
    assert r1.state["reopens"] == 0  # a first open replays nothing: not counted
    r2 = await second.respond([], ModelTurn(text=str(secret(5))), r1.state, ctx(1))
    assert r2.done and r2.turn_reward == 1.0 and r2.state["reopens"] == 1 and r2.state["server_losses"] == 0
    # the first process's session is behind the state now: used again, it is replaced, not trusted
    again = await first.respond([], ModelTurn(text=str(secret(5))), r1.state, ctx(1))
    assert again.done and again.state["reopens"] == 0  # its own session was at r1's position


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), plan=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2) | st.none()),
                                                  min_size=4, max_size=4))
def test_an_episode_resumed_anywhere_plays_what_an_undisturbed_one_plays(server_url, seed, plan):
    """Each turn on any of three processes (environment objects), some turns played twice: once
    by a process whose result is lost (it died before the turn was fenced: its session is now
    ahead of the state), then again from the fenced state by another. The replies are those of
    one process playing undisturbed, and the episode's state counts a re-open for each turn that
    had to replay."""

    async def play(players, turns):
        state = (await players[0].start({"seed": seed}, ctx())).state
        replies = []
        for t, (who, lost) in enumerate(turns):
            if len(replies) and replies[-1][2]:
                break
            if lost is not None:  # played, then lost with its process's fencing
                await players[lost].respond([], ModelTurn(text=str(t + 1)), state, ctx(t))
            r = await players[who].respond([], ModelTurn(text=str(t + 1)), state, ctx(t))
            state = r.state
            replies.append(([m.content for m in r.messages], r.turn_reward, r.done))
        return replies, state

    async def both():
        alone = load_env(f"openenv:{server_url}")
        expected, _ = await play([alone], [(0, None)] * 4)
        got, state = await play([load_env(f"openenv:{server_url}") for _ in range(3)], plan)
        return expected, got, state

    expected, got, state = asyncio.run(both())
    assert got == expected
    assert state["reopens"] <= len(got) and state["server_losses"] == 0


async def test_an_action_the_server_refuses_is_the_models_mistake(server_url):
    env = load_env(f"openenv:{server_url}", action="json")
    state = (await env.start({"seed": 7}, ctx())).state
    r = await env.respond([], ModelTurn(text="no json here"), state, ctx())
    assert not r.done and r.messages[0].content == "error: write the action as one JSON object"
    r = await env.respond([], ModelTurn(text='{"nope": 1}'), r.state, ctx(1))
    assert not r.done and r.messages[0].content.startswith("error: the environment refused the action")
    assert "VALIDATION_ERROR" in r.messages[0].content and r.state["invalid_actions"] == 2
    r = await env.respond([], ModelTurn(text=f'{{"guess": "{secret(7)}"}}'), r.state, ctx(2))
    assert r.done and env.score([], r.state, ctx()).reward == 1.0


async def test_a_killed_server_is_restarted_and_its_episode_reopened_and_counted(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    env = load_env("openenv:guess", command=f"python {SERVER} --port {{port}} --pid-dir {pids}", retry_s=120)
    try:
        opening = await env.start({"seed": 11}, ctx())
        wrong = [g for g in range(1, 9) if g != secret(11)]
        r1 = await env.respond([], ModelTurn(text=str(wrong[0])), opening.state, ctx(0))
        (first,) = [int(p.name) for p in pids.iterdir()]
        os.kill(first, signal.SIGKILL)
        # the next turn waits (bounded by retry_s) for the supervisor's restart, then replays
        r2 = await env.respond([], ModelTurn(text=str(wrong[1])), r1.state, ctx(1))
        assert r2.state["server_losses"] == 1 and r2.state["reopens"] == 1, r2.state
        assert len(list(pids.iterdir())) == 2 and env.server.downs[0] == "the server exited with -9"
        r3 = await env.respond([], ModelTurn(text=str(secret(11))), r2.state, ctx(2))
        assert r3.done and env.score([], r3.state, ctx()).reward == 1.0
        assert env.score([], r3.state, ctx()).metrics["server_losses"] == 1.0
    finally:
        env.server.close()
    _wait(lambda: all(not Path(f"/proc/{p.name}").exists() or _zombie(p.name) for p in pids.iterdir()), 30,
          "the started servers to end")


@pytest.mark.slow  # a server of its own, frozen until three health probes fail
async def test_a_frozen_server_is_killed_and_restarted_by_its_supervisor(tmp_path, monkeypatch):
    """SIGSTOP: the process lives but answers nothing (a deadlock, a swapped-out box). Calls time
    out (call_timeout_s); the supervisor's /health probes fail, it kills the server and starts
    another; the episode's turn, retried meanwhile, re-opens there."""
    from rlboost.envs.openenv_env import ManagedServer

    monkeypatch.setattr(ManagedServer, "HEALTH_EVERY_S", 0.5)
    monkeypatch.setattr(ManagedServer, "HEALTH_TIMEOUT_S", 0.5)
    pids = tmp_path / "pids"
    pids.mkdir()
    env = load_env("openenv:frozen", command=f"python {SERVER} --port {{port}} --pid-dir {pids}", retry_s=120,
                   call_timeout_s=2)
    try:
        opening = await env.start({"seed": 31}, ctx())
        wrong = [g for g in range(1, 9) if g != secret(31)]
        r1 = await env.respond([], ModelTurn(text=str(wrong[0])), opening.state, ctx(0))
        (first,) = [int(p.name) for p in pids.iterdir()]
        os.kill(first, signal.SIGSTOP)
        r2 = await env.respond([], ModelTurn(text=str(wrong[1])), r1.state, ctx(1))
        assert r2.state["server_losses"] == 1 and r2.state["reopens"] == 1, r2.state
        assert "stopped answering /health" in env.server.downs[0], env.server.downs
        assert len(list(pids.iterdir())) == 2
    finally:
        env.server.close()


@pytest.mark.slow  # two servers, one after the other
async def test_a_fixed_port_shares_a_running_server_and_takes_over_when_it_goes(tmp_path):
    """`port = N`: a process that finds a server answering on N (another process's) uses it and
    starts none; when it goes, this process starts its own there and the episode re-opens."""
    port, pids = free_port(), tmp_path / "pids"
    pids.mkdir()
    command = f"python {SERVER} --port {{port}} --pid-dir {pids}"
    other = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    env = None
    try:
        _wait(lambda: _healthy(port) or other.poll() is not None, 120, "the other process's server")
        env = load_env("openenv:shared", command=command, port=port, retry_s=120)
        opening = await env.start({"seed": 41}, ctx())
        wrong = [g for g in range(1, 9) if g != secret(41)]
        r1 = await env.respond([], ModelTurn(text=str(wrong[0])), opening.state, ctx(0))
        assert env.server.pid is None and not list(pids.iterdir())  # it started nothing
        other.kill()
        r2 = await env.respond([], ModelTurn(text=str(wrong[1])), r1.state, ctx(1))
        assert r2.state["server_losses"] == 1 and r2.state["reopens"] == 1
        assert env.server.pid is not None and [p.read_text() for p in pids.iterdir()] == [str(port)]
    finally:
        other.kill()
        other.wait()
        if env is not None:
            env.server.close()


HOLDER = """
import asyncio, sys
from rlboost.envs import load_env
env = load_env("openenv:orphan", command=sys.argv[1])
asyncio.run(env.server.ready(120))
print("up", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow  # a process of its own that starts a server, then SIGKILL
def test_a_sigkilled_process_leaks_no_server(tmp_path):
    """The server is started with PR_SET_PDEATHSIG: the process that started it SIGKILLed (no
    atexit runs), the server dies with it."""
    pids = tmp_path / "pids"
    pids.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, f"python {SERVER} --port {{port}} --pid-dir {pids}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        (server,) = [p.name for p in pids.iterdir()]
        holder.kill()
        holder.wait()
        _wait(lambda: _zombie(server), 30, "the server to die with its process")
    finally:
        holder.kill()
        holder.wait()


def _zombie(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


async def test_a_url_server_that_stays_down_ends_the_call_with_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = load_env(f"openenv:{url}", retry_s=1.0, call_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(EnvError, match="unreachable for retry_s = 1.0 s") as e:
        await env.start({"seed": 1}, ctx())
    assert 1.0 <= time.monotonic() - t0 < 10 and "\n" not in str(e.value)
    # the next episodes do not wait retry_s each: one try, then the same reason (a run's rows
    # against a dead server fail fast, and the run's own limits stop it)
    t0 = time.monotonic()
    for i in range(5):
        with pytest.raises(EnvError, match="still unreachable after retry_s = 1.0 s"):
            await env.start({"seed": 2 + i}, ctx())
    assert time.monotonic() - t0 < 1.0


@pytest.mark.slow  # a server of its own: ~15 s of openenv-core's imports
async def test_a_non_deterministic_environment_cannot_be_replayed(tmp_path):
    """An unseeded server deals another game on every reset: the worker's re-open does not
    reproduce the opening the trainer read, and the episode ends (env_error) instead of
    training on a transcript the environment never produced; on_diverge = continue plays on."""
    command = f"python {SERVER} --port {{port}} --unseeded"
    strict = load_env("openenv:unseeded", command=command, retry_s=120)
    lenient = load_env("openenv:unseeded", command=command, retry_s=120, on_diverge="continue")
    try:
        opening = await strict.start({"seed": 1}, ctx())
        with pytest.raises(EnvError, match="replay diverged after 0 actions"):
            await strict.respond([], ModelTurn(text="3"), opening.state, ctx())
        r = await lenient.respond([], ModelTurn(text="3"), opening.state, ctx())
        assert r.state["diverged"] == 1
    finally:
        strict.server.close()
    assert lenient.server is strict.server  # one started server per command in a process


@pytest.mark.slow  # a server of its own: ~15 s of openenv-core's imports
async def test_an_mcp_environments_tools_are_the_models_and_each_call_a_replayed_step():
    """`tools = true`: an MCP environment (openenv's MCPEnvironment, a FastMCP server's tools):
    the opening lists its tools, a call is a `call_tool` step (recorded, replayed elsewhere), a
    turn's calls' rewards are its reward, and a turn without calls ends the episode."""
    from rlboost.envs.protocol import ToolCall

    command = f"python {SERVER} --port {{port}} --mcp"
    first = load_env("openenv:counter", command=command, tools=True, retry_s=120)
    second = load_env("openenv:counter", command=command, tools=True, retry_s=120)
    try:
        opening = await first.start({"seed": 4}, ctx())
        target = random.Random(4).randint(3, 9)
        assert opening.messages[-1].content == f"Reach {target} with add."
        assert [t.name for t in opening.tools] == ["add"] and opening.tools[0].parameters["required"] == ["n"]
        r = await first.call_tool(ToolCall(key="ep-1/0/0", name="add", arguments={"n": 2}), opening.state, ctx())
        assert r.content == "2" and not r.error and not r.end
        bad = await first.call_tool(ToolCall(key="ep-1/0/1", name="add", arguments={"n": "x"}), r.state, ctx())
        assert bad.error and bad.content.startswith("error: ") and "integer" in bad.content
        turn0 = await first.respond([], ModelTurn(tool_calls=[ToolCall(key="ep-1/0/0", name="add")]), r.state,
                                    ctx())
        assert not turn0.done and turn0.turn_reward == 0.0
        # the next turn in another process: the add of 2 (and the refused call) replayed first
        last = await second.call_tool(ToolCall(key="ep-1/1/0", name="add", arguments={"n": target - 2}),
                                      turn0.state, ctx(1))
        assert last.content == str(target) and last.end and last.state["reopens"] == 1, last
        turn1 = await second.respond([], ModelTurn(tool_calls=[ToolCall(key="ep-1/1/0", name="add")]), last.state,
                                     ctx(1))
        assert turn1.done and turn1.turn_reward == 1.0
        assert second.score([], turn1.state, ctx()).reward == 1.0
    finally:
        first.server.close()


@pytest.mark.slow  # a server of its own: ~15 s of openenv-core's imports
async def test_an_mcp_episode_preempted_after_any_phase_resumes_elsewhere_to_the_same_end():
    """The episode runner with an MCP environment's tools, in the fallback chat format of a
    character tokenizer: a scripted policy calls `add(1)`, then `add(target - 1)`. Stopped after
    any phase (its snapshot JSON-encoded, as a checkpoint stores it) and resumed by a runner on
    another environment object (another process), it ends as an undisturbed run: the same
    transcript, reward 1 (the last call's), ended `done` by the environment."""
    import re

    from rlboost.config import EnvSettings
    from rlboost.envs import calculator
    from rlboost.envs.chat import chat_format
    from rlboost.episodes.runner import EpisodeRunner, Snapshot
    from rlboost.trainer.model import build_tokenizer

    fmt = chat_format(build_tokenizer(calculator.ALPHABET))
    command = f"python {SERVER} --port {{port}} --mcp"
    envs = [load_env("openenv:counter", command=command, tools=True, retry_s=120) for _ in range(2)]
    runners = [EpisodeRunner(env, fmt, EnvSettings(max_turns=4, max_episode_tokens=2048), max_turn_tokens=64)
               for env in envs]

    async def generate(ids, budget, stops):
        context = fmt.tokenizer.decode(ids)
        target = int(re.search(r"Reach (\d+) with add", context).group(1))
        n = 1 if "<tool_response>" not in context else target - 1
        new = fmt.encode(f'<tool_call>{{"name": "add", "arguments": {{"n": {n}}}}}</tool_call>') + [fmt.turn_end_id]
        return new, [-0.5] * len(new), "stop"

    try:
        whole = await runners[0].run(generate, "mcp-0", {"seed": 5})
        assert whole.end_reason == "done" and whole.reward == 1.0 and whole.tool_calls == 2, whole
        resumed_at = []
        for k in range(1, 8):
            snap = await runners[0].run(generate, f"mcp-{k}", {"seed": 5}, stop_after=k)
            if not isinstance(snap, Snapshot):
                break  # the episode ended before k phases
            resumed = await runners[1].run(generate, snapshot=Snapshot.decode(snap.encode()))
            assert resumed.end_reason == whole.end_reason and resumed.reward == whole.reward, (k, resumed)
            assert resumed.token_ids == whole.token_ids, k
            resumed_at.append(snap.phase)
        assert "tools" in resumed_at and len(resumed_at) >= 3, resumed_at
    finally:
        envs[0].server.close()


@pytest.mark.slow  # a server of its own: ~15 s of openenv-core's imports
async def test_a_server_at_capacity_gets_a_session_back_from_this_process():
    """openenv's template serves one session at a time: a second episode's open is refused
    (CAPACITY_REACHED), the process closes its least recently used session and retries; the
    first episode re-opens by replay when its turn comes (counted). With no session of ours to
    give back, the call ends after retry_s with a line that says what to change."""
    command = f"python {SERVER} --port {{port}} --capacity 1"
    env = load_env("openenv:one-seat", command=command, retry_s=120)
    try:
        a = await env.start({"seed": 21}, Context(episode_id="a"))
        b = await env.start({"seed": 22}, Context(episode_id="b"))
        wrong = {s: next(g for g in range(1, 9) if g != secret(s)) for s in (21, 22)}
        ra = await env.respond([], ModelTurn(text=str(wrong[21])), a.state, Context(episode_id="a"))
        assert list(env._sessions) == ["a"]  # a holds the server's one seat
        rb = await env.respond([], ModelTurn(text=str(wrong[22])), b.state, Context(episode_id="b"))
        assert list(env._sessions) == ["b"] and rb.state["reopens"] == 0
        ra2 = await env.respond([], ModelTurn(text=str(secret(21))), ra.state, Context(episode_id="a", turn=1))
        assert ra2.done and ra2.state["reopens"] == 1 and ra2.state["server_losses"] == 0
        # another process holds the seat: with nothing of its own to close, a third waits retry_s
        url = env.server.url
        await load_env(f"openenv:{url}").respond([], ModelTurn(text=str(wrong[21])), a.state,
                                                 Context(episode_id="c"))
        with pytest.raises(EnvError, match="gave no session for retry_s = 1.0 s: the server is at capacity"):
            await load_env(f"openenv:{url}", retry_s=1.0).start({"seed": 23}, Context(episode_id="d"))
    finally:
        env.server.close()


@pytest.mark.parametrize("ref, options, message", [
    ("openenv:guess", {}, "name the server to start"),
    ("openenv:guess", {"command": "python x.py", "colour": "red"}, "unknown field `colour`"),
    ("openenv:guess", {"command": "python x.py", "action": "speech"}, "action = 'speech': must be text or json"),
    ("openenv:guess", {"command": "python x.py", "port": 70000}, "port = 70000"),
    ("openenv:guess", {"command": "no-such-program-here --port {port}"}, "no such program"),
    ("openenv:http://127.0.0.1:1", {"command": "python x.py"}, "give one of them"),
    ("openenv:bad name!", {"command": "python x.py"}, "not a URL"),
    ("openenv:guess", {"command": "python x.py", "retry_s": "soon"}, "retry_s"),
])
def test_bad_options_are_refused_in_one_line(ref, options, message):
    with pytest.raises(EnvError) as e:
        load_env(ref, **options)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


async def test_the_text_goes_to_the_action_schemas_only_string_field_or_the_named_one(server_url):
    env = load_env(f"openenv:{server_url}")
    assert await env._text_field() == "guess"  # the guessing game's only string field
    env = load_env(f"openenv:{server_url}", action_field="guess")
    state = (await env.start({"seed": 2}, ctx())).state
    r = await env.respond([], ModelTurn(text=str(secret(2))), state, ctx())
    assert r.done


# ---------------------------------------------------------------- acceptance: `rlboost run`


@pytest.mark.slow
def test_rlboost_run_trains_on_an_openenv_server_that_is_sigkilled_mid_run(services, tmp_path,
                                                                           short_turns_model_dir):
    """`rlboost run --env openenv:guess`: every process that plays turns (the trainer, its
    worker) starts its own server from `[env.options] command`. Once a server has served 10
    steps it SIGKILLs itself in the middle of a step of an episode it holds a session of (the
    server's `--die-once`: a kill from outside would often land between episodes, with no
    session open to lose): its supervisor restarts it, the episodes it had open are re-opened
    by reset + replay and counted in the step rows, and the run trains all its steps."""
    nats_url, redis_url = services
    run_dir, pids, steps_file, died = tmp_path / "run", tmp_path / "pids", tmp_path / "steps.txt", tmp_path / "died"
    pids.mkdir()
    config = tmp_path / "openenv.toml"
    config.write_text(
        "[env]\nref = \"openenv:guess\"\nmax_turns = 4\ntool_timeout_s = 120.0\n\n[env.options]\n"
        f"command = \"python {SERVER} --port {{port}} --pid-dir {pids} --steps-file {steps_file} "
        f"--die-once {died}\"\nretry_s = 90.0\n")
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    steps = 6
    p = subprocess.run(
        [sys.executable, "-m", "rlboost.cli", "--config", str(config), "run", "--model-dir",
         str(short_turns_model_dir), "--run-dir", str(run_dir), "--steps", str(steps), "--prompts", "2",
         "--samples", "2", "--workers", "1", "--eval-every", "100", "--eval-size", "2",
         "--max-response-tokens", "24", "--t-seed", "0.5", "--t-seed-floor", "0.5"],
        capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert result["steps"] == steps and len(rows) == steps, result
    killed = died.read_text()  # the kill happened, and its server was replaced
    assert killed in {q.name for q in pids.iterdir()} and len(list(pids.iterdir())) >= 2
    assert "openenv server down, restarting" in p.stderr + "".join(
        f.read_text(errors="replace") for f in run_dir.rglob("*.log")), "no restart logged"
    ends: dict[str, int] = {}
    for r in rows:
        for reason, n in r["episode_ends"].items():
            ends[reason] = ends.get(reason, 0) + n
    losses = sum(r.get("env/server_losses", 0.0) * r["episodes"] for r in rows)
    reopens = sum(r.get("env/reopens", 0.0) * r["episodes"] for r in rows)
    print(f"episode ends {ends}, server losses {losses:.0f}, re-opens {reopens:.0f}, "
          f"steps served {len(steps_file.read_text().splitlines())}")
    assert losses >= 1 and reopens >= losses, (losses, reopens, rows)
    assert ends.get("env_error", 0) == 0, ends  # the lost episode was re-opened, not ended


@pytest.mark.slow
def test_rlboost_run_against_a_url_server_that_is_down_stops_with_one_line(services, tmp_path,
                                                                           short_turns_model_dir):
    """Nothing listens at the URL: the run's preflight waits `retry_s` for the first row, fails
    the next ones at once, and stops before any worker starts, naming the server."""
    nats_url, redis_url = services
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "run", "--env", f"openenv:{url}", "--model-dir",
                        str(short_turns_model_dir), "--run-dir", str(tmp_path / "run"), "--steps", "2",
                        "--workers", "1", "--env.options.retry_s", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    last = p.stderr.strip().splitlines()[-1]
    assert "unreachable for retry_s = 2.0 s" in last and url in last, p.stderr[-3000:]
    print(f"stopped in {time.monotonic() - t0:.1f} s: {last}")


@pytest.mark.slow
def test_the_openenv_bench_plays_every_arm_and_survives_the_kill():
    from rlboost.benchmarks import agent_openenv

    out = agent_openenv.run(episodes=8, concurrency=4)
    for arm in ("held", "handover", "kill"):
        assert out[arm]["solved"] == out[arm]["episodes"] == 8 and out[arm]["errors"] == 0, out[arm]
    assert out["held"]["reopens"] == 0 and out["handover"]["reopens"] > 0
    assert out["kill"]["restarts"] >= 1 and out["kill"]["server_losses"] >= 1 and out["kill"]["recovery_s"] > 0


@pytest.mark.slow
def test_rlboost_run_whose_url_server_dies_for_good_ends_its_episodes_and_stops(services, tmp_path,
                                                                                short_turns_model_dir):
    """A server the run does not own (a URL) is SIGKILLed mid-run and never comes back: the
    episodes that needed it end `env_error` after `retry_s`, the next rows cannot open (each
    fails at once: the server was found down), and the run stops with one line naming the
    server, well within its bound; it does not wait for the server."""
    nats_url, redis_url = services
    port, steps_file = free_port(), tmp_path / "steps.txt"
    server = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port), "--steps-file", str(steps_file)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "OMP_NUM_THREADS": "1"}
    try:
        _wait(lambda: _healthy(port) or server.poll() is not None, 120, "the openenv server")
        run = subprocess.Popen(
            [sys.executable, "-m", "rlboost.cli", "run", "--env", f"openenv:http://127.0.0.1:{port}", "--model-dir",
             str(short_turns_model_dir), "--run-dir", str(tmp_path / "run"), "--steps", "50", "--prompts", "2",
             "--samples", "2", "--workers", "1", "--eval-every", "100", "--eval-size", "2", "--max-response-tokens",
             "24", "--env.max_turns", "4", "--env.options.retry_s", "3", "--t-seed", "0.5", "--t-seed-floor", "0.5"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            _wait(lambda: (steps_file.exists() and len(steps_file.read_text().splitlines()) >= 8)
                  or run.poll() is not None, 400, "the game to serve a few steps")
            assert run.poll() is None, run.communicate()[1][-3000:]
            server.kill()
            t0 = time.monotonic()
            out, err = run.communicate(timeout=400)
        finally:
            if run.poll() is None:
                run.kill()
                run.communicate()
    finally:
        server.kill()
        server.wait()
    last = err.strip().splitlines()[-1]
    print(f"stopped {time.monotonic() - t0:.1f} s after the kill: {last}")
    assert run.returncode == 2, err[-3000:]
    assert f"127.0.0.1:{port}" in last and "unreachable" in last and "could not open an episode" in last, last
