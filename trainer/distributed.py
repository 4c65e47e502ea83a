"""FSDP2 under torchrun: ranks, sharding, and the lockstep that keeps ranks' collectives in order.

`torchrun --nproc-per-node N -m rlboost.cli run ...` (or `rlboost run --nproc N`, which execs
exactly that) starts N trainer processes. Rank 0 is the run: it alone talks to NATS and Redis
(manager, weight publisher, reserved engine, loggers). The other ranks build the same
`GRPOTrainer` and then only follow: whenever rank 0 calls an operation that involves every
rank (train the step, gather the weights, evaluate, checkpoint), it first broadcasts the
operation's name and arguments, and every rank runs it. FSDP2 (`fully_shard`) shards each
decoder layer and the root module over the ranks: nccl on GPUs, gloo on CPU.

A step's groups are scattered (group g goes to rank g mod N); every rank runs the same number
of forward/backward passes (a rank with fewer micro-batches runs empty ones), because each
FSDP pass is a collective. FSDP averages gradients across ranks and the trainer divides by
the step's global token count over the world size, so N ranks compute the update one process would.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


SINGLE = Ranks()


def init_from_env(device: str = "auto") -> Ranks:
    """Join the process group torchrun describes (WORLD_SIZE > 1); else one process, no
    torch.distributed at all."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    cuda = torch.cuda.is_available() and device != "cpu"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Ranks(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local)


def shutdown() -> None:
    """Leave the process group together. A rank that tore gloo down while a peer was still
    finishing the last collective aborted the peer (std::terminate, exit -6) now and then: a
    barrier alone does not prevent it, since the first rank out of the barrier may close its
    connections while another still reads the barrier's last message. So after the barrier each
    rank checks in with the rendezvous store (TCP, outside gloo), and no rank destroys the group
    until every rank has returned from every collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        store.set(f"rlboost/exit/{dist.get_rank()}", "1")
        store.wait([f"rlboost/exit/{r}" for r in range(dist.get_world_size())], timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank's process once its work is done and `shutdown()` has returned,
    skipping the interpreter's finalization. During finalization gloo's worker threads may
    still hold tensors whose release needs the GIL of an interpreter being torn down, and the
    process aborts (SIGABRT, "terminate called without an active exception"; pytorch#179291):
    torchrun then reports a finished run as failed. Seen about once in 20 runs here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def torchrun_rank() -> bool:
    """This process is one of torchrun's workers (torchrun sets TORCHELASTIC_RUN_ID)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "TORCHELASTIC_RUN_ID" in os.environ


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (the unit FSDP shards and activation
    checkpointing recomputes)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no .model.layers to shard")
    return list(layers)


def shard(model: torch.nn.Module, param_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """fully_shard every decoder layer, then the root (embeddings, final norm, head). With
    `param_dtype` (bf16) layers compute in it while master weights and the gradient reduction
    stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else \
        MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    # FSDP averages gradients over ranks (a sum would need PREMUL_SUM, which gloo lacks): the
    # trainer divides the token-sum gradient by global tokens / world size to undo it.
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective on a DTensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _reduce(x: float, ranks: Ranks, op: dist.ReduceOp.RedOpType) -> float:
    """`x` reduced over every rank (one all-reduce; float64 holds any count exactly)."""
    if not ranks.distributed:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def max_over_ranks(n: int, ranks: Ranks) -> int:
    return int(_reduce(n, ranks, dist.ReduceOp.MAX))


def max_float_over_ranks(x: float, ranks: Ranks) -> float:
    return _reduce(x, ranks, dist.ReduceOp.MAX)


def sum_over_ranks(x: float, ranks: Ranks) -> float:
    return _reduce(x, ranks, dist.ReduceOp.SUM)


def scatter(shares: list[Any] | None, ranks: Ranks) -> Any:
    """Rank 0 gives rank r `shares[r]`; every rank returns its own."""
    if not ranks.distributed:
        assert shares is not None
        return shares[0]
    out: list[Any] = [None]
    dist.scatter_object_list(out, shares if ranks.leader else None, src=0)
    return out[0]


def broadcast(obj: Any, ranks: Ranks) -> Any:
    if not ranks.distributed:
        return obj
    box = [obj if ranks.leader else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Lockstep:
    """Run a trainer operation on every rank: rank 0 announces (name, args), followers obey.

    Only plain data (step numbers, token lists, paths, task objects of our own process group)
    crosses, between the ranks of one job; never wire data from NATS."""

    STOP = "__stop__"

    def __init__(self, target: Any, ranks: Ranks) -> None:
        self.target, self.ranks = target, ranks

    def call(self, name: str, *args: Any) -> Any:
        if self.ranks.distributed:
            broadcast((name, args), self.ranks)
        return getattr(self.target, name)(*args)

    def stop(self) -> None:
        if self.ranks.distributed:
            broadcast((self.STOP, ()), self.ranks)

    def follow(self) -> None:
        """A follower's whole life: run what rank 0 announces until it says stop."""
        while True:
            name, args = broadcast(None, self.ranks)
            if name == self.STOP:
                return
            getattr(self.target, name)(*args)
