"""The NATS side of the wire: connect, provision streams/consumers/buckets, dead-letter.

Provisioning is idempotent: every process that joins (manager, trainer, worker) calls
`provision()`; the first creates, the rest find everything in place (and a changed config in
`rlboost.wire` updates the stream instead of failing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from rlboost import wire
from rlboost.logs import get_logger

log = get_logger(component="bus")

_RETENTION = {"limits": RetentionPolicy.LIMITS, "workqueue": RetentionPolicy.WORK_QUEUE}


async def connect(url: str, name: str = "rlboost", **kwargs: Any) -> NATS:
    """Connect with reconnects on; a clear error if nobody answers or the credentials are refused.

    With unlimited reconnects nats-py retries a refused login forever, so the first
    authorization violation during the initial connect ends the attempt with a ConnectionError
    that says so (after connecting, e.g. a rotated password, it keeps retrying as before)."""
    user_cb = kwargs.pop("error_cb", None)
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    async def error_cb(e: Exception) -> None:
        text = str(e).lower()
        if not refused.done() and ("authorization violation" in text or "authentication" in text
                                   or isinstance(e, nats.errors.AuthorizationError)):
            refused.set_result(e)
        if user_cb is not None:
            await user_cb(e)
        else:
            log.warning("nats error", error=str(e) or type(e).__name__)

    # nats-py sends URL credentials as they stand; URLs carry them %-encoded (rlboost.services).
    parts = urlsplit(url)
    if parts.username is not None and "user" not in kwargs:
        kwargs["user"] = unquote(parts.username)
        kwargs["password"] = unquote(parts.password or "")
        url = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
        shown = f"{parts.scheme}://***@{parts.netloc.rsplit('@', 1)[1]}"
    else:
        shown = _redact(url)
    nc = NATS()
    attempt = asyncio.ensure_future(nc.connect(url, name=name, connect_timeout=5, max_reconnect_attempts=-1,
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


def _redact(url: str) -> str:
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def stream_config(spec: wire.StreamSpec) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=_RETENTION[spec.retention],
        storage=StorageType.FILE,
        max_age=spec.max_age_s or None,
        duplicate_window=spec.duplicate_window_s,
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


async def provision(js: JetStreamContext, pools: tuple[str, ...] = (), consumer: wire.ConsumerSpec | None = None,
                    registry_ttl_s: float = 10.0) -> None:
    """Create or update every stream, the pools' consumers and the KV buckets."""
    for spec in wire.STREAMS:
        cfg = stream_config(spec)
        try:
            info = await js.stream_info(spec.name)
            if not _same_stream(info.config, cfg):  # unchanged: no update (a worker may not)
                await js.update_stream(cfg)
        except NotFoundError:
            try:
                await js.add_stream(cfg)
            except BadRequestError:  # a concurrent provisioner won the race
                await js.update_stream(cfg)
    for pool in pools:
        await ensure_pool_consumer(js, pool, consumer or wire.ConsumerSpec())
    await _kv(js, KeyValueConfig(bucket=wire.BUCKET_WORKERS, ttl=registry_ttl_s, history=1))
    await _kv(js, KeyValueConfig(bucket=wire.BUCKET_POLICY, history=5))
    await _kv(js, KeyValueConfig(bucket=wire.BUCKET_CONTROL, history=1))


def _same_stream(have: StreamConfig, want: StreamConfig) -> bool:
    def secs(v: float | None) -> float:
        return float(v or 0.0)

    return (sorted(have.subjects or []) == sorted(want.subjects or []) and have.retention == want.retention
            and have.storage == want.storage and abs(secs(have.max_age) - secs(want.max_age)) < 1e-3
            and abs(secs(have.duplicate_window) - secs(want.duplicate_window)) < 1e-3)


async def ensure_pool_consumer(js: JetStreamContext, pool: str, spec: wire.ConsumerSpec) -> None:
    wire.check_name("pool", pool)
    for cfg in pool_consumer_configs(pool, spec):
        await js.add_consumer(wire.STREAM_REQUESTS, cfg)


async def _kv(js: JetStreamContext, cfg: KeyValueConfig) -> None:
    try:
        await js.key_value(cfg.bucket)
    except Exception:
        try:
            await js.create_key_value(cfg)
        except BadRequestError:
            await js.key_value(cfg.bucket)


async def dead_letter(js: JetStreamContext, msg: Msg, reason: str, stream: str) -> None:
    """Copy the raw message to the DLQ with the reason, then ack it so it is not redelivered."""
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
    await msg.ack()
    log.warning("dead-lettered", stream=stream, subject=msg.subject, seq=meta_seq, reason=reason)


async def dead_letter_max_deliveries(js: JetStreamContext, nc: NATS, stop: asyncio.Event) -> None:
    """After `max_deliver` a work-queue message stays in the stream and JetStream only emits an
    advisory. Move such poison messages to the DLQ and delete them. Safe to run in many
    processes at once: the DLQ de-duplicates by stream sequence."""
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
    finally:
        await sub.unsubscribe()


async def worker_keys(js: JetStreamContext) -> list[str]:
    """The registry's keys (worker ids, deleted ones included: `kv.get` then raises), from the
    bucket stream's subject list in one request. nats-py's `kv.keys()` now and then reports
    "no keys" for a bucket that has some, which would read as "no workers at all"."""
    prefix = f"$KV.{wire.BUCKET_WORKERS}."
    info = await js.stream_info(f"KV_{wire.BUCKET_WORKERS}", subjects_filter=f"{prefix}>")
    return [subject[len(prefix):] for subject in (info.state.subjects or {})]
