"""`rlboost up/status/down` as a user runs them: real processes, nothing left behind."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys

import pytest
import redis

from rlboost.checkpoint import CheckpointStore
from rlboost.config import ServicesSettings
from rlboost.services import EmbeddedServices, ServiceError, find_binary, resolve_urls


def _cli(data_dir, *args, env_extra=None):
    env = {**os.environ, "RLBOOST_DATA_DIR": str(data_dir), **(env_extra or {})}
    env.pop("RLBOOST_NATS_URL", None)
    env.pop("RLBOOST_REDIS_URL", None)
    return subprocess.run([sys.executable, "-m", "rlboost.cli", *args], capture_output=True, text=True, env=env,
                          timeout=60)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_up_status_down_leaves_no_server_running(tmp_path):
    up = _cli(tmp_path, "up")
    assert up.returncode == 0, up.stderr
    state = json.loads((tmp_path / "services.json").read_text())
    pids = [state["nats_pid"], state["redis_pid"]]
    assert all(_pid_alive(p) for p in pids)
    again = _cli(tmp_path, "up")
    assert "already running" in again.stdout
    status = _cli(tmp_path, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["embedded"]["nats_pid"] == state["nats_pid"]
    down = _cli(tmp_path, "down")
    assert down.returncode == 0 and "stopped 2" in down.stdout
    assert not any(_pid_alive(p) for p in pids)
    assert not (tmp_path / "services.json").exists()
    assert _cli(tmp_path, "status").returncode == 1


def test_up_redis_cluster_serves_keys_on_every_master_and_down_stops_them_all(tmp_path):
    up = _cli(tmp_path, "up", "--redis-cluster", "3")
    assert up.returncode == 0, up.stderr
    state = json.loads((tmp_path / "services.json").read_text())
    masters = [state["redis_port"], *(port for port, _ in state["redis_masters"])]
    pids = [state["nats_pid"], state["redis_pid"], *(pid for _, pid in state["redis_masters"])]
    assert len(set(masters)) == 3 and all(_pid_alive(p) for p in pids)
    url = f"redis+cluster://{','.join(f'127.0.0.1:{p}' for p in masters)}/0"
    assert url in up.stdout

    async def every_master_holds_checkpoints():
        store = CheckpointStore(url)
        try:
            for i in range(12):
                c = await store.claim(f"up-cluster-s1-p{i}", "w", 0, ttl_s=5)
                await store.append(f"up-cluster-s1-p{i}", "w", c.epoch, 0, [i], [0.0], ttl_s=5)
        finally:
            await store.close()

    asyncio.run(every_master_holds_checkpoints())
    sizes = [redis.Redis(port=p).dbsize() for p in masters]
    assert sum(sizes) == 12 * 4 and all(sizes)  # (meta, lease, history, tokens) per request, on 3 masters
    down = _cli(tmp_path, "down")
    assert down.returncode == 0 and "stopped 4" in down.stdout
    assert not any(_pid_alive(p) for p in pids)


def test_the_embedded_redis_cluster_refuses_to_start_with_passwords(tmp_path):
    svc = EmbeddedServices(ServicesSettings(data_dir=str(tmp_path), redis_cluster=3, redis_password="x"))
    with pytest.raises(ServiceError, match="without Redis passwords"):
        svc.up()


def test_up_works_when_the_standard_ports_are_taken(tmp_path):
    """Other servers may hold 4222/6379: ours go on free ports and are recorded."""
    held = []
    for port in (4222, 6379):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
        except OSError:
            s.close()  # someone else's server holds it already: the point stands
    try:
        svc = EmbeddedServices(ServicesSettings(data_dir=str(tmp_path)))
        st, started = svc.up()
        assert started and st.nats_port not in (4222,) and st.redis_port != 6379
        nats_url, redis_url = resolve_urls(svc.settings)
        assert str(st.nats_port) in nats_url and str(st.redis_port) in redis_url
    finally:
        svc.stop_recorded()
        for s in held:
            s.close()


def test_external_urls_win_over_embedded(tmp_path):
    s = ServicesSettings(data_dir=str(tmp_path), nats_url="nats://example:1", redis_url="redis://example:2/0")
    assert resolve_urls(s) == ("nats://example:1", "redis://example:2/0")


def test_no_servers_is_a_clear_error(tmp_path):
    with pytest.raises(ServiceError, match="rlboost up"):
        resolve_urls(ServicesSettings(data_dir=str(tmp_path)))


def test_missing_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(ServiceError, match="not found"):
        find_binary("no-such-server")
