"""JetStream semantics the system relies on, against a real nats-server."""

from __future__ import annotations

import asyncio
import uuid
import contextlib

import msgspec
import pytest

from rlboost import bus, wire
from rlboost.clients import open_clients
from rlboost.config import RetentionSettings, load_settings


def _request(rid: str, **kw) -> wire.RolloutRequest:
    return wire.RolloutRequest(request_id=rid, step=1, policy_version=0, prompt_ids=[1, 2], max_new_tokens=8,
                               seed=1, **kw)


async def test_provisioning_is_idempotent(js):
    spec = wire.ConsumerSpec(ack_wait_s=2.0)
    for _ in range(3):
        await bus.provision(js, pools=("p1",), consumer=spec)
    names = {s.config.name for s in await js.streams_info()}
    assert {s.name for s in wire.STREAMS} <= names
    ci = await js.consumer_info(wire.STREAM_REQUESTS, wire.consumer_name("p1"))
    assert ci.config.ack_wait == 2.0 and ci.config.filter_subject == wire.request_subject("p1")


async def test_the_provisioner_sets_retention_and_a_process_without_it_keeps_it(js):
    ages = RetentionSettings(results_s=600, tokens_s=900, events_s=0, dlq_s=3600).stream_ages()
    await bus.provision(js, ages=ages)
    await bus.provision(js)  # a worker or a bench client: was not given the retention, must not reset it
    got = {n: await js.stream_info(n) for n in ages}
    assert {n: float(i.config.max_age or 0) for n, i in got.items()} == ages
    # the de-duplication window never outlasts the messages (JetStream refuses that)
    assert got[wire.STREAM_RESULTS].config.duplicate_window == 600
    assert got[wire.STREAM_DLQ].config.duplicate_window == 120
    await bus.provision(js, ages=RetentionSettings().stream_ages())
    assert not (await js.stream_info(wire.STREAM_RESULTS)).config.max_age  # the default: forever


async def test_checkpoints_expire_after_the_configured_retention(nats_url, redis_url, js):
    s = load_settings(None, environ={"RLBOOST_SERVICES__RETENTION__CHECKPOINTS_S": "600"})
    async with open_clients(nats_url, redis_url, "retention-test", settings=s, wait_provisioned=True) as c:
        rid = f"keep-{uuid.uuid4().hex[:8]}"
        await c.store.claim(rid, "w1", 0, ttl_s=5)
        assert 0 < await c.store.redis.ttl(wire.ckpt_meta_key(rid)) <= 600


def test_retention_windows_are_checked():
    with pytest.raises(ValueError, match="services.retention.results_s"):
        load_settings(None, environ={"RLBOOST_SERVICES__RETENTION__RESULTS_S": "10"})
    with pytest.raises(ValueError, match="services.retention.checkpoints_s"):
        load_settings(None, environ={"RLBOOST_SERVICES__RETENTION__CHECKPOINTS_S": "0"})


async def test_unacked_request_is_redelivered_after_ack_wait(js):
    await bus.ensure_pool_consumer(js, "redeliver", wire.ConsumerSpec(ack_wait_s=1.0))
    await js.publish(wire.request_subject("redeliver"), wire.encode(_request("r1")))
    psub = await js.pull_subscribe_bind(durable=wire.consumer_name("redeliver"), stream=wire.STREAM_REQUESTS)
    (first,) = await psub.fetch(1, timeout=2)
    assert first.metadata.num_delivered == 1  # ... and the worker holding it dies silently
    with pytest.raises(TimeoutError):
        await psub.fetch(1, timeout=0.5)  # still inside ack_wait: nobody else gets it
    (again,) = await psub.fetch(1, timeout=3)
    assert again.metadata.num_delivered == 2 and again.data == first.data
    await again.ack()


async def test_in_progress_keeps_a_live_worker_request(js):
    await bus.ensure_pool_consumer(js, "alive", wire.ConsumerSpec(ack_wait_s=1.0))
    await js.publish(wire.request_subject("alive"), wire.encode(_request("r2")))
    psub = await js.pull_subscribe_bind(durable=wire.consumer_name("alive"), stream=wire.STREAM_REQUESTS)
    (msg,) = await psub.fetch(1, timeout=2)
    for _ in range(4):
        await asyncio.sleep(0.5)
        await msg.in_progress()
    with pytest.raises(TimeoutError):
        await psub.fetch(1, timeout=0.3)
    await msg.ack()


async def test_results_are_deduplicated_by_request_id(js):
    data = wire.encode(wire.RolloutResult(request_id="r3", step=9, group=0, prompt_ids=[1], token_ids=[2],
                                          logprobs=[0.0], segments=[], finish_reason="stop", worker_id="w", ts=0.0))
    acks = [await js.publish(wire.result_subject(9), data, headers={wire.HDR_MSG_ID: "r3"}) for _ in range(3)]
    assert [a.duplicate for a in acks] == [None, True, True]
    info = await js.stream_info(wire.STREAM_RESULTS)
    assert info.state.messages == 1


async def test_dead_letter_keeps_raw_bytes_and_reason(js, store):
    from rlboost.smoke import consume

    await bus.ensure_pool_consumer(js, "dlq", wire.ConsumerSpec())
    bad = [b"\x93not a message", msgspec.msgpack.encode({"v": 99, "request_id": "x"})]
    for payload in bad:
        await js.publish(wire.request_subject("dlq"), payload)
    await js.publish(wire.request_subject("dlq"), wire.encode(_request("good-after-bad")))
    stats = await consume(js, store, n=3, pool="dlq")
    assert stats == {"done": 1, "dead_lettered": 2}
    assert (await js.stream_info(wire.STREAM_DLQ)).state.messages == 2
    reasons = []
    for seq in (1, 2):
        m = await js.get_msg(wire.STREAM_DLQ, seq)
        assert m.data in bad
        reasons.append(m.headers[wire.HDR_DLQ_REASON])
    assert "malformed" in reasons[0] and "schema version 99" in reasons[1]
    assert (await js.stream_info(wire.STREAM_REQUESTS)).state.messages == 0  # acked: not redelivered


async def test_poison_message_past_max_deliver_is_moved_to_the_dlq(js, nc):
    await bus.ensure_pool_consumer(js, "poison", wire.ConsumerSpec(ack_wait_s=0.3, max_deliver=2))
    stop = asyncio.Event()
    mover = asyncio.create_task(bus.dead_letter_max_deliveries(js, nc, stop))
    await asyncio.sleep(0.1)
    await js.publish(wire.request_subject("poison"), wire.encode(_request("crashes-every-worker")))
    psub = await js.pull_subscribe_bind(durable=wire.consumer_name("poison"), stream=wire.STREAM_REQUESTS)
    for _ in range(2):
        await psub.fetch(1, timeout=2)  # taken and never acked, as by a worker that dies on it
    for _ in range(30):  # the advisory fires when the consumer would deliver a third time
        if (await js.stream_info(wire.STREAM_DLQ)).state.messages:
            break
        with contextlib.suppress(TimeoutError):
            await psub.fetch(1, timeout=0.2)
    stop.set()
    await mover
    m = await js.get_msg(wire.STREAM_DLQ, 1)
    assert wire.decode(wire.RolloutRequest, m.data).request_id == "crashes-every-worker"
    assert m.headers[wire.HDR_DLQ_REASON] == "max deliveries exceeded"
    assert (await js.stream_info(wire.STREAM_REQUESTS)).state.messages == 0


async def test_a_step_whose_request_is_dead_lettered_fails_at_once_instead_of_waiting(nats_url, redis_url):
    """A request delivered max_deliver times never answers: waiting for its result would hang
    the run (a g4dn trace bench waited forever on 32 of them)."""
    from rlboost.errors import RequestsDeadLettered
    from rlboost.pool_client import PoolClient

    pool, run = f"dead{uuid.uuid4().hex[:6]}", wire.new_run_id()
    async with open_clients(nats_url, redis_url, "test-dead") as c:
        await bus.ensure_pool_consumer(c.js, pool, wire.ConsumerSpec(ack_wait_s=0.3, max_deliver=2))
        manager = PoolClient(c, pool)
        reqs = [wire.RolloutRequest(request_id=wire.request_id(3, i, 0, run=run), step=3, policy_version=0,
                                    prompt_ids=[1, 2], max_new_tokens=8, seed=i, group=i) for i in range(2)]
        await manager.publish_step(reqs[:1], pool)  # the other one is answered by nobody either: it waits
        psub = await c.js.pull_subscribe_bind(durable=wire.consumer_name(pool), stream=wire.STREAM_REQUESTS)

        async def never_acks() -> None:  # a worker that takes the request and dies on it, again and again
            while True:
                with contextlib.suppress(TimeoutError):
                    await psub.fetch(1, timeout=0.2)

        taker = asyncio.create_task(never_acks())
        try:
            with pytest.raises(RequestsDeadLettered) as e:
                async for _ in manager.results(3, reqs, timeout_s=60):
                    pass
        finally:
            taker.cancel()
        assert e.value.ids == [reqs[0].request_id] and "max_deliver" in str(e.value)
