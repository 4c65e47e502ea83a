"""`rlboost bench weights`: sparse weight deltas on real GRPO updates, and a late joiner's pull.

A locally built model (default 33.6M parameters: the demo's architecture family, hidden 512,
8 layers, mlp 2048; the demo's addition task) takes `--steps` GRPO steps at each `--lrs` (fp32
master weights, AdamW), each a real step: a torch engine samples `--prompts` x `--samples`
responses with the policy it pulled from the weight store, the task scores them, the trainer
updates. An untrained model never gets an answer exactly right, so every group would score 0 and
GRPO would not move: the reward adds the fraction of the worked solution's characters the
response gets right (at most 0.5) to the exact-match reward, which gives groups the reward spread
GRPO needs. Every version is published in `--publish-dtype` (bf16) into the embedded JetStream
Object Store, as a delta when it pays.

Per step: the fraction of elements whose published bits changed, the bytes of the version stored
full vs as a delta, publish time, and a follower worker's time to rebuild the version from the
one it holds (fetch the delta, replay, SHA-256 every tensor) plus whether the rebuilt tensors
are bit-identical to what the trainer published. Then a late joiner with an empty cache
provisions the newest version (nearest snapshot + the deltas since, verified).

- delta_bytes_ratio: median bytes of a delta version / bytes of the full version over the steps, at
  the first lr. Adam's first steps move every weight by about lr (its normalised update starts at
  +-1 and shrinks as its second moment fills), so the deltas shrink over the first ~10 steps and then
  hold (lr 1e-6: 2.3 % of the version at step 1, 1.0 % from step 10 on, sparse2): the default
  23 steps make the median a step of that plateau, as in a long run, and leave a late joiner the
  same 3 deltas to replay after the step-20 snapshot as the 3 steps did before
  (`delta_ratio_by_step` has every step)
- mb_per_s: the late joiner's effective rate = full version bytes / provisioning seconds, the median
  of `--late-trials` late joiners (each from an empty cache; every trial's rate is in the JSON)
- snapshot_pull_mb_per_s: the same for a plain pull of the v0 snapshot (the same bytes, an empty
  cache, nothing to replay), `--late-trials` of them interleaved with the late joiners
- late_joiner_vs_snapshot: the two medians' ratio (what replaying the deltas on arrival costs)
- late_joiner_vs_snapshot_peers: the same with peers on (`[weights] peers`): a holder that
  followed the run serves both over loopback HTTP; the late joiner takes the newest version whole
  from it (`late_joiner_peer_whole`: how many did), the snapshot pull the v0 shards
- publish_s_median: the trainer's publish time per version (encoding the delta and, with
  `--snapshot-deltas`, from the second version after a snapshot, the snapshot delta a late joiner
  replays instead; uploading them)
- late_joiner_bytes: what the median late joiner fetched (the v0 snapshot + every delta since, or
  with `--snapshot-deltas` + the newest version's snapshot delta when there is one)
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from rlboost.benchmarks import fleet_join, report
from rlboost.benchmarks.fleet_join import Bandwidth, measure_verify
from rlboost import bus, wire
from rlboost.config import Settings
from rlboost.services import running_services

MB = 1e6


def _reward(task, problem, text: str) -> float:
    """Exact match (the task's reward) plus up to 0.5 for the worked solution's characters
    the response gets right position by position: an untrained policy's groups get a spread."""
    sol = problem.solution
    agree = sum(a == b for a, b in zip(text, sol)) / max(1, len(sol))
    return task.reward(problem, text) + 0.5 * agree


async def _rollout(engine, trainer, task, tokenizer, stops, rng, step: int, prompts: int, samples: int):
    from rlboost.trainer.model import decode_response, encode
    from rlboost.workers.engines.base import Sequence

    problems = [task.sample(rng) for _ in range(prompts)]
    seqs = []
    for g, prob in enumerate(problems):
        ids = encode(tokenizer, prob.prompt)
        for s in range(samples):
            seqs.append(Sequence(request_id=wire.request_id(step, g, s), prompt_ids=ids, seed=rng.randrange(1 << 30),
                                 max_new_tokens=task.max_response_chars + 1, stop_ids=stops))
    out = await engine.generate(seqs, max(s.max_new_tokens for s in seqs))
    trainer.start_step(step)
    rewards_all = []
    for g, prob in enumerate(problems):
        results, rewards = [], []
        for s in range(samples):
            seq, gen = seqs[g * samples + s], out[g * samples + s]
            results.append(wire.RolloutResult(
                request_id=seq.request_id, step=step, group=g, prompt_ids=seq.prompt_ids, token_ids=gen.token_ids,
                logprobs=gen.logprobs, segments=[], finish_reason="stop" if gen.finished else "length",
                worker_id="bench", ts=0.0))
            rewards.append(_reward(task, prob, decode_response(tokenizer, gen.token_ids, stops)))
        rewards_all += rewards
        trainer.add_group(g, results, rewards)
    trainer.finish_step()
    return statistics.mean(rewards_all)


async def _one_lr(js, a: argparse.Namespace, lr: float, model_dir: Path, work: Path) -> dict:
    import random

    import numpy as np

    from rlboost.config import TrainerSettings
    from rlboost.modeldir import stop_ids
    from rlboost.weights import JetStreamBlobStore, WeightCache, WeightPublisher, deltas
    from rlboost.trainer.grpo_trainer import GRPOTrainer
    from rlboost.trainer.tasks import get_task
    from rlboost.workers.engines.torch_engine import TorchEngine

    task = get_task("addition")
    trainer = GRPOTrainer(str(model_dir), TrainerSettings(device="cpu", precision="fp32", lr=lr,
                                                          publish_dtype=a.publish_dtype), seed=a.seed)
    stops = stop_ids(model_dir, trainer.tokenizer)
    engine = TorchEngine(str(model_dir), dtype="float32")
    bucket = f"{wire.BUCKET_WEIGHTS}-bench-{uuid.uuid4().hex[:8]}"
    store = await JetStreamBlobStore.open(js, bucket)
    rng = random.Random(a.seed)
    try:
        pub = WeightPublisher(store, full_every=a.full_every, keep_versions=a.steps + 1, delta_format=a.delta_format,
                              snapshot_deltas=a.snapshot_deltas)
        follower = WeightCache(work / f"follower-{lr}", store)
        sd = await asyncio.to_thread(trainer.state_dict)
        rep = await pub.publish(sd, 0)
        full_bytes = rep.total_bytes
        vv = await follower.ensure(0)
        await engine.load_weights(vv.path, 0)
        steps, exact = [], True
        for step in range(1, a.steps + 1):
            t = time.perf_counter()
            reward = await _rollout(engine, trainer, task, trainer.tokenizer, stops, rng, step, a.prompts, a.samples)
            train_s = time.perf_counter() - t
            sd = await asyncio.to_thread(trainer.state_dict)
            rep = await pub.publish(sd, step)
            t = time.perf_counter()
            fetched = follower.stats.bytes_fetched
            vv = await follower.ensure(step)
            rebuild_s = time.perf_counter() - t
            got = await asyncio.to_thread(vv.load_tensors)
            same = all(np.array_equal(deltas.bits(got[k]), deltas.bits(v)) for k, v in sd.items())
            exact = exact and same
            await engine.load_weights(vv.path, step)
            steps.append({"step": step, "kind": rep.kind, "changed_frac": round(rep.changed_elements / rep.elements, 5),
                          "delta_bytes": rep.delta_bytes, "snapshot_delta_bytes": rep.snapshot_delta_bytes,
                          "full_bytes": rep.total_bytes,
                          "pulled_bytes": follower.stats.bytes_fetched - fetched,
                          "publish_s": round(rep.seconds, 3), "rebuild_s": round(rebuild_s, 3),
                          "train_s": round(train_s, 2), "reward": round(reward, 3), "bit_exact": same})
            print(f"lr {lr:g} step {step}: {steps[-1]}", flush=True)
        follower.close()

        # late joiners and plain snapshot pulls, interleaved trial by trial (the one going first
        # alternates) so both see the same box: each from an empty cache, the late joiner provisioning
        # the newest version (the nearest snapshot + the deltas since), the other only the v0 snapshot
        # (the same full version's bytes, nothing to replay)
        trials, snaps = [], []

        async def late_trial(trial: int) -> None:
            nonlocal exact
            late = WeightCache(work / f"late-{lr}-{trial}", store)
            t = time.perf_counter()
            vv = await late.ensure(a.steps)
            trials.append((time.perf_counter() - t, late.stats))
            got = await asyncio.to_thread(vv.load_tensors)
            exact = exact and all(np.array_equal(deltas.bits(got[k]), deltas.bits(v)) for k, v in sd.items())
            late.close()
            await asyncio.to_thread(shutil.rmtree, work / f"late-{lr}-{trial}")

        async def snapshot_trial(trial: int) -> None:
            snap = WeightCache(work / f"snap-{lr}-{trial}", store)
            t = time.perf_counter()
            await snap.ensure(0)
            snaps.append(time.perf_counter() - t)
            snap.close()
            await asyncio.to_thread(shutil.rmtree, work / f"snap-{lr}-{trial}")

        for trial in range(a.late_trials):
            for one in ((late_trial, snapshot_trial) if trial % 2 == 0 else (snapshot_trial, late_trial)):
                await one(trial)
        late_s, late_stats = sorted(trials, key=lambda x: x[0])[len(trials) // 2]  # the median trial
        snap_s = statistics.median(snaps)
        late_rate, snap_rate = full_bytes / MB / late_s, full_bytes / MB / snap_s
        peered = await _peer_trials(js, a, store, work / f"peers-{lr}", sd, full_bytes) if a.peers else {}
        exact = exact and peered.get("bit_exact", True)
        ratios = [s["delta_bytes"] / full_bytes for s in steps if s["delta_bytes"]]
        return {"lr": lr, "params": sum(t.numel() for t in sd.values()), "dtype": rep.dtype,
                "full_bytes": full_bytes, "delta_bytes_ratio": round(statistics.median(ratios), 4) if ratios else None,
                "delta_ratio_by_step": [round(r, 4) for r in ratios],
                "changed_frac_median": statistics.median(s["changed_frac"] for s in steps),
                "bit_exact": exact, "late_joiner_s": round(late_s, 3), "late_joiner_bytes": late_stats.bytes_fetched,
                "late_joiner_fetch_s": round(late_stats.fetch_s, 3),
                "late_joiner_rebuild_s": round(late_stats.rebuild_s, 3),
                "late_joiner_trials_mb_per_s": [round(full_bytes / MB / s, 1) for s, _ in trials],
                "late_joiner_mb_per_s": round(late_rate, 1),
                "snapshot_pull_trials_mb_per_s": [round(full_bytes / MB / s, 1) for s in snaps],
                "snapshot_pull_mb_per_s": round(snap_rate, 1),
                "late_joiner_vs_snapshot": round(late_rate / snap_rate, 3),
                **{k: v for k, v in peered.items() if k != "bit_exact"},
                "publish_s_median": statistics.median(s["publish_s"] for s in steps), "steps": steps}
    finally:
        await engine.close()
        try:
            await js.delete_object_store(bucket)
        except Exception:
            pass


async def _peer_trials(js, a: argparse.Namespace, store, work: Path, newest: dict, full: int) -> dict:
    """The same late joiners and snapshot pulls with peers on (`[weights] peers`): one holder (a
    worker that followed the run: it holds the v0 snapshot and the newest version, rebuilt)
    serves both, over loopback HTTP. A late joiner then takes the newest version whole from it,
    a snapshot pull takes the v0 shards from it: the same bytes from the same source, one
    replaying nothing and the other nothing either."""
    import numpy as np

    from rlboost.weights import WeightCache, deltas
    from rlboost.weights.peerhttp import PeerServer
    from rlboost.weights.peers import PeerNetwork, open_peers_bucket

    kv = await open_peers_bucket(js)
    run_id = uuid.uuid4().hex[:8]
    holder = WeightCache(work / "holder", store, peers=PeerNetwork(kv, f"bench-holder-{run_id}"))
    server = PeerServer(holder)
    holder.peers.url = await server.start()
    late_s, snap_s, exact, versions = [], [], True, []
    try:
        await holder.ensure(0)
        await holder.ensure(a.steps)  # the snapshot and the deltas since, then served whole

        async def trial(kind: str, i: int) -> None:
            nonlocal exact
            cache = WeightCache(work / f"{kind}-{i}", store, peers=PeerNetwork(kv, f"bench-{kind}-{i}-{run_id}"))
            t = time.perf_counter()
            vv = await cache.ensure(a.steps if kind == "late" else 0)
            (late_s if kind == "late" else snap_s).append(time.perf_counter() - t)
            if kind == "late":
                versions.append(cache.stats.peer_versions)
                got = await asyncio.to_thread(vv.load_tensors)
                exact = exact and all(np.array_equal(deltas.bits(got[k]), deltas.bits(v)) for k, v in newest.items())
            cache.close()
            await asyncio.to_thread(shutil.rmtree, work / f"{kind}-{i}")

        for i in range(a.late_trials):
            for kind in (("late", "snap") if i % 2 == 0 else ("snap", "late")):
                await trial(kind, i)
    finally:
        await holder.peers.close()
        await server.close()
        holder.close()
    late_rate, snap_rate = full / MB / statistics.median(late_s), full / MB / statistics.median(snap_s)
    return {"late_joiner_peer_mb_per_s": round(late_rate, 1), "snapshot_pull_peer_mb_per_s": round(snap_rate, 1),
            "late_joiner_vs_snapshot_peers": round(late_rate / snap_rate, 3),
            "late_joiner_peer_trials_mb_per_s": [round(full / MB / s, 1) for s in late_s],
            "snapshot_pull_peer_trials_mb_per_s": [round(full / MB / s, 1) for s in snap_s],
            "late_joiner_peer_whole": sum(versions), "bit_exact": exact}


async def run(nats_url: str, a: argparse.Namespace, work: Path) -> dict:
    from rlboost.trainer.model import init_model_dir
    from rlboost.trainer.tasks import get_task

    model_dir = init_model_dir(work / "model", get_task("addition"), seed=a.seed, hidden=a.hidden, layers=a.layers,
                               heads=a.heads, mlp=a.mlp)
    nc = await bus.connect(nats_url, name="bench-weights")
    try:
        per_lr = [await _one_lr(nc.jetstream(), a, lr, model_dir, work) for lr in a.lrs]
    finally:
        await nc.drain()
    first = per_lr[0]
    return {
        "delta_bytes_ratio": first["delta_bytes_ratio"],
        "mb_per_s": first["late_joiner_mb_per_s"],
        "snapshot_pull_mb_per_s": first["snapshot_pull_mb_per_s"],
        "late_joiner_vs_snapshot": first["late_joiner_vs_snapshot"],
        "late_joiner_vs_snapshot_peers": first.get("late_joiner_vs_snapshot_peers"),
        "publish_s_median": first["publish_s_median"],
        "lr": first["lr"],
        "bit_exact": all(r["bit_exact"] for r in per_lr),
        "params": first["params"],
        "publish_dtype": first["dtype"],
        "full_mb": round(first["full_bytes"] / MB, 2),
        "by_lr": {f"{r['lr']:g}": {k: v for k, v in r.items() if k not in ("lr", "params", "dtype", "full_bytes")}
                  for r in per_lr},
    }


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench weights", description=__doc__.splitlines()[0])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--steps", type=int, default=23, help="GRPO steps (published versions) per lr")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--publish-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--full-every", type=int, default=10, help="a snapshot every N versions")
    p.add_argument("--late-trials", type=int, default=5,
                   help="late joiners and plain snapshot pulls timed alternately, each from an empty cache "
                        "(the medians are reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="leave out the late joiners and snapshot pulls with peers on")
    p.add_argument("--delta-format", default="sparse3", choices=["sparse3", "sparse2"],
                   help="how deltas are coded ([weights] delta_format): sparse2 is the format before")
    p.add_argument("--snapshot-deltas", action="store_true",
                   help="also publish each version's change from the last snapshot ([weights] snapshot_deltas, "
                        "opt-in): a late joiner replays one delta, the publisher encodes and uploads two")
    g = p.add_argument_group("--model-fleet: the fleet-join model only (benchmarks/fleet_join.py), no GRPO run")
    g.add_argument("--model-fleet", action="store_true")
    g.add_argument("--link-gbps", type=float, default=Bandwidth.link_gbps)
    g.add_argument("--origin-gbps", type=float, default=Bandwidth.origin_gbps)
    g.add_argument("--verify-threads", type=int, default=Bandwidth.verify_threads)
    g.add_argument("--piece-mb", type=float, default=Bandwidth.piece_mb)
    g.add_argument("--delta-ratio", type=float, default=Bandwidth.delta_ratio,
                   help="a follower's bytes over a whole version's (bench weights' median delta)")
    g.add_argument("--decode-ns", type=float, default=Bandwidth.decode_ns,
                   help="a delta's decode per element and thread, in ns (a follower's replay)")
    report.add_out(p)
    a = p.parse_args(argv)
    if a.model_fleet:  # the verify rate is this box's, measured now; the rest are the flags
        return report.finish("weights", fleet_join.report(Bandwidth(
            link_gbps=a.link_gbps, origin_gbps=a.origin_gbps, verify_mb_s=measure_verify(),
            verify_threads=a.verify_threads, piece_mb=a.piece_mb, delta_ratio=a.delta_ratio,
            decode_ns=a.decode_ns)), report.out_dir(a))
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
    return report.finish("weights", out, report.out_dir(a))
