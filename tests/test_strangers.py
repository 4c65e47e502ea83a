"""Episodes on a stranger's model and environment, not only the calculator and the character
model: byte-level BPE tokenizers with the chat templates of the families rlboost/envs/chat.py
knows (tests/stranger_models.py), a second environment of our own with a side-effecting tool,
feedback and a retry (tests/stranger_env.py), a 512-token context, a model that never stops.

Each episode runs through `chat_format(tokenizer)` + `EpisodeRunner` with a scripted model that
writes the template's own tokens, and must end with its true reason (`done`, `length`,
`max_turns`, `tool_error`, `max_episode_tokens`), never `env_error` when the environment did
nothing wrong. The only test double is the model. CPU only, no servers."""

from __future__ import annotations

import asyncio

import pytest

import stranger_env
import stranger_models
from rlboost.config import EnvSettings
from rlboost.envs.chat import FallbackFormat, TemplateFormat, chat_format
from rlboost.episodes.runner import EpisodeRunner, Generation
from rlboost.envs.protocol import Message, ToolCall

FAMILIES = stranger_models.FAMILIES
ROW = {"checking": 100, "savings": 50, "amount": 30, "retries": 1}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


def call(name: str, **arguments) -> Message:
    return Message(role="assistant", tool_calls=[ToolCall(key="k", name=name, arguments=arguments)])


def say(text: str) -> Message:
    return Message(role="assistant", content=text)


def scripted(fmt, turns: list[Message], tools=stranger_env.TOOLS, log: list | None = None):
    """The model: the n-th call writes turns[n] as the format writes an assistant message (the
    template's own tokens), then the turn's end token; cut at the budget like an engine."""
    state = {"n": 0}

    async def generate(prompt_ids, max_new_tokens, stop_ids):
        message = turns[min(state["n"], len(turns) - 1)]
        state["n"] += 1
        ids = fmt.encode(fmt.assistant_text(message, tools)) + [fmt.turn_end_id]
        if log is not None:
            log.append((len(prompt_ids), max_new_tokens))
        cut = ids[:max_new_tokens]
        return Generation(token_ids=cut, logprobs=[-0.5] * len(cut),
                          finish_reason="stop" if cut and cut[-1] in stop_ids else "length")

    return generate


SOLVES = [call("balance", account="checking"), call("transfer", source="checking", target="savings", amount=30),
          say("The savings balance is 999."), say("The savings balance is 80.")]


def run(coro):
    return asyncio.run(coro)


def episode(fmt, turns, row=ROW, env=None, max_turn_tokens: int = 128, **settings):
    env = env or stranger_env.BankEnv()
    runner = EpisodeRunner(env, fmt, EnvSettings(**{"max_episode_tokens": 4096, **settings}),
                           max_turn_tokens=max_turn_tokens)
    return run(runner.run(scripted(fmt, turns), "ep1", row))


def test_every_family_builds_its_own_format(family):
    tok = stranger_models.tokenizer(family)
    fmt = chat_format(tok)
    assert isinstance(fmt, FallbackFormat if family == "fallback" else TemplateFormat)
    assert any(p.startswith("Ġ") for p in tok.convert_ids_to_tokens(fmt.encode("Move 30 from checking")))
    if isinstance(fmt, TemplateFormat):
        assert fmt.tools_native == (family != "gemma")
        assert fmt.syntax.name == {"llama3": "json", "mistral": "mistral"}.get(family, "hermes")


def test_a_solved_episode_with_a_retry_ends_done(family):
    fmt = chat_format(stranger_models.tokenizer(family))
    env = stranger_env.BankEnv()
    res = episode(fmt, SOLVES, env=env)
    assert res.end_reason == "done", (res.end_reason, res.messages)
    assert res.reward == 1.0 and res.turns == 4 and res.tool_calls == 2
    assert res.metrics["transfers"] == 1.0 and res.metrics["retries_used"] == 1.0 and res.metrics["env_errors"] == 0
    assert res.turn_rewards == [0.0, 0.0, 0.0, 1.0]
    assert [m.content for m in res.messages if m.role == "tool"] == [
        "100", "ok: moved 30 from checking to savings; checking now 70, savings now 80"]
    assert stranger_env.FEEDBACK in [m.content for m in res.messages if m.role == "user"]
    assert list(env.ledger.moves.values()) == [1]
    # the model's tokens are what it generated; every environment token is in between
    model = [s for s in res.segments if s.kind == "model"]
    assert all(s.token_ids[-1] == fmt.turn_end_id for s in model)
    decoded = fmt.tokenizer.decode(res.token_ids, skip_special_tokens=False)
    assert "savings now 80" in decoded and stranger_env.FEEDBACK in decoded


def test_a_turn_cut_by_its_budget_ends_length(family):
    fmt = chat_format(stranger_models.tokenizer(family))
    res = episode(fmt, SOLVES, max_turn_tokens=6)
    assert res.end_reason == "length" and res.turns == 1 and res.tool_calls == 0


def test_the_second_turn_cut_ends_length_not_env_error(family):
    """The first turn fits, the second (the longer transfer call) is cut: the cut turn's last
    token is an ordinary piece (`Ġ30`-like), never mistaken for a turn's end."""
    fmt = chat_format(stranger_models.tokenizer(family))
    first = len(fmt.encode(fmt.assistant_text(SOLVES[0], stranger_env.TOOLS))) + 1
    second = len(fmt.encode(fmt.assistant_text(SOLVES[1], stranger_env.TOOLS))) + 1
    assert second > first
    res = episode(fmt, SOLVES, max_turn_tokens=first)
    assert res.end_reason == "length" and res.turns == 2 and res.tool_calls == 1, res.end_reason


def test_a_turn_past_max_turns_ends_max_turns(family):
    fmt = chat_format(stranger_models.tokenizer(family))
    env = stranger_env.BankEnv()
    res = episode(fmt, SOLVES, env=env, max_turns=2)
    assert res.end_reason == "max_turns" and res.turns == 2 and res.tool_calls == 1  # the 2nd turn's call not run
    assert not env.ledger.moves


def test_a_failed_transfer_ends_tool_error_when_asked(family):
    fmt = chat_format(stranger_models.tokenizer(family))
    overdrawn = [SOLVES[0], call("transfer", source="checking", target="savings", amount=500), *SOLVES[2:]]
    res = episode(fmt, overdrawn, on_tool_error="end")
    assert res.end_reason == "tool_error" and res.tool_calls == 2 and res.metrics["tool_errors"] == 1.0
    # the default: the model reads the error and goes on (here it answers 999, then 80: wrong)
    res = episode(fmt, overdrawn)
    assert res.end_reason == "done" and res.reward == 0.0 and res.metrics["tool_errors"] == 1.0
    assert any(m.content.startswith("error: insufficient funds") for m in res.messages if m.role == "tool")


def test_a_model_that_never_stops_ends_every_episode_by_its_budget(family):
    """No stop id ever: each episode ends `length` (its turn cut) or `max_episode_tokens`,
    within a bounded number of generate calls, whatever the context."""
    fmt = chat_format(stranger_models.tokenizer(family))
    vocab = len(fmt.tokenizer)
    calls = []

    async def babble(prompt_ids, max_new_tokens, stop_ids):
        calls.append(max_new_tokens)
        ids = [t for t in range(vocab) if t not in stop_ids][:max_new_tokens]
        ids = (ids * (max_new_tokens // max(len(ids), 1) + 1))[:max_new_tokens]
        return Generation(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="length")

    for max_episode_tokens, max_turn_tokens in ((512, 64), (512, 4096), (4096, 64), (600, 512)):
        runner = EpisodeRunner(stranger_env.BankEnv(), fmt, EnvSettings(max_episode_tokens=max_episode_tokens),
                               max_turn_tokens=max_turn_tokens)
        calls.clear()
        res = run(asyncio.wait_for(runner.run(babble, "ep", ROW), 30))
        assert res.end_reason in ("length", "max_episode_tokens") and len(calls) <= 1, (res.end_reason, calls)
        # a prompt past the context (full tool schemas: see the brief descriptions below) ends at once
        assert len(res.token_ids) <= max(max_episode_tokens, res.prompt_len)
        assert res.end_reason == ("max_episode_tokens" if len(res.token_ids) >= max_episode_tokens else "length")


def test_mistral_results_quote_the_call_id_the_model_wrote():
    """Mistral's template refuses call ids that are not 9 characters (the runner's keys are
    `<episode>/<turn>/<index>`), and its results quote the id the model wrote."""
    fmt = chat_format(stranger_models.tokenizer("mistral"))
    res = episode(fmt, SOLVES)
    assert res.end_reason == "done"
    first, env = (fmt.tokenizer.decode(s.token_ids, skip_special_tokens=False) for s in res.segments[1:3])
    written = first.split('"id": "')[1][:9]
    assert env.startswith("[TOOL_RESULTS]") and f'"call_id": "{written}"' in env
    assert res.messages[2].tool_calls[0].id == written and res.messages[2].tool_calls[0].key == "ep1/0/0"


@pytest.mark.parametrize("describe", [False, "brief"])
def test_brief_tool_descriptions_fit_a_512_context_a_template_renders_in_full(family, describe):
    """Two tools with JSON schemas, rendered in full by the model's own template, leave a
    512-token context no room to finish; `describe_tools` false ("brief") gives the template
    each tool's name, first description line and argument names and types, and it fits."""
    tok = stranger_models.tokenizer(family)
    full = episode(chat_format(tok), SOLVES, max_episode_tokens=512)
    brief_fmt = chat_format(tok, describe_tools=describe)
    brief = episode(brief_fmt, SOLVES, max_episode_tokens=512)
    if family == "fallback":  # no template: false lists no tools at all, "brief" the short lines
        assert full.end_reason == "done" and brief.end_reason == "done" and brief.prompt_len < full.prompt_len
        prompt = tok.decode(brief.token_ids[:brief.prompt_len])
        assert ("Tools: " in prompt) == (describe == "brief")
        return
    assert full.end_reason == "max_episode_tokens" and full.reward == 0.0
    assert brief.end_reason == "done" and brief.reward == 1.0 and brief.turns == 4, brief.end_reason
    prompt = tok.decode(brief.token_ids[:brief.prompt_len], skip_special_tokens=False)
    for kept in ("balance", "transfer", "Read the current balance of one of the customer's accounts.",
                 '"amount"', '"integer"'):
        assert kept in prompt, kept
    for dropped in ("enum", "Whole euros to move", "interest-bearing", "cannot be undone"):
        assert dropped not in prompt, dropped


def test_describe_tools_takes_only_its_values():
    tok = stranger_models.tokenizer("qwen")
    for bad in ("short", 2, None):
        with pytest.raises(ValueError, match="describe_tools"):
            chat_format(tok, describe_tools=bad)
    opening = stranger_env.BankEnv().start(ROW, None).messages
    assert chat_format(tok, describe_tools="full").prompt_ids(opening, stranger_env.TOOLS) == \
        chat_format(tok).prompt_ids(opening, stranger_env.TOOLS)


def test_a_cut_turn_an_engine_calls_stop_still_ends_length(family):
    """An engine that reports `stop` for a turn it cut (no stop id at its end): the runner goes
    by the tokens, `length`, never a finished turn (the environment would answer a half-written
    call) nor `env_error` (a template has no turn end after the cut piece)."""
    fmt = chat_format(stranger_models.tokenizer(family))
    env = stranger_env.BankEnv()

    async def liar(prompt_ids, max_new_tokens, stop_ids):
        ids = fmt.encode(fmt.assistant_text(SOLVES[0], stranger_env.TOOLS))[:-2]
        return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop")

    res = run(EpisodeRunner(env, fmt, EnvSettings()).run(liar, "ep", ROW))
    assert res.end_reason == "length" and res.turns == 1 and res.tool_calls == 0 and not env.ledger.executions


def test_a_call_the_parser_refuses_is_an_error_to_the_model_never_env_error(family):
    """An unknown tool: the model reads `error: unknown tool` as a tool message with no call
    key (Mistral's template wants a 9-character id on it too) and goes on."""
    fmt = chat_format(stranger_models.tokenizer(family))
    res = episode(fmt, [call("overdraft", account="checking"), *SOLVES])
    assert res.end_reason == "done" and res.turns == 5 and res.reward == 1.0, res.end_reason
    assert res.messages[3].role == "tool" and res.messages[3].content.startswith("error: unknown tool 'overdraft'")


def test_llama_two_calls_after_python_tag_run_though_its_template_takes_one():
    """Llama 3.1's template raises on an assistant turn of two calls; the model can still write
    them (`<|python_tag|>{...}; {...}`): both run and the results follow, never env_error."""
    fmt = chat_format(stranger_models.tokenizer("llama3"))
    two = ('<|python_tag|>{"name": "balance", "parameters": {"account": "checking"}}; '
           '{"name": "transfer", "parameters": {"source": "checking", "target": "savings", "amount": 30}}')
    turns = iter([fmt.encode(two) + [fmt.turn_end_id],
                  fmt.encode("The savings balance is 80.") + [fmt.turn_end_id]])

    async def generate(prompt_ids, max_new_tokens, stop_ids):
        ids = next(turns)
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids))

    res = run(EpisodeRunner(stranger_env.BankEnv(), fmt, EnvSettings()).run(generate, "ep", ROW))
    assert res.end_reason == "done" and res.tool_calls == 2 and res.reward == 1.0, res.end_reason
    env = fmt.tokenizer.decode(res.segments[2].token_ids, skip_special_tokens=False)
    assert env.count("<|start_header_id|>ipython<|end_header_id|>") == 2 and "savings now 80" in env
