"""Verifiable tasks: where prompts come from and how a response is scored.

A task is a small plugin: it samples problems from a seeded `random.Random` (so a step's
prompts are a pure function of the run seed and the step), scores a response string with a
checkable reward, and owns a fixed held-out evaluation set that training prompts never
repeat. Each problem also carries a worked `solution`: the supervised warm start
(`rlboost.trainer.bootstrap`) learns the response format from it, and RL then only has to make the
answers right.

Tasks are text-level and torch-free; tokenisation belongs to `rlboost.trainer.model`.
"""

from __future__ import annotations

import abc
import random
import re
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str  # a correct response (without the EOS token), for the warm start


class Task(abc.ABC):
    name: str = "task"
    alphabet: str = ""  # every character a prompt or response may contain: the tokenizer's vocab
    eval_size: int = 256
    eval_seed: int = 1_000_003

    @abc.abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """One problem drawn from `rng`."""

    @abc.abstractmethod
    def reward(self, problem: Problem, response: str) -> float:
        """Score a decoded response (text before the EOS token)."""

    @property
    @abc.abstractmethod
    def max_response_chars(self) -> int:
        """The longest correct response: a generation budget that never truncates one."""

    @cached_property
    def eval_set(self) -> list[Problem]:
        """Fixed, distinct problems from their own seed; `prompts` never yields them. A task
        with fewer distinct problems than `eval_size` gets what it has (never an endless search)."""
        rng, seen, out = random.Random(self.eval_seed), set(), []
        for _ in range(50 * self.eval_size):
            if len(out) >= self.eval_size:
                break
            p = self.sample(rng)
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        return out

    def prompts(self, n: int, seed: int) -> list[Problem]:
        """`n` training problems, a pure function of `seed`, none from the held-out set."""
        held_out = {p.prompt for p in self.eval_set}
        rng, out = random.Random(seed), []
        for _ in range(1000 * n + 1000):
            if len(out) >= n:
                return out
            p = self.sample(rng)
            if p.prompt not in held_out:
                out.append(p)
        raise ValueError(f"task {self.name}: nearly every problem it samples is in its held-out set")


class Addition(Task):
    """Multi-digit addition with the work written out, least significant column first.

    `47+85:` (width 3) -> `7+5+0=12;4+8+1=13;0+0+1=01;=2310`. Each column is
    `a+b+carry_in=sum` with a two-digit sum whose first digit is the next carry, so every step
    is local and checkable. The answer is written the way the work runs, least significant
    digit first and zero-padded to width+1 digits (`=2310` is 132): copying the sum digits in
    order is learnable in ~400 supervised steps, while reversing them for a most-significant-
    first answer took twice as long. Operands have 1..2 digits and the work is written over 3
    columns, so responses are 32-33 tokens with EOS — long enough for chunked generation and
    migration to matter. The reward is exact match on the final `=answer`, which must end the
    response.
    """

    name = "addition"
    alphabet = "0123456789+=;:"

    def __init__(self, min_digits: int = 1, max_digits: int = 2, width: int = 3) -> None:
        """`width` (default: max_digits) is the number of columns written out; a width above
        max_digits adds carry-only columns: longer responses, barely harder to learn."""
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if width and width < max_digits:
            raise ValueError(f"width {width} < max_digits {max_digits}")
        self.min_digits, self.max_digits = min_digits, max_digits
        self.width = width or max_digits

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)

    def sample(self, rng: random.Random) -> Problem:
        a, b = self._operand(rng), self._operand(rng)
        w = self.width
        return Problem(prompt=f"{a:0{w}d}+{b:0{w}d}:", answer=str(a + b), solution=self.solve(a, b, w))

    @staticmethod
    def solve(a: int, b: int, width: int) -> str:
        da, db = str(a).zfill(width)[::-1], str(b).zfill(width)[::-1]
        steps, carry = [], 0
        for x, y in zip(da, db):
            s = int(x) + int(y) + carry
            steps.append(f"{x}+{y}+{carry}={s:02d};")
            carry = s // 10
        return "".join(steps) + "=" + str(a + b).zfill(width + 1)[::-1]

    def written_answer(self, answer: str) -> str:
        """How the response spells `answer`: least significant digit first, width+1 digits."""
        return answer.zfill(self.width + 1)[::-1]

    _FINAL = re.compile(r"(?:^|;)=(\d+)$")

    def reward(self, problem: Problem, response: str) -> float:
        m = self._FINAL.search(response)
        return 1.0 if m is not None and m.group(1) == self.written_answer(problem.answer) else 0.0

    @property
    def max_response_chars(self) -> int:
        return 9 * self.width + 2 + self.width


TASKS: dict[str, type[Task]] = {"addition": Addition}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator for task plugins: `@register_task class MyTask(Task): name = ...`."""
    TASKS[cls.name] = cls
    return cls


def get_task(name: str = "addition", **options: object) -> Task:
    try:
        return TASKS[name](**options)
    except KeyError:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}") from None
