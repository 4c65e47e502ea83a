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
- `trainer_nats_cut`: the trainer's link to NATS (the PoolClient that published the step and
  takes its results) is cut mid-step, some results taken and the rest in flight, for `--cut-s`
  while the workers keep generating and publishing results, then restored: every result must
  still be taken exactly once;
- `trainer_nats_half_open`: the trainer's NATS connection stops answering (new connections
  work), mid-step as above;
- `nats_node_isolated`: a JetStream cluster of 3 (`rlboost up --cluster 3`: streams, consumers and
  KV buckets at replication 3) whose route links run through fault relays, one per ordered pair of
  nodes; the node leading the work queue (RB_REQUESTS) has every route to and from it cut for
  `--cut-s` while its clients stay connected to it, then restored. Workers are spread over the
  nodes (w001, w004, ... on the isolated one, the others on the majority), the publisher and the
  checks on the majority (`--replicas 1`: the same at replication 1). `isolated_routes_during_cut`
  (must be 0: no route around the relays), `failover_s` (cut -> the majority sees a work queue
  leader of its own, `leader_during_cut`), `results_during_cut` (the majority carried on; None: it
  could not read them), `cpu_pct` (per worker on the isolated node, % of one core over the cut),
  `isolated_resumed_s` (restore -> each one's next result stored), `all_in_s` (restore -> every
  result in), `taken_over` / `fenced` (summed over the isolated workers), `stream_leaders` (at the
  start), `leader_after`; `recovery_s` is the isolated side's slowest resumption;
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
`all_unreachable`: the last worker's; for the trainer's link: from its return, or for a half-open
one from the moment it went dead, to the next result the trainer takes); `writes_after_takeover`,
from what the store accepted (every token chunk on the stream is an
append the store accepted): chunks of an older lease at or past the offset a newer lease of the
same request resumed from (two holders with writes accepted); `victim_resumed_s` (link restored
-> the affected worker's next checkpointed token, refused write, claim or result); `taken_over` (requests the affected
worker held that another worker claimed after it); `fenced` (tokens of the affected worker's
writes the store refused); for `all_unreachable`, `cpu_pct` (per worker, % of one core over the outage) and
`resumed_s` (per worker). `history_violations` (and `history_<invariant>` counts): every store
operation of the workers is recorded with its outcome (`RLBOOST_STORE_HISTORY`) and checked over the
whole history against the final checkpoints and the results (benchmarks/history.py); must be 0.
For the trainer's link, what the trainer took (`PoolClient.results`) is counted as well:
`taken_lost`, `taken_duplicated`, `taken_mismatched`, `taken_wrong_version_tokens` (must be 0),
`trainer` (how its collection ended: `returned`, or why not), `results_during_cut` (results the
workers published while the trainer could not hear them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlboost import bus, wire
from rlboost.checkpoint import HISTORY_ENV
from rlboost.clients import open_clients
from rlboost import pool_client
from rlboost.pool_client import PoolClient
from rlboost.replay import read_chunks, read_subject
from rlboost.config import ServicesSettings, Settings
from rlboost.services import EmbeddedServices, free_port, provision_cluster
from rlboost.benchmarks import faults, history, netns, report
from rlboost.benchmarks.relay import Relay

if TYPE_CHECKING:
    from rlboost.workers.fleet import WorkerFleet

SCENARIOS = ("redis_cut", "redis_slow", "redis_half_open", "all_unreachable", "nats_cut", "nats_half_open",
             "trainer_nats_cut", "trainer_nats_half_open", "nats_node_isolated")
TRAINER_SCENARIOS = ("trainer_nats_cut", "trainer_nats_half_open")
# Real links (benchmarks/netns.py; root): not in the default run
NETNS_SCENARIOS = ("netns_redis_cut", "netns_nats_cut", "netns_flap")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)


class RelayedCluster(EmbeddedServices):
    """`rlboost up --cluster N` with every route link through a fault relay of its own: one per
    ordered pair of nodes (the connections node a dials to node b), so that cutting a node's
    relays, both ways, leaves it with no route to any peer while its clients stay connected."""

    def __init__(self, settings: ServicesSettings) -> None:
        super().__init__(settings)
        self.route_relays: dict[tuple[int, int], Relay] = {}
        self.monitor_ports: dict[int, int] = {}
        # Nodes tell each other the route URL a new peer advertised and dial it when they have no
        # route to that peer yet (implicit routes): that dial would go around the relays. So every
        # node advertises a port held bound and never listened on: such a dial is refused (and
        # not retried: it is no configured route); the configured ones, the relays, are retried.
        self._nowhere = socket.socket()
        self._nowhere.bind(("127.0.0.1", 0))

    def _route_flags(self, node: int, host: str, routes: list[int]) -> list[str]:
        urls = []
        for peer, port in enumerate(routes):
            if peer != node:
                if (node, peer) not in self.route_relays:  # a restarted node dials through the same relay
                    self.route_relays[node, peer] = Relay(host, port, name=f"route-{node}-{peer}").start()
                urls.append(f"nats://{host}:{self.route_relays[node, peer].port}")
        self.monitor_ports.setdefault(node, free_port(host))
        return ["--routes", ",".join(urls), "--cluster_advertise", f"{host}:{self._nowhere.getsockname()[1]}",
                "-m", str(self.monitor_ports[node])]

    def links_of(self, node: int) -> list[Relay]:
        return [r for (a, b), r in self.route_relays.items() if node in (a, b)]

    def routes_of(self, node: int) -> int:
        """Route connections node `node` has now (its monitoring endpoint), -1 if it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_ports[node]}/routez", timeout=2.0) as f:
                return int(json.load(f)["num_routes"])
        except (OSError, ValueError, KeyError):
            return -1

    def close_relays(self) -> None:
        for r in self.route_relays.values():
            r.close()
        self._nowhere.close()


class SplitServers(faults.Servers):
    """faults.Servers on a 3-node JetStream cluster whose routes run through relays (RelayedCluster)."""

    def __init__(self, root: Path, replicas: int = 3) -> None:
        self.dir = root
        self.svc = RelayedCluster(ServicesSettings(data_dir=str(root / "data"), nats_cluster=3))
        try:
            st, _ = self.svc.up()
            self.node_urls = [f"nats://127.0.0.1:{port}" for port, _ in st.nats_nodes()]
            self.nats_url, self.redis_url = self.svc.nats_url(st), self.svc.redis_url(st)
            asyncio.run(provision_cluster(self.nats_url, replicas))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        super().close()
        self.svc.close_relays()


async def _stream_leader(url: str, stream: str, timeout_s: float = 30.0, other_than: str = "") -> str:
    """The stream's leader as the node at `url` sees it, once there is one (other than `other_than`)."""
    nc = await bus.connect(url)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(Exception):
                info = await nc.jetstream(timeout=2.0).stream_info(stream)
                if info.cluster and info.cluster.leader and info.cluster.leader != other_than:
                    return info.cluster.leader
            if time.monotonic() > deadline:
                raise TimeoutError(f"no leader of {stream} seen from {url} in {timeout_s:g} s")
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


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


async def _progress_after(w, since: float, timeout_s: float, all_in, nats: bool = False,
                          fields: tuple[str, ...] = ("checkpointed", "fenced", "claims", "results")) -> float | None:
    """Seconds from `since` until worker `w` hears from the store again: a token checkpointed, a
    write refused (fenced), a claim or a result (`fields` of its counters) more than it had at
    `since`. None if it did not within `timeout_s`, or the step completed first (nothing left for it)."""
    if nats:  # a fault of its NATS link: a request fetched (and claimed) or a result stored
        fields = ("claims", "results")

    def heard() -> int:
        c = w.counters()
        return sum(c[f] for f in fields)

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


class Trainer:
    """The trainer's side of one step, as `trainer/run.py` drives it: a PoolClient that publishes
    the step's requests and takes their results (`PoolClient.results`), reaching NATS through a
    link of its own (a relay's URL) and Redis directly. Records each result it takes, when, and
    over which of its connections."""

    def __init__(self, nats_url: str, redis_url: str, timeout_s: float) -> None:
        self.nats_url, self.redis_url, self.timeout_s = nats_url, redis_url, timeout_s
        self.taken: list[wire.RolloutResult] = []
        self.taken_at: list[float] = []  # time.monotonic() of each
        self.taken_on: list[int] = []  # the NATS connection's reconnects so far, at each
        self.outcome = "running"
        self.nc = None
        self.task: asyncio.Task | None = None
        self._published = asyncio.Event()

    async def publish(self, reqs: list[wire.RolloutRequest]) -> None:
        """`faults.run_load`'s publish hook: start the trainer; return once its step is stored."""
        self.task = asyncio.create_task(self._run(reqs))
        published = asyncio.create_task(self._published.wait())
        await asyncio.wait({self.task, published}, return_when=asyncio.FIRST_COMPLETED)
        published.cancel()
        if self.task.done():
            self.task.result()  # raises what stopped it
            raise RuntimeError("the trainer returned before publishing")

    async def finish(self, timeout_s: float) -> None:
        """Wait for the trainer to have taken every result; `outcome` says how it ended."""
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
            self.outcome = "returned"
        except (TimeoutError, asyncio.TimeoutError):
            self.outcome = f"hung: {len(self.taken)} results taken after {timeout_s:g} s more"
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        except Exception as e:
            self.outcome = f"raised: {str(e)[:200]}"

    async def _run(self, reqs: list[wire.RolloutRequest]) -> None:
        async with open_clients(self.nats_url, self.redis_url, "rlboost-partitions-trainer", pools=(faults.POOL,),
                                nats_options=pool_client.NATS_OPTIONS) as c:  # as trainer/run.py connects
            self.nc = c.nc
            pool = PoolClient(c, faults.POOL)
            await pool.publish_step(reqs)
            self._published.set()
            async for r in pool.results(reqs[0].step, reqs, timeout_s=self.timeout_s):
                self.taken.append(r)
                self.taken_at.append(time.monotonic())
                self.taken_on.append(self.reconnects())

    def reconnects(self) -> int:
        return self.nc.stats["reconnects"] if self.nc is not None else 0

    async def heard_again(self, since: float, reconnects: int, timeout_s: float, want: int) -> float | None:
        """Seconds from `since` to the first result taken after it over a newer connection than
        the `reconnects`-th: results the old connection delivered before it died, taken a little
        later, do not count. None if none within `timeout_s`, or every result (`want`) was taken."""
        while True:
            first = next((t for t, n in zip(self.taken_at, self.taken_on, strict=True) if t > since and n > reconnects),
                         None)
            if first is not None:
                return round(first - since, 2)
            if (time.monotonic() - since > timeout_s or len(self.taken) >= want
                    or (self.task is not None and self.task.done())):
                return None
            await asyncio.sleep(0.02)


class Partition:
    """One scenario's run, along its jobs: the servers and each worker's links (`setup`), the
    fault (`FAULTS[name]`, called once `--at` of the step's results are in), the load with the
    fault in its midst (`run`) and the checks over what the streams and the store recorded
    (`check`)."""

    def __init__(self, name: str, a: argparse.Namespace, root: Path) -> None:
        if name not in FAULTS:  # before any server starts
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS + NETNS_SCENARIOS)}")
        self.name, self.a, self.root = name, a, root
        self.real = name in NETNS_SCENARIOS  # real links: servers and workers in namespaces of their own
        self.split = name == "nats_node_isolated"
        self.step = 30 + NETNS_SCENARIOS.index(name) if self.real else 20 + SCENARIOS.index(name)
        self.reqs = faults.make_requests(self.step, a.requests, random.Random(a.seed), a.min_new, a.max_new)
        self.srv = None
        # each worker's (NATS link, Redis link): fault relays, or veth pairs (netns.Link) for the real ones
        self.links: dict = {}
        self.urls: list[tuple[str, str]] = []  # each worker's (NATS, Redis) URLs, in start order
        self.prefix = None  # what each worker runs in: its namespace's `ip netns exec`, for the real links
        self.trainer: Trainer | None = None
        self.trainer_relay: Relay | None = None
        self.iso = -1  # nats_node_isolated: the node cut off
        self.watch = None  # the harness's own NATS connection: has every result come in?
        self.extra: dict = {}  # the fault's figures, for the scenario's row
        self.held: dict = {}  # what the fault leaves for the checks: the worker(s) it hurt, their counts before

    # -- the servers and the links

    async def setup(self) -> None:
        """Fresh servers, and each worker's (and a trainer scenario's trainer's) way to them."""
        a = self.a
        if self.real:
            self.srv = await asyncio.to_thread(netns.Servers, self.root / self.name, a.workers)
            self.links, self.urls, self.prefix = self.srv.worker_links, self.srv.worker_urls, self.srv.worker_prefix
        elif self.split:
            self.srv = await asyncio.to_thread(SplitServers, self.root / self.name, a.replicas)
            await self._spread_over_nodes()
        else:
            self.srv = await asyncio.to_thread(faults.Servers, self.root / self.name)
            for i in range(a.workers):  # workers start as w001, w002, ... (WorkerFleet)
                self.links[f"w{i + 1:03d}"] = (Relay.to_url(self.srv.nats_url, f"nats-{i}"),
                                               Relay.to_url(self.srv.redis_url, f"redis-{i}"))
            self.urls = [(n.url(self.srv.nats_url), r.url(self.srv.redis_url)) for n, r in self.links.values()]
        if self.name in TRAINER_SCENARIOS:  # the trainer reaches NATS through a relay of its own
            self.trainer_relay = Relay.to_url(self.srv.nats_url, "nats-trainer")
            self.trainer = Trainer(self.trainer_relay.url(self.srv.nats_url), self.srv.redis_url, a.timeout)
        self.watch = await bus.connect(self.srv.nats_url)

    async def _spread_over_nodes(self) -> None:
        srv = self.srv
        # The node to isolate: the work queue's leader, so the majority has to elect another.
        self.iso = int((await _stream_leader(srv.node_urls[0], wire.STREAM_REQUESTS)).removeprefix("rb-n"))
        majority = [u for i, u in enumerate(srv.node_urls) if i != self.iso]
        # where each stream leads (at replication 1: the one node that has it)
        self.extra["stream_leaders"] = {spec.name: await _stream_leader(srv.node_urls[0], spec.name)
                                        for spec in wire.STREAMS}
        srv.nats_url = majority[0]  # the publisher, the watcher and the checks: the majority side
        order = [srv.node_urls[self.iso], *majority]
        self.urls = [(order[i % 3], srv.redis_url) for i in range(self.a.workers)]  # w001, w004, ...: isolated

    def close(self) -> None:
        if not self.real:  # veth pairs go with their namespaces (srv.close())
            for n, r in self.links.values():
                n.close()
                r.close()
        if self.trainer_relay is not None:
            self.trainer_relay.close()
        if self.srv is not None:
            self.srv.close()

    # -- the faults (FAULTS: which scenario runs which)

    async def all_in(self) -> bool:
        return await faults._results_so_far(self.watch.jetstream(), self.step) >= len(self.reqs)

    @staticmethod
    def victim_of(fleet: WorkerFleet):
        return next((w for w in fleet.live() if w.counters()["claims"] > 0), fleet.live()[0])

    async def one_worker_fault(self, fleet: WorkerFleet, hurt, heal, hold_s: float, link: int = 1) -> None:
        """One worker's link (0: to NATS, 1: to Redis) is hurt for `hold_s`, then healed."""
        w = self.victim_of(fleet)
        self.held.update(victim=w, fenced0=w.counters()["fenced"])
        relay = self.links[w.worker_id][link]
        await asyncio.to_thread(hurt, relay)
        await asyncio.sleep(hold_s)  # the fault's duration
        await asyncio.to_thread(heal, relay)
        t = time.monotonic()
        resumed = await _progress_after(w, t, self.a.timeout / 2, self.all_in, nats=link == 0)
        self.extra.update(victim=w.worker_id, victim_resumed_s=resumed, recovery_s=resumed)

    async def one_link_flapped(self, fleet: WorkerFleet, link: int) -> None:
        """The victim's link goes down and up `--flaps` times; recovery from its last return."""
        a = self.a
        w = self.victim_of(fleet)
        self.held.update(victim=w, fenced0=w.counters()["fenced"])
        veth = self.links[w.worker_id][link]
        for i in range(a.flaps):
            await _set_link(veth, "cut")
            await asyncio.sleep(a.flap_down_s)
            await _set_link(veth, "restore")
            if i < a.flaps - 1:
                await asyncio.sleep(a.flap_up_s)
        t = time.monotonic()
        resumed = await _progress_after(w, t, a.timeout / 2, self.all_in, nats=link == 0)
        self.extra.update(victim=w.worker_id, victim_resumed_s=resumed, recovery_s=resumed, flaps=a.flaps,
                          flapped=f"{w.worker_id}-{'nats' if link == 0 else 'redis'}")

    async def trainer_fault(self, hurt, hold_s: float) -> None:
        trainer, relay, a = self.trainer, self.trainer_relay, self.a
        # mid-step: some results taken, the rest in flight (the workers are at it)
        t_wait = time.monotonic()
        while not trainer.taken and time.monotonic() - t_wait < a.timeout / 2:
            await asyncio.sleep(0.02)
        js = self.watch.jetstream()
        taken0, published0 = len(trainer.taken), await faults._results_so_far(js, self.step)
        link = trainer.reconnects()
        hurt(relay)
        t = time.monotonic()  # a half-open link: recovery counts from the moment it went dead
        await asyncio.sleep(hold_s)
        relay.restore()
        if hold_s > 0:
            t = time.monotonic()
        self.extra["recovery_s"] = await trainer.heard_again(t, link, a.timeout / 2, len(self.reqs))
        # what the workers published while the trainer could not hear (until it did again)
        self.extra.update(taken_at_cut=taken0,
                          results_during_cut=await faults._results_so_far(js, self.step) - published0)

    async def all_unreachable(self, fleet: WorkerFleet) -> None:
        a = self.a
        live = fleet.live()
        for n, r in self.links.values():
            n.cut()
            r.cut()
        await asyncio.sleep(1.0)  # the first failures are handled: from here on, waiting only
        t0, cpu0 = time.monotonic(), {w.worker_id: cpu_seconds(w.proc.pid) for w in live}
        await asyncio.sleep(max(0.0, a.outage_s - 1.0))
        window = time.monotonic() - t0
        cpu = {w.worker_id: round(100 * (cpu_seconds(w.proc.pid) - cpu0[w.worker_id]) / window, 2)
               for w in live if w.alive()}
        for n, r in self.links.values():
            n.restore()
            r.restore()
        t = time.monotonic()
        resumed = await asyncio.gather(*(_progress_after(w, t, a.timeout / 2, self.all_in) for w in live))
        self.extra.update(outage_s=a.outage_s, cpu_pct=cpu, cpu_pct_max=max(cpu.values(), default=None),
                          resumed_s=dict(zip((w.worker_id for w in live), resumed)),
                          resumed_s_max=None if None in resumed else max(resumed, default=None))
        self.extra["recovery_s"] = self.extra["resumed_s_max"]

    async def node_isolated(self, fleet: WorkerFleet) -> None:
        a, srv, iso, extra = self.a, self.srv, self.iso, self.extra
        isolated = [w for w in fleet.live() if (int(w.worker_id[1:]) - 1) % 3 == 0]
        self.held.update(isolated=isolated, fenced0=sum(w.counters()["fenced"] for w in isolated))
        before = await faults._results_so_far(self.watch.jetstream(), self.step)
        for r in srv.svc.links_of(iso):
            r.cut()
        t0 = time.monotonic()
        # the state the cut is for: the node has no route left (not one around the relays)
        while (n := await asyncio.to_thread(srv.svc.routes_of, iso)) != 0 and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.1)
        extra["isolated_routes_during_cut"] = n
        if a.replicas > 1:  # the majority elects a leader of its own
            with contextlib.suppress(TimeoutError):
                extra["leader_during_cut"] = await _stream_leader(srv.nats_url, wire.STREAM_REQUESTS, a.cut_s,
                                                                  other_than=f"rb-n{iso}")
                extra["failover_s"] = round(time.monotonic() - t0, 2)
        cpu0 = {w.worker_id: cpu_seconds(w.proc.pid) for w in isolated}
        await asyncio.sleep(max(0.0, a.cut_s - (time.monotonic() - t0)))
        window = time.monotonic() - t0
        cpu = {w.worker_id: round(100 * (cpu_seconds(w.proc.pid) - cpu0[w.worker_id]) / window, 2)
               for w in isolated if w.alive()}
        after = await faults._results_so_far(self.watch.jetstream(), self.step)
        during = after - before if min(before, after) >= 0 else None  # None: the majority cannot read them
        for r in srv.svc.links_of(iso):
            r.restore()
        t = time.monotonic()

        async def all_in_after() -> None:
            while not await self.all_in():
                await asyncio.sleep(0.1)
            extra["all_in_s"] = round(time.monotonic() - t, 2)

        self.held["all_in_task"] = asyncio.create_task(all_in_after())
        # producing again: a result stored (a claim needs Redis only, which it never lost)
        resumed = await asyncio.gather(*(_progress_after(w, t, a.timeout / 2, self.all_in, fields=("results",))
                                         for w in isolated))
        extra.update(isolated_node=f"rb-n{iso}", replicas=a.replicas, isolated_workers=[w.worker_id for w in isolated],
                     cpu_pct=cpu, cpu_pct_max=max(cpu.values(), default=None), results_during_cut=during,
                     isolated_resumed_s=dict(zip((w.worker_id for w in isolated), resumed)),
                     recovery_s=None if None in resumed else max(resumed, default=None))

    # -- the load, then the checks

    async def run(self) -> dict:
        """The step's requests through the workers, the fault once `--at` of them are in
        (faults.run_load); then the trainer's collection, in a trainer scenario."""
        a = self.a
        # Every store operation of the workers, with its outcome, for the history check.
        worker_env = {HISTORY_ENV: str(self.root / self.name / "history")}
        if self.name == "redis_slow":
            # a slow store makes its worker look stalled sooner, so its requests are redelivered
            # while its late writes are in flight
            worker_env["RLBOOST_WORKER__STALL_S"] = "1.0"
        try:
            out = await faults.run_load(self.srv, self.root, self.name, self.reqs, a.workers,
                                        lambda ctx: FAULTS[self.name](self, ctx["fleet"]), at=a.at,
                                        timeout_s=a.timeout, speed=a.speed, worker_urls=self.urls or None,
                                        worker_env=worker_env, worker_prefix=self.prefix,
                                        publish=self.trainer.publish if self.trainer else None)
            if self.trainer is not None:  # the workers are done: the trainer has everything to take
                await self.trainer.finish(a.timeout / 2)
        finally:
            if (task := self.held.get("all_in_task")) is not None:  # it sees the last result a poll later
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    await asyncio.wait_for(task, 5.0)
            await self.watch.close()
        return out

    async def check(self, out: dict) -> None:
        """Into `out`: the fault's figures; what the trainer took; the fencing checks over what the
        streams and the store recorded (takeovers, the whole history: benchmarks/history.py)."""
        step, held = self.step, self.held
        if self.split:
            self.extra["leader_after"] = await _stream_leader(self.srv.nats_url, wire.STREAM_REQUESTS)
        if "victim" in held:
            out["fenced"] = held["victim"].counters()["fenced"] - held["fenced0"]
        out.update(self.extra)
        if self.trainer is not None:
            took = faults.analyse(self.reqs, self.trainer.taken, [], [])
            out.update(trainer=self.trainer.outcome, taken=len(self.trainer.taken),
                       **{f"taken_{k}": took[k] for k in ("lost", "duplicated", "mismatched", "wrong_version_tokens")})
        async with open_clients(self.srv.nats_url, self.srv.redis_url, f"rlboost-partitions-{self.name}") as c:
            events = await read_subject(c.js, f"rb.evt.{step}.>", wire.LeaseEvent)
            chunks = await read_chunks(c.js, step)
            results = await read_subject(c.js, wire.result_subject(step), wire.RolloutResult)
            # The fencing invariants over the whole history (benchmarks/history.py): no worker is
            # SIGKILLed here, so every checkpoint token must be explained by a recorded write.
            by_id = {q.request_id: q for q in self.reqs}
            pool = PoolClient(c, faults.POOL)
            out.update(await history.check_run(self.root / self.name / "history", c.store, results, strict=True,
                                               rids=list(by_id),
                                               verify=lambda r: pool.verify_result(step, r, by_id[r.request_id])))
        out["writes_after_takeover"] = writes_after_takeover(events, chunks)
        if "victim" in self.extra:
            out["taken_over"] = taken_over(events, self.extra["victim"])
        if "isolated" in held:  # what the isolated side held that the majority finished, and refused writes
            out["taken_over"] = sum(taken_over(events, w.worker_id) for w in held["isolated"])
            out["fenced"] = sum(w.counters()["fenced"] for w in held["isolated"]) - held["fenced0"]


# Each scenario's fault: called with the worker fleet once `--at` of the step's results are in.
FAULTS: dict[str, Callable[[Partition, WorkerFleet], Awaitable[None]]] = {
    "redis_cut": lambda p, fleet: p.one_worker_fault(fleet, Relay.cut, Relay.restore, p.a.cut_s),
    "redis_slow": lambda p, fleet: p.one_worker_fault(fleet, lambda r: r.set_latency(p.a.slow_s, p.a.slow_s / 8),
                                                      lambda r: r.set_latency(0.0, 0.0), p.a.slow_for_s),
    "redis_half_open": lambda p, fleet: p.one_worker_fault(fleet, lambda r: r.half_open(new_too=True), Relay.restore,
                                                           p.a.cut_s),
    "all_unreachable": Partition.all_unreachable,
    "nats_cut": lambda p, fleet: p.one_worker_fault(fleet, Relay.cut, Relay.restore, p.a.cut_s, link=0),
    # the connection dies and new ones work: resumed = how soon the worker notices it (its pings)
    # and reconnects, from the moment it went dead
    "nats_half_open": lambda p, fleet: p.one_worker_fault(fleet, Relay.half_open, lambda r: None, 0.0, link=0),
    "trainer_nats_cut": lambda p, fleet: p.trainer_fault(Relay.cut, p.a.cut_s),
    "trainer_nats_half_open": lambda p, fleet: p.trainer_fault(Relay.half_open, 0.0),
    "nats_node_isolated": Partition.node_isolated,
    # the worker's other link stays up; the harness's own links too
    "netns_redis_cut": lambda p, fleet: p.one_worker_fault(fleet, netns.Link.cut, netns.Link.restore, p.a.cut_s),
    "netns_nats_cut": lambda p, fleet: p.one_worker_fault(fleet, netns.Link.cut, netns.Link.restore, p.a.cut_s,
                                                          link=0),
    "netns_flap": lambda p, fleet: p.one_link_flapped(fleet, link=0 if p.a.flap_link == "nats" else 1),
}


async def run_partition(name: str, a: argparse.Namespace, root: Path) -> dict:
    """One scenario on fresh servers: its row of figures (`clean` judges it)."""
    p = Partition(name, a, root)
    try:
        await p.setup()
        out = await p.run()
        await p.check(out)
        return out
    finally:
        p.close()


def clean(out: dict, a: argparse.Namespace) -> bool:
    ok = faults.clean(out) and out["writes_after_takeover"] == 0 and out["history_violations"] == 0
    if out["scenario"] == "all_unreachable":
        ok = ok and out.get("cpu_pct_max") is not None and out["cpu_pct_max"] < a.max_cpu_pct
        ok = ok and out.get("resumed_s_max") is not None and out["resumed_s_max"] <= a.max_resume_s
    if out["scenario"] == "nats_node_isolated":  # a route left around the relays: nothing was isolated
        ok = ok and out.get("isolated_routes_during_cut") == 0
    if out["scenario"] in TRAINER_SCENARIOS:  # the trainer took every result once, and did not hang
        ok = ok and out["trainer"] == "returned" and out["recovery_s"] is not None and out["taken_lost"] == \
            out["taken_duplicated"] == out["taken_mismatched"] == out["taken_wrong_version_tokens"] == 0
    return ok


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlboost bench partitions", description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated, run in this order (default: all but the netns_* ones): "
                   f"{', '.join(SCENARIOS)}; needing root (network namespaces): {', '.join(NETNS_SCENARIOS)}")
    p.add_argument("--requests", type=int, default=180)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--min-new", type=int, default=48)
    p.add_argument("--max-new", type=int, default=320)
    p.add_argument("--speed", type=float, default=0.5, help="emulated engine speed (x H100)")
    p.add_argument("--at", type=float, default=0.1, help="inject the fault once this share of the results is in")
    p.add_argument("--cut-s", type=float, default=8.0, help="redis_cut, redis_half_open, nats_cut, "
                   "trainer_nats_cut, nats_node_isolated, netns_redis_cut, netns_nats_cut: how long")
    p.add_argument("--slow-s", type=float, default=4.0, help="redis_slow: added latency to Redis (s; an eighth of it back)")
    p.add_argument("--slow-for-s", type=float, default=10.0, help="redis_slow: how long")
    p.add_argument("--outage-s", type=float, default=60.0, help="all_unreachable: how long")
    p.add_argument("--max-cpu-pct", type=float, default=5.0, help="all_unreachable: a worker's bound (%% of a core)")
    p.add_argument("--max-resume-s", type=float, default=5.0, help="all_unreachable: bound on resuming")
    p.add_argument("--replicas", type=int, default=3, help="nats_node_isolated: the streams' replication "
                   "(3: what `rlboost up --cluster 3` and infra/*cluster* provision)")
    p.add_argument("--flaps", type=int, default=4, help="netns_flap: how many times the link goes down")
    p.add_argument("--flap-down-s", type=float, default=3.0, help="netns_flap: down each time (s)")
    p.add_argument("--flap-up-s", type=float, default=1.5, help="netns_flap: up between two cuts (s)")
    p.add_argument("--flap-link", choices=("redis", "nats"), default="redis", help="netns_flap: which link")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the servers' data dirs and worker logs")
    report.add_out(p)
    return p


def _print_row(name: str, out: dict) -> None:
    more = (f" cpu max {out['cpu_pct_max']}% resumed max {out['resumed_s_max']} s"
            if name == "all_unreachable" else
            f" isolated {out.get('isolated_node')} ({','.join(out.get('isolated_workers', []))}) cpu max "
            f"{out.get('cpu_pct_max')}% results during cut {out.get('results_during_cut')} resumed "
            f"{out.get('isolated_resumed_s')} all in {out.get('all_in_s')} s leader during cut "
            f"{out.get('leader_during_cut')} (in {out.get('failover_s')} s) after {out.get('leader_after')} "
            f"taken over {out.get('taken_over')} fenced {out.get('fenced')}"
            if name == "nats_node_isolated" else
            f" taken {out['taken']} (lost {out['taken_lost']} dup {out['taken_duplicated']} mismatched "
            f"{out['taken_mismatched']} wrong-version {out['taken_wrong_version_tokens']}) published during "
            f"the cut {out.get('results_during_cut')} trainer {out['trainer']}"
            if name in TRAINER_SCENARIOS else
            f" victim resumed {out.get('victim_resumed_s')} s taken over {out.get('taken_over')} fenced "
            f"{out.get('fenced')}")
    print(f"{name:<16} requests {out['requests']} lost {out['lost']} dup {out['duplicated']} mismatched "
          f"{out['mismatched']} wrong-version {out['wrong_version_tokens']} stale "
          f"{out['stale_writes_accepted']} after-takeover {out['writes_after_takeover']} history "
          f"{out['history_violations']} ({out['history_ops']} ops) regenerated "
          f"{out['regenerated_tokens']} recovery {out['recovery_s']} s{more}  -> "
          f"{'OK' if out['ok'] else 'VIOLATED'}", flush=True)


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
            _print_row(name, out)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    ok = all(r["ok"] for r in rows)
    return report.finish("partitions", {"ok": ok, "scenarios": rows}, report.out_dir(a), ok=ok)
