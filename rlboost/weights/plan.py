"""Which ways lead to a version, given what the cache holds, cheapest first.

The manifests form a chain (a delta version names its base). Walking it back from the wanted
version, each snapshot on the way (shards the cache lacks + the deltas after it) and a cached
version that is exactly a delta's base (only the deltas after it) is a way there. A version the
publisher stored a snapshot delta for (opt-in, `snapshot_deltas`: its change from the last
snapshot in one delta, `rlboost.weights.manifest.SnapshotDelta`) is also a way there from that
snapshot, cached or not: a late joiner with nothing cached so takes the nearest snapshot and
replays that one delta (or the deltas since, when there is none or it fails); a follower holding
the previous version takes its small delta and never reads the other. Nothing is fetched here
but manifests; `WeightCache` tries the ways in order.
"""

from __future__ import annotations

import asyncio

from rlboost.weights.disk import CacheDir, Step
from rlboost.weights.errors import VersionUnavailable
from rlboost.weights.manifest import Delta, Manifest, SnapshotDelta
from rlboost.weights.origin import Origin

__all__ = ["Planner", "Way", "MAX_CHAIN"]

MAX_CHAIN = 64  # deltas a pull replays at most; the publisher's full_every keeps chains far shorter
# (bytes to fetch, whether `start` is a cached version, start, the steps replayed from it, oldest first)
Way = tuple[int, bool, Manifest, list[Step]]


class Planner:
    def __init__(self, origin: Origin, disk: CacheDir) -> None:
        self.origin, self.disk = origin, disk

    async def manifest(self, version: int, wait_s: float) -> Manifest:
        """`version`'s manifest: the cached copy, else the store's (waiting up to `wait_s`)."""
        local = self.disk.local_manifest(version)
        return local if local is not None else await self.origin.manifest(version, wait_s)

    async def paths(self, target: Manifest) -> list[Way]:
        """Every way to `target` the manifests allow, cheapest first. A start is a snapshot
        (fetch the shards the cache lacks) or a cached version that is exactly a delta's base (a
        cached one is preferred at equal cost); unless the target's own delta base is cached (a
        follower), the target's snapshot delta is a way from its snapshot."""
        jump: asyncio.Future[SnapshotDelta | None] | None = None
        if not target.shards and target.delta is not None \
                and not (self.disk.vdir(target.delta.base) / "manifest.json").exists():
            # not a follower, by the look of the cache: the snapshot delta is read while the walk
            # below reads the chain's manifests, not after it (a round trip to the store less)
            jump = asyncio.ensure_future(self.origin.snapshot_delta(target))
        try:
            return await self._walk(target, jump)
        finally:
            if jump is not None and not jump.done():
                jump.cancel()

    async def _walk(self, target: Manifest, jump: asyncio.Future[SnapshotDelta | None] | None) -> list[Way]:
        paths: list[tuple[int, int, Manifest, list[Step]]] = []
        after: list[Step] = []  # the steps after `m`, newest first
        seen: dict[int, Manifest] = {}  # the manifests read on the way, by version
        delta_bytes = 0
        m = target
        while True:
            seen[m.version] = m
            if m.snapshot:
                paths.append((self.disk.missing(m) + delta_bytes, 1, m, after[::-1]))
            if m.delta is None or len(after) >= MAX_CHAIN:
                break
            delta_bytes += m.delta.bytes
            after = after + [(m, m.delta)]
            base = await self._base(m.delta)
            if base is None:
                break  # gone, or another life's version under that number: no delta applies to it
            if await self.disk.cached(base):
                paths.append((delta_bytes, 0, base, after[::-1]))
                break
            m = base
        follower = any(kind == 0 and len(steps) == 1 for _, kind, _, steps in paths)
        if jump is None and not follower and not target.shards and target.delta is not None:
            jump = asyncio.ensure_future(self.origin.snapshot_delta(target))
        if jump is not None and not follower and (sd := await jump) is not None \
                and (snap := await self._base(sd.delta, seen)) is not None and snap.shards:
            cached = await self.disk.cached(snap)
            paths.append((sd.delta.bytes + (0 if cached else self.disk.missing(snap)), 0 if cached else 1, snap,
                          [(target, sd.delta)]))
        paths.sort(key=lambda p: (p[0], p[1]))
        return [(cost, kind == 0, start, chain) for cost, kind, start, chain in paths]

    async def _base(self, delta: Delta, seen: dict[int, Manifest] | None = None) -> Manifest | None:
        """The manifest of the delta's base: one read on the way (`seen`), the cached copy, else
        the store's; None if none, or if it is not exactly the one the delta was made from."""
        base = (seen or {}).get(delta.base)
        if base is None:
            try:
                base = await self.manifest(delta.base, 0.0)
            except VersionUnavailable:
                return None
        return base if base.digest() == delta.base_digest else None
