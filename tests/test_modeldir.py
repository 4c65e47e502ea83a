"""Any Hugging Face causal-LM folder loads (trainer and torch engine alike); anything else is a
one-line error naming what is missing; nothing in the folder is ever written."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from helpers import build_hf_model, tree_sha256

from rlboost.modeldir import ModelDirError, check_model_dir, stop_ids
from rlboost.trainer.model import load_model, load_tokenizer
from rlboost.workers.engines.base import EngineError, Sequence
from rlboost.workers.engines.torch_engine import TorchEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Untied, sharded, bf16 on disk."""
    return build_hf_model(tmp_path_factory.mktemp("m") / "llama", "llama", dtype="bfloat16", shard="60KB")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Tied, one file, fp32."""
    return build_hf_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3", tied=True)


def _broken(src, dst, drop: tuple[str, ...] = (), config: dict | None = None):
    shutil.copytree(src, dst)
    for pattern in drop:
        for f in dst.glob(pattern):
            f.unlink()
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_folder_that_is_not_a_model_is_one_line_naming_what_is_missing(qwen3, tmp_path):
    cases = {
        "no such directory": tmp_path / "nothing-here",
        "no config.json": _broken(qwen3, tmp_path / "a", drop=("config.json",)),
        "no tokenizer": _broken(qwen3, tmp_path / "b", drop=("tokenizer.json",)),
        "need *.safetensors": _broken(qwen3, tmp_path / "c", drop=("*.safetensors",)),
        "no causal-LM class": _broken(qwen3, tmp_path / "d", config={"model_type": "t5"}),
        "not supported": _broken(qwen3, tmp_path / "e", config={"model_type": "no-such-architecture"}),
    }
    for what, folder in cases.items():
        with pytest.raises(ModelDirError) as e:
            check_model_dir(folder)
        assert what in str(e.value) and "\n" not in str(e.value), (what, str(e.value))
    with pytest.raises(EngineError, match="no tokenizer"):  # the engine says the same, as an engine error
        TorchEngine(str(cases["no tokenizer"]))


def test_llama_and_qwen3_load_in_the_trainer_and_the_engine_read_only(llama, qwen3):
    for folder, tied in ((llama, False), (qwen3, True)):
        before = tree_sha256(folder)
        info = check_model_dir(folder)
        assert info.tied is tied and info.max_context == 256
        model = load_model(folder)  # bf16 on disk -> float32 for training
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        tok = load_tokenizer(folder)
        stops = stop_ids(folder, tok)
        assert set(stops) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}  # generation_config + tokenizer
        engine = TorchEngine(str(folder))
        ids = tok.apply_chat_template([{"role": "user", "content": "What is 1 plus 2?"}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        seq = Sequence(request_id="s00001-p00000-g000", prompt_ids=list(ids), seed=3, max_new_tokens=6,
                       stop_ids=stops, temperature=0.0)
        (g,) = asyncio.run(engine.generate([seq], 6))
        with torch.no_grad():  # the engine's greedy tokens are the trainer model's argmax
            logits = model(input_ids=torch.tensor([list(ids) + g.token_ids[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(-1).tolist() == g.token_ids
        # the engine reloads a (sharded) shard set in place, as between policy versions
        asyncio.run(engine.load_weights(folder, version=1))
        assert tree_sha256(folder) == before


def test_worker_engine_options_reach_the_torch_engine(qwen3):
    from rlboost.config import Settings
    from rlboost.workers.engines import engine_from_settings
    from rlboost.workers.main import parse_args

    s = Settings()
    parse_args(["--engine", "torch", "--model-dir", str(qwen3), "--dtype", "float32", "--max-model-len", "64",
                "--device", "cpu"], s)
    engine = engine_from_settings(s.worker)
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32} and engine.max_model_len == 64
    assert TorchEngine(str(qwen3)).dtype == torch.float64  # the reproducible default
