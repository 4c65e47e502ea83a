"""`rlboost bench partitions`: links fail while both ends stay up. Real embedded NATS and Redis,
real worker processes, each worker reaching the servers through a fault relay of its own
(benchmarks/relay.py) that cuts, slows or leaves half-open the links of one worker or of all.

Scenarios (each on fresh servers, one after the other):
- `redis_cut`: one worker's link to Redis is cut (connections reset, new ones refused) for
  `--cut-s` while its link to NATS stays up, then restored;
- `redis_slow`: one worker's commands reach Redis `--slow-s` late (its answers an eighth of that)
  for `--slow-for-s`: past the lease TTL, so its renewals and appends arrive after its lease
  expired, while its requests are redelivered (its workers count as stalled after 1 s without
  progress) and claimed by others: no two holders of a request may both have writes accepted;
- `redis_half_open`: one worker's Redis connections stop answering without a reset (and new ones
  are black-holed) for `--cut-s`, then new connections work again;
- `nats_cut`: the same cut on one worker's link to NATS, Redis up;
- `nats_half_open`: one worker's NATS connection stops answering (no FIN, no RST; new connections
  work): recovery is from the moment it went dead to the worker's next claim or result;
- `all_unreachable`: every worker's links to NATS and Redis are cut for `--outage-s`: each
  worker's CPU time over the outage (it must back off, not spin) and how long after the links
  return each one generates again.

Real links (benchmarks/netns.py; root, iproute2; not in the default list): NATS, Redis and each
worker in a network namespace of its own, joined by veth pairs (the harness in the root
namespace); a cut is both ends of a link set down, so nothing is reset, open connections hang
and new ones fail (no route), as on a real network:
- `netns_redis_cut`: one worker's veth to Redis down for `--cut-s`, its veth to NATS up, restored;
- `netns_nats_cut`: the reverse;
- `netns_flap`: one worker's link (`--flap-link`, Redis by default) down `--flap-down-s`, up
  `--flap-up-s`, `--flaps` times; recovery from its last return.

Per scenario, besides `rlboost bench faults`' counts (lost, duplicated, mismatched,
wrong-version tokens, stale writes accepted, epochs reused, regenerated tokens, recovery s):
`recovery_s` here is from the link's return to the affected worker's next store answer (for
`all_unreachable`: the last worker's); `writes_after_takeover`, from what the store accepted (every token chunk on the stream is an
append the store accepted): chunks of an older lease at or past the offset a newer lease of the
same request resumed from (two holders with writes accepted); `victim_resumed_s` (link restored
-> the affected worker's next checkpointed token, refused write, claim or result); `taken_over` (requests the affected
worker held that another worker claimed after it); `fenced` (tokens of the affected worker's
writes the store refused); for `all_unreachable`, `cpu_pct` (per worker, % of one core over the outage) and
`resumed_s` (per worker). `history_violations` (and `history_<invariant>` counts): every store
operation of the workers is recorded with its outcome (`RLBOOST_STORE_HISTORY`) and checked over the
whole history against the final checkpoints and the results (benchmarks/history.py); must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from rlboost import wire
from rlboost.checkpoint import HISTORY_ENV
from rlboost.clients import open_clients
from rlboost.logs import print_result
from rlboost.pool_client import PoolClient
from rlboost.replay import read_chunks, read_subject
from rlboost.config import Settings
from benchmarks import faults, history, netns
from benchmarks.relay import Relay

SCENARIOS = ("redis_cut", "redis_slow", "redis_half_open", "all_unreachable", "nats_cut", "nats_half_open")
# Real links (benchmarks/netns.py; root): not in the default run
NETNS_SCENARIOS = ("netns_redis_cut", "netns_nats_cut", "netns_flap")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


def writes_after_takeover(events, chunks) -> int:
    """Accepted token chunks of a lease at or past the offset from which a newer lease of the same
    request resumed. Assumes the store kept its data (no restart that lost it)."""
    claims: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        if e.kind == "claim":
            claims[e.request_id].append((e.epoch, e.offset))
    return sum(1 for c in chunks for epoch, at in claims.get(c.request_id, ())
               if epoch > c.epoch and c.offset >= at)


def taken_over(events, worker: str) -> int:
    """Requests that `worker` held and another worker claimed after it (the fault handed them on)."""
    seq: dict[str, list[wire.LeaseEvent]] = defaultdict(list)
    for e in sorted((e for e in events if e.kind == "claim"), key=lambda e: e.epoch):
        seq[e.request_id].append(e)
    return sum(1 for cl in seq.values()
               if any(e.worker_id == worker and any(f.worker_id != worker for f in cl[i + 1:])
                      for i, e in enumerate(cl)))


async def _progress_after(w, since: float, timeout_s: float, all_in, nats: bool = False) -> float | None:
    """Seconds from `since` until worker `w` hears from the store again: a token checkpointed, a
    write refused (fenced), a claim or a result more than it had at `since`. None if it did not
    within `timeout_s`, or the step completed first (nothing left for it)."""
    def heard() -> int:
        c = w.counters()
        if nats:  # a fault of its NATS link: a request fetched (and claimed) or a result stored
            return c["claims"] + c["results"]
        return c["checkpointed"] + c["fenced"] + c["claims"] + c["results"]

    start = heard()
    while time.monotonic() - since < timeout_s and w.alive():
        if heard() > start:
            return round(time.monotonic() - since, 2)
        if await all_in():
            return None
        await asyncio.sleep(0.05)
    return None


async def _set_link(link, state: str) -> None:
    """`cut` / `restore` a relay or a veth link (whose `ip` calls block: off the loop)."""
    await asyncio.to_thread(getattr(link, state))


async def run_partition(name: str, a: argparse.Namespace, root: Path) -> dict:
    rng = random.Random(a.seed)
    prefix = None
    if name in NETNS_SCENARIOS:  # real links: servers and workers in namespaces of their own
        srv = await asyncio.to_thread(netns.Servers, root / name, a.workers)
        links, urls, prefix = srv.worker_links, srv.worker_urls, srv.worker_prefix
        step = 30 + NETNS_SCENARIOS.index(name)
    else:
        srv = await asyncio.to_thread(faults.Servers, root / name)
        step = 20 + SCENARIOS.index(name) if name in SCENARIOS else 0
        links = {}
    try:
        if name not in NETNS_SCENARIOS:
            for i in range(a.workers):  # workers start as w001, w002, ... (WorkerFleet)
                links[f"w{i + 1:03d}"] = (Relay.to_url(srv.nats_url, f"nats-{i}"),
                                          Relay.to_url(srv.redis_url, f"redis-{i}"))
            urls = [(n.url(srv.nats_url), r.url(srv.redis_url)) for n, r in links.values()]
        extra: dict = {}
        reqs = faults.make_requests(step, a.requests, rng, a.min_new, a.max_new)
        from rlboost import bus

        watch = await bus.connect(srv.nats_url)

        async def all_in() -> bool:
            return await faults._results_so_far(watch.jetstream(), step) >= len(reqs)

        def victim_of(fleet):
            return next((w for w in fleet.live() if w.counters()["claims"] > 0), fleet.live()[0])

        async def one_worker_fault(ctx, hurt, heal, hold_s: float, link: int = 1) -> None:
            w = victim_of(ctx["fleet"])
            fenced0 = w.counters()["fenced"]
            relay = links[w.worker_id][link]  # 0: its NATS link, 1: its Redis link
            await asyncio.to_thread(hurt, relay)
            await asyncio.sleep(hold_s)  # the fault's duration
            await asyncio.to_thread(heal, relay)
            t = time.monotonic()
            resumed = await _progress_after(w, t, a.timeout / 2, all_in, nats=link == 0)
            extra.update(victim=w.worker_id, victim_resumed_s=resumed, recovery_s=resumed)
            ctx["victim"], ctx["fenced0"] = w, fenced0

        async def one_link_flapped(ctx, link: int) -> None:
            """The victim's link goes down and up `--flaps` times; recovery from its last return."""
            w = victim_of(ctx["fleet"])
            fenced0 = w.counters()["fenced"]
            veth = links[w.worker_id][link]
            for i in range(a.flaps):
                await _set_link(veth, "cut")
                await asyncio.sleep(a.flap_down_s)
                await _set_link(veth, "restore")
                if i < a.flaps - 1:
                    await asyncio.sleep(a.flap_up_s)
            t = time.monotonic()
            resumed = await _progress_after(w, t, a.timeout / 2, all_in, nats=link == 0)
            extra.update(victim=w.worker_id, victim_resumed_s=resumed, recovery_s=resumed, flaps=a.flaps,
                         flapped=f"{w.worker_id}-{'nats' if link == 0 else 'redis'}")
            ctx["victim"], ctx["fenced0"] = w, fenced0

        if name == "redis_cut":
            async def fault(ctx):
                await one_worker_fault(ctx, Relay.cut, Relay.restore, a.cut_s)
        elif name in ("netns_redis_cut", "netns_nats_cut"):
            async def fault(ctx):
                # the worker's other link stays up; the harness's own links too
                await one_worker_fault(ctx, netns.Link.cut, netns.Link.restore, a.cut_s,
                                       link=0 if name == "netns_nats_cut" else 1)
        elif name == "netns_flap":
            async def fault(ctx):
                await one_link_flapped(ctx, link=0 if a.flap_link == "nats" else 1)
        elif name == "redis_slow":
            async def fault(ctx):
                await one_worker_fault(ctx, lambda r: r.set_latency(a.slow_s, a.slow_s / 8),
                                       lambda r: r.set_latency(0.0, 0.0), a.slow_for_s)
        elif name == "redis_half_open":
            async def fault(ctx):
                await one_worker_fault(ctx, lambda r: r.half_open(new_too=True), Relay.restore, a.cut_s)
        elif name == "nats_cut":
            async def fault(ctx):
                await one_worker_fault(ctx, Relay.cut, Relay.restore, a.cut_s, link=0)
        elif name == "nats_half_open":
            async def fault(ctx):
                # the connection dies and new ones work: resumed = how soon the worker notices it
                # (its pings) and reconnects, from the moment it went dead
                await one_worker_fault(ctx, Relay.half_open, lambda r: None, 0.0, link=0)
        elif name == "all_unreachable":
            async def fault(ctx):
                live = ctx["fleet"].live()
                for n, r in links.values():
                    n.cut()
                    r.cut()
                await asyncio.sleep(1.0)  # the first failures are handled: from here on, waiting only
                t0, cpu0 = time.monotonic(), {w.worker_id: cpu_seconds(w.proc.pid) for w in live}
                await asyncio.sleep(max(0.0, a.outage_s - 1.0))
                window = time.monotonic() - t0
                cpu = {w.worker_id: round(100 * (cpu_seconds(w.proc.pid) - cpu0[w.worker_id]) / window, 2)
                       for w in live if w.alive()}
                for n, r in links.values():
                    n.restore()
                    r.restore()
                t = time.monotonic()
                resumed = await asyncio.gather(*(_progress_after(w, t, a.timeout / 2, all_in) for w in live))
                extra.update(outage_s=a.outage_s, cpu_pct=cpu, cpu_pct_max=max(cpu.values(), default=None),
                             resumed_s=dict(zip((w.worker_id for w in live), resumed)),
                             resumed_s_max=None if None in resumed else max(resumed, default=None))
                extra["recovery_s"] = extra["resumed_s_max"]
        else:
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS + NETNS_SCENARIOS)}")

        captured: dict = {}
        # Every store operation of the workers, with its outcome, for the history check below.
        hist_dir = root / name / "history"
        worker_env = {HISTORY_ENV: str(hist_dir)}
        if name == "redis_slow":
            # a slow store makes its worker look stalled sooner, so its requests are redelivered
            # while its late writes are in flight
            worker_env["RLBOOST_WORKER__STALL_S"] = "1.0"

        async def fault_and_keep(ctx):
            await fault(ctx)
            captured.update(ctx)

        try:
            out = await faults.run_load(srv, root, name, reqs, a.workers, fault_and_keep, at=a.at,
                                        timeout_s=a.timeout, speed=a.speed, worker_urls=urls, worker_env=worker_env,
                                        worker_prefix=prefix)
        finally:
            await watch.close()
        if "victim" in captured:
            out["fenced"] = captured["victim"].counters()["fenced"] - captured["fenced0"]
        out.update(extra)
        async with open_clients(srv.nats_url, srv.redis_url, f"rlboost-partitions-{name}") as c:
            events = await read_subject(c.js, f"rb.evt.{step}.>", wire.LeaseEvent)
            chunks = await read_chunks(c.js, step)
            results = await read_subject(c.js, wire.result_subject(step), wire.RolloutResult)
            # The fencing invariants over the whole history (benchmarks/history.py): no worker is
            # SIGKILLed here, so every checkpoint token must be explained by a recorded write.
            by_id = {q.request_id: q for q in reqs}
            pool = PoolClient(c, faults.POOL)
            out.update(await history.check_run(hist_dir, c.store, results, strict=True, rids=list(by_id),
                                               verify=lambda r: pool.verify_result(step, r, by_id[r.request_id])))
        out["writes_after_takeover"] = writes_after_takeover(events, chunks)
        if "victim" in extra:
            out["taken_over"] = taken_over(events, extra["victim"])
        return out
    finally:
        if name not in NETNS_SCENARIOS:
            for n, r in links.values():
                n.close()
                r.close()
        srv.close()


def clean(out: dict, a: argparse.Namespace) -> bool:
    ok = faults.clean(out) and out["writes_after_takeover"] == 0 and out["history_violations"] == 0
    if out["scenario"] == "all_unreachable":
        ok = ok and out.get("cpu_pct_max") is not None and out["cpu_pct_max"] < a.max_cpu_pct
        ok = ok and out.get("resumed_s_max") is not None and out["resumed_s_max"] <= a.max_resume_s
    return ok


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlboost bench partitions", description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--requests", type=int, default=180)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--min-new", type=int, default=48)
    p.add_argument("--max-new", type=int, default=320)
    p.add_argument("--speed", type=float, default=0.5, help="emulated engine speed (x H100)")
    p.add_argument("--at", type=float, default=0.1, help="inject the fault once this share of the results is in")
    p.add_argument("--cut-s", type=float, default=8.0, help="redis_cut, redis_half_open: how long")
    p.add_argument("--slow-s", type=float, default=4.0, help="redis_slow: added latency to Redis (s; an eighth of it back)")
    p.add_argument("--slow-for-s", type=float, default=10.0, help="redis_slow: how long")
    p.add_argument("--outage-s", type=float, default=60.0, help="all_unreachable: how long")
    p.add_argument("--max-cpu-pct", type=float, default=5.0, help="all_unreachable: a worker's bound (%% of a core)")
    p.add_argument("--max-resume-s", type=float, default=5.0, help="all_unreachable: bound on resuming")
    p.add_argument("--flaps", type=int, default=4, help="netns_flap: how many times the link goes down")
    p.add_argument("--flap-down-s", type=float, default=3.0, help="netns_flap: down each time (s)")
    p.add_argument("--flap-up-s", type=float, default=1.5, help="netns_flap: up between two cuts (s)")
    p.add_argument("--flap-link", choices=("redis", "nats"), default="redis", help="netns_flap: which link")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the servers' data dirs and worker logs")
    return p


def main(argv: list[str], s: Settings) -> int:
    a = parser().parse_args(argv)
    if any(n in NETNS_SCENARIOS for n in a.scenarios.split(",")) and (why := netns.unavailable()):
        print(f"rlboost bench partitions: the netns_* scenarios cannot run here: {why}", flush=True)
        return 2
    root = Path(tempfile.mkdtemp(prefix="rlboost-partitions-"))
    rows = []
    try:
        for name in a.scenarios.split(","):
            out = asyncio.run(run_partition(name, a, root))
            out["ok"] = clean(out, a)
            rows.append(out)
            more = (f" cpu max {out['cpu_pct_max']}% resumed max {out['resumed_s_max']} s"
                    if name == "all_unreachable" else
                    f" victim resumed {out.get('victim_resumed_s')} s taken over {out.get('taken_over')} fenced "
                    f"{out.get('fenced')}")
            print(f"{name:<16} requests {out['requests']} lost {out['lost']} dup {out['duplicated']} mismatched "
                  f"{out['mismatched']} wrong-version {out['wrong_version_tokens']} stale "
                  f"{out['stale_writes_accepted']} after-takeover {out['writes_after_takeover']} history "
                  f"{out['history_violations']} ({out['history_ops']} ops) regenerated "
                  f"{out['regenerated_tokens']} recovery {out['recovery_s']} s{more}  -> "
                  f"{'OK' if out['ok'] else 'VIOLATED'}", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    ok = all(r["ok"] for r in rows)
    print_result({"ok": ok, "scenarios": rows})
    return 0 if ok else 1
