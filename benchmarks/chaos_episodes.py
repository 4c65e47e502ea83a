"""`rlboost bench chaos --episodes`: calculator episodes on real worker processes, SIGKILL and SIGTERM aimed at workers while they generate a model turn and while they run a tool call, and every result checked against an undisturbed run.

Tool calls run inline in the generation workers, or with `--env-pool` on environment worker
processes (`env.inline = false`, workers/env_worker.py): then the tool-call actions hit the
environment workers.

The workers run the scripted engine (workers/engines/scripted.py: a deterministic policy that
solves the calculator's problems with its tool, seeded logprobs), so an undisturbed run is
reproducible token for token; the environment is the calculator with a tool that takes
`--tool-s` seconds and writes each call's idempotency key to a log before it answers (one
O_APPEND write: a killed process leaves whole lines): what "the environment counts" means.

Each chaos action picks its moment from the checkpoint store: `kill-gen` waits for an episode
whose model turn is under way (tokens past its fenced state) and SIGKILLs the worker that holds
it; `kill-tool` waits for an episode whose pending tool call has started; `term` SIGTERMs the
holder of either (notice: the worker finishes the tool call or flushes the turn and hands the
episode back). With `--env-pool` the tool calls are the environment workers': `kill-tool`
SIGKILLs and `term-env` SIGTERMs the environment worker running one, `term` SIGTERMs a
generation worker during a turn. A replacement of the same kind starts after each.

What is measured:
- completed / lost / duplicated: results per episode in RB_RESULTS;
- mismatched: results whose tokens, training mask, logprobs or final messages differ from the
  undisturbed run (the episode runner alone, in this process);
- tool calls: invocations per idempotency key from the environment's log, with the process that
  ran each. The run whose result the episode kept is named by the result (`ToolRecord.worker_id`);
  any other run of that key must be by a SIGKILLed worker (it died during the call, before the
  result was fenced in; the re-run has the same key, so a tool with side effects can
  de-duplicate): `tool_calls_rerun_after_kill`. A re-run after a SIGTERM, or by a worker left
  alone, is `tool_calls_rerun_unexplained` and must be 0;
- regenerated tokens per worker fate: model tokens the worker generated (crash-proof counters)
  minus those the results attribute to it (model segments). SIGTERM: 0; SIGKILL: at most K per
  episode the killed worker held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from rlboost import bus, episodes, wire
from rlboost.checkpoint import parse_segment
from rlboost.clients import open_clients
from rlboost.config import EnvSettings, Settings, WorkerSettings
from rlboost.envs import calculator
from rlboost.envs.calculator import CALC, CalculatorEnv
from rlboost.envs.chat import chat_format
from rlboost.episodes.runner import EpisodeRunner
from rlboost.envs.protocol import Context, ToolCall, ToolResult
from rlboost.replay import read_subject
from rlboost.services import running_services
from rlboost.benchmarks.agent import solver, tokenizer  # the scripted policy that solves the calculator's problems
from rlboost.benchmarks import report

POOL = "chaosep"
ENV_REF = "rlboost.benchmarks.chaos_episodes:counting_calculator"


# ---------------------------------------------------------------- the environment and the policy


class CountingCalculator(CalculatorEnv):
    """The calculator, its tool slow (`delay_s`) and counted: each call's key is appended to `log`
    before the tool answers."""

    def __init__(self, log: str, delay_s: float = 0.0) -> None:
        super().__init__(instructions=True)
        self.log, self.delay_s = log, delay_s

    def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{call.key} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().call_tool(call, state, ctx)


def counting_calculator(log: str, delay_s: float = 0.0) -> CountingCalculator:
    return CountingCalculator(log, delay_s)


def runs(log: str) -> list[tuple[str, int]]:
    """Every tool call the environment ran: (idempotency key, process id), in order."""
    try:
        with open(log, encoding="utf-8") as f:
            return [(key, int(pid)) for key, pid in (line.split() for line in f if line.strip())]
    except FileNotFoundError:
        return []


def calls(log: str) -> list[str]:
    return [key for key, _ in runs(log)]


async def make_requests(step: int, rows: list[dict], log: str, delay_s: float, max_new: int = 600
                        ) -> list[wire.RolloutRequest]:
    fmt = chat_format(tokenizer())
    env = CalculatorEnv()
    out = []
    for i, row in enumerate(rows):
        prompt = fmt.prompt_ids(env.opening_messages(row), [CALC])
        settings = EnvSettings(max_turns=8, max_episode_tokens=len(prompt) + max_new)
        runner = EpisodeRunner(counting_calculator(log, delay_s), fmt, settings, max_turn_tokens=64)
        out.append(await episodes.request(runner, ENV_REF, row, request_id=wire.request_id(step, i, 0), step=step,
                                          policy_version=0, seed=100 + i, group=i,
                                          env_options={"log": log, "delay_s": delay_s}))
    return out


async def reference(reqs: list[wire.RolloutRequest], rows: list[dict], log: str) -> dict[str, tuple]:
    """Each episode run undisturbed by the runner alone: tokens after the prompt, the training
    mask, the logprobs (float32, as checkpointed) and the messages."""
    from rlboost.workers.engines.base import Sequence
    from rlboost.workers.engines.scripted import ScriptedEngine

    engine = ScriptedEngine(tokenizer(), solver(rows))
    out = {}
    for req in reqs:
        spec = req.episode
        assert spec is not None
        settings = EnvSettings(max_turns=spec.max_turns, max_episode_tokens=len(req.prompt_ids) + req.max_new_tokens,
                               tool_timeout_s=spec.tool_timeout_s)
        runner = EpisodeRunner(counting_calculator(log), chat_format(engine.tokenizer), settings,
                               max_turn_tokens=spec.max_turn_tokens or req.max_new_tokens)

        async def generate(ids: list[int], budget: int, stops: list[int], req=req):
            seq = Sequence(request_id=req.request_id, prompt_ids=list(req.prompt_ids), seed=req.seed,
                           max_new_tokens=len(ids) - len(req.prompt_ids) + budget, stop_ids=stops,
                           token_ids=list(ids[len(req.prompt_ids):]))
            new, lps = [], []
            while not seq.done():
                (g,) = await engine.generate([seq], 3)
                seq.token_ids += g.token_ids
                new += g.token_ids
                lps += g.logprobs
                if g.finished:
                    break
            return (new, lps)

        res = await runner.run(generate, req.request_id, json.loads(spec.row))
        n = res.prompt_len
        out[req.request_id] = (res.token_ids[n:], [bool(m) for m in res.mask[n:]],
                               np.asarray(res.logprobs[n:], dtype=np.float32).tolist(), res.messages)
    return out


# ---------------------------------------------------------------- worker processes


async def serve(nats_url: str, redis_url: str, pool: str, worker_id: str, rows_file: str, token_s: float,
                counters: str, k: int, inline: bool = True) -> None:
    """One worker process: the scripted engine, calculator episodes (tools inline, or sent to the
    environment pool), crash-proof counters."""
    from rlboost.workers.counters import Counters
    from rlboost.workers.engines.scripted import ScriptedEngine
    from rlboost.workers.worker import RolloutWorker

    with open(rows_file, encoding="utf-8") as f:
        rows = json.load(f)
    engine = ScriptedEngine(tokenizer(), solver(rows), token_s=token_s)
    settings = WorkerSettings(pool=pool, slots=4, checkpoint_tokens=k, ack_wait_s=3.0, lease_ttl_s=1.5,
                              heartbeat_s=0.2)
    async with open_clients(nats_url, redis_url, f"chaos-episodes-{worker_id}") as c:
        worker = RolloutWorker(settings, engine, c, worker_id=worker_id, counters=Counters(counters),
                               env=EnvSettings(ref=ENV_REF, inline=inline))
        worker.install_signal_handlers()
        await worker.run()
        await worker.settled()


async def serve_env(nats_url: str, redis_url: str, worker_id: str, counters: str) -> None:
    """One environment worker process: the counting calculator's tool calls."""
    from rlboost.workers.counters import Counters
    from rlboost.workers.env_worker import EnvWorker

    settings = WorkerSettings(ack_wait_s=3.0, lease_ttl_s=1.5, heartbeat_s=0.2, drain_grace_s=10.0)
    async with open_clients(nats_url, redis_url, f"chaos-episodes-{worker_id}") as c:
        worker = EnvWorker(settings, EnvSettings(ref=ENV_REF, inline=False), c, worker_id=worker_id,
                           counters=Counters(counters), tokenizer=tokenizer())
        worker.install_signal_handlers()
        await worker.run()


class Fleet:
    def __init__(self, nats_url: str, redis_url: str, workdir: Path, rows_file: Path, token_s: float, k: int,
                 env_pool: bool = False):
        self.args = (nats_url, redis_url, POOL)
        self.workdir, self.rows_file, self.token_s, self.k = workdir, rows_file, token_s, k
        self.env_pool = env_pool
        self.procs: dict[str, subprocess.Popen] = {}
        self.fate: dict[str, str] = {}
        self.kind: dict[str, str] = {}  # gen | env

    def start(self, kind: str = "gen") -> str:
        wid = f"ep-{'w' if kind == 'gen' else 'e'}{len(self.procs)}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RLBOOST_LOG_JSON": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                              os.environ.get("PYTHONPATH", "")])}
        log = open(self.workdir / f"{wid}.log", "w")
        if kind == "gen":
            cmd = ["serve", *self.args, wid, str(self.rows_file), str(self.token_s), str(self.counters(wid)),
                   str(self.k), "pool" if self.env_pool else "inline"]
        else:
            cmd = ["serve-env", *self.args[:2], wid, str(self.counters(wid))]
        self.procs[wid] = subprocess.Popen([sys.executable, "-m", "rlboost.benchmarks.chaos_episodes", *cmd],
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        self.fate[wid], self.kind[wid] = "running", kind
        return wid

    def counters(self, wid: str) -> Path:
        return self.workdir / f"{wid}.counters"

    def generated(self, wid: str) -> int:
        from rlboost.workers.counters import read_counters

        path = self.counters(wid)
        return read_counters(path)["generated"] if path.exists() else 0

    def live(self, kind: str = "gen") -> list[str]:
        return [w for w, p in self.procs.items() if p.poll() is None and self.fate[w] == "running"
                and self.kind[w] == kind]

    def ready(self, kind: str = "gen") -> list[str]:
        """Live workers that have opened their counters (past their imports: seconds on a loaded box)."""
        return [w for w in self.live(kind) if self.counters(w).exists()]

    def signal(self, wid: str, sig: signal.Signals) -> None:
        self.fate[wid] = "killed" if sig == signal.SIGKILL else "terminated"
        self.procs[wid].send_signal(sig)

    def stop_all(self, timeout: float = 30.0) -> None:
        for w, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---------------------------------------------------------------- the run


async def _holder(c, rid: str) -> str:
    last = await c.store.redis.lrange(wire.ckpt_history_key(rid), -1, -1)
    return parse_segment(last[0]).worker_id if last else ""


async def _target(c, reqs, done: set[str], log: str, phase: str, live: list[str]) -> tuple[str, str] | None:
    """(request id, holding worker) of an episode in `phase` (gen: a model turn under way;
    tool: a pending call that started) held by a live worker, if one is now."""
    started = set(calls(log))
    order = list(reqs)
    random.shuffle(order)
    for q in order:
        if q.request_id in done:
            continue
        state = await c.store.episode(q.request_id)
        if state is None or state.done:
            continue
        if phase == "tool":
            hit = bool(state.pending) and state.pending[0].key in started
        else:
            tokens, _ = await c.store.read(q.request_id)
            hit = not state.pending and len(tokens) > state.at + 1
        if hit and (w := await _holder(c, q.request_id)) in live:
            return q.request_id, w
    return None


async def run(a: argparse.Namespace, nats_url: str, redis_url: str, workdir: Path) -> dict:
    rng = random.Random(a.seed)
    random.seed(a.seed)
    step = int(time.time()) % 90000
    rows = calculator.rows("train", a.episodes, seed=a.seed)
    rows_file = workdir / "rows.json"
    rows_file.write_text(json.dumps(rows))
    log = str(workdir / "tool-calls.log")
    reqs = await make_requests(step, rows, log, a.tool_s)
    ref = await reference(reqs, rows, str(workdir / "reference-calls.log"))
    pool_mode = getattr(a, "env_pool", False)
    fleet = Fleet(nats_url, redis_url, workdir, rows_file, a.token_s, a.k, env_pool=pool_mode)
    env_workers = getattr(a, "env_workers", 2) if pool_mode else 0
    actions: list[dict] = []
    running_at_kill = 0  # for the record: pending calls started, of the episodes a killed worker held, per kill
    held_at_kill = 0
    async with open_clients(nats_url, redis_url, "rlboost-chaos-episodes", pools=(POOL,)) as c:
        try:
            for _ in range(a.workers):
                fleet.start()
            for _ in range(env_workers):
                fleet.start("env")
            deadline = time.time() + a.timeout
            while ((len(fleet.ready()) < a.workers or len(fleet.ready("env")) < env_workers)
                   and time.time() < deadline):
                await asyncio.sleep(0.1)  # the episodes start when the workers are up
            acks = [await c.js.publish_async(wire.request_subject(POOL), wire.encode(r),
                                             headers={wire.HDR_MSG_ID: r.request_id}) for r in reqs]
            await asyncio.gather(*acks)
            sub = await bus.follow(c.js, wire.result_subject(step))
            done: set[str] = set()
            plan: list[str] = []
            t0 = time.time()
            next_action = t0 + a.every
            while len(done) < len(reqs) and time.time() - t0 < a.timeout:
                try:
                    msg = await sub.next_msg(timeout=0.05)
                    done.add(wire.decode(wire.RolloutResult, msg.data).request_id)
                    continue
                except TimeoutError:
                    pass
                if time.time() < next_action or len(done) >= len(reqs) * a.chaos_until or len(actions) >= a.actions:
                    continue
                if not plan:
                    plan = ["kill-gen", "kill-tool", "term"] + (["term-env"] if pool_mode else [])
                    rng.shuffle(plan)
                kind = plan[-1]
                phase = ("tool" if kind in ("kill-tool", "term-env") else "gen" if kind == "kill-gen" or pool_mode
                         else rng.choice(["gen", "tool"]))
                victims = "env" if pool_mode and phase == "tool" else "gen"
                live = fleet.ready(victims)
                if len(live) < 2:
                    continue  # keep a worker of its kind serving beside the victim
                hit = await _target(c, reqs, done, log, phase, live)
                if hit is None:
                    continue  # try again on the next turn of the loop
                plan.pop()
                rid, wid = hit
                if kind in ("term", "term-env"):
                    fleet.signal(wid, signal.SIGTERM)
                else:
                    fleet.signal(wid, signal.SIGKILL)
                    fleet.procs[wid].wait(10)
                    started = {key for key, pid in runs(log) if pid == fleet.procs[wid].pid}  # final: it is dead
                    for q in reqs:
                        if q.request_id in done or await _holder(c, q.request_id) != wid:
                            continue
                        state = await c.store.episode(q.request_id)
                        if state is not None and not state.done:
                            held_at_kill += 1
                            running_at_kill += sum(1 for p in state.pending if p.key in started)
                actions.append({"kind": kind, "phase": phase, "worker": wid, "request": rid,
                                "t": round(time.time() - t0, 3)})
                fleet.start(victims)
                next_action = time.time() + rng.uniform(0.5, 1.5) * a.every
            elapsed = time.time() - t0
            await sub.unsubscribe()
        finally:
            fleet.stop_all()
        results = await read_subject(c.js, wire.result_subject(step), wire.RolloutResult)
    return analyse(reqs, rows, ref, results, runs(log), fleet, actions, running_at_kill, held_at_kill, a.k, elapsed)


def analyse(reqs, rows, ref, results, log_runs: list[tuple[str, int]], fleet: Fleet, actions,
            running_at_kill: int, held_at_kill: int, k: int, elapsed: float) -> dict:
    by_rid: dict[str, list[wire.RolloutResult]] = defaultdict(list)
    for r in results:
        by_rid[r.request_id].append(r)
    mismatched, attributed = 0, Counter()
    for q in reqs:
        for r in by_rid.get(q.request_id, [])[:1]:
            tokens, mask, lps, messages = ref[q.request_id]
            snap = episodes.snapshot(r.episode) if r.episode is not None else None
            if (r.finish_reason != "stop" or r.token_ids != tokens or r.logprobs != lps or snap is None
                    or wire.trainable_mask(r.segments, len(r.token_ids)) != mask or snap.messages != messages):
                mismatched += 1
            segs = sorted(r.segments, key=lambda s: s.offset)
            ends = [s.offset for s in segs[1:]] + [len(r.token_ids)]
            for s, end in zip(segs, ends, strict=True):
                if s.kind == "model":
                    attributed[s.worker_id] += end - s.offset
    regenerated: Counter = Counter()
    for wid, fate in fleet.fate.items():
        regenerated[fate] += fleet.generated(wid) - attributed[wid]
    ran = Counter(key for key, _ in log_runs)
    expected = sum(len(row["steps"]) for row in rows)
    kept = {c.key: c.worker_id for q in reqs for r in by_rid.get(q.request_id, [])[:1] if r.episode
            for c in r.episode.calls}
    keys = set(kept)
    fate_of_pid = {p.pid: fleet.fate[w] for w, p in fleet.procs.items()}
    wid_of_pid = {p.pid: w for w, p in fleet.procs.items()}
    after_kill = unexplained = 0
    for key, pid in log_runs:  # every run of a key but the one whose result the episode kept
        if wid_of_pid.get(pid) == kept.get(key):
            kept[key] = ""  # that worker's (last) run is the kept one; once
            continue
        if fate_of_pid.get(pid) == "killed":
            after_kill += 1
        else:
            unexplained += 1
    kinds = Counter(x["kind"] for x in actions)
    out = {
        "episodes": len(reqs), "completed": sum(1 for q in reqs if by_rid.get(q.request_id)),
        "lost": sum(1 for q in reqs if not by_rid.get(q.request_id)),
        "duplicated": sum(len(v) - 1 for v in by_rid.values()), "mismatched": mismatched,
        "kills_during_generation": kinds["kill-gen"], "kills_during_tool_call": kinds["kill-tool"],
        "terms": kinds["term"], "terms_of_env_workers": kinds["term-env"], "env_pool": fleet.env_pool,
        "workers_started": len(fleet.procs),
        "tool_calls_expected": expected, "tool_call_keys": len(keys), "tool_calls_run": sum(ran.values()),
        "tool_calls_rerun": sum(n - 1 for n in ran.values()), "tool_calls_rerun_after_kill": after_kill,
        "tool_calls_rerun_unexplained": unexplained, "tool_calls_running_at_kill": running_at_kill,
        "tool_keys_never_run": len(keys - set(ran)),
        "episodes_held_at_kill": held_at_kill, "checkpoint_tokens": k,
        "regenerated_tokens_term": regenerated["terminated"], "regenerated_tokens_kill": regenerated["killed"],
        "regenerated_tokens_undisturbed": regenerated["running"],
        "tokens": sum(len(v[0].token_ids) for v in by_rid.values()), "seconds": round(elapsed, 1),
        "actions": actions,
    }
    out["ok"] = ok(out)
    return out


def ok(out: dict) -> bool:
    return (out["lost"] == out["duplicated"] == out["mismatched"] == 0 and out["completed"] == out["episodes"]
            and out["tool_call_keys"] == out["tool_calls_expected"] and out["tool_keys_never_run"] == 0
            and out["tool_calls_rerun"] == out["tool_calls_rerun_after_kill"]
            and out["tool_calls_rerun_unexplained"] == 0
            and out["regenerated_tokens_term"] == 0 and out["regenerated_tokens_undisturbed"] == 0
            and 0 <= out["regenerated_tokens_kill"] <= out["checkpoint_tokens"] * out["episodes_held_at_kill"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--episodes")
    g.add_argument("--tool-s", type=float, default=0.4, help="episodes: seconds each tool call takes")
    g.add_argument("--token-s", type=float, default=0.02, help="episodes: seconds per scripted engine step")
    g.add_argument("--actions", type=int, default=6,
                   help="episodes: chaos actions at most (kill-gen, kill-tool, term; term-env with --env-pool)")
    g.add_argument("--env-pool", action="store_true",
                   help="episodes: tool calls on environment worker processes (env.inline = false)")
    g.add_argument("--env-workers", type=int, default=2, help="episodes, --env-pool: environment workers")


def bench(a: argparse.Namespace, s: Settings) -> int:
    """`rlboost bench chaos --episodes` (benchmarks/chaos.py parses its arguments)."""
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-chaos-")
    workdir = Path(tempfile.mkdtemp(prefix="rlboost-chaos-episodes-"))
    with running_services(s.services) as (nats_url, redis_url):
        out = asyncio.run(run(a, nats_url, redis_url, workdir))
    where = " (tools on the environment pool)" if out["env_pool"] else ""
    print(f"{out['episodes']} episodes{where}, {out['kills_during_generation']} SIGKILL during generation, "
          f"{out['kills_during_tool_call']} during a tool call, {out['terms']} + {out['terms_of_env_workers']} "
          f"SIGTERM in {out['seconds']} s: "
          f"completed {out['completed']}, lost {out['lost']}, duplicated {out['duplicated']}, mismatched "
          f"{out['mismatched']}; tool calls {out['tool_calls_run']} for {out['tool_call_keys']} keys (re-run "
          f"{out['tool_calls_rerun']}: {out['tool_calls_rerun_after_kill']} after a SIGKILL during the call, "
          f"{out['tool_calls_rerun_unexplained']} otherwise); regenerated: term "
          f"{out['regenerated_tokens_term']}, kill {out['regenerated_tokens_kill']} (bound {out['checkpoint_tokens']} x "
          f"{out['episodes_held_at_kill']} held)  -> {'OK' if out['ok'] else 'INVARIANT VIOLATED'}  "
          f"(worker logs: {workdir})")
    return report.finish("chaos", out, report.out_dir(a), ok=out["ok"])


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    nats, redis, pool, wid, rows_file, token_s, counters, k, where = sys.argv[2:11]
    asyncio.run(serve(nats, redis, pool, wid, rows_file, float(token_s), counters, int(k), inline=where == "inline"))
elif __name__ == "__main__" and sys.argv[1:2] == ["serve-env"]:
    nats, redis, wid, counters = sys.argv[2:6]
    asyncio.run(serve_env(nats, redis, wid, counters))
