"""How a rollout worker answers a request: finished, refused, or republished.

- finished: a flush completed it; the fenced finish, its result and its ack, batched with the
  others the same flush completed, in the background (the next engine call does not wait);
- refused: the engine cannot serve it (`Engine.check`, a `RequestError`) or its episode cannot
  be opened: finished under its lease with the tokens it has and answered with an `error`
  result that says why (verified by the trainer like any result), then acked;
- republished: its checkpoint says finished but its message came back (the finisher died
  between finishing and acking): the result is published again from the checkpoint.
"""

from __future__ import annotations

import contextlib
import time

from nats.aio.msg import Msg

from rlboost import bus, wire
from rlboost.checkpoint import AlreadyFinished, CheckpointError, LeaseLost
from rlboost.workers.inflight import Active, InFlight, make_result, make_sequence, publish_result


class Finisher:
    def __init__(self, st: InFlight) -> None:
        self.st = st

    async def finish_safely(self, batch: list[Active]) -> None:
        """`finish` in the background: whatever escapes it, no request stays `finishing` in a
        slot forever (it is handed back, and its redelivery finds the checkpoint's state)."""
        st = self.st
        try:
            await self.finish(batch)
        except Exception as e:
            st.log.error("finishing failed", requests=len(batch), error=repr(e))
            for a in batch:
                if st.active.get(a.req.request_id) is a:
                    st.forget(a)
                    with contextlib.suppress(Exception):
                        await a.msg.nak(delay=1.0)

    async def finish(self, batch: list[Active]) -> None:
        """Finish the requests a flush completed, together: one Redis round trip for every fenced
        finish and its provenance, the results published with their acks in flight together,
        then the messages acked. Per request, as before: a lost lease drops it; a result that
        could not be stored leaves the message un-acked (its redelivery republishes it from the
        finished checkpoint, never redoes it)."""
        st = self.st
        sent = time.time()  # the finish events' time: when the fenced finish was sent (see Generation.flush)
        try:
            outs: list = await st.retrying(lambda: st.c.store.finish_many(
                [(a.req.request_id, a.epoch, a.durable) for a in batch]))
        except Exception as e:  # not a connection problem (those are retried): fail each, do not vanish
            outs = [CheckpointError(repr(e))] * len(batch)
        ready: list[tuple[Active, wire.RolloutResult]] = []
        for a, out in zip(batch, outs, strict=True):
            if isinstance(out, (LeaseLost, AlreadyFinished)):
                await st.drop_fenced(a, out)
            elif isinstance(out, Exception):
                st.log.error("checkpoint finish failed", request_id=a.req.request_id, error=str(out))
                st.forget(a)
                with contextlib.suppress(Exception):
                    await a.msg.nak(delay=1.0)
            else:
                ready.append((a, make_result(a.req, a.seq.token_ids[: a.durable], a.logprobs, st.worker_id,
                                              a.epoch, out, episode=a.episode.stored if a.episode else None)))
        if not ready:
            return
        published = await bus.publish_batch(
            st.c.js, [(wire.result_subject(r.step), wire.encode(r), {wire.HDR_MSG_ID: wire.result_msg_id(r)})
                      for _, r in ready],
            ack_timeout_s=st.cfg.publish_timeout_s, deadline_s=st.cfg.publish_timeout_s * 3)
        for (a, _), pub in zip(ready, published, strict=True):
            rid = a.req.request_id
            try:
                if not pub.ok:
                    raise bus.PublishFailed("results", [rid], str(pub.error))
                await a.msg.ack()
            except Exception as e:  # the checkpoint says finished: redelivery republishes it, never redoes it
                st.log.warning("result publish failed; it is republished when the request comes back",
                               request_id=rid, error=repr(e))
                st.forget(a)
                continue
            await st.outbox.event(a.req, a.epoch, "finish", a.durable, ts=sent)
            st.counters.add("results")
            st.forget(a)
            st.log.info("finished", request_id=rid, step=a.req.step, tokens=a.durable)

    async def _publish_result(self, req: wire.RolloutRequest, tokens: list[int], logprobs: list[float],
                              worker_id: str, epoch: int, error: str = "") -> None:
        await publish_result(self.st.c, req, tokens, logprobs, worker_id, epoch, error, self.st.cfg.publish_timeout_s)

    async def refuse(self, msg: Msg, req: wire.RolloutRequest, epoch: int, tokens: list[int], logprobs: list[float],
                     reason: str) -> None:
        """A request this engine cannot serve: finished in the checkpoint under our lease with
        the tokens it has (none, mostly), then an `error` result naming that lease (the trainer
        verifies it like any result), then the ack. A redelivery finds it finished and
        republishes the same error result (`republish_finished`)."""
        st, rid = self.st, req.request_id
        st.counters.add("request_errors")
        st.log.warning("request refused", request_id=rid, step=req.step, reason=reason)
        try:
            await st.retrying(lambda: st.c.store.finish(rid, epoch, len(tokens)))
        except (LeaseLost, AlreadyFinished) as e:  # someone else's now: their answer stands
            st.log.warning("refused request lost its lease", request_id=rid, reason=str(e))
            return
        try:
            await self._publish_result(req, tokens, logprobs, st.worker_id, epoch, error=reason)
            await msg.ack()
        except Exception as e:  # finished in the checkpoint: redelivery republishes it
            st.log.warning("error result publish failed", request_id=rid, error=repr(e))
            return
        await st.outbox.event(req, epoch, "finish", len(tokens), detail=f"error: {reason}")

    async def fail_active(self, a: Active, reason: str) -> None:
        """An admitted request the engine failed on mid-batch: answered with an error, with the
        tokens already in its checkpoint."""
        self.st.forget(a)
        await self.refuse(a.msg, a.req, a.epoch, a.seq.token_ids[: a.durable], list(a.logprobs), reason)

    async def republish_finished(self, req: wire.RolloutRequest) -> None:
        """The checkpoint says finished but the message came back: the finisher died between
        finishing and acking. Publish the result from the checkpoint (the stream drops it if
        it is a duplicate) so it is never lost."""
        st = self.st
        tokens, logprobs = await st.c.store.read(req.request_id)
        owner, epoch, _ = await st.c.store.owner(req.request_id)
        error = st.engine.check(make_sequence(req, tokens)) or ""  # deterministic: the same refusal
        await self._publish_result(req, tokens, logprobs, owner, epoch, error=error)
        st.log.info("republished finished result", request_id=req.request_id, tokens=len(tokens))
