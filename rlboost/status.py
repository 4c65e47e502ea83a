"""`rlboost status`: which servers, how deep the queues, which workers are alive."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import msgspec

from rlboost import bus, wire
from rlboost.config import ServicesSettings, Settings
from rlboost.services import EmbeddedServices, ServiceError, resolve_urls

if TYPE_CHECKING:
    from rich.table import Table


async def gather_status(nats_url: str, services: ServicesSettings | None = None) -> dict:
    nc = await bus.connect(nats_url, name="rlboost-status", services=services)
    try:
        js = nc.jetstream()
        streams = {}
        for spec in wire.STREAMS:
            try:
                info = await js.stream_info(spec.name)
                streams[spec.name] = {"messages": info.state.messages, "bytes": info.state.bytes}
            except Exception:
                streams[spec.name] = None
        consumers = {}
        try:
            for ci in await js.consumers_info(wire.STREAM_REQUESTS):
                consumers[ci.name] = {"pending": ci.num_pending, "ack_pending": ci.num_ack_pending,
                                      "redelivered": ci.num_redelivered}
        except Exception:
            pass
        workers = []
        try:
            for key in await bus.worker_keys(js):
                try:  # one bad heartbeat (a worker credential can write any) hides only itself
                    entry = await bus.registry_entry(js, key)
                    if entry is None:
                        continue
                    hb = wire.decode(wire.WorkerHeartbeat, entry[0])
                except Exception:
                    continue
                if hb.worker_id != key:  # filed under another worker's id: not what a worker writes
                    continue
                # the age by the server's time of the put, not the entry's own (any writer's) `ts`
                workers.append({**msgspec.to_builtins(hb), "age_s": round(time.time() - entry[1], 1)})
        except Exception:
            pass  # no keys yet, or bucket missing
        return {"streams": streams, "consumers": consumers, "workers": workers}
    finally:
        await nc.drain()


def fleet_table(status: dict) -> Table:
    from rich.table import Table

    t = Table(title=f"rlboost fleet  {time.strftime('%H:%M:%S')}")
    for col in ("worker", "pool", "engine", "state", "in flight", "policy", "tokens", "age s"):
        t.add_column(col, justify="right" if col in ("in flight", "policy", "tokens", "age s") else "left")
    for w in sorted(status["workers"], key=lambda w: w["worker_id"]):
        t.add_row(w["worker_id"], w["pool"], w["engine"], w["state"], f"{w['inflight']}/{w['slots']}",
                  f"v{w['policy_version']}", f"{w['tokens_generated']:,}", str(w["age_s"]))
    queues = ", ".join(f"{n}: {v['pending']} pending / {v['ack_pending']} in flight"
                       for n, v in status["consumers"].items())
    t.caption = f"queues: {queues or 'none'}"
    return t


def watch_status(nats_url: str, interval_s: float = 1.0, services: ServicesSettings | None = None) -> int:
    """`rlboost status --watch`: the fleet, live, until Ctrl-C."""
    from rich.live import Live

    with Live(refresh_per_second=4) as live:
        try:
            while True:
                live.update(fleet_table(asyncio.run(gather_status(nats_url, services))))
                time.sleep(interval_s)
        except KeyboardInterrupt:
            return 0


def show_status(s: Settings, as_json: bool = False, watch: bool = False) -> int:
    svc = EmbeddedServices(s.services)
    st = svc.state()
    out: dict = {"data_dir": str(svc.data_dir), "embedded": None}
    if st is not None:
        out["embedded"] = {"nats": svc.nats_url(st), "redis": svc.redis_url(st), "nats_pid": st.nats_pid,
                           "redis_pid": st.redis_pid}
    try:
        nats_url, redis_url = resolve_urls(s.services)
    except ServiceError as e:
        out["error"] = str(e)
        print(json.dumps(out) if as_json else f"no servers running ({e})")
        return 1
    if watch:
        return watch_status(nats_url, services=s.services)
    out.update(asyncio.run(gather_status(nats_url, s.services)))
    if as_json:
        print(json.dumps(out))
        return 0
    print(f"nats  {bus._redact(nats_url)}\nredis {redis_url.split('@')[-1]}")
    for name, v in out["streams"].items():
        print(f"  stream {name:12} " + (f"{v['messages']} msgs, {v['bytes']} B" if v else "missing"))
    for name, v in out["consumers"].items():
        print(f"  consumer {name}: pending {v['pending']}, in flight {v['ack_pending']}, redelivered {v['redelivered']}")
    print(f"  workers alive: {len(out['workers'])}")
    for w in out["workers"]:
        print(f"    {w['worker_id']} pool={w['pool']} engine={w['engine']} state={w['state']} "
              f"inflight={w['inflight']}/{w['slots']} v{w['policy_version']} tokens={w['tokens_generated']}")
    return 0
