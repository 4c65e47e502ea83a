"""`rlboost bench agent`: multi-turn tool episodes with long-tailed tool latency on scripted engines: episodes per second and generation-slot use with tools inline (holding their slots, or parked off them) vs on the environment pool.

The workload: calculator episodes (`rlboost.envs.calculator`, 1-3 tool calls each) played by
a scripted policy that solves them (workers.engines.scripted: real tokenizer, a fixed time per
engine step whatever the batch, as on a GPU), tools whose latency is lognormal (median
`--tool-median` s, `--tool-sigma`: p99 is about 10x the median at sigma 1), drawn from each
call's idempotency key so every arm sees the same latencies; a share of each call
(`--tool-cpu`) is computation in Python (a sandbox, a parser, a test run), the rest waiting.
The arms, on the same episodes:

- `held`: an episode in its tool phase keeps its generation slot (`worker.parked_episodes = 0`,
  what a worker did before): a slow tool keeps the engine's batch short;
- `parked`: tools inline, the slot takes another request meanwhile (`worker.parked_episodes`,
  the default);
- `pool`: tools on the environment pool (`env.inline = false`): `--env-workers` `rlboost
  env-worker` processes run them; the generation worker releases the episode at each tool call.

`--kill-env-worker` (pool arm): once half the episodes are in, the environment workers are
SIGKILLed and the run's supervisor (`rlboost.workers.fleet.Supervisor`, what `rlboost run` uses)
restarts them: the arm reports `restarts`, `no_consumer_s` (from the kill until a restarted
worker pulls the lane again) and `recovered_s` (until every episode that was on the killed
workers is in: it waits out `ack_wait` before the lane redelivers it). A call that was running
at the kill may run twice, with the same key (`tool_calls_run_twice` <= `in_flight_at_kill`).

Figures per arm: episodes/s, `slot_use` (mean share of the slots generating, sampled every
20 ms while the arm runs), `engine_busy` (share of samples with any sequence generating),
`engine_step_s` (the engine's mean time per step: what tools computing in the worker's own
process cost the generation loop), and every episode's transcript checked: solved, each tool
call run once per key (the environment logs every call, in whichever process runs it).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from rlboost.benchmarks import percentile
from rlboost import episodes, wire
from rlboost.clients import open_clients
from rlboost.config import EnvSettings, Settings, WorkerSettings
from rlboost.envs import calculator
from rlboost.envs.calculator import CALC, CalculatorEnv
from rlboost.envs.chat import chat_format
from rlboost.episodes.runner import EpisodeRunner
from rlboost.envs.protocol import Context, ToolCall, ToolResult
from rlboost.logs import configure_logging, get_logger
from rlboost.pool_client import PoolClient
from rlboost.services import running_services
from rlboost.benchmarks import agent_paths, report
from rlboost.workers.counters import Counters
from rlboost.workers.engines.scripted import ScriptedEngine
from rlboost.workers.fleet import Supervisor, WorkerFleet
from rlboost.workers.worker import RolloutWorker

ENV_REF = "rlboost.benchmarks.agent:make"
ARMS = ("held", "parked", "pool")


def latency(key: str, median_s: float, sigma: float) -> float:
    """The call's latency: lognormal, a pure function of its key without the run and step
    (`<run>-s<step>-p<prompt>-g<sample>/<turn>/<index>`): the same call gets the same latency
    in both arms."""
    rid, _, where = key.partition("/")
    episode = rid[rid.find("-p") + 1:]
    return median_s * math.exp(sigma * random.Random(f"{episode}/{where}").gauss(0.0, 1.0))


class SlowCalculator(CalculatorEnv):
    """The calculator with long-tailed tools: each call takes its `latency`, the share `cpu` of
    it computing in Python (holding the GIL, as a parser or an interpreter does), the rest
    blocked (as a sandbox or an API call). Each call's key is appended to `log` (one O_APPEND
    write: whichever process runs it)."""

    def __init__(self, median_s: float = 0.5, sigma: float = 1.0, cpu: float = 0.0, log: str = "") -> None:
        super().__init__(instructions=True)
        self.median_s, self.sigma, self.cpu, self.log = median_s, sigma, cpu, log

    def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult:
        if self.log:
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{call.key}\n".encode())
            finally:
                os.close(fd)
        total = latency(call.key, self.median_s, self.sigma)
        end = time.monotonic() + total * self.cpu
        while time.monotonic() < end:  # computing: pure Python, the GIL held
            sum(i * i for i in range(2000))
        time.sleep(total * (1.0 - self.cpu))
        return super().call_tool(call, state, ctx)


def make(median_s: float = 0.5, sigma: float = 1.0, cpu: float = 0.0, log: str = "") -> SlowCalculator:
    return SlowCalculator(median_s, sigma, cpu, log)


def calls_run(log: str) -> Counter[str]:
    try:
        with open(log, encoding="utf-8") as f:
            return Counter(line.strip() for line in f if line.strip())
    except FileNotFoundError:
        return Counter()


_RESULT = re.compile(r"<tool_response>(.*?)</tool_response>")


def solver(rows: list[dict[str, Any]]):
    """A scripted policy that solves `rows`: finds the row's question in the context, calls
    `calc` for each worked step with the results the tool gave (read back from the context: a
    wrong tool result gives a wrong answer), then answers."""
    steps = {r["question"]: r["steps"] for r in rows}

    def policy(context: str, seed: int) -> str:
        question = next((q for q in steps if q in context), None)
        if question is None:
            return "Answer: 0"
        results = _RESULT.findall(context)
        k = len(results)
        if k < len(steps[question]):
            return f"<tool_call>calc {steps[question][k].format(*results)}</tool_call>"
        return f"Answer: {results[-1]}"
    return policy


def tokenizer():
    from rlboost.trainer.model import build_tokenizer

    return build_tokenizer(calculator.ALPHABET)


async def make_requests(step: int, rows: list[dict[str, Any]], options: dict[str, Any], run: str
                        ) -> list[wire.RolloutRequest]:
    fmt = chat_format(tokenizer())
    out = []
    for i, row in enumerate(rows):
        prompt = fmt.prompt_ids(CalculatorEnv().opening_messages(row), [CALC])
        settings = EnvSettings(max_turns=8, max_episode_tokens=len(prompt) + 600, tool_timeout_s=120.0)
        runner = EpisodeRunner(make(**options), fmt, settings, max_turn_tokens=64)
        out.append(await episodes.request(runner, ENV_REF, row, request_id=wire.request_id(step, i, 0, run),
                                          step=step, policy_version=0, seed=100 + i, group=i, env_options=options))
    return out


async def arm(name: str, a: argparse.Namespace, nats_url: str, redis_url: str, step: int, work: Path) -> dict:
    rows = calculator.rows("train", a.episodes, seed=a.seed)
    log = str(work / f"calls-{name}.log")
    options = {"median_s": a.tool_median, "sigma": a.tool_sigma, "cpu": a.tool_cpu, "log": log}
    pool = f"agent-{name}"
    parked = 0 if name == "held" else a.parked
    env = EnvSettings(ref=ENV_REF, inline=name != "pool")
    ack_wait = max(30.0, 4 * a.tool_median * math.exp(3 * a.tool_sigma))
    env_fleet = None
    if name == "pool":  # the environment pool: processes of their own, as on CPU machines
        tokenizer().save_pretrained(work / "tokenizer")
        env_fleet = WorkerFleet(nats_url, redis_url, work / "env-workers", pool, command="env-worker",
                                worker_args=["--model-dir", str(work / "tokenizer"), "--env", ENV_REF,
                                             "--worker.ack_wait_s", str(ack_wait), "--worker.lease_ttl_s", "20"],
                                env={"RLBOOST_LOG_LEVEL": os.environ.get("RLBOOST_ENV_WORKER_LOG_LEVEL", "warning")}, die_with_parent=True)
        for _ in range(a.env_workers):
            env_fleet.start(prefix="agent-env")
    try:
        async with open_clients(nats_url, redis_url, f"bench-agent-{name}") as c:
            reqs = await make_requests(step, rows, options, run=name)
            engines = [ScriptedEngine(tokenizer(), solver(rows), token_s=a.step_s) for _ in range(a.workers)]
            workers = [RolloutWorker(WorkerSettings(pool=pool, slots=a.slots, checkpoint_tokens=16,
                                                    parked_episodes=parked, ack_wait_s=ack_wait, lease_ttl_s=20.0,
                                                    heartbeat_s=0.5),
                                     engine, c, worker_id=f"{pool}-{i}", counters=Counters(), env=env)
                       for i, engine in enumerate(engines)]
            tasks = [asyncio.create_task(w.run()) for w in workers]
            if env_fleet is not None:  # timed from when the environment workers pull (not their start-up)
                await _pulling(c, a.env_workers, a.timeout)
            use: list[float] = []
            busy: list[bool] = []
            sub = await c.js.subscribe(wire.result_subject(step), ordered_consumer=True)
            got: dict[str, wire.RolloutResult] = {}
            t0 = time.monotonic()
            await PoolClient(c, pool).publish_step(reqs)
            want = {r.request_id for r in reqs}
            deadline = t0 + a.timeout
            kill = _Kill(env_fleet, c) if env_fleet is not None and a.kill_env_worker else None
            while len(got) < len(want) and time.monotonic() < deadline:
                try:
                    m = await sub.next_msg(timeout=0.02)
                    r = wire.decode(wire.RolloutResult, m.data)
                    if r.request_id in want:
                        got[r.request_id] = r
                except (TimeoutError, asyncio.TimeoutError):
                    pass
                if kill is not None:
                    await kill.tick(len(got), len(want))
                generating = [sum(1 for x in w.active.values() if not x.in_env and not x.done) for w in workers]
                use.append(sum(generating) / (a.slots * a.workers))
                busy.append(any(generating))
            elapsed = time.monotonic() - t0
            await sub.unsubscribe()
            for w in workers:
                w.request_drain("bench over")
            await asyncio.gather(*tasks)
            await RolloutWorker.settled()  # the fetches the drains stopped waiting for, before the connection closes
    finally:
        if env_fleet is not None:
            env_fleet.stop_all()
    ran = calls_run(log)
    snaps = [episodes.snapshot(r.episode) for r in got.values() if r.episode is not None and r.episode.done]
    solved = sum(1 for snap in snaps if calculator.make().score(snap.messages, snap.state, None).reward == 1.0)
    calls = [c for r in got.values() if r.episode is not None for c in r.episode.calls]
    steps = sum(e.steps for e in engines)
    return {"episodes": len(reqs), "finished": len(got), "solved": solved,
            "tool_calls": len(calls), "tool_calls_run_twice": sum(1 for c in calls if ran[c.key] > 1),
            "tool_p50_s": percentile([c.latency_s for c in calls], 0.5),
            "tool_p99_s": percentile([c.latency_s for c in calls], 0.99),
            "seconds": round(elapsed, 2), "episodes_per_s": round(len(got) / elapsed, 3),
            "slot_use": round(sum(use) / max(1, len(use)), 3), "engine_busy": round(sum(busy) / max(1, len(busy)), 3),
            "engine_step_s": round(sum(e.busy_s for e in engines) / max(1, steps), 4),
            **(kill.figures(len(got), time.monotonic()) if kill is not None else {})}


class _Kill:
    """`--kill-env-worker`: SIGKILL the environment workers once half the episodes are in, and
    supervise them as `rlboost run` does; then time the lane without a consumer and the recovery."""

    def __init__(self, fleet: WorkerFleet, c) -> None:
        self.fleet, self.c = fleet, c
        self.supervisor = Supervisor([fleet], get_logger(component="supervisor"))
        self.at = self.pulling_at = 0.0
        self.in_flight = self.done_at_kill = 0
        self._checked = 0.0

    async def tick(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.at and done >= total // 2:
            self.in_flight = (await self.c.js.consumer_info(wire.STREAM_REQUESTS, wire.ENV_CONSUMER)).num_ack_pending
            for w in self.fleet.live():
                w.proc.send_signal(signal.SIGKILL)  # from outside: the fleet did not choose it
            self.at, self.done_at_kill = now, done
        if self.at and not self.pulling_at and now - self._checked > 0.05:
            self._checked = now
            self.supervisor.poll()
            info = await self.c.js.consumer_info(wire.STREAM_REQUESTS, wire.ENV_CONSUMER)
            if self.supervisor.restarts and info.num_waiting >= 1:
                self.pulling_at = now

    def figures(self, done: int, end: float) -> dict[str, Any]:
        return {"restarts": self.supervisor.restarts, "in_flight_at_kill": self.in_flight,
                "no_consumer_s": round(self.pulling_at - self.at, 2) if self.pulling_at else None,
                "recovered_s": round(end - self.at, 2) if self.at and done else None}


async def _pulling(c, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await c.js.consumer_info(wire.STREAM_REQUESTS, wire.ENV_CONSUMER)).num_waiting >= n:
                return
        except Exception:  # not provisioned yet
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError(f"the {n} environment worker(s) did not start pulling within {timeout_s} s")


async def bench(a: argparse.Namespace, nats_url: str, redis_url: str) -> dict:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlboost-agent-") as tmp:
        for i, name in enumerate(a.arms):
            out[name] = await arm(name, a, nats_url, redis_url, 900 + i, Path(tmp))
    last = out[a.arms[-1]]
    out.update({"workers": a.workers, "slots": a.slots, "step_s": a.step_s, "tool_median_s": a.tool_median,
                "tool_sigma": a.tool_sigma, "tool_cpu": a.tool_cpu, "env_workers": a.env_workers,
                "tool_p50_s": last["tool_p50_s"], "tool_p99_s": last["tool_p99_s"]})
    base = out.get("held")
    for name in a.arms:
        if base and name != "held":
            out[f"{name}_speedup"] = round(out[name]["episodes_per_s"] / max(1e-9, base["episodes_per_s"]), 2)
    return out


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench agent", description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=48)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--parked", type=int, default=WorkerSettings().parked_episodes, help="the parked arm's parked_episodes")
    p.add_argument("--step-s", type=float, default=0.02, help="seconds per engine step (any batch size)")
    p.add_argument("--tool-median", type=float, default=0.5, help="median tool latency (s)")
    p.add_argument("--tool-sigma", type=float, default=1.0, help="lognormal sigma of tool latency")
    p.add_argument("--tool-cpu", type=float, default=0.0, help="share of each call computing in Python (0..1)")
    p.add_argument("--env-workers", type=int, default=1, help="the pool arm's environment worker processes")
    p.add_argument("--kill-env-worker", action="store_true",
                   help="pool arm: SIGKILL its environment workers half-way; they are supervised and restarted")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--paths", default="", help="also a row for each other way in, of "
                   f"{', '.join(agent_paths.PATHS)} (benchmarks/agent_paths.py): episodes/s and what a kill costs")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=7)
    report.add_out(p)
    a = p.parse_args(argv)
    a.arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not a.arms or any(x not in ARMS for x in a.arms):
        p.error(f"--arms: choose from {', '.join(ARMS)}")
    if not 0.0 <= a.tool_cpu <= 1.0:
        p.error("--tool-cpu: a share, 0..1")
    a.paths = [x.strip() for x in a.paths.split(",") if x.strip()]
    if any(x not in agent_paths.PATHS for x in a.paths):
        p.error(f"--paths: choose from {', '.join(agent_paths.PATHS)}")
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-agent-")
    if "RLBOOST_LOG_LEVEL" not in os.environ:  # the workers run in this process: their warnings only
        configure_logging(json=s.log_json, level="warning")
    with running_services(s.services) as (nats_url, redis_url):
        out = asyncio.run(bench(a, nats_url, redis_url))
        if a.paths:
            out["paths"] = agent_paths.run(a.paths, a.episodes, a.workers * a.slots, nats_url, redis_url)
    ok = all(out[k]["finished"] == out[k]["solved"] == out[k]["episodes"]
             and out[k]["tool_calls_run_twice"] <= out[k].get("in_flight_at_kill", 0) for k in a.arms)
    ok = ok and all(row["ok"] for row in out.get("paths", {}).values())
    if a.paths:  # one row per way in: the native arms', then each other path's
        rows = [(f"native ({k})", {"episodes_per_s": out[k]["episodes_per_s"],
                                   "kill": {"no_consumer_s": out[k].get("no_consumer_s"),
                                            "recovered_s": out[k].get("recovered_s")}
                                   if "restarts" in out[k] else {}}) for k in a.arms]
        rows += list(out["paths"].items())
        report.print_table(rows, [("path", "<18", lambda r: r[0]), ("ep/s", ">9", lambda r: r[1]["episodes_per_s"]),
                                  ("a kill costs", "<60", lambda r: agent_paths.kill_cost(r[1]) or "-")], sep="  ")
    arms = ", ".join(f"{k} {out[k]['episodes_per_s']} ep/s (slot use {out[k]['slot_use']}, engine step "
                     f"{out[k]['engine_step_s'] * 1000:.1f} ms)" for k in a.arms)
    print(f"{a.episodes} episodes, {a.workers} worker(s) x {a.slots} slots, tools p50 {out['tool_p50_s']} s / "
          f"p99 {out['tool_p99_s']} s, {a.tool_cpu:.0%} computing: {arms}  "
          f"-> {'OK' if ok else 'EPISODES LOST OR WRONG'}")
    return report.finish("agent", out, report.out_dir(a), ok=ok)
