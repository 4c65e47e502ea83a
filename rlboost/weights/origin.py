"""The origin store as a pull reads it: every read retried with back-off until a deadline, then
reported clearly; a version's manifest (waiting a while for one not published yet, and telling a
garbage-collected version from a late one); a version's snapshot delta, when there is one.

The blobs themselves are streamed from `store` by the fetcher (`rlboost.weights.fetch`), which
checks them as they arrive; a copy that fails is fetched again up to `corrupt_retries` times."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.weights.blobstore import BlobStore
from rlboost.weights.errors import ObjectMissing, StoreError, StoreUnavailable, VersionGone, VersionUnavailable
from rlboost.weights.manifest import Manifest, SnapshotDelta
from rlboost.weights.publisher import published_versions, read_snapshot_delta

log = get_logger(component="weights")

__all__ = ["Origin"]


class Origin:
    """`store` read with the cache's patience (`retry_deadline_s`, `corrupt_retries`)."""

    def __init__(self, store: BlobStore, *, retry_deadline_s: float = 60.0, corrupt_retries: int = 3) -> None:
        self.store = store
        self.retry_deadline_s = retry_deadline_s
        self.corrupt_retries = corrupt_retries

    async def retrying(self, what: str, op: Callable[[], Awaitable[Any]]) -> Any:
        """Retry StoreUnavailable with exponential back-off (jittered, capped at 5 s) until
        `retry_deadline_s`; then raise it with the attempt count."""
        deadline = time.monotonic() + self.retry_deadline_s
        delay, attempt = 0.1, 0
        while True:
            attempt += 1
            try:
                return await op()
            except StoreUnavailable as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(f"{e} (gave up on {what} after {attempt} attempts, "
                                           f"{self.retry_deadline_s:.0f}s)") from e
                sleep = min(delay * (1 + random.random() / 2), left, 5.0)
                log.warning("weight store unreachable; retrying", what=what, attempt=attempt,
                            retry_in_s=round(sleep, 2), error=str(e))
                await asyncio.sleep(sleep)
                delay = min(delay * 2, 5.0)

    async def manifest(self, version: int, wait_s: float) -> Manifest:
        """`version`'s manifest from the store. `wait_s`: a request may name a version whose
        manifest is not in the store yet (the trainer is still uploading); keep looking for that
        long before giving up (VersionUnavailable; VersionGone when a newer one is there)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                data = await self.retrying(f"manifest v{version}",
                                           lambda: self.store.read_all(wire.weights_manifest_key(version)))
                break
            except ObjectMissing:
                if wait_s > 0 and (newer := await self._newest_published()) > version:
                    # versions are published in order: a newer one means this one will not come
                    raise VersionGone(f"weights version {version} is not in {self.store.location} and "
                                      f"version {newer} is: garbage-collected") from None
                if time.monotonic() >= deadline:
                    raise VersionUnavailable(
                        f"weights version {version} is not in {self.store.location} "
                        f"(not published yet, or garbage-collected)") from None
                await asyncio.sleep(0.2)
        m = Manifest.decode(data)
        if m.version != version:
            raise StoreError(f"manifest {wire.weights_manifest_key(version)} claims version {m.version}")
        return m

    async def _newest_published(self) -> int:
        """The newest version with a manifest in the store (0: none, or the store did not answer)."""
        try:
            return max(await published_versions(self.store), default=0)
        except StoreError:
            return 0

    async def snapshot_delta(self, target: Manifest) -> SnapshotDelta | None:
        """The target's snapshot delta, if the publisher stored one (a store that does not answer
        now: none; the other paths are still there)."""
        try:
            return await read_snapshot_delta(self.store, target)
        except StoreError as e:
            log.info("weights: no snapshot delta read; replaying the deltas since the snapshot",
                     version=target.version, error=str(e))
            return None
