"""The reward: a user's function, run in a process pool with a per-call timeout.

`--reward` names a function as `module:fn`, `path/to/file.py:fn`, or a built-in task's name
(`addition`, `math`), loaded by `rlboost.plugins` (the same loader as `--env`). Two shapes are accepted, told apart by parameter names:

- per sample, verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`;
  any subset of those names (and `prompt`, `finish_reason`) works, as keywords;
- per batch, TRL's `reward_funcs(prompts, completions, **columns)`: lists, one entry per
  response of a group; the columns are `ground_truth`, `data_source`, `finish_reason` and the
  dataset's other columns. Conversational data gives TRL's conversational shapes (prompts as
  message lists, completions as `[{"role": "assistant", "content": ...}]`).

Every call also gets the finish reason (`stop` / `length`) where it asks for it (a
`finish_reason` parameter, `**kwargs`, or verl's `extra_info["finish_reason"]`), so a truncated
response can be penalised. A function may return a number, a bool, None (0) or verl's
`{"score": x, ...}`.

Rewards run off the trainer's critical path, in worker processes that import the function
themselves (nothing but plain data crosses the pipe): a call that raises, returns something
that is not a number, or runs past `timeout_s` scores 0, is counted (`errors`, `timeouts`)
and logged; a process stuck past its timeout is killed and replaced. A reward never crashes
the run.
"""

from __future__ import annotations

import inspect
import math
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from rlboost import plugins
from rlboost.errors import RlboostError
from rlboost.logs import get_logger

BUILTIN = {"addition": "rlboost.trainer.builtin_rewards:addition_score", "math": "rlboost.trainer.builtin_rewards:math_score"}
SAMPLE_PARAMS = {"data_source", "solution_str", "ground_truth", "extra_info", "prompt", "finish_reason", "answer"}


class RewardError(RlboostError, ValueError):
    """A reward spec that does not name a usable function (one line, says why)."""


def resolve(spec: str) -> str:
    return plugins.resolve(spec, BUILTIN)


def load_function(spec: str) -> Callable:
    fn = plugins.load(spec, what="reward", builtins=BUILTIN, error=RewardError)
    shape(fn, resolve(spec))
    return fn


def shape(fn: Callable, spec: str = "") -> str:
    """'batch' (TRL: prompts, completions, **columns) or 'sample' (verl: compute_score)."""
    params = inspect.signature(fn).parameters
    if "completions" in params or "prompts" in params:
        return "batch"
    named = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    required = {n for n in named if params[n].default is inspect.Parameter.empty}
    if named - SAMPLE_PARAMS and required - SAMPLE_PARAMS:
        raise RewardError(f"reward {spec or fn.__name__}{inspect.signature(fn)}: name the parameters like verl's "
                          "compute_score(data_source, solution_str, ground_truth, extra_info) or TRL's "
                          "(prompts, completions, **columns)")
    return "sample"


@dataclass
class Item:
    """One response to score: plain data, pickled to the reward process."""

    prompt: str | list[dict]
    response: str
    ground_truth: str
    data_source: str
    finish_reason: str
    extra: dict
    chat: bool = False


def _number(value) -> float:
    if isinstance(value, dict):
        value = value.get("score")
    if value is None:
        return 0.0
    x = float(value)
    if math.isnan(x):
        raise ValueError("reward is NaN")
    return x


def call(fn: Callable, items: list[Item]) -> list[float]:
    """Call `fn` in its shape on `items`: a batch call, or one call per item."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())

    def pick(available: dict) -> dict:
        return available if takes_all else {k: v for k, v in available.items() if k in params}

    if shape(fn) == "batch":
        columns: dict = {"ground_truth": [i.ground_truth for i in items], "data_source": [i.data_source for i in items],
                         "finish_reason": [i.finish_reason for i in items]}
        for key in {k for i in items for k in i.extra}:
            columns.setdefault(key, [i.extra.get(key) for i in items])
        completions = [[{"role": "assistant", "content": i.response}] if i.chat else i.response for i in items]
        out = fn(**pick({"prompts": [i.prompt for i in items], "completions": completions, **columns}))
        values = list(out)
        if len(values) != len(items):
            raise ValueError(f"returned {len(values)} rewards for {len(items)} completions")
        return [_number(v) for v in values]
    return [_number(fn(**pick({"data_source": i.data_source, "solution_str": i.response, "ground_truth": i.ground_truth,
                               "extra_info": {**i.extra, "finish_reason": i.finish_reason, "prompt": i.prompt},
                               "prompt": i.prompt, "finish_reason": i.finish_reason, "answer": i.ground_truth})))
            for i in items]


def _serve(spec: str, conn: Connection) -> None:
    """A reward process: load the function once, then score jobs until the pipe closes."""
    try:
        fn = load_function(spec)
    except Exception as e:
        conn.send(("dead", repr(e)))
        return
    conn.send(("ready", ""))
    while True:
        try:
            items = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", call(fn, items)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


@dataclass
class Scored:
    values: list[float]
    errors: int = 0
    timeouts: int = 0


class _Proc:
    def __init__(self, ctx, spec: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(spec, child), daemon=True, name="rlboost-reward")
        self.proc.start()
        child.close()
        self.ready = False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    """`workers` reward processes; `score` (blocking, thread-safe) or `ascore` (asyncio)."""

    def __init__(self, spec: str, workers: int = 2, timeout_s: float = 10.0) -> None:
        self.spec = resolve(spec)
        fn = load_function(self.spec)  # a bad spec fails here, in one line, not in a child
        self.batch = shape(fn, self.spec) == "batch"
        self.timeout_s = timeout_s
        self.errors = self.timeouts = 0
        self._ctx = multiprocessing.get_context("spawn")  # no fork of a threaded trainer process
        self._procs = [_Proc(self._ctx, self.spec) for _ in range(max(1, workers))]
        self._lock = threading.Lock()
        self._closed = False
        self.log = get_logger(component="reward", reward=self.spec)

    def score(self, items: list[Item], ids: list[str] | None = None) -> Scored:
        """One reward per item, in order. A batch function gets all items in one call; a
        per-sample one, one call per item, spread over the processes."""
        if self._closed:
            raise RuntimeError(f"reward pool {self.spec} is closed: nothing can be scored after close()")
        if not items:
            return Scored(values=[])
        ids = ids or [str(i) for i in range(len(items))]
        jobs = [list(range(len(items)))] if self.batch else [[i] for i in range(len(items))]
        values = [0.0] * len(items)
        out = Scored(values=values)
        with self._lock:
            pending = list(reversed(jobs))
            busy: dict[int, tuple[list[int], float]] = {}  # proc index -> (job, deadline)
            while pending or busy:
                for k, p in enumerate(self._procs):
                    if pending and k not in busy:
                        job = pending.pop()
                        try:
                            p.conn.send([items[i] for i in job])
                        except (OSError, ValueError) as e:  # the process died between jobs (OOM-killed...)
                            out.errors += len(job)
                            self.log.warning("reward process gone: scored 0", requests=[ids[i] for i in job],
                                             error=repr(e))
                            self._replace(k)
                            continue
                        # a fresh process's start-up (imports) is not the function's time
                        busy[k] = (job, time.monotonic() + self.timeout_s + (0 if p.ready else 60.0))
                if not busy:  # every send of this pass failed: the replacements take the rest
                    continue
                ready = wait([self._procs[k].conn for k in busy],
                             timeout=max(0.0, min(d for _, d in busy.values()) - time.monotonic()))
                now = time.monotonic()
                for k in list(busy):
                    p, (job, deadline) = self._procs[k], busy[k]
                    if p.conn in ready:
                        try:
                            kind, payload = p.conn.recv()
                        except (EOFError, OSError):
                            kind, payload = "dead", "the reward process exited"
                        if kind == "ready":  # started: the job's own clock starts now
                            p.ready = True
                            busy[k] = (job, time.monotonic() + self.timeout_s)
                            continue
                        del busy[k]
                        if kind == "ok":
                            for i, v in zip(job, payload, strict=True):
                                values[i] = v
                            continue
                        out.errors += len(job)
                        self.log.warning("reward failed: scored 0", requests=[ids[i] for i in job], error=payload)
                        if kind == "dead":
                            self._replace(k)
                    elif now >= deadline:
                        del busy[k]
                        out.timeouts += len(job)
                        self.log.warning("reward timed out: scored 0", requests=[ids[i] for i in job],
                                         timeout_s=self.timeout_s)
                        self._replace(k)
        self.errors += out.errors
        self.timeouts += out.timeouts
        return out

    async def ascore(self, items: list[Item], ids: list[str] | None = None) -> Scored:
        import asyncio

        return await asyncio.to_thread(self.score, items, ids)

    def _replace(self, k: int) -> None:
        self._procs[k].kill()
        self._procs[k] = _Proc(self._ctx, self.spec)

    def close(self) -> None:
        self._closed = True
        for p in self._procs:
            p.kill()
