"""`rlboost serve-openai` against real NATS and Redis and a real rollout worker, driven by the
`openai` client as an external agent loop would: multi-turn with a tool, every call recorded
with the tokens, logprobs and versions its checkpoint holds; no token, bad input and broken
HTTP refused with a clear message, and the server serves on.

The only test double is the LLM: the worker's engine is a scripted calculator policy that reads
the question and the tool results from its prompt tokens (like test_envs.py's perfect policy),
so the loop is deterministic; everything else (the worker, the leases, the checkpoints, the
results stream, the HTTP server, the client) is the real thing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading

import httpx
import openai
import pytest
from helpers import build_hf_model

from rlboost import metrics, wire
from rlboost.clients import open_clients
from rlboost.config import EndpointSettings, WorkerSettings
from rlboost.endpoint import OpenAIEndpoint, read_sessions
from rlboost.modeldir import load_tokenizer, stop_ids
from rlboost.workers.counters import Counters
from rlboost.workers.engines.base import Engine, Generated, Sequence
from rlboost.workers.worker import RolloutWorker
from rlboost.weights.source import EmulatedWeights

TOKEN = "test-token-123"
STEP = 99999
CALC = {"type": "function", "function": {
    "name": "calc", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


class CalculatorPolicy(Engine):
    """The LLM double: answers `What is A * B + C?` in two calls of the calc tool, reading the
    tool results from its prompt; deterministic per prompt and position (the engine contract).
    `delay_s` per engine call: slow enough to be preempted mid-turn."""

    name = "scripted"

    def __init__(self, tokenizer, stop_id: int, delay_s: float = 0.0) -> None:
        self.tok, self.stop_id, self.delay_s = tokenizer, stop_id, delay_s
        self.calls = 0
        self.weights_id = "emulated-v0"  # as the emulated engine: virtual weights, named by version

    def check(self, seq: Sequence) -> str | None:
        if "REFUSE" in self.tok.decode(seq.prompt_ids):
            return "this engine refuses prompts that say REFUSE"
        return None

    def weight_source(self):
        return EmulatedWeights()  # versions are labels: the worker serves whichever the request names

    def answer(self, prompt_ids: list[int]) -> list[int]:
        text = self.tok.decode(prompt_ids, skip_special_tokens=False)
        q = list(re.finditer(r"What is (\d+) \* (\d+) \+ (\d+)\?", text))
        if not q:
            out = "I only do arithmetic."
        else:
            a, b, c = q[-1].groups()
            results = re.findall(r"<tool_response>(.*?)</tool_response>", text[q[-1].end():], re.S)
            if not results:
                out = json.dumps({"name": "calc", "arguments": {"expression": f"{a} * {b}"}})
                out = f"<tool_call>{out}</tool_call>"
            elif len(results) == 1:
                out = json.dumps({"name": "calc", "arguments": {"expression": f"{results[0].strip()} + {c}"}})
                out = f"Now add.<tool_call>{out}</tool_call>"
            else:
                out = f"The answer is {results[-1].strip()}."
        return self.tok(out, add_special_tokens=False)["input_ids"] + [self.stop_id]

    async def generate(self, batch: list[Sequence], max_tokens: int,
                       stop: threading.Event | None = None) -> list[Generated]:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        out = []
        for s in batch:
            full = self.answer(s.prompt_ids)
            at = len(s.token_ids)
            take = full[at:min(len(full), s.max_new_tokens, at + max_tokens)]
            lps = [-0.05 * ((at + j) % 5 + 1) for j in range(len(take))]
            out.append(Generated(take, lps, at + len(take) >= min(len(full), s.max_new_tokens)))
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_hf_model(tmp_path_factory.mktemp("endpoint-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _worker(c, tokenizer, pool: str, name: str, delay_s: float = 0.0, k: int = 16) -> RolloutWorker:
    settings = WorkerSettings(pool=pool, slots=8, ack_wait_s=3.0, lease_ttl_s=2.0, heartbeat_s=0.2,
                              checkpoint_tokens=k)
    engine = CalculatorPolicy(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"), delay_s)
    return RolloutWorker(settings, engine, c, worker_id=f"{pool}-{name}", counters=Counters())


@contextlib.asynccontextmanager
async def serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, pool: str, workers: int = 1, **worker_kw):
    """The endpoint on a free loopback port and `workers` real workers on `pool`."""
    async with open_clients(nats_url, redis_url, f"test-endpoint-{pool}", pools=(pool,)) as c:
        ws = [_worker(c, tokenizer, pool, f"w{i}", **worker_kw) for i in range(workers)]
        tasks = [asyncio.create_task(w.run()) for w in ws]
        cfg = EndpointSettings(port=0, pool=pool, step=STEP, max_tokens=256, default_max_tokens=64,
                               max_body_bytes=64 << 10, request_timeout_s=30.0)
        ep = OpenAIEndpoint(c, cfg, tokenizer, stop_ids(model_dir, tokenizer), tmp_path / "endpoint-run",
                            token=TOKEN, max_context=1024)
        await ep.start()
        try:
            yield ep, c, ws
        finally:
            await ep.close()
            for w in ws:
                w.request_drain("test over")
            await asyncio.gather(*tasks, return_exceptions=True)
            await RolloutWorker.settled()  # its last fetches handed back before the connection closes


def _url(ep) -> str:
    return f"http://127.0.0.1:{ep.address[1]}"


def _calc(expression: str) -> str:
    a, op, b = expression.split()
    return str(int(a) * int(b) if op == "*" else int(a) + int(b))


async def _agent_loop(client: openai.AsyncOpenAI, session: str, question: str, max_turns: int = 6,
                      between=None) -> list:
    """The harness: call the model, run each tool call it makes, feed the results back as tool
    messages, until it answers without a call."""
    messages: list[dict] = [{"role": "system", "content": "Use the calc tool."}, {"role": "user", "content": question}]
    responses = []
    for turn in range(max_turns):
        r = await client.chat.completions.create(model="rlboost", messages=messages, tools=[CALC], max_tokens=200,
                                                 temperature=1.0, seed=7, extra_headers={"X-Session-Id": session})
        responses.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": _calc(json.loads(call.function.arguments)["expression"])})
        if between is not None:
            await between(turn)
    return responses


async def test_an_agent_loop_with_a_tool_is_recorded_with_its_checkpointed_tokens(
        nats_url, redis_url, js, tokenizer, model_dir, tmp_path):
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-loop") as (ep, c, _):
        kv = await c.js.key_value(wire.BUCKET_POLICY)
        with contextlib.suppress(Exception):
            await kv.delete(wire.WEIGHTS_POINTER_KEY)

        async def new_version(turn: int) -> None:
            if turn == 0:  # the trainer publishes version 1 between the first and the second call
                await kv.put(wire.WEIGHTS_POINTER_KEY, b"1")

        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        responses = await _agent_loop(client, "episode-1", "What is 12 * 7 + 5?", between=new_version)
        assert [r.choices[0].finish_reason for r in responses] == ["tool_calls", "tool_calls", "stop"]
        assert responses[-1].choices[0].message.content == "The answer is 89."
        assert responses[1].choices[0].message.content == "Now add."
        first_call = responses[0].choices[0].message.tool_calls[0]
        assert first_call.function.name == "calc" and json.loads(first_call.function.arguments) == {"expression": "12 * 7"}
        async with httpx.AsyncClient(base_url=_url(ep), headers={"Authorization": f"Bearer {TOKEN}"}) as h:
            got = await h.post("/v1/rlboost/sessions/episode-1/reward", json={"reward": 1.0, "metrics": {"turns": 3}})
            assert got.status_code == 200, got.text
            missing = await h.post("/v1/rlboost/sessions/nobody/reward", json={"reward": 1.0})
            assert missing.status_code == 404 and "no session" in missing.json()["error"]["message"]
        await client.close()

        (session,) = read_sessions(ep.run_dir)
        assert session.session == "episode-1" and session.reward == 1.0 and session.metrics == {"turns": 3}
        assert [rec["turn"] for rec in session.calls] == [0, 1, 2]
        assert [rec["policy_version"] for rec in session.calls] == [0, 1, 1]
        for rec, resp in zip(session.calls, responses, strict=True):
            ext = resp.model_extra["rlboost"]
            choice_ext = resp.choices[0].model_extra["rlboost"]
            # the record, the response and the checkpoint in Redis agree, token for token
            tokens, logprobs = await c.store.read(rec["request_id"])
            segments = await c.store.segments(rec["request_id"])
            owner, epoch, finished = await c.store.owner(rec["request_id"])
            assert finished and rec["completion_ids"] == tokens == choice_ext["token_ids"]
            assert rec["logprobs"] == pytest.approx(logprobs, abs=1e-6) and len(tokens) == len(logprobs) > 0
            assert choice_ext["logprobs"] == rec["logprobs"]
            assert rec["prompt_ids"] == ext["prompt_token_ids"]
            assert resp.usage.prompt_tokens == len(rec["prompt_ids"]) and resp.usage.completion_tokens == len(tokens)
            assert [(s["offset"], s["worker_id"], s["epoch"], s["policy_version"], s["weights"])
                    for s in rec["segments"]] == [
                (s.offset, s.worker_id, s.epoch, s.policy_version, s.weights) for s in segments]
            assert rec["token_versions"] == wire.token_versions(segments, len(tokens)) == [rec["policy_version"]] * len(tokens)
            assert all(s.weights == f"emulated-v{rec['policy_version']}" for s in segments)
            assert (rec["worker_id"], rec["epoch"]) == (owner, epoch)
            assert rec["request_id"] == choice_ext["request_id"]
        # the harness sent the whole conversation each time; each call's prompt is the previous
        # call's exact tokens (prompt + completion as generated, never re-encoded) + the template's
        # tokens for the tool result: the session is one token stream, as a native episode
        for prev, rec in zip(session.calls, session.calls[1:]):
            base = prev["prompt_ids"] + prev["completion_ids"]
            assert rec["extends"] == {"request_id": prev["request_id"], "prefix_tokens": len(base)}
            assert rec["prompt_ids"][:len(base)] == base
        assert "<tool_response>84</tool_response>" in tokenizer.decode(session.calls[1]["prompt_ids"])
        ep_ = session.episode()
        last = session.calls[-1]
        assert ep_["token_ids"] == last["prompt_ids"] + last["completion_ids"]
        assert ep_["request_ids"] == [rec["request_id"] for rec in session.calls] and ep_["reward"] == 1.0
        model_tokens = [t for t, m in zip(ep_["token_ids"], ep_["mask"], strict=True) if m]
        assert model_tokens == [t for rec in session.calls for t in rec["completion_ids"]]
        assert [v for v, m in zip(ep_["token_versions"], ep_["mask"], strict=True) if m] == \
            [v for rec in session.calls for v in rec["token_versions"]]
        env = tokenizer.decode([t for t, m in zip(ep_["token_ids"][ep_["prompt_tokens"]:],
                                                   ep_["mask"][ep_["prompt_tokens"]:], strict=True) if not m])
        assert "<tool_response>84</tool_response>" in env and "<tool_response>89</tool_response>" in env
        assert "calc" not in env  # the model's own calls are model tokens, never the environment's

        # the endpoint dies (here: mid-write, a torn line) and a new one serves the same run dir:
        # the session goes on where its file says, as the same token stream
        path = ep.run_dir / "sessions" / "episode-1.jsonl"
        with open(path, "ab") as f:
            f.write(b'{"v":1,"kind":"call","request_id":"torn')
        ep2 = OpenAIEndpoint(c, ep.cfg, tokenizer, stop_ids(model_dir, tokenizer), ep.run_dir, token=TOKEN,
                             max_context=1024)
        await ep2.start()
        try:
            client = openai.AsyncOpenAI(base_url=_url(ep2) + "/v1", api_key=TOKEN, max_retries=0)
            messages = [{"role": "system", "content": "Use the calc tool."},
                        {"role": "user", "content": "What is 12 * 7 + 5?"}]
            for resp in responses:
                msg = resp.choices[0].message
                messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
                for call in msg.tool_calls or []:
                    messages.append({"role": "tool", "tool_call_id": call.id,
                                     "content": _calc(json.loads(call.function.arguments)["expression"])})
            messages.append({"role": "user", "content": "And What is 2 * 3 + 4?"})
            more = await client.chat.completions.create(model="rlboost", messages=messages, tools=[CALC],
                                                        max_tokens=200, extra_headers={"X-Session-Id": "episode-1"})
            await client.close()
        finally:
            await ep2.close()
        assert json.loads(more.choices[0].message.tool_calls[0].function.arguments) == {"expression": "2 * 3"}
        (session,) = read_sessions(ep.run_dir)
        assert b"torn" not in path.read_bytes() and [rec["turn"] for rec in session.calls] == [0, 1, 2, 3]
        assert session.calls[3]["extends"]["request_id"] == session.calls[2]["request_id"]
        assert session.episode()["request_ids"] == [rec["request_id"] for rec in session.calls]


async def test_no_token_wrong_token_refused_and_models_listed(nats_url, redis_url, js, tokenizer, model_dir, tmp_path):
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-auth", workers=0) as (ep, _, _):
        for key in ("", "wrong"):
            client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=key or "x", max_retries=0,
                                        default_headers={"Authorization": f"Bearer {key}"} if key else
                                        {"Authorization": ""})
            with pytest.raises(openai.AuthenticationError, match="bearer token"):
                await client.chat.completions.create(model="rlboost", messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()
            await client.close()
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["rlboost"]
        await client.close()
        assert not list((ep.run_dir / "sessions").iterdir())  # nothing refused was recorded


BAD = [
    ({"model": "rlboost"}, "'messages' is required"),
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "'stream' must be true or false"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": 3}, "'stream_options' must be"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "'max_tokens' must be an integer in [1, 256]"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi " * 1500}], "max_tokens": 10}, "over the model's context of 1024"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "'temperature' must be a number"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "'top_p'"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 99}, "'n' must be an integer in [1, 16]"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": "a long stop string"}, "each stop string must be exactly one token"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 5}, "'top_logprobs' is not supported"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "calc", "arguments": "{not json"}}]}]},
     "arguments is not valid JSON"),
    ([1, 2, 3], "must be a JSON object"),
]


async def test_bad_input_is_a_400_that_says_why_and_the_server_serves_on(
        nats_url, redis_url, js, tokenizer, model_dir, tmp_path):
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-bad") as (ep, _, _):
        def answered(status: str) -> float:
            return metrics.REGISTRY.get_sample_value("rlboost_endpoint_calls_total", {"status": status}) or 0.0

        before = answered("400")
        async with httpx.AsyncClient(base_url=_url(ep), headers={"Authorization": f"Bearer {TOKEN}"}) as h:
            for body, why in BAD:
                r = await h.post("/v1/chat/completions", json=body)
                assert r.status_code == 400, (body, r.text)
                assert why in r.json()["error"]["message"], (body, r.json())
                assert r.json()["error"]["type"] == "invalid_request_error"
            assert answered("400") == before + len(BAD)  # counted for Prometheus, by status
            r = await h.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
            assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
            r = await h.post("/v1/chat/completions", content=b"[" * 60_000)
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
            r = await h.post("/v1/chat/completions", content=b"x" * (65 << 10))
            assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
            r = await h.get("/v1/chat/completions")
            assert r.status_code == 405
            r = await h.get("/nowhere")
            assert r.status_code == 404
            r = await h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                             headers={"X-Session-Id": "bad session/id"})
            assert r.status_code == 400 and "x-session-id" in r.json()["error"]["message"]
        # not HTTP at all, and a connection that hangs up mid-body: each costs one connection
        for junk in (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-length: 1000\r\n\r\n{\"messages\""):
            reader, writer = await asyncio.open_connection("127.0.0.1", ep.address[1])
            writer.write(junk)
            await writer.drain()
            if junk.startswith(b"\x16"):
                head = await asyncio.wait_for(reader.read(1000), 10)
                assert head.split(b"\r\n")[0].split()[1] == b"400"  # aiohttp's own answer to what is not HTTP
            writer.close()
        # a request the engine refuses (its worker answers an `error` result): a 400 that says why
        async with httpx.AsyncClient(base_url=_url(ep), headers={"Authorization": f"Bearer {TOKEN}"}) as h:
            r = await h.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "REFUSE"}]},
                             headers={"X-Session-Id": "refused"})
            assert r.status_code == 400 and "engine could not serve the request" in r.json()["error"]["message"]
            assert "refuses prompts that say REFUSE" in r.json()["error"]["message"]
        # a client that waits for `100 Continue` before its body (curl does, for larger bodies)
        reader, writer = await asyncio.open_connection("127.0.0.1", ep.address[1])
        body = json.dumps({"messages": []}).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                     b"authorization: Bearer " + TOKEN.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body))
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).startswith(b"HTTP/1.1 100")
        writer.write(body)
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)).startswith(b"HTTP/1.1 400")
        writer.close()
        # and it still answers: two choices, two requests, both recorded
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        r = await client.chat.completions.create(
            model="anything", n=2, user="someone@example.com", logprobs=True, max_tokens=200,
            messages=[{"role": "user", "content": "What is 2 * 3 + 4?"}], tools=[CALC])
        await client.close()
        assert len(r.choices) == 2 and all(ch.finish_reason == "tool_calls" for ch in r.choices)
        assert r.model == "rlboost"  # the endpoint's model name, whatever the harness asked for
        assert len({ch.model_extra["rlboost"]["request_id"] for ch in r.choices}) == 2
        assert [lp.logprob for lp in r.choices[0].logprobs.content] == r.choices[0].model_extra["rlboost"]["logprobs"]
        refused, session = read_sessions(ep.run_dir)  # sorted by id: "refused" < "u-..."
        assert [rec["finish_reason"] for rec in refused.calls] == ["error"] and refused.episode() is None
        assert session.session.startswith("u-") and [rec["choice"] for rec in session.calls] == [0, 1]


async def test_a_worker_preempted_mid_turn_costs_the_call_time_not_tokens(
        nats_url, redis_url, js, tokenizer, model_dir, tmp_path):
    """The model turn is durable: the worker generating it gets a spot notice halfway through,
    hands it off, another worker resumes from the checkpoint, and the harness gets the very
    turn it would have got, with nothing generated twice."""
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-pre", delay_s=0.05, k=4) as (ep, c, ws):
        (slow,) = ws
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        call = asyncio.create_task(client.chat.completions.create(
            model="rlboost", messages=[{"role": "user", "content": "What is 6 * 7 + 1?"}], tools=[CALC],
            max_tokens=200, extra_headers={"X-Session-Id": "preempted"}))
        for _ in range(400):  # until the slow worker has checkpointed part of the turn
            if slow.counters.get("checkpointed") >= 12 or call.done():
                break
            await asyncio.sleep(0.05)
        assert not call.done() and slow.counters.get("checkpointed") >= 12
        ctl = await c.js.key_value(wire.BUCKET_CONTROL)
        await ctl.put(slow.worker_id, wire.encode(wire.control("drain", slow.worker_id, "spot notice")))
        fast = _worker(c, tokenizer, "oa-pre", "fast")
        fast_task = asyncio.create_task(fast.run())
        try:
            r = await asyncio.wait_for(call, 30)
        finally:
            fast.request_drain("test over")
            await fast_task
        await client.close()
        assert r.choices[0].finish_reason == "tool_calls"
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"expression": "6 * 7"}
        (rec,) = read_sessions(ep.run_dir)[0].calls
        reference = CalculatorPolicy(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>")).answer(rec["prompt_ids"])
        assert rec["completion_ids"] == reference == (await c.store.read(rec["request_id"]))[0]
        assert [s["worker_id"] for s in rec["segments"]] == [slow.worker_id, fast.worker_id]
        assert 12 <= rec["segments"][1]["offset"] < len(reference)
        s = slow.counters.snapshot()
        assert s["handed_off"] == 1 and s["generated"] == s["checkpointed"]  # nothing to generate again
        assert fast.counters.get("generated") == len(reference) - rec["segments"][1]["offset"]


@pytest.mark.slow
def test_the_command_serves_until_sigterm_and_refuses_an_open_public_bind(nats_url, redis_url, model_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "RLBOOST_NATS_URL": nats_url, "RLBOOST_REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    env.pop("RLBOOST_ENDPOINT_TOKEN", None)
    cmd = [sys.executable, "-m", "rlboost.cli", "serve-openai", "--model-dir", str(model_dir),
           "--run-dir", str(tmp_path / "run"), "--pool", "oa-cli"]
    refused = subprocess.run([*cmd, "--host", "0.0.0.0"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "not a loopback address: set a token in $RLBOOST_ENDPOINT_TOKEN" in refused.stderr
    proc = subprocess.Popen([*cmd, "--port", "0", "--model-name", "my-policy"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**env, "RLBOOST_ENDPOINT_TOKEN": TOKEN})
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, line
        base = f"http://127.0.0.1:{m.group(1)}"
        assert httpx.get(base + "/v1/models").status_code == 401
        got = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"})
        assert got.status_code == 200 and got.json()["data"][0]["id"] == "my-policy"
        bad = httpx.post(base + "/v1/chat/completions", json={"messages": []}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert bad.status_code == 400 and "non-empty list" in bad.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


async def test_sessions_recorded_by_the_endpoint_train_two_grpo_steps(
        nats_url, redis_url, js, tokenizer, model_dir, tmp_path):
    """From harness to trainer: two tasks, each with an episode the harness completes (reward 1)
    and one it gives up after the first call (reward 0); the sessions' records, read back from
    the run dir, are two GRPO steps of the real trainer on the real (tiny) model."""
    import torch

    from rlboost.config import TrainerSettings
    from rlboost.trainer.grpo_trainer import GRPOTrainer

    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-train") as (ep, _, _):
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        tasks = {"t0": "What is 3 * 4 + 2?", "t1": "What is 5 * 5 + 1?"}
        async with httpx.AsyncClient(base_url=_url(ep), headers={"Authorization": f"Bearer {TOKEN}"}) as h:
            for task, question in tasks.items():
                for name, turns, reward in (("done", 6, 1.0), ("quit", 1, 0.0)):
                    responses = await _agent_loop(client, f"{task}-{name}", question, max_turns=turns)
                    assert len(responses) == (3 if name == "done" else 1)
                    got = await h.post(f"/v1/rlboost/sessions/{task}-{name}/reward", json={"reward": reward})
                    assert got.status_code == 200
        await client.close()
    sessions = {s.session: s for s in read_sessions(ep.run_dir)}
    assert sorted(sessions) == ["t0-done", "t0-quit", "t1-done", "t1-quit"]
    trainer = GRPOTrainer(str(model_dir), TrainerSettings(device="cpu", precision="fp32", lr=1e-3), seed=0)
    before = [p.detach().clone() for p in trainer.params]
    for step in range(2):
        trainer.start_step(step, policy_version=1)
        tokens = 0
        for g, task in enumerate(tasks):
            results, rewards = [], []
            for name in ("done", "quit"):
                s = sessions[f"{task}-{name}"]
                for r in s.results():
                    results.append(r)
                    rewards.append(s.reward)
                    tokens += len(r.token_ids)
            trainer.add_group(g, results, rewards)
        rep = trainer.finish_step()
        # 8 trained calls: each finished episode's 3 calls with reward 1, each quit one's call with 0
        assert rep.tokens == tokens and rep.responses == 8 and rep.reward_mean == pytest.approx(6 / 8)
        assert rep.grad_norm > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.params, strict=True))


async def test_a_retried_call_with_an_idempotency_key_gets_its_turn_from_the_checkpoint(
        nats_url, redis_url, js, tokenizer, model_dir, tmp_path):
    """The endpoint dies while a call waits; the harness retries it, with the same
    Idempotency-Key, on the endpoint's next life: the turn under way is finished, not started
    again, recorded once; a retry of an answered call is answered from the checkpoint."""
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-idem", delay_s=0.05, k=4) as (ep, c, ws):
        (w,) = ws
        body = {"model": "rlboost", "messages": [{"role": "user", "content": "What is 9 * 9 + 9?"}],
                "tools": [CALC], "max_tokens": 200}
        hdrs = {"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "retried", "Idempotency-Key": "call-1"}
        async with httpx.AsyncClient(base_url=_url(ep), timeout=30) as h:
            first = asyncio.create_task(h.post("/v1/chat/completions", json=body, headers=hdrs))
            for _ in range(400):  # until the worker is halfway through the turn
                if w.counters.get("checkpointed") >= 12:
                    break
                await asyncio.sleep(0.05)
            await ep.close()  # the endpoint dies with the call waiting
            with pytest.raises(httpx.HTTPError):
                await first
        assert read_sessions(ep.run_dir) == []  # never answered, never recorded
        ep2 = OpenAIEndpoint(c, ep.cfg, tokenizer, stop_ids(model_dir, tokenizer), ep.run_dir, token=TOKEN,
                             max_context=1024)
        await ep2.start()
        try:
            async with httpx.AsyncClient(base_url=_url(ep2), timeout=30) as h:
                again = await h.post("/v1/chat/completions", json=body, headers=hdrs)
                claims = w.counters.get("claims")
                third = await h.post("/v1/chat/completions", json=body, headers=hdrs)
                other = await h.post("/v1/chat/completions", json=body, headers={**hdrs, "Idempotency-Key": "call-2"})
        finally:
            await ep2.close()
    assert again.status_code == third.status_code == other.status_code == 200, again.text
    a, t = again.json()["choices"][0], third.json()["choices"][0]
    assert a["rlboost"]["request_id"] == t["rlboost"]["request_id"] != other.json()["choices"][0]["rlboost"]["request_id"]
    assert a["rlboost"]["token_ids"] == t["rlboost"]["token_ids"] and a["message"] == t["message"]
    assert a["finish_reason"] == "tool_calls"
    (session,) = read_sessions(ep.run_dir)
    assert [(rec["request_id"], rec["turn"]) for rec in session.calls] == [
        (a["rlboost"]["request_id"], 0), (other.json()["choices"][0]["rlboost"]["request_id"], 1)]
    # the turn was generated once: part by the first life's call, the rest after the retry,
    # and the answered retry cost the worker no claim at all
    reference = CalculatorPolicy(tokenizer, 0).answer(session.calls[0]["prompt_ids"])[:-1]
    assert a["rlboost"]["token_ids"][:-1] == reference
    assert w.counters.get("claims") == claims + 1  # only the call with the new key
    assert w.counters.get("generated") == len(a["rlboost"]["token_ids"]) + len(
        other.json()["choices"][0]["rlboost"]["token_ids"])
