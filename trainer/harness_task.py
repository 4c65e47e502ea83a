"""`rlboost run --harness CMD`: a run's task whose episodes are played by an agent harness of the
user's own, a program that speaks the OpenAI chat-completions API, through the run's endpoint.

The same `DataTask` as prompts and episodes, with other parts (`rlboost.trainer.data_task`):

- **requests** (`HarnessSource`): a step's `groups` rows, `rollout.samples` sessions each. For
  the draw the run starts its OpenAI-compatible endpoint (rlboost/endpoint/, in this process, on
  `harness.host`, a free port unless `harness.port`) and one harness process per session
  (`rlboost.trainer.harness_launcher`), each with `OPENAI_BASE_URL`, `OPENAI_API_KEY` (its
  session's own key: the endpoint pins its calls and its reward to that session),
  `RLBOOST_SESSION`, `RLBOOST_REWARD_URL` and its row as JSON in `RLBOOST_TASK`. Each session
  is bound to the step (`OpenAIEndpoint.bind`): its calls are requests of this step, in its
  row's GRPO group, under the version the step trains, checkpointed and verified like any
  other. The draw returns once every process has ended (or was killed at
  `harness.session_timeout_s`) with the requests of the calls of the sessions kept; the
  orchestrator then collects the step's results as for any request: they are on the step's
  results subject already (its second publish of them finds each checkpoint finished, and the
  worker that takes it publishes the result again, which the stream drops).
- **a session is kept** when its process exited 0 after reporting a reward
  (`POST .../reward`) and made at least one call the engine served. Any other (killed, hung
  past the timeout, a non-zero exit, no reward, no call) is **lost**: logged with the end of
  its output, counted in the step row (`harness_lost`), and its calls are not trained; its
  group trains on the sessions left. A step that loses every session fails with the last one's
  output (a harness command that cannot work: not a run that trains on nothing).
- **scores** (`HarnessScorer`): each call of a session gets the session's reward (a group's
  advantages are over its calls: a session of many calls weighs more than one of few, as
  docs/guides/agent-harnesses.md says of training on sessions).
- **held-out evaluation** (`HarnessEvaluation`): one session per held-out row, with
  `RLBOOST_EVAL=1` (the harness may sample greedily), at the endpoint's own step
  (`endpoint.step`), under the latest version; `eval_acc` is the mean reward of the sessions
  kept (`eval_harness_lost` counts the others).

What is durable: the model's turns (checkpointed tokens, resumed on any worker; the session
file). What is not: the harness's own state. A harness process that dies loses its session,
never the step, and the run starts no second copy of it.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rlboost import wire
from rlboost.clients import Clients
from rlboost.config import HarnessSettings, Settings
from rlboost.endpoint import OpenAIEndpoint, read_session
from rlboost.envs.chat import chat_format
from rlboost.errors import RlboostError
from rlboost.logs import get_logger
from rlboost.orchestrator import Evaluated, GroupKey, GroupScores
from rlboost.trainer.data import DataError, DataExhausted
from rlboost.trainer.harness_launcher import Exit, Launch, Launcher
from rlboost.trainer.request_source import RequestSource


class HarnessError(RlboostError):
    """The harness command lost every session of a step: it cannot work as given."""


@dataclass
class Spec:
    """One session to play: its id, its row, where its calls go (step, group) and the run part
    of its request ids."""

    session: str
    row: Any
    step: int
    group: int
    run: str


@dataclass
class Outcome:
    """A session played: kept (its reward and the requests of its calls) or lost (why)."""

    spec: Spec
    reward: float | None = None
    metrics: dict = field(default_factory=dict)  # what the harness reported beside its reward
    requests: list[wire.RolloutRequest] = field(default_factory=list)
    lost: str = ""  # why it is not trained ("" = kept)


class HarnessRunner:
    """Plays sessions: the run's endpoint for the duration of a batch of them, one harness
    process per session, and what each session's file says once its process ended."""

    def __init__(self, hs: Settings, clients: Clients, tokenizer, stops: list[int], context: int, run_dir: Path,
                 *, pool: str) -> None:
        self.h: HarnessSettings = hs.harness
        self.clients, self.tokenizer, self.stops, self.context = clients, tokenizer, stops, context
        self.run_dir = Path(run_dir)
        self.cfg = msgspec.structs.replace(hs.endpoint, host=self.h.host, port=self.h.port, pool=pool,
                                           run_dir=str(self.run_dir))
        self.fmt = chat_format(tokenizer)
        self.token = secrets.token_urlsafe(24)  # the endpoint's own; each harness gets its session's key
        # 0: as many as a step has sessions (a held-out set larger than that waits its turn)
        at_once = self.h.concurrency or hs.rollout.prompts * hs.rollout.samples
        self.launcher = Launcher(self.h.command, self.run_dir / "harness", concurrency=at_once,
                                 timeout_s=self.h.session_timeout_s, grace_s=self.h.kill_grace_s)
        self.log = get_logger(component="harness")

    async def play(self, specs: list[Spec], version: int | None, evaluation: bool = False) -> list[Outcome]:
        """Every session of `specs` played to its end (`version` None: the latest published)."""
        if not specs:
            return []
        ep = OpenAIEndpoint(self.clients, self.cfg, self.tokenizer, self.stops, self.run_dir, token=self.token,
                            max_context=self.context, fmt=self.fmt, bindable=True)
        host, port = await ep.start()
        try:
            if version is None:
                version = await ep.dataflow.policy_version()
            base = f"http://{host}:{port}/v1"
            bindings = [ep.bind(sp.session, step=sp.step, group=sp.group, version=version, run=sp.run) for sp in specs]
            exits = await self.launcher.run([Launch(sp.session, self._env(sp, b.key, base, evaluation))
                                             for sp, b in zip(specs, bindings, strict=True)])
        finally:
            await ep.close()
        return [self._outcome(sp, b.recorded, x) for sp, b, x in zip(specs, bindings, exits, strict=True)]

    def _env(self, sp: Spec, key: str, base: str, evaluation: bool) -> dict[str, str]:
        """The run's environment without rlboost's own settings (RLBOOST_*: the servers' addresses,
        their passwords, tokens: a harness talks to the endpoint only), and the session's."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("RLBOOST_")}
        return {**inherited, "OPENAI_BASE_URL": base, "OPENAI_API_KEY": key, "RLBOOST_SESSION": sp.session,
                "RLBOOST_REWARD_URL": f"{base}/rlboost/sessions/{sp.session}/reward",
                "RLBOOST_TASK": json.dumps(sp.row, ensure_ascii=False, default=str),
                "RLBOOST_STEP": str(sp.step), "RLBOOST_EVAL": "1" if evaluation else "0"}

    def _outcome(self, sp: Spec, recorded: list[wire.RolloutRequest], x: Exit) -> Outcome:
        out = Outcome(sp)
        path = self.run_dir / "sessions" / f"{sp.session}.jsonl"
        try:
            if path.exists():
                session = read_session(path)
                out.reward, out.metrics = session.reward, session.metrics
        except Exception as e:  # a file the endpoint wrote cannot be bad; say so if it is
            out.lost = f"its session file does not read: {e}"
        if out.lost:
            pass
        elif x.returncode is None:
            out.lost = f"it did not start: {x.error}"
        elif x.timed_out:
            out.lost = f"it ran past harness.session_timeout_s ({self.h.session_timeout_s:g} s) and was killed"
        elif x.returncode != 0:
            signalled = -x.returncode if x.returncode < 0 else x.returncode - 128 if x.returncode > 128 else 0
            out.lost = f"it exited with {x.returncode}" + (f" (killed by signal {signalled})" if signalled else "")
        elif out.reward is None:
            out.lost = "it exited without reporting a reward (POST $RLBOOST_REWARD_URL)"
        elif not recorded:
            out.lost = "it made no call the engine served"
        if out.lost:
            self.log.warning("harness session lost", session=sp.session, reason=out.lost, log=str(x.log),
                             output=x.tail()[-600:] or None)
        else:
            out.requests = list(recorded)
        return out


@dataclass
class StepSessions:
    """A step's sessions: played, lost, the calls of the kept ones and the numeric metrics their
    harness reported with their rewards (summed, with how many reported each)."""

    sessions: int = 0
    lost: int = 0
    calls: int = 0
    metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count]

    def add(self, o: Outcome) -> None:
        self.sessions += 1
        if o.lost:
            self.lost += 1
            return
        self.calls += len(o.requests)
        for k, v in o.metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and len(self.metrics) < 64:
                acc = self.metrics.setdefault(str(k)[:64], [0.0, 0])
                acc[0] += v
                acc[1] += 1

    def merge(self, other: StepSessions) -> None:
        self.sessions, self.lost, self.calls = (self.sessions + other.sessions, self.lost + other.lost,
                                                self.calls + other.calls)
        for k, (total, n) in other.metrics.items():
            acc = self.metrics.setdefault(k, [0.0, 0])
            acc[0] += total
            acc[1] += n

    def row(self) -> dict:
        """The step row's fields; a harness's own metrics as `harness/<name>` (their mean)."""
        kept = self.sessions - self.lost
        return {"harness_sessions": self.sessions, "harness_lost": self.lost,
                "harness_calls_mean": round(self.calls / kept, 3) if kept else 0.0,
                **{f"harness/{k}": round(total / n, 4) for k, (total, n) in sorted(self.metrics.items())}}


class HarnessSource(RequestSource):
    """A step's requests: the calls of the sessions a harness played on the step's rows."""

    def __init__(self, data, runner: HarnessRunner, *, run_id: str, seed: int, samples: int, temperature: float,
                 life: str = "") -> None:
        super().__init__(data, run_id=run_id, seed=seed, samples=samples, temperature=temperature, life=life,
                         component="harness")
        self.runner = runner
        self.rewards: dict[str, float] = {}  # request id -> its session's reward, until scored
        self.steps: dict[int, StepSessions] = {}  # step -> its sessions, until its row is written

    async def _draw(self, step: int, version: int, groups: int, run: str) -> list[wire.RolloutRequest]:
        rows: list[Any] = []
        while len(rows) < groups:
            try:
                rows += self.data.next_batch(groups - len(rows))
            except DataExhausted:
                if rows:  # the last epoch's last, short batch
                    break
                raise
        # a draw's own tag: a resumed life that draws the step again plays new sessions, never
        # continuing (or colliding with) the requests of the old ones
        nonce = secrets.token_hex(2)
        specs = [Spec(session=f"{run}-s{step:05d}-p{p:05d}-k{k:03d}-{nonce}", row=row, step=step, group=p,
                      run=f"{run}-{nonce}k{k:03d}") for p, row in enumerate(rows) for k in range(self.samples)]
        for p, row in enumerate(rows):
            self._keep((step, p), row)
        self.log.info("harness sessions", step=step, rows=len(rows), sessions=len(specs), policy_version=version)
        outcomes = await self.runner.play(specs, version)
        stats = self.steps.setdefault(step, StepSessions())
        out: list[wire.RolloutRequest] = []
        for o in outcomes:
            stats.add(o)
            if o.lost:
                continue
            out += o.requests
            self.rewards.update((q.request_id, float(o.reward)) for q in o.requests)
        for p in set(range(len(rows))) - {q.group for q in out}:
            self._samples.pop((step, p), None)  # every session of the row was lost: no group to score
        if outcomes and not out:
            last = outcomes[-1]
            raise HarnessError(f"step {step}: every one of its {len(outcomes)} harness sessions was lost; the last "
                               f"one ({last.spec.session}) because {last.lost} (its output: "
                               f"{self.runner.run_dir / 'harness' / (last.spec.session + '.log')})")
        return out


class HarnessScorer:
    """A group's scores: each call its session's reward (the harness reported it)."""

    errors = timeouts = step_errors = step_timeouts = 0  # a harness's failures are lost sessions, not reward errors

    def __init__(self, source: HarnessSource) -> None:
        self.source = source

    async def group(self, row: Any, results: list[wire.RolloutResult]) -> GroupScores:
        return GroupScores(rewards=[self.source.rewards.pop(r.request_id, 0.0) for r in results])

    def begin_step(self) -> None:
        pass

    def step_fields(self, trained: list[tuple[GroupKey, list[wire.RolloutResult]]]) -> dict:
        """The sessions of the steps whose groups this step trained (async: drawn earlier)."""
        total = StepSessions()
        for step in sorted({key[0] for key, _ in trained}):
            got = self.source.steps.pop(step, None)
            if got is not None:
                total.merge(got)
        return total.row()

    def close(self) -> None:
        self.source.runner.launcher.kill_all()


class HarnessEvaluation:
    """Held-out: one session per held-out row (`RLBOOST_EVAL=1`), the mean reward of those kept."""

    def __init__(self, rows: list, runner: HarnessRunner, *, run_id: str, step: int, enabled: bool) -> None:
        self.rows, self.runner, self.run_id, self.step = rows, runner, run_id, step
        self.enabled = enabled
        self.n = 0

    async def evaluate(self) -> Evaluated | None:
        if not self.enabled or not self.rows:
            return None
        self.n += 1
        nonce = secrets.token_hex(2)
        specs = [Spec(session=f"{self.run_id}-eval{self.n:04d}-r{i:05d}-{nonce}", row=row, step=self.step, group=i,
                      run=f"{self.run_id}-e{self.n}{nonce}") for i, row in enumerate(self.rows)]
        outcomes = await self.runner.play(specs, None, evaluation=True)
        kept = [o.reward for o in outcomes if not o.lost]
        return Evaluated(accuracy=sum(kept) / len(kept) if kept else 0.0,
                         fields={"eval_harness_lost": len(outcomes) - len(kept)})


def harness_rows(s: Settings):
    """The rows harness sessions start from: `--data` (JSONL / Parquet / a datasets folder, one
    object per row; held out: `--eval-data` or a seeded fraction), else the `--env`'s own rows."""
    from rlboost.trainer.episodes.data import EpisodeData, make_episode_data

    ds = s.data
    if not ds.train and s.env.ref:
        return make_episode_data(s.env, ds, s.run.seed)
    if not ds.train:
        raise DataError("--harness needs rows to start its sessions from: --data FILE (JSONL / Parquet / a datasets "
                        "folder, one object per row), or an --env that has rows")
    return EpisodeData(None, "--harness", train=ds.train, eval_path=ds.eval, seed=s.run.seed, shuffle=ds.shuffle,
                       epochs=ds.epochs, eval_size=ds.eval_size, eval_fraction=ds.eval_fraction)


def harness_parts(s: Settings, data, tokenizer, stops: list[int], context: int, *, clients: Clients, run_dir: Path,
                  pool: str, run_id: str, life: str) -> tuple[HarnessSource, HarnessScorer, HarnessEvaluation]:
    """The task's three parts (`data_task.harness_task` makes the `DataTask` of them)."""
    runner = HarnessRunner(s, clients, tokenizer, stops, context, run_dir, pool=pool)
    source = HarnessSource(data, runner, run_id=run_id, seed=s.run.seed, samples=s.rollout.samples,
                           temperature=s.rollout.temperature, life=life)
    evaluation = HarnessEvaluation(data.eval_samples(), runner, run_id=run_id, step=s.endpoint.step,
                                   enabled=s.harness.eval)
    return source, HarnessScorer(source), evaluation
