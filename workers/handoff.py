"""How a rollout worker lets requests go to other workers, checkpointed, nothing to regenerate.

- at a drain (`hand_back_all`): every lease released and every request put on the hand-off
  pool's resume lane, so a worker with a spare slot continues it from the checkpoint at once;
- a seeding engine (its own queue, another hand-off pool) forwards what is still queued for it
  as well (`forward_own_queue`), its specs vouched for as their fresh claim would;
- after a flush, the requests older than the pool's version floor (`hand_back_below_floor`):
  their next claim continues them under the floor's version, a new segment of the result.

Always release, publish, then ack: a crash in between leaves two messages for one request, which
the lease and the finished mark resolve, never zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import redis.exceptions
from nats.aio.msg import Msg

from rlboost import bus, wire
from rlboost.workers.inflight import InFlight


class Handoff:
    def __init__(self, st: InFlight) -> None:
        self.st = st

    async def hand_back_all(self) -> None:
        """After the final flush: release every lease and put every request on the resume lane.
        Batched (one Redis round trip, publishes in flight together): a seeding engine hands
        back hundreds."""
        st = self.st
        leftover = list(st.active.values())
        try:
            released = await st.c.store.release_many([(a.req.request_id, a.epoch) for a in leftover])
        except (redis.exceptions.RedisError, OSError) as e:  # they come back after ack_wait, like after a kill
            st.log.warning("hand-off failed: could not release", requests=len(leftover), error=str(e))
            released = [False] * len(leftover)
        mine = [a for a, ok in zip(leftover, released, strict=True) if ok]  # the rest: fenced out, not ours
        subject = wire.resume_subject(st.handoff_pool)
        # a request carried to a newer version (`Versions.carry_forward`) goes on under it: its
        # message says so, or the next worker could continue it under the older one again
        outcomes = await bus.publish_batch(
            st.c.js, [(subject, wire.encode(a.req) if a.req.upgradable else a.msg.data,
                       {wire.HDR_MSG_ID: wire.handoff_msg_id(a.req.request_id, a.epoch)})
                      for a in mine], ack_timeout_s=st.cfg.publish_timeout_s,
            deadline_s=min(st.cfg.publish_timeout_s * 2, st.cfg.drain_grace_s / 2))
        for a, out in zip(mine, outcomes, strict=True):
            if not out.ok:  # not acked: it comes back after ack_wait, like after a kill
                st.log.warning("hand-off failed", request_id=a.req.request_id, error=str(out.error))
                continue
            with contextlib.suppress(Exception):
                await a.msg.ack()
            st.counters.add("handed_off")
            await st.outbox.event(a.req, a.epoch, "release", a.durable, detail=st.drain_reason)
            st.log.info("handed off", request_id=a.req.request_id, at=a.durable)
        await st.outbox.sent()
        await st.outbox.publish()
        st.active.clear()
        st.version_users.clear()
        st.switch_wanted = 0.0

    async def forward_own_queue(self) -> None:
        """A seeding engine (its own queue, another hand-off pool) hands off its whole share:
        what is still queued for it (not fetched yet, or given back as the notice landed) goes
        to the hand-off pool's resume lane as well."""
        st, js = self.st, self.st.c.js
        sub = await js.pull_subscribe_bind(durable=wire.consumer_name(st.pool), stream=wire.STREAM_REQUESTS)
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch=256, timeout=0.05)
                except (TimeoutError, asyncio.TimeoutError):
                    msgs = []
                # done when nothing is queued, nor delivered to us past a fetch (the rest of a
                # batch its timeout cut short: the next fetch takes those first)
                if not msgs and not sub.pending_msgs and not (await sub.consumer_info()).num_pending:
                    await bus.hand_back_buffered(sub)  # what arrived since: back to our own queue
                    return
                rids = [(m.headers or {}).get(wire.HDR_MSG_ID) or f"forwarded-{uuid.uuid4().hex}" for m in msgs]
                await self._vouch(msgs)
                outcomes = await bus.publish_batch(
                    js, [(wire.resume_subject(st.handoff_pool), m.data, {wire.HDR_MSG_ID: wire.handoff_msg_id(rid, 0)})
                         for m, rid in zip(msgs, rids, strict=True)], ack_timeout_s=st.cfg.publish_timeout_s,
                    deadline_s=st.cfg.publish_timeout_s * 2)
                for msg, rid, out in zip(msgs, rids, outcomes, strict=True):
                    if not out.ok:  # not acked: it returns to our queue after ack_wait
                        st.log.warning("forward failed", request_id=rid, error=str(out.error))
                        continue
                    with contextlib.suppress(Exception):
                        await msg.ack()
                    st.counters.add("handed_off")
                    st.log.info("forwarded unstarted request", request_id=rid, to_pool=st.handoff_pool)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _vouch(self, msgs: list[Msg]) -> None:
        """Record the specs of fresh-lane requests forwarded unstarted, as their fresh claim
        would (`CheckpointStore.vouch_many`), so the hand-off pool takes them. What does not
        decode is forwarded as it is: the worker that takes it dead-letters it."""
        st = self.st
        specs = []
        for m in msgs:
            with contextlib.suppress(wire.WireError):
                req = wire.decode(wire.RolloutRequest, m.data)
                specs.append((req.request_id, wire.spec_digest(req)))
        if specs:
            try:
                await st.retrying(lambda: st.c.store.vouch_many(specs))
            except (redis.exceptions.RedisError, OSError) as e:  # forwarded anyway: a refused one is redone
                st.log.warning("could not record the specs of forwarded requests", requests=len(specs),
                               error=str(e))

    async def hand_back_below_floor(self) -> None:
        """After a flush: release the requests older than the floor and put them on the pool's
        resume lane (checkpointed, nothing to regenerate); their next claim continues them
        under the floor's version (`Admission.admit`), a new segment of the result."""
        st = self.st
        old = [a for a in st.active.values() if a.req.policy_version < st.floor and not a.done]
        if not old:
            return
        try:
            released = await st.c.store.release_many([(a.req.request_id, a.epoch) for a in old])
        except (redis.exceptions.RedisError, OSError) as e:  # keep generating them; try again next flush
            st.log.warning("version floor: could not release", requests=len(old), error=str(e))
            return
        mine = [a for a, ok in zip(old, released, strict=True) if ok]
        outcomes = await bus.publish_batch(
            st.c.js, [(wire.resume_subject(st.pool), a.msg.data,
                       {wire.HDR_MSG_ID: wire.handoff_msg_id(a.req.request_id, a.epoch)}) for a in mine],
            ack_timeout_s=st.cfg.publish_timeout_s, deadline_s=st.cfg.publish_timeout_s * 2)
        for a, out in zip(mine, outcomes, strict=True):
            st.forget(a)
            if out.ok:  # else: it comes back after ack_wait, like after a kill
                with contextlib.suppress(Exception):
                    await a.msg.ack()
                st.counters.add("handed_off")
                await st.outbox.event(a.req, a.epoch, "release", a.durable, detail=f"version floor {st.floor}")
        for a in old:
            if a not in mine:
                st.forget(a)  # fenced out: not ours any more
