"""An OpenAI chat-completions request, validated, as rlboost's types: messages and tools as the
environment protocol's `Message` and `ToolSpec`, the sampling as a `ChatCall`, the session the
call belongs to, and a reported reward. Every refusal is an EndpointError naming the field."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from rlboost.config import EndpointSettings
from rlboost.endpoint.errors import bad
from rlboost.envs.protocol import Message, ToolCall, ToolSpec

SESSION_HEADERS = ("x-session-id", "x-episode-id")
MAX_STOP = 4
NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")  # a session id, as a file name

# accepted only at their neutral value (a harness may send it); parallel_tool_calls is ignored
_UNSUPPORTED_DEFAULTS = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "top_logprobs": 0}


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
    stream: bool = False  # server-sent events (stream.py)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


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
                raise bad(f"{where}[{i}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported", where)
            out.append(part["text"])
        return "".join(out)
    raise bad(f"{where} must be a string, null or a list of text parts, got {type(value).__name__}", where)


def _call_arguments(value: Any, where: str) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad(f"{where} is not valid JSON ({e})", where) from None
    if not isinstance(value, dict):
        raise bad(f"{where} must be a JSON object", where)
    return value


def _tool_calls(m: dict, i: int, where: str) -> list[ToolCall]:
    if m.get("role") != "assistant" or m.get("tool_calls") is None:
        return []
    if not isinstance(m["tool_calls"], list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for j, c in enumerate(m["tool_calls"]):
        w = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{w} needs a function with a name", w)
        calls.append(ToolCall(key=str(c.get("id") or f"call-{i}-{j}"), name=fn["name"], index=j,
                              arguments=_call_arguments(fn.get("arguments"), f"{w}.function.arguments")))
    return calls


def parse_messages(raw: Any) -> list[Message]:
    """OpenAI chat messages as the protocol's `Message`s; EndpointError naming what is wrong."""
    if raw is None:
        raise bad("'messages' is required: a non-empty list of chat messages", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list of chat messages", "messages")
    out: list[Message] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with a 'role'", where)
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(f"{where}.role {role!r}: use system, developer, user, assistant or tool", f"{where}.role")
        content = _text(m.get("content"), f"{where}.content")
        calls = _tool_calls(m, i, where)
        tool_call_id = m.get("tool_call_id") or ""
        name = m.get("name") or ""
        if not isinstance(tool_call_id, str) or not isinstance(name, str):
            raise bad(f"{where}: tool_call_id and name must be strings", where)
        out.append(Message(role=role, content=content, tool_calls=calls,
                           tool_call_id=tool_call_id if role == "tool" else "", name=name if role == "tool" else ""))
    return out


def parse_tools(raw: Any) -> list[ToolSpec]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", f"tools[{i}]")
        params = fn.get("parameters") if fn.get("parameters") is not None else {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise bad(f"tools[{i}].function.description must be a string", f"tools[{i}]")
        out.append(ToolSpec(name=fn["name"], description=desc, parameters=params))
    return out


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v > hi or v < lo or (lo_open and v == lo):
        raise bad(f"'{key}' must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad(f"'{key}' must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def _refuse_unsupported(body: dict) -> None:
    """What rollout engines cannot do, refused by name rather than silently ignored."""
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad("'stream' must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise bad("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        if body.get(key) not in (None, default):
            raise bad(f"'{key}' is not supported (rollout engines sample from the plain distribution and record "
                      "the sampled token's logprob only)", key)
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise bad("'tool_choice' may be \"auto\" or \"none\": forcing a call needs constrained decoding, "
                  "which rollout engines do not do", "tool_choice")


def parse_call(body: Any, cfg: EndpointSettings) -> ChatCall:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _refuse_unsupported(body)
    messages = parse_messages(body.get("messages"))
    tools = [] if body.get("tool_choice") == "none" else parse_tools(body.get("tools"))
    mt = _integer(body, "max_completion_tokens", 1, cfg.max_tokens)
    if mt is None:
        mt = _integer(body, "max_tokens", 1, cfg.max_tokens)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise bad(f"'stop' must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("'logprobs' must be true or false", "logprobs")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    seed = _integer(body, "seed", -(2**63), 2**63 - 1)
    return ChatCall(messages=messages, tools=tools, max_tokens=mt if mt is not None else cfg.default_max_tokens,
                    temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                    n=_integer(body, "n", 1, cfg.max_n) or 1, seed=seed, stop=stop, logprobs=bool(logprobs),
                    model=model or cfg.model_name, stream=bool(body.get("stream")),
                    include_usage=bool((body.get("stream_options") or {}).get("include_usage")))


def check_session(session: str) -> str:
    if not isinstance(session, str) or not NAME.fullmatch(session):
        raise bad(f"a session id is 1-128 of [A-Za-z0-9_-], got {str(session)[:64]!r}")
    return session


def session_id(headers: dict[str, str], body: Any) -> str:
    """The episode a call belongs to: the X-Session-Id (or X-Episode-Id) header, else the body's
    `user` (hashed when it is not a plain id), else `default`."""
    for h in SESSION_HEADERS:
        if h in headers:
            value = headers[h]
            if not NAME.fullmatch(value):
                raise bad(f"the {h} header must be 1-128 of [A-Za-z0-9_-], got {value[:64]!r}")
            return value
    user = body.get("user") if isinstance(body, dict) else None
    if isinstance(user, str) and user:
        return user if NAME.fullmatch(user) else "u-" + hashlib.sha256(user.encode()).hexdigest()[:16]
    return "default"


def parse_reward(session: str, body: Any) -> tuple[float, dict, bool]:
    """`POST /v1/rlboost/sessions/{session}/reward`: the reward, its metrics and whether the episode is done."""
    if not NAME.fullmatch(session):
        raise bad("a session id is 1-128 of [A-Za-z0-9_-]")
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    reward = body.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise bad("'reward' must be a finite number", "reward")
    metrics = body.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise bad("'metrics' must be an object", "metrics")
    return float(reward), metrics, bool(body.get("done", True))
