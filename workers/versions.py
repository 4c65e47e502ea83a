"""Which policy version a rollout worker's engine serves, and when it switches.

One version at a time: a request is generated only with the weights its version names. A
request of another version is admitted once the engine can switch (`ensure`: no request of
another version admitted, active or still claiming), else it is handed back. An upgradable
request (async rollout) of a newer version instead moves the engine forward, carrying the
requests in flight along (`carried_to`, `carry_forward`: PipelineRL's in-flight update).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from pathlib import Path

import msgspec

from rlboost.checkpoint import LeaseLost
from rlboost.weights.errors import VersionGone
from rlboost.weights.source import WeightSource
from rlboost.workers.inflight import InFlight

STARTUP_WEIGHTS = "startup"  # the weights id of an engine's start-up weights, no manifest behind them


class Versions:
    def __init__(self, st: InFlight, weights: WeightSource | None) -> None:
        self.st = st
        self.engine = st.engine
        self.weights = weights
        self.lock = asyncio.Lock()
        self.carry_to = 0  # a newer version an upgradable request waits for (`carry_forward`)
        self.moved = asyncio.Event()  # set (and cleared) at each in-flight update

    def loaded(self, version: int) -> bool:
        """The engine holds `version`'s weights, and knows which ones (a real engine's start-up
        weights from the model dir are unnamed: the version is pulled once to name them)."""
        return version == self.engine.policy_version and (
            self.weights is None or self.weights.virtual or bool(self.engine.weights_id))

    async def ensure(self, version: int) -> bool:
        """Serve one policy version at a time. On True the caller holds a reservation of
        `version` (`InFlight.version_users`): the engine cannot switch away until it is released.

        The switch waits until no request of another version is admitted, active or still
        claiming. The download happens before the lock (a version that is not published yet
        keeps only its own request waiting, never the lock: the cache waits boundedly)."""
        st = self.st
        path: Path | None = None
        if not self.loaded(version):
            if self.weights is None:
                st.log.error("request needs a policy version this worker cannot load", version=version,
                             loaded=self.engine.policy_version)
                return False
            if self.weights.virtual:
                pass  # nothing to pull: the switch below only relabels the engine
            elif version == self.engine.policy_version and not await self.weights.published(version):
                # Start-up weights (the model dir) of a version the store does not hold: serve
                # them, labelled as such: a trainer that published the version refuses them.
                self.engine.weights_id = STARTUP_WEIGHTS
            else:
                try:
                    path = await self.weights.path(version)
                except VersionGone:
                    raise  # the request is a leftover: admission dead-letters it
                except Exception as e:
                    st.log.warning("weight pull failed", version=version, error=str(e))
                    return False
        async with self.lock:
            if not self.loaded(version):
                if any(n > 0 for v, n in st.version_users.items() if v != version):
                    return False
                if path is None and not self.weights.virtual:
                    return False  # another version was loaded meanwhile: pull again next delivery
                if not await self._load(path, version):
                    return False
                st.log.info("policy version loaded", policy_version=version, weights=self.engine.weights_id)
            st.version_users[version] += 1
            return True

    async def _load(self, path: Path | None, version: int) -> bool:
        """Put `version`'s weights in the engine (under `lock`); False if that failed."""
        try:
            if path is None:
                self.engine.policy_version = version  # virtual weights: only a label
            else:
                await self.engine.load_weights(path, version)
            self.engine.weights_id = self.weights.weights_id(path, version)
        except Exception as e:
            self.st.log.warning("weight load failed", version=version, error=str(e))
            return False
        return True

    async def carried_to(self, version: int) -> bool:
        """An upgradable request of a newer version than the engine's: ask the generate loop to
        move the engine to it, carrying the requests in flight along (`carry_forward`), and
        wait for that (at most half an ack_wait: the message is not extended meanwhile).
        False: nothing to wait for (the engine is not older), or it did not happen in time."""
        st = self.st
        if version <= self.engine.policy_version or self.weights is None:
            return False
        if not self.weights.virtual:
            try:  # the download here, not in the generate loop: it keeps generating meanwhile
                await self.weights.path(version)
            except VersionGone:
                raise
            except Exception as e:
                st.log.warning("weight pull failed", version=version, error=str(e))
                return False
        self.carry_to = max(self.carry_to, version)
        st.stop_engine.set()  # the move happens between two engine calls: end this one
        st.wake.set()
        deadline = time.monotonic() + st.cfg.ack_wait_s / 2
        while self.engine.policy_version < version and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.moved.wait(), timeout=left)
        return self.engine.policy_version >= version

    async def carry_forward(self) -> None:
        """Async rollout's in-flight update (as PipelineRL's): move the engine to the newer
        version an upgradable request asked for, and continue the requests in flight under it
        instead of finishing them first. Each is re-claimed under its lease (a new epoch, a
        history line with the new version and weights: its later tokens are a segment of their
        own), so a resume anywhere keeps the labels right; the staleness bound is the oldest
        segment's, unchanged. Without this a worker holding one long response of the old version
        could take none of the next version's requests until it ended: on the trace bench, ~13
        responses a step at the 14K-token cap kept most instances so at every step boundary.

        Runs between engine calls, after a flush (nothing pending). Not now (tried again after
        the next call) while a request of another version that cannot move is in flight (not
        upgradable, an episode) or still being admitted (it holds its version's reservation)."""
        st = self.st
        target = self.carry_to
        if target <= self.engine.policy_version:
            self.carry_to = 0
            return
        moving = [a for a in st.active.values() if a.req.policy_version != target and not a.done]
        if any(not a.req.upgradable or a.episode is not None or a.pending_tokens or a.req.policy_version > target
               for a in moving):
            return
        held = collections.Counter(a.req.policy_version for a in st.active.values())
        if any(n > held[v] for v, n in st.version_users.items() if v != target):
            return  # an admission of another version is claiming: it would land on the wrong weights
        path: Path | None = None
        if not self.weights.virtual:
            try:  # pulled by the request that asked (`carried_to`): a cache hit
                path = await self.weights.path(target)
            except Exception as e:  # gone meanwhile: the waiting requests are handed back
                st.log.warning("in-flight update: weight pull failed", version=target, error=str(e))
                self.carry_to = 0
                return
        async with self.lock:
            if any(n > held[v] for v, n in st.version_users.items() if v != target):
                return
            if not await self._load(path, target):
                self.carry_to = 0
                return
            self.carry_to = 0
            claims = await asyncio.gather(*(
                st.c.store.claim(a.req.request_id, st.worker_id, target, st.cfg.lease_ttl_s,
                                 weights=self.engine.weights_id) for a in moving), return_exceptions=True)
            for a, claim in zip(moving, claims, strict=True):
                old = a.req.policy_version
                if isinstance(claim, BaseException) or len(claim.token_ids) != a.durable:
                    # lost meanwhile (another worker holds or finished it, or the store failed):
                    # it is no longer ours to continue here
                    why = (claim if isinstance(claim, Exception)
                           else LeaseLost(f"{a.req.request_id}: the checkpoint moved on meanwhile"))
                    if not isinstance(claim, BaseException):
                        with contextlib.suppress(Exception):
                            await st.c.store.release(a.req.request_id, claim.epoch)
                    await st.drop_fenced(a, why)
                    continue
                a.req = msgspec.structs.replace(a.req, policy_version=target)
                a.epoch, a.weights = claim.epoch, self.engine.weights_id
                st.version_users[target] += 1
                st.unreserve(old)
                st.counters.add("carried")
                await st.outbox.event(a.req, a.epoch, "claim", a.durable,
                                      detail=f"in-flight update from version {old}")
        st.log.info("in-flight update", policy_version=target, weights=self.engine.weights_id, carried=len(moving))
        st.switch_wanted = 0.0
        self.moved.set()
        self.moved.clear()
        st.notify_slots()
