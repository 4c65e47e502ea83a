"""The dataflow smoke: requests -> a pull consumer -> fenced checkpoints -> de-duplicated results.

It exercises every part of the wire with fake tokens: N requests are published to the work
queue, a consumer pulls only as many as it has slots for, checkpoints 16 fake tokens at a time
under a lease, and publishes each result twice (as a retry after a crash would) with the request
id as `Nats-Msg-Id`; the collector must see each result exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from nats.js import JetStreamContext

from rlboost import bus, wire
from rlboost.checkpoint import CheckpointStore
from rlboost.clients import open_clients
from rlboost.config import Settings
from rlboost.logs import get_logger
from rlboost.services import running_services

POOL = "smoke"


def fake_tokens(rid: str, n: int) -> list[int]:
    h = sum(map(ord, rid))
    return [(h * 31 + i * 7) % 1000 for i in range(n)]


async def publish_requests(js: JetStreamContext, step: int, n: int, pool: str = POOL, max_new: int = 64) -> list[str]:
    rids = [wire.request_id(step, i, 0) for i in range(n)]
    acks = [await js.publish_async(
        wire.request_subject(pool),
        wire.encode(wire.RolloutRequest(request_id=rid, step=step, policy_version=0, prompt_ids=[1, 2, 3],
                                        max_new_tokens=max_new, seed=7, group=i)),
        headers={wire.HDR_MSG_ID: rid}) for i, rid in enumerate(rids)]
    await asyncio.gather(*acks)
    return rids


async def consume(js: JetStreamContext, store: CheckpointStore, n: int, slots: int = 64, worker: str = "smoke-consumer",
                  pool: str = POOL) -> dict[str, int]:
    """Pull, checkpoint, publish (twice), finish, ack — until n requests are done."""
    psub = await js.pull_subscribe_bind(durable=wire.consumer_name(pool), stream=wire.STREAM_REQUESTS)
    done = dead = 0
    while done + dead < n:
        try:
            msgs = await psub.fetch(batch=slots, timeout=1.0)
        except TimeoutError:
            continue
        for msg in msgs:
            try:
                req = wire.decode(wire.RolloutRequest, msg.data)
            except wire.WireError as e:
                await bus.dead_letter(js, msg, str(e), wire.STREAM_REQUESTS)
                dead += 1
                continue
            claim = await store.claim(req.request_id, worker, req.policy_version, ttl_s=10)
            tokens = fake_tokens(req.request_id, req.max_new_tokens)
            for off in range(len(claim.token_ids), len(tokens), 16):
                chunk = tokens[off:off + 16]
                await store.append(req.request_id, worker, claim.epoch, off, chunk, [-1.0] * len(chunk), ttl_s=10)
            result = wire.RolloutResult(
                request_id=req.request_id, step=req.step, group=req.group, prompt_ids=req.prompt_ids,
                token_ids=tokens, logprobs=[-1.0] * len(tokens), segments=await store.segments(req.request_id),
                finish_reason="length", worker_id=worker, ts=time.time(), epoch=claim.epoch)
            data = wire.encode(result)
            for _ in range(2):  # the retry a crash between publish and ack would cause
                await js.publish(wire.result_subject(req.step), data, headers={wire.HDR_MSG_ID: wire.result_msg_id(result)})
            await store.finish(req.request_id, claim.epoch, len(tokens))
            await msg.ack()
            done += 1
    return {"done": done, "dead_lettered": dead}


async def collect(js: JetStreamContext, step: int, expect: int, timeout: float = 30.0) -> dict[str, int]:
    """Count results per request id from the results stream, from its start."""
    seen: dict[str, int] = {}
    sub = await bus.follow(js, wire.result_subject(step))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except TimeoutError:
                if len(seen) >= expect:
                    break
                continue
            r = wire.decode(wire.RolloutResult, msg.data)
            seen[r.request_id] = seen.get(r.request_id, 0) + 1
    finally:
        await sub.unsubscribe()
    return seen


async def run_smoke(nats_url: str, redis_url: str, n: int, step: int) -> dict:
    log = get_logger(component="smoke", step=step)
    async with open_clients(nats_url, redis_url, "rlboost-smoke", pools=(POOL,)) as c:
        t0 = time.perf_counter()
        rids = await publish_requests(c.js, step, n)
        log.info("published requests", n=len(rids))
        stats = await consume(c.js, c.store, n)
        seen = await collect(c.js, step, n)
        elapsed = time.perf_counter() - t0
    missing = [r for r in rids if r not in seen]
    dup = {r: k for r, k in seen.items() if k > 1}
    return {"requests": n, "consumed": stats["done"], "results": len(seen), "missing": len(missing),
            "duplicated": len(dup), "seconds": round(elapsed, 3)}


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost smoke", description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=200, help="requests to publish")
    p.add_argument("--step", type=int, default=int(time.time()) % 100000)
    a = p.parse_args(argv)
    with running_services(s.services) as (nats_url, redis_url):
        out = asyncio.run(run_smoke(nats_url, redis_url, a.n, a.step))
    print(f"published {out['requests']} requests; consumer finished {out['consumed']}; each result was "
          f"published twice; the results stream holds {out['results']} distinct results "
          f"({out['missing']} missing, {out['duplicated']} duplicated) in {out['seconds']} s")
    from rlboost.logs import print_result

    print_result(out)
    return 0 if out["missing"] == 0 and out["duplicated"] == 0 else 1
