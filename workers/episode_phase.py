"""An episode's environment phase on a rollout worker: beside the batch, between model turns.

When a model turn of an episode is over and durable, its tool calls and the environment's reply
run here (`EpisodeRun.advance`, workers/episodes.py), each step fenced into the checkpoint,
while the engine serves the other requests; the episode holds no generation slot meanwhile
(`InFlight.holding_slots`). Then its next turn joins the batch, or it is finished. With
`env.inline = false` a turn that ends in tool calls goes to the environment pool instead
(workers/env_worker.py), which sends it back to the resume lane when its tool results are in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from rlboost import bus, wire
from rlboost.checkpoint import AlreadyFinished, LeaseLost
from rlboost.checkpoint import pack as checkpoint_pack
from rlboost.workers.finish import Finisher
from rlboost.workers.inflight import Active, InFlight


class EpisodePhase:
    def __init__(self, st: InFlight, finisher: Finisher, env_pool: bool) -> None:
        self.st = st
        self.finisher = finisher
        self.env_pool = env_pool  # tool calls go to the environment pool (env.inline = false)
        self.tasks: set[asyncio.Task] = set()

    def put(self, req: wire.RolloutRequest, epoch: int) -> Callable[[wire.EpisodeState], Awaitable[None]]:
        """An episode's state, fenced into its checkpoint under lease `epoch` (retried while the
        store is unreachable; a lost lease raises)."""
        st = self.st

        async def put(state: wire.EpisodeState) -> None:
            await st.retrying(lambda: st.c.store.put_episode(req.request_id, st.worker_id, epoch, state,
                                                             st.cfg.lease_ttl_s))
            if (a := st.active.get(req.request_id)) is not None and a.epoch == epoch:
                a.last_write = time.monotonic()  # the script renewed the lease
        return put

    def start(self, a: Active) -> None:
        """Run an episode's environment phase beside the engine (the batch goes on without it)."""
        a.in_env = time.monotonic()
        task = asyncio.create_task(self._run(a))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.st.notify_slots()  # parked: its slot is free for another request

    async def _run(self, a: Active) -> None:
        """After a durable model turn: its tool calls and the environment's reply, each fenced in
        (`EpisodeRun.advance`); then the next turn joins the batch, or the episode is finished."""
        st, run, rid = self.st, a.episode, a.req.request_id
        assert run is not None

        async def append_env(tokens: list[int], state: wire.EpisodeState) -> int:
            offset, sent = a.durable, time.time()
            n = await st.retrying(lambda: st.c.store.append_env(rid, st.worker_id, a.epoch, offset, tokens,
                                                                state, st.cfg.lease_ttl_s))
            a.seq.token_ids.extend(tokens)
            a.logprobs.extend([0.0] * len(tokens))
            a.durable, a.last_write = n, time.monotonic()
            st.counters.add("env_tokens", len(tokens))
            chunk = wire.FlushChunk(rid, a.epoch, offset, a.req.policy_version,
                                    checkpoint_pack(tokens, [0.0] * len(tokens)), True)
            msg = wire.TokenFlush(step=a.req.step, worker_id=st.worker_id, ts=sent, chunks=[chunk])
            st.outbox.add(wire.token_subject(a.req.step, st.worker_id), wire.encode(msg),
                          {wire.HDR_MSG_ID: wire.flush_msg_id(chunk)})
            return n

        def alive() -> None:
            a.in_env = time.monotonic()

        try:
            # env.inline = false: a turn's tool calls go to the environment pool, and nothing of the
            # episode stays here meanwhile; a turn without calls gets the environment's reply here
            if self.env_pool:
                await run.record_turn(a.seq.token_ids[:a.durable], list(a.logprobs), a.req.policy_version, a.weights,
                                      self.put(a.req, a.epoch))
                if run.snap.phase == "tools" and run.snap.pending is not None and run.snap.pending.turn.tool_calls:
                    await self._to_env_pool(a)
                    return
            more = await run.advance(a.seq.token_ids[:a.durable], list(a.logprobs), a.req.policy_version, a.weights,
                                     self.put(a.req, a.epoch), append_env, alive)
        except (LeaseLost, AlreadyFinished) as e:
            a.in_env = 0.0
            await st.drop_fenced(a, e)
            return
        except Exception as e:  # the store refused a write (a bug, never silent) or the runner broke
            a.in_env = 0.0
            st.log.error("episode step failed; handing the request back", request_id=rid, error=repr(e))
            st.forget(a)
            with contextlib.suppress(Exception):
                await st.c.store.release(rid, a.epoch)
                await a.msg.nak(delay=1.0)
            return
        a.in_env = 0.0
        st.progress_at = time.monotonic()
        if more:
            a.seq.max_new_tokens = run.turn_limit()
            a.done = False
            st.counters.add("episode_turns")
            if st.active.get(rid) is a and not st.draining.is_set():
                st.join_soon()  # the next turn joins the running batch now
            st.wake.set()
            return
        a.done = a.finishing = True
        await self.finisher.finish_safely([a])

    async def _to_env_pool(self, a: Active) -> None:
        """The model turn ended in tool calls, fenced in with them (`record_turn`): the episode
        goes to its pool's environment lane for an environment worker (workers/env_worker.py),
        which sends it back to the resume lane once its tool results are in. Release, publish,
        then ack (as a hand-off): a crash in between leaves the request's message to come back,
        and its claim finds the calls pending and sends the episode again."""
        st, rid = self.st, a.req.request_id
        st.forget(a)  # first: no heartbeat renews (or extends) what is being let go
        try:
            released = await st.retrying(lambda: st.c.store.release(rid, a.epoch))
        except Exception as e:
            released = False
            st.log.warning("could not release for the environment pool", request_id=rid, error=repr(e))
        if not released:  # fenced out (or the store refused): the message comes back, or is someone else's
            return
        (out,) = await bus.publish_batch(
            st.c.js, [(wire.env_subject(st.handoff_pool), a.msg.data,
                       {wire.HDR_MSG_ID: wire.env_handoff_msg_id(rid, a.epoch)})],
            ack_timeout_s=st.cfg.publish_timeout_s, deadline_s=st.cfg.publish_timeout_s * 2)
        if not out.ok:  # released, not sent: the next claim finds the calls pending and sends it again
            st.log.warning("could not send to the environment pool", request_id=rid, error=str(out.error))
            with contextlib.suppress(Exception):
                await a.msg.nak(delay=1.0)
            return
        with contextlib.suppress(Exception):
            await a.msg.ack()
        st.counters.add("to_env_pool")
        await st.outbox.event(a.req, a.epoch, "release", a.durable, detail="tool calls: environment pool")
