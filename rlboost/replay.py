"""`rlboost replay`: the life of one request, or a summary of a step, read back from the streams.

Everything a request went through is on the wire: its lease events (RB_EVENTS: published,
claimed, released on a drain, fenced after a takeover, finished), its token chunks as they were
checkpointed (RB_TOKENS: one `TokenFlush` per worker flush, which carries the chunks of every
request of that flush), and its result (RB_RESULTS). Replay reads them with ordered consumers
filtered to the request's subjects (the step's token flushes, for its chunks) and prints a
timeline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from rlboost import bus, wire
from rlboost.config import ServicesSettings, Settings
from rlboost.errors import RlboostError
from rlboost.services import resolve_urls

# what a replay reads: lease events, token flushes, results
READ_STREAMS = (wire.STREAM_EVENTS, wire.STREAM_TOKENS, wire.STREAM_RESULTS)


class ReplayError(RlboostError):
    """Nothing to replay on these servers (one line, says why)."""

_STEP = re.compile(r"(?:^|-)s(\d+)-p\d+-g\d+$")


async def read_subject(js: JetStreamContext, subject: str, kind: type, idle_s: float = 0.5) -> list:
    """All messages on `subject` from the start of its stream, decoded (bad ones skipped); none
    when the stream does not exist (a run that never got that far)."""
    out = []
    try:
        sub = await bus.follow(js, subject)
    except NotFoundError:
        return out
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_s)
            except TimeoutError:
                break
            try:
                out.append(wire.decode(kind, msg.data))
            except wire.WireError:
                continue
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


async def read_chunks(js: JetStreamContext, step: int, request_id: str | None = None) -> list[wire.TokenChunk]:
    """The token chunks of a step (of one request, if given), out of the step's token flushes."""
    return [c for f in await read_subject(js, wire.token_steps_subject(step), wire.TokenFlush)
            for c in f.token_chunks() if request_id is None or c.request_id == request_id]


@dataclass
class Life:
    request_id: str
    events: list[wire.LeaseEvent] = field(default_factory=list)
    chunks: list[wire.TokenChunk] = field(default_factory=list)
    result: wire.RolloutResult | None = None

    def tokens_by_worker(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for c in self.chunks:
            out[c.worker_id] += len(c.token_ids)
        return dict(out)

    def handoffs(self) -> int:
        return sum(1 for e in self.events if e.kind in ("release", "fenced"))

    def summary(self) -> dict:
        r = self.result
        return {"request_id": self.request_id, "workers": list(self.tokens_by_worker()),
                "tokens_by_worker": self.tokens_by_worker(), "claims": sum(e.kind == "claim" for e in self.events),
                "handoffs": self.handoffs(), "result_tokens": len(r.token_ids) if r else None,
                "finish_reason": r.finish_reason if r else None, "finished": r is not None}


def migrations(events: list[wire.LeaseEvent]) -> list[tuple[wire.LeaseEvent, wire.LeaseEvent]]:
    """(left, claimed) pairs, one per change of hands: each claim by a worker other than the
    request's last holder, with the event that ended that hold — its `release` (a hand-off),
    or its own `claim` when it vanished without one (a kill, or a lease lost)."""
    by_rid: dict[str, list[wire.LeaseEvent]] = defaultdict(list)
    for e in events:
        by_rid[e.request_id].append(e)
    out = []
    for evs in by_rid.values():
        last = None  # the last claim or release
        for e in sorted(evs, key=lambda e: e.ts):
            if e.kind == "claim":
                if last is not None and last.worker_id != e.worker_id:
                    out.append((last, e))
                last = e
            elif e.kind == "release":
                last = e
    return out


async def life_of(js: JetStreamContext, step: int, request_id: str) -> Life:
    life = Life(request_id)
    life.events = sorted(await read_subject(js, wire.event_subject(step, request_id), wire.LeaseEvent), key=lambda e: e.ts)
    life.chunks = sorted(await read_chunks(js, step, request_id), key=lambda c: c.ts)
    results = [r for r in await read_subject(js, wire.result_subject(step), wire.RolloutResult)
               if r.request_id == request_id]
    life.result = results[0] if results else None
    return life


async def step_lives(js: JetStreamContext, step: int) -> dict[str, Life]:
    lives: dict[str, Life] = {}
    for e in await read_subject(js, f"rb.evt.{step}.>", wire.LeaseEvent):
        lives.setdefault(e.request_id, Life(e.request_id)).events.append(e)
    for c in await read_chunks(js, step):
        lives.setdefault(c.request_id, Life(c.request_id)).chunks.append(c)
    for r in await read_subject(js, wire.result_subject(step), wire.RolloutResult):
        lives.setdefault(r.request_id, Life(r.request_id)).result = r
    return lives


def print_timeline(life: Life) -> None:
    rows: list[tuple[float, str]] = []
    for e in life.events:
        what = {"claim": f"claimed by {e.worker_id} (epoch {e.epoch}), resuming at token {e.offset}",
                "release": f"handed off by {e.worker_id} at token {e.offset} ({e.detail})",
                "fenced": f"{e.worker_id} lost the lease (epoch {e.epoch} stale) at token {e.offset}",
                "finish": f"finished by {e.worker_id} with {e.offset} tokens",
                "publish": f"published by {e.worker_id}",
                "deadletter": f"dead-lettered: {e.detail}"}.get(e.kind, e.kind)
        rows.append((e.ts, what))
    for c in life.chunks:
        rows.append((c.ts, f"  tokens {c.offset}..{c.offset + len(c.token_ids) - 1} from {c.worker_id} "
                           f"(policy v{c.policy_version})"))
    if life.result:
        r = life.result
        rows.append((r.ts, f"result: {len(r.token_ids)} tokens, {r.finish_reason}, segments "
                           + ", ".join(f"{s.worker_id}@{s.offset}" for s in r.segments)))
    t0 = min((t for t, _ in rows), default=time.time())
    print(f"request {life.request_id}")
    for t, what in sorted(rows):
        print(f"  +{t - t0:8.3f}s  {what}")
    print(f"  tokens by worker: {life.tokens_by_worker()}; hand-offs: {life.handoffs()}")


async def check_streams(js: JetStreamContext, nats_url: str) -> None:
    """ReplayError when the servers hold none of the streams a replay reads: nothing has run there."""
    for name in READ_STREAMS:
        try:
            await js.stream_info(name)
            return
        except NotFoundError:
            continue
    shown = ",".join(bus._redact(u.strip()) for u in nats_url.split(","))  # never a password
    raise ReplayError(f"no rlboost streams on {shown}: nothing has run here "
                      "(is this the servers' URL? RLBOOST_NATS_URL, or the data dir of `rlboost up`)")


async def run(nats_url: str, a: argparse.Namespace, services: ServicesSettings | None = None) -> int:
    nc = await bus.connect(nats_url, name="rlboost-replay", services=services)
    try:
        js = nc.jetstream()
        await check_streams(js, nats_url)
        if a.request:
            m = _STEP.search(a.request)
            step = a.step if a.step is not None else (int(m.group(1)) if m else None)
            if step is None:
                print("rlboost replay: give --step for a request id not of the form [run-]s<step>-p<n>-g<n>")
                return 2
            life = await life_of(js, step, a.request)
            if not (life.events or life.chunks or life.result):
                print(f"nothing on the streams for {a.request} in step {step}")
                return 1
            print(json.dumps(life.summary())) if a.json else print_timeline(life)
            return 0
        lives = await step_lives(js, a.step)
        rows = [life.summary() for _, life in sorted(lives.items())]
        if a.json:
            print(json.dumps(rows))
            return 0
        done = sum(r["finished"] for r in rows)
        print(f"step {a.step}: {len(rows)} requests seen, {done} finished, "
              f"{sum(r['handoffs'] for r in rows)} hand-offs")
        for r in rows:
            print(f"  {r['request_id']}  {'done' if r['finished'] else 'OPEN':4}  tokens={r['result_tokens']}  "
                  f"claims={r['claims']}  hand-offs={r['handoffs']}  workers={','.join(r['workers'])}")
        return 0
    finally:
        await nc.close()


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost replay", description=__doc__.splitlines()[0])
    p.add_argument("request", nargs="?", help="request id, e.g. s00003-p00012-g005")
    p.add_argument("--step", type=int, help="the step (a step summary when no request is given)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not a.request and a.step is None:
        p.error("give a request id or --step")
    nats_url, _ = resolve_urls(s.services)
    return asyncio.run(run(nats_url, a, s.services))
