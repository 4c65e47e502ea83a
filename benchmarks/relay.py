"""A fault relay of the project's own: a TCP proxy on loopback between a client (a worker) and a
server (NATS, Redis) that can add latency per direction, cut the link, or leave connections
half-open, under the control of the test or bench that started it.

Faults (each applies at once, to new and existing connections):
- `set_latency(up=, down=)`: every chunk is delivered `up` s (client -> server) or `down` s
  (server -> client) after it was read, in order: a slow link, a server that answers late;
- `cut()`: the listening socket is closed (new connections are refused) and every open
  connection is reset: a link that dropped while both ends stay up;
- `half_open(new_too=False)`: open connections stay open and are never answered again (what
  each side sends is read and dropped): a peer that vanished without a FIN or RST. With
  `new_too`, new connections are accepted and never answered either (a black hole);
- `restore()`: new connections are served normally again (a connection left half-open stays
  dead: its client has to notice and reconnect, as it would have to on a real network).

The relay runs its own event loop in a thread of the calling process, so a harness that blocks
(waiting for worker processes to exit) does not freeze the links of the workers it waits for.
Everything it opens, `close()` closes (it is a context manager).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

CHUNK = 1 << 16


@dataclass(eq=False)
class _Conn:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter | None = None
    dead: bool = False  # half-open: never forwards again
    tasks: list[asyncio.Task] = field(default_factory=list)

    def abort(self) -> None:
        for w in (self.client, self.server):
            if w is not None:
                with contextlib.suppress(Exception):
                    w.transport.abort()  # RST, not FIN: the link is gone
        for t in self.tasks:
            t.cancel()


class Relay:
    """A TCP relay from 127.0.0.1:<port> to `target` (host, port). Thread-safe controls."""

    def __init__(self, target_host: str, target_port: int, bind: str = "127.0.0.1", name: str = "relay") -> None:
        self.target = (target_host, target_port)
        self.bind = bind
        self.name = name
        self.port = 0
        self.mode = "up"  # up | cut | half_open | black_hole (half_open with new_too)
        self.latency = {"up": 0.0, "down": 0.0}
        self.accepted = 0
        self.bytes = {"up": 0, "down": 0}
        self._conns: set[_Conn] = set()
        self._handlers: set[asyncio.Task] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"relay-{name}", daemon=True)

    @classmethod
    def to_url(cls, url: str, name: str = "relay") -> Relay:
        """A relay to the server of `url` (`nats://` or `redis://`, one host), started."""
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 0, name=name).start()

    def url(self, url: str) -> str:
        """`url` with its host:port replaced by this relay's (credentials and path kept)."""
        parts = urlsplit(url)
        creds = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        return urlunsplit(parts._replace(netloc=f"{creds}{self.bind}:{self.port}"))

    # ---------------------------------------------------------------- controls (any thread)

    def start(self) -> Relay:
        self._thread.start()
        self._call(self._listen())
        return self

    def set_latency(self, up: float | None = None, down: float | None = None) -> None:
        """From the next chunk read on (returns once the relay's loop applied it)."""
        async def apply() -> None:
            if up is not None:
                self.latency["up"] = up
            if down is not None:
                self.latency["down"] = down
        self._call(apply())

    def cut(self) -> None:
        self._call(self._cut())

    def half_open(self, new_too: bool = False) -> None:
        self._call(self._half_open(new_too))

    def restore(self) -> None:
        self._call(self._restore())

    def open_connections(self) -> int:
        return self._call(self._count())

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown(), timeout=10.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---------------------------------------------------------------- the relay's loop

    async def _count(self) -> int:
        return sum(1 for c in self._conns if not c.dead)

    async def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.bind, self.port))  # port 0 the first time; the same port after a cut
        self.port = sock.getsockname()[1]
        self._server = await asyncio.start_server(self._handle, sock=sock, limit=CHUNK)

    async def _stop_listening(self) -> None:
        if self._server is not None:
            # close() shuts the listening socket at once (new connections are refused); not
            # wait_closed(), which waits for every connection to end (Python >= 3.12)
            self._server.close()
            self._server = None

    async def _cut(self) -> None:
        self.mode = "cut"
        await self._stop_listening()
        for c in list(self._conns):
            c.abort()
        self._conns.clear()

    async def _half_open(self, new_too: bool) -> None:
        self.mode = "black_hole" if new_too else "half_open"
        for c in self._conns:
            c.dead = True
        if self._server is None and new_too:
            await self._listen()

    async def _restore(self) -> None:
        self.mode = "up"
        if self._server is None:
            await self._listen()

    async def _shutdown(self) -> None:
        await self._stop_listening()
        for c in list(self._conns):
            c.abort()
        self._conns.clear()
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=5.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "cut":  # a connection accepted just before the cut
            writer.transport.abort()
            return
        self.accepted += 1
        conn = _Conn(client=writer, dead=self.mode == "black_hole")
        self._conns.add(conn)
        me = asyncio.current_task()
        self._handlers.add(me)  # type: ignore[arg-type]
        try:
            if conn.dead:
                await self._drain_dead(reader)
                return
            try:
                s_reader, s_writer = await asyncio.open_connection(*self.target, limit=CHUNK)
            except OSError:
                return  # the server is down itself: the client sees its connection closed
            conn.server = s_writer
            up = asyncio.create_task(self._pipe(conn, reader, s_writer, "up"))
            down = asyncio.create_task(self._pipe(conn, s_reader, writer, "down"))
            conn.tasks = [up, down]
            pending: set[asyncio.Task] = {up, down}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.cancelled() or t.exception() is not None for t in done):
                    break  # a reset on either side: the whole connection goes
                if up in done and conn.dead:
                    break  # the client gave up on a half-open connection; the server never hears of it
        except (asyncio.CancelledError, Exception):
            pass
        finally:
            self._conns.discard(conn)
            conn.abort()
            self._handlers.discard(me)  # type: ignore[arg-type]

    async def _drain_dead(self, reader: asyncio.StreamReader) -> None:
        """A half-open connection: read what the client sends and drop it, never answer."""
        while await reader.read(CHUNK):
            pass

    async def _pipe(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, way: str) -> None:
        """Copy one direction, each chunk delayed by the latency of its direction when it was read."""
        queue: deque[tuple[float, bytes]] = deque()
        ready = asyncio.Event()
        eof = False

        async def deliver() -> None:
            while True:
                while not queue:
                    if eof:
                        return
                    ready.clear()
                    await ready.wait()
                due, data = queue.popleft()
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                if conn.dead:
                    continue
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(CHUNK):
                if conn.dead:
                    continue
                self.bytes[way] += len(data)
                queue.append((time.monotonic() + self.latency[way], data))
                ready.set()
            eof = True
            ready.set()
            await sender
            if not conn.dead:  # a half-close travels on (a dead link carries no FIN)
                with contextlib.suppress(Exception):
                    writer.write_eof()
        finally:
            sender.cancel()
