"""`rlboost serve-openai`: an answer cut by `max_tokens` (finish_reason `length`) is continued
on the session's next call as the same token stream (issue 40: it started a new one). The
harness sends the cut answer back as it was returned; the template closes it with its
end-of-turn token, which the next prompt holds after the model's exact tokens and which is
never trained. Real NATS, Redis, worker and HTTP; the LLM is test_endpoint.py's scripted
calculator policy."""

from __future__ import annotations

import openai
import pytest
from helpers import build_hf_model
from test_endpoint import CALC, TOKEN, _url, serving

from rlboost.endpoint import read_sessions
from rlboost.modeldir import load_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_hf_model(tmp_path_factory.mktemp("endpoint-cut-model"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


async def test_an_answer_cut_by_max_tokens_is_continued_as_the_same_token_stream(
        nats_url, redis_url, js, tokenizer, model_dir, tmp_path):
    async with serving(nats_url, redis_url, tokenizer, model_dir, tmp_path, "oa-cut") as (ep, c, _):
        client = openai.AsyncOpenAI(base_url=_url(ep) + "/v1", api_key=TOKEN, max_retries=0)
        messages = [{"role": "system", "content": "Use the calc tool."},
                    {"role": "user", "content": "What is 12 * 7 + 5?"}]
        headers = {"X-Session-Id": "cut-1"}
        first = await client.chat.completions.create(model="rlboost", messages=messages, tools=[CALC], max_tokens=6,
                                                     extra_headers=headers)
        assert first.choices[0].finish_reason == "length"
        messages.append(first.choices[0].message.model_dump(exclude_none=True, include={"role", "content",
                                                                                          "tool_calls"}))
        messages.append({"role": "user", "content": "Go on."})
        second = await client.chat.completions.create(model="rlboost", messages=messages, tools=[CALC],
                                                      max_tokens=200, extra_headers=headers)
        await client.close()
    assert second.choices[0].finish_reason == "tool_calls"
    (session,) = read_sessions(ep.run_dir)
    cut, nxt = session.calls
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    base = cut["prompt_ids"] + cut["completion_ids"]
    assert len(cut["completion_ids"]) == 6 and end not in cut["completion_ids"]
    # the next prompt: the cut call's exact tokens, the template's end of turn, then the user turn
    assert nxt["extends"] == {"request_id": cut["request_id"], "prefix_tokens": len(base) + 1}
    assert nxt["prompt_ids"][:len(base) + 1] == base + [end]
    assert "Go on." in tokenizer.decode(nxt["prompt_ids"][len(base) + 1:])
    episode = session.episode()
    assert episode["request_ids"] == [cut["request_id"], nxt["request_id"]]
    # the model's tokens are trained, the closing token and the user turn are not
    trained = [t for t, m in zip(episode["token_ids"], episode["mask"], strict=True) if m]
    assert trained == cut["completion_ids"] + nxt["completion_ids"]
    assert episode["mask"][len(base)] == 0 and episode["token_ids"][len(base)] == end
