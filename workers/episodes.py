"""Episodes on a rollout worker: model turns through the engine, tools inline, every step fenced.

A request with `episode` (schema 4) is generated like any request, one model turn at a time:
the worker's batch extends it until the turn ends (a stop token of the chat format, or the
turn's budget). Its tokens are checkpointed by the worker's flushes as usual. Then, off the
generation loop (the engine serves the other requests meanwhile), the environment phase runs
on the episode runner (rlboost/episodes/runner.py):

1. the turn is recorded and parsed (`model_turn`); the state with its pending tool calls is
   fenced into the checkpoint (`put_episode`);
2. each tool call runs under the request's `tool_timeout_s` with its idempotency key; after
   each, the state holding its result is fenced in before the next call starts, so a resumed
   episode reuses it and never calls that tool again;
3. the environment answers the turn (`respond`, recorded the same way) and its tokens (tool
   results, user turns) are appended to the checkpoint with the state that follows them, in one
   fenced step (`append_env`); then the next model turn joins the batch.

When the episode ends, its final state is fenced in and the request is finished like any other:
the result carries every token (model and environment, typed by its segments) and the final
state; the reward is the trainer's to compute (`rlboost.episodes.snapshot`).

Resume: an episode's claim returns its state with its tokens (`Claim.episode`), wherever it
was: a model turn under way (tokens past the state's `at`: generation continues where it
stopped), a turn whose tool calls are partly answered (the recorded results are reused, the
rest run with the same keys), or an ended episode not yet finished. Only the call that was
running when a worker died without notice can run twice, with the same key (the environment
can de-duplicate on it); with notice the worker lets the environment phase finish first.

Which environments a worker runs: the built-in ones (`rlboost.envs.BUILTIN_ENVS`) and the one
its own settings name (`[env] ref`): a request cannot make a worker import code of its choosing.
Tools run inline in the worker (`env.inline`, the default), off the generation loop: an episode
in its environment phase holds no generation slot (`worker.parked_episodes`), so a slow tool never
keeps the engine's batch short. With `env.inline = false` the worker records the turn, fences it
with its pending calls and hands the episode to the environment pool (workers/env_worker.py),
which runs steps 2 and 3 and sends it back to the resume lane.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlboost import episodes, wire
from rlboost.envs import BUILTIN_ENVS, SCHEMES, load_env
from rlboost.envs.chat import ChatFormat, chat_format
from rlboost.episodes.runner import EpisodeRunner, Generation, Snapshot, Span
from rlboost.config import EnvSettings
from rlboost.errors import RlboostError
from rlboost.logs import get_logger

log = get_logger(component="episodes")


class EpisodeRefused(RlboostError, ValueError):
    """This worker cannot serve the episode (an environment it does not run, no tokenizer for
    the chat format, an opening that is not the request's prompt): the request gets an `error`
    result saying why, like any request the engine cannot serve."""


MAX_CACHED = 64  # environments (per options) and runners (per bounds) a worker keeps loaded
Put = Callable[[wire.EpisodeState], Awaitable[None]]
AppendEnv = Callable[[list[int], wire.EpisodeState], Awaitable[int]]


@dataclass
class EpisodeRun:
    """One episode on this worker: its runner, the snapshot as of the last fenced state, and
    where the model turn under way starts in the checkpoint (`turn_start`)."""

    req: wire.RolloutRequest
    runner: EpisodeRunner
    snap: Snapshot
    turn_start: int  # checkpoint offset (tokens after the prompt) where the current model turn starts
    worker_id: str
    calls: list[wire.ToolRecord] = field(default_factory=list)
    stored: wire.EpisodeState | None = None  # the last state fenced into the checkpoint

    @property
    def ended(self) -> bool:
        return self.snap.phase == "done"

    @property
    def stop_ids(self) -> list[int]:
        return list(self.runner.fmt.stop_ids)

    def turn_limit(self) -> int:
        """The checkpoint length at which the current model turn must end (its budget)."""
        return self.turn_start + self.runner.budget(self.snap)

    def turn_done(self, tokens: list[int]) -> bool:
        """The model turn under way is over (or none is under way: tools to run, or the end)."""
        if self.snap.phase != "generate":
            return True
        turn = tokens[self.turn_start:]
        return bool(turn) and (turn[-1] in self.runner.fmt.stop_ids or len(tokens) >= self.turn_limit())

    def state(self, at: int) -> wire.EpisodeState:
        """The wire state of the snapshot as it stands, describing a checkpoint of `at` tokens."""
        snap, pending = self.snap, []
        if snap.phase == "tools" and snap.pending is not None:
            known = {c.key for c in self.calls}
            for r in snap.pending.results:  # answered since the last state: record who and how long
                if r.key not in known:
                    self.calls.append(wire.ToolRecord(key=r.key, name=r.name[:200], worker_id=self.worker_id,
                                                      latency_s=max(0.0, r.latency_s), at=at, error=r.error))
            pending = [wire.ToolCall(key=c.key, name=c.name[:200], arguments=json.dumps(c.arguments))
                       for c in snap.pending.turn.tool_calls[len(snap.pending.results):]]
        return wire.EpisodeState(turn=snap.turn, at=at, env_state=episodes.pack(snap), pending=pending,
                                 calls=list(self.calls), done=snap.phase == "done", reason=snap.end_reason[:1000])

    async def advance(self, tokens: list[int], logprobs: list[float], version: int, weights: str, put: Put,
                      append_env: AppendEnv, alive: Callable[[], None]) -> bool:
        """The environment phase after a model turn (`tokens`, `logprobs`: the whole durable
        checkpoint, the turn at its end), or the rest of one a resume found under way. Every
        step is fenced through `put` / `append_env` before the next. True: the next model turn
        is to be generated; False: the episode is over and its final state stored."""
        await self.record_turn(tokens, logprobs, version, weights, put)
        return await self.env_phase(len(tokens), put, append_env, alive)

    async def record_turn(self, tokens: list[int], logprobs: list[float], version: int, weights: str,
                          put: Put) -> None:
        """The model turn that just ended (the checkpoint's tokens past `turn_start`), recorded and
        parsed, and the state that follows it fenced in: tool calls to run, or the end."""
        if self.snap.phase == "generate":
            turn = list(tokens[self.turn_start:])
            # a turn that does not end in a stop id was cut by its budget: `length`, never a
            # finished turn (the environment would answer a half-written message)
            reason = "stop" if turn and turn[-1] in self.runner.fmt.stop_ids else "length"
            self.snap = self.runner.model_turn(self.snap, Generation(
                token_ids=turn, logprobs=list(logprobs[self.turn_start:]), finish_reason=reason,
                policy_version=version, weights_digest=weights, worker=self.worker_id))
            await self._put(put, len(tokens))

    async def env_phase(self, at: int, put: Put, append_env: AppendEnv, alive: Callable[[], None]) -> bool:
        """The pending tool calls and the environment's reply of a checkpoint of `at` tokens (in a
        generation worker, inline, or in an environment worker), each fenced in before the next.
        True: the next model turn is to be generated; False: the episode is over, its final state
        stored."""
        if self.snap.phase == "tools":
            async def record(_: Snapshot) -> None:  # each tool result (and the reply) fenced before the next call
                alive()
                await self._put(put, at)

            before = len(self.snap.segments)
            alive()
            self.snap = await self.runner.run_tools(self.snap, on_record=record)
            new = self.snap.segments[before:]
            if new and self.ended and at + len(new[0].token_ids) > self.req.max_new_tokens:
                # the reply after which the episode ran out of tokens: nothing reads it, and a
                # result may not exceed its request's bound
                self.snap.segments = self.snap.segments[:before]
            elif new:
                env_ids = list(new[0].token_ids)
                state = self.state(at + len(env_ids))
                at = await append_env(env_ids, state)
                self.stored = state
            if not self.ended:
                self.turn_start = at
                return True
        if self.stored is None or not self.stored.done or self.stored.at != at:
            await self._put(put, at)
        return False

    async def _put(self, put: Put, at: int) -> None:
        state = self.state(at)
        if state != self.stored:
            await put(state)
            self.stored = state


class EpisodeHost:
    """The episodes side of a worker: the environments it may run (one loaded object each), its
    chat format (the engine's tokenizer, else the model directory's) and one runner per
    (environment, options, bounds)."""

    def __init__(self, engine: Any, model_dir: str = "", env: EnvSettings | None = None, worker_id: str = "",
                 tokenizer: Any = None) -> None:
        self.engine, self.model_dir, self.worker_id = engine, model_dir, worker_id
        self.tokenizer = tokenizer  # (an environment worker has no engine: its own, or the model directory's)
        self.allowed = set(BUILTIN_ENVS) | ({env.ref} if env is not None and env.ref else set())
        self.describe_tools = env.describe_tools if env is not None else True  # the trainer's format: [env]
        self._fmt: ChatFormat | None = None
        self._envs: dict[tuple[str, str], Any] = {}
        self._runners: dict[tuple, EpisodeRunner] = {}
        self._loading: asyncio.Lock | None = None  # made in the worker's loop, at its first load

    def preload(self, ref: str) -> None:
        """Import the code of environment `ref` and load the chat format now, not on the first
        episode: an import inside the event loop would hold every episode already fetched."""
        from rlboost import plugins

        if ref:
            scheme, sep, _ = ref.partition(":")  # `verifiers:...`: the scheme's loader is the code to import
            plugins.load(SCHEMES[scheme] if sep and scheme in SCHEMES else ref, what="env", builtins=BUILTIN_ENVS,
                         error=EpisodeRefused)
        self.chat_format()

    def chat_format(self) -> ChatFormat:
        if self._fmt is None:
            tokenizer = self.tokenizer or getattr(self.engine, "tokenizer", None)
            if tokenizer is None and self.model_dir:
                from rlboost.modeldir import load_tokenizer

                tokenizer = load_tokenizer(self.model_dir)
            if tokenizer is None and self.engine is None:
                raise EpisodeRefused("no model directory: an environment worker writes the environment's replies "
                                     "in the model's chat format (rlboost env-worker --model-dir DIR)")
            if tokenizer is None:
                raise EpisodeRefused(f"the {getattr(self.engine, 'name', 'engine')} engine has no tokenizer: "
                                     "episodes need a model's chat format (a model directory)")
            try:
                self._fmt = chat_format(tokenizer, describe_tools=self.describe_tools)
            except (ValueError, RlboostError) as e:
                raise EpisodeRefused(f"no chat format for this model: {e}") from None
        return self._fmt

    async def _load(self, ref: str, config: str) -> Any:
        """The environment (ref, options), loaded once: in a thread (an environment's first load
        imports its library, seconds, which in the event loop would stop this worker's heartbeats
        and every episode it holds), one load at a time (the first episodes of a step arrive
        together, and two threads executing the same user module at once each saw it half built)."""
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            if (env := self._envs.get((ref, config))) is not None:
                return env  # loaded while this one waited
            options = json.loads(config)
            if not isinstance(options, dict):
                raise EpisodeRefused(f"episode config {config[:80]!r} is not a JSON object")
            try:
                env = await asyncio.to_thread(load_env, ref, **options)
            except RlboostError as e:
                raise EpisodeRefused(f"environment {ref!r} does not load: {e}") from None
            if len(self._envs) >= MAX_CACHED:  # bounded, whatever requests name
                self._envs.clear()
                self._runners.clear()
            self._envs[(ref, config)] = env
            return env

    async def runner(self, req: wire.RolloutRequest) -> EpisodeRunner:
        spec = req.episode
        assert spec is not None
        if spec.env not in self.allowed:
            raise EpisodeRefused(f"environment {spec.env!r} is not one this worker runs (built-in: "
                                 f"{', '.join(sorted(BUILTIN_ENVS))}; others: name it in the worker's [env] ref)")
        env = self._envs.get((spec.env, spec.config)) or await self._load(spec.env, spec.config)
        bounds = (spec.env, spec.config, spec.max_turns, spec.max_turn_tokens, spec.tool_timeout_s, spec.on_tool_error,
                  len(req.prompt_ids) + req.max_new_tokens)
        runner = self._runners.get(bounds)
        if runner is None:
            if len(self._runners) >= MAX_CACHED:
                self._runners.clear()
            settings = EnvSettings(ref=spec.env, tool_timeout_s=spec.tool_timeout_s, on_tool_error=spec.on_tool_error,
                                   max_turns=spec.max_turns, max_episode_tokens=bounds[-1], inline=True)
            runner = self._runners[bounds] = EpisodeRunner(env, self.chat_format(), settings,
                                                           max_turn_tokens=spec.max_turn_tokens or req.max_new_tokens,
                                                           worker_id=self.worker_id)
        return runner

    async def open(self, req: wire.RolloutRequest, stored: wire.EpisodeState | None, token_ids: list[int],
                   logprobs: list[float], put: Put) -> EpisodeRun:
        """The episode as its claim found it: a new one opens (`begin`, its opening checked against
        the request's prompt, its first state fenced in); a stored one continues from its state."""
        runner = await self.runner(req)
        assert req.episode is not None
        if stored is None:
            if token_ids:
                raise episodes.EpisodeStateError(f"{len(token_ids)} tokens in the checkpoint and no episode state")
            row = json.loads(req.episode.row)
            if not isinstance(row, dict):
                raise EpisodeRefused(f"episode row {req.episode.row[:80]!r} is not a JSON object")
            snap = await runner.begin(req.request_id, row)
            if snap.segments and snap.segments[0].token_ids != list(req.prompt_ids):
                raise EpisodeRefused("the environment's opening in this worker's chat format is not the request's "
                                     f"prompt ({len(snap.segments[0].token_ids)} vs {len(req.prompt_ids)} tokens)")
            if not snap.segments:  # start failed: the episode ended before it began (an env_error)
                snap.segments = [Span(kind="prompt", token_ids=list(req.prompt_ids))]
            run = EpisodeRun(req=req, runner=runner, snap=snap, turn_start=0, worker_id=self.worker_id)
            await run._put(put, 0)
            return run
        snap = episodes.unpack(stored, list(req.prompt_ids), token_ids, logprobs)
        return EpisodeRun(req=req, runner=runner, snap=snap, turn_start=stored.at, worker_id=self.worker_id,
                          calls=list(stored.calls), stored=stored)
