"""`WeightSource`: "policy version -> weights an engine can load", the one shape every engine's
owner uses (a rollout worker, the trainer's reserved engine, benches).

- `StoreWeights`: the weight store through a local `WeightCache`: `path(v)` is a verified folder
  (pulled, rebuilt from deltas if need be), `prefetch(v)` pulls ahead of the requests that will
  need it, `follow()` prefetches every version the pointer announces.
- `EmulatedWeights`: the emulated engine's weights are virtual: nothing to pull or load.

`weights_id(path, v)` names the weights results' segments carry (`wire.Segment.weights`): the
manifest digest of a pulled version, `emulated-v<N>` for virtual ones.
"""

from __future__ import annotations

import abc
import asyncio
import time
from pathlib import Path

from rlboost import metrics, wire
from rlboost.logs import get_logger
from rlboost.weights.cache import WeightCache
from rlboost.weights.errors import StoreError
from rlboost.weights.manifest import Manifest
from rlboost.weights.peerhttp import PeerServer
from rlboost.weights.pointer import VersionPointer

log = get_logger(component="weights")

__all__ = ["WeightSource", "StoreWeights", "EmulatedWeights"]


class WeightSource(abc.ABC):
    virtual: bool = False  # True: there is nothing to load, a switch of version is only a label

    @abc.abstractmethod
    async def path(self, version: int) -> Path | None:
        """A folder holding exactly `version`'s verified weights (None for virtual weights), or raise."""

    async def prefetch(self, version: int) -> None:
        """Have `version` ready before a request asks for it; never raises (the request path
        retries and reports)."""

    async def published(self, version: int) -> bool:
        """Does the store hold `version` at all? (Start-up weights of an unpublished version are
        served labelled as such.)"""
        return True

    @abc.abstractmethod
    def weights_id(self, path: Path | None, version: int) -> str:
        """The name of the weights `path(version)` gave: what results' segments carry."""

    async def follow(self, pointer: VersionPointer, stop: asyncio.Event) -> None:
        """Prefetch every version the pointer announces until `stop`: download only, an engine
        switches when a request asks (never mid-batch)."""
        async for version in pointer.watch(stop):
            await self.prefetch(version)

    def close(self) -> None:
        return None

    async def aclose(self) -> None:
        """`close()`, and whatever this source serves (a peer server) is taken down first."""
        self.close()


class StoreWeights(WeightSource):
    """The weight store through a local cache. `wait_s`: how long `path()` waits for a version
    whose manifest is not in the store yet (the trainer may still be uploading it). `server`:
    this worker's peer server over `cache` (`[weights] peers`), closed with the source."""

    def __init__(self, cache: WeightCache, *, wait_s: float = 5.0, server: PeerServer | None = None) -> None:
        self.cache = cache
        self.wait_s = wait_s
        self.server = server

    async def path(self, version: int) -> Path:
        t0, fetched = time.monotonic(), self.cache.stats.bytes_fetched
        path = (await self.cache.ensure(version, wait_s=self.wait_s)).path
        moved = self.cache.stats.bytes_fetched - fetched
        metrics.WEIGHT_PULLS.labels("miss" if moved else "hit").inc()
        metrics.WEIGHT_PULL_BYTES.inc(moved)
        metrics.WEIGHT_PULL_SECONDS.observe(time.monotonic() - t0)
        return path

    async def prefetch(self, version: int) -> None:
        try:
            await self.cache.ensure(version)
        except Exception as e:  # the request path retries and reports; the watch goes on
            log.warning("prefetch failed", policy_version=version, error=str(e))

    async def published(self, version: int) -> bool:
        try:
            return await self.cache.store.has(wire.weights_manifest_key(version))
        except Exception:  # unreachable: try the pull, which retries and reports
            return True

    def weights_id(self, path: Path | None, version: int) -> str:
        if path is None:
            raise StoreError(f"no folder for weights version {version}")
        return Manifest.decode((path / "manifest.json").read_bytes()).digest()

    def close(self) -> None:
        self.cache.close()

    async def aclose(self) -> None:
        if self.cache.peers is not None:  # withdraw the adverts before the server goes
            await self.cache.peers.close()
        if self.server is not None:
            await self.server.close()
        self.close()


class EmulatedWeights(WeightSource):
    virtual = True

    async def path(self, version: int) -> None:
        return None

    def weights_id(self, path: Path | None, version: int) -> str:
        return f"emulated-v{version}"
