"""Agent harness sessions through a run's endpoint (`rlboost run --harness`): sessions/s, and what a harness that is killed or hangs costs.

The path measured is the harness task's own (`rlboost.trainer.harness_task.HarnessRunner.play`,
what each step of `rlboost run --harness` does): the run's endpoint started for the batch,
`sessions` harness processes (this module run with `--as-harness`: stdlib HTTP, `turns` calls
of `tokens` tokens each, then its reward), each session bound to one step, every call a
checkpointed request on an emulated worker at unlimited speed, verified and recorded. So what
the figures hold is process start, HTTP, the chat template, the dataflow around each call and
the session records: a real engine's generation comes on top. Three arms on the same sessions:

- `clean`: every session is kept;
- `killed`: the first session SIGKILLs itself after its first call (a harness that dies
  mid-session): it is lost, the others kept; the cost is its calls (generated, not trained);
- `hung`: the first session hangs after its first call until `harness.session_timeout_s`
  (`--hang-timeout`) kills its process group: the batch waits for it, so the cost is the wall
  time past the clean arm's, bounded by the timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlboost.config import Settings

# The harness processes run this file by its path (`--as-harness`): nothing above imports more
# than the standard library, so a process starts in tens of milliseconds, as a light harness
# would (importing the trainer's modules, torch among them, took seconds per process).

POOL = "bench-harness"
STEP = 7
ARMS = ("clean", "killed", "hung")
CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate an arithmetic expression",
                                         "parameters": {"type": "object", "required": ["expression"],
                                                        "properties": {"expression": {"type": "string"}}}}}


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def as_harness(turns: int, tokens: int) -> int:
    """One session, as `rlboost run --harness` starts it: its calls, then its reward. BENCH_FAULT
    (killed / hung) makes it fail after its first call."""
    row = json.loads(os.environ["RLBOOST_TASK"])
    messages = [{"role": "user", "content": f"{row['a']} + {row['b']} = ?"}]
    for turn in range(turns):
        r = _post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
                  {"model": "m", "messages": messages, "max_tokens": tokens, "tools": [CALC]})
        messages += [{"role": "assistant", "content": r["choices"][0]["message"]["content"] or ""},
                     {"role": "user", "content": "more"}]
        fault = os.environ.get("BENCH_FAULT", "")
        if turn == 0 and fault == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if turn == 0 and fault == "hung":
            time.sleep(3600)  # until the run's session timeout kills it
    _post(os.environ["RLBOOST_REWARD_URL"], {"reward": 1.0})
    return 0


async def run(nats_url: str, redis_url: str, sessions: int = 16, turns: int = 3, tokens: int = 16,
              concurrency: int = 0, hang_timeout_s: float = 5.0, work: str = "") -> dict:
    """Each arm on `sessions` sessions of `turns` calls; returns the figures per arm."""
    from rlboost.clients import open_clients
    from rlboost.config import WorkerSettings
    from rlboost.envs import calculator as calc
    from rlboost.trainer.model import build_tokenizer
    from rlboost.workers.counters import Counters
    from rlboost.workers.engines.emulated import EmulatedEngine, LengthModel
    from rlboost.workers.worker import RolloutWorker

    work_dir = Path(work or tempfile.mkdtemp(prefix="rlboost-bench-harness-"))
    tok = build_tokenizer(calc.ALPHABET)
    out: dict = {"sessions": sessions, "turns": turns, "tokens_per_call": tokens}
    async with open_clients(nats_url, redis_url, "rlboost-bench-harness", pools=(POOL,)) as c:
        engine = EmulatedEngine(speed=0, vocab=len(tok), lengths=LengthModel(median=1e9))
        worker = RolloutWorker(WorkerSettings(pool=POOL, slots=max(32, sessions)), engine, c,
                               worker_id=f"{POOL}-w0", counters=Counters())
        wtask = asyncio.create_task(worker.run())
        try:
            for arm in ARMS:
                out[arm] = await _arm(arm, c, tok, work_dir / arm, sessions, turns, tokens, concurrency,
                                      hang_timeout_s)
        finally:
            worker.request_drain("bench over")
            await wtask
            await RolloutWorker.settled()
    clean = out["clean"]["wall_s"]
    out["killed_extra_s"] = round(out["killed"]["wall_s"] - clean, 2)
    out["hung_extra_s"] = round(out["hung"]["wall_s"] - clean, 2)
    return out


async def _arm(arm: str, c, tok, run_dir: Path, sessions: int, turns: int, tokens: int, concurrency: int,
               hang_timeout_s: float) -> dict:
    from rlboost.config import Settings
    from rlboost.endpoint import read_session
    from rlboost.trainer.harness_task import HarnessRunner, Spec

    s = Settings()
    s.harness.command = f"{sys.executable} {Path(__file__).resolve()} --as-harness --turns {turns} --tokens {tokens}"
    s.harness.concurrency = concurrency or sessions
    s.harness.session_timeout_s = hang_timeout_s if arm == "hung" else 600.0
    s.harness.kill_grace_s = 0.5
    runner = HarnessRunner(s, c, tok, [tok.eos_token_id], 0, run_dir, pool=POOL)
    specs = [Spec(session=f"{arm}-{i:04d}", row={"a": i, "b": 2 * i}, step=STEP, group=i // 4, run=f"bh{arm}{i}")
             for i in range(sessions)]
    if arm != "clean":  # the first session fails after its first call; how is the harness's own business
        os.environ["BENCH_FAULT_SESSION"] = specs[0].session
    t0 = time.perf_counter()
    outcomes = await runner.play(specs, 0)
    wall = time.perf_counter() - t0
    os.environ.pop("BENCH_FAULT_SESSION", None)
    kept = [o for o in outcomes if not o.lost]
    lost = [o for o in outcomes if o.lost]
    wasted = sum(len(read_session(p).calls) for o in lost
                 if (p := run_dir / "sessions" / f"{o.spec.session}.jsonl").exists())
    return {"wall_s": round(wall, 2), "sessions_per_s": round(len(kept) / wall, 2),
            "calls_per_s": round(sum(len(o.requests) for o in kept) / wall, 1), "kept": len(kept), "lost": len(lost),
            "lost_reasons": sorted({o.lost for o in lost}), "calls_lost": wasted}


def main(argv: list[str], s: Settings | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench agent-harness", description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=0, help="harness processes at once (0: all)")
    p.add_argument("--hang-timeout", type=float, default=5.0, help="harness.session_timeout_s of the hung arm")
    p.add_argument("--as-harness", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.as_harness:
        if os.environ.get("BENCH_FAULT_SESSION") == os.environ.get("RLBOOST_SESSION"):
            os.environ["BENCH_FAULT"] = Path(os.environ["RLBOOST_SESSION"]).name.split("-")[0]
        return as_harness(a.turns, a.tokens)
    from rlboost.config import Settings
    from rlboost.services import running_services

    s = s or Settings()
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-bench-")
    with running_services(s.services) as (nats_url, redis_url):
        out = asyncio.run(run(nats_url, redis_url, a.sessions, a.turns, a.tokens, a.concurrency, a.hang_timeout))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":  # a harness process of the bench (`--as-harness`)
    sys.exit(main(sys.argv[1:]))
