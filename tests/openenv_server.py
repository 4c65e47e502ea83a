"""A small OpenEnv environment served by openenv-core's own server code, for the OpenEnv adapter's
tests (tests/test_openenv_env.py): guess the number.

`reset(seed)` draws a secret number in 1..`--top` from `random.Random(seed)`; each `step` is one
guess (`GuessAction(guess="5")`), answered "higher", "lower" or "right" with reward 1.0 on the
right guess (done), 0.0 otherwise; the game ends after `--tries` guesses. Every text is in the
calculator's alphabet (printable ASCII), so the tests' character model reads it.

    python tests/openenv_server.py --port 8000 [--host 127.0.0.1] [--pid-dir DIR] [--steps-file F]
                                   [--unseeded]

`--pid-dir` writes `<pid>` there at startup (a test finds the server a worker started and kills
it); `--steps-file` appends one line per step served (a test waits for steps, not for time);
`--unseeded` ignores the seed (a non-deterministic environment: a replay diverges);
`--mcp` serves a game with MCP tools instead (`CounterEnvironment`: reach a seeded target with
`add(n)` calls; reward 1.0 and done when the counter reaches it exactly, done past it);
`--capacity N` is openenv's max_concurrent_envs (512 here; 1 in openenv's template);
`--die-once FILE`: the first server to have served `--die-after` steps SIGKILLs itself in the
middle of a step of an episode it already served a step of (a client holding that session loses
it), and creates FILE so that its restarted successors do not.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import threading
from pathlib import Path
from typing import Any, Optional

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

TOP, TRIES = 8, 4
UNSEEDED = False
STEPS_FILE: Path | None = None
DIE_ONCE: Path | None = None
DIE_AFTER = 10
_served = 0
_steps_lock = threading.Lock()


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    message: str = ""


class GuessState(State):
    secret: int = 0
    tries: int = 0


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> GuessObservation:
        rng = random.Random(None if UNSEEDED or seed is None else seed)
        self._state = GuessState(episode_id=episode_id, secret=rng.randint(1, TOP), tries=0)
        # the game's number is drawn too: an unseeded server's openings differ (a replay sees it)
        return GuessObservation(message=f"Game {rng.randrange(1000)}: guess my number from 1 to {TOP}. "
                                        f"You have {TRIES} tries.", reward=0.0, done=False)

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        global _served
        with _steps_lock:
            _served += 1
            if STEPS_FILE is not None:
                with STEPS_FILE.open("a") as f:
                    f.write(f"{os.getpid()} {self._state.episode_id}\n")
            if DIE_ONCE is not None and _served >= DIE_AFTER and self._state.tries >= 1 and not DIE_ONCE.exists():
                DIE_ONCE.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
        s = self._state
        s.tries += 1
        s.step_count += 1
        found = re.findall(r"-?\d+", action.guess)
        if not found:
            message, reward = "Say a number.", 0.0
        else:
            n = int(found[-1])
            message, reward = ("right", 1.0) if n == s.secret else ("higher" if n < s.secret else "lower", 0.0)
        done = reward > 0 or s.tries >= TRIES
        return GuessObservation(message=message, reward=reward, done=done)

    @property
    def state(self) -> GuessState:
        return self._state


class CounterObservation(Observation):
    message: str = ""


def counter_environment():
    """An OpenEnv MCP environment (openenv's `MCPEnvironment`, tools from a FastMCP server):
    its tool calls are steps (`{"type": "call_tool", ...}`) with the reward and done set here."""
    from fastmcp import FastMCP
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction

    class CounterEnvironment(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            mcp = FastMCP("counter")
            self.total, self.target = 0, 0

            @mcp.tool
            def add(n: int) -> int:
                """Add n to the counter; answers the new total."""
                self.total += n
                return self.total

            super().__init__(mcp)
            self._state = State()

        def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
                  **kwargs: Any) -> CounterObservation:
            self.total, self.target = 0, random.Random(seed).randint(3, 9)
            self._state = State(episode_id=episode_id)
            return CounterObservation(message=f"Reach {self.target} with add.", reward=0.0)

        async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
            obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
            if isinstance(action, CallToolAction):
                obs.reward = float(self.total == self.target)
                obs.done = self.total >= self.target
            return obs

        def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
            return CounterObservation(message="use the add tool", reward=0.0)

        @property
        def state(self) -> State:
            return self._state

    return CounterEnvironment, CallToolAction


def main() -> None:
    global UNSEEDED, STEPS_FILE, DIE_ONCE, DIE_AFTER
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--pid-dir", default="")
    p.add_argument("--steps-file", default="")
    p.add_argument("--unseeded", action="store_true")
    p.add_argument("--die-once", default="")
    p.add_argument("--die-after", type=int, default=10)
    p.add_argument("--mcp", action="store_true")
    p.add_argument("--capacity", type=int, default=512, help="sessions at once (max_concurrent_envs)")
    args = p.parse_args()
    DIE_ONCE, DIE_AFTER = (Path(args.die_once) if args.die_once else None), args.die_after
    UNSEEDED = args.unseeded
    STEPS_FILE = Path(args.steps_file) if args.steps_file else None
    if args.pid_dir:
        Path(args.pid_dir, str(os.getpid())).write_text(str(args.port))
    if args.mcp:
        env_cls, action_cls = counter_environment()
        app = create_app(env_cls, action_cls, CounterObservation, env_name="counter",
                         max_concurrent_envs=args.capacity)
    else:
        app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                         max_concurrent_envs=args.capacity)
    import uvicorn

    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", ws_max_size=1 << 20)


if __name__ == "__main__":
    main()
