"""The fault relay (benchmarks/relay.py) on its own: forwarding, latency per direction, cut,
half-open and restore, against an echo server of this test."""

from __future__ import annotations

import socket
import socketserver
import threading
import time

import pytest
import redis

from rlboost.benchmarks.relay import Relay


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


@pytest.fixture
def echo():
    socketserver.ThreadingTCPServer.allow_reuse_address = True
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()
    t.join()


@pytest.fixture
def relay(echo):
    with Relay("127.0.0.1", echo).start() as r:
        yield r


def _conn(relay: Relay, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", relay.port), timeout=timeout)


def _roundtrip(s: socket.socket, data: bytes = b"ping") -> bytes:
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_it_forwards_both_ways_and_delays_each_direction(relay):
    with _conn(relay) as s:
        t0 = time.monotonic()
        assert _roundtrip(s, b"x" * 200_000) == b"x" * 200_000
        fast = time.monotonic() - t0
        relay.set_latency(up=0.2, down=0.1)
        t0 = time.monotonic()
        assert _roundtrip(s) == b"ping"
        slow = time.monotonic() - t0
    assert slow >= 0.3 > fast
    assert relay.bytes["up"] >= 200_004 and relay.bytes["down"] >= 200_004


def test_a_cut_resets_open_connections_refuses_new_ones_and_restore_serves_again(relay):
    s = _conn(relay)
    assert _roundtrip(s) == b"ping"
    port = relay.port
    relay.cut()
    with pytest.raises(OSError):  # reset, or EOF then a write into a closed connection
        if _roundtrip(s) != b"ping":
            raise ConnectionResetError("closed")
    s.close()
    with pytest.raises(ConnectionRefusedError):
        _conn(relay)
    relay.restore()
    assert relay.port == port
    with _conn(relay) as s2:
        assert _roundtrip(s2) == b"ping"


def test_half_open_connections_never_answer_while_new_ones_work(relay):
    old = _conn(relay, timeout=0.3)
    assert _roundtrip(old) == b"ping"
    relay.half_open()
    old.sendall(b"ping")  # accepted by the relay, never forwarded
    with pytest.raises(TimeoutError):
        old.recv(10)
    with _conn(relay) as fresh:
        assert _roundtrip(fresh) == b"ping"
    relay.half_open(new_too=True)
    with _conn(relay, timeout=0.3) as hole:  # the connect succeeds...
        hole.sendall(b"ping")
        with pytest.raises(TimeoutError):  # ...and nothing ever comes back
            hole.recv(10)
    relay.restore()
    with _conn(relay) as again:
        assert _roundtrip(again) == b"ping"
    with pytest.raises(TimeoutError):  # a dead connection stays dead
        old.recv(10)
    old.close()


def test_close_stops_the_relay_and_every_connection(echo):
    r = Relay("127.0.0.1", echo).start()
    s = _conn(r)
    assert _roundtrip(s) == b"ping"
    r.close()
    assert not r._thread.is_alive()
    s.settimeout(2.0)
    assert s.recv(10) == b""  # reset or closed: nothing more
    s.close()
    with pytest.raises(ConnectionRefusedError):
        _conn(r)


def test_a_redis_client_through_the_relay_fails_fast_on_a_cut_and_recovers(redis_url):
    with Relay.to_url(redis_url) as r:
        client = redis.Redis.from_url(r.url(redis_url), socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            assert client.ping()
            r.cut()
            with pytest.raises(redis.ConnectionError):
                client.ping()
            r.restore()
            assert client.ping()  # a new connection through the restored link
        finally:
            client.close()
