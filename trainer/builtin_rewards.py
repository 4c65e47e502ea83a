"""The built-in tasks' rewards, in verl's per-sample shape (see trainer.rewards).

- `addition`: the demo's scratchpad addition (trainer.tasks.Addition): exact match on the
  final `=answer`, which must end the response.
- `math`: GSM8K/MATH-style. The answer is the last `\\boxed{...}` of the response, else what
  follows its last `####`; the ground truth may be a bare answer or a GSM8K solution ending in
  `#### answer`. Equivalence is decided by `math-verify` (numbers, fractions, LaTeX
  expressions: `0.5` == `\\frac{1}{2}`), not by string match. No extracted answer scores 0.
"""

from __future__ import annotations

import re

from rlboost.trainer.tasks import Addition, Problem

_ADDITION = Addition()


def addition_score(solution_str: str, ground_truth: str) -> float:
    return _ADDITION.reward(Problem(prompt="", answer=ground_truth, solution=""), solution_str)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
        j += 1
    return None  # unbalanced: the response was cut off inside the box


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip().splitlines()
        return tail[0].strip() if tail else None
    return None


def _normalise(answer: str) -> str:
    answer = answer.strip().rstrip(".").replace("$", "")
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", answer)  # 1,000 -> 1000


def math_score(solution_str: str, ground_truth: str) -> float:
    from math_verify import parse, verify

    predicted = extract_answer(solution_str)
    if predicted is None or not predicted.strip():
        return 0.0
    truth = extract_answer(ground_truth) if "####" in ground_truth or "\\boxed" in ground_truth else ground_truth
    gold, pred = parse(f"${_normalise(truth or '')}$"), parse(f"${_normalise(predicted)}$")
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred) else 0.0
