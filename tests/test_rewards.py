"""User reward functions in verl's and TRL's shapes, in a process pool: failures score 0, counted."""

from __future__ import annotations

import pytest

from rlboost.trainer.builtin_rewards import extract_answer, math_score
from rlboost.trainer.rewards import Item, RewardError, RewardPool, load_function

VERL = '''
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "boom":
        raise ValueError("cannot score this")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "nan":
        return float("nan")
    bonus = 0.5 if extra_info["finish_reason"] == "stop" else 0.0
    return {"score": float(solution_str == ground_truth) + bonus, "acc": 1.0}
'''

TRL = '''
def lengths(prompts, completions, ground_truth, level, **kwargs):
    assert kwargs["finish_reason"] and kwargs["data_source"]
    return [len(c[0]["content"]) * lvl + (p[-1]["content"] == "q") for p, c, lvl in zip(prompts, completions, level)]

def wrong_length(prompts, completions, **kwargs):
    return [1.0]
'''


def _item(response: str, truth: str = "4", finish: str = "stop", **kw) -> Item:
    return Item(prompt="2+2=", response=response, ground_truth=truth, data_source="arith", finish_reason=finish,
                extra=kw.pop("extra", {}), **kw)


def test_a_verl_reward_in_a_pool_scores_failures_0_and_counts_them(tmp_path):
    (tmp_path / "rew.py").write_text(VERL)
    pool = RewardPool(f"{tmp_path}/rew.py:compute_score", workers=2, timeout_s=2.0)
    try:
        out = pool.score([_item("4"), _item("4", finish="length"), _item("5"), _item("boom"), _item("hang"),
                          _item("nan")])
        assert out.values == [1.5, 1.0, 0.5, 0.0, 0.0, 0.0]
        assert (out.errors, out.timeouts) == (2, 1)  # boom, nan; hang
        assert pool.score([_item("4")]).values == [1.5]  # the hung process was replaced
        assert (pool.errors, pool.timeouts) == (2, 1)
    finally:
        pool.close()


def test_a_trl_batch_reward_gets_conversational_lists_and_the_columns(tmp_path, monkeypatch):
    (tmp_path / "trl_rewards.py").write_text(TRL)
    monkeypatch.syspath_prepend(str(tmp_path))
    chat = [{"role": "user", "content": "q"}]
    items = [Item(prompt=chat, response=r, ground_truth="x", data_source="d", finish_reason="stop",
                  extra={"level": lvl}, chat=True) for r, lvl in (("ab", 1), ("abc", 10))]
    pool = RewardPool("trl_rewards:lengths", workers=1)
    try:
        assert pool.score(items).values == [3.0, 31.0]
    finally:
        pool.close()
    broken = RewardPool("trl_rewards:wrong_length", workers=1)
    try:
        out = broken.score(items)
        assert out.values == [0.0, 0.0] and out.errors == 2  # a batch call fails as a whole
    finally:
        broken.close()
    with pytest.raises(RuntimeError, match="closed"):  # before: "min() arg is an empty sequence"
        broken.score(items)


def test_reward_specs_that_name_nothing_usable_are_one_line_errors(tmp_path):
    (tmp_path / "r.py").write_text("def f(x, y):\n    return 1\n")
    for spec, what in (("no-colon", "module:function"), (f"{tmp_path}/missing.py:f", "no such file"),
                       ("no_such_module_xyz:f", "cannot import"), (f"{tmp_path}/r.py:g", "no function 'g'"),
                       (f"{tmp_path}/r.py:f", "name the parameters")):
        with pytest.raises(RewardError, match=what) as e:
            load_function(spec)
        assert "\n" not in str(e.value)


def test_math_answers_are_extracted_and_verified_not_string_matched():
    assert extract_answer(r"so \boxed{\frac{1}{2}} and then \boxed{7}") == "7"  # the last box
    assert extract_answer("work...\n#### 1,234\n") == "1,234"
    assert extract_answer("no answer here 42") is None
    assert math_score(r"The answer is \boxed{0.5}", r"\frac{1}{2}") == 1.0
    assert math_score("#### 1,234", "She has 1234 apples. #### 1234") == 1.0  # GSM8K ground truth
    assert math_score(r"\boxed{72}", "Natalia sold 48+24 = 72 clips. #### 72") == 1.0
    assert math_score(r"\boxed{71}", "72") == 0.0
    assert math_score("72", "72") == 0.0  # no \boxed{} nor ####: nothing extracted
    assert math_score(r"\boxed{7", "7") == 0.0  # cut off inside the box


def test_the_math_task_scores_the_shipped_gsm8k_style_problems():
    """tests/data/math_small.jsonl: hand-written, GSM8K fields (question, answer ending in ####)."""
    from pathlib import Path

    from rlboost.config import DataSettings
    from rlboost.trainer.data_task import make_data

    path = Path(__file__).parent / "data" / "math_small.jsonl"
    data, reward, max_new = make_data(DataSettings(task="math", train=str(path), eval_fraction=0.25), seed=0)
    assert reward == "math" and max_new == 0 and len(data.eval_samples()) == 2
    samples = data.next_batch(6) + data.eval_samples()
    assert sorted(s.index for s in samples) == list(range(8)) and all(s.prompt for s in samples)
    pool = RewardPool(reward, workers=1)
    try:
        truths = [s.ground_truth for s in samples]
        right = [Item(prompt=s.prompt, response=f"Thinking... the answer is \\boxed{{{t.rsplit('####', 1)[1].strip()}}}",
                      ground_truth=t, data_source="", finish_reason="stop", extra={}) for s, t in zip(samples, truths)]
        wrong = [Item(prompt=s.prompt, response="\\boxed{-1}", ground_truth=t, data_source="", finish_reason="stop",
                      extra={}) for s, t in zip(samples, truths)]
        assert pool.score(right).values == [1.0] * 8
        assert pool.score(wrong).values == [0.0] * 8
    finally:
        pool.close()
