"""OpenEnv environments (`--env openenv:TARGET`, docs/guides/openenv.md).

An OpenEnv environment is a server: an `Environment` subclass with `reset(seed)` / `step(action)`
behind openenv-core's app, one stateful session per WebSocket connection (`/ws`: the server
keeps one environment instance per connection). rlboost's contract is the opposite: an
environment object keeps nothing of an episode outside its JSON `state`, and an episode may
continue in another process, after a SIGKILL. This adapter bridges the two the way the
textarena / gymnasium adapters do (rlboost/envs/adapters.py), with the server as the game:

- `state` holds what re-opens the episode: the reset seed (and extra reset arguments), the
  actions accepted so far, and a digest of the last observation.
- Each process keeps its open sessions as a cache, keyed by episode id and checked against
  `state` before use (same position, same digest, same event loop). Where it has none (the
  episode was opened by the trainer, handed over from another worker, or the server lost it),
  it opens a session by `reset(seed)` and replays the actions; the replay's last observation
  must match the digest (`on_diverge`). Every re-open with moves to replay is counted
  (`reopens`), and a session this process held that broke under it (server died or
  restarted) as well (`server_losses`): both reach the step rows as `env/reopens` and
  `env/server_losses` (Score.metrics).
- TARGET is a URL of a running server (`openenv:http://127.0.0.1:8000`), or a name whose server
  this process starts when it loads the environment and supervises (`[env.options] command =
  "python -m my_env.server"`): on a free loopback port of its own, restarted with backoff when it dies (one log line), killed
  with its process (PR_SET_PDEATHSIG). Every call is bounded (`call_timeout_s`), and a lost
  server is retried for `retry_s` (keep it under `env.tool_timeout_s`) before the episode ends
  with a one-line reason (the runner's `env_error`).
- The model's turn becomes the action: its text in the action's one string field (`action =
  "text"`, the field read from the server's `/schema` or named by `action_field`) or a JSON
  object it wrote (`action = "json"`). An action the server refuses (VALIDATION_ERROR) is the
  model's mistake: it reads an `error: ...` message and may try again (`invalid_actions`);
  an exception in the environment's `step` is the environment's: `env_error`.
- `tools = true`: an MCP environment's tools (a `list_tools` step at the opening) are the
  model's; each call is a `call_tool` step, recorded and replayed like any action, and a turn
  without calls ends the episode.
- The reward: each step's `reward` is the turn's reward (`Reply.turn_reward`); the episode's
  is their sum (`reward = "sum"`) or the last one (`"last"`). `score` reads state only, so the
  trainer scores without a server.

The WebSocket protocol is spoken with the `websockets` library (what openenv's own client
uses) instead of importing openenv's `GenericEnvClient`: `openenv.core` imports the whole server
stack with it (gradio among it: ~5 s and a few hundred MB in every worker process). The messages
are openenv's documented ones (`{"type": "reset" | "step" | "close", "data": ...}`).
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import OrderedDict, deque
from typing import Any

import msgspec

from rlboost.envs.protocol import (Context, Env, EnvError, Message, ModelTurn, Opening, Reply, Score, ToolCall,
                                   ToolResult, ToolSpec, in_thread, system, user)
from rlboost.errors import RlboostError
from rlboost.logs import get_logger

log = get_logger(component="openenv")

NOT_SHOWN = ("done", "reward", "metadata")  # observation fields that are not the text the model reads
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_URL = re.compile(r"^(https?|wss?)://[^\s/]+(/[^\s]*)?$")


class OpenEnvOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[env.options]` of `--env openenv:TARGET`."""

    command: str | list[str] = ""  # the server to start (a name TARGET); `{port}` / `{host}` substituted, `python` = this Python
    host: str = "127.0.0.1"  # where a started server listens
    port: int = 0  # 0: a free port per process (each process its own server); N: that port, shared where one answers
    start_timeout_s: float = 120.0  # a started server answers /health within this, or it is restarted
    call_timeout_s: float = 10.0  # one message to the server (connect, reset, one step)
    retry_s: float = 20.0  # a lost server is waited for this long per call, then the episode ends (env_error)
    max_sessions: int = 64  # open sessions this process keeps (least recently used closed first)
    idle_s: float = 300.0  # a session unused this long is closed
    action: str = "text"  # text: the model's text in one string field of the action | json: the model writes the action
    action_field: str = ""  # the action's field for text ("" = the action schema's only string field)
    observation_field: str = ""  # the observation's field shown to the model ("" = its only string field, else JSON)
    instructions: str = ""  # a system message before the first observation
    tools: bool = False  # an MCP environment: its tools (list_tools) are the model's, each call a step (call_tool)
    reward: str = "sum"  # the episode's reward: sum of the step rewards | last (the final step's)
    on_diverge: str = "error"  # a replay that does not reproduce the recorded observation: error (env_error) | continue
    max_message_mb: float = 16.0  # the largest message accepted from the server

    def __post_init__(self) -> None:
        for key, ok, why in (
                ("action", self.action in ("text", "json"), "text or json"),
                ("reward", self.reward in ("sum", "last"), "sum or last"),
                ("on_diverge", self.on_diverge in ("error", "continue"), "error or continue"),
                ("port", 0 <= self.port < 65536, "0 (a free port) to 65535"),
                ("start_timeout_s", self.start_timeout_s > 0, "> 0"), ("call_timeout_s", self.call_timeout_s > 0, "> 0"),
                ("retry_s", self.retry_s >= 0, ">= 0"), ("max_sessions", self.max_sessions >= 1, ">= 1"),
                ("idle_s", self.idle_s > 0, "> 0"), ("max_message_mb", self.max_message_mb > 0, "> 0")):
            if not ok:
                raise ValueError(f"{key} = {getattr(self, key)!r}: must be {why}")


class ServerLost(RlboostError):
    """The server did not answer: refused, closed, timed out. The episode re-opens elsewhere."""


class SessionLost(ServerLost):
    """A session this process held broke: the server may already be back (a restart)."""


class ServerBusy(ServerLost):
    """The server refused a new session: it is at capacity (openenv's max_concurrent_envs)."""


class ServerRefused(RlboostError):
    """The server answered an error message (`{"type": "error"}`), with openenv's code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} (code: {code})")
        self.code = code


def _websockets():
    try:
        from websockets.asyncio.client import connect
    except ImportError as e:
        raise EnvError(f"openenv environments need the websockets package: pip install 'rlboost[openenv]' ({e})") \
            from None
    return connect


def _http(url: str) -> str:
    return re.sub(r"^ws", "http", url.rstrip("/"))


def _healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{_http(url)}/health", timeout=timeout) as r:
            return r.status == 200
    except Exception:
        return False


def _death_signal():
    """A function for the server's process to run before exec: PR_SET_PDEATHSIG = SIGKILL, so it
    is killed with the thread that started it (the supervisor's, which lives as long as this
    process) and a SIGKILLed worker leaks no server. libc is loaded here, in the parent: the
    child of a threaded process must not import (another thread may have held the import lock
    at the fork). None where prctl is missing."""
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- servers


class UrlServer:
    """A server someone else runs: nothing to start or restart; a lost one is retried."""

    managed = False

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def describe(self) -> str:
        return self.url

    async def ready(self, timeout: float) -> str:
        return self.url


class ManagedServer:
    """A server this process starts from `command` and supervises from a thread of its own: a
    server that exits, or stops answering /health (`_watch`), is restarted with backoff (1 s
    doubling to 30 s, back to 1 s after a minute up), one log line each time; calls wait
    (bounded) for it to answer /health again."""

    managed = True

    def __init__(self, name: str, argv: list[str], host: str, port: int, start_timeout_s: float) -> None:
        self.name, self.argv, self.host, self.port, self.start_timeout_s = name, argv, host, port, start_timeout_s
        self.url, self.restarts, self.last_error = "", 0, ""
        self.downs: deque[str] = deque(maxlen=16)  # why the server went, the latest last
        self.log_path = os.path.join(tempfile.gettempdir(), f"rlboost-openenv-{name}-{os.getpid()}.log")
        self._ready, self._closing, self._lock = threading.Event(), threading.Event(), threading.Lock()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None

    def describe(self) -> str:
        return f"{self.name} ({shlex.join(self.argv)}; its output: {self.log_path})"

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    @property
    def pid(self) -> int | None:
        """The running server's process id (None before the first start)."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the server (once; it boots while the process loads the rest of its work)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._supervise, name=f"openenv-{self.name}", daemon=True)
                self._thread.start()
                atexit.register(self.close)

    async def ready(self, timeout: float) -> str:
        """The server's URL once it answers, waiting at most `timeout` (ServerLost after)."""
        self.start()
        deadline = time.monotonic() + timeout
        while not self._ready.is_set():
            if time.monotonic() >= deadline:
                raise ServerLost(f"the server is not up{': ' + self.last_error if self.last_error else ''}")
            await asyncio.sleep(0.05)  # polls a thread's event: the wait is bounded by the deadline
        return self.url

    def close(self) -> None:
        self._closing.set()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _argv(self, port: int) -> list[str]:
        sub = [a.replace("{port}", str(port)).replace("{host}", self.host) for a in self.argv]
        return sub if any("{port}" in a for a in self.argv) else sub + ["--port", str(port)]

    def _supervise(self) -> None:
        backoff = 1.0
        while not self._closing.is_set():
            port = self.port or _free_port(self.host)
            url = f"http://{self.host}:{port}"
            if self.port and _healthy(url):  # a fixed port another process's server already answers on: share it
                self.url = url
                self._ready.set()
                while not self._closing.is_set() and _healthy(url):
                    self._closing.wait(1.0)
                self._ready.clear()
                continue
            started = time.monotonic()
            with open(self.log_path, "ab") as out:
                try:
                    proc = subprocess.Popen(self._argv(port), stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, preexec_fn=_death_signal())
                except OSError as e:
                    proc, self.last_error = None, f"cannot run {shlex.join(self.argv)}: {e}"
            if proc is not None:
                self._proc = proc
                if self._wait_healthy(proc, url):
                    self.url, self.last_error = url, ""
                    self._ready.set()
                    if not self.restarts:  # a restart's one line is the warning below
                        log.info("openenv server up", server=self.name, url=url, pid=proc.pid)
                    self.last_error = self._watch(proc, url)
                    self._ready.clear()
                else:
                    proc.kill()
                    rc = proc.wait()
                    self.last_error = (f"the server exited with {rc} before answering" if rc != -signal.SIGKILL
                                       else f"the server did not answer /health within {self.start_timeout_s} s")
            if self._closing.is_set():
                return
            if time.monotonic() - started > 60:
                backoff = 1.0
            self.restarts += 1
            self.downs.append(self.last_error)
            log.warning("openenv server down, restarting", server=self.name, why=self.last_error, in_s=backoff,
                        output=self.log_path)
            self._closing.wait(backoff)
            backoff = min(2 * backoff, 30.0)

    HEALTH_EVERY_S, HEALTH_TIMEOUT_S, HEALTH_MISSES = 5.0, 5.0, 3

    def _watch(self, proc: subprocess.Popen, url: str) -> str:
        """Until the server exits, or stops answering /health (HEALTH_MISSES probes in a row,
        HEALTH_TIMEOUT_S each: a frozen or deadlocked server, whose calls would only time out),
        then it is killed. Why it went."""
        misses = 0
        while True:
            try:
                return f"the server exited with {proc.wait(timeout=self.HEALTH_EVERY_S)}"
            except subprocess.TimeoutExpired:
                pass
            if self._closing.is_set():
                return "closed"
            misses = 0 if _healthy(url, timeout=self.HEALTH_TIMEOUT_S) else misses + 1
            if misses >= self.HEALTH_MISSES:
                proc.kill()
                proc.wait()
                return f"the server stopped answering /health ({misses} probes of {self.HEALTH_TIMEOUT_S} s): killed"

    def _wait_healthy(self, proc: subprocess.Popen, url: str) -> bool:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline and not self._closing.is_set():
            if proc.poll() is not None:
                return False
            if _healthy(url, timeout=min(2.0, self.start_timeout_s)):
                return True
            self._closing.wait(0.1)
        return False


_SERVERS: dict[tuple, ManagedServer] = {}  # one started server per command in a process, whatever loads it
_SERVERS_LOCK = threading.Lock()


def managed_server(name: str, argv: list[str], host: str, port: int, start_timeout_s: float) -> ManagedServer:
    with _SERVERS_LOCK:
        key = (tuple(argv), host, port)
        if key not in _SERVERS or _SERVERS[key].closed:  # a closed one stays closed: a new one replaces it
            _SERVERS[key] = ManagedServer(name, argv, host, port, start_timeout_s)
        return _SERVERS[key]


# ---------------------------------------------------------------- sessions


class Session:
    """One open WebSocket session (one environment instance on the server), at `steps` actions
    into its episode with the last observation's `digest`. Usable only on the loop it opened on."""

    def __init__(self, ws: Any, url: str, timeout: float) -> None:
        self.ws, self.url, self.timeout = ws, url, timeout
        self.loop = asyncio.get_running_loop()
        self.steps, self.digest, self.used = 0, "", time.monotonic()

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message, read its answer (bounded): the answer's data, ServerRefused for an
        error answer, ServerLost when the connection fails or the answer does not come."""
        import websockets.exceptions as wse

        try:
            try:
                await asyncio.wait_for(self.ws.send(json.dumps(message)), self.timeout)
            except wse.ConnectionClosed:
                pass  # the server may have said why before it closed (at capacity): its message is read below
            raw = await asyncio.wait_for(self.ws.recv(), self.timeout)
        except (asyncio.TimeoutError, TimeoutError):
            raise ServerLost(f"no answer to {message['type']} within call_timeout_s = {self.timeout} s") from None
        except (OSError, wse.WebSocketException) as e:
            raise ServerLost(f"{type(e).__name__}: {e}") from None
        try:
            answer = json.loads(raw)
            kind, data = answer["type"], answer.get("data") or {}
            if not isinstance(data, dict):
                raise TypeError(f"data is {type(data).__name__}")
        except Exception as e:
            raise EnvError(f"the openenv server answered something that is not an openenv message ({e!r})") from None
        if kind == "error":
            raise ServerRefused(str(data.get("code", "UNKNOWN")), str(data.get("message", ""))[:500])
        return data

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.ws.send(json.dumps({"type": "close"})), 2.0)
            await asyncio.wait_for(self.ws.close(), 2.0)
        except BaseException:  # best effort: a dead session has nothing to close
            pass


def _result(data: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
    """An observation answer, checked: (observation, reward, done)."""
    obs, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
    if not isinstance(obs, dict) or not isinstance(done, bool) or not (
            reward is None or isinstance(reward, (int, float))):
        raise EnvError(f"the openenv server answered a malformed observation: {json.dumps(data)[:200]}")
    if reward is not None and not abs(float(reward)) < float("inf"):
        raise EnvError(f"the openenv server answered a reward that is not finite: {reward!r}")
    return obs, (None if reward is None else float(reward)), done


def _digest(obs: dict[str, Any], reward: float | None, done: bool) -> str:
    """What a replay must reproduce: the observation (its metadata aside), reward and done."""
    shown = {k: v for k, v in obs.items() if k != "metadata"}
    blob = json.dumps([shown, reward, done], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the environment


class OpenEnvEnv(Env):
    """An OpenEnv server's environment as an rlboost environment (the module's docstring)."""

    def __init__(self, name: str, server: UrlServer | ManagedServer, options: OpenEnvOptions) -> None:
        self.name, self.server, self.o = f"openenv/{name}", server, options
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._field = options.action_field
        self._gave_up_at = float("-inf")  # when a call last waited retry_s for the server in vain

    # -------------------------------------------------------- protocol

    def rows(self, split: str = "train", n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
        """Reset seeds as rows; the held-out split takes its own seed range."""
        if split not in ("train", "test"):
            raise ValueError(f"split {split!r}: train or test")
        base = (1 << 30 if split == "test" else 0) + seed * n
        return [{"seed": base + i, "data_source": self.name} for i in range(n)]

    async def start(self, row: dict[str, Any], ctx: Context) -> Opening:
        reset = row.get("reset") or {}
        if not isinstance(reset, dict):
            raise EnvError(f"a row's reset must be an object of reset arguments, not {type(reset).__name__}")
        # a row without a seed gets one from its content: every episode of its group plays the same game
        seed = int(row["seed"]) if "seed" in row else int(hashlib.sha256(
            json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:8], 16)
        state = {"seed": seed % (1 << 31), "reset": reset, "actions": [], "rewards": [], "done": False, "digest": "",
                 "reopens": 0, "server_losses": 0, "invalid_actions": 0, "diverged": 0,
                 "mark": 0}  # with tools: the steps before the current model turn's
        # the episode's turns are played wherever a worker takes them: this session only reads the opening
        obs, tools = await self._retrying(ctx.episode_id, state, self._opening, ctx.episode_id, state)
        messages = ([system(self.o.instructions)] if self.o.instructions else []) + [user(self._text(obs))]
        return Opening(messages=messages, tools=tools, state=state)

    async def _opening(self, episode_id: str, state: dict[str, Any]) -> tuple[dict[str, Any], list[ToolSpec]]:
        sess, obs = await self._open(episode_id, state)
        try:
            if not self.o.tools:
                return obs, []
            try:  # MCP's tools/list as a step: it reads, the episode's replay does not need it
                listed = _result(await sess.request({"type": "step", "data": {"type": "list_tools"}}))[0]
            except ServerRefused as e:
                raise EnvError(f"openenv: tools = true, but the server lists no tools ({e})") from None
            try:
                return obs, [ToolSpec(name=str(t["name"]), description=str(t.get("description") or ""),
                                      parameters=t.get("input_schema") or {"type": "object", "properties": {}})
                             for t in listed["tools"]]
            except (KeyError, TypeError) as e:
                raise EnvError(f"openenv: the server's tool list is malformed ({e!r})") from None
        finally:
            await sess.close()

    async def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult:
        """A tool call is a step (`call_tool`): recorded and replayed like any action."""
        new = {**state}
        action = {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
        try:
            obs, _, done = await self._retrying(ctx.episode_id, new, self._step, ctx.episode_id, new, action)
        except ServerRefused as e:  # nothing happened on the server (a re-open before it is counted)
            return ToolResult(content=f"error: the environment refused the call: {e}", error=True, state=new,
                              set_state=True)
        error = obs.get("error")
        if error:
            message = error.get("message", error) if isinstance(error, dict) else error
            return ToolResult(content=f"error: {message}", error=True, state=new, set_state=True, end=done)
        return ToolResult(content=_tool_text(obs.get("result")), state=new, set_state=True, end=done)

    async def respond(self, transcript: list[Message], turn: ModelTurn, state: Any, ctx: Context) -> Reply:
        new = {**state}
        if self.o.tools:  # the turn's tool calls were its steps: their rewards are its reward
            rewards = [r for r in state["rewards"][state["mark"]:] if r is not None]
            new["mark"] = len(state["rewards"])
            return Reply(done=state["done"] or not (turn.tool_calls or turn.errors),
                         turn_reward=sum(rewards) if rewards else None, state=new, set_state=True)
        if state["done"]:
            return Reply(done=True)
        action, problem = await self._action(turn.text or turn.raw)
        if problem:
            new["invalid_actions"] += 1
            return Reply(messages=[user(f"error: {problem}")], state=new, set_state=True)
        try:
            obs, reward, done = await self._retrying(ctx.episode_id, new, self._step, ctx.episode_id, new, action)
        except ServerRefused as e:  # the action does not fit the environment's schema: the model's mistake
            new["invalid_actions"] += 1
            return Reply(messages=[user(f"error: the environment refused the action: {e}")], state=new,
                         set_state=True)
        return Reply(messages=[] if done else [user(self._text(obs))], done=done, turn_reward=reward, state=new,
                     set_state=True)

    def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score:
        rewards = [r for r in state["rewards"] if r is not None]
        reward = sum(rewards) if self.o.reward == "sum" else (rewards[-1] if rewards else 0.0)
        return Score(reward=float(reward), metrics={
            "reopens": float(state["reopens"]), "server_losses": float(state["server_losses"]),
            "invalid_actions": float(state["invalid_actions"]), "diverged": float(state["diverged"]),
            "steps": float(len(state["actions"])), "finished": float(bool(state["done"]))})

    # -------------------------------------------------------- sessions

    async def _retrying(self, episode_id: str, state: dict[str, Any], fn, *args: Any) -> Any:
        """`fn(*args)` until it works, the server lost and found again for at most `retry_s`:
        a server that stays down ends the call with a one-line EnvError (the episode's env_error)."""
        deadline, pause = time.monotonic() + self.o.retry_s, 0.2
        while True:
            try:
                out = await fn(*args)
                self._gave_up_at = float("-inf")
                return out
            except ServerLost as e:
                left = deadline - time.monotonic()
                # a server found down by a call that waited it out is not waited for again by the
                # next one for retry_s (one try each): a run of rows against a dead server fails
                # row by row in milliseconds, not retry_s each
                # (a held session that broke is not that: the server may be back, so re-open first)
                recent = time.monotonic() - self._gave_up_at < self.o.retry_s and not isinstance(e, SessionLost)
                if left <= 0 or recent:
                    if not recent:
                        self._gave_up_at = time.monotonic()
                    what = "gave no session" if isinstance(e, ServerBusy) else "unreachable"
                    raise EnvError(f"openenv server {self.server.describe()} {'still ' if recent else ''}{what} "
                                   f"{'after' if recent else 'for'} retry_s = {self.o.retry_s} s: {e}") from None
                if self.server.managed:
                    try:
                        await self.server.ready(left)
                    except ServerLost:
                        continue  # the deadline says when to stop
                # a server that answers but refused (at capacity) or one someone else runs: back off
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(2 * pause, 2.0)

    async def _connect(self) -> Session:
        url = await self.server.ready(self.o.call_timeout_s)
        connect = _websockets()
        ws_url = re.sub(r"^http", "ws", url) + "/ws"
        try:
            ws = await connect(ws_url, open_timeout=self.o.call_timeout_s, close_timeout=2,
                               max_size=int(self.o.max_message_mb * (1 << 20)), proxy=None)
        except (asyncio.TimeoutError, TimeoutError, OSError) as e:
            raise ServerLost(f"cannot connect to {ws_url}: {type(e).__name__}: {e}") from None
        except Exception as e:  # a handshake refused (HTTP status), a bad URL: websockets' own errors
            raise ServerLost(f"cannot connect to {ws_url}: {type(e).__name__}: {e}") from None
        return Session(ws, url, self.o.call_timeout_s)

    async def _open(self, episode_id: str, state: dict[str, Any]) -> tuple[Session, dict[str, Any]]:
        """A new session at `state`'s position: reset(seed) then the actions so far, replayed;
        the last observation must be the one recorded (`on_diverge`). Counts `reopens`."""
        sess = await self._connect()
        try:
            data = await sess.request({"type": "reset", "data": {**state["reset"], "seed": state["seed"]}})
        except ServerRefused as e:
            await sess.close()
            if e.code != "CAPACITY_REACHED":
                raise EnvError(f"openenv reset refused: {e}") from None
            await self._evict(1)  # room on the server: our least recently used session goes, if we hold one
            raise ServerBusy(f"the server is at capacity ({e}): raise its max_concurrent_envs, or lower "
                             "[env.options] max_sessions") from None
        except BaseException:
            await sess.close()
            raise
        try:
            obs, reward, done = _result(data)
            for action in state["actions"]:
                try:
                    obs, reward, done = _result(await sess.request({"type": "step", "data": action}))
                except ServerRefused as e:
                    raise EnvError(f"openenv replay: the server refused a recorded action: {e}") from None
        except BaseException:
            await sess.close()
            raise
        digest = _digest(obs, reward, done)
        if state["digest"] and digest != state["digest"]:
            if self.o.on_diverge == "error":
                await sess.close()
                raise EnvError(f"openenv replay diverged after {len(state['actions'])} actions: reset(seed="
                               f"{state['seed']}) and the same actions gave another observation (the environment "
                               "is not deterministic for a seed; on_diverge = \"continue\" plays on from it)")
            state["diverged"] += 1
        if state["actions"]:
            state["reopens"] += 1
        state["digest"] = digest
        sess.steps, sess.digest = len(state["actions"]), digest
        return sess, obs

    async def _step(self, episode_id: str, state: dict[str, Any], action: dict[str, Any]):
        """One action in the episode's session (the cached one if it is where `state` is, else a
        re-opened one); `state` takes the result. ServerRefused: the action was refused."""
        sess = self._sessions.pop(episode_id, None)
        held = sess is not None and sess.loop is asyncio.get_running_loop() and sess.steps == len(
            state["actions"]) and sess.digest == state["digest"]
        if sess is not None and not held and sess.loop is asyncio.get_running_loop():
            await sess.close()  # behind or ahead of the state (a turn redone after a hand-off): replaced
        if not held:
            sess, _ = await self._open(episode_id, state)
        try:
            data = await sess.request({"type": "step", "data": action})
        except ServerLost as e:
            await sess.close()
            if held:
                state["server_losses"] += 1  # this process had the episode open and the server lost it
                raise SessionLost(str(e)) from None
            raise
        except ServerRefused as e:
            if e.code in ("VALIDATION_ERROR", "INVALID_JSON"):
                self._sessions[episode_id] = sess  # nothing happened on the server: the session is still in step
                raise
            await sess.close()
            raise EnvError(f"openenv step failed: {e}") from None
        except BaseException:  # cancelled (the runner's timeout) mid-call: the session's position is unknown
            await sess.close()
            raise
        obs, reward, done = _result(data)
        state["actions"] = state["actions"] + [action]
        state["rewards"] = state["rewards"] + [reward]
        state["done"], state["digest"] = done, _digest(obs, reward, done)
        sess.steps, sess.digest, sess.used = len(state["actions"]), state["digest"], time.monotonic()
        if done:
            await sess.close()
        else:
            self._sessions[episode_id] = sess
            await self._evict(0)
        return obs, reward, done

    async def _evict(self, at_least: int) -> None:
        """Close sessions past `max_sessions`, idle past `idle_s`, and `at_least` more (oldest first)."""
        loop, now = asyncio.get_running_loop(), time.monotonic()
        while self._sessions:
            eid, sess = next(iter(self._sessions.items()))
            if not (at_least > 0 or len(self._sessions) > self.o.max_sessions or now - sess.used > self.o.idle_s):
                break
            del self._sessions[eid]
            at_least -= 1
            if sess.loop is loop:  # another loop's session cannot be awaited here: it is only forgotten
                await sess.close()

    # -------------------------------------------------------- text <-> actions, observations

    async def _action(self, text: str) -> tuple[dict[str, Any], str]:
        """The action the model's text stands for, or why there is none (the model is told)."""
        if self.o.action == "json":
            found = text.strip()
            if not found.startswith("{"):
                found = found[found.find("{"):found.rfind("}") + 1] if "{" in found else ""
            try:
                action = json.loads(found)
            except ValueError:
                action = None
            if not isinstance(action, dict):
                return {}, "write the action as one JSON object"
            return action, ""
        if not self._field:
            self._field = await self._text_field()
        return {self._field: text}, ""

    async def _text_field(self) -> str:
        """The action schema's only string field (GET /schema), else a one-line error."""
        url = await self._retrying("", {}, self.server.ready, self.o.retry_s)

        def fetch() -> Any:
            with urllib.request.urlopen(f"{_http(url)}/schema", timeout=self.o.call_timeout_s) as r:
                return json.loads(r.read(1 << 20))

        try:
            schema = await in_thread(fetch)
            props = {k: v for k, v in schema["action"]["properties"].items() if k != "metadata"}
        except Exception as e:
            raise EnvError(f"openenv: cannot read the action schema from {url}/schema ({e!r}); "
                           "set [env.options] action_field") from None
        strings = [k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"]
        if len(strings) != 1:
            raise EnvError(f"openenv: the action has {len(strings)} string fields ({', '.join(strings) or 'none'}; "
                           f"all: {', '.join(props) or 'none'}): name the one for the model's text with "
                           "[env.options] action_field, or action = \"json\"")
        return strings[0]

    def _text(self, obs: dict[str, Any]) -> str:
        if self.o.observation_field:
            if self.o.observation_field not in obs:
                raise EnvError(f"openenv: the observation has no field {self.o.observation_field!r} "
                               f"(it has {', '.join(obs) or 'none'})")
            value = obs[self.o.observation_field]
            return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        shown = {k: v for k, v in obs.items() if k not in NOT_SHOWN}
        if len(shown) == 1 and isinstance(next(iter(shown.values())), str):
            return next(iter(shown.values()))
        return json.dumps(shown, sort_keys=True, default=str)


def _tool_text(result: Any) -> str:
    """An MCP tool result as the model reads it: its text contents, else its data, else JSON."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        texts = [c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict) and c.get("type") == "text"]
        if texts:
            return "\n".join(texts)
        if result.get("data") is not None:
            data = result["data"]
            return data if isinstance(data, str) else json.dumps(data, sort_keys=True, default=str)
    return json.dumps(result, sort_keys=True, default=str)


def _command(command: str | list[str]) -> list[str]:
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise EnvError("openenv command: empty")
    # `python` is the Python running rlboost: a worker's PATH need not hold the virtualenv's
    argv = [sys.executable if a in ("python", "python3", "{python}") else a for a in argv[:1]] + argv[1:]
    if shutil.which(argv[0]) is None:
        raise EnvError(f"openenv command {argv[0]!r}: no such program")
    return argv


def load(target: str, **options: Any) -> OpenEnvEnv:
    """`--env openenv:TARGET` with `[env.options]`: TARGET a server's URL, or a name whose server
    `command` starts (one per process, supervised)."""
    try:
        o = msgspec.convert(options, OpenEnvOptions)
    except msgspec.ValidationError as e:
        raise EnvError(f"openenv:{target}: [env.options] {e}") from None
    if _URL.match(target):
        if o.command:
            raise EnvError(f"openenv:{target}: a URL names a running server; command starts one: give one of them")
        return OpenEnvEnv(re.sub(r"^\w+://", "", target).rstrip("/"), UrlServer(target), o)
    if not _NAME.match(target):
        raise EnvError(f"openenv:{target}: not a URL (http://HOST:PORT) nor a name (letters, digits, _ . -)")
    if not o.command:
        raise EnvError(f"openenv:{target}: name the server to start ([env.options] command = \"python -m ...\") "
                       f"or give its URL (openenv:http://HOST:PORT)")
    server = managed_server(target, _command(o.command), o.host, o.port, o.start_timeout_s)
    # started now, not at the first call: a worker loads its environment before it takes work,
    # so the server boots (openenv-core's imports take seconds) while the worker loads its model,
    # and the first episode's call does not spend its env.tool_timeout_s waiting for it
    server.start()
    return OpenEnvEnv(target, server, o)
