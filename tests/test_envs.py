"""Environments and the episode runner (rlboost/envs): the protocol's messages round-trip, the
runner keeps its bounds and survives anything an environment does, a snapshot taken after any
phase resumes to the same transcript without calling a recorded tool again, the chat formats
(a real tokenizer, a real chat template) parse what a model writes without raising, and the
built-in calculator environment is deterministic, held out and solvable with >= 2 calls.

The only test double is the LLM: a scripted `generate` that writes fixed turns or a perfect
policy that reads the tool results from the token stream."""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter

import msgspec
import pytest

from rlboost import plugins
from rlboost.envs import load_env
from rlboost.envs import calculator as calc
from rlboost.envs.chat import FallbackFormat, TemplateFormat, chat_format, parse_turn, Syntax
from rlboost.episodes.runner import EpisodeResult, EpisodeRunner, Generation, Snapshot
from rlboost.config import EnvSettings
from rlboost.envs.protocol import (Context, Env, EnvError, Message, ModelTurn, Opening, Reply, Score,
                                   ToolCall, ToolResult, ToolSpec, user)
from rlboost.trainer.model import build_tokenizer

TOOL = ToolSpec(name="echo", description="echo", parameters={"type": "object", "properties": {"x": {"type": "string"}},
                                                             "required": ["x"]})


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(calc.ALPHABET)


@pytest.fixture(scope="module")
def fmt(tok):
    return FallbackFormat(tok, describe_tools=False, compact_calls=True)


def scripted(tok, turns: list[str], calls: list | None = None):
    """The LLM double: the n-th call writes turns[n] (then EOS), logprobs -0.5 each."""
    state = {"n": 0}

    async def generate(prompt_ids, max_new_tokens, stop_ids):
        if calls is not None:
            calls.append(list(prompt_ids))
        text = turns[min(state["n"], len(turns) - 1)]
        state["n"] += 1
        ids = tok(text, add_special_tokens=False)["input_ids"] + [stop_ids[0]]
        ids = ids[:max_new_tokens]
        return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="", policy_version=3, worker="w1")

    return generate


def perfect_policy(tok, fmt, by_question: dict, json_calls: bool = False):
    """Solves a calculator problem from what the token stream shows: the question, and the
    tool results so far (each step's expression uses them)."""

    async def generate(prompt_ids, max_new_tokens, stop_ids):
        text = tok.decode(prompt_ids, skip_special_tokens=False)
        row = next(r for q, r in by_question.items() if q in text)
        results = [r.strip() for r in re.findall(r"<tool_response>(.*?)</tool_response>", text, re.S)]
        if len(results) < len(row["steps"]):
            expr = row["steps"][len(results)].format(*results)
            out = fmt.assistant_text(Message(role="assistant", tool_calls=[
                ToolCall(key="k", name="calc", arguments={"expression": expr})]), [calc.CALC])
            if json_calls:
                out = Syntax().write("calc", {"expression": expr})
        else:
            out = f"Answer: {results[-1]}"
        ids = tok(out, add_special_tokens=False)["input_ids"] + [stop_ids[-1]]
        return (ids[:max_new_tokens], [-0.25] * len(ids[:max_new_tokens]))

    return generate


class Counting(calc.CalculatorEnv):
    """The calculator, counting how often each idempotency key reaches the tool."""

    def __init__(self, counter: Counter) -> None:
        super().__init__(instructions=False)
        self.counter = counter

    def call_tool(self, call, state, ctx):
        self.counter[call.key] += 1
        return super().call_tool(call, state, ctx)


class Echo(Env):
    """A small env: `echo` answers its argument; `boom` raises; `hang` never returns."""

    def __init__(self, hang_event: threading.Event | None = None) -> None:
        self.hang_event = hang_event

    def start(self, row, ctx):
        return Opening(messages=[user(row.get("q", "say"))], tools=[TOOL, ToolSpec(name="boom"), ToolSpec(name="hang"),
                                                                     ToolSpec(name="block"), ToolSpec(name="nojson")],
                       state={"n": 0})

    def tool_echo(self, state, ctx, x):
        return ToolResult(content=x, state={"n": state["n"] + 1}, set_state=True)

    def tool_boom(self, state, ctx):
        raise RuntimeError("kaput")

    async def tool_hang(self, state, ctx):
        await asyncio.Event().wait()

    def tool_block(self, state, ctx):  # a plain function that blocks its thread until released
        assert self.hang_event is not None and self.hang_event.wait(60)
        return "released"

    def tool_nojson(self, state, ctx):
        return ToolResult(content="ok", state={"x": object()}, set_state=True)

    def score(self, transcript, state, ctx):
        return Score(reward=float(state["n"]), metrics={"n": float(state["n"])})


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- protocol and snapshots


def test_protocol_messages_and_snapshots_round_trip_as_json(tok, fmt):
    call = ToolCall(key="ep/0/1", name="calc", arguments={"expression": "2*3"}, index=1)
    msgs = [user("q"), Message(role="assistant", content="t", tool_calls=[call]),
            Message(role="tool", content="6", tool_call_id="ep/0/1", name="calc")]
    assert msgspec.json.decode(msgspec.json.encode(msgs), type=list[Message]) == msgs
    assert msgs[1].chat()["tool_calls"][0]["function"] == {"name": "calc", "arguments": {"expression": "2*3"}}
    assert msgs[2].chat()["tool_call_id"] == "ep/0/1"

    row = calc.rows("train", 1, seed=5)[0]
    runner = EpisodeRunner(calc.make(instructions=False), fmt)
    gen = perfect_policy(tok, fmt, {row["question"]: row})
    snap = run(runner.run(gen, "ep", row, stop_after=2))  # a model turn and its tool call
    assert isinstance(snap, Snapshot) and snap.phase == "generate" and snap.tool_calls == 1
    back = Snapshot.decode(snap.encode())
    expect = [result for _, result in calc.work(row["steps"])]  # the worked steps' results: the turn rewards
    assert back == snap and back.state == {"answer": row["answer"], "calls": 1, "bad": 0, "expect": expect}
    assert [s.kind for s in back.segments] == ["prompt", "model", "env"]
    with pytest.raises(EnvError, match="version"):
        Snapshot.decode(snap.encode().replace(b'"version":1,', b'"version":9,'))
    with pytest.raises(EnvError, match="not an episode snapshot"):
        Snapshot.decode(b'{"episode_id": "e", "phase": "nowhere"}')
    with pytest.raises(EnvError, match="not an episode snapshot"):
        Snapshot.decode(b"\x00garbage")
    runner = EpisodeRunner(calc.make(), fmt)
    with pytest.raises(EnvError, match="3 tokens with 2 logprobs"):  # a generator's bug is never papered over
        runner.model_turn(Snapshot(episode_id="x"), Generation(token_ids=[5, 6, 1], logprobs=[-1.0, -1.0]))


def test_env_settings_validate_their_keys():
    assert EnvSettings().on_tool_error == "message"
    for bad, key in (({"on_tool_error": "ignore"}, "on_tool_error"), ({"max_turns": 0}, "max_turns"),
                     ({"tool_timeout_s": 0}, "tool_timeout_s"), ({"nope": 1}, "nope")):
        with pytest.raises(msgspec.ValidationError, match=key):
            msgspec.convert(bad, EnvSettings)


def test_envs_and_plugins_load_from_a_module_a_file_or_a_builtin_name(tmp_path):
    assert isinstance(load_env("calculator"), calc.CalculatorEnv)
    assert isinstance(load_env("rlboost.envs.calculator:make", instructions=False), calc.CalculatorEnv)
    (tmp_path / "my_env.py").write_text("from rlboost.envs.calculator import CalculatorEnv\n"
                                        "def env():\n    return CalculatorEnv()\n"
                                        "def nothing():\n    return 42\n"
                                        "def broken():\n    raise KeyError('x')\n")
    assert isinstance(load_env(f"{tmp_path}/my_env.py:env"), calc.CalculatorEnv)
    for ref, what in ((f"{tmp_path}/my_env.py:nothing", "not an environment"), (f"{tmp_path}/my_env.py:broken",
                      "failed"), ("nocolon", "module:function"), ("no_such_mod_zz:f", "cannot import"),
                     (f"{tmp_path}/gone.py:f", "no such file"), (f"{tmp_path}/my_env.py:zz", "no function 'zz'")):
        with pytest.raises(EnvError, match=what):
            load_env(ref)
    with pytest.raises(plugins.PluginError, match="thing"):
        plugins.load("x", what="thing")


# ---------------------------------------------------------------- the runner


def test_a_scripted_episode_records_typed_segments_and_a_training_mask(tok, fmt):
    gen = scripted(tok, ['<tool_call>{"name": "echo", "arguments": {"x": "hi"}}</tool_call>',
                         "<tool_call>echo yo</tool_call><tool_call>echo 2</tool_call>", "done"])
    runner = EpisodeRunner(Echo(), fmt, EnvSettings(max_turns=5))
    res = run(runner.run(gen, "ep1", {"q": "say"}))
    assert isinstance(res, EpisodeResult)
    assert (res.end_reason, res.turns, res.tool_calls, res.reward) == ("done", 3, 3, 3.0)
    kinds = [s.kind for s in res.segments]
    assert kinds == ["prompt", "model", "env", "model", "env", "model"]
    for seg in res.segments:
        assert (len(seg.logprobs) == len(seg.token_ids)) if seg.kind == "model" else not seg.logprobs
        if seg.kind == "model":
            assert (seg.policy_version, seg.worker) == (3, "w1") and seg.token_ids[-1] == tok.eos_token_id
    assert len(res.token_ids) == len(res.mask) == len(res.logprobs)
    assert sum(res.mask) == sum(len(s.token_ids) for s in res.segments if s.kind == "model")
    assert all(lp == 0.0 for lp, m in zip(res.logprobs, res.mask) if not m)
    env_text = tok.decode(res.segments[4].token_ids)
    assert env_text == "<tool_response>yo</tool_response>\n<tool_response>2</tool_response>\n"
    keys = [c.key for m in res.messages if m.role == "assistant" for c in m.tool_calls]
    assert keys == ["ep1/0/0", "ep1/1/0", "ep1/1/1"]
    assert [m.tool_call_id for m in res.messages if m.role == "tool"] == keys


def test_a_tool_that_raises_or_times_out_is_an_error_message_or_the_end(tok, fmt):
    hang = threading.Event()
    try:
        turns = ["<tool_call>boom</tool_call><tool_call>hang</tool_call><tool_call>block</tool_call>"
                 "<tool_call>echo x</tool_call>", "ok"]

        def release(snap):  # the blocked thread is let go once its call has timed out
            if snap.tool_timeouts == 2:
                hang.set()

        res = run(EpisodeRunner(Echo(hang), fmt, EnvSettings(tool_timeout_s=0.3)).run(
            scripted(tok, turns), "e", {}, on_checkpoint=release))
        tools = [m.content for m in res.messages if m.role == "tool"]
        assert tools[0] == "error: boom failed: RuntimeError: kaput"
        assert tools[1] == "error: hang timed out after 0.3s" and tools[2] == "error: block timed out after 0.3s"
        assert tools[3] == "x"
        assert (res.end_reason, res.tool_calls, res.metrics["tool_errors"], res.metrics["tool_timeouts"]) == \
            ("done", 4, 3.0, 2.0)

        res = run(EpisodeRunner(Echo(), fmt, EnvSettings(on_tool_error="end")).run(scripted(tok, turns), "e", {}))
        assert (res.end_reason, res.tool_calls, res.turns) == ("tool_error", 1, 1)  # hang and echo never ran
        assert res.reward == 0.0 and [m.role for m in res.messages][-1] == "tool"

        # state that is not JSON is a failed call, not a crash
        res = run(EpisodeRunner(Echo(), fmt).run(scripted(tok, ["<tool_call>nojson</tool_call>", "ok"]), "e", {}))
        assert res.metrics["tool_errors"] == 1.0 and "not JSON-serialisable" in res.messages[2].content
    finally:
        hang.set()


class Broken(Echo):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def start(self, row, ctx):
        if self.where == "start":
            raise ValueError("no episode for you")
        if self.where == "opening":
            return {"messages": []}
        return super().start(row, ctx)

    def respond(self, transcript, turn, state, ctx):
        if self.where == "respond":
            return "not a reply"
        return super().respond(transcript, turn, state, ctx)

    def score(self, transcript, state, ctx):
        if self.where == "score":
            raise ZeroDivisionError("no score")
        return float("nan") if self.where == "nan" else super().score(transcript, state, ctx)


@pytest.mark.parametrize("where, reason, errors", [("start", "env_error", 1), ("opening", "env_error", 1),
                                                   ("respond", "env_error", 1), ("score", "done", 1),
                                                   ("nan", "done", 1)])
def test_nothing_an_environment_does_crashes_the_runner(tok, fmt, where, reason, errors):
    res = run(EpisodeRunner(Broken(where), fmt).run(scripted(tok, ["<tool_call>echo a</tool_call>", "ok"]), "e", {}))
    assert res.end_reason == reason and res.reward == 0.0 and res.metrics["env_errors"] == errors


def test_max_turns_ends_the_episode_and_the_last_turns_calls_are_not_run(tok, fmt):
    counter: Counter = Counter()
    row = calc.rows("train", 1)[0]
    res = run(EpisodeRunner(Counting(counter), fmt, EnvSettings(max_turns=3)).run(
        scripted(tok, ["<tool_call>calc 1+1</tool_call>"]), "m", row))
    assert (res.end_reason, res.turns, res.tool_calls, sum(counter.values())) == ("max_turns", 3, 2, 2)
    assert res.reward == 0.0


def test_max_episode_tokens_bounds_the_whole_stream(tok, fmt):
    row = calc.rows("train", 1)[0]
    full = run(EpisodeRunner(calc.make(instructions=False), fmt).run(
        perfect_policy(tok, fmt, {row["question"]: row}), "t", row))
    prompt, n = full.prompt_len, len(full.token_ids)
    assert full.reward == 1.0 and prompt < n
    for limit in range(prompt + 1, n):  # every cut: within the bound, never a reward
        res = run(EpisodeRunner(calc.make(instructions=False), fmt, EnvSettings(max_episode_tokens=limit)).run(
            perfect_policy(tok, fmt, {row["question"]: row}), "t", row))
        assert len(res.token_ids) <= limit and res.token_ids == full.token_ids[:len(res.token_ids)]
        # (the last cut loses only the final EOS: the answer is all there, and scored)
        assert res.end_reason == "max_episode_tokens" and res.reward == float(limit == n - 1), limit
    res = run(EpisodeRunner(calc.make(instructions=False), fmt, EnvSettings(max_episode_tokens=n)).run(
        perfect_policy(tok, fmt, {row["question"]: row}), "t", row))
    assert res.reward == 1.0 and res.token_ids == full.token_ids
    # the prompt alone over the budget: no model turn at all
    res = run(EpisodeRunner(calc.make(instructions=False), fmt, EnvSettings(max_episode_tokens=prompt)).run(
        perfect_policy(tok, fmt, {row["question"]: row}), "t", row))
    assert (res.end_reason, res.turns) == ("max_episode_tokens", 0)


def test_a_turn_cut_off_by_its_token_budget_ends_the_episode(tok, fmt):
    res = run(EpisodeRunner(Echo(), fmt, max_turn_tokens=8).run(scripted(tok, ["<tool_call>echo hello</tool_call>"]),
                                                                "c", {}))
    assert (res.end_reason, res.turns, res.tool_calls) == ("length", 1, 0)


def test_malformed_tool_calls_go_back_to_the_model_as_errors(tok, fmt):
    turns = ['<tool_call>{"name": "echo", "arguments": {"x": </tool_call>', "<tool_call>nosuch 1</tool_call>",
             '<tool_call>{"name": "echo", "arguments": {}}</tool_call>', "<tool_call>echo x", "<tool_call>echo ok</tool_call>",
             "bye"]
    res = run(EpisodeRunner(Echo(), fmt, EnvSettings(max_turns=8)).run(scripted(tok, turns), "bad", {}))
    tools = [m.content for m in res.messages if m.role == "tool"]
    assert tools[0].startswith("error: invalid JSON in a tool call")
    assert tools[1].startswith("error: invalid JSON") or "unknown tool" in tools[1]
    assert tools[2] == "error: echo: missing argument 'x'"
    assert tools[3].startswith("error: unclosed <tool_call>")
    assert tools[4] == "ok" and (res.end_reason, res.tool_calls, res.reward) == ("done", 1, 1.0)


def test_parse_turn_handles_what_models_write():
    tools = [TOOL, calc.CALC]
    hermes = Syntax(compact=True)
    cases = [
        ('I will call.<tool_call>\n{"name": "echo", "arguments": {"x": "a"}}\n</tool_call>', "I will call.",
         [("echo", {"x": "a"})], 0),
        ('<tool_call>{"name": "echo", "arguments": "{\\"x\\": \\"s\\"}"}</tool_call>', "", [("echo", {"x": "s"})], 0),
        ('<tool_call>{"function": {"name": "echo", "parameters": {"x": "o"}}}</tool_call>', "", [("echo", {"x": "o"})],
         0),
        ("<tool_call>calc 2 * (3+4)</tool_call>", "", [("calc", {"expression": "2 * (3+4)"})], 0),
        ("<tool_call>[1, 2]</tool_call>", "", [], 1),
        ('<tool_call>{"name": 5}</tool_call>', "", [], 1),
        ('<tool_call>{"name": "echo", "arguments": [1]}</tool_call>', "", [], 1),
        ("<tool_call></tool_call>plain", "plain", [], 1),
        ("no calls at all", "no calls at all", [], 0),
        ("\x00\ufffd<tool_call>{{{{</tool_call><tool_call>", "\x00\ufffd", [], 2),
    ]
    for text, outside, calls, n_errors in cases:
        turn = parse_turn(text, hermes, tools, "ep", 4)
        assert isinstance(turn, ModelTurn) and turn.text == outside, text
        assert [(c.name, c.arguments) for c in turn.tool_calls] == calls, text
        assert len(turn.errors) == n_errors, (text, turn.errors)
        assert [c.key for c in turn.tool_calls] == [f"ep/4/{i}" for i in range(len(calls))]


# ---------------------------------------------------------------- resume


def test_resume_from_any_snapshot_reuses_recorded_tool_results(tok, fmt):
    """Preempt after every checkpoint in turn: the resumed episode (a new runner, a new env
    object) ends token-identical to the undisturbed one and every key reached the tool once."""
    rows = calc.rows("train", 6, seed=2)
    rows = [r for r in rows if len(r["steps"]) == 3][:1] + [r for r in rows if len(r["steps"]) == 2][:1]
    # a turn with two calls too: the runner must resume between them
    two = ["<tool_call>calc 2*3</tool_call><tool_call>calc 4*5</tool_call>", "Answer: 20"]

    class Preempted(Exception):
        pass

    for make_gen, row in [((lambda r: perfect_policy(tok, fmt, {r["question"]: r})), rows[0]),
                          ((lambda r: perfect_policy(tok, fmt, {r["question"]: r})), rows[1]),
                          ((lambda r: scripted(tok, two)), rows[1])]:
        base_counter: Counter = Counter()
        base = run(EpisodeRunner(Counting(base_counter), fmt).run(make_gen(row), "ep", row))
        points = 0

        def count(snap):
            nonlocal points
            points += 1

        run(EpisodeRunner(Counting(Counter()), fmt).run(make_gen(row), "ep", row, on_checkpoint=count))
        assert points >= 5 and base.tool_calls >= 2
        for k in range(1, points):
            counter: Counter = Counter()
            saved: list[bytes] = []

            def checkpoint(snap, k=k):
                saved.append(snap.encode())
                if len(saved) == k:
                    raise Preempted

            with pytest.raises(Preempted):
                run(EpisodeRunner(Counting(counter), fmt).run(make_gen(row), "ep", row, on_checkpoint=checkpoint))
            snap = Snapshot.decode(saved[-1])
            gen = make_gen(row)
            if make_gen(row).__qualname__.startswith("scripted"):  # a script resumes at its next turn
                gen = scripted(tok, two[sum(1 for s in snap.segments if s.kind == "model"):] or two[-1:])
            res = run(EpisodeRunner(Counting(counter), fmt).run(gen, snapshot=snap))
            assert res.token_ids == base.token_ids and res.messages == base.messages, k
            assert res.reward == base.reward and res.mask == base.mask
            assert counter == base_counter and set(counter.values()) == {1}, (k, counter)


def test_a_pending_tool_call_is_named_by_the_snapshot(tok, fmt):
    counter: Counter = Counter()
    two = ["<tool_call>calc 2*3</tool_call><tool_call>calc 4*5</tool_call>", "Answer: 20"]
    row = calc.rows("train", 1)[0]
    runner = EpisodeRunner(Counting(counter), fmt)
    snap = run(runner.run(scripted(tok, two), "p", row, stop_after=1))
    assert snap.phase == "tools" and snap.pending_call().key == "p/0/0"
    seen = []

    async def one_then_stop(s):
        seen.append(Snapshot.decode(s.encode()))

    run(runner.run_tools(snap, on_record=one_then_stop))
    assert seen[0].pending_call().key == "p/0/1" and seen[0].pending.results[0].content == "6"
    assert seen[1].pending_call() is None and seen[1].state["calls"] == 2


# ---------------------------------------------------------------- the calculator


def test_calculator_problems_are_seeded_held_out_and_evaluated_safely():
    a, b = calc.rows("train", 50, seed=7), calc.rows("train", 50, seed=7)
    assert a == b and a != calc.rows("train", 50, seed=8)
    test = calc.rows("test", 100, seed=0)
    assert {r["split"] for r in test} == {"test"} and len({r["question"] for r in test}) == 100
    train_q = {r["question"] for s in range(3) for r in calc.rows("train", 300, seed=s)}
    assert not train_q & {r["question"] for r in test}
    assert all(calc.held_out(r["question"]) for r in test) and not any(calc.held_out(q) for q in train_q)
    assert set(calc.ALPHABET) >= set("".join(r["question"] for r in a)) | set(calc.INSTRUCTIONS)
    assert calc.evaluate("(12+3)*4/6") == "10" and calc.evaluate("7/2") == "3.5"
    for bad in ("2**8", "__import__('os')", "1/0", "", "1e5", "(" * 90):
        with pytest.raises(calc.CalcError):
            calc.evaluate(bad)


def test_the_small_level_draws_smaller_numbers_in_the_same_stories_still_held_out():
    small, standard = calc.rows("train", 300, seed=0, level="small"), calc.rows("train", 300, seed=0)
    assert small == calc.rows("train", 300, seed=0, level="small") and small != standard
    assert load_env("calculator", level="small").rows("train", 300, 0) == small
    test = calc.rows("test", 100, seed=0, level="small")
    assert all(calc.held_out(r["question"]) for r in test) and not any(calc.held_out(r["question"]) for r in small)
    # fewer digits to copy: operands of at most 2 digits (standard: up to 3), answers below 1000
    digits = [len(n) for r in small for n in re.findall(r"\d+", r["question"])]
    assert max(digits) <= 3 and sum(d >= 3 for d in digits) < len(digits) / 20
    assert max(int(float(r["answer"])) for r in small) < 1000
    assert max(len(n) for r in standard for n in re.findall(r"\d+", r["question"])) >= 3
    # still one call per step: 2 or 3 steps, about 2.3 a problem
    assert {len(r["steps"]) for r in small} == {2, 3} and sum(len(r["steps"]) for r in small) / len(small) >= 2.2
    for bad in (lambda: calc.rows("train", 5, level="tiny"), lambda: load_env("calculator", level="tiny")):
        with pytest.raises(calc.CalcConfigError, match="standard or small"):
            bad()


@pytest.mark.parametrize("level", ["standard", "small"])
@pytest.mark.parametrize("template", [False, True])
def test_a_perfect_policy_scores_1_with_at_least_2_calls_on_average(tok, template, level):
    rows = calc.rows("test", 40, seed=0, level=level)
    by_q = {r["question"]: r for r in rows}
    tokenizer = qwen_like_tokenizer() if template else tok
    f = chat_format(tokenizer, describe_tools=False, compact_calls=True)
    assert isinstance(f, TemplateFormat if template else FallbackFormat)
    runner = EpisodeRunner(calc.make(instructions=template), f, EnvSettings(max_episode_tokens=2048),
                           max_turn_tokens=128)

    async def all_rows():
        gen = perfect_policy(tokenizer, f, by_q, json_calls=template)
        return await asyncio.gather(*(runner.run(gen, f"ep{i}", r) for i, r in enumerate(rows)))

    results = run(all_rows())
    assert [r.reward for r in results] == [1.0] * len(rows), [r.end_reason for r in results]
    assert sum(r.tool_calls for r in results) / len(results) >= 2.0
    assert all(r.metrics["correct"] == 1.0 and r.end_reason == "done" for r in results)
    wrong = run(runner.run(scripted(tokenizer, ["Answer: -1"]), "w", rows[0]))
    assert wrong.reward == 0.0 and wrong.tool_calls == 0
    assert all(r.turn_rewards == [1.0] * (len(by_q[q]["steps"]) + 1) for r, q in zip(results, by_q, strict=True))
    assert wrong.turn_rewards == [0.0]


def test_calculator_turn_rewards_credit_each_right_step_however_written():
    row = {"question": "q", "answer": "87", "steps": ["4*23", "{0}-5"]}  # 92, then 87
    state = calc.CalculatorEnv().start(row, None).state
    assert state["expect"] == ["92", "87"]

    def turns(*texts):
        msgs = [Message(role="assistant", tool_calls=[calc.ToolCall(key=f"k{i}", name="calc", arguments={"expression": t})])
                if not t.startswith("Answer") else Message(role="assistant", content=t) for i, t in enumerate(texts)]
        return calc.turn_rewards(msgs, state["expect"], state["answer"])

    assert turns("23*4", "92-5", "Answer: 87") == [1.0, 1.0, 1.0]
    assert turns("4*32", "128-5", "Answer: 123") == [0.0, 0.0, 0.0]  # one copying error costs every later turn
    assert turns("4*23", "92-6", "Answer: 87") == [1.0, 0.0, 1.0]
    assert turns("4**23", "92-5", "92-5", "Answer: 87") == [0.0, 1.0, 0.0, 1.0]  # a bad expression; a step past the last
    assert calc.CalculatorEnv().start({"question": "q", "answer": "3"}, None).state.get("expect") is None  # a user's row without steps
    for steps in (["{name}+1"], ["{3}+1"], ["{0.real}"], ["2**9"]):  # a user's steps that do not work out
        assert calc.CalculatorEnv().start({"question": "q", "answer": "3", "steps": steps}, None).state.get("expect") is None


@pytest.mark.parametrize("template", [False, True])
def test_the_warm_start_conversation_is_the_runners_token_stream(tok, fmt, template):
    row = calc.rows("train", 1, seed=3)[0]
    tokenizer = qwen_like_tokenizer() if template else tok
    f = chat_format(tokenizer) if template else fmt
    ids, mask = f.conversation_ids(calc.solution(row, instructions=template), [calc.CALC])
    res = run(EpisodeRunner(calc.make(instructions=template), f).run(
        perfect_policy(tokenizer, f, {row["question"]: row}), "w", row))
    assert res.reward == 1.0 and ids == res.token_ids and mask == res.mask
    if template:  # the model's turns are the template's own: <tool_call>\n{json}\n</tool_call><|im_end|>
        first = tokenizer.decode(res.segments[1].token_ids, skip_special_tokens=False)
        assert first.startswith("<tool_call>\n{\"name\": \"calc\"") and first.endswith("</tool_call><|im_end|>")


# ---------------------------------------------------------------- a real chat template


# Qwen2.5-Instruct's chat template (tools, grouped tool responses), as the model ships it
QWEN_LIKE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


def qwen_like_tokenizer():
    t = build_tokenizer(calc.ALPHABET)
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = QWEN_LIKE
    return t


def test_the_models_own_template_writes_the_prompt_and_the_environments_tokens():
    t = qwen_like_tokenizer()
    f = chat_format(t)
    assert isinstance(f, TemplateFormat) and f.tools_native and f.syntax.name == "hermes"
    im_end = t.convert_tokens_to_ids("<|im_end|>")
    assert im_end in f.stop_ids
    prompt = t.decode(f.prompt_ids([user("What is 2*3?")], [calc.CALC]), skip_special_tokens=False)
    assert '"name": "calc"' in prompt and prompt.endswith("<|im_start|>user\nWhat is 2*3?<|im_end|>\n"
                                                          "<|im_start|>assistant\n")
    turn = ('<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>'
            '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>')
    ids = t(turn, add_special_tokens=False)["input_ids"] + [im_end]
    parsed = f.parse(ids, [calc.CALC], "e", 0)
    assert [c.arguments["expression"] for c in parsed.tool_calls] == ["2*3", "1+1"] and not parsed.errors
    history = [user("What is 2*3?"), Message(role="assistant", tool_calls=parsed.tool_calls)]
    new = [Message(role="tool", content="6", tool_call_id="e/0/0", name="calc"),
           Message(role="tool", content="2", tool_call_id="e/0/1", name="calc")]
    env = t.decode(f.env_ids(history, new, [calc.CALC], im_end), skip_special_tokens=False)
    assert env == ("\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n2\n</tool_response>"
                   "<|im_end|>\n<|im_start|>assistant\n")
    # a template without tools: roles from the template, tools described by us, results as user turns
    plain = build_tokenizer(calc.ALPHABET)
    plain.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    plain.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    g = chat_format(plain)
    assert not g.tools_native
    text = plain.decode(g.prompt_ids([user("hi")], [calc.CALC]), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou may call these tools") and '"calc"' in text
    env = plain.decode(g.env_ids([user("hi"), Message(role="assistant", tool_calls=parsed.tool_calls[:1])],
                                 new[:1], [calc.CALC], im_end), skip_special_tokens=False)
    assert env == "\n<|im_start|>user\n<tool_response>6</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_other_template_syntaxes_parse_their_calls():
    from rlboost.envs.chat import JsonSyntax, MistralSyntax, syntax_for_template

    assert isinstance(syntax_for_template("... [TOOL_CALLS] ..."), MistralSyntax)
    assert isinstance(syntax_for_template("<|python_tag|>"), JsonSyntax)
    m = parse_turn('[TOOL_CALLS][{"name": "echo", "arguments": {"x": "1"}}, {"name": "nope"}]', MistralSyntax(), [TOOL],
                   "e", 0)
    assert [c.arguments for c in m.tool_calls] == [{"x": "1"}] and len(m.errors) == 1
    m = parse_turn('[TOOL_CALLS]echo[ARGS]{"x": "2"}', MistralSyntax(), [TOOL], "e", 0)
    assert [c.arguments for c in m.tool_calls] == [{"x": "2"}]
    j = parse_turn('{"name": "echo", "parameters": {"x": "3"}}', JsonSyntax(), [TOOL], "e", 0)
    assert [c.arguments for c in j.tool_calls] == [{"x": "3"}] and j.text == ""
    assert parse_turn("just words", JsonSyntax(), [TOOL], "e", 0).text == "just words"
    assert parse_turn("<|python_tag|>{bad", JsonSyntax(), [TOOL], "e", 0).errors


def test_the_default_env_dispatches_tools_and_refuses_bad_arguments():
    async def go():
        env = Echo()
        ctx = Context(episode_id="e")
        ok = await env.call_tool(ToolCall(key="e/0/0", name="echo", arguments={"x": "a"}), {"n": 0}, ctx)
        bad = await env.call_tool(ToolCall(key="e/0/1", name="echo", arguments={"y": "a"}), {"n": 0}, ctx)
        gone = await env.call_tool(ToolCall(key="e/0/2", name="nosuch"), {"n": 0}, ctx)
        return ok, bad, gone

    ok, bad, gone = run(go())
    assert ok.content == "a" and ok.state == {"n": 1}
    assert bad.error and "bad arguments" in bad.content and gone.error and "no tool" in gone.content
    reply = Echo().respond([], ModelTurn(text="x"), None, Context(episode_id="e"))
    assert isinstance(reply, Reply) and reply.done


# ---------------------------------------------------------------- adapters (skipped only without the library)


def _answering(tok, answers: list[str]):
    return scripted(tok, answers)


def test_reasoning_gym_tasks_play_as_episodes_scored_by_their_own_verifier(tok, fmt):
    pytest.importorskip("reasoning_gym")
    env = load_env("reasoning-gym", dataset="chain_sum", attempts=2)
    train, test = env.rows("train", 20, seed=0), env.rows("test", 20, seed=0)
    assert train == env.rows("train", 20, seed=0) and not {r["question"] for r in train} & {r["question"] for r in test}
    row = train[0]
    runner = EpisodeRunner(env, fmt, EnvSettings(max_turns=4))
    right = run(runner.run(scripted(tok, [f"<answer>{row['answer']}</answer>"]), "rg1", row))
    assert (right.reward, right.turns, right.end_reason) == (1.0, 1, "done")
    retry = run(runner.run(scripted(tok, ["<answer>-1</answer>", f"Answer: {row['answer']}"]), "rg2", row))
    assert (retry.reward, retry.turns) == (1.0, 2) and "Try again" in retry.messages[2].content
    wrong = run(runner.run(scripted(tok, ["<answer>-1</answer>"]), "rg3", row))
    assert (wrong.reward, wrong.turns, wrong.metrics["attempts"]) == (0.0, 2, 2.0)
    with pytest.raises(EnvError, match="reasoning-gym 'no_such_task'"):
        load_env("reasoning-gym", dataset="no_such_task")


def test_a_textarena_game_is_multi_turn_and_resumes_by_replaying_its_moves(tok, fmt):
    pytest.importorskip("textarena")
    env = load_env("textarena", game="GuessTheNumber-v0")

    def bisect():  # the LLM double reads the game's hints from the token stream
        async def generate(prompt_ids, max_new_tokens, stop_ids):
            text = tok.decode(prompt_ids)
            lo, hi = 1, 20
            for guess, hint in re.findall(r"\[(\d+)\]<eos>.*?target number is (higher|lower)", text, re.S):
                lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
            ids = tok(f"[{(lo + hi) // 2}]", add_special_tokens=False)["input_ids"] + [stop_ids[0]]
            return ids, [-0.1] * len(ids)
        return generate

    row = env.rows("train", 1, seed=4)[0]
    runner = EpisodeRunner(env, fmt, EnvSettings(max_turns=10, max_episode_tokens=8192))
    base = run(runner.run(bisect(), "ta", row))
    assert base.reward == 1.0 and base.turns >= 2 and base.end_reason == "done"
    assert base.messages[2].role == "user" and "[GAME]" in base.messages[2].content
    assert "You are Player 0" not in base.messages[2].content  # only what is new after the move
    snap = run(runner.run(bisect(), "ta", row, stop_after=2))
    resumed = run(EpisodeRunner(load_env("textarena", game="GuessTheNumber-v0"), fmt,
                                EnvSettings(max_turns=10, max_episode_tokens=8192)).run(
        bisect(), snapshot=Snapshot.decode(snap.encode())))
    assert resumed.token_ids == base.token_ids and resumed.reward == 1.0


def test_a_gymnasium_env_is_played_in_text(tok, fmt):
    pytest.importorskip("gymnasium")
    env = load_env("gymnasium", env_id="FrozenLake-v1", is_slippery=False)
    row = {"seed": 0}
    path = ["[2]", "[2]", "[1]", "[1]", "[1]", "[2]"]  # right, right, down, down, down, right: the goal
    res = run(EpisodeRunner(env, fmt, EnvSettings(max_turns=10)).run(scripted(tok, path), "gym", row))
    assert (res.reward, res.turns, res.end_reason) == (1.0, 6, "done")
    assert "Moves: [0] left" in res.messages[0].content and "*" in res.messages[0].content
    lost = run(EpisodeRunner(env, fmt).run(scripted(tok, ["[1]", "[2]"]), "gym2", row))  # into the hole at (1,1)
    assert (lost.reward, lost.end_reason, lost.turns) == (0.0, "done", 2)


class _Hangs(Env):
    """An environment whose `where` method (start, respond or score) never returns."""

    def __init__(self, where: str) -> None:
        self.where = where

    def _maybe_hang(self, what: str) -> None:
        if self.where == what:
            threading.Event().wait(2.0)  # blocks its thread ten times past the bound below

    def start(self, row, ctx):
        self._maybe_hang("start")
        return Opening(messages=[user("hi")])

    def respond(self, transcript, turn, state, ctx):
        self._maybe_hang("respond")
        return Reply(done=True)

    def score(self, transcript, state, ctx):
        self._maybe_hang("score")
        return Score(reward=1.0)


@pytest.mark.parametrize("where", ["start", "respond", "score"])
async def test_an_environment_method_that_hangs_ends_its_episode_within_the_bound(tok, fmt, where):
    """Every environment call is bounded like a tool call (`env.tool_timeout_s`): a hung start or
    respond ends the episode env_error, a hung score gives reward 0, never a wait for ever."""
    runner = EpisodeRunner(_Hangs(where), fmt, EnvSettings(tool_timeout_s=0.2, max_episode_tokens=200),
                           max_turn_tokens=8)
    out = await asyncio.wait_for(runner.run(scripted(tok, ["ok"]), "e1", {}), timeout=10)
    if where == "score":
        assert out.end_reason == "done" and out.reward == 0.0 and out.metrics["score_error"] == 1.0
    else:
        assert out.end_reason == "env_error" and out.reward == 0.0
        assert out.metrics["env_errors"] == 1.0
