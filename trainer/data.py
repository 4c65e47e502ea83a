"""Where prompts come from: a user's dataset file, or a built-in generator.

A dataset is a list of `Sample`s read once from JSONL, Parquet or a Hugging Face `datasets`
folder (`load_from_disk`), with a field mapping:

- the prompt: chat `messages` (a list of {role, content}; rendered with the model's chat
  template and the generation prompt) or `prompt` text (tokenised as is); a `prompt` that holds
  a list of messages (verl's layout) counts as messages; `question` (GSM8K) is the text fallback;
- `ground_truth`, else `answer`, else verl's `reward_model.ground_truth`: what the reward checks;
- `data_source` (optional): passed to the reward (verl dispatches on it);
- every other column: passed to the reward as is (verl's `extra_info`, TRL's `**columns`).

`DataIterator` walks the training samples in a seeded shuffled order, epoch after epoch, and
its position is a small dict (`state()` / `load_state()`), so a resumed run continues where
the checkpoint left it. The held-out set is a separate file, or a seeded split of the training
file; it may be smaller than `eval_size` (then it is all used). The `addition` generator is a
dataset too (`GeneratedData`), whose step-`k` batch is the same as it always was.

Tokenisation and filtering live here as well (`encode_prompt`, `PromptBudget`): a prompt over
its token budget is dropped before a step is published, counted and logged, never sent.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlboost.trainer.tasks import Task

from rlboost.errors import RlboostError


class DataError(RlboostError, ValueError):
    """A dataset that cannot be read or mapped; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Sample:
    index: int  # row number in its file: ids in logs and rollouts
    prompt: str | None = None  # text, tokenised as is ...
    messages: list[dict] | None = None  # ... or chat messages, rendered with the chat template
    ground_truth: str = ""
    data_source: str = ""
    extra: dict = field(default_factory=dict)  # the other columns, for the reward

    def prompt_for_reward(self) -> str | list[dict]:
        return self.messages if self.messages is not None else (self.prompt or "")


@dataclass(frozen=True)
class FieldMap:
    prompt: str = "prompt"
    messages: str = "messages"
    ground_truth: str = ""  # "" = ground_truth, else answer, else reward_model.ground_truth
    data_source: str = "data_source"


def _lookup(row: dict, dotted: str) -> Any:
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def to_sample(row: dict, index: int, fields: FieldMap, where: str) -> Sample:
    messages = row.get(fields.messages)
    prompt = row.get(fields.prompt)
    if messages is None and _is_messages(prompt):  # verl: `prompt` holds the chat messages
        messages, prompt = prompt, None
    if messages is None and prompt is None:
        prompt = row.get("question")
    if messages is not None:
        if not _is_messages(messages):
            raise DataError(f"{where}: row {index}: {fields.messages!r} is not a list of {{role, content}} messages")
        messages = [{"role": str(m["role"]), "content": m.get("content", "")} for m in messages]
    elif not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: row {index} has no prompt: need a {fields.messages!r} list or "
                        f"{fields.prompt!r} text (columns: {', '.join(sorted(row)) or 'none'})")
    keys = [fields.ground_truth] if fields.ground_truth else ["ground_truth", "answer", "reward_model.ground_truth"]
    truth = next((v for v in (_lookup(row, k) for k in keys) if v is not None), "")
    used = {fields.prompt, fields.messages, fields.data_source, "question", *keys}
    extra = {k: v for k, v in row.items() if k not in used}
    return Sample(index=index, prompt=prompt if messages is None else None, messages=messages,
                  ground_truth=str(truth), data_source=str(row.get(fields.data_source) or ""), extra=extra)


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a JSONL (or JSON list) file, a Parquet file, or a `datasets.save_to_disk` folder
    (its `train` split if it holds several)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{p}: no such file or folder")
    if p.is_dir():
        try:
            import datasets
        except ModuleNotFoundError:
            raise DataError(f"{p}: a Hugging Face datasets folder needs the `datasets` package") from None
        try:
            ds = datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError) as e:
            raise DataError(f"{p}: not a datasets.save_to_disk folder ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{p}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})")
            ds = ds["train"]
        return [dict(r) for r in ds]
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow raises its own types for a file that is not Parquet
            raise DataError(f"{p}: not a readable Parquet file ({e})") from None
    text = p.read_text()
    if p.suffix == ".json" and text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise DataError(f"{p}:{n}: not a JSON line ({e})") from None
    if not all(isinstance(r, dict) for r in rows):
        raise DataError(f"{p}: every row must be a JSON object")
    return rows


def load_samples(path: str | Path, fields: FieldMap = FieldMap()) -> list[Sample]:
    rows = read_rows(path)
    if not rows:
        raise DataError(f"{path}: no rows")
    return [to_sample(r, i, fields, str(path)) for i, r in enumerate(rows)]


class DataExhausted(RlboostError):
    """Every epoch the run asked for has been served."""


class DataIterator:
    """Seeded shuffled passes over `samples`; `epochs` 0 = as many as the run needs.

    The position is (epoch, offset): epoch e's order is a pure function of (seed, e), so
    `load_state` puts a resumed run exactly where it stopped."""

    def __init__(self, samples: list[Sample], seed: int = 0, shuffle: bool = True, epochs: int = 0) -> None:
        if not samples:
            raise DataError("no training samples")
        self.samples, self.seed, self.shuffle, self.epochs = samples, seed, shuffle, epochs
        self.epoch, self.offset, self.served = 0, 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> Sample:
        if self.offset >= len(self._order):
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        if self.epochs and self.epoch >= self.epochs:
            raise DataExhausted(f"{self.epochs} epoch(s) of {len(self.samples)} samples served")
        sample = self.samples[self._order[self.offset]]
        self.offset += 1
        self.served += 1
        return sample

    def next_batch(self, n: int) -> list[Sample]:
        """Up to `n` samples (fewer only in the last batch of the last epoch)."""
        out = []
        try:
            while len(out) < n:
                out.append(self.next())
        except DataExhausted:
            if not out:
                raise
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "served": self.served, "seed": self.seed,
                "samples": len(self.samples)}

    def load_state(self, state: dict) -> None:
        if state.get("samples", len(self.samples)) != len(self.samples) or state.get("seed", self.seed) != self.seed:
            raise DataError(f"data position {state} is from another dataset or seed "
                            f"({len(self.samples)} samples, seed {self.seed})")
        self.epoch, self.offset, self.served = int(state["epoch"]), int(state["offset"]), int(state.get("served", 0))
        self._order = self._permutation(self.epoch)


class GeneratedData:
    """A built-in generator task (`addition`) as a dataset: batch k is `task.prompts(n, seed')`
    with seed' = seed * 1_000_003 + k, exactly the prompts the demo has always trained on; the
    held-out set is the task's own."""

    def __init__(self, task: Task, seed: int = 0) -> None:
        self.task, self.seed, self.batches = task, seed, 0

    def next_batch(self, n: int) -> list[Sample]:
        problems = self.task.prompts(n, seed=self.seed * 1_000_003 + self.batches)
        self.batches += 1
        return [Sample(index=i, prompt=p.prompt, ground_truth=p.answer, data_source=self.task.name)
                for i, p in enumerate(problems)]

    def state(self) -> dict:
        return {"batches": self.batches, "seed": self.seed}

    def load_state(self, state: dict) -> None:
        self.batches = int(state["batches"])

    def eval_samples(self) -> list[Sample]:
        return [Sample(index=i, prompt=p.prompt, ground_truth=p.answer, data_source=self.task.name)
                for i, p in enumerate(self.task.eval_set)]


class FileData:
    """A user's dataset: shuffled training passes plus a held-out set (a separate file, or a
    seeded `eval_fraction` of the training file, at most `eval_size` rows)."""

    def __init__(self, train: str | Path, eval_path: str | Path = "", fields: FieldMap = FieldMap(), seed: int = 0,
                 shuffle: bool = True, epochs: int = 0, eval_size: int = 256, eval_fraction: float = 0.1) -> None:
        samples = load_samples(train, fields)
        if eval_path:
            held_out = load_samples(eval_path, fields)[:eval_size]
        else:
            order = list(range(len(samples)))
            random.Random(seed + 7919).shuffle(order)
            n = min(eval_size, int(len(samples) * eval_fraction)) if len(samples) > 1 else 0
            held = set(order[:n])
            held_out = [s for i, s in enumerate(samples) if i in held]
            samples = [s for i, s in enumerate(samples) if i not in held]
        self._eval = held_out
        self.iterator = DataIterator(samples, seed=seed, shuffle=shuffle, epochs=epochs)

    def next_batch(self, n: int) -> list[Sample]:
        return self.iterator.next_batch(n)

    def state(self) -> dict:
        return self.iterator.state()

    def load_state(self, state: dict) -> None:
        self.iterator.load_state(state)

    def eval_samples(self) -> list[Sample]:
        return self._eval


# ---------------------------------------------------------------- tokens


def encode_prompt(tokenizer, sample: Sample) -> list[int]:
    """Prompt token ids: chat messages through the model's chat template with the generation
    prompt (the assistant turn is opened for the policy to fill), text as is."""
    if sample.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"sample {sample.index} gives chat messages but the model's tokenizer has no chat "
                            "template: give `prompt` text instead, or use a model with one")
        ids = tokenizer.apply_chat_template(sample.messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return an encoding anyway
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(sample.prompt, add_special_tokens=True)["input_ids"])


DEFAULT_RESPONSE_TOKENS = 512  # data.max_response_tokens = 0 with data: this, at most half the context


@dataclass
class PromptBudget:
    """The longest prompt a step may send: `max_prompt_tokens`, and no more than what leaves the
    model's context room for `max_response_tokens`.

    `response_from` says where the response budget came from, for the errors: "set" (the user's
    data.max_response_tokens), "task" (a built-in task's longest answer) or "context" (the default,
    `DEFAULT_RESPONSE_TOKENS` but no more than half the model's context). Build one with
    `for_model`, which defaults and checks it."""

    max_prompt_tokens: int
    max_response_tokens: int
    max_context: int = 0  # 0 = unknown
    response_from: str = "set"

    @classmethod
    def for_model(cls, max_prompt_tokens: int, max_response_tokens: int, max_context: int,
                  task_response_tokens: int = 0) -> PromptBudget:
        """The run's budget: `max_response_tokens` as set (> 0); else the task's; else 512, no
        more than half of `max_context` (a 512-token model gets 256 for the prompt and 256 for
        the response). DataError when the response leaves no room for a prompt."""
        if max_response_tokens > 0:
            response, source = max_response_tokens, "set"
        elif task_response_tokens > 0:
            response, source = task_response_tokens, "task"
        else:
            response = min(DEFAULT_RESPONSE_TOKENS, max_context // 2) if max_context else DEFAULT_RESPONSE_TOKENS
            source = "context"
        budget = cls(max_prompt_tokens, max(1, response), max_context, source)
        if max_context and budget.max_response_tokens >= max_context:
            fix = ("set data.max_response_tokens (--max-response-tokens) below that, or 0 for the default "
                   f"({min(DEFAULT_RESPONSE_TOKENS, max_context // 2)})" if source == "set"
                   else "set data.max_response_tokens (--max-response-tokens) below that, or use a model "
                   "with a longer context")
            raise DataError(f"{budget.response_words()} leaves no room for a prompt: the model's context is "
                            f"{max_context} tokens (max_position_embeddings): {fix}")
        return budget

    def response_words(self) -> str:
        n = self.max_response_tokens
        return {"set": f"max_response_tokens {n} (as set)",
                "task": f"max_response_tokens {n} (the task's longest answer)",
                "context": f"max_response_tokens {n} (the default: {DEFAULT_RESPONSE_TOKENS}, at most half the "
                           "model's context)"}.get(self.response_from, f"max_response_tokens {n}")

    @property
    def limit(self) -> int:
        limits = [self.max_prompt_tokens] if self.max_prompt_tokens else []
        if self.max_context:
            limits.append(self.max_context - self.max_response_tokens)
        return min(limits) if limits else 1 << 30

    def explain(self) -> str:
        """What the limit is made of and which knob raises it, for an error."""
        by_context = bool(self.max_context) and self.max_context - self.max_response_tokens <= (
            self.max_prompt_tokens or 1 << 30)
        if not by_context:
            return f"data.max_prompt_tokens {self.max_prompt_tokens}; raise it (--max-prompt-tokens), or check the data"
        why = f"the model's context of {self.max_context} tokens less {self.response_words()}"
        if self.response_from == "set":
            return f"{why}; lower it (--max-response-tokens), or check the data"
        return f"{why}; set it lower (--max-response-tokens), use a model with a longer context, or check the data"

    def check_samples(self, samples: list[Sample], encode: Callable[[Sample], list[int]], what: str) -> None:
        """Before anything slow starts: DataError if `samples` (non-empty) has no prompt within
        budget, the error the run would otherwise meet at its first step."""
        if samples and not any(0 < len(encode(s)) <= self.limit for s in samples):
            raise DataError(f"none of the {len(samples)} {what} is within the prompt budget of {self.limit} "
                            f"tokens: {self.explain()}")

    def fill(self, next_batch: Callable[[int], list[Sample]], encode: Callable[[Sample], list[int]], n: int,
             on_filtered: Callable[[Sample, int], None]) -> list[tuple[Sample, list[int]]]:
        """`n` samples within budget with their ids; the ones over it are reported and replaced."""
        out: list[tuple[Sample, list[int]]] = []
        dropped_in_a_row = 0
        while len(out) < n:
            try:
                batch = next_batch(n - len(out))
            except DataExhausted:
                if out:  # the last epoch's last, short batch
                    return out
                raise
            for s in batch:
                ids = encode(s)
                if not ids or len(ids) > self.limit:
                    on_filtered(s, len(ids))
                    dropped_in_a_row += 1
                    continue
                dropped_in_a_row = 0
                out.append((s, ids))
            if dropped_in_a_row >= max(64 * n, 1024):
                raise DataError(f"{dropped_in_a_row} prompts in a row are over the budget of {self.limit} tokens: "
                                f"{self.explain()}")
        return out
