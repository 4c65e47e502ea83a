"""Blob stores for weight shards and manifests: one small interface, several backends.

The weight store only needs five operations on immutable, named blobs — put, has, streamed
read, delete, list — so every backend (the embedded JetStream Object Store, a directory on
local disk or a shared mount, an S3-compatible bucket in `rlboost.weights.s3`) is a few dozen lines behind
`BlobStore`. Integrity is *not* the backend's job: the weight cache hashes every byte it
receives against the manifest, so a backend may be as dumb as a directory.

Errors are split in two on purpose: `ObjectMissing` (the store answered: no such blob — a
version was never published or was garbage-collected) is final; `StoreUnavailable` (the store
did not answer: connection lost, mount gone, timeout) is transient and callers retry it with
back-off.

The S3 backend (`rlboost.weights.s3.S3BlobStore`, optional extra `rlboost[s3]`) maps put →
PutObject (multipart above 64 MiB), has → HeadObject, read → a streamed GetObject body resumed
by ranged GETs, delete → DeleteObject, list → ListObjectsV2 with a prefix, and raises
`StoreUnavailable` on connection errors / 5xx.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import hashlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path

import nats.errors
from nats.js import JetStreamContext, api
from nats.js.errors import BadRequestError, NotFoundError

from rlboost.logs import get_logger
from rlboost.weights.errors import ObjectMissing, StoreUnavailable

log = get_logger(component="objstore")

Buffer = bytes | bytearray | memoryview


class BlobStore(abc.ABC):
    """Immutable named blobs. Keys are `[A-Za-z0-9._/-]+` paths such as `shards/<sha>.safetensors`."""

    location: str = "?"  # for messages and logs; never contains credentials

    @abc.abstractmethod
    async def put(self, key: str, data: Buffer) -> None:
        """Store `data` under `key`, atomically: a reader sees all of it or nothing."""

    @abc.abstractmethod
    async def has(self, key: str) -> bool: ...

    @abc.abstractmethod
    def read(self, key: str) -> AsyncIterator[Buffer]:
        """Stream the blob's bytes in order (chunks of any size). Raises ObjectMissing."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove the blob; a missing blob is not an error."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Keys starting with `prefix`, sorted."""

    async def read_all(self, key: str) -> bytes:
        """Small blobs (manifests)."""
        return b"".join([bytes(c) async for c in self.read(key)])

    async def close(self) -> None:
        return None


# ---------------------------------------------------------------- filesystem


class FileBlobStore(BlobStore):
    """A directory: local disk, or a shared mount (NFS, a CSI volume) all workers see.

    The root must exist (the publisher creates it with `create=True`): a missing root means a
    mount that is not there, which is `StoreUnavailable`, not an empty store.
    """

    READ_CHUNK = 8 << 20

    def __init__(self, root: str | os.PathLike[str], create: bool = False) -> None:
        self.root = Path(root)
        self.location = f"file://{self.root}"
        if create:
            self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid blob key {key!r}")
        return self.root / key

    def _check_root(self) -> None:
        if not self.root.is_dir():
            raise StoreUnavailable(f"weight store {self.location} is not reachable (directory missing)")

    async def put(self, key: str, data: Buffer) -> None:
        self._check_root()
        await asyncio.to_thread(self._put_sync, self._path(key), data)

    @staticmethod
    def _put_sync(path: Path, data: Buffer) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())  # a shared mount must not expose a half-written shard
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    async def has(self, key: str) -> bool:
        self._check_root()
        return self._path(key).is_file()

    async def read(self, key: str) -> AsyncIterator[Buffer]:
        self._check_root()
        try:
            f = open(self._path(key), "rb")  # noqa: SIM115 - closed below, across awaits
        except FileNotFoundError:
            raise ObjectMissing(f"{key} not in {self.location}") from None
        except OSError as e:
            raise StoreUnavailable(f"weight store {self.location}: {e}") from e
        try:
            while True:
                try:
                    chunk = await asyncio.to_thread(f.read, self.READ_CHUNK)
                except OSError as e:
                    raise StoreUnavailable(f"weight store {self.location}: reading {key}: {e}") from e
                if not chunk:
                    return
                yield chunk
        finally:
            f.close()

    async def delete(self, key: str) -> None:
        self._check_root()
        self._path(key).unlink(missing_ok=True)

    async def list(self, prefix: str = "") -> list[str]:
        self._check_root()
        out = []
        for p in self.root.rglob("*"):
            if p.is_file() and not p.name.startswith("."):
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


# ---------------------------------------------------------------- JetStream Object Store

async def _acked(pending: list[asyncio.Future], timeout_s: float = 10.0) -> None:
    """Wait for publish acks, boundedly: nats-py's futures never time out on their own (an ack
    lost to a server restart would hang the upload). Unanswered ones are cancelled and the put
    fails as transient (the caller retries it whole: chunks go to a fresh subject)."""
    if not pending:
        return
    done, late = await asyncio.wait(pending, timeout=timeout_s)
    for f in late:
        f.cancel()
    if late:
        raise nats.errors.TimeoutError
    for f in done:
        f.result()


_TRANSIENT = (
    nats.errors.ConnectionClosedError,
    nats.errors.NoServersError,
    nats.errors.TimeoutError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.NoRespondersError,
    asyncio.TimeoutError,
    ConnectionError,
    OSError,
)


class JetStreamBlobStore(BlobStore):
    """The embedded default: a JetStream Object Store bucket, no extra server to run.

    The layout is the standard one (stream `OBJ_<bucket>`, chunks on `$O.<bucket>.C.<nuid>`,
    JSON meta on `$O.<bucket>.M.<base64 name>`), so `nats object get` and other clients read
    what we write. Reads do not use nats-py's `ObjectStore.get()`, which grows a bytes object
    by concatenation (quadratic) or hops to a thread per chunk with `writeinto`: we create an
    ephemeral pull consumer on the object's chunk subject and keep a window of chunk requests
    in flight (bounded across concurrent reads, see MAX_INFLIGHT), yielding each 1 MiB chunk as
    it arrives (measured several times faster).
    Writes pipeline the chunk publishes (a bounded window of un-acked publishes) instead of
    waiting for each ack.
    """

    WINDOW = 32  # un-acked chunk publishes per write
    # Reads: chunks requested and not yet received, across all concurrent reads of this store.
    # The server buffers at most max_pending (64 MiB) per client connection and silently drops
    # deliveries beyond it (a slow consumer), so the total must stay well below that.
    MAX_INFLIGHT = 24
    BATCH = 8  # chunks per pull request
    READ_TIMEOUT_S = 15.0  # no chunk for this long: the server is gone or stuck

    def __init__(self, js: JetStreamContext, bucket: str, chunk_size: int = 1 << 20) -> None:
        self.js = js
        self.nc = js._nc  # the connection behind the context: raw pull requests and inboxes
        self.bucket = bucket
        self.stream = f"OBJ_{bucket}"
        # A chunk must fit the server's max_payload (1 MiB by default).
        self.chunk_size = max(1024, min(chunk_size, self.nc.max_payload or chunk_size))
        self.location = f"nats object store {bucket}"
        self._credits = asyncio.Semaphore(self.MAX_INFLIGHT)

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, create: bool = True, replicas: int = 1,
                   **kwargs) -> JetStreamBlobStore:
        """Find the bucket, or create it (file storage, unlimited size) if `create`."""
        try:
            await js.stream_info(f"OBJ_{bucket}")
        except NotFoundError:
            if not create:
                raise ObjectMissing(f"object store bucket {bucket} does not exist") from None
            try:
                await js.create_object_store(bucket, storage=api.StorageType.FILE, replicas=replicas,
                                             description="rlboost weight shards and manifests")
            except BadRequestError:
                pass  # a concurrent creator won
        except _TRANSIENT as e:
            raise StoreUnavailable(f"nats object store {bucket}: {e!r}") from e
        return cls(js, bucket, **kwargs)

    def _meta_subject(self, key: str) -> str:
        return f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(key.encode()).decode()}"

    def _chunk_subject(self, nuid: str) -> str:
        return f"$O.{self.bucket}.C.{nuid}"

    async def _info(self, key: str) -> api.ObjectInfo | None:
        try:
            msg = await self.js.get_last_msg(self.stream, self._meta_subject(key))
        except NotFoundError:
            return None
        except _TRANSIENT as e:
            raise StoreUnavailable(f"{self.location}: {e!r}") from e
        info = api.ObjectInfo.from_response(json.loads(msg.data))
        return None if info.deleted else info

    async def has(self, key: str) -> bool:
        return await self._info(key) is not None

    async def put(self, key: str, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        nuid = self.nc._nuid.next().decode()
        subject = self._chunk_subject(nuid)
        old = await self._info(key)
        digest = hashlib.sha256(view).digest()
        chunks = 0
        try:
            pending: list[asyncio.Future] = []
            for off in range(0, len(view), self.chunk_size):
                pending.append(await self.js.publish_async(subject, bytes(view[off:off + self.chunk_size])))
                chunks += 1
                if len(pending) >= self.WINDOW:
                    await _acked(pending)
                    pending = []
            await _acked(pending)
            info = api.ObjectInfo(
                name=key, bucket=self.bucket, nuid=nuid, size=len(view), chunks=chunks,
                digest="SHA-256=" + base64.urlsafe_b64encode(digest).decode(),
                mtime=datetime.now(timezone.utc).isoformat(),
                options=api.ObjectMetaOptions(max_chunk_size=self.chunk_size),
            )
            # The meta message is what makes the object visible, so it goes last (atomic put).
            await self.js.publish(self._meta_subject(key), json.dumps(info.as_dict()).encode(),
                                  headers={api.Header.ROLLUP: "sub"})
        except _TRANSIENT as e:
            await self._purge_quietly(subject)
            raise StoreUnavailable(f"{self.location}: writing {key}: {e!r}") from e
        except BaseException:
            await self._purge_quietly(subject)
            raise
        if old is not None and old.nuid != nuid:
            await self._purge_quietly(self._chunk_subject(old.nuid))

    async def _purge_quietly(self, subject: str) -> None:
        try:
            await self.js.purge_stream(self.stream, subject=subject)
        except Exception as e:  # best effort: orphan chunks only cost space
            log.warning("purge failed", subject=subject, error=repr(e))

    async def read(self, key: str) -> AsyncIterator[Buffer]:
        info = await self._info(key)
        if info is None:
            raise ObjectMissing(f"{key} not in {self.location}")
        total = info.chunks or 0
        if not info.size:
            return
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, pending_msgs_limit=4 * self.MAX_INFLIGHT,
                                      pending_bytes_limit=4 * self.MAX_INFLIGHT * (self.chunk_size + 4096))
        consumer = None
        held = 0  # credits taken for chunks requested and not yet received
        try:
            try:
                consumer = await self.js.add_consumer(self.stream, api.ConsumerConfig(
                    filter_subject=self._chunk_subject(info.nuid), ack_policy=api.AckPolicy.NONE,
                    deliver_policy=api.DeliverPolicy.ALL, mem_storage=True, inactive_threshold=60.0,
                    max_waiting=8, num_replicas=1))
            except _TRANSIENT as e:
                raise StoreUnavailable(f"{self.location}: reading {key}: {e!r}") from e
            next_api = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{consumer.name}"
            expires_ns = int(self.READ_TIMEOUT_S * 1e9)
            requested = received = 0
            while received < total:
                if requested - received <= self.BATCH // 2 and requested < total:
                    # Take credits one by one (never starve while holding some), then ask.
                    n = 0
                    want = min(self.BATCH, total - requested)
                    while n < want and (n == 0 or not self._credits.locked()):
                        await self._credits.acquire()
                        n += 1
                    held += n
                    await self.nc.publish(next_api, json.dumps({"batch": n, "expires": expires_ns}).encode(),
                                          reply=inbox)
                    requested += n
                try:
                    msg = await sub.next_msg(timeout=self.READ_TIMEOUT_S)
                except nats.errors.TimeoutError:
                    raise StoreUnavailable(f"{self.location}: reading {key}: no data for "
                                           f"{self.READ_TIMEOUT_S:.0f}s ({received}/{total} chunks)") from None
                status = msg.headers.get(api.Header.STATUS) if msg.headers else None
                if status == "100":  # idle heartbeat
                    continue
                if status == "408":  # a pull request expired: give back its credits, ask again
                    self._release(requested - received)
                    held -= requested - received
                    requested = received
                    continue
                if status:
                    raise StoreUnavailable(f"{self.location}: reading {key}: status {status} "
                                           f"{msg.headers.get(api.Header.DESCRIPTION, '')}")
                received += 1
                held -= 1
                self._credits.release()
                # The consumer sequence in the ack subject counts deliveries: a gap means the
                # server dropped chunks for this connection (slow consumer).
                if msg.reply and msg.metadata.sequence.consumer != received:
                    raise StoreUnavailable(f"{self.location}: reading {key}: chunk {received} lost in transit")
                yield msg.data
        except _TRANSIENT as e:
            raise StoreUnavailable(f"{self.location}: reading {key}: {e!r}") from e
        finally:
            self._release(held)
            try:
                await sub.unsubscribe()
            except Exception:
                pass
            if consumer is not None:
                try:  # fire and forget: no round trip per shard (inactive_threshold is the backstop)
                    await self.nc.publish(f"$JS.API.CONSUMER.DELETE.{self.stream}.{consumer.name}", b"")
                except Exception:
                    pass

    def _release(self, n: int) -> None:
        for _ in range(max(0, n)):
            self._credits.release()

    async def delete(self, key: str) -> None:
        info = await self._info(key)
        if info is None:
            return
        try:
            # Purge both subjects outright: no tombstones pile up as GC deletes old shards.
            await self.js.purge_stream(self.stream, subject=self._chunk_subject(info.nuid))
            await self.js.purge_stream(self.stream, subject=self._meta_subject(key))
        except _TRANSIENT as e:
            raise StoreUnavailable(f"{self.location}: deleting {key}: {e!r}") from e

    async def list(self, prefix: str = "") -> list[str]:
        """Walk the last meta message of every object with an ordered consumer."""
        keys: list[str] = []
        try:
            try:
                await self.js.get_last_msg(self.stream, f"$O.{self.bucket}.M.>")
            except NotFoundError:
                return []
            sub = await self.js.subscribe(f"$O.{self.bucket}.M.>", ordered_consumer=True,
                                          deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT)
            try:
                while True:
                    msg = await sub.next_msg(timeout=5.0)
                    info = api.ObjectInfo.from_response(json.loads(msg.data))
                    if not info.deleted and info.name.startswith(prefix):
                        keys.append(info.name)
                    if msg.metadata.num_pending == 0:
                        break
            finally:
                await sub.unsubscribe()
        except _TRANSIENT as e:
            raise StoreUnavailable(f"{self.location}: listing: {e!r}") from e
        return sorted(keys)
