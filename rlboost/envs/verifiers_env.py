"""`--env verifiers:TARGET`: a verifiers environment (verifiers 0.4, `verifiers.v1`) trained
natively through rlboost's environment protocol: rlboost's episode runner plays the agent loop
(the part verifiers' `null` harness plays: a chat loop with the task's tool servers), so every
model turn and every tool result is fenced into the checkpoint like any rlboost episode.

TARGET is an importable module or a path to a `.py` file. It names the environment one of two
ways: a function `load_environment(**options)` (`[env.options]`) returning a `vf.Taskset`, a
`vf.Env`, or `(taskset, EnvClass[, env_config])` (an Env whose taskset is not an installed
verifiers plugin: verifiers' own Env constructor finds its taskset by plugin id); or, verifiers'
own plugin convention, a module exporting its `Taskset` subclass in `__all__`, built from its
config type with `[env.options]` as the config's fields. The module may also export an `Env`
subclass with ONE seat whose `run(task, agents)` drives the seat turn by turn (`async with
agents.<seat>.interaction(task) as i: seg = await i.turn(message)`: a game, a feedback loop);
anything else is refused at load, one line each (`refusal`). Loaded inside an event loop (a
worker's first episode) it is built on a thread at its first call (`Deferred`).

What maps to what:

- `rows(split, n, seed)`: the taskset's tasks as rows (`vf_task`: the task's data as JSON, plus
  `prompt`, `answer`, `info` and `task` for people and reward code to read). verifiers has no
  held-out split of its own; one task in 8 (by a hash of its content) is held out (`test`) and
  never trained on.
- `start`: the task's system prompt and prompt as the opening; the tools of its tool servers
  (`Task.toolsets` per episode, `Taskset.toolsets` shared), named as verifiers names them
  (`<server>_<tool>`), their JSON schemas built by the MCP library as verifiers' servers do.
- `call_tool`: the tool method on a server rebuilt for the call (per-episode servers: built,
  `setup()`, `setup_task(task)`), with the episode's `vf.State` set as the server's `self.state`,
  arguments validated by MCP's own argument model. A raise is a ToolResult with error=True.
- `respond`: a turn with tool calls continues; a final answer ends the episode, or, for a seat-
  driven `Env`, is fed to the env's `run()` replayed from the start with the answers so far: its
  next `turn(message)` is the reply, its return the end. `@vf.stop` predicates on the `Trace`
  are checked after every turn.
- `score`: the task's `@vf.reward` functions (weighted) and `@vf.metric`s through `Task.score`
  on a `vf.Trace` built from the transcript, plus whatever the env's `run()` recorded on the
  seat's trace; reward = `trace.reward` (the weighted sum), metrics = every metric and every
  reward's raw score (`reward/<name>`).

What is durable: rlboost's state holds only JSON: the task's data, the episode's `vf.State`
(a pydantic model: dumped to JSON after every tool call), the seat's answers so far. Everything
else (tool server objects, the env's `run()` coroutine, the trace) is rebuilt from those,
deterministically, on whichever worker continues the episode. What cannot be preserved across a
worker's death: anything a tool server or an env keeps on `self` during an episode (it is
rebuilt, not restored) and any randomness an env's `run()` draws unseeded (a replay draws it
again). A `vf.State` that does not dump to JSON is an error naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import inspect
import json
import sys
import threading
import weakref
from typing import Any

from rlboost import plugins
from rlboost.envs.protocol import (Context, EnvError, Message, ModelTurn, Opening, Reply, Score, ToolCall,
                                   ToolResult, ToolSpec, in_thread)

HELD_OUT = 8  # one task in HELD_OUT is held out (test), by a hash of its content
_CALL_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("rlboost_verifiers_call_key", default="")
# the Env methods that own verifiers' rollout machinery: an env overriding one runs its own loop
_MACHINERY = ("run_episode", "run_slot", "slots", "serving", "shared_tools", "_episode_agents")
_RUNTIME_HOOKS = ("setup", "finalize", "stage_verifier")
ELSEWHERE = "run it through its own harness: `rlboost run --harness ...` or against `rlboost serve-openai`"


def call_key() -> str:
    """Inside a tool call: the call's idempotency key (`<episode>/<turn>/<index>`), for a tool with
    side effects to de-duplicate on (a call under way when its worker died runs again with the
    same key). Empty outside one."""
    return _CALL_KEY.get()


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise EnvError(f"--env verifiers:...: needs verifiers 0.4 (pip install 'rlboost[verifiers]'): {e}") from None
    return vf


# ---------------------------------------------------------------- loading


def _module(target: str) -> Any:
    # plugins.load imports a module or a .py file (under a stable private name, the same in every
    # process) and returns an attribute; a module's `__name__` gives the module itself back
    try:
        name = plugins.load(f"{target}:__name__", what="env", error=EnvError, callable_only=False)
    except EnvError as e:
        why = str(e).replace(f"{target}:__name__", f"verifiers:{target}")
        raise EnvError(why + (OLD_API if any(n in why for n in _OLD_NAMES) else "")) from None
    return sys.modules[name]


# what an environment written for verifiers before 0.4 uses (the classes rlboost does not play)
_OLD_NAMES = ("SingleTurnEnv", "MultiTurnEnv", "ToolEnv", "StatefulToolEnv", "Rubric", "load_example_dataset")
OLD_API = ("; written for verifiers < 0.4 (SingleTurnEnv / MultiTurnEnv / ToolEnv / Rubric)? rlboost pins verifiers "
           "0.4, whose environments are verifiers.v1 tasksets (Taskset, Task, Toolset, @vf.reward)")


def _exported(module: Any, base: type) -> list[type]:
    return [obj for n in getattr(module, "__all__", ()) if isinstance(obj := getattr(module, n, None), type)
            and issubclass(obj, base) and obj is not base]


def _made(target: str, module: Any, options: dict[str, Any]) -> tuple[Any, type | None, Any]:
    """(the taskset, the Env class or None, an Env instance when load_environment made one)."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    fn = getattr(module, "load_environment", None)
    if callable(fn):
        try:
            made = fn(**options)
        except Exception as e:
            hint = OLD_API if any(n in repr(e) for n in _OLD_NAMES) else ""
            raise EnvError(f"verifiers:{target}: load_environment() failed ({e!r}){hint}") from None
        if isinstance(made, vf.Env):
            return made.taskset, type(made), made
        if (isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], vf.Taskset)
                and isinstance(made[1], type) and issubclass(made[1], vf.Env)):
            # (taskset, Env class[, its config]): an Env whose taskset is not an installed plugin
            # (verifiers' own Env constructor resolves its taskset by plugin id)
            return made[0], made[1], (_bare_env(made[1], made[2]) if len(made) == 3 else None)
        if isinstance(made, vf.Taskset):
            envs = _exported(module, vf.Env)
            return made, (envs[0] if len(envs) == 1 else None), None
        old = any(n in {c.__name__ for c in type(made).__mro__} for n in _OLD_NAMES)
        raise EnvError(f"verifiers:{target}: load_environment() returned {type(made).__name__}, not a verifiers.v1 "
                       f"Taskset, Env or (Taskset, Env class[, its config])" + (OLD_API if old else ""))
    tasksets = _exported(module, vf.Taskset)
    if len(tasksets) != 1:
        raise EnvError(f"verifiers:{target}: define load_environment(**options) or export exactly one "
                       f"verifiers.v1 Taskset subclass in __all__ (found {len(tasksets)})")
    cls = tasksets[0]
    config_cls = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        taskset = cls(config_cls(**options))
    except Exception as e:
        raise EnvError(f"verifiers:{target}: {cls.__name__}({config_cls.__name__}(**options)) failed ({e!r})") from None
    envs = _exported(module, vf.Env)
    return taskset, (envs[0] if len(envs) == 1 else None), None


def _overrides(cls: type, base: type, name: str) -> bool:
    return getattr(cls, name, None) is not getattr(base, name, None)


def refusal(taskset: Any, env_cls: type | None, module: Any) -> str | None:
    """Why the native path cannot play this environment (one line), or None."""
    vf = _vf()
    from verifiers.v1.session import hook_boundary

    if env_cls is not None:
        name = env_cls.__name__
        own = [m for m in _MACHINERY if _overrides(env_cls, vf.Env, m)]
        if own:
            return (f"{name} overrides verifiers' rollout loop (Env.{own[0]}): rlboost cannot play it turn by "
                    f"turn; {ELSEWHERE}")
        if _overrides(env_cls, vf.Env, "finalize"):
            return (f"{name}.finalize() judges an episode's traces together (a group-based reward); rlboost scores "
                    f"each episode on its own through the environment protocol (no group hook): {ELSEWHERE}")
    if _exported(module, vf.Harness):
        return f"the module exports its own Harness (a program with its own agent loop): {ELSEWHERE}"
    task_cls = type(taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        return f"task {task_cls.__name__} needs a container (NEEDS_CONTAINER): {ELSEWHERE}"
    hooks = [h for h in _RUNTIME_HOOKS if _overrides(task_cls, vf.Task, h)]
    if hooks:
        return f"task {task_cls.__name__} has a {hooks[0]}() hook that runs in the agent's box (a runtime): {ELSEWHERE}"
    task = task_cls(task_cls.data_type().model_construct(), taskset.config.task)
    if task.config.judges:
        return (f"task {task_cls.__name__} is scored by judges (a model of their own), which the native path "
                f"does not call: {ELSEWHERE}")
    for kind in ("reward", "metric"):
        for fn in task.hooks(kind):
            if not inspect.iscoroutinefunction(inspect.unwrap(fn)):
                return f"@vf.{kind} {fn.__name__} is a plain def: verifiers awaits every {kind} (async def)"
            p = inspect.signature(fn).parameters.get("runtime")
            if p is not None and p.default is inspect.Parameter.empty:
                return f"@vf.{kind} {fn.__name__} needs the agent's runtime (a box): {ELSEWHERE}"
    for fn in task.hooks("stop"):
        try:
            kind = hook_boundary(fn, allow_trace=True)
        except TypeError as e:
            return f"@vf.stop {fn.__name__}: {e}"
        if kind is not vf.Trace:
            return (f"@vf.stop {fn.__name__} inspects a model {kind.__name__}; the native path checks stops on the "
                    f"Trace after each turn only: {ELSEWHERE}")
    return None


def _seat(env_cls: type | None, env: Any) -> tuple[Any, str]:
    """The Env object whose run() drives the seat, and the seat's name (None: a plain taskset)."""
    vf = _vf()
    from verifiers.v1.configs.agent import agent_config_fields

    if env_cls is None or env_cls is vf.SingleAgentEnv:
        return None, ""
    if env is None:
        env = _bare_env(env_cls, None)
    seats = agent_config_fields(env.config)
    if len(seats) != 1:
        raise EnvError(f"{env_cls.__name__} declares {len(seats)} agents ({', '.join(seats) or 'none'}): the native "
                       f"path plays one seat, the policy; {ELSEWHERE}")
    (name, spec), = seats.items()
    if spec.harness is not None and spec.harness.id not in ("", "null"):
        raise EnvError(f"{env_cls.__name__}'s {name} pins the {spec.harness.id!r} harness (a program with its own "
                       f"agent loop): {ELSEWHERE}")
    return env, name


def _bare_env(env_cls: type, config: Any) -> Any:
    """An Env object for its config, setup() and run(): Env.__init__ resolves its taskset and
    harnesses through verifiers' plugin ids (an installed package per id), which the native path
    does not use, so the object is made without it (its config as given, else its defaults)."""
    vf = _vf()
    from verifiers.v1.utils.generic import concrete_type

    config_cls = concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    if config is not None and not isinstance(config, config_cls):
        raise EnvError(f"{env_cls.__name__} takes a {config_cls.__name__}, not a {type(config).__name__}")
    env = env_cls.__new__(env_cls)
    env.config = config if config is not None else config_cls()
    return env


def load(target: str, **options: Any) -> Any:
    """The environment `verifiers:TARGET` names (rlboost.envs.SCHEMES), `options` from `[env.options]`.
    Outside an event loop (the trainer, the CLI) it is built now, refusals and all; inside one (a
    generation worker loads an environment when its first episode arrives) it is built on a
    thread at its first call (`Deferred`)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return build(target, dict(options))
    return Deferred(target, dict(options))


class Deferred:
    """A VerifiersEnv built at its first call, on a thread: importing verifiers and the user's
    module takes seconds (12-20 s on a busy 2-core box), and in the event loop that would stop
    the worker's heartbeats and let its leases lapse mid-claim (its episodes taken back). The run
    has already built it once in the trainer, so a refusal surfaced here is no surprise."""

    def __init__(self, target: str, options: dict[str, Any]) -> None:
        self._target, self._options = target, options
        self._env: VerifiersEnv | None = None
        self._lock = threading.Lock()
        self.name = f"verifiers/{target}"

    def built(self) -> "VerifiersEnv":
        with self._lock:
            if self._env is None:
                self._env = build(self._target, self._options)
            return self._env

    async def _ready(self) -> "VerifiersEnv":
        return self._env if self._env is not None else await in_thread(self.built)

    async def start(self, row: dict[str, Any], ctx: Context) -> Opening:
        return await (await self._ready()).start(row, ctx)

    async def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult:
        return await (await self._ready()).call_tool(call, state, ctx)

    async def respond(self, transcript: list[Message], turn: ModelTurn, state: Any, ctx: Context) -> Reply:
        return await (await self._ready()).respond(transcript, turn, state, ctx)

    async def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score:
        return await (await self._ready()).score(transcript, state, ctx)

    def rows(self, split: str = "train", n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
        return self.built().rows(split, n, seed)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.built(), name)


def build(target: str, options: dict[str, Any]) -> "VerifiersEnv":
    """The VerifiersEnv `target` names, built now (the module imported, refusals checked)."""
    module = _module(target)
    taskset, env_cls, env = _made(target, module, options)
    why = refusal(taskset, env_cls, module)
    if why:
        raise EnvError(f"verifiers:{target}: {why}")
    try:
        seat_env, seat = _seat(env_cls, env)
    except EnvError as e:
        raise EnvError(f"verifiers:{target}: {e}") from None
    return VerifiersEnv(target, taskset, seat_env, seat)


# ---------------------------------------------------------------- messages both ways


def _text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return content if isinstance(content, str) else content_text(content or [])


def opening_messages(data: Any) -> list[Message]:
    """A task's system prompt and prompt (a string or verifiers Messages) as rlboost messages."""
    out = [Message(role="system", content=data.system_prompt)] if data.system_prompt else []
    prompt = data.prompt
    if isinstance(prompt, str):
        return out + [Message(role="user", content=prompt)]
    for m in prompt or []:
        if m.role == "assistant":
            calls = [ToolCall(key=c.id, id=c.id, name=c.name, arguments=_arguments(c.arguments), index=i)
                     for i, c in enumerate(m.tool_calls or [])]
            out.append(Message(role="assistant", content=m.content or "", tool_calls=calls))
        elif m.role == "tool":
            out.append(Message(role="tool", content=_text(m.content), tool_call_id=m.tool_call_id, name=m.name or ""))
        else:
            out.append(Message(role=m.role, content=_text(m.content)))
    return out


def _arguments(raw: str) -> dict[str, Any]:
    try:
        out = json.loads(raw or "{}")
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def vf_messages(transcript: list[Message]) -> list[Any]:
    """rlboost messages as verifiers messages (tool calls keep their idempotency key as their id)."""
    from verifiers.v1 import types as t

    out: list[Any] = []
    for m in transcript:
        if m.role == "system":
            out.append(t.SystemMessage(content=m.content))
        elif m.role == "user":
            out.append(t.UserMessage(content=m.content))
        elif m.role == "assistant":
            calls = [t.ToolCall(id=c.key, name=c.name, arguments=json.dumps(c.arguments)) for c in m.tool_calls]
            out.append(t.AssistantMessage(content=m.content, tool_calls=calls or None))
        else:
            out.append(t.ToolMessage(tool_call_id=m.tool_call_id or "", content=m.content, name=m.name or None))
    return out


# ---------------------------------------------------------------- the seat's replay


class _Suspend(BaseException):
    """The replayed run() asked for an answer the model has not given yet (BaseException: a
    run() that catches Exception must not swallow it)."""

    def __init__(self, message: Any) -> None:
        super().__init__("suspended")
        self.message = message


class _Interaction:
    """Stands in for verifiers' Interaction during a replay: `turn()` answers from the model's
    answers so far, in order, and suspends the replay at the first one not yet given."""

    def __init__(self, trace: Any, replies: list[str], prompted: bool) -> None:
        self.trace, self.replies, self.prompted = trace, replies, prompted
        self.given = 0
        self.asked: list[Any] = []  # the messages the env sent, one per turn (None: the bare opening turn)

    async def turn(self, message: Any = None) -> Any:
        from verifiers.v1.agent import Segment
        from verifiers.v1.types import AssistantMessage

        if message is None and not (self.prompted and self.given == 0):
            raise EnvError("interaction.turn() without a message after the opening (verifiers refuses it too)")
        self.asked.append(message)
        if self.given >= len(self.replies):
            raise _Suspend(message)
        reply = self.replies[self.given]
        self.given += 1
        return Segment(messages=[AssistantMessage(content=reply)])

    def __getattr__(self, name: str) -> Any:
        raise EnvError(f"the native path plays interaction.turn() only, not interaction.{name}: {ELSEWHERE}")


class _Seat:
    def __init__(self, interaction: _Interaction) -> None:
        self._interaction = interaction
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any):
        yield self._interaction

    async def run(self, task: Any) -> None:  # SingleAgentEnv-style: the whole exchange is the model's
        await self._interaction.turn(None if self._interaction.prompted else "")

    def __getattr__(self, name: str) -> Any:
        raise EnvError(f"the native path plays agents.<seat>.interaction(task) only, not .{name}: {ELSEWHERE}")


class _Agents:
    def __init__(self, name: str, seat: _Seat) -> None:
        self._name, self._seat = name, seat

    def __getattr__(self, name: str) -> Any:
        if name == self.__dict__.get("_name"):
            return self.__dict__["_seat"]
        raise AttributeError(f"no agent {name!r}; the native path plays one seat")


# ---------------------------------------------------------------- the environment


class VerifiersEnv:
    """A verifiers taskset (and its one-seat Env, if any) as an rlboost environment."""

    def __init__(self, target: str, taskset: Any, seat_env: Any, seat: str) -> None:
        from mcp.server.mcpserver.tools.base import Tool

        self.target, self.taskset, self.seat_env, self.seat = target, taskset, seat_env, seat
        self.task_cls = type(taskset).task_type()
        self.name = f"verifiers/{type(taskset).__name__}"
        self._Tool = Tool
        self._shared = list(type(taskset).toolsets(taskset.config))
        self._shared_ready: set[int] = set()
        self._lock = threading.Lock()
        # one lock per event loop (an asyncio.Lock belongs to the loop it first waits in)
        self._setup_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._meta: dict[tuple, Any] = {}  # MCP's Tool (schema, argument model) per server class and tool
        self.tools = [spec for spec, _ in self._tool_table(self._servers_now())]  # a bad tool fails here, once

    # ------------------------------------------------ data

    def rows(self, split: str = "train", n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise ValueError(f"split {split!r}: train or test")
        out: list[dict[str, Any]] = []
        looked = 0
        with self._lock:  # a taskset's iteration is not promised to be thread-safe
            for task in iter(self.taskset):
                looked += 1
                if self._held_out(task) == (split == "test"):
                    out.append(self.row_of(task))
                if len(out) >= n or looked >= 50 * n + 1000:  # an infinite taskset: bounded
                    break
        return out

    @staticmethod
    def _held_out(task: Any) -> bool:
        data = task.data.model_dump(mode="json", exclude_none=True, exclude={"idx"})
        digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).digest()
        return digest[0] % HELD_OUT == HELD_OUT - 1

    def row_of(self, task: Any) -> dict[str, Any]:
        data = data_json(task.data)
        row = {"vf_task": data, "task": type(task).__name__, "data_source": self.name}
        for k in ("prompt", "answer", "info"):
            if k in data:
                row[k] = data[k]
        return row

    def task_of(self, row: dict[str, Any]) -> Any:
        """The task a row stands for: its `vf_task`, else the row's own fields (a `--data` file)."""
        raw = row.get("vf_task", row)
        data_cls = self.task_cls.data_type()
        try:
            data = data_cls.model_validate({k: v for k, v in raw.items() if k in data_cls.model_fields})
        except Exception as e:
            raise EnvError(f"a row that is not a {data_cls.__name__}: {e}") from None
        return self.task_cls(data, self.taskset.config.task)

    # ------------------------------------------------ tools

    def _servers_now(self) -> list[Any]:
        return list(self.task_cls.toolsets(self.taskset.config.task)) + self._shared

    def _tool_table(self, servers: list[Any]) -> list[tuple[ToolSpec, tuple[Any, Any, Any]]]:
        """Each tool of `servers`: its spec, and (its server, the method bound to it, MCP's Tool,
        built once per server class: its argument model is a pydantic model made per build)."""
        from verifiers.v1.utils.decorators import discover_decorated

        out, seen = [], set()
        for server in servers:
            for fn in discover_decorated(server, "tool"):
                raw = getattr(fn, "tool_name", None) or fn.__name__
                name = f"{server.server_name}_{raw}" if server.server_name else raw
                if name in seen:
                    raise EnvError(f"two tools named {name!r}")
                seen.add(name)
                tool = self._meta.get((type(server), fn.__name__, name))
                if tool is None:
                    tool = self._meta[(type(server), fn.__name__, name)] = self._Tool.from_function(
                        fn, name=name, description=(fn.__doc__ or "").strip())
                out.append((ToolSpec(name=name, description=tool.description, parameters=tool.parameters),
                            (server, fn, tool)))
        return out

    async def _servers_for(self, task: Any) -> list[Any]:
        """The call's tool servers: the task's built afresh for it (`setup`, `setup_task`: what
        verifiers does once per rollout, rebuilt here from the task alone), the shared ones set up
        once per process."""
        lock = self._setup_locks.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        fresh = list(self.task_cls.toolsets(self.taskset.config.task))
        for server in fresh:
            await server.setup()
            await server.setup_task(task)
        async with lock:
            for server in self._shared:
                if id(server) not in self._shared_ready:
                    await server.setup()
                    self._shared_ready.add(id(server))
        return fresh + self._shared

    async def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult:
        from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content
        from verifiers.v1.mcp.server import _call_state

        task = self.task_of(state["task"])
        table = dict((spec.name, impl) for spec, impl in self._tool_table(await self._servers_for(task)))
        if call.name not in table:
            return ToolResult(content=f"error: no tool named {call.name!r}", error=True)
        server, fn, tool = table[call.name]
        try:
            kwargs = tool.fn_metadata.validate_arguments(call.arguments)
        except Exception as e:
            return ToolResult(content=f"error: bad arguments for {call.name}: {e}", error=True)
        vf_state = server._state_adapter.validate_python(state["vf_state"])
        key = ctx.call_key or call.key

        def run() -> Any:
            # the server's `self.state` is a context variable in verifiers (one per call): set it
            # in the thread that runs the tool
            tokens = _call_state.set(vf_state), _CALL_KEY.set(key)
            try:
                return fn(**kwargs)
            finally:
                _CALL_KEY.reset(tokens[1])
                _call_state.reset(tokens[0])

        async def run_async() -> Any:
            tokens = _call_state.set(vf_state), _CALL_KEY.set(key)
            try:
                return await fn(**kwargs)
            finally:
                _CALL_KEY.reset(tokens[1])
                _call_state.reset(tokens[0])

        try:
            if tool.is_async:
                out = await run_async()
            else:
                out = await in_thread(run)
                if inspect.isawaitable(out):
                    out = await out
            error, content = False, mcp_content_to_chat_content(tool.fn_metadata.convert_result(out).content)
        except Exception as e:
            error, content = True, f"error: {type(e).__name__}: {e}"
        try:
            dumped = _dump(vf_state)
        except EnvError as e:  # the call's effect on the state cannot be kept: the model is told, the state stays
            return ToolResult(content=f"error: {e}", error=True)
        # a server's State type may know fewer fields than the task's: what it wrote replaces what it knows
        new = {**state, "vf_state": {**state["vf_state"], **dumped}}
        text = content if isinstance(content, str) else json.dumps(content)
        return ToolResult(content=text, error=error, state=new, set_state=True)

    # ------------------------------------------------ the protocol

    async def start(self, row: dict[str, Any], ctx: Context) -> Opening:
        task = self.task_of(row)
        state = {"task": {"vf_task": data_json(task.data)},
                 "vf_state": _dump(self._state_cls()()), "replies": [], "recorded": None}
        messages = opening_messages(task.data)
        if self.seat_env is not None:
            state["opening"] = len(messages)
            done, asked, trace = await self._replay(task, messages, [])
            if done:
                raise EnvError(f"{type(self.seat_env).__name__}.run() ended before the model's first turn")
            if asked is not None:  # a prompt-less task: the env's first turn(message) opens it
                messages = messages + [Message(role="user", content=_text(asked))]
        return Opening(messages=messages, tools=list(self.tools), state=state)

    def _state_cls(self):
        from verifiers.v1.state import state_cls

        return state_cls(self.task_cls)

    def trace_of(self, task: Any, transcript: list[Message], vf_state: Any) -> Any:
        from verifiers.v1 import AgentConfig
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.types import Tool

        nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=m.role == "assistant")
                 for i, m in enumerate(vf_messages(transcript))]
        state = self._state_cls().model_validate(vf_state)
        return Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=AgentInfo(config=AgentConfig(), name=self.seat or "agent"), nodes=nodes, state=state,
                     tools=[Tool(name=t.name, description=t.description, parameters=t.parameters) for t in self.tools])

    async def _replay(self, task: Any, transcript: list[Message], replies: list[str]) -> tuple[bool, Any, Any]:
        """The seat's env's run() replayed with `replies`: (finished, the message it asked the next
        answer with, the seat's trace)."""
        trace = self.trace_of(task, transcript, self._state_cls()().model_dump(mode="json"))
        interaction = _Interaction(trace, replies, prompted=task.data.prompt is not None)
        agents = _Agents(self.seat, _Seat(interaction))
        try:
            await self.seat_env.setup(agents)
            await self.seat_env.run(task, agents)
        except _Suspend as s:
            return False, s.message, trace
        return True, None, trace

    async def respond(self, transcript: list[Message], turn: ModelTurn, state: Any, ctx: Context) -> Reply:
        task = self.task_of(state["task"])
        if await self._stopped(task, transcript, state):
            return Reply(done=True)
        if turn.tool_calls or turn.errors:
            return Reply(done=False)
        if self.seat_env is None:
            return Reply(done=True)
        replies = state["replies"] + [turn.text]
        done, asked, trace = await self._replay(task, transcript, replies)
        new = {**state, "replies": replies}
        if done:
            new["recorded"] = {"rewards": {k: [r.score, r.weight] for k, r in trace.rewards.items() if r is not None},
                               "metrics": {k: v for k, v in trace.metrics.items() if v is not None}}
            return Reply(done=True, state=new, set_state=True)
        return Reply(messages=[Message(role="user", content=_text(asked))], state=new, set_state=True)

    async def _stopped(self, task: Any, transcript: list[Message], state: Any) -> bool:
        from verifiers.v1.session import call_hook
        from verifiers.v1.trace import Trace

        stops = task.hooks("stop")
        if not stops:
            return False
        trace = self.trace_of(task, transcript, state["vf_state"])
        for fn in stops:
            fired = await call_hook(fn, {Trace: trace})
            if not isinstance(fired, bool):
                raise EnvError(f"@vf.stop {fn.__name__} returned {type(fired).__name__}, not a bool")
            if fired:
                return True
        return False

    async def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score:
        task = self.task_of(state["task"])
        trace = self.trace_of(task, transcript, state["vf_state"])
        for name, (value, weight) in ((state.get("recorded") or {}).get("rewards") or {}).items():
            trace.record_reward(name, value, weight)
        trace.record_metrics((state.get("recorded") or {}).get("metrics") or {})
        await task.score(trace)
        metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
        metrics.update({f"reward/{k}": float(r.score) for k, r in trace.rewards.items() if r is not None})
        return Score(reward=float(trace.reward), metrics=metrics)


def data_json(data: Any) -> dict[str, Any]:
    """A task's data as JSON: the fields it was given (a field left at its default comes back as
    that default), each whole (a nested message keeps its `role`, the default its union is told
    apart by)."""
    full = data.model_dump(mode="json", exclude_none=True)
    return {k: v for k, v in full.items() if k in data.model_fields_set or k == "idx"}


def _dump(state: Any) -> Any:
    """A vf.State as JSON, or an error naming what does not encode."""
    try:
        return json.loads(state.model_dump_json())
    except Exception as e:
        raise EnvError(f"the episode's vf.State ({type(state).__name__}) does not encode as JSON, so it cannot "
                       f"be checkpointed: {e}") from None
