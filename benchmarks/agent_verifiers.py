"""verifiers episodes through rlboost's native adapter (rlboost/envs/verifiers_env.py): episodes per
second, against the same episodes on rlboost's built-in calculator, with every phase handed over,
and what a worker kill costs.

The workload: the calculator's word problems (1-3 tool calls each) as a verifiers 0.4 taskset
defined here (`load_environment`: a `Calc` tool server whose `calc` tool is rlboost's calculator,
a `@vf.reward` on the final answer), played by a scripted policy that solves them from the token
stream (no model: what is measured is the environment's side), `concurrency` episodes at once
through `EpisodeRunner` as a worker runs them. The arms, on the same rows:

- `builtin`: rlboost's own calculator environment (the baseline);
- `native`: the verifiers taskset through the adapter (tool servers rebuilt per call, state as
  JSON, `Task.score` on a trace built from the transcript);
- `handover`: as `native`, the phases alternating between two environment objects, each from
  the snapshot's bytes (what a preemption after every checkpoint would cost: the state decoded,
  the tool servers and the trace rebuilt); each tool call is counted per key;
- `kill`: what a worker's SIGKILL costs on this path: a fresh process (a replacement worker)
  loads the environment and answers its first episode's first call (`cold_start_s`: the
  verifiers import and the module's, the whole of it), and the episodes in flight resume from
  their checkpoints (as `handover`: no tool call runs twice).

Every arm checks each episode: solved, every tool call run once per key.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from rlboost.benchmarks import percentile, report
from rlboost.config import EnvSettings, Settings
from rlboost.envs import calculator, load_env
from rlboost.episodes.runner import EpisodeRunner, Snapshot

REF = "verifiers:rlboost.benchmarks.agent_verifiers"
CALLS: Counter[str] = Counter()  # tool calls per idempotency key, in this process


def load_environment(n: int = 256):
    """The benchmark's verifiers taskset (its imports here only: the module imports without verifiers)."""
    import verifiers.v1 as vf

    from rlboost.envs.verifiers_env import call_key

    class Data(vf.TaskData):
        answer: str = ""
        steps: list[str] = []

    class Calc(vf.Toolset[vf.ToolsetConfig, vf.State]):
        TOOL_PREFIX = None

        @vf.tool
        def calc(self, expression: str) -> str:
            """Evaluate an arithmetic expression exactly."""
            CALLS[call_key()] += 1
            return calculator.evaluate(expression)

    class Task(vf.Task[Data, vf.State, vf.TaskConfig]):
        @classmethod
        def toolsets(cls, config):
            return [Calc(vf.ToolsetConfig())]

        @vf.reward
        async def correct(self, task, trace) -> float:
            return float(calculator.final_answer(trace.last_reply) == task.answer)

    class Problems(vf.Taskset[Task, vf.TasksetConfig]):
        def load(self):
            for r in calculator.rows("train", n, seed=11):
                yield Task(Data(prompt=r["question"], answer=str(r["answer"]), steps=list(r["steps"])))

    return Problems(vf.TasksetConfig())


def solver(tok, fmt, by_question: dict[str, dict]):
    """A policy that solves each problem from what its token stream shows (the question, the tool
    results so far), instantly."""
    from rlboost.envs.protocol import Message, ToolCall

    async def generate(prompt_ids, max_new_tokens, stop_ids):
        text = tok.decode(prompt_ids, skip_special_tokens=False)
        row = next(r for q, r in by_question.items() if q in text)
        results = [x.strip() for x in re.findall(r"<tool_response>(.*?)</tool_response>", text, re.S)]
        if len(results) < len(row["steps"]):
            call = ToolCall(key="k", name="calc", arguments={"expression": row["steps"][len(results)].format(*results)})
            out = fmt.assistant_text(Message(role="assistant", tool_calls=[call]), [calculator.CALC])
        else:
            out = f"Answer: {results[-1] if results else row['answer']}"
        ids = tok(out, add_special_tokens=False)["input_ids"] + [stop_ids[0]]
        return ids[:max_new_tokens], [-0.1] * len(ids[:max_new_tokens])

    return generate


async def _episode(name: str, i: int, row: dict, envs: list, fmt, settings: EnvSettings, gen) -> Any:
    if name != "handover":
        return await EpisodeRunner(envs[0], fmt, settings).run(gen, f"ep-{i}", row)
    snap = await EpisodeRunner(envs[0], fmt, settings).run(gen, f"ep-{i}", row, stop_after=1)
    phase = 1
    while isinstance(snap, Snapshot):  # the phases alternate between two environment objects, through bytes
        snap = await EpisodeRunner(envs[phase % 2], fmt, settings).run(gen, snapshot=Snapshot.decode(snap.encode()),
                                                                      stop_after=1)
        phase += 1
    return snap


async def arm(name: str, episodes: int, concurrency: int) -> dict[str, Any]:
    from rlboost.envs.chat import FallbackFormat
    from rlboost.trainer.model import build_tokenizer

    tok = build_tokenizer(calculator.ALPHABET)
    fmt = FallbackFormat(tok, describe_tools=False, compact_calls=True)
    settings = EnvSettings(max_turns=6, max_episode_tokens=4096)
    rows = [r for r in calculator.rows("train", episodes, seed=11)]
    gen = solver(tok, fmt, {r["question"]: r for r in rows})
    if name != "builtin":  # the adapter's rows: the same problems, as the taskset's task data
        by_q = {r["prompt"]: r for r in load_env(REF, n=episodes).rows("train", 10 * episodes)}
        by_q.update({r["prompt"]: r for r in load_env(REF, n=episodes).rows("test", 10 * episodes)})
        rows = [by_q[r["question"]] for r in rows]
    envs = ([load_env("calculator", instructions=False)] if name == "builtin"
            else [load_env(REF, n=episodes), load_env(REF, n=episodes)])
    for env in envs:  # built before the clock starts (a worker builds its environment once)
        getattr(env, "built", lambda: None)()
    CALLS.clear()
    gate, lat = asyncio.Semaphore(concurrency), []

    async def one(i: int, row: dict) -> Any:
        async with gate:
            t0 = time.monotonic()
            res = await _episode(name, i, row, envs, fmt, settings, gen)
            lat.append(time.monotonic() - t0)
            return res

    t0 = time.monotonic()
    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    wall = time.monotonic() - t0
    out = {"episodes": episodes, "solved": sum(r.reward == 1.0 for r in results), "seconds": round(wall, 2),
           "episodes_per_s": round(episodes / wall, 1), "tool_calls": sum(r.tool_calls for r in results),
           "episode_p50_ms": percentile([1000 * x for x in lat], 0.5),
           "episode_p99_ms": percentile([1000 * x for x in lat], 0.99)}
    if name != "builtin":
        out["tool_calls_run_twice"] = sum(1 for n in CALLS.values() if n > 1)
        out["tool_calls_run"] = sum(CALLS.values())
    return out


def cold_start_s() -> float:
    """A fresh process (a replacement worker): load the environment and answer a first episode's
    start, timed from the process's own start (its imports included)."""
    code = ("import time, asyncio; t0 = time.monotonic()\n"
            "from rlboost.envs import load_env\n"
            "from rlboost.envs.protocol import Context\n"
            f"env = load_env({REF!r}, n=8)\n"
            "row = env.rows('train', 1)[0]\n"
            "asyncio.run(env.start(row, Context(episode_id='cold')))\n"
            "print(time.monotonic() - t0)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"the cold start failed: {p.stderr[-500:]}")
    return round(float(p.stdout.strip().splitlines()[-1]), 2)


def run(episodes: int = 64, concurrency: int = 16, arms: str = "builtin,native,handover,kill") -> dict:
    """The bench's figures (the module's docstring): one dict per arm."""
    names = [x.strip() for x in arms.split(",") if x.strip()]
    if not names or any(x not in ("builtin", "native", "handover", "kill") for x in names):
        raise ValueError(f"arms {arms!r}: choose from builtin, native, handover, kill")
    out: dict[str, Any] = {"concurrency": concurrency}
    for name in names:
        if name == "kill":
            out["kill"] = {"cold_start_s": cold_start_s()}
        else:
            out[name] = asyncio.run(arm(name, episodes, concurrency))
    return out


def main(argv: list[str], s: Settings | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench agent-verifiers", description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--arms", default="builtin,native,handover,kill")
    report.add_out(p)
    a = p.parse_args(argv)
    out = run(a.episodes, a.concurrency, a.arms)
    played = [k for k in ("builtin", "native", "handover") if k in out]
    ok = all(out[k]["solved"] == out[k]["episodes"] and not out[k].get("tool_calls_run_twice") for k in played)
    print(", ".join(f"{k} {out[k]['episodes_per_s']} ep/s (p50 {out[k]['episode_p50_ms']} ms)" for k in played)
          + (f"; a replacement worker's cold start {out['kill']['cold_start_s']} s" if "kill" in out else "")
          + f" -> {'OK' if ok else 'EPISODES WRONG OR A TOOL CALL RUN TWICE'}")
    return report.finish("agent-verifiers", out, report.out_dir(a), ok=ok)
