"""A rollout worker's engine loop: generate K tokens for the whole batch, then flush.

Each engine call extends every active request by up to K tokens (continuous batching between
calls: a request admitted meanwhile joins the next call, a hand-off interrupts the current one,
`InFlight.join_soon`). Then one flush checkpoints every request's new tokens in one fenced
script call, queues them as one token message per step, and finishes what is done in the
background; an episode whose model turn is over goes to its environment phase instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import numpy as np

from rlboost import wire
from rlboost.checkpoint import AlreadyFinished, LeaseLost
from rlboost.workers.engines.base import RequestError
from rlboost.workers.episode_phase import EpisodePhase
from rlboost.workers.finish import Finisher
from rlboost.workers.handoff import Handoff
from rlboost.workers.inflight import Active, InFlight
from rlboost.workers.versions import Versions


def pack_flush(dirty: list[Active]) -> tuple[list[bytes], list[list[float]]]:
    """Every request's pending tokens as packed checkpoint records, with one numpy pass for the
    whole flush (per request it cost more than the Redis call). Also each request's logprobs as
    float32 values: what the checkpoint keeps."""
    counts = [len(a.pending_tokens) for a in dirty]
    total = sum(counts)
    rec = np.empty(total, dtype=wire.RECORD)
    rec["token"] = np.fromiter(itertools.chain.from_iterable(a.pending_tokens for a in dirty), np.int32, total)
    rec["logprob"] = np.fromiter(itertools.chain.from_iterable(a.pending_logprobs for a in dirty), np.float32, total)
    blob, lps = rec.tobytes(), rec["logprob"].tolist()
    size = wire.RECORD.itemsize
    records, logprobs, at = [], [], 0
    for n in counts:
        records.append(blob[at * size:(at + n) * size])
        logprobs.append(lps[at:at + n])
        at += n
    return records, logprobs


class Generation:
    def __init__(self, st: InFlight, versions: Versions, finisher: Finisher, phase: EpisodePhase, handoff: Handoff,
                 engine_counts: bool) -> None:
        self.st = st
        self.versions = versions
        self.finisher = finisher
        self.phase = phase
        self.handoff = handoff
        self.engine_counts = engine_counts  # the engine reports its tokens itself (`InFlight.tokens_made`)
        self.finishing: set[asyncio.Task] = set()  # background finishes (`flush`)

    async def loop(self) -> None:
        """Generate and flush until drained (returns after the drain's final flush)."""
        st, engine, k = self.st, self.st.engine, self.st.cfg.checkpoint_tokens
        while True:
            st.wake.clear()  # before looking: whatever arrives from here on wakes the wait below
            if self.versions.carry_to and not st.draining.is_set():
                await self.versions.carry_forward()  # after the last call's flush: nothing is pending
            if not st.active:
                st.progress_at = time.monotonic()
                if st.draining.is_set() and st.admitting == 0:
                    return
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(st.wake.wait(), timeout=0.5)
                continue
            batch = [a for a in st.active.values() if not a.done]
            if not batch and not st.draining.is_set() and not any(a.pending_tokens for a in st.active.values()):
                # Only requests being finished: wait for one to leave or for new work. No sign of
                # life here: a finish that cannot complete (the store gone) must let this worker
                # look stalled, as when finishing held up the loop itself.
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(st.wake.wait(), timeout=0.5)
                continue
            st.progress_at = time.monotonic()
            for a in [a for a in batch if a.weights != engine.weights_id]:
                # Cannot happen while the version reservation holds; if it ever did, the tokens
                # would carry the wrong label: refuse to generate them, hand the request back.
                st.log.error("request is not on the loaded weights; handing back", request_id=a.req.request_id,
                             request_weights=a.weights, loaded=engine.weights_id)
                st.counters.add("wrong_weights")
                batch.remove(a)
                st.forget(a)
                with contextlib.suppress(Exception):
                    await st.c.store.release(a.req.request_id, a.epoch)
                    await a.msg.nak()
            if not st.draining.is_set():
                st.stop_engine.clear()
            if batch and not st.draining.is_set():
                try:
                    outs = await engine.generate([a.seq for a in batch], k, stop=st.stop_engine)
                except RequestError as e:  # one request's fault: answer it, serve the rest on
                    bad = st.active.get(e.request_id)
                    if bad is None:  # not one of ours: the engine is confused, not the request
                        st.log.error("engine failed", error=repr(e))
                        st.drain(f"engine failure: {e!r}")
                    else:
                        await self.finisher.fail_active(bad, e.reason)
                    outs = []
                except Exception as e:  # an engine failure must not take the process down silently
                    st.log.error("engine failed", error=repr(e))
                    st.drain(f"engine failure: {e!r}")
                    outs = []
                for a, g in zip(batch, outs, strict=False):
                    toks = a.seq.token_ids
                    toks.extend(g.token_ids)
                    a.pending_tokens.extend(g.token_ids)
                    a.pending_logprobs.extend(g.logprobs)
                    # (seq.max_new_tokens: the request's, or an episode's turn limit)
                    a.done = g.finished or len(toks) >= a.seq.max_new_tokens or (bool(toks) and toks[-1] in a.stops)
                if not self.engine_counts:
                    st.counters.add("generated", sum(len(g.token_ids) for g in outs))
            await self.flush()
            if st.draining.is_set():
                return
            await self.handoff.hand_back_below_floor()

    async def flush(self) -> None:
        """Checkpoint every pending token (one fenced script call), publish them as one token
        message per step, finish what is done."""
        st = self.st
        dirty = [a for a in st.active.values() if a.pending_tokens]
        if dirty:
            # Stamped before the append is sent: a write accepted under a lease can only have been
            # sent before its supersession, so a pause (SIGSTOP) between the store's answer and
            # here cannot make an accepted write look like one sent after a takeover.
            now, mono = time.time(), time.monotonic()
            records, logprobs32 = pack_flush(dirty)
            outcomes = await st.retrying(lambda: st.c.store.append_packed(
                [(a.req.request_id, st.worker_id, a.epoch, a.durable, rec) for a, rec in zip(dirty, records)],
                st.cfg.lease_ttl_s))
            by_step: dict[int, list[wire.FlushChunk]] = {}
            checkpointed = 0
            for a, out, rec, lps in zip(dirty, outcomes, records, logprobs32, strict=True):
                if type(out) is int:
                    pass
                elif isinstance(out, (LeaseLost, AlreadyFinished)):
                    await st.drop_fenced(a, out)
                    continue
                if isinstance(out, Exception):
                    st.log.error("checkpoint append failed", request_id=a.req.request_id, error=str(out))
                    st.forget(a)
                    with contextlib.suppress(Exception):
                        await a.msg.nak(delay=1.0)
                    continue
                by_step.setdefault(a.req.step, []).append(wire.FlushChunk(
                    a.req.request_id, a.epoch, a.durable, a.req.policy_version, rec))
                checkpointed += len(lps)
                a.durable = out
                # What is durable is float32: keep exactly that, so a result does not depend on
                # whether its tokens came from memory or from the checkpoint after a hand-off.
                a.logprobs.extend(lps)
                a.pending_tokens, a.pending_logprobs = [], []
                a.last_write = mono
            st.counters.add("checkpointed", checkpointed)
            for step, chunks in by_step.items():
                for part in wire.split_flush(chunks):
                    msg = wire.TokenFlush(step=step, worker_id=st.worker_id, ts=now, chunks=part)
                    st.outbox.add(wire.token_subject(step, st.worker_id), wire.encode(msg),
                                  {wire.HDR_MSG_ID: wire.flush_msg_id(part[0])})
        # Finished requests are finished in the background: each finish is a few round trips
        # (fenced finish, provenance, result publish, ack) that the next engine call need not
        # wait for. A finishing request keeps its slot until it leaves `active`; a drain waits
        # for these before handing the rest back (RolloutWorker.run).
        done = [a for a in st.active.values() if a.done and not a.pending_tokens and not a.finishing and not a.in_env]
        if any(a.episode is not None for a in done):
            for a in [a for a in done if a.episode is not None and not a.episode.ended]:
                self.phase.start(a)  # a model turn is over and durable: its tools, the env's reply
            done = [a for a in done if a.episode is None or a.episode.ended]
        if done:
            for a in done:
                a.finishing = True
            task = asyncio.create_task(self.finisher.finish_safely(done))
            self.finishing.add(task)
            task.add_done_callback(self.finishing.discard)
        await st.outbox.publish_soon()
