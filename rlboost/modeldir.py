"""A user's Hugging Face model folder: checked, loaded, never written.

`--model-dir` is any causal-LM folder that `transformers` loads with `AutoModelForCausalLM`
(Llama, Qwen2/3, Mistral, Gemma...; tied or untied embeddings; sharded or not; bf16, fp16 or
fp32 on disk) with its own tokenizer. The trainer, the torch engine and the vLLM engine all
read the same folder, through this module, and nothing here opens a file for writing.

Weights are read as safetensors only (`use_safetensors=True`: a folder of pickled `.bin`
files is refused, never unpickled), from local files only (never the hub), and without
`trust_remote_code` (a folder cannot run code of its own in our processes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlboost.errors import RlboostError

# A tokenizer is one of these (a fast tokenizer file, a sentencepiece model, or BPE vocab+merges).
_TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


class ModelDirError(RlboostError, ValueError):
    """A folder that is not a loadable model; the message names what is missing, on one line."""


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    model_type: str
    architecture: str
    vocab_size: int
    max_context: int  # max_position_embeddings: the longest prompt + response it was built for
    tied: bool
    dtype: str = ""  # config.json's torch_dtype (dtype in newer transformers): the serving dtype


def check_model_dir(model_dir: str | Path) -> ModelInfo:
    """Cheap checks before anything heavy loads: raise ModelDirError naming what is missing."""
    d = Path(model_dir).expanduser()
    if not d.is_dir():
        raise ModelDirError(f"{d} is not a model folder: no such directory")
    if not (d / "config.json").is_file():
        raise ModelDirError(f"{d} is not a model folder: no config.json")
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelDirError(f"{d}/config.json is not readable JSON ({e})") from None
    if not sorted(d.glob("*.safetensors")):
        what = "only pickled *.bin weights, which are never loaded" if sorted(d.glob("*.bin")) else "no weights"
        raise ModelDirError(f"{d} has {what}: need *.safetensors")
    if not any(all((d / f).is_file() for f in files) for files in _TOKENIZER_FILES):
        raise ModelDirError(f"{d} has no tokenizer: need tokenizer.json (or tokenizer.model, or vocab.json + merges.txt)")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelDirError(f"{d}: config.json model_type {raw.get('model_type')!r} is not supported by "
                            f"this transformers ({first})") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelDirError(f"{d}: model_type {config.model_type!r} has no causal-LM class in transformers "
                            "(AutoModelForCausalLM cannot load it)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelInfo(path=d, model_type=config.model_type,
                     architecture=(raw.get("architectures") or [MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__])[0],
                     vocab_size=int(text.vocab_size), max_context=int(getattr(text, "max_position_embeddings", 0) or 0),
                     tied=bool(getattr(text, "tie_word_embeddings", False)),
                     dtype=str(raw.get("torch_dtype") or raw.get("dtype") or ""))


def load_causal_lm(model_dir: str | Path, dtype=None):
    """The model, in eval mode, in `dtype` (default float32) whatever the dtype on disk."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    info = check_model_dir(model_dir)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(info.path), local_files_only=True, use_safetensors=True,
                                                 trust_remote_code=False, dtype=dtype or torch.float32)
    return model.eval()


def load_tokenizer(model_dir: str | Path):
    """The folder's tokenizer. One saved as a plain fast tokenizer (tokenizer_class
    `TokenizersBackend` / `PreTrainedTokenizerFast`, as rlboost's demo models are) is its
    tokenizer.json exactly: AutoTokenizer would rebuild it as config.json's model type's tokenizer
    (Qwen2's byte-level pre-tokenizer drops a character vocabulary's spaces and newlines)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d = Path(model_dir).expanduser()
    try:
        cls = json.loads((d / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls = None
    try:
        if cls in ("TokenizersBackend", "PreTrainedTokenizerFast") and (d / "tokenizer.json").exists():
            return PreTrainedTokenizerFast.from_pretrained(str(d), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError) as e:
        raise ModelDirError(f"{d}: the tokenizer does not load ({str(e).strip().splitlines()[0]})") from None


def stop_ids(model_dir: str | Path, tokenizer=None) -> list[int]:
    """Every end-of-sequence id the model may emit: generation_config.json's eos_token_id (an int
    or a list: chat models end turns with their own token), the tokenizer's, and config.json's.
    The first is the tokenizer's when it has one (the id a padded batch can use)."""
    d = Path(model_dir).expanduser()
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v >= 0 and v not in ids:
                ids.append(v)

    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    for name in ("generation_config.json", "config.json"):
        path = d / name
        if path.is_file():
            try:
                add(json.loads(path.read_text()).get("eos_token_id"))
            except (OSError, ValueError):
                pass
    return ids
