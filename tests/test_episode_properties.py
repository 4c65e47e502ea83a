"""Property tests of the episode runner (hypothesis, bounded and derandomized): generated
environments (tool latencies, failures and exceptions, hangs, a process killed mid-call, state
sizes, retries, turn counts) on strangers' chat templates (tests/stranger_models.py) with the
bank environment (tests/stranger_env.py), and generated preemption points: the runner stopped
after n phases (`EpisodeRunner.run(stop_after=n)`) or killed mid-tool-call, its snapshot
round-tripped through `Snapshot.encode/decode` or the worker's wire state
(`rlboost.episodes.pack/unpack`), and resumed by a fresh runner.

Invariants, against an undisturbed run and a small model of the rules (`expected`):
- every episode ends with its true reason (`env_error` only where `respond` broke);
- a tool call runs once per key, except the one in flight when its process died (it runs again
  with the same key), and a transfer moves money once per key;
- the transcript (tokens, mask, logprobs, messages, reward, metrics) equals the undisturbed run's.

CPU only, no servers."""

from __future__ import annotations

import asyncio
import functools

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import stranger_env
import stranger_models
from rlboost import episodes, wire
from rlboost.config import EnvSettings
from rlboost.envs.chat import chat_format
from rlboost.episodes.runner import EpisodeResult, EpisodeRunner, Generation, Snapshot
from rlboost.envs.protocol import Message, ToolCall

FAMILIES = ["qwen", "llama3", "mistral", "gemma", "fallback"]
TIMEOUT_S = 0.5  # a `hang` costs this; a healthy call (a few ms) is far below it
MAX_TURN_TOKENS = 120  # above every scripted turn but a `ramble`
PROPS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def fmt_of(family: str):
    return chat_format(stranger_models.tokenizer(family))


# ---------------------------------------------------------------- what is generated

def scenario(rnd, family: str) -> tuple[list, dict, EnvSettings, list]:
    """A model's script, an environment (chaos per call, state size, retries) and preemption
    points, drawn from `rnd` (a random.Random hypothesis seeds: derandomized, replayable) with weights of
    our own: hypothesis' structural strategies draw their simplest values most, and a one-turn
    episode with no call tests little."""
    def call():
        if rnd.random() < 0.6:
            return ("transfer", {"source": "checking", "target": "savings", "amount": rnd.randint(1, 9)})
        return ("balance", {"account": rnd.choice(["checking", "savings"])})

    script = []
    for _ in range(rnd.randint(2, 6)):
        kind = rnd.choices(["calls", "answer", "unknown_tool", "ramble"], [60, 25, 8, 7])[0]
        script.append(("calls", [call() for _ in range(1 if family == "llama3" else rnd.randint(1, 2))])
                      if kind == "calls" else ("answer", rnd.random() < 0.6) if kind == "answer" else (kind,))
    chaos = {f"{t}/{i}": rnd.choices(["kill", "slow", "raise", "error", "bad", "hang"], [40, 20, 10, 10, 10, 3])[0]
             for t, turn in enumerate(script) if turn[0] == "calls" for i in range(len(turn[1]))
             if rnd.random() < 0.35}
    if rnd.random() < 0.15:
        chaos[f"{rnd.randint(0, 5)}/respond"] = "raise"
    row = {"checking": 1000, "savings": 50, "retries": rnd.randint(0, 2), "pad": rnd.choice([0, 3, 2000]),
           "chaos": chaos, "system": rnd.random() < 0.5}
    env_settings = EnvSettings(max_turns=rnd.choice([1, 2, 3, 4, 5, 6, 6, 6]),
                               on_tool_error=rnd.choice(["message", "end"]), tool_timeout_s=TIMEOUT_S,
                               max_episode_tokens=100_000)
    stops = [(rnd.randint(1, 3), rnd.choice(["json", "wire"])) for _ in range(rnd.randint(1, 8))]
    return script, row, env_settings, stops


# ---------------------------------------------------------------- the rules, as a model


def expected(script: list, row: dict, s: EnvSettings) -> tuple[list[Message], str]:
    """The model's turns (an answer writes the balance the model would have read) and the
    reason the episode must end with, from the rules of docs/concepts/environments.md."""
    savings, retries_used, turns = row["savings"], 0, []
    for t in range(s.max_turns):
        kind, *arg = script[min(t, len(script) - 1)]
        if kind == "ramble":
            turns.append(Message(role="assistant", content="and so on " * 200))
            return turns, "length"
        if kind == "answer":
            turns.append(Message(role="assistant", content=f"Savings: {savings}." if arg[0] else "I cannot say."))
        elif kind == "unknown_tool":
            turns.append(Message(role="assistant", tool_calls=[ToolCall(key="k", name="nope")]))
        else:
            turns.append(Message(role="assistant", tool_calls=[ToolCall(key="k", name=n, arguments=a, index=i)
                                                               for i, (n, a) in enumerate(arg[0])]))
        if t + 1 >= s.max_turns and kind != "answer":
            return turns, "max_turns"  # a call past the last turn is not run
        failed = False
        for i, (name, args) in enumerate(arg[0] if kind == "calls" else []):
            if failed and s.on_tool_error == "end":
                break
            what = row["chaos"].get(f"{t}/{i}", "ok")
            if what in ("raise", "error", "bad", "hang"):
                failed = True
            elif name == "transfer":
                savings += args["amount"]
        if failed and s.on_tool_error == "end":
            return turns, "tool_error"
        if row["chaos"].get(f"{t}/respond"):
            return turns, "env_error"
        if kind == "answer":
            if arg[0] or retries_used >= row["retries"]:
                return turns, "done"
            retries_used += 1
    return turns, "max_turns"


def scripted(fmt, turns: list[Message], start: int = 0):
    """The model from turn `start` on (a resumed episode's generator picks up at its turn)."""
    n = {"i": start}

    async def generate(prompt_ids, max_new_tokens, stop_ids):
        message = turns[min(n["i"], len(turns) - 1)]
        n["i"] += 1
        ids = fmt.encode(fmt.assistant_text(message, stranger_env.TOOLS))
        if not message.content.startswith("and so on"):
            ids.append(fmt.turn_end_id)
        ids = ids[:max_new_tokens]
        return Generation(token_ids=ids, logprobs=[-0.25 - 0.001 * (i % 7) for i in range(len(ids))],
                          finish_reason="stop" if ids and ids[-1] in stop_ids else "length")

    return generate


# ---------------------------------------------------------------- the two ways a snapshot travels


def via_json(snap: Snapshot) -> Snapshot:
    return Snapshot.decode(snap.encode())


def via_wire(snap: Snapshot) -> Snapshot:
    """What a worker stores: the state without tokens, the tokens in the checkpoint."""
    prompt = snap.segments[0].token_ids if snap.segments else []
    rest = [s for s in snap.segments[1:]]
    tokens = [t for s in rest for t in s.token_ids]
    logprobs = [lp for s in rest for lp in (s.logprobs if s.kind == "model" else [0.0] * len(s.token_ids))]
    state = wire.EpisodeState(turn=snap.turn, at=len(tokens), env_state=episodes.pack(snap))
    return episodes.unpack(msgspec.json.decode(msgspec.json.encode(state), type=wire.EpisodeState), prompt, tokens,
                           logprobs)


TRAVEL = {"json": via_json, "wire": via_wire}


async def disturbed(fmt, turns, row, s: EnvSettings, stops: list, ledger: stranger_env.Ledger) -> EpisodeResult:
    """The episode stopped at every drawn point, and killed wherever a `kill` strikes, each
    time resumed by a fresh runner from what was durable: the snapshot it handed on, or the
    last checkpoint (`on_checkpoint`, after every phase and every tool call) before the kill."""
    env = stranger_env.BankEnv(ledger, kills=True)
    snapshot: Snapshot | None = None
    for attempt in range(200):
        n, travel = stops[attempt % len(stops)]
        runner = EpisodeRunner(env, fmt, s, max_turn_tokens=MAX_TURN_TOKENS)
        durable: list[Snapshot] = []
        try:
            out = await runner.run(scripted(fmt, turns, snapshot.turn if snapshot else 0), "ep", row,
                                   snapshot=snapshot, stop_after=n,
                                   on_checkpoint=lambda snap: durable.append(TRAVEL[travel](snap)))
        except stranger_env.Killed:
            snapshot = durable[-1] if durable else snapshot
            continue
        if isinstance(out, EpisodeResult):
            return out
        snapshot = TRAVEL[travel](out)
    raise AssertionError("the episode never finished")


@pytest.mark.parametrize("family", FAMILIES)
@PROPS
@given(data=st.data())
def test_a_preempted_episode_ends_as_an_undisturbed_one_with_each_call_run_once(family, data):
    script, row, s, stops = scenario(data.draw(st.randoms(use_true_random=True)), family)
    fmt = fmt_of(family)
    turns, reason = expected(script, row, s)

    ref_ledger = stranger_env.Ledger()
    ref = asyncio.run(EpisodeRunner(stranger_env.BankEnv(ref_ledger, kills=False), fmt, s,
                                    max_turn_tokens=MAX_TURN_TOKENS).run(scripted(fmt, turns), "ep", row))
    assert ref.end_reason == reason, (family, script, row["chaos"], ref.end_reason, reason)
    event(f"ends {reason}")  # what the examples cover (pytest --hypothesis-show-statistics)
    assert all(n == 1 for n in ref_ledger.executions.values())

    ledger = stranger_env.Ledger()
    got = asyncio.run(disturbed(fmt, turns, row, s, stops, ledger))
    assert got.end_reason == ref.end_reason
    assert got.token_ids == ref.token_ids and got.mask == ref.mask and got.logprobs == ref.logprobs
    assert got.messages == ref.messages and got.reward == ref.reward and got.metrics == ref.metrics
    assert got.turn_rewards == ref.turn_rewards and got.tool_calls == ref.tool_calls
    # once per key, but the call in flight at a kill (one more run, same key); money moves once
    assert set(ledger.executions) == set(ref_ledger.executions)
    transfers = {m.tool_call_id for m in ref.messages if m.role == "tool" and m.name == "transfer"}
    killed = {k for k in transfers if row["chaos"].get(k.split("/", 1)[1]) == "kill"}
    assert all(n == (2 if k in killed else 1) for k, n in ledger.executions.items()), ledger.executions
    event(f"{len(killed)} calls killed mid-flight")
    event(f"{got.turns} turns, {got.tool_calls} calls")
    assert ledger.moves == ref_ledger.moves and all(n == 1 for n in ledger.moves.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_of_the_rules_covers_every_reason(family):
    """The generator reaches every end reason (so the property above tests them all)."""
    s = EnvSettings(max_turns=3, tool_timeout_s=TIMEOUT_S)
    call = ("calls", [("balance", {"account": "checking"})])
    cases = {"done": ([call, ("answer", True)], {}, s),
             "length": ([call, ("ramble",)], {}, s),
             "max_turns": ([call], {}, s),
             "tool_error": ([call, ("answer", True)], {"0/0": "raise"}, msgspec.structs.replace(s, on_tool_error="end")),
             "env_error": ([call, ("answer", True)], {"1/respond": "raise"}, s)}
    for reason, (script, chaos, es) in cases.items():
        row = {"checking": 1000, "savings": 50, "retries": 0, "chaos": chaos}
        turns, want = expected(script, row, es)
        assert want == reason
        res = asyncio.run(EpisodeRunner(stranger_env.BankEnv(), fmt_of(family), es,
                                        max_turn_tokens=MAX_TURN_TOKENS).run(scripted(fmt_of(family), turns), "e", row))
        assert res.end_reason == reason, (family, reason, res.end_reason)
