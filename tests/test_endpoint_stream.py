"""`stream: true` on `rlboost serve-openai`: server-sent events in the OpenAI shape
(`chat.completion.chunk` objects, `data: [DONE]`), with tool calls as `delta.tool_calls`, read by
the official `openai` client. A streamed conversation continued with what the client
accumulated is one token stream in the session file, as a non-streamed one is (a turn cut by
`max_tokens` too). Real NATS, Redis, worker and HTTP; the LLM is test_endpoint.py's scripted
calculator policy. The chunking itself is checked without servers against openai's own
accumulator."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from helpers import build_hf_model
from openai.lib.streaming.chat import ChatCompletionStreamState
from test_endpoint import CALC, TOKEN, _calc, _url, serving

from rlboost.endpoint import read_sessions
from rlboost.endpoint.stream import chunks
from rlboost.modeldir import load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_hf_model(tmp_path_factory.mktemp("endpoint-stream-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _response(content, tool_calls, finish: str, n: int = 1) -> dict:
    msg = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "rlboost",
            "system_fingerprint": "rlboost-v0",
            "choices": [{"index": i, "message": msg, "finish_reason": finish, "logprobs": None,
                         "rlboost": {"request_id": f"r-{i}"}} for i in range(n)],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
            "rlboost": {"session": "s", "turn": 0}}


@pytest.mark.parametrize("content,calls,finish", [
    ("The answer is 89." * 5, [], "stop"),
    (None, [{"id": "s/0/0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "12 * 7"}'}},
            {"id": "s/0/1", "type": "function", "function": {"name": "calc", "arguments": json.dumps({"e": "x" * 300})}}],
     "tool_calls"),
    ("Now add.", [{"id": "s/1/0", "type": "function", "function": {"name": "calc", "arguments": "{}"}}], "tool_calls"),
    ("", [], "length"),
])
def test_chunks_accumulate_to_the_whole_message_in_openais_own_accumulator(content, calls, finish):
    resp = _response(content, calls, finish, n=2)
    state = ChatCompletionStreamState()
    for c in chunks(resp, include_usage=True):
        assert c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-x"
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(c))
    done = state.current_completion_snapshot
    assert [c.index for c in done.choices] == [0, 1]
    for choice in done.choices:
        assert (choice.message.content or "") == (content or "")
        assert choice.finish_reason == finish
        got = [(t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        assert got == [(t["id"], t["function"]["name"], t["function"]["arguments"]) for t in calls]
    assert done.usage.total_tokens == 12
    last = chunks(resp)[-1]  # without usage: the extension rides on the last choice chunk
    assert last["rlboost"] == {"session": "s", "turn": 0} and last["choices"][0]["finish_reason"] == finish


async def _streamed(client, messages, session, **kw):
    """One streamed call through the openai client: every chunk, and the accumulated message."""
    stream = await client.chat.completions.create(model="rlboost", messages=messages, tools=[CALC], stream=True,
                                                  extra_headers={"X-Session-Id": session}, **kw)
    state, got = ChatCompletionStreamState(), []
    async for chunk in stream:
        got.append(chunk)
        state.handle_chunk(chunk)
    return got, state.current_completion_snapshot


async def test_a_streamed_agent_loop_with_a_tool_is_one_token_stream(nats_url, redis_url, js, tokenizer, model_dir,
                                                                      tmp_path):
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-stream") as (ep, c, _):
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        messages: list[dict] = [{"role": "system", "content": "Use the calc tool."},
                                {"role": "user", "content": "What is 12 * 7 + 5?"}]
        finals = []
        for _ in range(4):
            got, final = await _streamed(client, messages, "st-1", max_tokens=200,
                                         stream_options={"include_usage": True})
            assert all(ch.object == "chat.completion.chunk" for ch in got)
            assert got[-1].choices == [] and got[-1].usage.completion_tokens > 0  # include_usage: last, no choices
            finals.append(final)
            msg = final.choices[0].message
            messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            if not msg.tool_calls:
                break
            assert any(ch.choices and ch.choices[0].delta.tool_calls for ch in got)  # delta.tool_calls chunks
            for call in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": _calc(json.loads(call.function.arguments)["expression"])})
        # a bad streamed call is refused with its HTTP status before any event
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await client.chat.completions.create(model="rlboost", messages=messages, stream=True, max_tokens=10 ** 6)
        async with httpx.AsyncClient() as h:
            r = await h.post(_url(ep) + "/v1/chat/completions", headers={"Authorization": f"Bearer {TOKEN}"},
                             json={"messages": messages[:2], "stream": "yes"})
            assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
        await client.close()
    assert [f.choices[0].finish_reason for f in finals] == ["tool_calls", "tool_calls", "stop"]
    assert finals[-1].choices[0].message.content == "The answer is 89."
    (session,) = read_sessions(ep.run_dir)
    assert [c["content"] for c in session.calls][-1] == "The answer is 89."
    # each call continued the one before it: the session is one token stream, as if not streamed
    assert [c["extends"] is not None for c in session.calls] == [False, True, True]
    episode = session.episode()
    assert episode["request_ids"] == [c["request_id"] for c in session.calls]
    trained = [t for t, m in zip(episode["token_ids"], episode["mask"], strict=True) if m]
    assert trained == [t for c in session.calls for t in c["completion_ids"]]


async def test_a_streamed_answer_cut_by_max_tokens_continues_the_token_stream(nats_url, redis_url, js, tokenizer,
                                                                                model_dir, tmp_path):
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-stream-cut") as (ep, c, _):
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        messages = [{"role": "system", "content": "Use the calc tool."},
                    {"role": "user", "content": "What is 12 * 7 + 5?"}]
        _, first = await _streamed(client, messages, "st-cut", max_tokens=6)
        assert first.choices[0].finish_reason == "length"
        messages.append(first.choices[0].message.model_dump(exclude_none=True,
                                                            include={"role", "content", "tool_calls"}))
        messages.append({"role": "user", "content": "Go on."})
        _, second = await _streamed(client, messages, "st-cut", max_tokens=200)
        await client.close()
    assert second.choices[0].finish_reason == "tool_calls"
    (session,) = read_sessions(ep.run_dir)
    cut, nxt = session.calls
    base = cut["prompt_ids"] + cut["completion_ids"]
    assert nxt["extends"] == {"request_id": cut["request_id"], "prefix_tokens": len(base) + 1}
    assert session.episode()["request_ids"] == [cut["request_id"], nxt["request_id"]]


async def test_a_slow_turn_keeps_the_stream_alive_and_a_late_one_ends_it_with_an_error_event(
        nats_url, redis_url, js, tokenizer, model_dir, tmp_path, monkeypatch):
    from rlboost.endpoint import stream

    monkeypatch.setattr(stream, "KEEPALIVE_S", 0.05)
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-stream-slow", delay_s=0.2, k=4) \
            as (ep, c, _):
        body = {"messages": [{"role": "user", "content": "What is 2 * 3 + 4?"}], "tools": [CALC], "max_tokens": 200,
                "stream": True}
        async with httpx.AsyncClient(timeout=60) as h:
            async with h.stream("POST", _url(ep) + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "st-slow"}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                raw = (await r.aread()).decode()
        events = raw.split("\n\n")
        assert events[0].startswith(": ")  # a comment while the turn was generated, before any chunk
        assert [e for e in events if e.startswith("data: ")][-1] == "data: [DONE]"
        # a turn not in within endpoint.request_timeout_s: the stream ends with an error event
        ep.cfg.request_timeout_s = 0.3
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        with pytest.raises(openai.APIError, match="no result within"):
            await _streamed(client, body["messages"], "st-late", max_tokens=200)
        await client.close()
