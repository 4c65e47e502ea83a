"""The environment protocol: what an episode asks of an environment, in rlboost's own terms.

An episode is a conversation between the policy and an environment:

1. `start(row, ctx)` opens it from one data row: the opening messages, the tools the model may
   call (JSON-schema specs), and the environment's state.
2. The model writes a turn. The runner parses it (rlboost/envs/chat.py) into text and tool calls.
3. Each tool call goes to `call_tool(call, state, ctx)`, one at a time, in order. The call
   carries its idempotency key (`<episode id>/<turn>/<call index>`); the result may carry a new
   state. Once recorded, a result is never asked for again (a resumed episode reuses it).
4. `respond(transcript, turn, state, ctx)` then answers the turn: more messages (a user turn,
   feedback), or the end of the episode. The default ends the episode on a turn without tool
   calls and continues after one with tool calls.
5. `score(transcript, state, ctx)` gives the episode's reward, optional per-turn rewards and
   metrics.

State is any JSON value (dicts, lists, strings, numbers, bools, None; msgspec Structs encode
as dicts). The runner stores it JSON round-tripped, so the environment always sees exactly what
a resumed episode on another machine would see. Methods may be `async def` or plain `def` (a
plain one runs in a thread, so a blocking tool can still be timed out). An environment must not
keep per-episode state anywhere but in `state`: the same environment object serves many
episodes at once, and an episode may continue in another process.

Everything here is plain msgspec Structs so the runner can checkpoint it (rlboost/episodes/runner.py).
The protocol is stable: changes are named in commit messages.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec

from rlboost.errors import RlboostError


class EnvError(RlboostError, RuntimeError):
    """An environment that cannot be loaded or that broke the protocol (a bad return value,
    state that is not JSON). Raised to callers of the loader; inside an episode the runner
    records it and ends the episode instead."""


# ---------------------------------------------------------------- messages and tools


class ToolSpec(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A tool the model may call: `parameters` is a JSON schema of its arguments object."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face chat-template shape (`tools=` of apply_chat_template)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


class ToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One call the model made. `key` is the idempotency key, `<episode id>/<turn>/<index>`: a
    tool with side effects de-duplicates on it (the rare re-run after an env worker died mid-call
    carries the same key)."""

    key: str
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    index: int = 0
    id: str = ""  # the call id the model wrote, where its syntax has one (Mistral's): its results quote it


def idempotency_key(episode_id: str, turn: int, index: int) -> str:
    return f"{episode_id}/{turn}/{index}"


Role = Literal["system", "user", "assistant", "tool"]


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A chat message. An assistant message may carry tool calls; a tool message answers the
    call whose key is `tool_call_id`."""

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    tool_call_id: str = ""
    name: str = ""  # a tool message: the tool's name

    def chat(self) -> dict[str, Any]:
        """The Hugging Face / OpenAI dict for a chat template."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [{"type": "function", "id": c.key,
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name:
                out["name"] = self.name
        return out


def user(content: str) -> Message:
    return Message(role="user", content=content)


def system(content: str) -> Message:
    return Message(role="system", content=content)


class ModelTurn(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The model's last turn, parsed. `text` is what it wrote outside tool calls; `errors` are
    tool calls it tried to make but wrote wrong (bad JSON, an unknown tool): the runner answers
    each with an error message to the model, never an exception."""

    text: str = ""
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    errors: list[str] = msgspec.field(default_factory=list)
    raw: str = ""  # the decoded turn as generated (stop token removed)
    finish_reason: str = "stop"  # stop | length


# ---------------------------------------------------------------- what an environment answers


class Opening(msgspec.Struct, kw_only=True):
    """`start`'s answer: the conversation so far, the tools, and the initial state."""

    messages: list[Message]
    tools: list[ToolSpec] = msgspec.field(default_factory=list)
    state: Any = None


class ToolResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`call_tool`'s answer. `content` goes back to the model as the tool message. `error`
    marks a failed call (the content says why): it counts as a tool error (`env.on_tool_error`).
    `state` replaces the episode's state when `set_state` is true. `end` ends the episode after
    this turn's calls (e.g. the game is over)."""

    content: str = ""
    error: bool = False
    state: Any = None
    set_state: bool = False
    end: bool = False
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class Reply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`respond`'s answer: messages to append after the turn's tool results (a user turn,
    feedback), whether the episode ends, an optional reward for this turn, and the new state
    when `set_state` is true."""

    messages: list[Message] = msgspec.field(default_factory=list)
    done: bool = False
    turn_reward: float | None = None
    state: Any = None
    set_state: bool = False


class Score(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`score`'s answer: the episode's reward, optional per-model-turn rewards (one per model
    turn; None = the environment gives none), and metrics (numbers, averaged over episodes)."""

    reward: float
    turn_rewards: list[float] | None = None
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class Context(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Where an episode stands when the environment is called. `seed` is fixed per episode
    (from its id) for environments that draw random numbers: draw them from state, not a global
    generator, so a resumed episode draws the same. `end_reason` is set for `score` only.
    `call_key` is the idempotency key of the tool call being served (`call_tool` and the
    `tool_<name>` methods `Env` dispatches to, which do not see the call itself): a tool with
    side effects de-duplicates on it. Empty outside a tool call."""

    episode_id: str
    turn: int = 0
    seed: int = 0
    end_reason: str = ""
    call_key: str = ""


# ---------------------------------------------------------------- the protocol


@runtime_checkable
class Environment(Protocol):
    """What the runner calls. Subclass `Env` for the defaults, or write the four methods."""

    def start(self, row: dict[str, Any], ctx: Context) -> Opening: ...

    def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult | str: ...

    def respond(self, transcript: list[Message], turn: ModelTurn, state: Any, ctx: Context) -> Reply: ...

    def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score | float: ...


class Env:
    """A base with the defaults: `call_tool` dispatches to a method `tool_<name>(state, ctx,
    **arguments)` (async, or plain: run in a thread; a string answer is the content); `respond` ends the episode
    on a turn without tool calls. `start` and `score` are yours. Any method may be `async`."""

    name: str = "env"

    def start(self, row: dict[str, Any], ctx: Context) -> Opening:
        raise NotImplementedError

    async def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult | str:
        fn = getattr(self, f"tool_{call.name}", None)
        if fn is None or not callable(fn):
            return ToolResult(content=f"error: no tool named {call.name!r}", error=True)
        try:
            inspect.signature(fn).bind(state, ctx, **call.arguments)
        except TypeError as e:
            return ToolResult(content=f"error: bad arguments for {call.name}: {e}", error=True)
        if inspect.iscoroutinefunction(fn):
            return await fn(state, ctx, **call.arguments)
        # a plain method runs in a thread: a blocking tool can still be timed out
        out = await in_thread(fn, state, ctx, **call.arguments)
        if inspect.isawaitable(out):
            out = await out
        return out

    def respond(self, transcript: list[Message], turn: ModelTurn, state: Any, ctx: Context) -> Reply:
        return Reply(done=not turn.tool_calls and not turn.errors)

    def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score | float:
        raise NotImplementedError


# Sync environment methods run on threads of their own, not the event loop's default executor
# (min(32, cores + 4) threads: 6 on a 2-core box), which would queue the blocking tool calls of
# the episodes a worker parks (`worker.parked_episodes`) behind one another.
ENV_THREADS = 64
_executor: ThreadPoolExecutor | None = None


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on the environments' threads."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=ENV_THREADS, thread_name_prefix="rlboost-env")
    return await asyncio.get_running_loop().run_in_executor(_executor, functools.partial(fn, *args, **kwargs))
