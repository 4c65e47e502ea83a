"""Datasets: three file formats, one field mapping, seeded epochs, a position that resumes."""

from __future__ import annotations

import json

import pytest
from helpers import build_hf_model

from rlboost.trainer.data import (DataError, DataExhausted, DataIterator, FieldMap, FileData, GeneratedData, PromptBudget,
                          Sample, encode_prompt, load_samples)
from rlboost.trainer.model import load_tokenizer
from rlboost.trainer.tasks import get_task

ROWS = [
    {"messages": [{"role": "user", "content": "What is 2 plus 2?"}], "answer": "4", "level": 1},
    {"prompt": "1+1=", "ground_truth": "2", "data_source": "arith", "level": 2},
    {"prompt": [{"role": "user", "content": "Say 3"}], "reward_model": {"ground_truth": "3"}},  # verl's layout
    {"question": "How many legs has a cat?", "answer": "It has #### 4"},  # GSM8K's
]


def _write_all(tmp_path, rows) -> dict:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    folder = tmp_path / "d-hf"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    return {"jsonl": jsonl, "parquet": parquet, "datasets": folder}


def test_jsonl_parquet_and_datasets_folders_map_to_the_same_samples(tmp_path):
    rows = [ROWS[0], {**ROWS[0], "messages": [{"role": "user", "content": "What is 5 plus 1?"}], "answer": "6"}]
    loaded = {kind: load_samples(path) for kind, path in _write_all(tmp_path, rows).items()}
    assert loaded["jsonl"] == loaded["parquet"] == loaded["datasets"]
    s = loaded["jsonl"][1]
    assert s.messages == [{"role": "user", "content": "What is 5 plus 1?"}] and s.prompt is None
    assert s.ground_truth == "6" and s.extra == {"level": 1}


def test_field_mapping_defaults_and_overrides(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    chat, text, verl, gsm8k = load_samples(path)
    assert chat.messages and chat.ground_truth == "4" and chat.extra == {"level": 1}
    assert text.prompt == "1+1=" and text.ground_truth == "2" and text.data_source == "arith"
    assert verl.messages == [{"role": "user", "content": "Say 3"}] and verl.ground_truth == "3"
    assert gsm8k.prompt == "How many legs has a cat?" and gsm8k.ground_truth == "It has #### 4"
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"q": "hi", "gold": "x", "src": "s"}) + "\n")
    (s,) = load_samples(other, FieldMap(prompt="q", ground_truth="gold", data_source="src"))
    assert (s.prompt, s.ground_truth, s.data_source, s.extra) == ("hi", "x", "s", {})
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(DataError, match="row 0 has no prompt"):
        load_samples(bad)


def test_epochs_are_seeded_shuffles_and_the_position_resumes_exactly(tmp_path):
    samples = [s for s in load_samples(_numbers(tmp_path, 10))]
    a = DataIterator(samples, seed=3, epochs=3)
    first = [a.next().index for _ in range(10)]
    second = [a.next().index for _ in range(10)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second  # each epoch: all, reshuffled
    assert [s.index for s in DataIterator(samples, seed=3).next_batch(10)] == first  # a pure function of the seed
    a.next_batch(4)
    saved = a.state()
    expected = [s.index for s in a.next_batch(6)]
    b = DataIterator(samples, seed=3, epochs=3)
    b.load_state(saved)  # what a resumed run does with the checkpointed position
    assert [s.index for s in b.next_batch(6)] == expected
    with pytest.raises(DataExhausted):
        b.next()
    with pytest.raises(DataError, match="another dataset"):
        DataIterator(samples[:5], seed=3).load_state(saved)


def test_a_dataset_smaller_than_the_eval_size_is_used_whole(tmp_path):
    data = FileData(_numbers(tmp_path, 6), eval_path=_numbers(tmp_path, 3, name="eval"), eval_size=256)
    assert len(data.eval_samples()) == 3 and len(data.next_batch(6)) == 6
    split = FileData(_numbers(tmp_path, 30), eval_size=256, eval_fraction=0.1, seed=1)
    held = {s.index for s in split.eval_samples()}
    assert len(held) == 3 and not held & {s.index for s in split.next_batch(27)}  # training never sees them


def test_the_addition_generator_is_a_dataset_with_the_demo_s_prompts():
    task = get_task("addition")
    data = GeneratedData(task, seed=5)
    batches = [data.next_batch(8) for _ in range(3)]
    for step, batch in enumerate(batches):
        assert [s.prompt for s in batch] == [p.prompt for p in task.prompts(8, seed=5 * 1_000_003 + step)]
    again = GeneratedData(task, seed=5)
    again.load_state({"batches": 2, "seed": 5})
    assert again.next_batch(8) == batches[2]
    assert len(data.eval_samples()) == task.eval_size


def test_chat_prompts_use_the_template_and_long_prompts_are_filtered(tmp_path):
    model = build_hf_model(tmp_path / "m", "qwen3", tied=True)
    tok = load_tokenizer(model)
    rows = [{"messages": [{"role": "user", "content": "hi"}], "answer": "x"},
            {"messages": [{"role": "user", "content": "blue " * 100}], "answer": "y"},
            {"prompt": "plain text", "answer": "z"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    short, long_, text = load_samples(path)
    ids = encode_prompt(tok, short)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # generation prompt open
    assert tok.decode(encode_prompt(tok, text)) == "plain text"
    budget = PromptBudget(max_prompt_tokens=64, max_response_tokens=16, max_context=256)
    dropped = []
    it = DataIterator([short, long_, text], shuffle=False)
    got = budget.fill(it.next_batch, lambda s: encode_prompt(tok, s), 3, lambda s, n: dropped.append((s.index, n)))
    assert [s.index for s, _ in got] == [0, 2, 0] and [i for i, _ in dropped] == [1]  # replaced by the next one
    assert dropped[0][1] > 64
    assert PromptBudget(max_prompt_tokens=1024, max_response_tokens=200, max_context=256).limit == 56


def test_the_response_budget_defaults_from_the_model_context():
    """0 = 512 but at most half the context (a 512-token model: 256 + 256, no longer a prompt
    budget of 0); a task's own length or the user's wins; one that fills the context is refused,
    saying where it came from."""
    small = PromptBudget.for_model(1024, 0, 512)
    assert (small.max_response_tokens, small.limit, small.response_from) == (256, 256, "context")
    assert PromptBudget.for_model(1024, 0, 32768).max_response_tokens == 512
    assert PromptBudget.for_model(1024, 0, 0).max_response_tokens == 512  # context unknown
    assert PromptBudget.for_model(1024, 0, 256, task_response_tokens=33).max_response_tokens == 33
    assert PromptBudget.for_model(0, 100, 512).limit == 412  # 0: the context is the only cap
    with pytest.raises(DataError, match=r"max_response_tokens 512 \(as set\) leaves no room for a prompt: the "
                                        r"model's context is 512 tokens .* or 0 for the default \(256\)"):
        PromptBudget.for_model(1024, 512, 512)
    with pytest.raises(DataError, match=r"max_response_tokens 300 \(the task's longest answer\) leaves no room"):
        PromptBudget.for_model(1024, 0, 300, task_response_tokens=300)
    over = PromptBudget.for_model(1024, 500, 512)
    with pytest.raises(DataError, match=r"1024 prompts in a row are over the budget of 12 tokens: the model's "
                                        r"context of 512 tokens less max_response_tokens 500 \(as set\); lower it"):
        over.fill(lambda n: [Sample(index=0, prompt="x")] * n, lambda s: [1] * 20, 4, lambda s, n: None)


def _numbers(tmp_path, n: int, name: str = "train"):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{name} {i}", "answer": str(i)}) + "\n" for i in range(n)))
    return path
