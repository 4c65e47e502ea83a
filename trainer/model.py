"""The policy: any Hugging Face causal LM folder, and the demo's small local one.

`load_model` / `load_tokenizer` read a user's folder through `rlboost.modeldir` (any
AutoModelForCausalLM architecture, safetensors only, local files only, never written).

The demo's policy is a character tokenizer and a Qwen2-shaped causal LM, no hub: built from
the task's alphabet and saved in Hugging Face layout (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) by `rlboost init-model` into a folder of rlboost's own.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from rlboost import modeldir
from rlboost.trainer.tasks import Task

PAD, EOS = "<pad>", "<eos>"
META_FILE = "rlboost.json"  # which task the model was warm-started on, and how far


def build_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character (a BPE trained on the bare alphabet learns no merges), plus
    <pad>=0 and <eos>=1. Characters outside the alphabet are refused at encode time."""
    tok = Tokenizer(models.BPE(unk_token=None))
    chars = sorted(set(alphabet))
    trainer = trainers.BpeTrainer(vocab_size=2 + len(chars), special_tokens=[PAD, EOS],
                                  initial_alphabet=chars, show_progress=False)
    tok.train_from_iterator(["".join(chars)], trainer)
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)


DEMO_CONTEXT = 256  # the demo model's max_position_embeddings


def build_model(vocab_size: int, hidden: int = 128, layers: int = 4, heads: int = 4, mlp: int = 512,
                max_positions: int = DEMO_CONTEXT, seed: int = 0, pad_id: int = 0, eos_id: int = 1) -> Qwen2ForCausalLM:
    """~1.05M parameters at the defaults (tied embeddings): learns scratchpad addition on CPU
    in about a minute (DESIGN §8)."""
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         pad_token_id=pad_id, bos_token_id=eos_id, eos_token_id=eos_id, use_cache=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path,
         meta: dict | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # a bar per save would drown the progress lines
    model.save_pretrained(out)  # safetensors is the only format transformers 5 writes
    tokenizer.save_pretrained(out)
    if meta is not None:
        (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def init_model_dir(out_dir: str | Path, task: Task, seed: int = 0, **arch: int) -> Path:
    """An untrained model directory in seconds: for tests and for wiring things up."""
    tokenizer = build_tokenizer(task.alphabet)
    model = build_model(len(tokenizer), seed=seed, pad_id=tokenizer.pad_token_id,
                        eos_id=tokenizer.eos_token_id, **arch)
    return save(model, tokenizer, out_dir, meta={"task": task.name, "trained": False})


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The one loader: any causal-LM folder (rlboost.modeldir), in `dtype` whatever is on disk."""
    return modeldir.load_causal_lm(model_dir, dtype=dtype)


def load_tokenizer(model_dir: str | Path):
    return modeldir.load_tokenizer(model_dir)


def read_meta(model_dir: str | Path) -> dict:
    path = Path(model_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_response(tokenizer, token_ids: list[int], stops: list[int] | None = None) -> str:
    """The text a reward sees: the response up to (not including) its first stop id (default:
    the tokenizer's EOS), special tokens dropped."""
    stops = [tokenizer.eos_token_id] if stops is None else stops
    cut = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
    return tokenizer.decode(token_ids[:cut], skip_special_tokens=True)


@torch.no_grad()
def greedy_ids(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, stops: list[int],
               pad_id: int, batch_size: int = 256) -> list[list[int]]:
    """Batched greedy decoding (left-padded) of token-id prompts: the response ids of each."""
    out: list[list[int]] = []
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    for i in range(0, len(prompts), batch_size):
        ids = prompts[i: i + batch_size]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        gen = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id, eos_token_id=stops)
        out += [row[width:].tolist() for row in gen]
    model.train(was_training)
    return out


def pad_id(tokenizer, stops: list[int]) -> int:
    """What a left-padded batch pads with: the tokenizer's pad token, else an EOS (masked anyway)."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return stops[0] if stops else 0


def greedy_responses(model: torch.nn.Module, tokenizer, prompts: list[str], max_new_tokens: int,
                     batch_size: int = 256) -> list[str]:
    """Greedy responses to text prompts (the warm start's evaluation)."""
    stops = [tokenizer.eos_token_id]
    rows = greedy_ids(model, [encode(tokenizer, p) for p in prompts], max_new_tokens, stops,
                      pad_id(tokenizer, stops), batch_size)
    return [decode_response(tokenizer, r, stops) for r in rows]


def accuracy(model: torch.nn.Module, tokenizer, task: Task, problems=None) -> float:
    """Mean reward of greedy responses on `problems` (default: the task's held-out set)."""
    problems = task.eval_set if problems is None else problems
    texts = greedy_responses(model, tokenizer, [p.prompt for p in problems], task.max_response_chars + 1)
    return sum(task.reward(p, t) for p, t in zip(problems, texts, strict=True)) / len(problems)


def weights_sha256(state: dict) -> str:
    """One digest of a state dict's names and bytes (run results: a reproduced run's weights are
    identical, or not)."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().numpy().tobytes())
    return h.hexdigest()
