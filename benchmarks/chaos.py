"""`rlboost bench chaos`: real worker processes, a random schedule of SIGKILL, SIGTERM,
SIGSTOP/SIGCONT and restarts, and every result checked against an uninterrupted reference.

What is measured, and how:
- lost / duplicated: results in RB_RESULTS per request id (the stream keeps duplicates that
  arrive outside its de-duplication window, so they would show);
- mismatched: tokens or logprobs that differ from the emulated engine's reference for the
  request (what one uninterrupted worker produces);
- regenerated tokens, per worker fate: tokens the worker generated (crash-proof counter, see
  `rlboost.workers.counters`) minus the tokens the final results attribute to it (result segments).
  Terminated workers must regenerate 0; killed ones at most K per request in flight;
- killed_inflight: requests a worker had claimed and not finished or released at the kill (from
  the lease events in RB_EVENTS, and the claims in Redis's history lines: a worker killed right
  after claiming has not sent its claim events yet);
- hand-off latency: SIGTERM -> the first token chunk of a handed-off request from another
  worker (an upper bound on "first token": a chunk is published after K tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

from rlboost import bus, wire
from rlboost.checkpoint import HISTORY_ENV, parse_segment
from rlboost.pool_client import PoolClient
from rlboost.clients import open_clients
from rlboost.config import Settings
from rlboost.replay import read_chunks, read_subject
from rlboost.services import running_services
from rlboost.benchmarks import history, percentile, report
from rlboost.workers.engines.emulated import LengthModel, reference_tokens
from rlboost.workers.fleet import WorkerFleet

POOL = "chaos"
Reference = Callable[[wire.RolloutRequest], tuple[list[int], list[float]]]


def make_requests(n: int, step: int, rng: random.Random, min_new: int, max_new: int) -> list[wire.RolloutRequest]:
    return [wire.RolloutRequest(request_id=wire.request_id(step, i, 0), step=step, policy_version=0,
                                prompt_ids=[rng.randrange(32000) for _ in range(64)],
                                max_new_tokens=rng.randint(min_new, max_new), seed=rng.randrange(1 << 30), group=i)
            for i in range(n)]


def emulated_reference(q: wire.RolloutRequest) -> tuple[list[int], list[float]]:
    """What one uninterrupted emulated worker produces for the request."""
    n = min(q.max_new_tokens, LengthModel().length(q.seed, q.request_id))
    return reference_tokens(q.seed, q.request_id, 0, n, policy_version=q.policy_version)


async def chaos(a: argparse.Namespace, nats_url: str, redis_url: str, workdir: Path,
                engine_args: list[str] | None = None, reference: Reference = emulated_reference,
                requests: list[wire.RolloutRequest] | None = None) -> dict:
    rng = random.Random(a.seed)
    step = requests[0].step if requests else int(time.time()) % 90000
    fleet = WorkerFleet(nats_url, redis_url, workdir, POOL, worker_args=[
        *(engine_args or ["--engine", "emulated", "--speed", str(a.speed)]), "--slots", str(a.slots),
        "--checkpoint-tokens", str(a.k), "--ack-wait", str(a.ack_wait), "--lease-ttl", str(a.ack_wait * 0.6)],
        env={HISTORY_ENV: str(workdir / "history")})  # every store operation, for the history check
    actions: list[tuple[str, str, float]] = []  # (kind, worker id, time)
    async with open_clients(nats_url, redis_url, "rlboost-chaos", pools=(POOL,)) as c:
        requests = requests or make_requests(a.requests, step, rng, a.min_new, a.max_new)

        async def publish(batch: list[wire.RolloutRequest]) -> None:
            acks = [await c.js.publish_async(wire.request_subject(POOL), wire.encode(r),
                                             headers={wire.HDR_MSG_ID: r.request_id}) for r in batch]
            await asyncio.gather(*acks)

        # --min-actions N: the requests go out in N + 1 stages, and stage s + 1 only after the
        # s-th action, forced once half of stage s is done; so N actions happen with work in
        # flight and work left, on a box of any speed (a timer alone let a fast machine finish
        # before the second action).
        min_actions = getattr(a, "min_actions", 0)
        bounds = [round(len(requests) * i / (min_actions + 1)) for i in range(min_actions + 2)]
        stage = 0
        await publish(requests[:bounds[1]])
        for _ in range(a.workers):
            fleet.start()
        seen: set[str] = set()
        sub = await bus.follow(c.js, wire.result_subject(step))
        t0 = time.time()
        next_action = t0 + rng.uniform(1.0, 2.0) * a.every
        plan: list[str] = []
        resume_at: dict[str, float] = {}
        while len(seen) < len(requests) and time.time() - t0 < a.timeout:
            try:
                msg = await sub.next_msg(timeout=0.1)
                seen.add(wire.decode(wire.RolloutResult, msg.data).request_id)
            except TimeoutError:
                pass
            now = time.time()
            for wid, t in list(resume_at.items()):
                if now >= t:
                    fleet.resume(fleet.workers[wid])
                    del resume_at[wid]
            while stage < min(len(actions), min_actions):  # an action done: the next stage goes out
                stage += 1
                await publish(requests[bounds[stage]:bounds[stage + 1]])
            forced = len(actions) == stage < min_actions and len(seen) >= (bounds[stage] + bounds[stage + 1]) / 2
            if not forced and (now < next_action or len(seen) >= len(requests) * a.chaos_until):
                continue
            next_action = now + rng.uniform(0.5, 1.5) * a.every
            # only workers that serve (in the registry): a process still importing on a busy box
            # would die of a SIGTERM before its handler exists, and measure no hand-off
            serving = set(await bus.worker_keys(c.js))
            candidates = [w for w in fleet.live() if w.fate == "running" and w.worker_id in serving]
            if len(candidates) < 2:
                continue  # keep someone working
            if not plan:
                plan = ["kill", "term", "stop"]
                rng.shuffle(plan)
            kind, w = plan.pop(), rng.choice(candidates)
            if kind == "kill":
                actions.append(("kill", w.worker_id, fleet.kill(w)))
                fleet.start()
            elif kind == "term":
                actions.append(("term", w.worker_id, fleet.terminate(w)))
                fleet.start()
            else:
                actions.append(("stop", w.worker_id, fleet.pause(w)))
                resume_at[w.worker_id] = now + rng.uniform(a.ack_wait + 1.0, a.ack_wait + 3.0)
        elapsed = time.time() - t0
        await sub.unsubscribe()
        for wid in list(resume_at):
            fleet.resume(fleet.workers[wid])
        fleet.stop_all()
        results = await read_subject(c.js, wire.result_subject(step), wire.RolloutResult)
        events = await read_subject(c.js, f"rb.evt.{step}.>", wire.LeaseEvent)
        chunks = await read_chunks(c.js, step)
        # Who claimed what, from Redis: a worker's lease events leave in batches, so one killed
        # right after claiming (and generating less than a chunk) loses its claim events, while
        # the claim itself (a history line per epoch) is durable before any token is generated.
        owners: dict[str, set[str]] = defaultdict(set)
        async with c.store.redis.pipeline(transaction=False) as pipe:  # one round trip
            for q in requests:
                pipe.lrange(wire.ckpt_history_key(q.request_id), 0, -1)
            histories = await pipe.execute()
        for q, lines in zip(requests, histories, strict=True):
            for line in lines:  # every epoch's line, a claim that generated nothing durable included
                owners[parse_segment(line).worker_id].add(q.request_id)
        # The fencing invariants over the whole history (benchmarks/history.py). Not strict: a
        # worker SIGKILLed between the store's answer and its history line leaves tokens that no
        # recorded write explains (counted in history_unrecorded_tokens, not a violation).
        by_id = {q.request_id: q for q in requests}
        pool = PoolClient(c, POOL)
        checked = await history.check_run(workdir / "history", c.store, results, strict=False, rids=list(by_id),
                                          verify=lambda r: pool.verify_result(step, r, by_id[r.request_id]))
    return {**analyse(a, requests, results, events, chunks, actions, fleet, elapsed, reference, owners), **checked}


def analyse(a, requests, results, events, chunks, actions, fleet: WorkerFleet, elapsed: float,
            reference: Reference, owners: dict[str, set[str]] | None = None) -> dict:
    by_rid: dict[str, list] = defaultdict(list)
    for r in results:
        by_rid[r.request_id].append(r)
    mismatched = 0
    attributed: dict[str, int] = defaultdict(int)
    for q in requests:
        for r in by_rid.get(q.request_id, [])[:1]:
            toks, lps = reference(q)
            durable = np.asarray(lps, dtype=np.float32).tolist()  # checkpoints keep float32 logprobs
            if r.token_ids != toks or r.logprobs != durable:
                mismatched += 1
            bounds = [s.offset for s in r.segments] + [len(r.token_ids)]
            for s, end in zip(r.segments, bounds[1:], strict=True):
                attributed[s.worker_id] += end - s.offset
    regenerated: dict[str, int] = defaultdict(int)
    for w in fleet.workers.values():
        regenerated[w.fate] += w.counters()["generated"] - attributed[w.worker_id]

    ev_by_worker: dict[str, list] = defaultdict(list)
    for e in events:
        ev_by_worker[e.worker_id].append(e)
    killed_inflight = 0
    for kind, wid, t in actions:
        if kind != "kill":
            continue
        held: set[str] = set((owners or {}).get(wid, ()))  # claimed, per Redis (before the kill: it was dead after)
        for e in sorted(ev_by_worker[wid], key=lambda e: e.ts):
            if e.ts > t:
                break
            if e.kind == "claim":
                held.add(e.request_id)
            else:
                held.discard(e.request_id)
        killed_inflight += len(held)

    first_chunk: dict[tuple[str, str], float] = {}
    for ch in chunks:
        key = (ch.request_id, ch.worker_id)
        first_chunk[key] = min(first_chunk.get(key, ch.ts), ch.ts)
    claims: dict[str, list] = defaultdict(list)
    for e in events:
        if e.kind == "claim":
            claims[e.request_id].append(e)
    handoffs_ms, released_ms, claimed_ms = [], [], []
    for kind, wid, t in actions:
        if kind != "term":
            continue
        for e in ev_by_worker[wid]:
            if e.kind == "release" and e.ts >= t:
                released_ms.append((e.ts - t) * 1000)
                taken = [c.ts for c in claims[e.request_id] if c.worker_id != wid and c.ts >= t]
                if taken:
                    claimed_ms.append((min(taken) - t) * 1000)
                    if os.environ.get("RLBOOST_CHAOS_DEBUG") and (min(taken) - t) > 1.0:
                        print("slow hand-off", e.request_id, "from", wid, "term at", round(t, 2), "claims",
                              [(c.worker_id, round(c.ts - t, 2), c.offset) for c in claims[e.request_id]],
                              "actions", [(k, w, round(x - t, 2)) for k, w, x in actions if abs(x - t) < 5])
                later = [ts for (rid, w), ts in first_chunk.items() if rid == e.request_id and w != wid and ts >= t]
                if later:
                    handoffs_ms.append((min(later) - t) * 1000)

    count = lambda k: sum(1 for x in actions if x[0] == k)  # noqa: E731
    return {
        "requests": len(requests), "lost": sum(1 for q in requests if q.request_id not in by_rid),
        "duplicated": sum(len(v) - 1 for v in by_rid.values()), "mismatched": mismatched,
        "kills": count("kill"), "terms": count("term"), "stops": count("stop"),
        "restarts": count("kill") + count("term"), "workers_started": len(fleet.workers),
        "killed_inflight": killed_inflight, "checkpoint_tokens": a.k,
        "regenerated_tokens_term": regenerated["terminated"], "regenerated_tokens_kill": regenerated["killed"],
        "regenerated_tokens_stop": regenerated["stopped"], "regenerated_tokens_undisturbed": regenerated["running"],
        "handoffs": len(handoffs_ms), "handoff_p50_ms": percentile(handoffs_ms, 0.5), "handoff_p99_ms": percentile(handoffs_ms, 0.99),
        "released_p50_ms": percentile(released_ms, 0.5), "released_p99_ms": percentile(released_ms, 0.99),
        "reclaimed_p50_ms": percentile(claimed_ms, 0.5), "reclaimed_p99_ms": percentile(claimed_ms, 0.99),
        "tokens": sum(len(v[0].token_ids) for v in by_rid.values()), "seconds": round(elapsed, 1),
    }


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost bench chaos", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--k", type=int, default=16, help="checkpoint interval in tokens")
    p.add_argument("--speed", type=float, default=1.0, help="emulated engine speed (x H100)")
    p.add_argument("--min-new", type=int, default=64)
    p.add_argument("--max-new", type=int, default=768)
    p.add_argument("--every", type=float, default=2.0, help="mean seconds between chaos actions")
    p.add_argument("--chaos-until", type=float, default=0.9, help="stop the chaos once this fraction is done")
    p.add_argument("--min-actions", type=int, default=0,
                   help="at least this many actions, whatever the box's speed: the requests go out in stages")
    p.add_argument("--ack-wait", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--episodes", type=int, nargs="?", const=24, default=0,
                   help="calculator episodes instead of single-turn requests (default 24): SIGKILL during "
                        "generation and during tool calls, SIGTERM (benchmarks/chaos_episodes.py)")
    from rlboost.benchmarks import chaos_episodes

    chaos_episodes.add_arguments(p)
    report.add_out(p)
    a = p.parse_args(argv)
    if a.episodes:
        return chaos_episodes.bench(a, s)
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-chaos-")
    workdir = Path(tempfile.mkdtemp(prefix="rlboost-chaos-workers-"))
    with running_services(s.services) as (nats_url, redis_url):
        out = asyncio.run(chaos(a, nats_url, redis_url, workdir))
    ok = (out["lost"] == out["duplicated"] == out["mismatched"] == 0 and out["regenerated_tokens_term"] == 0
          and out["regenerated_tokens_kill"] <= a.k * out["killed_inflight"] and out["history_violations"] == 0)
    print(f"{out['requests']} requests, {out['kills']} kills, {out['terms']} terms, {out['stops']} stops in "
          f"{out['seconds']} s: lost {out['lost']}, duplicated {out['duplicated']}, mismatched {out['mismatched']}; "
          f"regenerated: term {out['regenerated_tokens_term']}, kill {out['regenerated_tokens_kill']} "
          f"(bound {a.k} x {out['killed_inflight']} in flight); hand-off p50 {out['handoff_p50_ms']} ms, "
          f"p99 {out['handoff_p99_ms']} ms; history: {out['history_violations']} violations in {out['history_ops']} "
          f"operations  -> {'OK' if ok else 'INVARIANT VIOLATED'}  (worker logs: {workdir})")
    return report.finish("chaos", out, report.out_dir(a), ok=ok)
