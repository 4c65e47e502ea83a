"""Real network partitions on one box: Linux network namespaces joined by veth pairs, whose links
a test or bench cuts, restores and flaps (`ip link set DEV down/up` on both ends).

A `Topology` owns namespaces named `rb-<pid>-<seq>-<name>` (the pid of the process that made
them, so a later run can tell its own from a dead run's leftovers), each with `lo` up, and point
to point links between two of them, or between one and the root namespace (where the bench's
trainer side runs). Every link is a veth pair with a private /24 of its own: `10.<net>.<k>.1` on
the first end, `.2` on the second; `<net>` is picked among 10.200-249 so that no route of the root
namespace overlaps it. A process started in a namespace (`ip netns exec`, which execs: its pid is
the program's own) reaches another namespace only over a direct link, so cutting that link
partitions exactly that pair.

A cut here is what a real network does, not what the loopback relay (benchmarks/relay.py) does:
no reset reaches either end; open connections hang until a timeout or keepalive of their own, new
ones fail at once (the route went with the link: ENETUNREACH).

Everything a `Topology` starts, `close()` stops: its processes (SIGTERM, then SIGKILL), anything
else left in its namespaces, the namespaces (their veth ends, and so the peers, go with them).
It is a context manager, and an atexit hook closes what is still open; `cleanup_stale()` removes
the namespaces of runs whose process is gone (a SIGKILLed bench). Needs root and iproute2.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rlboost.errors import RlboostError
from rlboost.procs import pid_alive

ROOT = None  # the root namespace, as an end of a link
PREFIX = "rb-"
_STALE = re.compile(r"^rb-(\d+)-")
_seq = itertools.count()
_open: set[Topology] = set()


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(("-n", ns) if ns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise NetnsError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done


class NetnsError(RlboostError, RuntimeError):
    """An `ip` command failed (or network namespaces are not available here)."""


def unavailable() -> str | None:
    """Why namespaces cannot be used here (not root, no iproute2, `ip netns add` refused); None if they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this process is not root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not on PATH"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {e}"
    if done.returncode:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def namespaces() -> list[str]:
    """Every named network namespace (`ip netns list`)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL whatever still runs in `ns` (only ever called on a namespace of ours)."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete_ns(ns: str) -> None:
    _kill_inside(ns)
    _ip("netns", "del", ns, check=False)


def cleanup_stale() -> list[str]:
    """Delete the `rb-<pid>-*` namespaces whose process is gone (and what still runs in them)."""
    gone = [ns for ns in namespaces() if (m := _STALE.match(ns)) and not pid_alive(int(m.group(1)))]
    for ns in gone:
        _delete_ns(ns)
    return gone


def _free_net() -> int:
    """A second octet in 10.200-249 that no route of the root namespace overlaps."""
    routes = [ipaddress.ip_network(r.split()[0], strict=False)
              for r in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines()
              if r and r.split()[0][0].isdigit()]
    for n in range(200, 250):
        net = ipaddress.ip_network(f"10.{n}.0.0/16")
        if not any(net.overlaps(r) for r in routes if r.prefixlen > 0):
            return n
    raise NetnsError("no free 10.x.0.0/16 (x in 200-249) for the links")


@dataclass
class Link:
    """One veth pair between namespaces `a` and `b` (None: the root namespace)."""

    topo: Topology
    a: str | None
    b: str | None
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str
    up: bool = True

    def addr_of(self, end: str | None) -> str:
        """The address of this link's end in namespace `end` (short name, or ROOT)."""
        return self.addr_a if end == self.a else self.addr_b

    def _set(self, state: str) -> None:
        _ip("link", "set", "dev", self.dev_a, state, ns=self.topo.ns(self.a))
        _ip("link", "set", "dev", self.dev_b, state, ns=self.topo.ns(self.b))

    def cut(self) -> None:
        """Both ends down: nothing crosses, no reset is sent; the routes over it go."""
        self._set("down")
        self.up = False

    def restore(self) -> None:
        """Both ends up again (the addresses stay, the kernel puts the routes back)."""
        self._set("up")
        self.up = True

    def flap(self, times: int, down_s: float, up_s: float) -> None:
        """Cut and restore `times` times (down `down_s`, then up `up_s`, the last up time too)."""
        for _ in range(times):
            self.cut()
            time.sleep(down_s)
            self.restore()
            time.sleep(up_s)

    def carrier(self) -> bool:
        """Whether the kernel reports both ends up (operstate UP), as this link's state says."""
        states = [_ip("-o", "link", "show", "dev", d, ns=self.topo.ns(n)).stdout
                  for d, n in ((self.dev_a, self.a), (self.dev_b, self.b))]
        return all("state UP" in s for s in states)


class Topology:
    """Namespaces, the links between them and the processes in them; `close()` undoes it all."""

    def __init__(self) -> None:
        reason = unavailable()
        if reason:
            raise NetnsError(reason)
        cleanup_stale()
        self.pid, self.seq = os.getpid(), next(_seq)
        self.net = _free_net()
        self.names: dict[str, str] = {}  # short name -> namespace
        self.links: list[Link] = []
        self.procs: list[subprocess.Popen] = []
        self.closed = False
        _open.add(self)

    def ns(self, name: str | None) -> str | None:
        return None if name is ROOT else self.names[name]

    def add(self, name: str) -> str:
        """A namespace for `name` (its loopback up); returns its full name."""
        full = f"{PREFIX}{self.pid}-{self.seq}-{name}"
        _ip("netns", "add", full)
        self.names[name] = full
        _ip("link", "set", "dev", "lo", "up", ns=full)
        return full

    def link(self, a: str | None, b: str) -> Link:
        """A veth pair between `a` (a short name, or ROOT) and `b`, up, with a /24 of its own."""
        k = len(self.links) + 1
        if k > 254:
            raise NetnsError("too many links for one /16")
        # names: in a namespace of ours, after the peer (short); in the root one, unique per run
        dev_a = f"rb{self.pid:x}-{self.seq}-{k}"[:15] if a is ROOT else b[:15]
        dev_b = "root" if a is ROOT else a[:15]
        where_a = [] if a is ROOT else ["netns", self.names[a]]
        _ip("link", "add", dev_a, *where_a, "type", "veth", "peer", "name", dev_b, "netns", self.names[b])
        addr_a, addr_b = f"10.{self.net}.{k}.1", f"10.{self.net}.{k}.2"
        for dev, ns, addr in ((dev_a, self.ns(a), addr_a), (dev_b, self.names[b], addr_b)):
            _ip("addr", "add", f"{addr}/24", "dev", dev, ns=ns)
            _ip("link", "set", "dev", dev, "up", ns=ns)
        link = Link(self, a, b, dev_a, dev_b, addr_a, addr_b)
        self.links.append(link)
        return link

    def prefix(self, name: str) -> list[str]:
        """What to put before a command line to run it in `name`'s namespace."""
        return ["ip", "netns", "exec", self.names[name]]

    def spawn(self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `cmd` in `name`'s namespace (own session, output to `log`); `close()` stops it."""
        with open(log, "ab") as out:
            proc = subprocess.Popen([*self.prefix(name), *cmd], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10.0
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in self.names.values():  # the veth ends in them go too, and with them their peers
            _delete_ns(ns)
        for link in self.links:  # a root end whose peer somehow survived
            if link.a is ROOT:
                _ip("link", "del", link.dev_a, check=False)
        _open.discard(self)

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Inside the servers' own namespaces nothing else listens: fixed ports (not 4222 / 6379, so no
# log or URL of these runs is taken for the machine's own servers).
NATS_PORT, REDIS_PORT = 14222, 16379


class Servers:
    """Embedded NATS (JetStream) and Redis, each in a namespace of its own (`nats`, `redis`), each
    with a link to the root namespace (the harness: publisher, trainer side, analysis) and one to
    each worker's namespace (`w001`, `w002`, ...: the ids `WorkerFleet` gives in start order).
    The same command lines as `rlboost up` (rlboost/services.py), listening on every address of
    their namespace. `nats_url` / `redis_url`: from the root namespace; `worker_urls[i]`: worker
    i's; `worker_links[wid]`: its (NATS link, Redis link); `worker_prefix[i]`: its `ip netns exec`."""

    def __init__(self, root: Path, workers: int) -> None:
        from rlboost.config import ServicesSettings
        from rlboost.services import EmbeddedServices, _wait_ready

        self.dir = root
        self.topo = Topology()
        try:
            t = self.topo
            for name in ("nats", "redis", *(f"w{i + 1:03d}" for i in range(workers))):
                t.add(name)
            to_nats, to_redis = t.link(ROOT, "nats"), t.link(ROOT, "redis")
            self.nats_url = f"nats://{to_nats.addr_b}:{NATS_PORT}"
            self.redis_url = f"redis://{to_redis.addr_b}:{REDIS_PORT}/0"
            self.worker_links: dict[str, tuple[Link, Link]] = {}
            self.worker_urls: list[tuple[str, str]] = []
            self.worker_prefix: list[list[str]] = []
            for i in range(workers):
                wid = f"w{i + 1:03d}"
                n, r = t.link(wid, "nats"), t.link(wid, "redis")
                self.worker_links[wid] = (n, r)
                self.worker_urls.append((f"nats://{n.addr_b}:{NATS_PORT}", f"redis://{r.addr_b}:{REDIS_PORT}/0"))
                self.worker_prefix.append(t.prefix(wid))
            svc = EmbeddedServices(ServicesSettings(data_dir=str(root / "data"), bind="0.0.0.0"))
            svc.data_dir.mkdir(parents=True, exist_ok=True)
            deadline = time.monotonic() + 30.0
            nats = t.spawn("nats", svc._command("nats", NATS_PORT), svc.data_dir / "nats.log")
            redis = t.spawn("redis", svc._command("redis", REDIS_PORT), svc.data_dir / "redis.log")
            # ready as the harness sees them: over the root namespace's links
            _wait_ready(to_nats.addr_b, NATS_PORT, b"INFO", b"", deadline, nats, "nats-server",
                        svc.data_dir / "nats.log")
            _wait_ready(to_redis.addr_b, REDIS_PORT, b"PONG", b"PING\r\n", deadline, redis, "redis-server",
                        svc.data_dir / "redis.log")
        except BaseException:
            self.topo.close()
            raise

    def links(self) -> list[Link]:
        """Every worker's links (not the harness's)."""
        return [link for pair in self.worker_links.values() for link in pair]

    def close(self) -> None:
        self.topo.close()


@atexit.register
def _close_open() -> None:
    for t in list(_open):
        if t.pid == os.getpid():  # not in a forked child: the namespaces are its parent's
            with contextlib.suppress(Exception):
                t.close()
