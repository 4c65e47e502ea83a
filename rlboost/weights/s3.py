"""An S3-compatible bucket as a `BlobStore`: AWS S3, MinIO, Ceph RGW, Cloudflare R2, moto.

Configured by URL, `s3://bucket/prefix` (every key lives under `prefix/`), with the endpoint
and region from settings (`[weights] s3_endpoint`, `s3_region`) or the usual environment
(`AWS_ENDPOINT_URL`, `AWS_REGION` / `AWS_DEFAULT_REGION`), and credentials never from code or
settings: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, else a web
identity token (EKS), the ECS container role or the instance profile (IMDS); with boto3
installed, an `AWS_PROFILE` from `~/.aws/config` and `~/.aws/credentials` too.

The client is `obstore` (Python bindings of the Rust `object_store` crate), not `aiobotocore`:
it is natively async (a Tokio runtime, the GIL released while bytes move), streams a GET body
in chunks without growing a Python bytes object, uploads multipart in parallel from a buffer,
retries connection errors and 5xx itself with jittered back-off, needs no botocore pin (so it
does not fight boto3/moto over botocore versions), and the same package speaks GCS and Azure
should a deployment want them. It is an optional extra: `pip install 'rlboost[s3]'`.

Mapping: put -> PutObject (multipart above `multipart_threshold`, parts in parallel), has ->
HeadObject, read -> a streamed GetObject body that, when the connection is cut mid-body,
resumes with a ranged GET from the byte it reached (If-Match the first ETag, so a replaced
object is never spliced), delete -> DeleteObject, list -> ListObjectsV2 with a prefix.
Errors: no such key -> `ObjectMissing`; connection errors, timeouts, 5xx (after the client's
own short retries), 408/429 and a missing bucket -> `StoreUnavailable` (the weight cache
retries those with back-off); refused credentials and other 4xx -> `StoreError` (a
configuration problem: retrying does not help). Integrity stays the cache's job: it hashes
every byte against the manifest, so a tampered object is refused like any corrupt shard.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from rlboost.logs import get_logger
from rlboost.weights.blobstore import BlobStore, Buffer
from rlboost.weights.errors import ObjectMissing, StoreError, StoreUnavailable
from rlboost.wire import parse_s3_url

log = get_logger(component="objstore")

__all__ = ["S3BlobStore"]

_KEY = re.compile(r"[A-Za-z0-9._/-]+")
_STATUS = re.compile(r"\b(?:status(?: code)?:?\s*)(\d{3})\b")


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise StoreError("an s3:// weight store needs the obstore package: pip install 'rlboost[s3]'") from None
    return obstore


class S3BlobStore(BlobStore):
    """Immutable blobs in an S3-compatible bucket, under the URL's prefix. See the module doc."""

    READ_CHUNK = 4 << 20  # bytes per chunk handed to the reader (the cache hashes each as it comes)
    RESUMES = 3  # a body cut mid-stream is resumed this many times in a row without progress

    def __init__(self, url: str, *, endpoint: str = "", region: str = "",
                 multipart_threshold: int = 64 << 20, part_size: int = 16 << 20, put_concurrency: int = 8,
                 max_retries: int = 3, retry_timeout_s: float = 10.0, connect_timeout_s: float = 5.0,
                 read_timeout_s: float = 30.0) -> None:
        obstore = _obstore()
        from obstore.store import S3Store

        self.bucket, self.prefix = parse_s3_url(url)
        # S3 refuses parts under 5 MiB (but the last); obstore's multipart writer sends part_size parts
        self.part_size = max(5 << 20, part_size)
        self.multipart_threshold = max(self.part_size, multipart_threshold)
        self.put_concurrency = put_concurrency
        self.resumed_reads = 0  # bodies cut mid-stream and resumed with a ranged GET (tests, logs)
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
        config: dict[str, Any] = {}
        if endpoint:
            config["endpoint"] = endpoint
        if region:
            config["region"] = region
        client = {
            "connect_timeout": timedelta(seconds=connect_timeout_s),
            # no cap on a whole request (a multi-GB shard on a slow link is fine), but a body
            # that stalls for read_timeout_s is cut, and then resumed from where it stopped
            "timeout": timedelta(hours=6),
            "read_timeout": timedelta(seconds=read_timeout_s),
            "allow_http": endpoint.startswith("http://"),  # a loopback or in-cluster endpoint
        }
        # The client's own retries (5xx, connection errors, timeouts; jittered back-off) stay
        # short: the weight cache retries StoreUnavailable with its own back-off and deadline,
        # and a put that still fails is the publisher's StoreUnavailable, as on the other backends.
        retry = {"max_retries": max_retries, "retry_timeout": timedelta(seconds=retry_timeout_s),
                 "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2)}}
        self._ob = obstore
        oe = obstore.exceptions
        # obstore raises a missing object as the builtin FileNotFoundError; both are caught
        self._missing = (oe.NotFoundError, FileNotFoundError)
        self._failed = (oe.BaseError, OSError)
        self._store = S3Store(self.bucket, prefix=self.prefix or None, config=config, client_options=client,
                              retry_config=retry, credential_provider=_profile_credentials())
        self.location = f"s3://{self.bucket}/{self.prefix}" + (f" at {endpoint}" if endpoint else "")

    # -- helpers

    @staticmethod
    def _key(key: str) -> str:
        if not _KEY.fullmatch(key) or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
            raise ValueError(f"invalid blob key {key!r}")
        return key

    def _error(self, e: BaseException, what: str) -> StoreError:
        """An obstore/OS error as the store's own: transient ones as StoreUnavailable."""
        from obstore import exceptions as oe

        text = str(e)
        first = text.split("\n", 1)[0].strip()[:400]
        m = _STATUS.search(text)
        status = int(m.group(1)) if m else 0
        if isinstance(e, (oe.PermissionDeniedError, oe.UnauthenticatedError, PermissionError)) or status in (401, 403):
            return StoreError(f"{self.location}: {what}: access refused ({first}); check the credentials "
                              f"(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, the instance role)")
        if "NoSuchBucket" in text:
            return StoreUnavailable(f"{self.location}: {what}: bucket {self.bucket} does not exist")
        if 400 <= status < 500 and status not in (408, 429):
            return StoreError(f"{self.location}: {what}: refused ({first})")
        return StoreUnavailable(f"{self.location}: {what}: {first}")

    # -- the five operations

    async def put(self, key: str, data: Buffer) -> None:
        path = self._key(key)
        view = memoryview(data).cast("B")
        try:
            await self._ob.put_async(self._store, path, view, use_multipart=len(view) > self.multipart_threshold,
                                     chunk_size=self.part_size, max_concurrency=self.put_concurrency)
        except self._failed as e:
            raise self._error(e, f"writing {key}") from e

    async def has(self, key: str) -> bool:
        path = self._key(key)
        try:
            await self._ob.head_async(self._store, path)
        except self._missing:
            return False
        except self._failed as e:
            raise self._error(e, f"looking up {key}") from e
        return True

    async def read(self, key: str) -> AsyncIterator[Buffer]:
        """Stream the object; a body cut mid-way (server restarted, connection reset, a stall
        past read_timeout_s) is resumed with a ranged GET from the next byte, pinned to the
        first response's ETag, up to RESUMES times without progress; then StoreUnavailable."""
        ob = self._ob
        path = self._key(key)
        offset, size, etag = 0, -1, None
        chunks: Any = None
        failures = 0
        while True:
            try:
                if chunks is None:
                    if size < 0:
                        resp = await ob.get_async(self._store, path)
                        size, etag = int(resp.meta["size"]), resp.meta.get("e_tag")
                    else:
                        opts: dict[str, Any] = {"range": (offset, size)}
                        if etag:
                            opts["if_match"] = etag
                        resp = await ob.get_async(self._store, path, options=opts)
                    chunks = resp.stream(min_chunk_size=self.READ_CHUNK).__aiter__()
                if offset >= size:
                    return
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                err: StoreError = StoreUnavailable(f"{self.location}: reading {key}: body ended at "
                                                   f"{offset} of {size} bytes")
            except self._missing as e:
                if size < 0:
                    if "NoSuchBucket" in str(e):
                        raise self._error(e, f"reading {key}") from None
                    raise ObjectMissing(f"{key} not in {self.location}") from None
                raise StoreUnavailable(f"{self.location}: {key} was deleted while being read") from None
            except ob.exceptions.PreconditionError:
                raise StoreUnavailable(f"{self.location}: {key} was replaced while being read "
                                       f"(ETag no longer {etag})") from None
            except self._failed as e:
                err = self._error(e, f"reading {key}")
                err.__cause__ = e
            else:
                offset += len(chunk)
                failures = 0
                yield chunk
                continue
            # the body was cut: resume from `offset` if the store is only briefly away
            if not isinstance(err, StoreUnavailable) or failures >= self.RESUMES or size < 0:
                raise err
            failures += 1
            self.resumed_reads += 1
            log.info("s3 read resumed", key=key, at_byte=offset, size=size, attempt=failures, error=str(err))
            chunks = None
            await asyncio.sleep(0.1 * 2 ** (failures - 1))

    async def delete(self, key: str) -> None:
        path = self._key(key)
        try:
            await self._ob.delete_async(self._store, path)
        except self._missing as e:
            if "NoSuchBucket" in str(e):
                raise self._error(e, f"deleting {key}") from e
        except self._failed as e:
            raise self._error(e, f"deleting {key}") from e

    async def list(self, prefix: str = "") -> list[str]:
        # object_store lists whole path segments: list the prefix's directory, filter by string
        directory = prefix.rpartition("/")[0] if "/" in prefix else ""
        keys: list[str] = []
        try:
            async for batch in self._ob.list(self._store, directory or None, chunk_size=1000):
                keys.extend(m["path"] for m in batch if m["path"].startswith(prefix))
        except self._failed as e:
            raise self._error(e, f"listing {prefix or '/'}") from e
        return sorted(keys)


def _profile_credentials() -> Any:
    """Credentials of a named AWS profile (`AWS_PROFILE`: SSO, assume-role, credentials file),
    through boto3 when it is installed and no static keys are in the environment; None leaves
    the client's own chain (environment keys, web identity, ECS role, instance profile)."""
    if not os.environ.get("AWS_PROFILE") or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        log.warning("AWS_PROFILE is set but boto3 is not installed: using the environment's credentials chain")
        return None
    return Boto3CredentialProvider(boto3.Session())
