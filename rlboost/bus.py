"""The NATS side of the wire: connect, provision streams/consumers/buckets, dead-letter.

Provisioning is idempotent: every process that joins (manager, trainer, worker) calls
`provision()`; the first creates, the rest find everything in place (and a changed config in
`rlboost.wire` updates the stream instead of failing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from rlboost import auth, wire
from rlboost.config import ServicesSettings
from rlboost.errors import RlboostError
from rlboost.logs import get_logger

log = get_logger(component="bus")

_RETENTION = {"limits": RetentionPolicy.LIMITS, "workqueue": RetentionPolicy.WORK_QUEUE}


async def connect(url: str, name: str = "rlboost", services: ServicesSettings | None = None, **kwargs: Any) -> NATS:
    """Connect with reconnects on; a clear error if nobody answers or the credentials are refused.

    `services`: the client identity settings of this process, applied here so that every
    connection honours them: TLS (a CA to verify the server, a client certificate for mutual
    TLS) and an nkey seed (`rlboost.auth.nats_connect_options`). Explicit kwargs win.

    With unlimited reconnects nats-py retries a refused login forever, so the first
    authorization violation during the initial connect ends the attempt with a ConnectionError
    that says so (after connecting, e.g. a rotated password, it keeps retrying as before)."""
    if services is not None:
        kwargs = {**auth.nats_connect_options(services), **kwargs}
    user_cb = kwargs.pop("error_cb", None)
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    async def error_cb(e: Exception) -> None:
        text = str(e).lower()
        if not refused.done() and ("authorization violation" in text or "authentication" in text
                                   or isinstance(e, (nats.errors.AuthorizationError, ssl.SSLError))):
            refused.set_result(e)  # a TLS handshake that fails is as final as a refused password
        if user_cb is not None:
            await user_cb(e)
        else:
            log.warning("nats error", error=str(e) or type(e).__name__)

    # nats-py sends URL credentials as they stand; URLs carry them %-encoded (rlboost.services).
    # A cluster is a comma-separated list of URLs: the client fails over between them.
    servers, shown_all = [], []
    for one in url.split(","):
        parts = urlsplit(one.strip())
        if parts.username is not None and "user" not in kwargs:
            kwargs["user"] = unquote(parts.username)
            kwargs["password"] = unquote(parts.password or "")
        if parts.username is not None:
            servers.append(urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1])))
            shown_all.append(f"{parts.scheme}://***@{parts.netloc.rsplit('@', 1)[1]}")
        else:
            servers.append(one.strip())
            shown_all.append(_redact(one.strip()))
    shown = ",".join(shown_all)
    kwargs.setdefault("reconnect_time_wait", 0.5)  # a restarted server is found within half a second
    nc = NATS()
    attempt = asyncio.ensure_future(nc.connect(servers if len(servers) > 1 else servers[0], name=name, connect_timeout=5, max_reconnect_attempts=-1,
                                               drain_timeout=2, allow_reconnect=True, error_cb=error_cb, **kwargs))
    try:
        await asyncio.wait({attempt, refused}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not attempt.done():
            attempt.cancel()
            with contextlib.suppress(BaseException):
                await attempt
            with contextlib.suppress(Exception):
                await nc.close()
    if refused.done() and not nc.is_connected and isinstance(refused.result(), ssl.SSLError):
        raise ConnectionError(
            f"NATS at {shown}: TLS handshake failed ({refused.result()}); check services.nats_tls_ca / "
            f"nats_tls_cert / nats_tls_key (RLBOOST_SERVICES__NATS_TLS_CA, ...)")
    if refused.done() and not nc.is_connected:
        raise ConnectionError(
            f"NATS at {shown} refused the credentials (authorization violation: {refused.result()}); "
            f"check services.nats_user / nats_password (RLBOOST_SERVICES__NATS_USER / RLBOOST_SERVICES__NATS_PASSWORD)")
    refused.cancel()
    try:
        attempt.result()
    except Exception as e:  # nats-py raises a zoo of types here (NoServersError, OSError, auth)
        raise ConnectionError(f"cannot connect to NATS at {shown}: {e}") from e
    return nc


class PublishFailed(RlboostError, RuntimeError):
    """Some messages were not stored (no ack in time, after every retry); `ids` names them."""

    def __init__(self, what: str, ids: list[str], cause: str) -> None:
        shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
        super().__init__(f"{len(ids)} {what} not stored: {shown} ({cause})")
        self.ids = ids


Outgoing = tuple[str, bytes, dict[str, str]]  # (subject, payload, headers with a Nats-Msg-Id)


@dataclass(frozen=True, slots=True)
class Published:
    """The outcome of one message of `publish_batch`: its ack, or the last error."""

    ack: PubAck | None
    error: Exception | None
    attempts: int

    @property
    def ok(self) -> bool:
        return self.ack is not None

    @property
    def taken_before(self) -> bool:
        """The stream already held this Nats-Msg-Id at the first attempt: someone else's
        message with our id (a retry finding it is just our own earlier attempt)."""
        return self.ack is not None and bool(self.ack.duplicate) and self.attempts == 1


async def publish_batch(js: JetStreamContext, msgs: list[Outgoing], *, ack_timeout_s: float = 5.0,
                        deadline_s: float = 15.0) -> list[Published]:
    """Publish `msgs` with their acks in flight together; every wait is bounded.

    nats-py's `publish_async` futures have no timeout: an ack lost to a server restart leaves
    its future pending forever (and holds one of nats-py's pending-publish permits). Here each
    round waits at most `ack_timeout_s`, cancels what did not answer (releasing the permits) and
    publishes those again with the same headers, until `deadline_s`. Each message must carry a
    `Nats-Msg-Id`: a retried message that was stored after all is dropped by the stream as a
    duplicate, so "retry" never means "twice". One outcome per message, in order."""
    outcomes: list[PubAck | Exception | None] = [None] * len(msgs)
    attempts = [0] * len(msgs)
    todo = list(range(len(msgs)))
    deadline = time.monotonic() + deadline_s
    backoff = 0.1
    while todo:
        futures: dict[int, asyncio.Future] = {}
        for i in todo:
            subject, data, headers = msgs[i]
            attempts[i] += 1
            try:
                # No wait_stall: with one, nats-py wraps every publish in a task (an event-loop
                # turn each); its pending-publish permits are bounded anyway, since every
                # future that outlives ack_timeout_s is cancelled below, which releases it.
                futures[i] = await js.publish_async(subject, data, headers=headers)
            except Exception as e:  # stalled (too many pending), disconnected with a full buffer
                outcomes[i] = e
        if futures:
            _, pending = await asyncio.wait(futures.values(), timeout=ack_timeout_s)
            for f in pending:
                f.cancel()
        retry = []
        for i in todo:
            f = futures.get(i)
            if f is not None and f.done() and not f.cancelled() and f.exception() is None:
                outcomes[i] = f.result()
                continue
            if f is not None:
                outcomes[i] = (f.exception() if f.done() and not f.cancelled()
                               else TimeoutError(f"no ack in {ack_timeout_s:g} s"))
            retry.append(i)
        todo = retry
        if not todo or time.monotonic() + backoff >= deadline:
            break
        log.warning("publishes unacknowledged, retrying with the same Nats-Msg-Id", count=len(todo),
                    error=str(outcomes[todo[0]]))
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 1.0)
    return [Published(o, None, n) if isinstance(o, PubAck) else Published(None, o, n)  # type: ignore[arg-type]
            for o, n in zip(outcomes, attempts, strict=True)]


def _redact(url: str) -> str:
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def stream_config(spec: wire.StreamSpec, replicas: int = 1, max_age_s: float | None = None) -> StreamConfig:
    """`max_age_s`: the configured retention (`[services.retention]`; 0 = forever) instead of the
    spec's default. The de-duplication window never outlasts the messages (JetStream refuses
    a window longer than the max age)."""
    age = spec.max_age_s if max_age_s is None else max_age_s
    return StreamConfig(
        num_replicas=replicas,
        name=spec.name,
        subjects=list(spec.subjects),
        retention=_RETENTION[spec.retention],
        storage=StorageType.FILE,
        max_age=age or None,
        duplicate_window=min(spec.duplicate_window_s, age) if age else spec.duplicate_window_s,
    )


def pool_consumer_configs(pool: str, spec: wire.ConsumerSpec) -> list[ConsumerConfig]:
    """The pool's fresh-request lane and its resume (hand-off) lane."""
    return [ConsumerConfig(
        durable_name=name,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait_s,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        filter_subject=subject,
    ) for name, subject in ((wire.consumer_name(pool), wire.request_subject(pool)),
                            (wire.resume_consumer_name(pool), wire.resume_subject(pool)))]


def env_consumer_config(spec: wire.ConsumerSpec) -> ConsumerConfig:
    """The environment lane of every pool (`wire.ENV_FILTER`): environment workers share it."""
    return ConsumerConfig(durable_name=wire.ENV_CONSUMER, ack_policy=AckPolicy.EXPLICIT, ack_wait=spec.ack_wait_s,
                          max_deliver=spec.max_deliver, max_ack_pending=spec.max_ack_pending,
                          filter_subject=wire.ENV_FILTER)


async def provision(js: JetStreamContext, pools: tuple[str, ...] = (), consumer: wire.ConsumerSpec | None = None,
                    registry_ttl_s: float = 10.0, replicas: int = 1, ages: dict[str, float] | None = None) -> None:
    """Create or update every stream, the pools' consumers and the KV buckets. `replicas`:
    their replication on a JetStream cluster, for what this call creates (existing ones keep theirs).
    `ages`: max age per stream name (`RetentionSettings.stream_ages`), applied to existing streams
    too; without it a stream is created with its spec's age and an existing one keeps its own,
    so a process that was not given the retention (a worker, a bench client) never resets it."""
    for spec in wire.STREAMS:
        cfg = stream_config(spec, replicas, None if ages is None else ages.get(spec.name))
        try:
            info = await js.stream_info(spec.name)
            if ages is None or spec.name not in ages:  # keep the age (and window) it was given
                cfg.max_age, cfg.duplicate_window = info.config.max_age, info.config.duplicate_window
            if not _same_stream(info.config, cfg):  # unchanged: no update (a worker may not)
                cfg.num_replicas = info.config.num_replicas  # an update never rescales
                await js.update_stream(cfg)
        except NotFoundError:
            try:
                await js.add_stream(cfg)
            except BadRequestError:  # a concurrent provisioner won the race
                await js.update_stream(cfg)
    for pool in pools:
        await ensure_pool_consumer(js, pool, consumer or wire.ConsumerSpec())
    if pools:
        await _ensure_consumers(js, [env_consumer_config(consumer or wire.ConsumerSpec())])
    await _kv(js, KeyValueConfig(bucket=wire.BUCKET_WORKERS, ttl=registry_ttl_s, history=1, replicas=replicas))
    await _kv(js, KeyValueConfig(bucket=wire.BUCKET_POLICY, history=5, replicas=replicas))
    await _kv(js, KeyValueConfig(bucket=wire.BUCKET_CONTROL, history=1, replicas=replicas))
    # who holds which weight blob ([weights] peers): entries nobody touched for a day are dropped
    await _kv(js, KeyValueConfig(bucket=wire.BUCKET_PEERS, history=1, ttl=24 * 3600.0, replicas=replicas))


def _same_stream(have: StreamConfig, want: StreamConfig) -> bool:
    def secs(v: float | None) -> float:
        return float(v or 0.0)

    return (sorted(have.subjects or []) == sorted(want.subjects or []) and have.retention == want.retention
            and have.storage == want.storage and abs(secs(have.max_age) - secs(want.max_age)) < 1e-3
            and abs(secs(have.duplicate_window) - secs(want.duplicate_window)) < 1e-3)


async def ensure_pool_consumer(js: JetStreamContext, pool: str, spec: wire.ConsumerSpec) -> None:
    """Create or update the pool's consumers, but only where they are missing or differ: the
    worker identity may read consumer info and never (re)configure a consumer (rlboost/auth.py),
    so a worker joining a pool the trainer provisioned makes no forbidden call."""
    wire.check_name("pool", pool)
    await _ensure_consumers(js, pool_consumer_configs(pool, spec))


async def _ensure_consumers(js: JetStreamContext, configs: list[ConsumerConfig]) -> None:
    for cfg in configs:
        try:
            have = (await js.consumer_info(wire.STREAM_REQUESTS, cfg.durable_name)).config
            if _same_consumer(have, cfg):
                continue
        except NotFoundError:
            pass
        await js.add_consumer(wire.STREAM_REQUESTS, cfg)


# What a refused JetStream API call looks like to nats-py: the server drops a request its
# permissions deny (the client only hears a timeout, the violation goes to the error callback);
# no responders / no leader while a server starts or restarts read the same to a joiner: wait.
_REFUSED = (nats.errors.TimeoutError, nats.errors.NoRespondersError, ServiceUnavailableError)
JOIN_API_TIMEOUT_S = 2.0  # a (re)configure call the worker identity may not make is not answered at all
_REFUSED_POOLS: set[str] = set()  # pools whose consumers this process was refused to reconfigure


async def join_pool(js: JetStreamContext, pool: str, spec: wire.ConsumerSpec, *,
                    stop: asyncio.Event | None = None, cap_s: float = 5.0,
                    configs: list[ConsumerConfig] | None = None) -> ConsumerConfig | None:
    """A worker joining `pool`: its consumers as provisioned, ready to pull from. Returns the
    fresh lane's configuration (whoever set it), or None if `stop` was set while waiting.

    The pool's consumers are the trainer's (the trainer identity provisions them; a worker's may
    not create or reconfigure one, rlboost/auth.py). Where this process may (no auth, a dev
    setup), a missing consumer is created and one with other settings updated, as before. Where
    it may not, the call is refused and the worker serves with the consumers the trainer
    provisioned (logging once which of its own settings differ), or, before the trainer has
    provisioned the pool, waits for it with bounded back-off instead of crash-looping (asking
    once: while it waits it only reads, so the server logs one refusal, not one per retry)."""
    wire.check_name("pool", pool)
    wanted = configs or pool_consumer_configs(pool, spec)  # `configs`: an environment worker's lane
    delay, may_create, told = 0.5, True, False
    while True:
        try:
            have = [await _consumer_config(js, cfg.durable_name) for cfg in wanted]
            for cfg, got in zip(wanted, have, strict=True):
                if got is None and may_create:
                    await js.add_consumer(wire.STREAM_REQUESTS, cfg, timeout=JOIN_API_TIMEOUT_S)
                elif got is not None and not _same_consumer(got, cfg):
                    try:
                        if pool in _REFUSED_POOLS:  # refused before: asking again costs a timeout each time
                            raise nats.errors.TimeoutError
                        await js.add_consumer(wire.STREAM_REQUESTS, cfg, timeout=JOIN_API_TIMEOUT_S)
                    except (*_REFUSED, BadRequestError) as e:
                        _REFUSED_POOLS.add(pool)
                        if not told:
                            _log_differences(pool, got, cfg, e)
                        told = True
            if all(got is not None for got in have) or may_create:
                return await _consumer_config(js, wanted[0].durable_name) or wanted[0]
        except (*_REFUSED, NotFoundError, BadRequestError) as e:
            if may_create:
                log.warning("waiting for the trainer to provision this pool's consumers (the trainer's identity "
                            "provisions them; this one may not)", pool=pool, error=type(e).__name__)
        may_create = False
        if not await _pause(stop, delay):
            return None
        delay = min(cap_s, delay * 2)


async def _consumer_config(js: JetStreamContext, durable: str) -> ConsumerConfig | None:
    try:
        return (await js.consumer_info(wire.STREAM_REQUESTS, durable)).config
    except NotFoundError:
        return None


async def _pause(stop: asyncio.Event | None, delay: float) -> bool:
    """Sleep `delay`; False if `stop` was set (then at once)."""
    if stop is None:
        await asyncio.sleep(delay)
        return True
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=delay)
    return not stop.is_set()


def _log_differences(pool: str, have: ConsumerConfig, want: ConsumerConfig, refused: Exception) -> None:
    """Once per join: the pool's consumer differs from this worker's settings and it may not
    change it. The provisioned settings stand (every worker of the pool shares the consumer)."""
    diffs = {k: (a, b) for k, a, b in (
        ("ack_wait_s", float(have.ack_wait or 0), float(want.ack_wait or 0)),
        ("max_deliver", have.max_deliver, want.max_deliver),
        ("max_ack_pending", have.max_ack_pending, want.max_ack_pending),
        ("filter_subject", have.filter_subject, want.filter_subject)) if a != b}
    log.warning("this worker's settings differ from its pool's consumer, which the trainer provisions; "
                "serving with the pool's", pool=pool, consumer=have.durable_name,
                differs=", ".join(f"{k}: pool {a}, worker {b}" for k, (a, b) in diffs.items()),
                refused=type(refused).__name__)


async def provision_or_wait(js: JetStreamContext, stop: asyncio.Event | None = None, cap_s: float = 5.0,
                            **kwargs: Any) -> bool:
    """`provision`, for a process whose identity may not create streams or buckets (a worker):
    before the trainer has provisioned the servers, wait for it with bounded back-off and a
    log line instead of failing. While waiting it only reads (stream info), and provisions
    again once everything is there (which then needs no forbidden call). False if `stop` was
    set while waiting."""
    delay, first = 0.5, True
    while True:
        try:
            if first or await _provisioned(js):
                await provision(js, **kwargs)
                return True
        except (*_REFUSED, BadRequestError, NotFoundError) as e:
            if first:
                log.warning("waiting for the trainer to provision the streams and buckets (the trainer's "
                            "identity provisions them; this one may not)", error=type(e).__name__)
        first = False
        if not await _pause(stop, delay):
            return False
        delay = min(cap_s, delay * 2)


async def _provisioned(js: JetStreamContext) -> bool:
    names = [s.name for s in wire.STREAMS] + [f"KV_{b}" for b in (wire.BUCKET_WORKERS, wire.BUCKET_POLICY,
                                                                  wire.BUCKET_CONTROL)]
    for name in names:
        try:
            await js.stream_info(name)
        except NotFoundError:
            return False
    return True


def _same_consumer(have: ConsumerConfig, want: ConsumerConfig) -> bool:
    return (have.filter_subject == want.filter_subject and have.max_deliver == want.max_deliver
            and have.max_ack_pending == want.max_ack_pending and abs(float(have.ack_wait or 0) - float(want.ack_wait or 0)) < 1e-3)


async def _kv(js: JetStreamContext, cfg: KeyValueConfig) -> None:
    try:
        await js.key_value(cfg.bucket)
    except Exception:
        try:
            await js.create_key_value(cfg)
        except BadRequestError:
            await js.key_value(cfg.bucket)


async def follow(js: JetStreamContext, subject: str, within_s: float = 30.0,
                 from_seq: int = 0) -> JetStreamContext.PushSubscription:
    """An ordered consumer on `subject`, from the start of its stream (or its sequence `from_seq`:
    where an earlier reader of it left off).

    Creating one is a JetStream API call that needs the stream's leader; right after a cluster
    node is lost (or while a single server restarts) there is none for a few seconds, and the
    call times out. Readers of results and events must outlive that, so it is retried until
    `within_s`. The stream is named, not looked up: a lookup needs the meta leader as well."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=from_seq) \
                if from_seq > 0 else None
            return await js.subscribe(subject, stream=wire.stream_of(subject), ordered_consumer=True, config=config)
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ServiceUnavailableError) as e:
            if time.monotonic() > deadline:
                raise ConnectionError(f"no JetStream leader answered for {subject} within {within_s:.0f} s") from e
            log.warning("waiting for a JetStream leader", subject=subject, error=type(e).__name__)
            await asyncio.sleep(0.5)


async def hand_back_buffered(psub: JetStreamContext.PullSubscription) -> int:
    """Nak every message a pull subscription holds that no fetch took; returns how many.

    nats-py's `fetch(n)` returns when its timeout runs out even if the server is still sending
    the rest of its batch, and leaves those in the subscription for the next fetch. A worker at
    capacity makes no next fetch, and one that stops pulling never will: delivered and never
    acknowledged, they would wait out ack_wait (10 s by default) unclaimed. Call before
    unsubscribing. (The subscription's buffer is nats-py's own; pinned < 3 in pyproject.)"""
    sub = getattr(psub, "_sub", None)
    queue = getattr(sub, "_pending_queue", None)
    if queue is None:
        return 0
    n = 0
    while not queue.empty():
        msg = queue.get_nowait()
        sub._pending_size -= len(msg.data)
        if JetStreamContext.is_status_msg(msg):  # the end of some fetch's batch, not a message
            continue
        with contextlib.suppress(Exception):
            await msg.nak()
            n += 1
    return n


async def dead_letter(js: JetStreamContext, msg: Msg, reason: str, stream: str, ack: bool = True) -> None:
    """Copy the raw message to the DLQ with the reason, then ack it so it is not redelivered.
    `ack=False` for a message read from a limits stream (results), which nobody acks."""
    meta_seq = ""
    try:
        meta_seq = str(msg.metadata.sequence.stream)
    except Exception:
        pass
    headers = {
        wire.HDR_DLQ_REASON: reason[:1000],
        wire.HDR_DLQ_SUBJECT: msg.subject,
        wire.HDR_DLQ_SEQ: meta_seq,
        wire.HDR_MSG_ID: f"dlq-{stream}-{meta_seq}" if meta_seq else f"dlq-{time.time_ns()}",
    }
    await js.publish(wire.dlq_subject(stream), msg.data, headers=headers)
    if ack:
        await msg.ack()
    log.warning("dead-lettered", stream=stream, subject=msg.subject, seq=meta_seq, reason=reason)


async def dead_letter_max_deliveries(js: JetStreamContext, nc: NATS, stop: asyncio.Event,
                                     on_dead: Callable[[bytes], None] | None = None) -> None:
    """After `max_deliver` a work-queue message stays in the stream and JetStream only emits an
    advisory. Move such poison messages to the DLQ and delete them. Safe to run in many
    processes at once: the DLQ de-duplicates by stream sequence. `on_dead(payload)`: told of
    each message this call moved (the caller decodes it: wire bytes are untrusted)."""
    subject = f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{wire.STREAM_REQUESTS}.*"
    sub = await nc.subscribe(subject)
    try:
        while not stop.is_set():
            try:
                adv = await asyncio.wait_for(sub.next_msg(timeout=None), timeout=0.5)
            except (TimeoutError, asyncio.TimeoutError, nats.errors.TimeoutError):
                continue
            try:
                seq = int(json.loads(adv.data)["stream_seq"])
                raw = await js.get_msg(wire.STREAM_REQUESTS, seq)
            except (NotFoundError, KeyError, ValueError):
                continue  # already moved by another process
            headers = {
                wire.HDR_DLQ_REASON: "max deliveries exceeded",
                wire.HDR_DLQ_SUBJECT: raw.subject or "",
                wire.HDR_DLQ_SEQ: str(seq),
                wire.HDR_MSG_ID: f"dlq-{wire.STREAM_REQUESTS}-{seq}",
            }
            await js.publish(wire.dlq_subject(wire.STREAM_REQUESTS), raw.data or b"", headers=headers)
            try:
                await js.delete_msg(wire.STREAM_REQUESTS, seq)
            except NotFoundError:
                pass
            log.warning("dead-lettered", stream=wire.STREAM_REQUESTS, seq=seq, reason="max deliveries exceeded")
            if on_dead is not None:
                on_dead(raw.data or b"")
    finally:
        await sub.unsubscribe()


async def worker_keys(js: JetStreamContext) -> list[str]:
    """The registry's keys (worker ids, deleted ones included: `kv.get` then raises), from the
    bucket stream's subject list in one request. nats-py's `kv.keys()` now and then reports
    "no keys" for a bucket that has some, which would read as "no workers at all"."""
    prefix = f"$KV.{wire.BUCKET_WORKERS}."
    info = await js.stream_info(f"KV_{wire.BUCKET_WORKERS}", subjects_filter=f"{prefix}>")
    return [subject[len(prefix):] for subject in (info.state.subjects or {})]


async def registry_entry(js: JetStreamContext, key: str) -> tuple[bytes, float, int] | None:
    """A worker registry entry: (value, the server's time of the put in unix seconds, revision),
    or None if the key is gone. The time is the NATS server's, which a writer cannot choose: a
    heartbeat's own `ts` is whatever the worker credential put there."""
    try:
        msg = await js.get_msg(f"KV_{wire.BUCKET_WORKERS}", subject=f"$KV.{wire.BUCKET_WORKERS}.{key}")
    except NotFoundError:
        return None
    if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or msg.time is None:
        return None
    return msg.data or b"", msg.time.timestamp(), int(msg.seq or 0)
