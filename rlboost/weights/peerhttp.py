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
constant time) every request must carry it, and a non-loopback address needs one. HTTP is
aiohttp's, server and client (as under rlboost/endpoint/); one request per connection (a blob
is megabytes to gigabytes: a handshake is noise next to it), its body streamed from the open
file in 1 MiB chunks, never read whole.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from rlboost.logs import get_logger
from rlboost.weights.errors import StoreError
from rlboost.webserver import loopback, start_app

if TYPE_CHECKING:
    from rlboost.weights.disk import VerifiedFiles

log = get_logger(component="peers")

__all__ = ["PeerServer", "PeerError", "PeerBusy", "read_blob", "read_version_file", "BLOB_ROUTE", "VERSION_ROUTE",
           "loopback"]

BLOB_ROUTE = "/blob/"
VERSION_ROUTE = "/version/"
_VERSION_FILE = re.compile(r"([0-9a-f]{64})/([0-9]{1,6})")
_RANGE = re.compile(r"bytes=([0-9]{1,15})-([0-9]{1,15})")
_SHA = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 20
IDLE_TIMEOUT_S = 10.0  # a client that reads nothing for this long is dropped (and a peer that sends nothing)


class PeerError(StoreError):
    """A peer did not hand over a blob (refused, missing, unreachable, cut mid-body): the puller
    tries the next source. Never a reason to fail a pull on its own."""


class PeerBusy(PeerError):
    """The peer is at its concurrency bound (503): try another holder, or this one later."""


class PeerServer:
    """Serves `cache`'s verified blobs over HTTP. `start()` returns the URL to advertise."""

    def __init__(self, cache: VerifiedFiles, *, host: str = "127.0.0.1", port: int = 0, token: str = "",
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
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        # one route for every method and path: the token is checked before anything else, and the
        # target is read as sent (`raw_path`), never normalised: `/blob/../x` is refused, not resolved
        app.router.add_route("*", "/{target:.*}", self._answer)
        self._runner, (_, port) = await start_app(app, self.host, self.port, shutdown_timeout=1.0)
        host = self.advertise_host
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        log.info("peer server up", url=self.url, bound=self.host, auth=bool(self.token), max_serving=self.max_serving)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        # the credential first: an unauthenticated client learns nothing, not even what is held
        if self.token and not hmac.compare_digest(request.headers.get("authorization", "").encode(),
                                                  f"Bearer {self.token}".encode()):
            return _text(401, "missing or wrong bearer token\n")
        if request.method != "GET":
            return _text(405, "GET only\n")
        target = request.raw_path
        if target.startswith(BLOB_ROUTE):
            sha = target[len(BLOB_ROUTE):]
            if not _SHA.fullmatch(sha):
                return _text(400, "a blob is named by its SHA-256: 64 lower-case hex digits\n")
            opener = lambda: self.cache.open_verified(sha)  # noqa: E731
        elif target.startswith(VERSION_ROUTE):
            m = _VERSION_FILE.fullmatch(target[len(VERSION_ROUTE):])
            if m is None:
                return _text(400, "a version file is <manifest digest>/<index>\n")
            opener = lambda: self.cache.open_version_file(m[1], int(m[2]))  # noqa: E731
        else:
            return _text(404, "no such route\n")
        if self.serving >= self.max_serving:
            self.busy_refusals += 1
            return _text(503, "busy\n")
        f = opener()
        if f is None:
            return _text(404, "not held here\n")
        self.serving += 1
        try:
            return await self._send_file(request, f)
        finally:
            self.serving -= 1
            f.close()

    async def _send_file(self, request: web.Request, f) -> web.StreamResponse:
        size, status = os.fstat(f.fileno()).st_size, 200
        if "range" in request.headers:  # one range, first-last inclusive (a late joiner's piece of a version file)
            m = _RANGE.fullmatch(request.headers["range"].strip())
            if m is None or not int(m[1]) <= int(m[2]) < size:
                return _text(416, "one range within the file: bytes=first-last\n")
            await asyncio.to_thread(f.seek, int(m[1]))
            size, status = int(m[2]) + 1 - int(m[1]), 206
        resp = web.StreamResponse(status=status, headers={"content-type": "application/octet-stream"})
        resp.content_length = size
        resp.force_close()
        await resp.prepare(request)
        sent = 0
        try:
            while sent < size:
                chunk = await asyncio.to_thread(f.read, min(CHUNK, size - sent))
                if not chunk:  # cannot happen to an unlinked-but-open file; a truncated one is cut short
                    return resp
                await asyncio.wait_for(resp.write(chunk), IDLE_TIMEOUT_S)
                sent += len(chunk)
            await asyncio.wait_for(resp.write_eof(), IDLE_TIMEOUT_S)
        except (TimeoutError, ConnectionError):  # a client that stopped reading, or went away: drop it
            if request.transport is not None:
                request.transport.abort()
            return resp
        self.served_blobs += 1
        self.served_bytes += sent
        return resp


def _text(status: int, body: str) -> web.Response:
    resp = web.Response(status=status, text=body)
    resp.force_close()
    return resp


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
    headers = dict(extra)
    if token:
        headers["authorization"] = f"Bearer {token}"
    # a session per read, its connection closed after it: one request per connection, as served;
    # the body as sent (no decompression: bytes are checked against the manifest, not unpacked)
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s, sock_read=read_timeout_s)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout,
                                         auto_decompress=False) as session:
            try:
                resp = await session.get(url.rstrip("/") + target, headers=headers, allow_redirects=False)
            except (OSError, TimeoutError, aiohttp.ClientError) as e:
                raise PeerError(f"peer {url}: no answer: {e!r}") from None
            async with resp:
                if resp.status == 503:
                    raise PeerBusy(f"peer {url} is busy")
                if resp.status != (206 if extra else 200):
                    raise PeerError(f"peer {url}: {what}: HTTP {resp.status}")
                async for chunk in resp.content.iter_chunked(CHUNK):
                    yield chunk
    except (OSError, TimeoutError, aiohttp.ClientError) as e:  # refused mid-way, stalled, cut short
        raise PeerError(f"peer {url}: {what}: {e!r}") from None
