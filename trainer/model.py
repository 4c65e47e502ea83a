"""The small local policy: a character tokenizer and a Qwen2-shaped causal LM, no hub.

Everything is built from the task's alphabet and saved in Hugging Face layout (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json), so the same directory loads in
`transformers`, in the torch engine and in vLLM. Weights are only ever read with
`safetensors` (never unpickled).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from trainer.tasks import Task

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


def build_model(vocab_size: int, hidden: int = 128, layers: int = 4, heads: int = 4, mlp: int = 512,
                max_positions: int = 256, seed: int = 0, pad_id: int = 0, eos_id: int = 1) -> Qwen2ForCausalLM:
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


def load_state(model: torch.nn.Module, weights_dir: str | Path) -> None:
    """Load every *.safetensors file of `weights_dir` into `model`, in place, keeping its dtype.

    Strict except for a tied output head, which save_pretrained leaves out of the file."""
    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {weights_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"weights in {weights_dir} do not fit the model: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """config.json + safetensors from a local directory; never the hub, never pickle."""
    config = Qwen2Config.from_json_file(str(Path(model_dir) / "config.json"))
    model = Qwen2ForCausalLM(config).to(dtype)
    load_state(model, model_dir)
    return model.eval()


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


def read_meta(model_dir: str | Path) -> dict:
    path = Path(model_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_response(tokenizer: PreTrainedTokenizerFast, token_ids: list[int]) -> str:
    """The text a reward sees: the response up to (not including) its first EOS."""
    eos = tokenizer.eos_token_id
    if eos in token_ids:
        token_ids = token_ids[: token_ids.index(eos)]
    return tokenizer.decode(token_ids, skip_special_tokens=True)


@torch.no_grad()
def greedy_responses(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: list[str],
                     max_new_tokens: int, batch_size: int = 256) -> list[str]:
    """Batched greedy decoding (left-padded) for held-out evaluation."""
    out: list[str] = []
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    for i in range(0, len(prompts), batch_size):
        ids = [encode(tokenizer, p) for p in prompts[i: i + batch_size]]
        width = max(map(len, ids))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        gen = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=eos)
        out += [decode_response(tokenizer, row[width:].tolist()) for row in gen]
    model.train(was_training)
    return out


def accuracy(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, task: Task,
             problems=None) -> float:
    """Mean reward of greedy responses on `problems` (default: the task's held-out set)."""
    problems = task.eval_set if problems is None else problems
    texts = greedy_responses(model, tokenizer, [p.prompt for p in problems], task.max_response_chars + 1)
    return sum(task.reward(p, t) for p, t in zip(problems, texts, strict=True)) / len(problems)
