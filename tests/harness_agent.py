"""A test agent harness for `rlboost run --harness`, written as a user would write one: the
official `openai` client (it reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment the
run gives it), its task row from $RLBOOST_TASK, several turns with a tool offered and streamed
answers, a reward it computes itself, POSTed to $RLBOOST_REWARD_URL.

The model behind it is whatever the run trains (a tiny untrained Llama in tests/test_harness_run.py):
it may or may not call the tool; a call is answered with the tool's result, an answer with a
user turn asking for more, until `turns` model turns are done. The reward is the share of the
expected answer's digits the model's text holds, so a group's sessions differ and GRPO has a
signal.

Test hook: with $HARNESS_VICTIM_DIR set, the first training session to claim `victim` there (after its
first answered call) writes its pid into it and waits to be killed (by tests/test_harness_run.py,
with SIGKILL), up to 120 s, after which it exits 1: either way its session is lost.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

import openai

CALC = {"type": "function", "function": {
    "name": "calc", "description": "evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calc(expression: str) -> str:
    allowed = set("0123456789+-*/() ")
    if not expression or set(expression) - allowed or len(expression) > 40 or "**" in expression:
        return "error: only integer arithmetic"
    try:
        return str(eval(expression, {"__builtins__": {}}, {}))  # the characters are checked above
    except Exception as e:
        return f"error: {type(e).__name__}"


def streamed(client: openai.OpenAI, messages: list[dict], greedy: bool) -> tuple[str, list[dict], str]:
    """One streamed call: the content, the tool calls (accumulated from delta.tool_calls) and the
    finish reason."""
    stream = client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=8,
                                            temperature=0.0 if greedy else 1.0, stream=True)
    content, calls, finish = [], {}, ""
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            if d.content:
                content.append(d.content)
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["function"]["name"] += tc.function.name or ""
                    slot["function"]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


def be_the_victim() -> None:
    where = os.environ.get("HARNESS_VICTIM_DIR")
    if not where or os.environ.get("RLBOOST_EVAL") == "1":  # a training session: its loss is the step's
        return
    try:
        fd = os.open(os.path.join(where, "victim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:  # waiting to be killed: the test's SIGKILL ends this
        time.sleep(0.05)
    sys.exit(1)


def main() -> int:
    task = json.loads(os.environ["RLBOOST_TASK"])
    greedy = os.environ.get("RLBOOST_EVAL") == "1"
    client = openai.OpenAI(max_retries=0, timeout=120.0)
    messages: list[dict] = [{"role": "user", "content": task["question"]}]
    said, tool_calls = [], 0
    for turn in range(int(task.get("turns", 3))):
        content, calls, finish = streamed(client, messages, greedy)
        said.append(content)
        msg: dict = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        messages.append(msg)
        if turn == 0:
            be_the_victim()
        for c in calls:
            tool_calls += 1
            try:
                expression = json.loads(c["function"]["arguments"] or "{}").get("expression", "")
            except ValueError:
                expression = ""
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": calc(str(expression))})
        if not calls:
            messages.append({"role": "user", "content": "Go on."})
    text = " ".join(said)
    digits = [d for d in str(task["answer"]) if d.isdigit()]
    reward = sum(d in text for d in digits) / len(digits) if digits else 0.0
    body = json.dumps({"reward": reward, "metrics": {"tool_calls": tool_calls, "turns": len(said)}}).encode()
    req = urllib.request.Request(os.environ["RLBOOST_REWARD_URL"], data=body, method="POST", headers={
        "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200, r.status
    return 0


if __name__ == "__main__":
    sys.exit(main())
