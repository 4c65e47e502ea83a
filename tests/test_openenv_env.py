"""OpenEnv environments (`--env openenv:TARGET`, rlboost/envs/openenv_env.py) against a real
OpenEnv server: tests/openenv_server.py, a number-guessing game served by openenv-core's own app
in a subprocess on a free loopback port. An episode's state is its seed and actions: another
environment object (another process) re-opens it by reset + replay, a killed server is restarted
and its episodes re-opened and counted, and a server that stays down ends a call with a clear
error instead of a hang."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
        assert len(list(pids.iterdir())) == 2 and env.server.restarts >= 1
        r3 = await env.respond([], ModelTurn(text=str(secret(11))), r2.state, ctx(2))
        assert r3.done and env.score([], r3.state, ctx()).reward == 1.0
        assert env.score([], r3.state, ctx()).metrics["server_losses"] == 1.0
    finally:
        env.server.close()
    _wait(lambda: all(not Path(f"/proc/{p.name}").exists() or _zombie(p.name) for p in pids.iterdir()), 30,
          "the started servers to end")


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
    assert time.monotonic() - t0 < 10 and "\n" not in str(e.value)


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
