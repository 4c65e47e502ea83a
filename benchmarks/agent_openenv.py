"""OpenEnv episodes through rlboost's adapter: episodes per second with sessions held, with every turn handed over (re-opened by reset + replay), and what a server SIGKILL costs.

The adapter is rlboost/envs/openenv_env.py (docs/guides/openenv.md).

The workload: a number-guessing game (1..8, 4 tries, seeded; this module serves it with
openenv-core's own app: `python -m rlboost.benchmarks.agent_openenv serve --port N`), each
environment step taking `step_ms` in the server, played by a scripted binary search (2-4 turns an
episode), `concurrency` episodes at once, through the adapter's `start` / `respond` as a worker
calls them. The arms, on the same games:

- `held`: one environment object plays every turn: each episode keeps its session (what a worker
  that keeps its episodes sees);
- `handover`: the turns alternate between two environment objects (two processes): every turn
  re-opens the episode and replays its actions (what a preemption on every turn would cost);
- `kill`: as `held`, and once half the episodes are in the server is SIGKILLed: its supervisor
  restarts it, the episodes it held are re-opened. Figures: `recovery_s` (from the kill to the
  first turn answered after it: the server's restart, mostly its imports), `server_losses`,
  `reopens`, and episodes lost (none: each waits, bounded by `retry_s`).

Every arm checks each episode's outcome: the search finds the secret within the tries.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from typing import Any

from rlboost.benchmarks import percentile, report
from rlboost.config import Settings
from rlboost.envs.openenv_env import OpenEnvEnv, load
from rlboost.envs.protocol import Context, EnvError, ModelTurn

TOP, TRIES = 8, 4


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, TOP)


def serve(argv: list[str]) -> None:
    """The guessing game on openenv-core's server (its imports only here: the bench's own process
    never loads them)."""
    import re

    import uvicorn
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    p = argparse.ArgumentParser(prog="agent_openenv serve")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=0.0)
    a = p.parse_args(argv)

    class GuessAction(Action):
        guess: str

    class GuessObservation(Observation):
        message: str = ""

    class Guess(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._s = State()
            self.secret, self.tries = 0, 0

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> GuessObservation:
            self.secret, self.tries = secret(seed or 0), 0
            return GuessObservation(message=f"Guess my number from 1 to {TOP}.", reward=0.0)

        def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any) -> GuessObservation:
            if a.step_ms:
                time.sleep(a.step_ms / 1000)  # the environment's own work (a sandbox, a simulator)
            self.tries += 1
            found = re.findall(r"\d+", action.guess)
            n = int(found[-1]) if found else 0
            right = n == self.secret
            return GuessObservation(message="right" if right else "higher" if n < self.secret else "lower",
                                    reward=float(right), done=right or self.tries >= TRIES)

        @property
        def state(self) -> State:
            return self._s

    app = create_app(Guess, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=4096)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


async def play(seed: int, players: list[OpenEnvEnv], opener: OpenEnvEnv, turn_s: list[float],
               answered: list[float], between_turns=lambda: None) -> dict[str, Any]:
    """One episode: opened by `opener` (the trainer), its turns played by `players` in turn;
    `between_turns()` after each turn that does not end it."""
    ctx = Context(episode_id=f"ep-{seed}", seed=seed)
    state = (await opener.start({"seed": seed}, ctx)).state
    low, high, turn = 1, TOP, 0
    while True:
        guess = (low + high) // 2
        t0 = time.monotonic()
        reply = await players[turn % len(players)].respond([], ModelTurn(text=str(guess)), state,
                                                           Context(episode_id=ctx.episode_id, turn=turn, seed=seed))
        turn_s.append(time.monotonic() - t0)
        answered.append(time.monotonic())
        state, turn = reply.state, turn + 1
        if reply.done:
            return {"solved": guess == secret(seed), "state": state}
        low, high = (guess + 1, high) if reply.messages[0].content == "higher" else (low, guess - 1)
        between_turns()


async def arm(name: str, env: OpenEnvEnv, other: OpenEnvEnv, episodes: int, concurrency: int,
              seed0: int) -> dict[str, Any]:
    players = [env, other] if name == "handover" else [env]
    gate, turn_s, answered, done = asyncio.Semaphore(concurrency), [], [], []
    kill: dict[str, float] = {}

    def between_turns() -> None:
        # half-way, between two turns of an episode (so that at least its session is open):
        # the supervised server dies
        if name == "kill" and len(done) >= episodes // 2 and not kill:
            kill["at"] = time.monotonic()
            os.kill(env.server.pid, signal.SIGKILL)

    async def one(i: int) -> dict[str, Any]:
        async with gate:
            try:
                out = await play(seed0 + i, players, other, turn_s, answered, between_turns)
            except EnvError as e:
                out = {"solved": False, "error": str(e)}
        done.append(out)
        return out

    t0 = time.monotonic()
    outs = await asyncio.gather(*(one(i) for i in range(episodes)))
    wall = time.monotonic() - t0
    states = [o["state"] for o in outs if "state" in o]
    res = {"episodes": episodes, "solved": sum(o["solved"] for o in outs),
           "errors": sum("error" in o for o in outs), "seconds": round(wall, 2),
           "episodes_per_s": round(episodes / wall, 2), "turns": len(turn_s),
           "turn_p50_ms": percentile([1000 * t for t in turn_s], 0.5),
           "turn_p99_ms": percentile([1000 * t for t in turn_s], 0.99),
           "reopens": sum(s["reopens"] for s in states), "server_losses": sum(s["server_losses"] for s in states)}
    if kill:
        after = [t for t in answered if t > kill["at"]]
        res["recovery_s"] = round(min(after) - kill["at"], 2) if after else None
        res["restarts"] = env.server.restarts
    return res


async def bench(episodes: int, concurrency: int, step_ms: float, arms: list[str], retry_s: float) -> dict:
    command = [sys.executable, "-m", "rlboost.benchmarks.agent_openenv", "serve", "--port", "{port}",
               "--step-ms", str(step_ms)]
    env, other = (load("guess-bench", command=command, retry_s=retry_s) for _ in range(2))
    try:
        await env.server.ready(retry_s)  # the server's start (its imports) is not the arms' time
        out: dict[str, Any] = {"step_ms": step_ms, "concurrency": concurrency}
        for i, name in enumerate(arms):
            out[name] = await arm(name, env, other, episodes, concurrency, 1000 * i)
        return out
    finally:
        env.server.close()


def run(episodes: int = 64, concurrency: int = 16, step_ms: float = 0.0, arms: str = "held,handover,kill",
        retry_s: float = 120.0) -> dict:
    """The bench's figures (the module's docstring): one dict per arm."""
    names = [x.strip() for x in arms.split(",") if x.strip()]
    if not names or any(x not in ("held", "handover", "kill") for x in names):
        raise ValueError(f"arms {arms!r}: choose from held, handover, kill")
    return asyncio.run(bench(episodes, concurrency, step_ms, names, retry_s))


def main(argv: list[str], s: Settings | None = None) -> int:
    if argv[:1] == ["serve"]:
        serve(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="rlboost bench agent-openenv", description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--step-ms", type=float, default=0.0, help="the environment's own time per step")
    p.add_argument("--arms", default="held,handover,kill")
    report.add_out(p)
    a = p.parse_args(argv)
    out = run(a.episodes, a.concurrency, a.step_ms, a.arms)
    arms = [k for k in ("held", "handover", "kill") if k in out]
    ok = all(out[k]["solved"] == out[k]["episodes"] for k in arms)
    print(", ".join(f"{k} {out[k]['episodes_per_s']} ep/s (turn p50 {out[k]['turn_p50_ms']} ms, re-opens "
                    f"{out[k]['reopens']})" for k in arms)
          + (f"; kill: recovered in {out['kill']['recovery_s']} s, {out['kill']['server_losses']} sessions lost"
             if "kill" in out else "") + f" -> {'OK' if ok else 'EPISODES LOST OR WRONG'}")
    return report.finish("agent-openenv", out, report.out_dir(a), ok=ok)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
