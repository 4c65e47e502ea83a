"""A built-in multi-turn tool environment: arithmetic word problems solved with a calculator.

Problems are generated offline from a seed: a short story with two or three arithmetic steps
(`4 boxes of 23 pens, 37 sold: how many left?` = 4*23, then 92-37), numbers large enough that
a small model does better by calling the tool once per step than by guessing. The model calls
`calc` with an expression (`+ - * /`, parentheses, integers), reads the result, and ends with
`Answer: N`; the reward is 1 for the right final answer, else 0. A perfect policy makes about
2.3 tool calls per episode (a third of the problems take three steps).

The held-out split is a function of the problem itself (a hash of its text), so no seed of the
training split can ever draw a held-out problem. Each row carries its worked steps (`steps`,
expressions whose `{0}`, `{1}` name earlier results) and `solution(row)` gives the whole
conversation, for a supervised warm start in the episode's own format.

`make()` is what `--env calculator` loads; `rows(split, n, seed)` are its data rows.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
import string
from fractions import Fraction
from typing import Any

from rlboost.envs.protocol import Context, Env, EnvError, Message, Opening, Score, ToolCall, ToolResult, ToolSpec, system, user
from rlboost.errors import RlboostError

INSTRUCTIONS = "Use the calc tool for each step, one call at a time. Then reply: Answer: <number>"
# every character the environment (and the runner's error messages) can write: a character
# tokenizer built on this alphabet can read every episode
ALPHABET = "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c")))
HELD_OUT_EVERY = 8  # one problem in 8 (by text hash) belongs to the held-out split
NAMES = ["Ann", "Bob", "Cai", "Dee", "Eli", "Fay", "Gus", "Ida", "Joe", "Kim", "Lea", "Max", "Ned", "Ola", "Pia", "Raj"]
ITEMS = ["pens", "cards", "apples", "stamps", "coins", "beads", "books", "shells"]

CALC = ToolSpec(name="calc", description="Evaluate an arithmetic expression: integers, + - * / and parentheses.",
                parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                            "required": ["expression"]})


# ---------------------------------------------------------------- the tool


class CalcError(RlboostError, ValueError):
    """An expression the calculator refuses (the model reads why, as the tool's answer)."""


class CalcConfigError(EnvError, ValueError):
    """An option value the calculator does not have (`--env.options.level`): an EnvError, so
    `load_env` passes its message on as it is."""


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{float(x):.6g}"


def evaluate(expression: str) -> str:
    """`expression` evaluated exactly (no eval: a small AST walk); CalcError says why not."""
    text = expression.strip()
    if not text or len(text) > 80:
        raise CalcError("the expression must be 1 to 80 characters")
    if not re.fullmatch(r"[0-9+\-*/(). ]+", text):
        raise CalcError("use digits, + - * / and parentheses only")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError("cannot read the expression") from None

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = walk(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                out = a * b
                if abs(out) > 10**18:
                    raise CalcError("the result is too large")
                return out
            if b == 0:
                raise CalcError("division by zero")
            return a / b
        raise CalcError("use digits, + - * / and parentheses only")

    return _fmt(walk(tree))


# ---------------------------------------------------------------- problems


# the numbers a story draws: `standard` needs the tool (2-3 digit operands, results to ~4
# digits); `small` (one-digit multipliers, two-digit amounts) is the same stories with fewer
# digits to copy, for a small model whose errors are mostly copying numbers (still one calc
# call per step: about 2.3 per episode)
LEVELS = {
    "standard": {"mul": (3, 19), "amount": (12, 99), "stock": (20, 500), "groups": (3, 12), "per": (11, 60),
                 "extra": (11, 99), "times": (3, 9), "round": 100},
    "small": {"mul": (2, 9), "amount": (10, 30), "stock": (10, 99), "groups": (2, 6), "per": (5, 20),
              "extra": (5, 30), "times": (2, 9), "round": 10},
}


def _story(rng: random.Random, level: str = "standard") -> tuple[str, list[str]]:
    """One problem: its text and its steps ({i} = the result of step i)."""
    n = LEVELS[level]

    def draw(key: str) -> int:
        return rng.randint(*n[key])

    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(6)
    if kind == 0:
        a, b = draw("mul"), draw("amount")
        c = rng.randint(n["amount"][0] - 1, a * b - 1)
        return (f"{name} buys {a} boxes of {b} {item} and gives away {c}. How many {item} are left?",
                [f"{a}*{b}", f"{{0}}-{c}"])
    if kind == 1:
        a, b, c = draw("stock"), draw("amount"), draw("mul")
        return (f"{name} has {a} {item} and gets {b} more each day for {c} days. How many {item} now?",
                [f"{b}*{c}", f"{a}+{{0}}"])
    if kind == 2:
        a, b, c, d = draw("mul"), draw("amount"), draw("mul"), draw("amount")
        return (f"{name} packs {a} bags of {b} {item} and {c} bags of {d} {item}. How many {item} in all?",
                [f"{a}*{b}", f"{c}*{d}", "{0}+{1}"])
    if kind == 3:
        price, count, unit = draw("amount"), draw("mul"), n["round"]
        paid = (price * count // unit + rng.randint(1, 5)) * unit
        return (f"One ticket costs {price}. {name} buys {count} tickets and pays {paid}. What is the change?",
                [f"{price}*{count}", f"{paid}-{{0}}"])
    if kind == 4:
        groups, per = draw("groups"), draw("per")
        extra = draw("extra")
        a = draw("mul")
        b = (groups * per + extra) // a + 1
        total = a * b
        extra = total - groups * per
        return (f"{name} has {a} crates of {b} {item}, removes {extra}, and shares the rest equally among "
                f"{groups} friends. How many {item} does each friend get?",
                [f"{a}*{b}", f"{{0}}-{extra}", f"{{1}}/{groups}"])
    a, b, c = draw("amount"), draw("amount"), draw("times")
    return (f"{name} earns {a} on Monday and {b} on Tuesday, then {c} times that sum in the rest of the week. "
            f"How much in the rest of the week?", [f"{a}+{b}", f"{{0}}*{c}"])


def work(steps: list[str]) -> list[tuple[str, str]]:
    """Each step's expression (earlier results filled in) and its result."""
    results: list[str] = []
    out = []
    for s in steps:
        expr = s.format(*results)
        results.append(evaluate(expr))
        out.append((expr, results[-1]))
    return out


def held_out(question: str) -> bool:
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:4], "big") % HELD_OUT_EVERY == 0


def problem(rng: random.Random, level: str = "standard") -> dict[str, Any]:
    question, steps = _story(rng, level)
    answer = work(steps)[-1][1]
    return {"question": question, "answer": answer, "steps": steps,
            "split": "test" if held_out(question) else "train", "data_source": "calculator"}


def rows(split: str = "train", n: int = 256, seed: int = 0, level: str = "standard") -> list[dict[str, Any]]:
    """`n` distinct problems of `split` (train | test) at `level` (`LEVELS`), a pure function of
    (split, n, seed, level)."""
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r}: train or test")
    if level not in LEVELS:
        raise CalcConfigError(f"calculator level {level!r}: use {' or '.join(LEVELS)}")
    # the standard level keeps its original seed string: its problems are the ones always drawn
    rng = random.Random(f"calculator/{split}/{seed}" + ("" if level == "standard" else f"/{level}"))
    out, seen = [], set()
    for _ in range(200 * n + 1000):
        if len(out) >= n:
            break
        row = problem(rng, level)
        if row["split"] == split and row["question"] not in seen:
            seen.add(row["question"])
            out.append(row)
    return out


def solution(row: dict[str, Any], instructions: bool = True) -> list[Message]:
    """The worked conversation for `row`: one calc call per step, then the answer."""
    env = CalculatorEnv(instructions=instructions)
    messages = list(env.opening_messages(row))
    for i, (expr, result) in enumerate(work(row["steps"])):
        key = f"solution/{i + 1}/0"
        messages.append(Message(role="assistant", tool_calls=[ToolCall(key=key, name="calc",
                                                                        arguments={"expression": expr})]))
        messages.append(Message(role="tool", content=result, tool_call_id=key, name="calc"))
    messages.append(Message(role="assistant", content=f"Answer: {row['answer']}"))
    return messages


_ANSWER = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    m = _ANSWER.search(text)
    if m:
        return m.group(1)
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def turn_rewards(transcript: list[Message], expect: list[str], answer: str) -> list[float]:
    """One per model turn: 1 if the turn did the next right thing, else 0. A turn that calls
    the tool is right when its (first) expression's value is the worked step's result at that
    turn (`expect`, the step's value however it is written: 23*4 as well as 4*23); a turn without
    a call is right when it answers `answer`. Dense credit for a small model whose failures are
    one wrong number copied in one of three turns (the trainer's `algorithm.turn_reward_coef`)."""
    out = []
    for j, m in enumerate(x for x in transcript if x.role == "assistant"):
        if m.tool_calls:
            try:  # both as the tool prints them (`_fmt`: 1/3 is 0.333333 on both sides)
                value = evaluate(str(m.tool_calls[0].arguments.get("expression", "")))
            except CalcError:
                value = None
            out.append(float(value is not None and j < len(expect) and value == expect[j]))
        else:
            got = final_answer(m.content)
            out.append(float(got is not None and Fraction(got) == Fraction(answer)))
    return out


# ---------------------------------------------------------------- the environment


class CalculatorEnv(Env):
    """Arithmetic word problems with a `calc` tool. State: the expected answer and the calls
    made (JSON). `instructions`: open with a one-line system message saying how to work;
    `level`: the size of the numbers in its problems (`LEVELS`: standard | small)."""

    name = "calculator"
    alphabet = ALPHABET

    def __init__(self, instructions: bool = True, level: str = "standard") -> None:
        if level not in LEVELS:
            raise CalcConfigError(f"calculator level {level!r}: use {' or '.join(LEVELS)}")
        self.instructions = instructions
        self.level = level

    def opening_messages(self, row: dict[str, Any]) -> list[Message]:
        return ([system(INSTRUCTIONS)] if self.instructions else []) + [user(str(row["question"]))]

    def start(self, row: dict[str, Any], ctx: Context) -> Opening:
        if "question" not in row or "answer" not in row:
            raise ValueError("a calculator row needs question and answer")
        state = {"answer": str(row["answer"]), "calls": 0, "bad": 0}
        if isinstance(row.get("steps"), list):  # the worked steps' results: each turn's reward
            try:
                state["expect"] = [result for _, result in work([str(x) for x in row["steps"]])]
            except (CalcError, IndexError, KeyError, AttributeError, ValueError):
                pass  # a row of the user's whose steps do not work out (`{name}`, `{9}`): episode reward only
        return Opening(messages=self.opening_messages(row), tools=[CALC], state=state)

    def call_tool(self, call: ToolCall, state: Any, ctx: Context) -> ToolResult:
        if call.name != "calc":
            return ToolResult(content=f"error: no tool named {call.name!r}", error=True)
        new = {**state, "calls": state["calls"] + 1}
        try:
            content = evaluate(str(call.arguments.get("expression", "")))
        except CalcError as e:
            new["bad"] += 1
            content = f"error: {e}"
        return ToolResult(content=content, state=new, set_state=True)

    def score(self, transcript: list[Message], state: Any, ctx: Context) -> Score:
        last = next((m for m in reversed(transcript) if m.role == "assistant"), None)
        got = final_answer(last.content) if last is not None and not last.tool_calls else None
        correct = got is not None and Fraction(got) == Fraction(state["answer"])
        metrics = {"correct": float(correct), "calc_calls": float(state["calls"]),
                   "bad_expressions": float(state["bad"]), "answered": float(got is not None)}
        turns = None
        if "expect" in state:
            turns = turn_rewards(transcript, state["expect"], state["answer"])
            metrics["turns_right"] = sum(turns) / len(turns) if turns else 0.0
        return Score(reward=float(correct), turn_rewards=turns, metrics=metrics)

    def solution(self, row: dict[str, Any]) -> list[Message]:
        """The worked conversation for `row` in this environment's opening (a warm start's data)."""
        return solution(row, instructions=self.instructions)

    # data for `rlboost run --env calculator` without a dataset
    def rows(self, split: str = "train", n: int = 256, seed: int = 0) -> list[dict[str, Any]]:
        return rows(split, n, seed, self.level)


def make(instructions: bool = True, level: str = "standard") -> CalculatorEnv:
    return CalculatorEnv(instructions=instructions, level=level)
