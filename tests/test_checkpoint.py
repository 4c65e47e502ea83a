"""Checkpoint store: round trips, leases, fencing, expiry — against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlboost.checkpoint import AlreadyFinished, LeaseHeld, LeaseLost, OffsetMismatch

chunkings = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=40), min_size=0, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=chunkings)
async def test_append_read_round_trip_over_any_chunking(store, chunks):
    rid = f"prop-{abs(hash(str(chunks))) % 10**12}-{id(chunks)}"
    claim = await store.claim(rid, "w1", policy_version=3, ttl_s=5)
    assert claim.token_ids == [] and claim.epoch == 1
    tokens: list[int] = []
    logprobs: list[float] = []
    for chunk in chunks:
        lps = [-(i % 7) / 8 for i in range(len(chunk))]  # exactly representable in float32
        n = await store.append(rid, "w1", claim.epoch, len(tokens), chunk, lps, ttl_s=5)
        tokens += chunk
        logprobs += lps
        assert n == len(tokens)
    assert await store.read(rid) == (tokens, logprobs)
    await store.finish(rid, claim.epoch, len(tokens))
    assert await store.is_finished(rid)


async def test_resume_returns_tokens_so_far(store, rid):
    c1 = await store.claim(rid, "w1", 0, ttl_s=5)
    await store.append(rid, "w1", c1.epoch, 0, [5, 6, 7], [-0.5, -0.25, -1.0], ttl_s=5)
    await store.release(rid, c1.epoch)
    c2 = await store.claim(rid, "w2", 0, ttl_s=5)
    assert c2.epoch == c1.epoch + 1
    assert (c2.token_ids, c2.logprobs) == ([5, 6, 7], [-0.5, -0.25, -1.0])
    segs = await store.segments(rid)
    assert [(s.worker_id, s.offset) for s in segs] == [("w1", 0), ("w2", 3)]


async def test_stale_epoch_writer_is_refused_after_takeover(store, rid):
    zombie = await store.claim(rid, "zombie", 0, ttl_s=5)
    await store.append(rid, "zombie", zombie.epoch, 0, [1, 2], [0.0, 0.0], ttl_s=5)
    new = await store.claim(rid, "new", 0, ttl_s=5, steal=True)
    await store.append(rid, "new", new.epoch, 2, [3], [0.0], ttl_s=5)
    with pytest.raises(LeaseLost):
        await store.append(rid, "zombie", zombie.epoch, 2, [99], [0.0], ttl_s=5)
    with pytest.raises(LeaseLost):
        await store.finish(rid, zombie.epoch, 3)
    with pytest.raises(LeaseLost):
        await store.renew(rid, "zombie", zombie.epoch, ttl_s=5)
    assert (await store.read(rid))[0] == [1, 2, 3]
    await store.finish(rid, new.epoch, 3)


async def test_live_lease_blocks_another_claimant_until_it_expires(store, rid):
    await store.claim(rid, "w1", 0, ttl_s=0.3)
    with pytest.raises(LeaseHeld) as e:
        await store.claim(rid, "w2", 0, ttl_s=5)
    assert 0 < e.value.retry_after_s <= 0.3
    await asyncio.sleep(0.4)
    c = await store.claim(rid, "w2", 0, ttl_s=5)
    assert c.epoch == 2


async def test_renew_keeps_the_lease_alive(store, rid):
    c = await store.claim(rid, "w1", 0, ttl_s=0.3)
    for _ in range(4):
        await asyncio.sleep(0.15)
        await store.renew(rid, "w1", c.epoch, ttl_s=0.3)
    with pytest.raises(LeaseHeld):
        await store.claim(rid, "w2", 0, ttl_s=5)


async def test_append_must_continue_where_the_checkpoint_ends(store, rid):
    c = await store.claim(rid, "w1", 0, ttl_s=5)
    await store.append(rid, "w1", c.epoch, 0, [1, 2], [0.0, 0.0], ttl_s=5)
    with pytest.raises(OffsetMismatch):
        await store.append(rid, "w1", c.epoch, 1, [9], [0.0], ttl_s=5)
    with pytest.raises(OffsetMismatch):
        await store.finish(rid, c.epoch, 5)


async def test_finished_request_cannot_be_claimed_or_appended(store, rid):
    c = await store.claim(rid, "w1", 0, ttl_s=5)
    await store.finish(rid, c.epoch, 0)
    with pytest.raises(AlreadyFinished):
        await store.claim(rid, "w2", 0, ttl_s=5, steal=True)
    with pytest.raises(AlreadyFinished):
        await store.append(rid, "w1", c.epoch, 0, [1], [0.0], ttl_s=5)


async def test_one_lost_lease_does_not_fail_the_other_appends_of_a_batch(store, rid):
    other = rid + "-b"
    a = await store.claim(rid, "w1", 0, ttl_s=5)
    b = await store.claim(other, "w1", 0, ttl_s=5)
    await store.claim(rid, "w2", 0, ttl_s=5, steal=True)
    out = await store.append_many([(rid, "w1", a.epoch, 0, [1], [0.0]), (other, "w1", b.epoch, 0, [2], [0.0])], ttl_s=5)
    assert isinstance(out[0], LeaseLost) and out[1] == 1
