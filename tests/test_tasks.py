"""The task plugin: deterministic prompts, a held-out set training never sees, exact rewards."""

from __future__ import annotations

import random
import re

import pytest

from rlboost.trainer.tasks import Addition, Problem, Task, get_task, register_task


def test_prompts_are_a_pure_function_of_the_seed():
    task = get_task("addition")
    assert get_task("addition").prompts(64, seed=5) == task.prompts(64, seed=5)
    assert task.prompts(64, seed=5) != task.prompts(64, seed=6)


def test_training_prompts_never_include_held_out_problems():
    task = get_task("addition")
    held_out = {p.prompt for p in task.eval_set}
    assert len(held_out) == task.eval_size
    assert not held_out & {p.prompt for p in task.prompts(5000, seed=1)}


def test_solutions_are_correct_worked_sums_and_long_enough():
    task = Addition()
    problems = task.prompts(2000, seed=3)
    for p in problems:
        a, b = map(int, p.prompt.rstrip(":").split("+"))
        assert p.answer == str(a + b)
        assert task.reward(p, p.solution) == 1.0
        assert len(p.solution) <= task.max_response_chars
        assert set(p.prompt + p.solution) <= set(task.alphabet)
        columns = re.findall(r"(\d)\+(\d)\+(\d)=(\d\d);", p.solution)
        carry = 0
        for x, y, c, s in columns:  # every written column is right, carries chain
            assert int(c) == carry and int(x) + int(y) + carry == int(s)
            carry = int(s) // 10
    mean_tokens = sum(len(p.solution) + 1 for p in problems) / len(problems)  # + EOS
    assert mean_tokens >= 24


def test_reward_is_exact_match_on_the_final_answer():
    task = Addition()
    p = task.sample(random.Random(0))
    wrong = str(int(p.answer) + 1)
    assert task.reward(p, p.solution) == 1.0
    assert task.reward(p, p.solution[: p.solution.rindex("=")] + "=" + wrong) == 0.0
    assert task.reward(p, p.solution + ";") == 0.0  # the answer must end the response
    assert task.reward(p, p.solution[:-1]) == 0.0  # truncated
    assert task.reward(p, "=" + task.written_answer(p.answer)) == 1.0  # only the answer is checked
    assert task.reward(p, "") == 0.0


def test_plugins_register_by_name():
    @register_task
    class Echo(Task):
        name = "echo-test"
        alphabet = "ab"
        eval_size = 3

        def sample(self, rng):
            s = "".join(rng.choice("ab") for _ in range(6))
            return Problem(prompt=s, answer=s, solution=s)

        def reward(self, problem, response):
            return float(response == problem.answer)

        @property
        def max_response_chars(self):
            return 6

    task = get_task("echo-test")
    assert len(task.eval_set) == 3 and len(task.prompts(5, seed=0)) == 5
    with pytest.raises(ValueError, match="unknown task"):
        get_task("no-such-task")


def test_a_task_with_fewer_problems_than_the_eval_size_gets_them_all():
    class Tiny(Task):
        name = "tiny-test"
        alphabet = "ab"
        eval_size = 256  # only 4 distinct problems exist

        def sample(self, rng):
            s = rng.choice(["a", "b", "aa", "bb"])
            return Problem(prompt=s, answer=s, solution=s)

        def reward(self, problem, response):
            return float(response == problem.answer)

        @property
        def max_response_chars(self):
            return 2

    assert sorted(p.prompt for p in Tiny().eval_set) == ["a", "aa", "b", "bb"]
    with pytest.raises(ValueError, match="held-out"):
        Tiny().prompts(1, seed=0)
