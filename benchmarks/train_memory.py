"""`rlboost bench train-memory`: peak memory of one GRPO step, the trainer vs the old per-group copies.

One training step of a locally built model (default 33.6M parameters: hidden 512, 8 layers,
mlp 2048) over --groups x --samples synthetic responses, two ways, each in a fresh child process
(or, on CUDA, one after the other with the allocator's peak reset):

- `new`: `GRPOTrainer` as it trains: gradients accumulate in the parameters' `.grad` in group
  order, micro-batches by token budget, AdamW;
- `old`: the trainer before it (kept here only, as the baseline): every group's gradient is
  copied into a flat tensor held until the step ends, then summed and stepped.

Peak = the child's peak resident set (CPU; `ru_maxrss`) minus its resident set before the model
was loaded, or the CUDA allocator's peak. The bound the trainer is held to: weights, gradients
and two Adam moments are 4x the parameter bytes, plus one micro-batch's activations: within 6x.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlboost.benchmarks import report
from rlboost.config import Settings


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _results(groups: int, samples: int, prompt_len: int, response_len: int, vocab: int):
    from rlboost import wire

    rng = random.Random(0)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(2, vocab) for _ in range(prompt_len)]
        for s in range(samples):
            toks = [rng.randrange(2, vocab) for _ in range(response_len)]
            out.append(wire.RolloutResult(request_id=wire.request_id(0, g, s), step=0, group=g, prompt_ids=prompt,
                                          token_ids=toks, logprobs=[-2.7] * len(toks), segments=[],
                                          finish_reason="stop", worker_id="bench", ts=0.0))
    return out


def _old_step(model_dir: str, results, groups: int, device: str) -> None:
    """The per-group-copy trainer, as it was (the baseline: not used anywhere else)."""
    import torch

    from rlboost.trainer.grpo import group_advantages, grpo_loss, token_logprobs
    from rlboost.trainer.model import load_model

    model = load_model(model_dir).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-4)
    grads, total = {}, 0
    for g in range(groups):
        rows = [r for r in results if r.group == g]
        adv = group_advantages([float(i % 2) for i in range(len(rows))], [0] * len(rows))
        logp, mask = token_logprobs(model, [r.prompt_ids for r in rows], [r.token_ids for r in rows], device=device)
        behaviour = torch.tensor([r.logprobs for r in rows], dtype=logp.dtype, device=device)
        loss, stats = grpo_loss(logp, behaviour, adv.to(device), mask, num_tokens=1.0)
        model.zero_grad(set_to_none=True)
        loss.backward()
        grads[g] = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        total += stats.tokens
    flat = torch.zeros_like(grads[0])
    for g in sorted(grads):
        flat += grads[g]
    flat /= total
    at = 0
    for p in params:
        p.grad = flat[at: at + p.numel()].view_as(p).clone()
        at += p.numel()
    optimizer.step()


def _new_step(model_dir: str, results, groups: int, device: str, micro_batch_tokens: int) -> None:
    from rlboost.config import TrainerSettings
    from rlboost.trainer.grpo_trainer import GRPOTrainer

    t = GRPOTrainer(model_dir, TrainerSettings(device=device, precision="fp32", micro_batch_tokens=micro_batch_tokens))
    t.start_step(0)
    for g in range(groups):
        rows = [r for r in results if r.group == g]
        t.add_group(g, rows, [float(i % 2) for i in range(len(rows))])
    t.finish_step()


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def child(a: argparse.Namespace) -> dict:
    """One path in this process; returns its figures."""
    import torch

    from safetensors import safe_open

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    with safe_open(str(Path(a.model_dir) / "model.safetensors"), "pt") as f:  # counted, not loaded
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    # the same path once on a tiny model first: imports, thread pools and autograd's own set-up
    # are in the baseline, not in the figure
    warm = _results(1, 2, 4, 4, a.vocab)
    (_old_step if a.child == "old" else _new_step)(a.warm_dir, warm, 1, a.device, *([] if a.child == "old" else [64]))
    gc.collect()
    results = _results(a.groups, a.samples, a.prompt_len, a.response_len, a.vocab)
    cuda = a.device.startswith("cuda")
    base = torch.cuda.memory_allocated() if cuda else _rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if a.child == "old":
        _old_step(a.model_dir, results, a.groups, a.device)
    else:
        _new_step(a.model_dir, results, a.groups, a.device, a.micro_batch_tokens)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"path": a.child, "params": params, "param_bytes": params * 4, "peak_bytes": peak - base,
            "seconds": round(seconds, 1)}


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench train-memory", description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--device", default="auto")
    p.add_argument("--paths", default="new,old", help="which paths to measure, in this order")
    p.add_argument("--child", choices=["new", "old"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=16, help=argparse.SUPPRESS)
    p.add_argument("--warm-dir", default="", help=argparse.SUPPRESS)
    report.add_out(p)
    a = p.parse_args(argv)
    if a.child:  # the parent reads this line
        print(json.dumps(child(a)), flush=True)
        return 0
    import torch

    from rlboost.trainer.model import init_model_dir
    from rlboost.trainer.tasks import get_task

    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    work = Path(tempfile.mkdtemp(prefix="rlboost-train-memory-"))
    model_dir = init_model_dir(work / "model", get_task("addition"), seed=0, hidden=a.hidden, layers=a.layers,
                               heads=a.heads, mlp=a.mlp)
    warm_dir = init_model_dir(work / "warm", get_task("addition"), seed=0, hidden=32, layers=1, heads=2, mlp=64)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    figures = {}
    for path in a.paths.split(","):
        cmd = [sys.executable, "-m", "rlboost.cli", "bench", "train-memory", "--child", path, "--model-dir",
               str(model_dir), "--warm-dir", str(warm_dir), "--device", device, "--vocab", str(vocab), "--groups", str(a.groups), "--samples",
               str(a.samples), "--prompt-len", str(a.prompt_len), "--response-len", str(a.response_len),
               "--micro-batch-tokens", str(a.micro_batch_tokens)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "RLBOOST_LOG_LEVEL": "warning"})
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        figures[path] = json.loads(out.stdout.strip().splitlines()[-1])
        f = figures[path]
        print(f"{path}: peak {f['peak_bytes'] / 2**20:,.0f} MiB = {f['peak_bytes'] / f['param_bytes']:.2f}x the "
              f"parameter bytes ({f['params'] / 1e6:.1f}M parameters, {f['param_bytes'] / 2**20:,.0f} MiB), "
              f"{f['seconds']} s", flush=True)
    any_f = next(iter(figures.values()))
    result = {"device": device, "params": any_f["params"], "param_bytes": any_f["param_bytes"], "groups": a.groups,
              "samples": a.samples, "tokens_per_response": a.prompt_len + a.response_len,
              **{f"{k}_peak_bytes": v["peak_bytes"] for k, v in figures.items()},
              **{f"{k}_x_params": round(v["peak_bytes"] / v["param_bytes"], 2) for k, v in figures.items()},
              **{f"{k}_seconds": v["seconds"] for k, v in figures.items()}}
    if "new" in figures:
        result["new_within_6x"] = figures["new"]["peak_bytes"] <= 6 * figures["new"]["param_bytes"]
    if "new" in figures and "old" in figures:
        result["old_over_new"] = round(figures["old"]["peak_bytes"] / figures["new"]["peak_bytes"], 2)
    return report.finish("train-memory", result, report.out_dir(a))
