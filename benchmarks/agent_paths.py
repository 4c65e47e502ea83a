"""`rlboost bench agent --paths verifiers,openenv,harness`: one row per way an environment users
already have comes in (docs/concepts/environments.md, "Four ways in"), beside the native arms:
episodes (sessions) per second, and what a kill costs on that path. Each row is its own bench's
figures (`rlboost bench agent-verifiers`, `agent-openenv`, `agent-harness`: their docstrings say
what they measure), run small here so the four paths sit in one table:

- `verifiers`: a verifiers taskset through the native adapter, episodes/s; a worker's SIGKILL
  costs a replacement's cold start (the verifiers import and the module's) and, since its
  episodes resume from their checkpoints, no tool call run twice;
- `openenv`: an OpenEnv game with sessions held, episodes/s; the server's SIGKILL costs the
  time until it answers again (restarted by its supervisor) and re-opened sessions, no episode;
- `harness`: the user's agent process through the run's endpoint, sessions/s; a harness
  SIGKILLed mid-session costs its own session (its calls generated, not trained), never the batch.
"""

from __future__ import annotations

import asyncio
from typing import Any

PATHS = ("verifiers", "openenv", "harness")


def verifiers(episodes: int, concurrency: int) -> dict[str, Any]:
    from rlboost.benchmarks import agent_verifiers

    out = agent_verifiers.run(episodes=episodes, concurrency=concurrency, arms="native,kill")
    native = out["native"]
    return {"episodes_per_s": native["episodes_per_s"], "episodes": native["episodes"], "solved": native["solved"],
            "kill": {"cold_start_s": out["kill"]["cold_start_s"], "tool_calls_run_twice": native["tool_calls_run_twice"]},
            "ok": native["solved"] == native["episodes"] and native["tool_calls_run_twice"] == 0, "detail": out}


def openenv(episodes: int, concurrency: int) -> dict[str, Any]:
    from rlboost.benchmarks import agent_openenv

    out = agent_openenv.run(episodes=episodes, concurrency=concurrency, arms="held,kill")
    held, kill = out["held"], out["kill"]
    return {"episodes_per_s": held["episodes_per_s"], "episodes": held["episodes"], "solved": held["solved"],
            "kill": {"recovery_s": kill.get("recovery_s"), "sessions_lost": kill["server_losses"],
                     "reopens": kill["reopens"], "episodes_lost": kill["episodes"] - kill["solved"]},
            "ok": held["solved"] == held["episodes"] and kill["solved"] == kill["episodes"], "detail": out}


def harness(nats_url: str, redis_url: str, sessions: int) -> dict[str, Any]:
    from rlboost.benchmarks import agent_harness

    out = asyncio.run(agent_harness.run(nats_url, redis_url, sessions=sessions))
    clean, killed = out["clean"], out["killed"]
    return {"episodes_per_s": clean["sessions_per_s"], "episodes": sessions, "solved": clean["kept"],
            "kill": {"sessions_lost": killed["lost"], "calls_lost": killed["calls_lost"],
                     "extra_s": out["killed_extra_s"]},
            "ok": clean["kept"] == sessions and killed["kept"] == sessions - 1 and killed["lost"] == 1, "detail": out}


def run(names: list[str], episodes: int, concurrency: int, nats_url: str, redis_url: str) -> dict[str, dict]:
    """Each named path's row (the `detail` holds its bench's whole output)."""
    rows: dict[str, dict] = {}
    for name in names:
        if name == "verifiers":
            rows[name] = verifiers(episodes, concurrency)
        elif name == "openenv":
            rows[name] = openenv(episodes, concurrency)
        elif name == "harness":
            rows[name] = harness(nats_url, redis_url, min(episodes, 16))  # a process per session
    return rows


def kill_cost(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in row["kill"].items())
