"""`rlboost env-worker`: an environment worker: runs episodes' tool calls off the GPUs.

With `env.inline = false`, a generation worker whose model turn ends in tool calls fences the
turn and its pending calls into the checkpoint, releases its lease and sends the episode to its
pool's environment lane (`wire.env_subject`): its slot goes to other requests at once, however
long the tools take. An environment worker (a CPU machine; scaled like workers, on the lane's
depth) then:

1. takes an episode from the lane (`wire.ENV_CONSUMER`: every pool's) and claims its lease
   (`inherit`: the checkpoint's history keeps the model's version and weights labels);
2. runs the pending calls and the environment's reply exactly as a generation worker does
   inline (`EpisodeRun.env_phase`): each result fenced in before the next call starts, each
   call with its idempotency key, the reply's tokens appended with the state that follows them;
3. releases the lease, sends the episode back to the pool's resume lane (one message per tool
   phase, `wire.env_return_msg_id`, whoever sends it) and acks.

Preemption. With notice (SIGTERM) it takes no more episodes and lets the running tool phases
finish within `worker.drain_grace_s`: no call runs twice; one still running at the deadline is
handed back (lease released, message nak'ed: the next worker reuses every result fenced so far
and runs the rest with the same keys). Without notice (SIGKILL) the message comes back after
ack_wait and the lease expires: the same, plus the call that was under way runs again with its
key (the environment can de-duplicate on it).

A message whose episode has left its tools phase was served already (a worker died between
sending it back and acking): it is sent back again under the same id (the stream drops the
duplicate) and acked. No message, tool or environment can stop this process: a bad message is
dead-lettered, an episode the worker cannot run is answered with an `error` result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg

from rlboost import bus, episodes, metrics, wire
from rlboost.checkpoint import AlreadyFinished, CorruptCheckpoint, LeaseHeld, LeaseLost
from rlboost.checkpoint import pack as checkpoint_pack
from rlboost.clients import Clients
from rlboost.clients import open_clients
from rlboost.config import ConfigError, EnvSettings, Settings, WorkerSettings, apply_overrides, parse_overrides
from rlboost.logs import get_logger
from rlboost.services import resolve_urls
from rlboost.workers.counters import Counters
from rlboost.workers.episodes import EpisodeHost, EpisodeRefused
from rlboost.workers.main import WORKER_NATS_OPTIONS, exit_after_grace
from rlboost.workers.inflight import make_worker_id, publish_result, retrying

T = TypeVar("T")


class EnvWorker:
    """Serves every pool's environment lane until drained (`run`)."""

    def __init__(self, settings: WorkerSettings, env: EnvSettings, clients: Clients, worker_id: str | None = None,
                 counters: Counters | None = None, tokenizer=None) -> None:
        self.cfg, self.c = settings, clients
        self.worker_id = wire.check_name("worker id", worker_id or make_worker_id("env"))
        self.slots = env.pool_slots
        # the environments it may run (built-ins and its [env] ref) and their chat format: the
        # model directory's tokenizer (no engine here)
        self.host = EpisodeHost(None, settings.model_dir, env, self.worker_id, tokenizer=tokenizer)
        self.env_ref = env.ref
        self.counters = counters or Counters()
        self.log = get_logger(component="env-worker", worker_id=self.worker_id)
        self.draining = asyncio.Event()
        self.drain_reason = ""
        self.serving: dict[asyncio.Task, tuple[Msg, list]] = {}  # task -> (message, [request id, epoch] once claimed)
        self._slot_freed = asyncio.Event()
        self._sending: set[asyncio.Task] = set()  # token chunks and lease events on their way

    def request_drain(self, reason: str) -> None:
        if not self.draining.is_set():
            self.drain_reason = reason
            self.draining.set()
            self.log.info("draining", reason=reason, serving=len(self.serving))

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_drain, f"signal {sig.name}")

    async def run(self) -> None:
        spec = wire.ConsumerSpec(ack_wait_s=self.cfg.ack_wait_s, max_deliver=self.cfg.max_deliver)
        if await bus.join_pool(self.c.js, wire.ENV_CONSUMER, spec, stop=self.draining,
                               configs=[bus.env_consumer_config(spec)]) is None:
            return
        # its environment's code and the chat format, loaded before the first pull (a refusal
        # here is a configuration error of this worker: it stops with the reason, takes nothing)
        await asyncio.to_thread(self.host.preload, self.env_ref)
        sub = await self.c.js.pull_subscribe_bind(durable=wire.ENV_CONSUMER, stream=wire.STREAM_REQUESTS)
        keep_alive = asyncio.create_task(self._keep_alive())
        self.log.info("environment worker started", slots=self.slots)
        try:
            await self._feed(sub)
        finally:
            with contextlib.suppress(Exception):
                await bus.hand_back_buffered(sub)
                await sub.unsubscribe()
            if self.serving:  # the running tool phases finish within the grace; the rest go back
                _, late = await asyncio.wait(list(self.serving), timeout=self.cfg.drain_grace_s * 0.8)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
            keep_alive.cancel()
            await asyncio.gather(keep_alive, *self._sending, return_exceptions=True)
            self.log.info("environment worker stopped", reason=self.drain_reason, **self.counters.snapshot())

    async def _feed(self, sub) -> None:
        while not self.draining.is_set():
            free = self.slots - len(self.serving)
            if free <= 0:
                self._slot_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), timeout=0.5)
                continue
            # one at a time: nats-py's fetch(n) on an empty lane waits for all n (or its timeout),
            # and an episode waiting here is a turn not generated; fetch(1) returns on arrival
            fetch = asyncio.ensure_future(sub.fetch(batch=1, timeout=0.5))
            stop = asyncio.ensure_future(self.draining.wait())
            await asyncio.wait([fetch, stop], return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            try:
                msgs = await fetch  # a drain waits out the fetch's linger: what it brings goes back below
            except (TimeoutError, asyncio.TimeoutError):
                continue
            except Exception as e:  # the server gone for a moment: back off, do not crash
                self.log.warning("fetch failed", error=str(e))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                if self.draining.is_set():
                    with contextlib.suppress(Exception):
                        await msg.nak()
                    continue
                task = asyncio.create_task(self._serve(msg))
                self.serving[task] = (msg, [])
                task.add_done_callback(self._done)

    def _lease_of_current_task(self) -> list:
        """[request id, epoch] of the lease the running `_serve` holds (empty: none to renew)."""
        entry = self.serving.get(asyncio.current_task())  # type: ignore[arg-type]
        return entry[1] if entry is not None else []

    def _done(self, task: asyncio.Task) -> None:
        self.serving.pop(task, None)
        self._slot_freed.set()

    async def _keep_alive(self) -> None:
        """Tools may run for minutes: every heartbeat, each served message's ack_wait is extended
        and each lease renewed (a fenced write renews it too, but a long call writes nothing)."""
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            for msg, lease in list(self.serving.values()):
                with contextlib.suppress(Exception):
                    await msg.in_progress()
                if lease:
                    with contextlib.suppress(Exception):
                        await self.c.store.renew(lease[0], self.worker_id, lease[1], self.cfg.lease_ttl_s)

    async def _serve(self, msg: Msg) -> None:
        try:
            pool = wire.env_lane_pool(msg.subject)
            req = wire.decode(wire.RolloutRequest, msg.data)
            if req.episode is None:
                raise wire.WireError(f"{req.request_id}: not an episode (the environment lane takes episodes only)")
        except wire.WireError as e:
            with contextlib.suppress(Exception):
                await bus.dead_letter(self.c.js, msg, str(e), wire.STREAM_REQUESTS)
                self.counters.add("dead_lettered")
            return
        rid = req.request_id
        log = self.log.bind(request_id=rid, step=req.step, policy_version=req.policy_version)
        queued_s = _queued_s(msg)
        epoch = 0
        try:
            try:
                # the environment lane is a hand-off (any worker credential publishes there): taken
                # only for the request the trainer published, with its spec (else dead-lettered)
                claim = await self.c.store.claim(rid, self.worker_id, req.policy_version, self.cfg.lease_ttl_s,
                                                 episode=True, inherit=True, spec=wire.spec_digest(req),
                                                 handoff=True)
            except AlreadyFinished:  # finished by a generation worker: nothing left to run
                await msg.ack()
                return
            except LeaseHeld as e:
                state = await self.c.store.episode(rid)
                if state is not None and _phase(state) != "tools":  # past its tools, in someone's hands
                    await msg.ack()
                else:  # another environment worker runs them (or is about to let go)
                    await msg.nak(delay=max(0.05, e.retry_after_s))
                return
            epoch = claim.epoch
            self._lease_of_current_task()[:] = [rid, epoch]  # the keep-alive renews it from now on
            await self._event(req, epoch, "claim", len(claim.token_ids), "environment worker")
            state = claim.episode
            if state is not None and _phase(state) == "tools":
                state = await self._tools(req, claim, epoch)
                log.info("tool phase done", epoch=epoch, turn=state.turn, done=state.done, queued_s=queued_s)
            await self._send_back(msg, req, pool, epoch, state, state.at if state else len(claim.token_ids))
        except EpisodeRefused as e:
            await self._refuse(msg, req, epoch, claim.token_ids, claim.logprobs, str(e))
        except (CorruptCheckpoint, episodes.EpisodeStateError) as e:
            with contextlib.suppress(Exception):
                await bus.dead_letter(self.c.js, msg, f"corrupt checkpoint: {e}", wire.STREAM_REQUESTS)
                self.counters.add("dead_lettered")
        except (LeaseLost, AlreadyFinished) as e:  # someone else's now: the message is theirs to settle
            log.warning("lease lost during the tool phase", epoch=epoch, reason=str(e))
            self.counters.add("fenced")
        except asyncio.CancelledError:  # the drain's grace is over: back to the lane, fenced results kept
            await self._hand_back(msg, rid, epoch)
            raise
        except Exception as e:  # the store, the wire, a bug: never the process
            log.error("tool phase failed; handing the episode back", error=repr(e))
            await self._hand_back(msg, rid, epoch, delay=1.0)

    async def _tools(self, req: wire.RolloutRequest, claim, epoch: int) -> wire.EpisodeState:
        """The pending calls and the environment's reply, each fenced in (`EpisodeRun.env_phase`)."""
        rid = req.request_id
        durable = [len(claim.token_ids)]

        async def put(state: wire.EpisodeState) -> None:
            await self._retrying(lambda: self.c.store.put_episode(rid, self.worker_id, epoch, state,
                                                                  self.cfg.lease_ttl_s))

        async def append_env(tokens: list[int], state: wire.EpisodeState) -> int:
            offset, sent = durable[0], time.time()
            n = await self._retrying(lambda: self.c.store.append_env(rid, self.worker_id, epoch, offset, tokens, state,
                                                                     self.cfg.lease_ttl_s))
            durable[0] = n
            self.counters.add("env_tokens", len(tokens))
            chunk = wire.FlushChunk(rid, epoch, offset, req.policy_version, checkpoint_pack(tokens, [0.0] * len(tokens)),
                                    True)
            flush = wire.TokenFlush(step=req.step, worker_id=self.worker_id, ts=sent, chunks=[chunk])
            await self._publish(wire.token_subject(req.step, self.worker_id), wire.encode(flush),
                                wire.flush_msg_id(chunk))
            return n

        run = await self.host.open(req, claim.episode, claim.token_ids, claim.logprobs, put)
        await run.env_phase(claim.episode.at, put, append_env, lambda: None)
        self.counters.add("tool_phases")
        self.counters.add("tool_calls", len(run.calls) - len(claim.episode.calls))
        return run.stored or claim.episode

    async def _send_back(self, msg: Msg, req: wire.RolloutRequest, pool: str, epoch: int,
                         state: wire.EpisodeState | None, at: int) -> None:
        """Release, send to the pool's resume lane (one id per tool phase), then ack."""
        rid = req.request_id
        self._lease_of_current_task().clear()  # first: the keep-alive no longer renews it
        await self._retrying(lambda: self.c.store.release(rid, epoch))
        turn, done = (state.turn, state.done) if state is not None else (0, False)
        (out,) = await bus.publish_batch(self.c.js, [(wire.resume_subject(pool), msg.data,
                                                      {wire.HDR_MSG_ID: wire.env_return_msg_id(rid, turn, done)})],
                                         ack_timeout_s=self.cfg.publish_timeout_s,
                                         deadline_s=self.cfg.publish_timeout_s * 2)
        if not out.ok:  # not sent: the message comes back to this lane, finds the phase over, sends it
            self.log.warning("could not send the episode back", request_id=rid, error=str(out.error))
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)
            return
        with contextlib.suppress(Exception):
            await msg.ack()
        self.counters.add("sent_back")
        await self._event(req, epoch, "release", at, f"tools done: {pool} resume lane")

    async def _hand_back(self, msg: Msg, rid: str, epoch: int, delay: float = 0.0) -> None:
        self._lease_of_current_task().clear()
        with contextlib.suppress(Exception):
            if epoch:
                await self.c.store.release(rid, epoch)
            await msg.nak(delay=delay or None)
            self.counters.add("handed_back")

    async def _refuse(self, msg: Msg, req: wire.RolloutRequest, epoch: int, tokens: list[int], logprobs: list[float],
                      reason: str) -> None:
        """An episode this worker cannot run (an environment it does not have): finished under
        its lease with an `error` result that says why, as a generation worker refuses one."""
        rid = req.request_id
        self.counters.add("request_errors")
        self.log.warning("episode refused", request_id=rid, reason=reason)
        try:
            await self._retrying(lambda: self.c.store.finish(rid, epoch, len(tokens)))
            await publish_result(self.c, req, tokens, logprobs, self.worker_id, epoch, reason,
                                 self.cfg.publish_timeout_s)
            await msg.ack()
        except (LeaseLost, AlreadyFinished):
            return
        except Exception as e:  # finished in the checkpoint: a generation worker republishes it on redelivery
            self.log.warning("error result publish failed", request_id=rid, error=repr(e))

    async def _event(self, req: wire.RolloutRequest, epoch: int, kind: str, offset: int, detail: str) -> None:
        ev = wire.LeaseEvent(request_id=req.request_id, step=req.step, worker_id=self.worker_id, epoch=epoch,
                             kind=kind, offset=offset, ts=time.time(), detail=detail)  # type: ignore[arg-type]
        await self._publish(wire.event_subject(req.step, req.request_id), wire.encode(ev),
                            wire.event_msg_id(req.request_id, kind, epoch, offset))

    async def _publish(self, subject: str, data: bytes, msg_id: str) -> None:
        """Token chunks and lease events: what replay reads, not the durability path (the
        checkpoint is). Sent in the background: an episode does not wait for their acks (a
        round trip each, per tool phase); a failure is logged, never raised."""
        async def send() -> None:
            (out,) = await bus.publish_batch(self.c.js, [(subject, data, {wire.HDR_MSG_ID: msg_id})],
                                             ack_timeout_s=self.cfg.publish_timeout_s,
                                             deadline_s=self.cfg.publish_timeout_s)
            if not out.ok:
                self.log.warning("publish failed", subject=subject, error=str(out.error))

        task = asyncio.create_task(send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        return await retrying(op, self.log)  # the store unreachable for a moment (the message stays in progress)


def _queued_s(msg: Msg) -> float:
    """How long the message waited in the lane (its stream timestamp to now), -1 if unknown."""
    try:
        return round(time.time() - msg.metadata.timestamp.timestamp(), 3)
    except Exception:
        return -1.0


def _phase(state: wire.EpisodeState) -> str:
    return episodes.snapshot(state).phase



# ---------------------------------------------------------------- the process


async def serve(s: Settings, worker_id: str, counters: Counters) -> None:
    # its environment's code and the model's chat format, checked before connecting: a worker
    # that cannot run them says why and takes nothing
    await asyncio.to_thread(EpisodeHost(None, s.worker.model_dir, s.env, worker_id).preload, s.env.ref)
    nats_url, redis_url = resolve_urls(s.services)
    async with open_clients(nats_url, redis_url, f"rlboost-env-worker-{worker_id}", settings=s,
                            wait_provisioned=True, nats_options=WORKER_NATS_OPTIONS) as c:
        if s.metrics.port:  # as workers/main.py: what compose's health check and k8s's readiness probe read
            port = metrics.start_metrics_server(s.metrics.port, s.metrics.bind)
            get_logger(worker_id=worker_id).info("metrics served", url=f"http://{s.metrics.bind}:{port}/metrics")
        worker = EnvWorker(s.worker, s.env, c, worker_id=worker_id, counters=counters)
        worker.install_signal_handlers()
        watchdog = asyncio.create_task(exit_after_grace(worker))
        try:
            await worker.run()
        finally:
            watchdog.cancel()


def main(argv: list[str], s: Settings) -> int:
    p = argparse.ArgumentParser(prog="rlboost env-worker", description=__doc__.splitlines()[0],
                                epilog="Any setting: --section.key VALUE (e.g. --env.tool_timeout_s 60).")
    p.add_argument("--env", help="an environment it may run besides the built-ins ([env] ref: module:fn, file.py:fn)")
    p.add_argument("--model-dir", help="the model's Hugging Face directory: its tokenizer writes the environment's "
                   "replies in the model's chat format (as the generation workers' does)")
    p.add_argument("--slots", type=int, help=f"episodes whose tools run at once (default: {s.env.pool_slots})")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--counters", default=None, help="file for crash-proof counters (read by benchmarks)")
    a, rest = p.parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        if a.env is not None:
            overrides.setdefault("env", {})["ref"] = a.env
        if a.slots is not None:
            overrides.setdefault("env", {})["pool_slots"] = a.slots
        if a.model_dir is not None:
            overrides.setdefault("worker", {})["model_dir"] = a.model_dir
        s = apply_overrides(s, overrides)
    except ConfigError as e:
        p.error(str(e))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_id = a.worker_id or make_worker_id("env")
    try:
        asyncio.run(serve(s, worker_id, Counters(a.counters)))
    except ConnectionError as e:
        get_logger(worker_id=worker_id).error("cannot connect", error=str(e))
        return 1
    return 0
