"""The endpoint's side of the dataflow: a call's choices as rollout requests on the pool's work
queue, and their results back, each verified against its checkpoint before it is taken.

One `wire.RolloutRequest` per choice is published through the `PoolClient` under the latest
published policy version; a worker claims it, generates and checkpoints every K tokens in Redis,
so a worker lost mid-turn costs at most K tokens (none with notice) and another worker finishes
the turn: the call just takes longer. One follower of the results subject serves every call
waiting; a result is handed over only once `PoolClient.verify_result` agrees with the checkpoint
(tokens, logprobs, lease, segments). A retried call (the same `Idempotency-Key`) names the same
requests, so a turn generated or under way comes from its checkpoint, never generated again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field

from rlboost import bus, wire
from rlboost.clients import Clients
from rlboost.config import EndpointSettings
from rlboost.endpoint.errors import EndpointError, bad
from rlboost.endpoint.parse import ChatCall
from rlboost.pool_client import PoolClient


@dataclass
class Binding:
    """A session a training run made for one harness process (`rlboost run --harness`,
    rlboost.trainer.harness_task): its calls are requests of the run's step `step`, in GRPO group
    `group`, generated under `version` (not the latest pointer: the step's own version, as a
    native request is), named `<run>-s<step>-p<group>-g<n>` with n counting the session's
    choices. `recorded`: the requests of its answered calls, in order, for the run to collect."""

    session: str
    step: int
    group: int
    version: int
    run: str
    key: str = ""  # the session's API key (OpenAIEndpoint.bind)
    next_sample: int = 0
    idem: dict[str, int] = field(default_factory=dict)  # Idempotency-Key digest -> the call's first sample
    recorded: list[wire.RolloutRequest] = field(default_factory=list)

    def samples(self, n: int, digest: str | None) -> int:
        """The first sample number of a call of `n` choices (the same for a retried key)."""
        if digest is not None and digest in self.idem:
            return self.idem[digest]
        first, self.next_sample = self.next_sample, self.next_sample + n
        if digest is not None:
            self.idem[digest] = first
        return first


def choice_seed(seed: int | None, choice: int) -> int:
    """The sampling key of one choice: derived from the call's seed (the same seed, the same
    choices: a rerun reproduces them), or fresh."""
    if seed is None:
        return secrets.randbits(63)
    digest = hashlib.sha256(f"{seed}/{choice}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class Dataflow:
    """Requests out, verified results back, for one endpoint (`run_id`) on `cfg.pool` at `cfg.step`."""

    def __init__(self, clients: Clients, cfg: EndpointSettings, run_id: str, log, all_steps: bool = False) -> None:
        """`all_steps`: follow the results of every step (a run's endpoint, whose bound sessions'
        calls are requests of the run's steps), not `cfg.step`'s alone."""
        self.c, self.cfg, self.run_id, self.log = clients, cfg, run_id, log
        self.step = cfg.step
        self.all_steps = all_steps
        self.manager = PoolClient(clients, cfg.pool)
        self._pending: dict[str, tuple[wire.RolloutRequest, asyncio.Future]] = {}
        self._calls = 0
        self._follower: asyncio.Task | None = None
        self._sub = None
        self._policy_kv = None

    async def start(self) -> None:
        self._start_seq = (await self.c.js.stream_info(wire.STREAM_RESULTS)).state.last_seq + 1
        self._sub = await self._subscribe(self._start_seq)
        self._follower = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def policy_version(self) -> int:
        """The latest published version (0 before any is): what a call is generated with."""
        if self._policy_kv is None:
            self._policy_kv = await self.c.js.key_value(wire.BUCKET_POLICY)
        try:
            entry = await self._policy_kv.get(wire.WEIGHTS_POINTER_KEY)
        except Exception:  # no version published yet
            return 0
        try:
            return max(0, int((entry.value or b"0").decode()))
        except ValueError:
            return 0

    def requests(self, session: str, call: ChatCall, prompt_ids: list[int], stops: list[int], version: int,
                 idem: str | None, binding: Binding | None = None) -> tuple[str, list[wire.RolloutRequest]]:
        """The call's id and one request per choice. With an Idempotency-Key the ids follow from
        the key, session and call (the same in any life of the endpoint), else from this life's
        run id and call count; a bound session's from its step, group and choice count."""
        run, step, group, seed, first = self.run_id, self.step, self._calls, call.seed, 0
        digest = None
        if idem is not None:
            if not 0 < len(idem) <= 256:
                raise bad("the Idempotency-Key header must be 1-256 characters")
            digest = hashlib.sha256(json.dumps(
                [session, idem, prompt_ids, stops, call.max_tokens, call.temperature, call.top_p, call.n, call.seed],
                separators=(",", ":")).encode()).hexdigest()
            run, group = "i" + digest[:24], 0
            seed = call.seed if call.seed is not None else int(digest[24:40], 16)
        if binding is not None:
            run, step, group = binding.run, binding.step, binding.group
            first = binding.samples(call.n, digest)
            if seed is None:  # a session's choices are seeded like a native request's: fresh, once each
                seed = secrets.randbits(62)
        else:
            self._calls += 1
        reqs = [wire.RolloutRequest(
            request_id=wire.request_id(step, group, first + i, run=run), step=step, policy_version=version,
            prompt_ids=prompt_ids, max_new_tokens=call.max_tokens, seed=choice_seed(seed, i),
            sampling=wire.SamplingParams(temperature=call.temperature, top_p=call.top_p),
            eos_id=stops[0] if stops else -1, stop_ids=stops, group=group) for i in range(call.n)]
        return f"chatcmpl-{run}-{group}" + (f"-{first}" if binding is not None else ""), reqs

    async def results(self, reqs: list[wire.RolloutRequest], retried: bool,
                      bound: bool = False) -> list[wire.RolloutResult]:
        """The requests' verified results, in order: published (a `retried` call's finished ones
        read back from their checkpoints instead), then waited for up to `request_timeout_s`.
        `bound`: a bound session's (`_publish_bound`)."""
        finished: dict[str, wire.RolloutResult] = {}
        if retried:
            for r in reqs:
                if r.request_id not in self._pending and (done := await self._finished(r)) is not None:
                    finished[r.request_id] = done
        loop = asyncio.get_running_loop()
        futs, mine = [], []
        for r in reqs:
            waiting = self._pending.get(r.request_id)
            if waiting is not None:  # the same call, retried while its first attempt still waits
                futs.append(waiting[1])
                continue
            fut = loop.create_future()
            done = finished.get(r.request_id)
            if done is not None:
                fut.set_result(done)
            else:
                self._pending[r.request_id] = (r, fut)
                mine.append(r)
            futs.append(fut)
        try:
            if mine and bound:
                await self._publish_bound(mine)
            elif mine:
                await self.manager.publish_step(mine, deadline_s=30.0, republish=retried)
            try:
                return await asyncio.wait_for(asyncio.gather(*futs), self.cfg.request_timeout_s)
            except TimeoutError:
                raise EndpointError(f"no result within {self.cfg.request_timeout_s:g} s (endpoint.request_timeout_s): "
                                    f"are workers serving pool {self.cfg.pool!r}? The request stays queued under "
                                    f"{reqs[0].request_id}", 504, kind="timeout") from None
        except bus.PublishFailed as e:
            raise EndpointError(f"the request could not be queued: {e}", 503, kind="service_unavailable") from None
        finally:
            for r in mine:
                self._pending.pop(r.request_id, None)

    async def _publish_bound(self, reqs: list[wire.RolloutRequest]) -> None:
        """A bound session's requests, on the pool's queue under a message id of their own
        (`<request id>.endpoint`): the run's orchestrator publishes the same requests again when
        it collects the step (its `publish_step` refuses an id the queue's de-duplication window
        holds). That second message finds the checkpoint finished, and the worker that takes it
        publishes the result again (the results stream drops the copy) and acks it."""
        subject = wire.request_subject(self.cfg.pool)
        now = time.time()
        msgs: list[bus.Outgoing] = [(subject, wire.encode(r), {wire.HDR_MSG_ID: f"{r.request_id}.endpoint"})
                                    for r in reqs]
        msgs += [(wire.event_subject(r.step, r.request_id),
                  wire.encode(wire.LeaseEvent(request_id=r.request_id, step=r.step, worker_id="endpoint", epoch=0,
                                              kind="publish", offset=0, ts=now, detail=subject)),
                  {wire.HDR_MSG_ID: wire.event_msg_id(r.request_id, "publish", 0, 0)}) for r in reqs]
        outcomes = await bus.publish_batch(self.c.js, msgs, ack_timeout_s=5.0, deadline_s=30.0)
        failed = [(r.request_id, out.error) for r, out in zip(reqs, outcomes[:len(reqs)], strict=True) if not out.ok]
        if failed:
            raise bus.PublishFailed("requests", [rid for rid, _ in failed], f"no ack within 30 s: {failed[0][1]}")

    async def _finished(self, req: wire.RolloutRequest) -> wire.RolloutResult | None:
        """A retried call's request whose checkpoint is finished: its result, read back from the
        checkpoint (the tokens, logprobs and segments a result is verified against). None if it
        is not finished (never published, queued, or under way: published again, and its result
        comes on the stream)."""
        try:
            owner, epoch, finished = await self.c.store.owner(req.request_id)
            if not finished:
                return None
            tokens, logprobs = await self.c.store.read(req.request_id)
            segments = await self.c.store.segments(req.request_id)
        except Exception as e:
            raise EndpointError(f"{req.request_id}: the checkpoint store does not answer ({e}); retry the call", 503,
                                kind="service_unavailable") from None
        if not wire.is_complete(req, tokens):
            raise EndpointError(f"{req.request_id}: this call was answered before with an error (the engine could "
                                "not serve it); send it with another Idempotency-Key to try again", 400)
        return wire.RolloutResult(
            request_id=req.request_id, step=req.step, group=req.group, prompt_ids=list(req.prompt_ids),
            token_ids=tokens, logprobs=logprobs, segments=segments,
            finish_reason=wire.finish_reason(req, tokens), worker_id=owner, epoch=epoch, ts=time.time())

    async def _subscribe(self, start_seq: int):
        from nats.js.api import ConsumerConfig, DeliverPolicy

        subject = "rb.res.*" if self.all_steps else wire.result_subject(self.step)
        return await self.c.js.subscribe(
            subject, stream=wire.STREAM_RESULTS, ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq))

    async def _follow(self) -> None:
        """One follower of the endpoint's results subject for every call (not one per call from
        the stream's start): each result is verified against its checkpoint, then handed to the
        call waiting for it. The checkpoint scripts are loaded again every few seconds (a
        restarted Redis forgets them, and workers may only run them)."""
        scripts_at = 0.0
        seen = 0  # the stream sequence of the last result taken off the subscription
        while True:
            if time.monotonic() - scripts_at > 5.0:
                scripts_at = time.monotonic()
                with contextlib.suppress(Exception):
                    await self.c.store.load_scripts()
            try:
                msg = await self._sub.next_msg(timeout=0.5)
            except TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a subscription the connection lost: follow again after the last one seen
                self.log.warning("results subscription lost, following again", error=str(e), after=seen)
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):
                    self._sub = await self._subscribe(seen + 1 if seen else self._start_seq)
                continue
            with contextlib.suppress(Exception):
                seen = msg.metadata.sequence.stream
            try:
                r = wire.decode(wire.RolloutResult, msg.data)
            except wire.WireError:
                continue
            waiting = self._pending.get(r.request_id)
            if waiting is None or waiting[1].done():
                continue  # another endpoint's, or a duplicate
            req, fut = waiting
            reason = await self._verify(r, req)
            if reason is None:  # Redis did not answer: the call fails, the server serves on
                if not fut.done():
                    fut.set_exception(EndpointError(f"{r.request_id}: the result cannot be checked against its "
                                                    "checkpoint (Redis unreachable); retry the call", 503,
                                                    kind="service_unavailable"))
                continue
            if reason:
                self.log.warning("result refused", request_id=r.request_id, reason=reason)
                with contextlib.suppress(Exception):
                    await bus.dead_letter(self.c.js, msg, f"result for {r.request_id} refused: {reason}",
                                          wire.STREAM_RESULTS, ack=False)
                continue
            if not fut.done():
                fut.set_result(r)

    async def _verify(self, r: wire.RolloutResult, req: wire.RolloutRequest) -> str | None:
        """`PoolClient.verify_result`'s reason ('' = genuine), retried while Redis does not
        answer (a restart, a failover); None if it never did."""
        for attempt in range(6):
            try:
                return await self.manager.verify_result(req.step, r, req)
            except Exception as e:
                self.log.warning("cannot verify a result yet", request_id=r.request_id, error=str(e), attempt=attempt)
                await asyncio.sleep(0.25 * 2 ** attempt)
        return None
