"""The version pointer: the latest published version, in the `rb-policy` KV bucket."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyNotFoundError

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.weights.errors import StoreUnavailable

log = get_logger(component="weights")

__all__ = ["VersionPointer", "parse_version"]



def parse_version(raw: bytes | None) -> int | None:
    """`b"17"` -> 17; anything that is not 1-18 ASCII digits -> None."""
    if not raw or len(raw) > 18 or not raw.isdigit() or not raw.isascii():
        return None
    return int(raw)


class VersionPointer:
    """The latest published version, an ASCII integer in the `rb-policy` KV bucket.

    Workers watch it; it only moves forward (a trainer restarting from an older checkpoint
    must publish a new, higher version, or it would silently roll workers back)."""

    def __init__(self, kv: Any, key: str = wire.WEIGHTS_POINTER_KEY) -> None:
        self.kv = kv
        self.key = key
        self.last_valid: int | None = None

    @classmethod
    async def open(cls, js: JetStreamContext, key: str = wire.WEIGHTS_POINTER_KEY) -> VersionPointer:
        try:
            try:
                kv = await js.key_value(wire.BUCKET_POLICY)
            except Exception:
                try:
                    kv = await js.create_key_value(KeyValueConfig(bucket=wire.BUCKET_POLICY, history=5))
                except BadRequestError:
                    kv = await js.key_value(wire.BUCKET_POLICY)
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"cannot open KV bucket {wire.BUCKET_POLICY}: {e!r}") from e
        return cls(kv, key)

    def _parse(self, raw: bytes | None) -> int | None:
        """The pointer door: an ASCII decimal version, or None (logged) for anything else. A
        garbage value never replaces the last valid one (main: it killed the trainer at start
        and every worker's prefetch for good)."""
        v = parse_version(raw)
        if v is None and raw:
            log.warning("ignoring a version pointer that is not a version", key=self.key, value=raw[:40])
        elif v is not None:
            self.last_valid = max(v, self.last_valid or 0)
        return v

    async def get(self) -> int | None:
        """The latest valid version: a garbage current value falls back to the newest valid one
        in the key's history (or the last one this process saw)."""
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            return self.last_valid
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"reading {wire.BUCKET_POLICY}/{self.key}: {e!r}") from e
        v = self._parse(entry.value)
        if v is not None:
            return v
        with contextlib.suppress(Exception):
            for old in reversed(await self.kv.history(self.key)):
                if (v := parse_version(old.value)) is not None:
                    self.last_valid = max(v, self.last_valid or 0)
                    break
        return self.last_valid

    async def set(self, version: int) -> None:
        current = await self.get()
        if current is not None and version < current:
            raise ValueError(f"version pointer is at {current}; refusing to move it back to {version}")
        try:
            await self.kv.put(self.key, str(version).encode())
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as e:
            raise StoreUnavailable(f"writing {wire.BUCKET_POLICY}/{self.key}: {e!r}") from e

    async def watch(self, stop: asyncio.Event | None = None) -> AsyncIterator[int]:
        """Yield the current version (if any), then every new one, until `stop` is set."""
        watcher = await self.kv.watch(self.key)
        try:
            while stop is None or not stop.is_set():
                try:
                    entry = await watcher.updates(timeout=0.5)
                except nats.errors.TimeoutError:
                    continue
                if entry is None or not entry.value or entry.operation in ("DEL", "PURGE"):
                    continue
                version = self._parse(entry.value)
                if version is not None:
                    yield version
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
