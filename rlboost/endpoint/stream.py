"""`stream: true`: a call answered as server-sent events in the OpenAI shape, one
`chat.completion.chunk` object per `data:` event and a last `data: [DONE]`.

Granularity: the chunks are cut from the **verified, recorded** answer. A call's tokens are
checkpointed every K tokens while a worker generates them, but what a harness is told must be
what it will be trained on: the result is taken only once it matches its checkpoint
(`PoolClient.verify_result`), is parsed for tool calls in the template's syntax (which text is
content and which a call is only known at the end of the turn: `<tool_call>` may open in the
last token) and is fsynced into the session file. Streaming raw per-flush text would hand the
harness content that the parsed answer does not hold (the call's markup), and a harness that
sends back what it accumulated would no longer continue the session's token stream. So the
stream starts once the turn is durable and recorded; until then the connection carries an SSE
comment every `KEEPALIVE_S` (proxies and clients with read timeouts see a live stream, and the
openai client skips comments). Concatenated, the deltas are exactly the non-streamed message:
`content` in pieces, each tool call as its id and name, then its arguments (`delta.tool_calls`
with `index`, the shape the openai client accumulates), then `finish_reason`. The `rlboost`
fields of a whole response ride on the chunks too: each choice's on its last chunk, the call's
on the last chunk of the stream.

A failure after the stream started (no result within `endpoint.request_timeout_s`, the engine
could not serve the request) is one `data: {"error": {...}}` event, which the openai client
raises as an `APIError`; a failure before it (a bad request) is the ordinary HTTP error.
"""

from __future__ import annotations

import json
from typing import Any

KEEPALIVE_S = 5.0  # an SSE comment this often while the turn is generated
CONTENT_PIECE = 24  # characters of content per chunk


def event(obj: Any) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": generating\n\n"


def _pieces(text: str, size: int = CONTENT_PIECE) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def chunks(resp: dict, include_usage: bool = False) -> list[dict]:
    """A whole chat-completions response (`Chats.answer`'s) as the chunk objects of its stream."""
    head = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"],
            "system_fingerprint": resp.get("system_fingerprint")}
    out: list[dict] = []

    def chunk(index: int, delta: dict, finish: str | None = None, **extra) -> None:
        out.append({**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish,
                                         **extra}]})

    for choice in resp["choices"]:
        i, msg = choice["index"], choice["message"]
        chunk(i, {"role": "assistant", "content": ""})
        for piece in _pieces(msg.get("content") or ""):
            chunk(i, {"content": piece})
        for j, call in enumerate(msg.get("tool_calls") or []):
            chunk(i, {"tool_calls": [{"index": j, "id": call["id"], "type": "function",
                                      "function": {"name": call["function"]["name"], "arguments": ""}}]})
            for piece in _pieces(call["function"]["arguments"], 4 * CONTENT_PIECE):
                chunk(i, {"tool_calls": [{"index": j, "function": {"arguments": piece}}]})
        chunk(i, {}, choice["finish_reason"], rlboost=choice.get("rlboost"))
        if choice.get("logprobs"):
            out[-1]["choices"][0]["logprobs"] = choice["logprobs"]
    last = {**head, "choices": [], "usage": resp["usage"]} if include_usage else out[-1]
    if include_usage:
        out.append(last)
    last["rlboost"] = resp.get("rlboost")
    return out
