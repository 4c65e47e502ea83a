"""A second environment of our own, written against docs/concepts/environments.md as a user
would: a tiny bank. Two tools, one with side effects; feedback and a retry.

- `balance(account)` reads a balance from the episode's state.
- `transfer(source, target, amount)` moves money: a side effect in the outside world (`Ledger`,
  shared by every episode, like a real bank's API), de-duplicated by the call's idempotency key:
  a call re-run with the same key (after its process died mid-call) returns the first outcome
  and moves nothing again. Insufficient funds or an unknown account is a failed call
  (`ToolResult(error=True)`), which `env.on_tool_error = "end"` turns into the end of the episode.
- A turn without tool calls is the model's answer: right (it names the target account's balance)
  ends the episode; wrong gets feedback (a user turn) and another try, `retries` times.
- `score`: 1 for a right answer, with metrics (`transfers`, `retries_used`, `lookups`).

For property tests the data row may also carry `chaos`, what a call does instead of its work,
by `"<turn>/<call index>"`: `slow` (a few ms), `raise` (an exception), `error` (a failed
result), `bad` (a return value that is not a ToolResult), `hang` (never answers: the runner's
timeout), `kill` (the transfer happens, then the process "dies": `Killed`, a BaseException
nothing in the runner catches, once per key: the ledger remembers), `respond` (respond raises at
that turn, `"<turn>/respond"`), and `pad` (that many filler strings in the state).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

from rlboost.envs.protocol import (Context, Env, Message, ModelTurn, Opening, Reply, Score, ToolCall, ToolResult,
                                   ToolSpec, system, user)

BALANCE = ToolSpec(
    name="balance",
    description="Read the current balance of one of the customer's accounts.\n"
                "Balances are whole euros, read at the moment of the call: a transfer made earlier in "
                "the conversation is already included. An unknown account is an error, and reading a "
                "balance never changes it, so it is safe to call as often as needed.",
    parameters={"type": "object",
                "properties": {"account": {"type": "string", "enum": ["checking", "savings"],
                                           "description": "Which account to read: checking (the everyday "
                                                          "account) or savings (the interest-bearing one)."}},
                "required": ["account"]})
TRANSFER = ToolSpec(
    name="transfer",
    description="Move money between the customer's own accounts.\n"
                "It takes effect at once and cannot be undone; a transfer larger than the source "
                "balance fails and moves nothing. Each call is one transfer: calling it twice moves "
                "the money twice. Answer with the new balance afterwards.",
    parameters={"type": "object",
                "properties": {"source": {"type": "string", "enum": ["checking", "savings"],
                                          "description": "The account the money leaves; it must hold at "
                                                         "least the amount."},
                               "target": {"type": "string", "enum": ["checking", "savings"],
                                          "description": "The account the money arrives in; not the "
                                                         "source account."},
                               "amount": {"type": "integer", "minimum": 1,
                                          "description": "Whole euros to move, at least 1; no cents."}},
                "required": ["source", "target", "amount"]})
TOOLS = [BALANCE, TRANSFER]
FEEDBACK = "Not quite: read the balance again and answer with the number."


class Killed(BaseException):
    """The process died mid-call (what a SIGKILL looks like to the test): nothing catches it."""


class Ledger:
    """The outside world: transfers that happened, by idempotency key. `executions` counts how
    often each key reached the tool (a re-run after a kill counts twice, moves money once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.applied: dict[str, str] = {}
        self.executions: Counter[str] = Counter()
        self.moves: Counter[str] = Counter()  # money actually moved, per key (never above 1)

    def transfer(self, key: str, outcome: str) -> str:
        with self.lock:
            if key not in self.applied:
                self.applied[key] = outcome
                self.moves[key] += 1
            return self.applied[key]


class BankEnv(Env):
    name = "bank"

    def __init__(self, ledger: Ledger | None = None, kills: bool = True) -> None:
        self.ledger = ledger or Ledger()
        self.kills = kills  # False: a `kill` in the chaos map is an ordinary call (the undisturbed run)

    def start(self, row: dict[str, Any], ctx: Context) -> Opening:
        balances = {"checking": int(row.get("checking", 100)), "savings": int(row.get("savings", 50))}
        amount = int(row.get("amount", 30))
        messages = [user(f"Move {amount} from checking to savings, then tell me the savings balance.")]
        if row.get("system", True):
            messages.insert(0, system("You are a careful bank assistant. Answer with the final balance."))
        state = {"balances": balances, "target": "savings", "retries": int(row.get("retries", 1)),
                 "retries_used": 0, "lookups": 0, "transfers": 0, "answered": False,
                 "chaos": dict(row.get("chaos", {})), "pad": ["x" * 16] * int(row.get("pad", 0))}
        return Opening(messages=messages, tools=list(TOOLS), state=state)

    # ---------------------------------------------------------------- tools

    def _chaos(self, state: dict, ctx: Context, call_key: str) -> str:
        index = call_key.rsplit("/", 1)[-1]
        return state["chaos"].get(f"{ctx.turn}/{index}", "")

    async def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult | str:
        self.ledger.executions[call.key] += 1  # before anything: the count the test checks
        what = self._chaos(state, ctx, call.key)
        if what == "slow":
            await asyncio.sleep(0.002)
        elif what == "raise":
            raise RuntimeError("the bank's API is down")
        elif what == "error":
            return ToolResult(content="error: try again later", error=True)
        elif what == "bad":
            return 42  # type: ignore[return-value]  # not a ToolResult: the environment's own mistake
        elif what == "hang":
            await asyncio.Event().wait()
        return await super().call_tool(call, state, ctx)

    def tool_balance(self, state: dict, ctx: Context, account: str) -> ToolResult:
        if account not in state["balances"]:
            return ToolResult(content=f"error: no account {account!r}", error=True)
        return ToolResult(content=str(state["balances"][account]),
                          state={**state, "lookups": state["lookups"] + 1}, set_state=True)

    def tool_transfer(self, state: dict, ctx: Context, source: str, target: str, amount: int) -> ToolResult:
        balances = dict(state["balances"])
        if source not in balances or target not in balances or source == target:
            return ToolResult(content=f"error: cannot move from {source!r} to {target!r}", error=True)
        if not isinstance(amount, int) or amount < 1 or amount > balances[source]:
            return ToolResult(content=f"error: insufficient funds in {source} (balance {balances[source]}, "
                                      f"asked {amount})", error=True)
        balances[source] -= amount
        balances[target] += amount
        outcome = f"ok: moved {amount} from {source} to {target}; {source} now {balances[source]}, " \
                  f"{target} now {balances[target]}"
        key = ctx.call_key  # the call's idempotency key: a re-run of this call carries the same one
        outcome = self.ledger.transfer(key, outcome)
        if self.kills and self._chaos(state, ctx, key) == "kill" and self.ledger.executions[key] == 1:
            raise Killed(key)  # the money moved; the answer never comes back
        return ToolResult(content=outcome, state={**state, "balances": balances, "transfers": state["transfers"] + 1},
                          set_state=True)

    # ---------------------------------------------------------------- turns and score

    def respond(self, transcript: list[Message], turn: ModelTurn, state: Any, ctx: Context) -> Reply:
        if state["chaos"].get(f"{ctx.turn}/respond"):
            raise RuntimeError("respond broke")
        if turn.tool_calls or turn.errors:
            return Reply()
        right = str(state["balances"][state["target"]]) in turn.text
        if right or state["retries_used"] >= state["retries"]:
            return Reply(done=True, turn_reward=float(right), state={**state, "answered": right}, set_state=True)
        return Reply(messages=[user(FEEDBACK)], turn_reward=0.0,
                     state={**state, "retries_used": state["retries_used"] + 1}, set_state=True)

    def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score:
        return Score(reward=float(state["answered"]),
                     metrics={"transfers": float(state["transfers"]), "retries_used": float(state["retries_used"]),
                              "lookups": float(state["lookups"])})


def make(**options: Any) -> BankEnv:
    return BankEnv(**options)
