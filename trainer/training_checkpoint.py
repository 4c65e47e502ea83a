"""Training checkpoints: everything a run needs to continue after its trainer dies.

`<run_dir>/checkpoints/step-NNNNNN/` holds
- `model/`: a Hugging Face model folder (config.json, model.safetensors, tokenizer files) that
  `AutoModelForCausalLM.from_pretrained`, the torch engine and vLLM load as it is;
- `state/`: the training state in `torch.distributed.checkpoint` format (weights in the
  master dtype, AdamW moments and step): sharded, each rank writes and reads its own shards
  under FSDP2; one process writes it the same way;
- `rank-R.json`: each rank's RNG states (Python, torch CPU, CUDA);
- `trainer_state.json`: step, run id, the trainer's update count, scheduler, and what the caller adds
  (data position, the seeding window's memory, the first evaluation).

A checkpoint is written into `step-NNNNNN.tmp` and renamed when complete, so a kill while
writing leaves the previous one as the latest; the newest `keep` are kept. Saving and loading
are collectives under FSDP2: every rank calls them (rank 0 alone writes the HF folder and
the JSON). The state files are our own, never wire data; DCP's metadata file is a pickle, read
only from the run's own folder.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

if TYPE_CHECKING:
    from rlboost.trainer.distributed import Ranks

STATE_FILE = "trainer_state.json"


class Checkpointable(Protocol):
    """What a checkpoint saves and restores of a trainer. `rlboost.trainer.grpo_trainer.GRPOTrainer` is one
    and calls this module (save_checkpoint / load_checkpoint): named here, not imported, so that
    this module never reads the trainer's."""

    ranks: Ranks
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tokenizer: Any  # a Hugging Face tokenizer (save_pretrained)
    master_dtype: torch.dtype
    precision: str
    updates: int

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]: ...


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / STATE_FILE).exists())


def latest(run_dir: str | Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


@contextlib.contextmanager
def _quiet(trainer: Checkpointable):
    """One process: DCP warns that it is 'assuming the intent is to save in a single process'. It is."""
    with warnings.catch_warnings():
        if not trainer.ranks.distributed:
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def _barrier(trainer: Checkpointable) -> None:
    if trainer.ranks.distributed:
        torch.distributed.barrier()


def save(trainer: Checkpointable, run_dir: str | Path, step: int, meta: dict[str, Any], keep: int = 2) -> Path:
    """Write the checkpoint of the state after `step` (every rank calls this under FSDP2)."""
    t0 = time.perf_counter()
    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    leader = trainer.ranks.leader
    if leader:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(trainer)
    # the HF folder: gathered tensor by tensor, written by rank 0
    weights = trainer.state_dict(dtype=trainer.master_dtype)
    if leader:
        export_hf(weights, trainer, tmp / "model")
    del weights
    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    with _quiet(trainer):
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / "state"))
    rng = {"python": random.getstate(), "torch": torch.get_rng_state().tolist(),
           "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []}
    (tmp / f"rank-{trainer.ranks.rank}.json").write_text(json.dumps(rng))
    _barrier(trainer)
    if leader:
        sched = {k: v for k, v in trainer.scheduler.state_dict().items() if k != "lr_lambdas"}
        state = {"step": step, "updates": trainer.updates, "world": trainer.ranks.world, "precision": trainer.precision,
                 "scheduler": sched, "saved_at": time.time(), **meta}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in checkpoint_dirs(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(trainer)
    seconds = time.perf_counter() - t0
    from rlboost import metrics

    metrics.TRAINER_CHECKPOINT_SECONDS.observe(seconds)
    return final


def export_hf(weights: dict[str, torch.Tensor], trainer: Checkpointable, out: Path) -> None:
    """config.json + model.safetensors + tokenizer: a folder `from_pretrained` loads."""
    out.mkdir(parents=True, exist_ok=True)
    config = trainer.model.config
    tied = getattr(config, "tie_word_embeddings", False)
    state = {k: v.contiguous() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    trainer.tokenizer.save_pretrained(out)


def load(trainer: Checkpointable, ckpt: str | Path) -> dict[str, Any]:
    """Restore the trainer (weights, optimizer, scheduler, update count, this rank's RNG) from `ckpt`;
    returns its trainer_state.json (every rank calls this under FSDP2)."""
    ckpt = Path(ckpt)
    state = json.loads((ckpt / STATE_FILE).read_text())
    msd, osd = get_state_dict(trainer.model, trainer.optimizer)
    box = {"model": msd, "optim": osd}
    with _quiet(trainer):
        dcp.load(box, checkpoint_id=str(ckpt / "state"))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=box["model"], optim_state_dict=box["optim"])
    trainer.scheduler.load_state_dict({**trainer.scheduler.state_dict(), **state["scheduler"]})
    trainer.updates = int(state.get("updates", state.get("version", 0)))  # "version": before the rename
    rank_file = ckpt / f"rank-{trainer.ranks.rank}.json"  # DCP reshards; RNG files are per rank
    rng = json.loads((rank_file if rank_file.exists() else ckpt / "rank-0.json").read_text())
    random.setstate((rng["python"][0], tuple(rng["python"][1]), rng["python"][2]))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
    return state
