"""Peers' HTTP: a worker serves the blobs its weight cache holds verified, another one reads them.

Two routes. `GET /blob/<sha256>`, content-addressed: the name is the SHA-256 of the bytes, 64
lower-case hex characters (anything else is refused before a path is built), and the file is
served only if the cache hashed it itself and it has not changed since (`WeightCache.open_verified`:
same inode, size and mtime). `GET /version/<manifest digest>/<i>`: file i of a version the cache
rebuilt from deltas and checked in this process (`WeightCache.open_version_file`), whose bytes
follow from the manifest. The receiver checks every byte against its manifest anyway, so a
serving bug or a lying peer costs a retry elsewhere, never a wrong weight.

Bounded: at most `max_serving` bodies go out at once, a request past that is answered 503 at
once (the puller tries another holder, or this one a little later). Bound to the configured
address (loopback by default); with a token (`Authorization: Bearer <token>`, compared in
constant time) every request must carry it, and a non-loopback address needs one. HTTP/1.1 is
parsed by h11 (as in rlboost/endpoint.py); one request per connection (a blob is megabytes to
gigabytes: a handshake is noise next to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import h11

from rlboost.logs import get_logger
from rlboost.weights.errors import StoreError

if TYPE_CHECKING:
    from rlboost.weights.cache import WeightCache

log = get_logger(component="peers")

__all__ = ["PeerServer", "PeerError", "PeerBusy", "read_blob", "read_version_file", "BLOB_ROUTE", "VERSION_ROUTE"]

BLOB_ROUTE = "/blob/"
VERSION_ROUTE = "/version/"
_VERSION_FILE = re.compile(r"([0-9a-f]{64})/([0-9]{1,6})")
_RANGE = re.compile(r"bytes=([0-9]{1,15})-([0-9]{1,15})")
_SHA = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 20
MAX_HEADER_BYTES = 16 << 10
IDLE_TIMEOUT_S = 10.0  # a client that sends nothing (or reads nothing) for this long is dropped


class PeerError(StoreError):
    """A peer did not hand over a blob (refused, missing, unreachable, cut mid-body): the puller
    tries the next source. Never a reason to fail a pull on its own."""


class PeerBusy(PeerError):
    """The peer is at its concurrency bound (503): try another holder, or this one later."""


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PeerServer:
    """Serves `cache`'s verified blobs over HTTP. `start()` returns the URL to advertise."""

    def __init__(self, cache: WeightCache, *, host: str = "127.0.0.1", port: int = 0, token: str = "",
                 max_serving: int = 4, advertise_host: str = "") -> None:
        if not token and not loopback(host):
            raise StoreError(f"weights.peer_host {host!r} is not a loopback address: set a peer token first "
                             f"(an open peer server hands the model's weights to anyone who asks)")
        self.cache = cache
        self.host, self.port, self.token = host, port, token
        self.max_serving = max(1, max_serving)
        self.advertise_host = advertise_host or host
        self.url = ""
        self.serving = 0  # bodies going out now
        self.served_blobs = self.served_bytes = self.busy_refusals = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        host = self.advertise_host
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info("peer server up", url=self.url, bound=self.host, auth=bool(self.token), max_serving=self.max_serving)
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        try:
            event = await _next(conn, reader)
            if isinstance(event, h11.Request):
                await self._answer(conn, writer, event)
        except h11.RemoteProtocolError:
            if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                with contextlib.suppress(Exception):
                    await _send(conn, writer, 400, b"malformed HTTP\n")
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away (or we are closing): nothing to answer
        except Exception as e:  # never the server: one connection ends
            log.error("peer connection failed", error=f"{type(e).__name__}: {e}")
        finally:
            if task is not None:
                self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2.0)

    async def _answer(self, conn: h11.Connection, writer: asyncio.StreamWriter, req: h11.Request) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in req.headers}
        # the credential first: an unauthenticated client learns nothing, not even what is held
        if self.token and not hmac.compare_digest(headers.get("authorization", "").encode(),
                                                  f"Bearer {self.token}".encode()):
            return await _send(conn, writer, 401, b"missing or wrong bearer token\n")
        if req.method != b"GET":
            return await _send(conn, writer, 405, b"GET only\n")
        target = req.target.decode("latin-1")
        if target.startswith(BLOB_ROUTE):
            sha = target[len(BLOB_ROUTE):]
            if not _SHA.fullmatch(sha):
                return await _send(conn, writer, 400, b"a blob is named by its SHA-256: 64 lower-case hex digits\n")
            opener = lambda: self.cache.open_verified(sha)  # noqa: E731
        elif target.startswith(VERSION_ROUTE):
            m = _VERSION_FILE.fullmatch(target[len(VERSION_ROUTE):])
            if m is None:
                return await _send(conn, writer, 400, b"a version file is <manifest digest>/<index>\n")
            opener = lambda: self.cache.open_version_file(m[1], int(m[2]))  # noqa: E731
        else:
            return await _send(conn, writer, 404, b"no such route\n")
        if self.serving >= self.max_serving:
            self.busy_refusals += 1
            return await _send(conn, writer, 503, b"busy\n")
        f = opener()
        if f is None:
            return await _send(conn, writer, 404, b"not held here\n")
        self.serving += 1
        try:
            size, status = _size(f), 200
            if "range" in headers:  # one range, first-last inclusive (a late joiner's piece of a version file)
                m = _RANGE.fullmatch(headers["range"].strip())
                if m is None or not int(m[1]) <= int(m[2]) < size:
                    return await _send(conn, writer, 416, b"one range within the file: bytes=first-last\n")
                await asyncio.to_thread(f.seek, int(m[1]))
                size, status = int(m[2]) + 1 - int(m[1]), 206
            writer.write(conn.send(h11.Response(status_code=status, headers=[
                ("content-type", "application/octet-stream"), ("content-length", str(size)),
                ("connection", "close")])))
            sent = 0
            while sent < size:
                chunk = await asyncio.to_thread(f.read, min(CHUNK, size - sent))
                if not chunk:  # cannot happen to an unlinked-but-open file; a truncated one is cut short
                    return
                writer.write(conn.send(h11.Data(data=chunk)))
                sent += len(chunk)
                await asyncio.wait_for(writer.drain(), IDLE_TIMEOUT_S)
            writer.write(conn.send(h11.EndOfMessage()))
            await asyncio.wait_for(writer.drain(), IDLE_TIMEOUT_S)
            self.served_blobs += 1
            self.served_bytes += sent
        finally:
            self.serving -= 1
            f.close()


def _size(f) -> int:
    import os

    return os.fstat(f.fileno()).st_size


async def _next(conn: h11.Connection, reader: asyncio.StreamReader):
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await asyncio.wait_for(reader.read(65536), IDLE_TIMEOUT_S))


async def _send(conn: h11.Connection, writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    out = conn.send(h11.Response(status_code=status, headers=[
        ("content-type", "text/plain"), ("content-length", str(len(body))), ("connection", "close")]))
    out += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
    writer.write(out)
    await writer.drain()


def read_blob(url: str, sha: str, *, token: str = "", connect_timeout_s: float = 2.0,
              read_timeout_s: float = IDLE_TIMEOUT_S) -> AsyncIterator[bytes]:
    """Stream blob `sha` from the peer at `url`. Raises PeerBusy (503) or PeerError (anything
    else that is not the whole body: refused, 404, unreachable, stalled, cut). The bytes are
    unverified: the caller hashes them against its manifest."""
    if not _SHA.fullmatch(sha):
        raise ValueError(f"invalid blob name {sha!r}")
    return _get(url, BLOB_ROUTE + sha, f"blob {sha[:12]}", token, connect_timeout_s, read_timeout_s)


def read_version_file(url: str, digest: str, index: int, start: int, stop: int, *, token: str = "",
                      connect_timeout_s: float = 2.0, read_timeout_s: float = IDLE_TIMEOUT_S) -> AsyncIterator[bytes]:
    """Stream bytes [start, stop) of file `index` of the version whose manifest digest is `digest`
    from the peer at `url`; as `read_blob` (unverified bytes, PeerBusy / PeerError)."""
    name = f"{digest}/{index}"
    if not _VERSION_FILE.fullmatch(name) or not 0 <= start < stop:
        raise ValueError(f"invalid version file {name!r} [{start}, {stop})")
    return _get(url, VERSION_ROUTE + name, f"version {digest[:12]} file {index}", token, connect_timeout_s,
                read_timeout_s, ("range", f"bytes={start}-{stop - 1}"))


async def _get(url: str, target: str, what: str, token: str, connect_timeout_s: float,
               read_timeout_s: float, *extra: tuple[str, str]) -> AsyncIterator[bytes]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise PeerError(f"peer URL {url!r} is not http://host:port")
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), connect_timeout_s)
    except (OSError, TimeoutError) as e:
        raise PeerError(f"peer {url}: cannot connect: {e!r}") from None
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
    try:
        headers = [("host", parts.netloc), ("connection", "close"), *extra]
        if token:
            headers.append(("authorization", f"Bearer {token}"))
        writer.write(conn.send(h11.Request(method="GET", target=target, headers=headers)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        event = await _client_next(conn, reader, read_timeout_s)
        if not isinstance(event, h11.Response):
            raise PeerError(f"peer {url}: no response")
        if event.status_code == 503:
            raise PeerBusy(f"peer {url} is busy")
        if event.status_code != (206 if extra else 200):
            raise PeerError(f"peer {url}: {what}: HTTP {event.status_code}")
        while True:
            event = await _client_next(conn, reader, read_timeout_s)
            if isinstance(event, h11.Data):
                yield event.data
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise PeerError(f"peer {url}: {what}: unexpected {type(event).__name__}")
    except (OSError, TimeoutError, h11.ProtocolError) as e:  # refused mid-way, stalled, cut short
        raise PeerError(f"peer {url}: {what}: {e!r}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)


async def _client_next(conn: h11.Connection, reader: asyncio.StreamReader, timeout_s: float):
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await asyncio.wait_for(reader.read(CHUNK), timeout_s))
