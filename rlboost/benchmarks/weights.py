"""`rlboost bench weights`: pull a ~1 GB policy from the embedded store into an empty cache and
into loaded tensors, next to reading the same bytes from local disk; then the delta of a
version that changes 10% of the tensors.

The synthetic model is transformer-shaped (fp32, hidden 1024: four 4 MiB attention matrices,
three 11 MiB MLP matrices and two norms per layer, a 125 MiB embedding), with layers added
until it reaches `--size-mb`. "Loaded" means copied into preallocated parameter tensors, as
`load_state_dict` does, on both paths, so the two figures end in the same state:

- mb_per_s: `WeightCache.ensure(v)` from the JetStream Object Store (fetch, verify SHA-256,
  write the content-addressed cache) + `load_tensors` + copy into the parameters.
- raw_mb_per_s: the same shard files read from local disk (page cache warm: an upper bound)
  + copy into the parameters, no store, no verification.
- delta_bytes_ratio: bytes a worker holding v1 fetches for v2 ÷ the full size.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from rlboost import bus, wire
from rlboost.cli import print_result
from rlboost.config import Settings
from rlboost.services import running_services

MIB = 1 << 20


def synthetic_model(size_mb: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = 1024, 2816, 32000

    def rand(*shape: int) -> torch.Tensor:
        return torch.empty(*shape).uniform_(-0.05, 0.05, generator=g)

    sd = {"model.embed_tokens.weight": rand(vocab, hidden)}
    total = vocab * hidden * 4
    layer = 0
    while total < size_mb * MIB:
        p = f"model.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{name}.weight"] = rand(hidden, hidden)
        sd[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        sd[p + "input_layernorm.weight"] = torch.ones(hidden)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        total += (4 * hidden * hidden + 3 * inter * hidden + 2 * hidden) * 4
        layer += 1
    sd["model.norm.weight"] = torch.ones(hidden)
    return sd


def copy_into(params: dict, tensors: dict) -> None:
    for k, t in tensors.items():
        params[k].copy_(t)


def read_raw(paths: list[Path], params: dict, manifest) -> None:
    """The baseline: the same safetensors files from local disk into the parameters."""
    from rlboost.weight_cache import read_safetensors

    flat: dict = {}
    for path in paths:
        flat.update(read_safetensors(path))
    for e in manifest.tensors:
        dst = params[e.name]
        for part in e.parts:
            (dst[part.start:part.stop] if len(e.parts) > 1 else dst).copy_(flat[part.key])


async def run(nats_url: str, a: argparse.Namespace, work: Path) -> dict:
    import torch

    from rlboost.objstore import FileBlobStore, JetStreamBlobStore
    from rlboost.weight_cache import WeightCache
    from rlboost.weights import WeightPublisher

    nc = await bus.connect(nats_url, name="bench-weights")
    js = nc.jetstream()
    bucket = f"{wire.BUCKET_WEIGHTS}-bench-{uuid.uuid4().hex[:8]}"
    store = await JetStreamBlobStore.open(js, bucket)
    try:
        t = time.perf_counter()
        v1 = synthetic_model(a.size_mb, a.seed)
        print(f"model: {len(v1)} tensors, {sum(x.numel() * 4 for x in v1.values()) / MIB:.0f} MiB "
              f"(generated in {time.perf_counter() - t:.1f}s)", flush=True)
        pub = WeightPublisher(store, None, max_shard_bytes=a.max_shard_mb * MIB,
                              target_shard_bytes=int(a.target_shard_mb * MIB), keep_versions=3)
        rep1 = await pub.publish(v1, 1)
        total = rep1.total_bytes
        print(f"published v1: {rep1.shards} shards, {total / MIB:.0f} MiB in {rep1.seconds:.1f}s "
              f"({total / MIB / rep1.seconds:.0f} MiB/s)", flush=True)
        params = {k: torch.full_like(x, 7) for k, x in v1.items()}  # the engine's parameters, pages touched

        store_s, raw_s = [], []
        cache = None
        for rep in range(a.repeats):
            if cache is not None:
                cache.close()
                shutil.rmtree(cache.root, ignore_errors=True)
            cache = WeightCache(work / f"cache-{rep}", store, parallel=a.parallel)
            t = time.perf_counter()
            vv = await cache.ensure(1)
            copy_into(params, await asyncio.to_thread(vv.load_tensors))
            store_s.append(time.perf_counter() - t)
            assert cache.stats.bytes_fetched == total, "a fresh cache fetched other than the full model"
            paths = [vv.path / f"{s.sha256}.safetensors" for s in vv.manifest.shards]
            t = time.perf_counter()
            await asyncio.to_thread(read_raw, paths, params, vv.manifest)
            raw_s.append(time.perf_counter() - t)
            print(f"run {rep}: store {total / MIB / store_s[-1]:.0f} MiB/s, "
                  f"local disk {total / MIB / raw_s[-1]:.0f} MiB/s", flush=True)
        for k in ("model.embed_tokens.weight", "model.norm.weight"):
            assert torch.equal(params[k], v1[k]), "loaded tensors differ from the published ones"

        # The same shards behind the directory backend (hard links: no extra copy).
        fdir = work / "filestore"
        (fdir / "shards").mkdir(parents=True)
        (fdir / "manifests").mkdir()
        for s in vv.manifest.shards:
            os.link(cache.root / "shards" / f"{s.sha256}.safetensors", fdir / wire.weights_shard_key(s.sha256))
        (fdir / wire.weights_manifest_key(1)).write_bytes(vv.manifest.encode())
        fcache = WeightCache(work / "cache-file", FileBlobStore(fdir), parallel=a.parallel)
        t = time.perf_counter()
        fvv = await fcache.ensure(1)
        copy_into(params, await asyncio.to_thread(fvv.load_tensors))
        file_s = time.perf_counter() - t
        fcache.close()
        shutil.rmtree(fcache.root, ignore_errors=True)

        # Delta: a new version changing 10% of the tensors (random, seeded).
        rng = random.Random(a.seed)
        changed = rng.sample(sorted(v1), max(1, round(a.changed_frac * len(v1))))
        v2 = dict(v1)
        for k in changed:
            v2[k] = v1[k] + 1e-3
        rep2 = await pub.publish(v2, 2)
        before = cache.stats.bytes_fetched
        vv2 = await cache.ensure(2)
        delta = cache.stats.bytes_fetched - before
        changed_bytes = sum(v1[k].numel() * 4 for k in changed)
        assert torch.equal(vv2.load_tensors()[changed[0]], v2[changed[0]])
        return {
            "mb_per_s": round(total / MIB / min(store_s), 1),
            "raw_mb_per_s": round(total / MIB / min(raw_s), 1),
            "delta_bytes_ratio": round(delta / rep2.total_bytes, 4),
            "file_store_mb_per_s": round(total / MIB / file_s, 1),
            "publish_mb_per_s": round(total / MIB / rep1.seconds, 1),
            "model_mb": round(total / MIB, 1),
            "tensors": len(v1),
            "shards": rep1.shards,
            "changed_tensors": len(changed),
            "changed_tensor_bytes_ratio": round(changed_bytes / rep2.total_bytes, 4),
            "delta_upload_bytes_ratio": round(rep2.bytes_uploaded / rep2.total_bytes, 4),
            "store_s": [round(x, 3) for x in store_s],
            "raw_s": [round(x, 3) for x in raw_s],
            "parallel": a.parallel,
            "target_shard_mb": a.target_shard_mb,
            "max_shard_mb": a.max_shard_mb,
        }
    finally:
        try:
            await js.delete_object_store(bucket)
        finally:
            await nc.drain()


def main(argv: list[str], s: Settings) -> int:
    from rlboost.weights import DEFAULT_MAX_SHARD_BYTES, DEFAULT_TARGET_SHARD_BYTES

    p = argparse.ArgumentParser(prog="rlboost bench weights", description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--changed-frac", type=float, default=0.10)
    p.add_argument("--parallel", type=int, default=4, help="shards fetched concurrently")
    p.add_argument("--target-shard-mb", type=float, default=DEFAULT_TARGET_SHARD_BYTES / MIB)
    p.add_argument("--max-shard-mb", type=int, default=DEFAULT_MAX_SHARD_BYTES // MIB)
    p.add_argument("--repeats", type=int, default=2, help="fresh-cache pulls; the best is reported")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-bench-")
    work = Path(tempfile.mkdtemp(prefix="rlboost-bench-weights-"))
    try:
        with running_services(s.services) as (nats_url, _):
            out = asyncio.run(run(nats_url, a, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if s.services.data_dir.startswith(tempfile.gettempdir()):
            shutil.rmtree(s.services.data_dir, ignore_errors=True)
    print(f"store -> cache -> tensors: {out['mb_per_s']} MiB/s (target >= 200); "
          f"local disk: {out['raw_mb_per_s']} MiB/s; directory backend: {out['file_store_mb_per_s']} MiB/s")
    print(f"delta for {out['changed_tensors']}/{out['tensors']} changed tensors: "
          f"{out['delta_bytes_ratio']:.3f} of the full size (target <= 0.15)")
    print_result(out)
    return 0
