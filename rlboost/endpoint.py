"""`rlboost serve-openai`: an OpenAI-compatible chat-completions endpoint backed by the dataflow.

An agent loop rlboost does not own (the `verifiers` harness, OpenEnv, a user's own scaffold)
points its OpenAI client at this server and drives episodes; every call is a rollout request
like any other:

1. the messages (and `tools=`) become prompt token ids through the model's own chat template
   (`rlboost.envs.chat.chat_format`: the template where the tokenizer has one, else the
   documented fallback);
2. one `wire.RolloutRequest` per choice (`n`) is published through the `PoolClient` on the
   pool's work queue, under the latest published policy version; a worker claims it, generates
   and checkpoints every K tokens in Redis, so a worker lost mid-turn costs at most K tokens
   (none with notice) and another worker finishes the turn: the call just takes longer;
3. the result is taken only once `PoolClient.verify_result` agrees with the checkpoint
   (tokens, logprobs, lease, segments), decoded and parsed for tool calls in the template's
   syntax, and recorded: one JSON line per choice in `<run dir>/sessions/<session>.jsonl`,
   fsynced before the answer goes out (so every answered call is on disk);
4. the answer is the OpenAI response shape plus an `rlboost` field with the request ids, token
   ids, logprobs and policy versions.

Why a JSONL per session and not the results stream alone: the results stream already holds
every call's tokens durably (and `rlboost replay` reads it), but not what makes a call part of
an episode: the session, the call's turn in it, the parsed tool calls and the reward the
harness reports (`POST /v1/rlboost/sessions/{id}/reward`). Those are facts only the endpoint
knows; one file per session, in call order, is what a trainer reads as an episode
(`read_sessions`), without NATS, and the token-level truth in it was checked against Redis
before it was written.

Guarantees (docs/guides/agent-harnesses.md): a model turn is durable (checkpointed tokens,
resumed on any worker); the harness's own state (its loop, its tools' side effects, the
conversation it holds) is not: a harness that dies loses its episode. A call the endpoint never
answered (it died) is the harness's to retry; with the same `Idempotency-Key` header the retry
names the same requests, so the turn comes from its checkpoint instead of being generated again.

HTTP: HTTP/1.1 with keep-alive, parsed by h11 (the sans-IO parser httpx and uvicorn use; pure
Python, no dependencies) over asyncio streams. Bodies are bounded (`endpoint.max_body_bytes`),
as are header sizes, idle connections and the calls waiting at once; nothing a client sends
can end the server: every failure is answered as an OpenAI error object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11

from rlboost import bus, metrics, wire
from rlboost.clients import Clients
from rlboost.config import EndpointSettings, Settings
from rlboost.envs.chat import ChatFormat, chat_format
from rlboost.envs.protocol import Message, ToolCall, ToolSpec
from rlboost.errors import RlboostError
from rlboost.logs import get_logger
from rlboost.pool_client import PoolClient

RECORD_VERSION = 1  # the schema of a session file's lines (`read_sessions`)
SESSION_HEADERS = ("x-session-id", "x-episode-id")
IDLE_TIMEOUT_S = 120.0  # a keep-alive connection with nothing to say for this long is closed
MAX_HEADER_BYTES = 64 << 10
MAX_STOP = 4
MAX_CONNECTIONS = 1024  # open HTTP connections; a client past it is answered 503
_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
_ROUTE_REWARD = re.compile(r"/v1/rlboost/sessions/([^/]+)/reward")


class EndpointError(RlboostError, ValueError):
    """A call the endpoint refuses, with the HTTP status and the OpenAI error type to answer."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind


def _bad(message: str, param: str | None = None) -> EndpointError:
    return EndpointError(message, 400, param)


# ---------------------------------------------------------------- the OpenAI request


def _text(value: Any, where: str) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{i}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported", where)
            out.append(part["text"])
        return "".join(out)
    raise _bad(f"{where} must be a string, null or a list of text parts, got {type(value).__name__}", where)


def _call_arguments(value: Any, where: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _bad(f"{where} is not valid JSON ({e})", where) from None
    if not isinstance(value, dict):
        raise _bad(f"{where} must be a JSON object", where)
    return value


def parse_messages(raw: Any) -> list[Message]:
    """OpenAI chat messages as the protocol's `Message`s; EndpointError naming what is wrong."""
    if raw is None:
        raise _bad("'messages' is required: a non-empty list of chat messages", "messages")
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty list of chat messages", "messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object with a 'role'", where)
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant", "tool"):
            raise _bad(f"{where}.role {role!r}: use system, developer, user, assistant or tool", f"{where}.role")
        content = _text(m.get("content"), f"{where}.content")
        calls: list[ToolCall] = []
        if role == "assistant" and m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list):
                raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            for j, c in enumerate(m["tool_calls"]):
                w = f"{where}.tool_calls[{j}]"
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise _bad(f"{w} needs a function with a name", w)
                calls.append(ToolCall(key=str(c.get("id") or f"call-{i}-{j}"), name=fn["name"], index=j,
                                      arguments=_call_arguments(fn.get("arguments"), f"{w}.function.arguments")))
        tool_call_id = m.get("tool_call_id") or ""
        name = m.get("name") or ""
        if not isinstance(tool_call_id, str) or not isinstance(name, str):
            raise _bad(f"{where}: tool_call_id and name must be strings", where)
        out.append(Message(role=role, content=content, tool_calls=calls,
                           tool_call_id=tool_call_id if role == "tool" else "", name=name if role == "tool" else ""))
    return out


def parse_tools(raw: Any) -> list[ToolSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", f"tools[{i}]")
        params = fn.get("parameters") if fn.get("parameters") is not None else {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise _bad(f"tools[{i}].function.description must be a string", f"tools[{i}]")
        out.append(ToolSpec(name=fn["name"], description=desc, parameters=params))
    return out


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v > hi or v < lo or (lo_open and v == lo):
        raise _bad(f"'{key}' must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"'{key}' must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


@dataclass
class ChatCall:
    """A validated chat-completions call."""

    messages: list[Message]
    tools: list[ToolSpec]
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    seed: int | None
    stop: list[str]
    logprobs: bool
    model: str


# accepted only at their neutral value (a harness may send it); parallel_tool_calls is ignored
_UNSUPPORTED_DEFAULTS = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "top_logprobs": 0}


def parse_call(body: Any, cfg: EndpointSettings) -> ChatCall:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if body.get("stream"):
        raise _bad("stream=true is not supported: this endpoint answers whole (non-streaming) responses; "
                   "send stream=false or leave it out", "stream")
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        if body.get(key) not in (None, default):
            raise _bad(f"'{key}' is not supported (rollout engines sample from the plain distribution and record "
                       "the sampled token's logprob only)", key)
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise _bad("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")
    tool_choice = body.get("tool_choice")
    if tool_choice not in (None, "auto", "none"):
        raise _bad("'tool_choice' may be \"auto\" or \"none\": forcing a call needs constrained decoding, "
                   "which rollout engines do not do", "tool_choice")
    messages = parse_messages(body.get("messages"))
    tools = [] if tool_choice == "none" else parse_tools(body.get("tools"))
    mt = _integer(body, "max_completion_tokens", 1, cfg.max_tokens)
    if mt is None:
        mt = _integer(body, "max_tokens", 1, cfg.max_tokens)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _bad(f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("'logprobs' must be true or false", "logprobs")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    return ChatCall(messages=messages, tools=tools, max_tokens=mt if mt is not None else cfg.default_max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                    n=_integer(body, "n", 1, cfg.max_n) or 1, seed=seed, stop=stop, logprobs=bool(logprobs),
                    model=model or cfg.model_name)


def _choice_seed(seed: int | None, choice: int) -> int:
    """The sampling key of one choice: derived from the call's seed (the same seed, the same
    choices: a rerun reproduces them), or fresh."""
    if seed is None:
        return secrets.randbits(63)
    digest = hashlib.sha256(f"{seed}/{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def session_id(headers: dict[str, str], body: Any) -> str:
    """The episode a call belongs to: the X-Session-Id (or X-Episode-Id) header, else the body's
    `user` (hashed when it is not a plain id), else `default`."""
    for h in SESSION_HEADERS:
        if h in headers:
            value = headers[h]
            if not _NAME.fullmatch(value):
                raise _bad(f"the {h} header must be 1-128 of [A-Za-z0-9_-], got {value[:64]!r}")
            return value
    user = body.get("user") if isinstance(body, dict) else None
    if isinstance(user, str) and user:
        return user if _NAME.fullmatch(user) else "u-" + hashlib.sha256(user.encode()).hexdigest()[:16]
    return "default"


def conversation_digest(messages: list[Message], tools: list[ToolSpec]) -> str:
    """What identifies a conversation (messages and tools, tool-call indices aside): a call whose
    messages are an earlier call's plus its answer continues that call's token stream."""
    canon = [{"role": m.role, "content": m.content, "tool_call_id": m.tool_call_id, "name": m.name,
              "calls": [[c.key, c.name, c.arguments] for c in m.tool_calls]} for m in messages]
    data = json.dumps({"messages": canon, "tools": [t.openai() for t in tools]}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(data.encode()).hexdigest()[:32]


MAX_SESSIONS_CACHED = 4096  # sessions whose last answer is kept in memory (the rest re-read their file)


def _stream(rec: dict) -> list[int]:
    """The token stream a recorded call leaves for the next call to extend: its prompt, its
    completion and, for a turn cut by max_tokens, the end-of-turn token that closes it."""
    return rec["prompt_ids"] + rec["completion_ids"] + rec.get("closing_ids", [])


@dataclass
class _SessionState:
    next_turn: int = 0
    # conversation digest (the call's messages + one choice's answer) -> (that stream's tokens, request id)
    tails: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    recorded: dict[str, int] = field(default_factory=dict)  # request id -> turn, of every recorded call


# ---------------------------------------------------------------- session records


@dataclass
class Session:
    """One session file, read back: its calls (one dict per choice, in call order) and the last
    reward the harness reported (None: none yet)."""

    session: str
    calls: list[dict] = field(default_factory=list)
    reward: float | None = None
    metrics: dict = field(default_factory=dict)
    done: bool = False

    def results(self) -> list[wire.RolloutResult]:
        """The session's calls as the trainer takes rollouts (`GRPOTrainer.add_group`): one
        result per recorded choice the engine served, each its call's prompt and completion with
        the behaviour logprobs and the segments (who generated which tokens, with which version:
        the per-token staleness). Every call's prompt holds the turns before it, and prompts are
        never trained, so training each call with its session's reward trains the episode's model
        tokens and nothing the harness added."""
        return [wire.RolloutResult(
            request_id=c["request_id"], step=c["step"], group=c["group"], prompt_ids=c["prompt_ids"],
            token_ids=c["completion_ids"], logprobs=c["logprobs"], finish_reason=c["finish_reason"],
            segments=[wire.Segment(offset=g["offset"], worker_id=g["worker_id"], epoch=g["epoch"],
                                   policy_version=g["policy_version"], weights=g["weights"],
                                   kind=g.get("kind", "model")) for g in c["segments"]],
            worker_id=c["worker_id"], epoch=c["epoch"], ts=c["ts"]) for c in self.calls if c["finish_reason"] != "error"]

    def episode(self) -> dict | None:
        """The session as one token stream, as the native episode protocol records it: the last
        call's prompt and completion, where every call's prompt continued the one before it
        (`extends`: its tokens start with the previous call's prompt and completion, exactly).
        `mask` is 1 on the model's tokens (each call's completion), 0 on the prompt and on what
        the harness added between calls (tool results, user turns): those are never trained.
        `logprobs` and `token_versions` are the engines' on model tokens (0.0 and -1 elsewhere).
        The chain is followed back from the last call: where the harness rewrote its history,
        the stream starts at the first call after the rewrite (`request_ids` says which calls it
        holds). None when a call it names is not in the file, or when one of its calls was one
        the engine could not serve (`finish_reason` error: nothing to train on)."""
        if not self.calls:
            return None
        by_id = {c["request_id"]: c for c in self.calls}
        chain = [self.calls[-1]]
        while chain[-1].get("extends"):
            prev = by_id.get(chain[-1]["extends"]["request_id"])
            if prev is None:
                return None
            chain.append(prev)
        chain.reverse()
        if any(c["finish_reason"] == "error" for c in chain):
            return None
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for c in chain:
            if c["prompt_ids"][:len(ids)] != ids:
                return None
            new = c["prompt_ids"][len(ids):]
            ids += new + c["completion_ids"]
            mask += [0] * len(new) + [1] * len(c["completion_ids"])
            logprobs += [0.0] * len(new) + list(c["logprobs"])
            versions += [-1] * len(new) + list(c["token_versions"])
        return {"session": self.session, "token_ids": ids, "mask": mask, "logprobs": logprobs,
                "token_versions": versions, "request_ids": [c["request_id"] for c in chain],
                "prompt_tokens": len(chain[0]["prompt_ids"]), "reward": self.reward}


def read_session(path: str | os.PathLike[str]) -> Session:
    """A session file's records. A last line cut short (the endpoint died while writing it; its
    call was never answered) is skipped; any other line that does not parse raises."""
    p = Path(path)
    out = Session(session=p.stem)
    lines = p.read_bytes().split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: the torn tail of a write that never finished
                break
            raise EndpointError(f"{p}: line {i + 1} is not JSON") from None
        if rec.get("kind") == "call":
            out.calls.append(rec)
        elif rec.get("kind") == "reward":
            out.reward, out.metrics, out.done = rec.get("reward"), rec.get("metrics") or {}, bool(rec.get("done"))
    return out


def read_sessions(run_dir: str | os.PathLike[str]) -> list[Session]:
    """Every session an endpoint recorded under `run_dir`, by session id."""
    return [read_session(p) for p in sorted((Path(run_dir) / "sessions").glob("*.jsonl"))]


def _cut_torn_tail(path: Path) -> None:
    """An endpoint that died while writing a line left it without its newline (that call was
    never answered): cut it off before appending, or the next line would be glued to it."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


def _append_lines(path: Path, lines: list[dict]) -> None:
    data = b"".join(json.dumps(rec, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for rec in lines)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the endpoint


class OpenAIEndpoint:
    """The server. `start()` binds and begins following results; `close()` stops both."""

    def __init__(self, clients: Clients, cfg: EndpointSettings, tokenizer, stop_ids: list[int], run_dir: str | Path,
                 *, token: str = "", max_context: int = 0, fmt: ChatFormat | None = None) -> None:
        self.c, self.cfg = clients, cfg
        self.tokenizer = tokenizer
        self.fmt = fmt or chat_format(tokenizer)
        self.stops = list(dict.fromkeys([*stop_ids, *self.fmt.stop_ids]))
        self.max_context = max_context
        self.token = token
        self.run_dir = Path(run_dir)
        (self.run_dir / "sessions").mkdir(parents=True, exist_ok=True)
        self.run_id = wire.new_run_id()  # request ids of this life never collide with an earlier one's
        self.manager = PoolClient(clients, cfg.pool)
        self.step = cfg.step
        self.log = get_logger(component="endpoint", run_id=self.run_id, pool=cfg.pool)
        self._pending: dict[str, tuple[wire.RolloutRequest, asyncio.Future]] = {}
        self._calls = 0
        self._sessions: dict[str, _SessionState] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._inflight = 0
        self._server: asyncio.Server | None = None
        self._follower: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()
        self._policy_kv = None
        self.address: tuple[str, int] = ("", 0)

    # ------------------------------------------------------------ life

    async def start(self) -> tuple[str, int]:
        if not self.token and not _loopback(self.cfg.host):
            raise EndpointError(f"endpoint.host {self.cfg.host!r} is not a loopback address: set a token in "
                                f"${self.cfg.token_env} first (an open endpoint spends the pool's GPUs)")
        self._start_seq = (await self.c.js.stream_info(wire.STREAM_RESULTS)).state.last_seq + 1
        self._sub = await self._subscribe(self._start_seq)
        self._follower = asyncio.create_task(self._follow())
        self._server = await asyncio.start_server(self._connection, self.cfg.host, self.cfg.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)
        self.log.info("serving", host=host, port=port, step=self.step, run_dir=str(self.run_dir),
                      auth=bool(self.token), chat_format=getattr(self.fmt, "name", "?"))
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def _subscribe(self, start_seq: int):
        from nats.js.api import ConsumerConfig, DeliverPolicy

        return await self.c.js.subscribe(
            wire.result_subject(self.step), stream=wire.STREAM_RESULTS, ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq))

    async def _follow(self) -> None:
        """One follower of the endpoint's results subject for every call (not one per call from
        the stream's start): each result is verified against its checkpoint, then handed to the
        call waiting for it. The checkpoint scripts are loaded again every few seconds (a
        restarted Redis forgets them, and workers may only run them)."""
        scripts_at = 0.0
        seen = 0  # the stream sequence of the last result taken off the subscription
        while True:
            if time.monotonic() - scripts_at > 5.0:
                scripts_at = time.monotonic()
                with contextlib.suppress(Exception):
                    await self.c.store.load_scripts()
            try:
                msg = await self._sub.next_msg(timeout=0.5)
            except TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a subscription the connection lost: follow again after the last one seen
                self.log.warning("results subscription lost, following again", error=str(e), after=seen)
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):
                    self._sub = await self._subscribe(seen + 1 if seen else self._start_seq)
                continue
            with contextlib.suppress(Exception):
                seen = msg.metadata.sequence.stream
            try:
                r = wire.decode(wire.RolloutResult, msg.data)
            except wire.WireError:
                continue
            waiting = self._pending.get(r.request_id)
            if waiting is None or waiting[1].done():
                continue  # another endpoint's, or a duplicate
            req, fut = waiting
            reason = await self._verify(r, req)
            if reason is None:  # Redis did not answer: the call fails, the server serves on
                if not fut.done():
                    fut.set_exception(EndpointError(f"{r.request_id}: the result cannot be checked against its "
                                                    "checkpoint (Redis unreachable); retry the call", 503,
                                                    kind="service_unavailable"))
                continue
            if reason:
                self.log.warning("result refused", request_id=r.request_id, reason=reason)
                with contextlib.suppress(Exception):
                    await bus.dead_letter(self.c.js, msg, f"result for {r.request_id} refused: {reason}",
                                          wire.STREAM_RESULTS, ack=False)
                continue
            if not fut.done():
                fut.set_result(r)

    async def _verify(self, r: wire.RolloutResult, req: wire.RolloutRequest) -> str | None:
        """`PoolClient.verify_result`'s reason ('' = genuine), retried while Redis does not
        answer (a restart, a failover); None if it never did."""
        for attempt in range(6):
            try:
                return await self.manager.verify_result(self.step, r, req)
            except Exception as e:
                self.log.warning("cannot verify a result yet", request_id=r.request_id, error=str(e), attempt=attempt)
                await asyncio.sleep(0.25 * 2 ** attempt)
        return None

    # ------------------------------------------------------------ the calls

    async def _finished(self, req: wire.RolloutRequest) -> wire.RolloutResult | None:
        """A retried call's request whose checkpoint is finished: its result, read back from the
        checkpoint (the tokens, logprobs and segments a result is verified against). None if it
        is not finished (never published, queued, or under way: published again, and its result
        comes on the stream)."""
        try:
            owner, epoch, finished = await self.c.store.owner(req.request_id)
            if not finished:
                return None
            tokens, logprobs = await self.c.store.read(req.request_id)
            segments = await self.c.store.segments(req.request_id)
        except Exception as e:
            raise EndpointError(f"{req.request_id}: the checkpoint store does not answer ({e}); retry the call", 503,
                                kind="service_unavailable") from None
        if not wire.is_complete(req, tokens):
            raise EndpointError(f"{req.request_id}: this call was answered before with an error (the engine could "
                                "not serve it); send it with another Idempotency-Key to try again", 400)
        return wire.RolloutResult(
            request_id=req.request_id, step=req.step, group=req.group, prompt_ids=list(req.prompt_ids),
            token_ids=tokens, logprobs=logprobs, segments=segments,
            finish_reason=wire.finish_reason(req, tokens), worker_id=owner, epoch=epoch, ts=time.time())

    async def policy_version(self) -> int:
        """The latest published version (0 before any is): what a call is generated with."""
        if self._policy_kv is None:
            self._policy_kv = await self.c.js.key_value(wire.BUCKET_POLICY)
        try:
            entry = await self._policy_kv.get(wire.WEIGHTS_POINTER_KEY)
        except Exception:  # no version published yet
            return 0
        try:
            return max(0, int((entry.value or b"0").decode()))
        except ValueError:
            return 0

    def _stop_ids(self, stop: list[str]) -> list[int]:
        out = []
        for s in stop:
            ids = self.fmt.encode(s, special=False)
            vocab_id = self.tokenizer.convert_tokens_to_ids(s) if hasattr(self.tokenizer, "convert_tokens_to_ids") else None
            if isinstance(vocab_id, int) and vocab_id >= 0 and vocab_id != getattr(self.tokenizer, "unk_token_id", None):
                ids = [vocab_id]
            if len(ids) != 1:
                raise _bad(f"stop {s!r} is {len(ids)} tokens of this model's vocabulary: rollout engines stop on "
                           "token ids, so each stop string must be exactly one token", "stop")
            out.append(ids[0])
        return out

    def _state(self, session: str) -> _SessionState:
        """The session's next turn and last answers, read from its file once after a restart."""
        st = self._sessions.pop(session, None)
        if st is None:
            path = self.run_dir / "sessions" / f"{session}.jsonl"
            _cut_torn_tail(path)
            calls = read_session(path).calls if path.exists() else []
            st = _SessionState(next_turn=1 + max((c.get("turn", -1) for c in calls), default=-1),
                               recorded={c["request_id"]: c["turn"] for c in calls})
            last = [c for c in calls if c.get("turn") == st.next_turn - 1]
            st.tails = {c["answer_digest"]: (_stream(c), c["request_id"]) for c in last if c.get("answer_digest")}
            while len(self._sessions) >= MAX_SESSIONS_CACHED:
                old = next(iter(self._sessions))
                self._sessions.pop(old)
                lock = self._locks.get(old)
                if lock is not None and not lock.locked():
                    del self._locks[old]
        self._sessions[session] = st  # most recently used last
        return st

    def _prompt(self, session: str, call: ChatCall) -> tuple[list[int], dict | None]:
        """The call's prompt token ids, and which earlier call it continues (None: none).

        A harness sends the whole conversation each call. When it is an earlier call's
        conversation plus that call's answer (as returned) plus new messages (tool results, a
        user turn), the prompt is that call's exact tokens (prompt and completion, as generated:
        never re-encoded from text) followed by the template's tokens for the new messages
        (`ChatFormat.env_ids`), so the session stays one token stream. Otherwise (the first call,
        a history the harness rewrote) the template renders the messages afresh."""
        msgs = call.messages
        last = max((i for i, m in enumerate(msgs) if m.role == "assistant"), default=-1)
        if 0 <= last < len(msgs) - 1:
            hit = self._state(session).tails.get(conversation_digest(msgs[:last + 1], call.tools))
            if hit is not None:
                base, rid = hit
                try:
                    env = self.fmt.env_ids(msgs[:last + 1], msgs[last + 1:], call.tools, turn_end_id=base[-1])
                    return base + env, {"request_id": rid, "prefix_tokens": len(base)}
                except Exception as e:  # a template that does not extend: render afresh
                    self.log.info("session not continued as tokens", session=session, reason=str(e)[:200])
        return self.fmt.prompt_ids(msgs, call.tools), None

    async def chat(self, body: Any, headers: dict[str, str]) -> dict:
        """One chat-completions call: the OpenAI response, or EndpointError."""
        session = session_id(headers, body)
        call = parse_call(body, self.cfg)
        try:
            prompt_ids, extends = self._prompt(session, call)
        except Exception as e:  # the model's own template refused these messages (its own rules)
            raise _bad(f"the model's chat template cannot render these messages: {type(e).__name__}: {e}",
                       "messages") from None
        if not prompt_ids:
            raise _bad("the messages render to an empty prompt", "messages")
        if self.max_context and len(prompt_ids) + call.max_tokens > self.max_context:
            raise _bad(f"the prompt is {len(prompt_ids)} tokens; with max_tokens {call.max_tokens} that is over the "
                       f"model's context of {self.max_context}", "max_tokens")
        stops = list(dict.fromkeys([*self.stops, *self._stop_ids(call.stop)]))
        if self._inflight >= self.cfg.max_inflight:
            raise EndpointError(f"{self._inflight} calls are waiting already (endpoint.max_inflight); retry later",
                                429, kind="rate_limit_error")
        self._inflight += 1
        metrics.ENDPOINT_INFLIGHT.set(self._inflight)
        try:
            return await self._generate(session, call, prompt_ids, stops, extends, headers.get("idempotency-key"))
        finally:
            self._inflight -= 1
            metrics.ENDPOINT_INFLIGHT.set(self._inflight)

    async def _generate(self, session: str, call: ChatCall, prompt_ids: list[int], stops: list[int],
                        extends: dict | None, idem: str | None = None) -> dict:
        version = await self.policy_version()
        k = self._calls
        self._calls += 1
        run, group, seed = self.run_id, k, call.seed
        if idem is not None:
            # A retried call (the same Idempotency-Key, session and call) names the same requests,
            # in any life of the endpoint: a turn generated or under way is taken from its
            # checkpoint, never generated again.
            if not 0 < len(idem) <= 256:
                raise _bad("the Idempotency-Key header must be 1-256 characters")
            digest = hashlib.sha256(json.dumps(
                [session, idem, prompt_ids, stops, call.max_tokens, call.temperature, call.top_p, call.n, call.seed],
                separators=(",", ":")).encode()).hexdigest()
            run, group = "i" + digest[:24], 0
            seed = call.seed if call.seed is not None else int(digest[24:40], 16)
        reqs = [wire.RolloutRequest(
            request_id=wire.request_id(self.step, group, i, run=run), step=self.step, policy_version=version,
            prompt_ids=prompt_ids, max_new_tokens=call.max_tokens, seed=_choice_seed(seed, i),
            sampling=wire.SamplingParams(temperature=call.temperature, top_p=call.top_p),
            eos_id=stops[0] if stops else -1, stop_ids=stops, group=group) for i in range(call.n)]
        log = self.log.bind(session=session, call=k, request_id=reqs[0].request_id, policy_version=version)
        finished: dict[str, wire.RolloutResult] = {}
        if idem is not None:
            for r in reqs:
                if r.request_id not in self._pending and (done := await self._finished(r)) is not None:
                    finished[r.request_id] = done
        loop = asyncio.get_running_loop()
        futs, mine, publish = [], [], []
        for r in reqs:
            waiting = self._pending.get(r.request_id)
            if waiting is not None:  # the same call, retried while its first attempt still waits
                futs.append(waiting[1])
                continue
            fut = loop.create_future()
            done = finished.get(r.request_id)
            if done is not None:
                fut.set_result(done)
            else:
                self._pending[r.request_id] = (r, fut)
                mine.append(r)
                publish.append(r)
            futs.append(fut)
        t0 = time.monotonic()
        try:
            if publish:
                await self.manager.publish_step(publish, deadline_s=30.0, republish=idem is not None)
            try:
                results: list[wire.RolloutResult] = await asyncio.wait_for(asyncio.gather(*futs),
                                                                           self.cfg.request_timeout_s)
            except TimeoutError:
                raise EndpointError(f"no result within {self.cfg.request_timeout_s:g} s (endpoint.request_timeout_s): "
                                    f"are workers serving pool {self.cfg.pool!r}? The request stays queued under "
                                    f"{reqs[0].request_id}", 504, kind="timeout") from None
        except bus.PublishFailed as e:
            raise EndpointError(f"the request could not be queued: {e}", 503, kind="service_unavailable") from None
        finally:
            for r in mine:
                self._pending.pop(r.request_id, None)
        lock = self._locks.setdefault(session, asyncio.Lock())
        async with lock:  # turns are numbered and written in the order calls finish
            state = self._state(session)
            before = state.recorded.get(reqs[0].request_id)  # a retry of a call answered (and recorded) already
            turn = state.next_turn if before is None else before
            choices, records = [], []
            for i, (req, res) in enumerate(zip(reqs, results, strict=True)):
                choice, rec = self._choice(session, turn, i, call, req, res)
                choices.append(choice)
                records.append(rec)
            call_id = f"chatcmpl-{run}-{group}" if idem is not None else f"chatcmpl-{self.run_id}-{k}"
            now = time.time()
            for rec in records:
                rec.update(call_id=call_id, ts=now, session=session, turn=turn, extends=extends)
            if before is None:
                await asyncio.to_thread(_append_lines, self.run_dir / "sessions" / f"{session}.jsonl", records)
                state.next_turn = turn + 1
                state.recorded.update((rec["request_id"], turn) for rec in records)
            state.tails = {rec["answer_digest"]: (_stream(rec), rec["request_id"]) for rec in records
                           if rec["answer_digest"]}
        log.info("answered", turn=turn, choices=len(choices), seconds=round(time.monotonic() - t0, 3),
                 tokens=sum(len(r.token_ids) for r in results))
        errors = [r.error for r in results if r.finish_reason == "error"]
        if errors:
            raise EndpointError(f"the engine could not serve the request: {errors[0]}", 400)
        n_out = sum(len(r.token_ids) for r in results)
        return {"id": call_id, "object": "chat.completion", "created": int(now), "model": self.cfg.model_name,
                "choices": choices, "system_fingerprint": f"rlboost-v{version}",
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                          "total_tokens": len(prompt_ids) + n_out},
                "rlboost": {"session": session, "turn": turn, "step": self.step, "policy_version": version,
                            "prompt_token_ids": prompt_ids, "run_dir": str(self.run_dir)}}

    def _choice(self, session: str, turn: int, i: int, call: ChatCall, req: wire.RolloutRequest,
                res: wire.RolloutResult) -> tuple[dict, dict]:
        ids = list(res.token_ids)
        text_ids = ids[:-1] if ids and ids[-1] in req.stops() else ids  # the stop token is not content
        episode = session if call.n == 1 else f"{session}-c{i}"
        parsed = self.fmt.parse(text_ids, call.tools, episode, turn) if res.finish_reason != "error" else None
        calls = parsed.tool_calls if parsed else []
        content = (parsed.raw.strip() if parsed.errors else parsed.text) if parsed else ""
        tool_calls = [{"id": c.key, "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                      for c in calls]
        finish = {"length": "length", "error": "error"}.get(res.finish_reason, "tool_calls" if calls else "stop")
        message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        segments = [{"offset": s.offset, "worker_id": s.worker_id, "epoch": s.epoch,
                     "policy_version": s.policy_version, "weights": s.weights, "kind": s.kind} for s in res.segments]
        versions = wire.token_versions(list(res.segments), len(ids))
        ext = {"request_id": res.request_id, "token_ids": ids, "logprobs": list(res.logprobs),
               "policy_versions": sorted({s.policy_version for s in res.segments}), "segments": segments,
               "tool_call_errors": parsed.errors if parsed else [res.error]}
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None,
                                  "rlboost": ext}
        if call.logprobs:
            choice["logprobs"] = {"content": [self._logprob(t, lp) for t, lp in zip(ids, res.logprobs, strict=True)]}
        # what the harness sends back as this turn, if it continues the conversation with it: the
        # next call extends this stream. A turn cut by max_tokens has no end-of-turn token; the
        # history the harness sends back closes it (the template writes one after every assistant
        # message), so the stream continues after the template's own (`closing_ids`): a token
        # the model did not generate, in the next call's prompt, never trained
        answer = Message(role="assistant", content=content, tool_calls=[
            ToolCall(key=c.key, name=c.name, arguments=c.arguments) for c in calls])
        closing = [self.fmt.turn_end_id] if res.finish_reason == "length" and ids else []
        extendable = bool(closing) or (res.finish_reason == "stop" and bool(ids) and ids[-1] in req.stops())
        rec = {"v": RECORD_VERSION, "kind": "call",
               "answer_digest": conversation_digest([*call.messages, answer], call.tools) if extendable else "",
               "closing_ids": closing, "choice": i, "request_id": res.request_id, "step": res.step,
               "group": res.group, "policy_version": req.policy_version, "prompt_ids": list(res.prompt_ids),
               "completion_ids": ids, "logprobs": list(res.logprobs), "token_versions": versions,
               "segments": segments, "finish_reason": res.finish_reason, "worker_id": res.worker_id,
               "epoch": res.epoch, "content": content, "tool_calls": tool_calls,
               "tool_call_errors": ext["tool_call_errors"], "error": res.error,
               "sampling": {"temperature": call.temperature, "top_p": call.top_p, "seed": req.seed,
                            "max_tokens": call.max_tokens}}
        return choice, rec

    def _logprob(self, token: int, logprob: float) -> dict:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}

    async def reward(self, session: str, body: Any) -> dict:
        if not _NAME.fullmatch(session):
            raise _bad("a session id is 1-128 of [A-Za-z0-9_-]")
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise _bad("'reward' must be a finite number", "reward")
        metrics = body.get("metrics") or {}
        if not isinstance(metrics, dict):
            raise _bad("'metrics' must be an object", "metrics")
        path = self.run_dir / "sessions" / f"{session}.jsonl"
        async with self._locks.setdefault(session, asyncio.Lock()):
            if not path.exists():
                raise EndpointError(f"no session {session!r}: it made no call", 404, kind="not_found_error")
            self._state(session)  # a torn tail (an endpoint that died mid-write) is cut first
            await asyncio.to_thread(_append_lines, path, [{
                "v": RECORD_VERSION, "kind": "reward", "session": session, "reward": float(reward),
                "metrics": metrics, "done": bool(body.get("done", True)), "ts": time.time()}])
        self.log.info("reward recorded", session=session, reward=float(reward))
        return {"session": session, "recorded": True}

    # ------------------------------------------------------------ HTTP

    def _authorized(self, headers: dict[str, str]) -> bool:
        if not self.token:
            return True
        got = headers.get("authorization", "")
        scheme, _, value = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    async def _route(self, method: str, target: str, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
        path = target.split("?", 1)[0]
        if path == "/health":
            return 200, {"ok": True, "inflight": self._inflight}
        if not path.startswith("/v1/"):
            raise EndpointError(f"no route {path}: this is an OpenAI-compatible API under /v1", 404, kind="not_found_error")
        if not self._authorized(headers):
            raise EndpointError("missing or wrong bearer token (Authorization: Bearer <token>)", 401,
                                kind="authentication_error")
        if path == "/v1/models":
            if method != "GET":
                raise EndpointError("use GET /v1/models", 405)
            return 200, {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model", "created": 0,
                                                     "owned_by": "rlboost"}]}
        reward = _ROUTE_REWARD.fullmatch(path)
        if path == "/v1/chat/completions" or reward:
            if method != "POST":
                raise EndpointError(f"use POST {path}", 405)
            try:
                parsed = json.loads(body) if body else None
            except ValueError as e:
                raise _bad(f"the request body is not JSON ({e})") from None
            except RecursionError:
                raise _bad("the request body is nested too deeply") from None
            if reward:
                return 200, await self.reward(reward.group(1), parsed)
            return 200, await self.chat(parsed, headers)
        raise EndpointError(f"no route {path}", 404, kind="not_found_error")

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        try:
            while True:
                event = await self._next(conn, reader)
                if not isinstance(event, h11.Request):
                    break
                if len(self._conns) > MAX_CONNECTIONS:
                    await self._send(conn, writer, 503, _error(EndpointError(
                        f"over {MAX_CONNECTIONS} open connections; retry later", 503, kind="service_unavailable")),
                        close=True)
                    break
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
                length = headers.get("content-length", "")
                if length.isdigit() and int(length) > self.cfg.max_body_bytes:
                    await self._send(conn, writer, 413, _error(EndpointError(
                        f"the body is {length} bytes, over endpoint.max_body_bytes ({self.cfg.max_body_bytes})", 413)),
                        close=True)
                    break
                if conn.they_are_waiting_for_100_continue:  # curl sends larger bodies only after this
                    writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
                body = bytearray()
                too_big = False
                while True:
                    ev = await self._next(conn, reader)
                    if isinstance(ev, h11.Data):
                        body += ev.data
                        if len(body) > self.cfg.max_body_bytes:
                            too_big = True
                            break
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                    else:
                        return
                if too_big:
                    await self._send(conn, writer, 413, _error(EndpointError(
                        f"the body is over endpoint.max_body_bytes ({self.cfg.max_body_bytes})", 413)), close=True)
                    break
                status, payload = await self._answer(event.method.decode("latin-1"),
                                                     event.target.decode("latin-1"), headers, bytes(body))
                await self._send(conn, writer, status, payload)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                try:
                    conn.start_next_cycle()
                except h11.LocalProtocolError:
                    break
        except h11.RemoteProtocolError as e:  # not HTTP: answer 400 when a response can still go out
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with contextlib.suppress(Exception):
                    await self._send(conn, writer, 400, _error(_bad(f"malformed HTTP: {e}")), close=True)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        except Exception as e:  # never the server: one connection ends
            self.log.error("connection failed", error=f"{type(e).__name__}: {e}")
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2.0)

    async def _answer(self, method: str, target: str, headers: dict[str, str], body: bytes) -> tuple[int, dict]:
        t0 = time.monotonic()
        try:
            status, payload = await self._route(method, target, headers, body)
        except EndpointError as e:
            if e.status >= 500:
                self.log.warning("call failed", status=e.status, error=str(e))
            status, payload = e.status, _error(e)
        except Exception as e:  # a bug or a server fault: this call fails, the server serves on
            self.log.error("call failed", error=f"{type(e).__name__}: {e}", target=target[:200])
            status, payload = 500, _error(EndpointError(f"internal error: {type(e).__name__}: {e}", 500,
                                                        kind="server_error"))
        if target.split("?", 1)[0] == "/v1/chat/completions":
            metrics.ENDPOINT_CALLS.labels(str(status)).inc()
            if status == 200:
                metrics.ENDPOINT_CALL_SECONDS.observe(time.monotonic() - t0)
        return status, payload

    async def _next(self, conn: h11.Connection, reader: asyncio.StreamReader):
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await asyncio.wait_for(reader.read(65536), IDLE_TIMEOUT_S)
            conn.receive_data(data)

    async def _send(self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, payload: dict,
                    close: bool = False) -> None:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
        if close:
            headers.append(("connection", "close"))
        out = conn.send(h11.Response(status_code=status, headers=headers))
        out += conn.send(h11.Data(data=data))
        out += conn.send(h11.EndOfMessage())
        writer.write(out)
        await writer.drain()


def _error(e: EndpointError) -> dict:
    return {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.status}}


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------- the command


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost serve-openai", description=__doc__.splitlines()[0])
    p.add_argument("--host", help="address to bind (endpoint.host; loopback by default)")
    p.add_argument("--port", type=int, help="port (endpoint.port; 0 = a free one)")
    p.add_argument("--model-dir", help="the model folder whose tokenizer and chat template are used (endpoint.model_dir)")
    p.add_argument("--model-name", help="the model id /v1/models lists (endpoint.model_name)")
    p.add_argument("--pool", help="the worker pool the calls go to (endpoint.pool)")
    p.add_argument("--run-dir", help="where sessions are recorded (endpoint.run_dir)")
    a = p.parse_args(argv)
    cfg = s.endpoint
    for key in ("host", "port", "model_dir", "model_name", "pool", "run_dir"):
        if getattr(a, key) is not None:
            setattr(cfg, key, getattr(a, key))
    return asyncio.run(serve(s))


async def serve(s: Settings, stop: asyncio.Event | None = None) -> int:
    from rlboost.clients import open_clients
    from rlboost.modeldir import check_model_dir, load_tokenizer, stop_ids
    from rlboost.services import resolve_urls

    cfg = s.endpoint
    token = os.environ.get(cfg.token_env, "") if cfg.token_env else ""
    if not token and not _loopback(cfg.host):  # before anything connects or loads
        raise EndpointError(f"endpoint.host {cfg.host!r} is not a loopback address: set a token in "
                            f"${cfg.token_env or 'RLBOOST_ENDPOINT_TOKEN'} first (an open endpoint spends the pool's GPUs)")
    model_dir = cfg.model_dir or s.run.model_dir or str(Path(s.services.data_dir) / "model")
    info = check_model_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    run_dir = Path(cfg.run_dir or Path("runs") / time.strftime("endpoint-%Y%m%d-%H%M%S"))
    nats_url, redis_url = resolve_urls(s.services)
    if s.metrics.port:
        from rlboost.metrics import start_metrics_server

        start_metrics_server(s.metrics.port, s.metrics.bind)
    async with open_clients(nats_url, redis_url, "rlboost-endpoint", settings=s, pools=(cfg.pool,)) as c:
        ep = OpenAIEndpoint(c, cfg, tokenizer, stop_ids(model_dir, tokenizer), run_dir, token=token,
                            max_context=info.max_context)
        host, port = await ep.start()
        print(f"serving an OpenAI-compatible API on http://{host}:{port}/v1 (model {cfg.model_name!r}, pool "
              f"{cfg.pool!r}, {'bearer token from $' + cfg.token_env if token else 'no token: loopback only'}); "
              f"sessions recorded in {run_dir / 'sessions'}", flush=True)
        if stop is None:  # SIGTERM / Ctrl-C: stop serving, close the connections, exit 0
            import signal

            stop = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await ep.close()
    return 0
