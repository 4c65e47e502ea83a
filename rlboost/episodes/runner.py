"""The episode runner: turns of model output and environment replies, engine-agnostic and
resumable after any step from a JSON snapshot.

An episode moves through three phases, each a method that updates a `Snapshot`:

    begin(episode_id, row)        -> phase "generate"   env.start; the opening prompt segment
    model_turn(snapshot, gen)     -> "tools" | "done"   records the model's tokens, parses the turn
    run_tools(snapshot)           -> "generate" | "done" each tool call, then env.respond; env tokens
    finish(snapshot)              -> EpisodeResult       env.score (once: recorded)

`run()` loops them with a `generate(prompt_ids, max_new_tokens, stop_ids)` callable (any engine).
A caller that splits the work (a GPU worker generates, an env worker runs tools) calls the
phases itself and checkpoints the snapshot between them: every phase is a pure function of the
snapshot plus what the environment answers, and every answer is recorded in the snapshot before
it is used, so a snapshot taken after any call resumes on any machine to the same transcript.
Inside `run_tools` the snapshot is handed to `on_record` after each tool call, so a checkpoint
can fence each result before the next call starts: a resumed episode reuses a recorded result
and never calls that tool again.

Nothing an environment does crashes the runner: an exception, a bad return value, state that is
not JSON or a tool past `tool_timeout_s` is caught, logged with the episode id and recorded (a
tool's: an error message to the model or the end of the episode, per `on_tool_error`; start's,
respond's: the end of the episode with `end_reason = "env_error"`, reward 0, not scored; score's:
reward 0, counted in the `score_error` metric).

The token stream is a list of typed segments: `prompt` (the opening), `model` (generated, with
logprobs and who generated them) and `env` (tool results and environment turns). Only model
tokens are trained; env tokens carry no logprobs.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from rlboost.envs.chat import ChatFormat
from rlboost.config import EnvSettings
from rlboost.envs.protocol import (Context, in_thread, EnvError, Environment, Message, ModelTurn, Opening, Reply,
                                   Score, ToolCall, ToolResult, ToolSpec)
from rlboost.logs import get_logger

SNAPSHOT_VERSION = 1

# why an episode ended
DONE, MAX_TURNS, MAX_TOKENS, LENGTH, TOOL_ERROR, ENV_ERROR = (
    "done", "max_turns", "max_episode_tokens", "length", "tool_error", "env_error")


class Span(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A typed run of an episode's token stream (a snapshot's `segments`; not the wire's
    `Segment`, which says who generated a stretch of a result). `model` spans carry one logprob
    per token and who made them; `prompt` and `env` spans carry none and are never trained."""

    kind: Literal["prompt", "model", "env"]
    token_ids: list[int]
    logprobs: list[float] = msgspec.field(default_factory=list)
    turn: int = 0
    policy_version: int = -1
    weights_digest: str = ""
    worker: str = ""


class Generation(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a `generate` call answers: the new tokens (ending with a stop id unless the turn
    was cut), their logprobs, and who generated them. The runner goes by the tokens: a turn
    without a stop id at its end is `length` whatever `finish_reason` says."""

    token_ids: list[int]
    logprobs: list[float] = msgspec.field(default_factory=list)
    finish_reason: str = "stop"
    policy_version: int = -1
    weights_digest: str = ""
    worker: str = ""


class ToolRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool call's recorded outcome: reused, never re-run, by a resumed episode."""

    key: str
    name: str
    content: str
    error: bool = False
    timed_out: bool = False
    end: bool = False
    latency_s: float = 0.0
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class Pending(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model turn whose tool calls are under way: the results recorded so far (in call
    order), the state after them, and the environment's reply once it has one."""

    turn: ModelTurn
    results: list[ToolRecord] = msgspec.field(default_factory=list)
    reply: Reply | None = None


class Snapshot(msgspec.Struct, kw_only=True):
    """Everything an episode needs to continue, anywhere: JSON (`encode` / `decode`). Every
    field is written (the version above all: a reader of another version refuses it)."""

    episode_id: str
    version: int = SNAPSHOT_VERSION
    phase: Literal["generate", "tools", "done"] = "generate"
    turn: int = 0  # model turns recorded so far
    segments: list[Span] = msgspec.field(default_factory=list)
    messages: list[Message] = msgspec.field(default_factory=list)
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    state: Any = None
    pending: Pending | None = None
    end_reason: str = ""
    turn_rewards: list[float | None] = msgspec.field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    errors: list[str] = msgspec.field(default_factory=list)  # what the environment got wrong, in words
    score: Score | None = None

    def encode(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, data: bytes | str) -> Snapshot:
        try:
            snap = msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise EnvError(f"not an episode snapshot: {e}") from None
        if snap.version != SNAPSHOT_VERSION:
            raise EnvError(f"episode snapshot version {snap.version}; this rlboost reads {SNAPSHOT_VERSION}")
        return snap

    @property
    def token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def n_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def pending_call(self) -> ToolCall | None:
        """The next tool call to run (its key is the idempotency key), if any."""
        if self.phase != "tools" or self.pending is None:
            return None
        done = len(self.pending.results)
        calls = self.pending.turn.tool_calls
        return calls[done] if done < len(calls) else None


class EpisodeResult(msgspec.Struct, kw_only=True):
    """A finished episode: the token stream, the training mask (1 = a model token), the
    behaviour logprobs (0.0 where the mask is 0), the reward and the transcript."""

    episode_id: str
    token_ids: list[int]
    mask: list[int]
    logprobs: list[float]
    prompt_len: int
    reward: float
    turn_rewards: list[float] | None
    metrics: dict[str, float]
    end_reason: str
    turns: int
    tool_calls: int
    messages: list[Message]
    segments: list[Span]


def _json(state: Any) -> Any:
    """`state` as a resumed episode will see it (JSON round trip); EnvError if it is not JSON."""
    try:
        return msgspec.json.decode(msgspec.json.encode(state))
    except (TypeError, msgspec.EncodeError, OverflowError, ValueError) as e:
        raise EnvError(f"environment state is not JSON-serialisable ({e})") from None


def _validated(obj: Any, cls: type) -> Any:
    """`obj` re-checked against its Struct's types (an environment may have put anything in a
    field): a plain copy, or EnvError."""
    try:
        return msgspec.convert(msgspec.to_builtins(obj), cls)
    except (TypeError, msgspec.EncodeError, msgspec.ValidationError) as e:
        raise EnvError(f"{cls.__name__} does not fit its schema ({e})") from None


def episode_seed(episode_id: str) -> int:
    return int.from_bytes(hashlib.sha256(episode_id.encode()).digest()[:8], "big") >> 1


async def _call(fn: Callable, *args: Any) -> Any:
    """An environment method, sync (in a thread: a blocking one can still be timed out) or async."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    out = await in_thread(fn, *args)
    if inspect.isawaitable(out):
        out = await out
    return out


GenerateFn = Callable[[list[int], int, list[int]], Awaitable[Any]]


class EpisodeRunner:
    """Runs episodes of one environment in one chat format, within `settings`' bounds.
    `max_turn_tokens` bounds one model turn (the episode's remaining budget bounds it too)."""

    def __init__(self, env: Environment, fmt: ChatFormat, settings: EnvSettings | None = None,
                 max_turn_tokens: int = 256, **log_ids: Any) -> None:
        self.env, self.fmt = env, fmt
        self.settings = settings or EnvSettings()
        self.max_turn_tokens = max_turn_tokens
        self.log = get_logger(component="episode", **log_ids)

    # ------------------------------------------------------------ helpers

    def _ctx(self, snap: Snapshot, end_reason: str = "") -> Context:
        return Context(episode_id=snap.episode_id, turn=snap.turn, seed=episode_seed(snap.episode_id),
                       end_reason=end_reason)

    def _end(self, snap: Snapshot, reason: str, error: str = "") -> Snapshot:
        snap.phase, snap.end_reason, snap.pending = "done", reason, None
        if error:
            snap.errors.append(error)
            self.log.warning("episode ended by an environment error", episode=snap.episode_id, turn=snap.turn,
                             error=error)
        return snap

    async def _bounded(self, what: str, fn: Callable, *args: Any) -> Any:
        """An environment method under `tool_timeout_s`, like a tool: one that hangs ends its
        episode (`env_error`; score: reward 0) instead of holding it, and its worker, for ever."""
        try:
            return await asyncio.wait_for(_call(fn, *args), timeout=self.settings.tool_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise EnvError(f"{what} did not return within env.tool_timeout_s = {self.settings.tool_timeout_s} s") \
                from None

    def budget(self, snap: Snapshot) -> int:
        """How many tokens the next model turn may have (0: none: the episode is over)."""
        if snap.phase != "generate":
            return 0
        return max(0, min(self.max_turn_tokens, self.settings.max_episode_tokens - snap.n_tokens))

    # ------------------------------------------------------------ phases

    async def begin(self, episode_id: str, row: dict[str, Any]) -> Snapshot:
        snap = Snapshot(episode_id=episode_id)
        try:
            opening = await self._bounded("start", self.env.start, row, self._ctx(snap))
            if not isinstance(opening, Opening):
                raise EnvError(f"start returned {type(opening).__name__}, not an Opening")
            state = _json(opening.state)
            opening = _validated(msgspec.structs.replace(opening, state=None), Opening)
            snap.state = state
            snap.messages, snap.tools = list(opening.messages), list(opening.tools)
            prompt = self.fmt.prompt_ids(snap.messages, snap.tools)
        except Exception as e:
            return self._end(snap, ENV_ERROR, f"start: {type(e).__name__}: {e}")
        snap.segments.append(Span(kind="prompt", token_ids=list(prompt)))
        if self.budget(snap) <= 0:
            return self._end(snap, MAX_TOKENS)
        return snap

    def model_turn(self, snap: Snapshot, gen: Generation | tuple) -> Snapshot:
        """Record the model's turn (its tokens and logprobs) and parse it."""
        if snap.phase != "generate":
            raise EnvError(f"episode {snap.episode_id}: a model turn in phase {snap.phase}")
        if isinstance(gen, tuple):
            gen = Generation(token_ids=list(gen[0]), logprobs=list(gen[1]),
                             finish_reason=gen[2] if len(gen) > 2 else "")
        ids = list(gen.token_ids)
        # a turn that does not end in a stop id was cut, whatever the engine called it: the
        # environment would answer a half-written message (a cut call as "unclosed <tool_call>"),
        # and a chat template has no turn end to write its reply after (an env_error blamed on
        # the environment)
        reason = "stop" if ids and ids[-1] in self.fmt.stop_ids else "length"
        logprobs = [float(x) for x in gen.logprobs]
        if len(logprobs) != len(ids):  # the behaviour logprobs are what off-policy correction needs: never guessed
            raise EnvError(f"episode {snap.episode_id}: {len(ids)} tokens with {len(logprobs)} logprobs")
        snap.segments.append(Span(kind="model", token_ids=ids, logprobs=logprobs, turn=snap.turn,
                                     policy_version=gen.policy_version, weights_digest=gen.weights_digest,
                                     worker=gen.worker))
        turn = self.fmt.parse(ids, snap.tools, snap.episode_id, snap.turn, reason)
        snap.messages.append(Message(role="assistant", content=turn.text, tool_calls=turn.tool_calls))
        snap.turn_rewards.append(None)
        snap.turn += 1
        if reason != "stop":  # cut off mid-turn: no clean place to put the environment's reply
            return self._end(snap, LENGTH if snap.n_tokens < self.settings.max_episode_tokens else MAX_TOKENS)
        if snap.turn >= self.settings.max_turns and (turn.tool_calls or turn.errors):
            return self._end(snap, MAX_TURNS)  # the calls of a turn past the limit are not run
        snap.phase, snap.pending = "tools", Pending(turn=turn)
        return snap

    async def run_tools(self, snap: Snapshot, on_record: Callable[[Snapshot], Awaitable[None] | None] | None = None
                        ) -> Snapshot:
        """Run the pending turn's tool calls not yet recorded (one at a time, in order; each
        recorded, then `on_record(snapshot)`), ask the environment to respond, and append the
        environment's tokens. Recorded results and a recorded reply are reused, never re-asked."""
        if snap.phase != "tools" or snap.pending is None:
            raise EnvError(f"episode {snap.episode_id}: tools in phase {snap.phase}")
        pending = snap.pending
        turn_index = snap.turn - 1
        ctx = Context(episode_id=snap.episode_id, turn=turn_index, seed=episode_seed(snap.episode_id))
        stop_on_error = self.settings.on_tool_error == "end"
        while (call := snap.pending_call()) is not None:
            if stop_on_error and any(r.error for r in pending.results):
                break  # the calls after a failed one are not run
            record, new_state = await self._tool(call, snap.state, ctx)
            if new_state is not _KEEP:
                snap.state = new_state
            pending.results.append(record)
            snap.tool_calls += 1
            snap.tool_errors += record.error
            snap.tool_timeouts += record.timed_out
            if on_record is not None:
                out = on_record(snap)
                if inspect.isawaitable(out):
                    await out
        if stop_on_error and any(r.error for r in pending.results):
            snap.messages += [Message(role="tool", content=r.content, tool_call_id=r.key, name=r.name)
                              for r in pending.results]
            return self._end(snap, TOOL_ERROR)
        tool_messages = [Message(role="tool", content=r.content, tool_call_id=r.key, name=r.name)
                         for r in pending.results]
        tool_messages += [Message(role="tool", content=f"error: {e}") for e in pending.turn.errors]
        if pending.reply is None:
            try:
                reply = await self._bounded("respond", self.env.respond, list(snap.messages) + tool_messages, pending.turn,
                                            snap.state,
                                    ctx)
                if not isinstance(reply, Reply):
                    raise EnvError(f"respond returned {type(reply).__name__}, not a Reply")
                state = _json(reply.state) if reply.set_state else None
                reply = _validated(msgspec.structs.replace(reply, state=state), Reply)
            except Exception as e:
                snap.messages += tool_messages
                return self._end(snap, ENV_ERROR, f"respond: {type(e).__name__}: {e}")
            pending.reply = reply
            if on_record is not None:
                out = on_record(snap)
                if inspect.isawaitable(out):
                    await out
        reply = pending.reply
        if reply.set_state:
            snap.state = reply.state
        if reply.turn_reward is not None:
            snap.turn_rewards[turn_index] = float(reply.turn_reward)
        new = tool_messages + list(reply.messages)
        snap.messages += new
        if reply.done or any(r.end for r in pending.results):
            return self._end(snap, DONE)
        if snap.turn >= self.settings.max_turns:
            return self._end(snap, MAX_TURNS)
        try:
            last_model = next(s for s in reversed(snap.segments) if s.kind == "model")
            env = self.fmt.env_ids(snap.messages[:len(snap.messages) - len(new)], new, snap.tools,
                                   last_model.token_ids[-1] if last_model.token_ids else None)
        except Exception as e:
            return self._end(snap, ENV_ERROR, f"the chat format cannot write the reply: {type(e).__name__}: {e}")
        if snap.n_tokens + len(env) >= self.settings.max_episode_tokens:
            return self._end(snap, MAX_TOKENS)  # no room for the model to answer: the tokens are not added
        snap.segments.append(Span(kind="env", token_ids=list(env), turn=turn_index))
        snap.phase, snap.pending = "generate", None
        return snap

    async def _tool(self, call: ToolCall, state: Any, ctx: Context) -> tuple[ToolRecord, Any]:
        s = self.settings
        t0 = time.monotonic()
        record = ToolRecord(key=call.key, name=call.name, content="")
        new_state: Any = _KEEP
        try:
            # the call's key in its context too: a `tool_<name>` method sees no call, only ctx
            call_ctx = msgspec.structs.replace(ctx, call_key=call.key)
            out = await asyncio.wait_for(_call(self.env.call_tool, call, state, call_ctx), timeout=s.tool_timeout_s)
            if isinstance(out, str):
                out = ToolResult(content=out)
            if not isinstance(out, ToolResult):
                raise EnvError(f"call_tool returned {type(out).__name__}, not a ToolResult or str")
            if out.set_state:
                new_state = _json(out.state)
            out = _validated(msgspec.structs.replace(out, state=None), ToolResult)
            record.content, record.error, record.end, record.metrics = out.content, out.error, out.end, out.metrics
        except (asyncio.TimeoutError, TimeoutError):
            record.content, record.error, record.timed_out = f"error: {call.name} timed out after {s.tool_timeout_s}s", \
                True, True
            self.log.warning("tool timed out", episode=ctx.episode_id, key=call.key, tool=call.name,
                             timeout_s=s.tool_timeout_s)
        except Exception as e:
            record.content, record.error = f"error: {call.name} failed: {type(e).__name__}: {e}", True
            self.log.warning("tool failed", episode=ctx.episode_id, key=call.key, tool=call.name, error=repr(e))
        record.latency_s = time.monotonic() - t0
        return record, new_state

    async def finish(self, snap: Snapshot) -> EpisodeResult:
        """Score the episode (once: a recorded score is reused) and assemble the result."""
        if snap.phase != "done":
            raise EnvError(f"episode {snap.episode_id}: finish in phase {snap.phase}")
        if snap.score is None:
            if snap.end_reason == ENV_ERROR:  # a broken environment's verdict is not worth training on
                snap.score = Score(reward=0.0)
            else:
                try:
                    out = await self._bounded("score", self.env.score, list(snap.messages), snap.state,
                                      self._ctx(snap, snap.end_reason))
                    if isinstance(out, (int, float)) and not isinstance(out, bool):
                        out = Score(reward=float(out))
                    if not isinstance(out, Score):
                        raise EnvError(f"score returned {type(out).__name__}, not a Score or a number")
                    out = _validated(out, Score)
                    if out.reward != out.reward:
                        raise EnvError("score is NaN")
                    snap.score = out
                except Exception as e:
                    snap.errors.append(f"score: {type(e).__name__}: {e}")
                    self.log.warning("score failed: reward 0", episode=snap.episode_id, error=repr(e))
                    snap.score = Score(reward=0.0, metrics={"score_error": 1.0})
        return self.result(snap)

    def result(self, snap: Snapshot) -> EpisodeResult:
        score = snap.score or Score(reward=0.0)
        ids, mask, logprobs = [], [], []
        for seg in snap.segments:
            ids += seg.token_ids
            trained = seg.kind == "model"
            mask += [int(trained)] * len(seg.token_ids)
            logprobs += seg.logprobs if trained else [0.0] * len(seg.token_ids)
        turn_rewards = score.turn_rewards
        if turn_rewards is None and any(r is not None for r in snap.turn_rewards):
            turn_rewards = [r or 0.0 for r in snap.turn_rewards]
        metrics = {**score.metrics, "turns": float(snap.turn), "tool_calls": float(snap.tool_calls),
                   "tool_errors": float(snap.tool_errors), "tool_timeouts": float(snap.tool_timeouts),
                   "env_errors": float(len(snap.errors))}
        prompt_len = len(snap.segments[0].token_ids) if snap.segments and snap.segments[0].kind == "prompt" else 0
        return EpisodeResult(episode_id=snap.episode_id, token_ids=ids, mask=mask, logprobs=logprobs,
                             prompt_len=prompt_len, reward=score.reward, turn_rewards=turn_rewards, metrics=metrics,
                             end_reason=snap.end_reason, turns=snap.turn, tool_calls=snap.tool_calls,
                             messages=snap.messages, segments=snap.segments)

    # ------------------------------------------------------------ the loop

    async def step(self, snap: Snapshot, generate: GenerateFn,
                   on_record: Callable[[Snapshot], Awaitable[None] | None] | None = None) -> Snapshot:
        """One phase: a model turn (phase generate) or the pending tool calls (phase tools)."""
        if snap.phase == "generate":
            out = await generate(snap.token_ids, self.budget(snap), list(self.fmt.stop_ids))
            return self.model_turn(snap, out)
        if snap.phase == "tools":
            return await self.run_tools(snap, on_record)
        return snap

    async def run(self, generate: GenerateFn, episode_id: str = "", row: dict[str, Any] | None = None,
                  snapshot: Snapshot | None = None, on_checkpoint: Callable[[Snapshot], Any] | None = None,
                  stop_after: int | None = None) -> EpisodeResult | Snapshot:
        """Run an episode to its end, from `row` or from `snapshot`. `on_checkpoint(snapshot)`
        is called after every phase and every tool call. `stop_after=n`: return the snapshot
        after n phases (a test of resumption, or a worker handing the episode on)."""
        snap = snapshot if snapshot is not None else await self.begin(episode_id, row or {})
        steps = 0
        while snap.phase != "done":
            if stop_after is not None and steps >= stop_after:
                return snap
            snap = await self.step(snap, generate, on_checkpoint)
            steps += 1
            if on_checkpoint is not None:
                out = on_checkpoint(snap)
                if inspect.isawaitable(out):
                    await out
        return await self.finish(snap)


_KEEP: Any = object()
