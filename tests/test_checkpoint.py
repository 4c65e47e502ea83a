"""Checkpoint store: round trips, leases, fencing, expiry — against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlboost import wire
from rlboost.checkpoint import (AlreadyFinished, CheckpointError, CorruptCheckpoint, LeaseHeld, LeaseLost,
                                OffsetMismatch)

chunkings = st.lists(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=40), min_size=0, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=chunkings)
async def test_append_read_round_trip_over_any_chunking(store, chunks):
    rid = f"prop-{abs(hash(str(chunks))) % 10**12}-{id(chunks)}"
    claim = await store.claim(rid, "w1", policy_version=3, ttl_s=5)
    assert claim.token_ids == [] and claim.epoch > 0
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
    assert c2.epoch > c1.epoch
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
    first = await store.claim(rid, "w1", 0, ttl_s=0.3)
    with pytest.raises(LeaseHeld) as e:
        await store.claim(rid, "w2", 0, ttl_s=5)
    assert 0 < e.value.retry_after_s <= 0.3
    await asyncio.sleep(0.4)
    c = await store.claim(rid, "w2", 0, ttl_s=5)
    assert c.epoch > first.epoch


async def test_renew_keeps_the_lease_alive(store, rid):
    c = await store.claim(rid, "w1", 0, ttl_s=0.3)
    for _ in range(4):
        await asyncio.sleep(0.15)
        await store.renew(rid, "w1", c.epoch, ttl_s=0.3)
    with pytest.raises(LeaseHeld):
        await store.claim(rid, "w2", 0, ttl_s=5)


async def test_a_renewal_after_a_release_does_not_take_the_lease_back(store, rid):
    """A heartbeat's renewal racing a hand-off arrives after the release: refused (the lease is
    lost to that epoch), so the next claimer does not wait out a TTL for a holder that let go."""
    c = await store.claim(rid, "w1", 0, ttl_s=30)
    assert await store.release(rid, c.epoch)
    with pytest.raises(LeaseLost):
        await store.renew(rid, "w1", c.epoch, ttl_s=30)
    with pytest.raises(LeaseLost):  # nor a write of that epoch (a bug of the writer: the store says so)
        await store.append(rid, "w1", c.epoch, 0, [1], [0.0], ttl_s=30)
    nxt = await store.claim(rid, "w2", 0, ttl_s=30)  # at once, not after 30 s
    await store.renew(rid, "w2", nxt.epoch, ttl_s=30)  # the new epoch renews and writes as ever
    await store.append(rid, "w2", nxt.epoch, 0, [1], [0.0], ttl_s=30)


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


async def _evalsha_calls(store) -> int:
    return int((await store.redis.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0))


async def test_a_flush_is_one_fenced_script_call_with_an_outcome_per_request(store, rid):
    """A worker's whole flush is one EVALSHA; each request keeps the checks and the answer of a
    single append: stale epoch, offset mismatch, finished, a key of the wrong type."""
    rids = [f"{rid}-{i}" for i in range(6)]
    claims = [await store.claim(r, "w1", 0, ttl_s=5) for r in rids]
    await store.claim(rids[1], "w2", 0, ttl_s=5, steal=True)  # w1 is stale on 1
    await store.finish(rids[3], claims[3].epoch, 0)  # 3 is finished
    await store.redis.hset(f"rb:{{{rids[4]}}}:tok", "x", "1")  # 4 holds junk of the wrong type
    before = await _evalsha_calls(store)
    out = await store.append_many([(r, "w1", c.epoch, 1 if i == 2 else 0, [i, 7], [-0.5, -1.0])
                                   for i, (r, c) in enumerate(zip(rids, claims))], ttl_s=5)
    assert await _evalsha_calls(store) - before == 1
    assert out[0] == 2 and out[5] == 2
    assert isinstance(out[1], LeaseLost) and isinstance(out[2], OffsetMismatch)
    assert isinstance(out[3], AlreadyFinished)
    assert isinstance(out[4], CheckpointError) and "WRONGTYPE" in str(out[4])
    assert await store.read(rids[5]) == ([5, 7], [-0.5, -1.0])
    assert (await store.read(rids[1]))[0] == [] and (await store.read(rids[2]))[0] == []
    # The appends renewed the leases of the requests they landed on, and only those.
    assert 4000 < await store.redis.pttl(f"rb:{{{rids[5]}}}:lease") <= 5000


@pytest.mark.slow
async def test_on_a_redis_cluster_a_flush_is_grouped_by_slot_and_stays_fenced(tmp_path):
    """A script may only touch keys of one hash slot: on a cluster the flush is one call per
    slot (requests keep their own `{rid}` slot), sent to each master in one batch."""
    from redis.crc import key_slot

    from rlboost.checkpoint import CheckpointStore
    from rlboost.config import ServicesSettings
    from rlboost.services import EmbeddedServices

    svc = EmbeddedServices(ServicesSettings(data_dir=str(tmp_path / "data"), redis_cluster=3))
    st, _ = svc.up()
    store = CheckpointStore(svc.redis_url(st))
    try:
        rids = [f"cl-{i}" for i in range(30)]
        old = [await store.claim(r, "old", 0, ttl_s=5) for r in rids]
        new = [await store.claim(r, "new", 0, ttl_s=5, steal=True) for r in rids[::2]]
        groups = store._groups([(r, "new", 0, 0, b"") for r in rids])
        assert len(groups) == len({key_slot(f"rb:{{{r}}}:meta".encode()) for r in rids})
        stale = await store.append_many([(r, "old", c.epoch, 0, [1], [0.0]) for r, c in zip(rids, old)], 5)
        assert [isinstance(x, LeaseLost) for x in stale] == [i % 2 == 0 for i in range(30)]
        fresh = await store.append_many([(r, "new", c.epoch, 0, [2], [0.0]) for r, c in zip(rids[::2], new)], 5)
        assert fresh == [1] * 15
        assert [(await store.read(r))[0] for r in rids] == [[2] if i % 2 == 0 else [1] for i in range(30)]
    finally:
        await store.close()
        svc.stop_recorded()


def test_every_lua_reply_code_means_one_thing_in_every_script():
    """A script's negative replies are all in the one table, and each script answers only codes
    its Python caller maps (a -1 is a stale epoch whichever script says it)."""
    import re

    from rlboost import checkpoint, errors
    scripts = {"claim": checkpoint._CLAIM, "append": checkpoint._APPEND_MANY, "finish": checkpoint._FINISH,
               "renew": checkpoint._RENEW, "release": checkpoint._RELEASE, "append_env": checkpoint._APPEND_ENV,
               "episode": checkpoint._EPISODE}
    for name, source in scripts.items():
        said = {int(c) for c in re.findall(r"(?:return \{?|codes\[i\] = ')(-\d+)", source)}
        assert said, name
        assert said == set(errors.SCRIPT_CODES[name]), name
        assert said <= set(errors.LUA_CODES), name
    assert isinstance(errors.lua_error("claim", errors.FINISHED, "r"), errors.AlreadyFinished)
    assert isinstance(errors.lua_error("append", errors.STALE_EPOCH, "r"), errors.LeaseLost)
    assert isinstance(errors.lua_error("release", errors.FINISHED, "r"), errors.CheckpointError)  # never said there


# ---------------------------------------------------------------- episodes (schema 4)


def _state(at: int, turn: int = 0, **kw) -> wire.EpisodeState:
    return wire.EpisodeState(turn=turn, at=at, **kw)


async def test_an_episode_round_trips_as_typed_segments_with_its_state(store, rid):
    """Model turns and environment replies are one token stream; the history types each span, the
    env span names the lease that appended it and the version it ran, and the model segment
    resumes after it; the state comes back with the next claim."""
    c = await store.claim(rid, "w1", 3, ttl_s=5, weights="emulated-v3", episode=True)
    assert c.episode is None  # nothing stored yet
    await store.append(rid, "w1", c.epoch, 0, [10, 11, 12], [-0.5, -0.25, -1.0], ttl_s=5)
    call = wire.ToolCall(key=wire.tool_call_key(rid, 0, 0), name="calc", arguments='{"expr": "1+2"}')
    await store.put_episode(rid, "w1", c.epoch, _state(3, turn=1, pending=[call]), ttl_s=5)
    assert (await store.episode(rid)).pending == [call]
    rec = wire.ToolRecord(key=call.key, name="calc", worker_id="w1", latency_s=0.01, at=3)
    n = await store.append_env(rid, "w1", c.epoch, 3, [20, 21], _state(5, turn=1, env_state='{"x": 3}', calls=[rec]),
                               ttl_s=5)
    assert n == 5
    await store.append(rid, "w1", c.epoch, 5, [13], [-0.125], ttl_s=5)
    assert await store.read(rid) == ([10, 11, 12, 20, 21, 13], [-0.5, -0.25, -1.0, 0.0, 0.0, -0.125])
    segs = await store.segments(rid)
    assert [(s.offset, s.kind, s.worker_id, s.policy_version, s.weights) for s in segs] == [
        (0, "model", "w1", 3, "emulated-v3"), (3, "env", "w1", 3, "emulated-v3"), (5, "model", "w1", 3, "emulated-v3")]
    assert wire.trainable_mask(segs, 6) == [True, True, True, False, False, True]
    await store.release(rid, c.epoch)
    c2 = await store.claim(rid, "w2", 3, ttl_s=5, episode=True)
    assert c2.token_ids == [10, 11, 12, 20, 21, 13]
    assert c2.episode == _state(5, turn=1, env_state='{"x": 3}', calls=[rec])
    # a second env reply under the new lease: its span names w2
    await store.append_env(rid, "w2", c2.epoch, 6, [22], _state(7, turn=2), ttl_s=5)
    segs = await store.segments(rid)
    assert [(s.offset, s.kind, s.worker_id) for s in segs][-2:] == [(6, "env", "w2"), (7, "model", "w2")]
    assert wire.trainable_mask(segs, 7) == [True] * 3 + [False] * 2 + [True, False]
    await store.finish(rid, c2.epoch, 7)
    assert await store.is_finished(rid)


async def test_a_single_turn_claim_does_not_touch_the_episode_key(store, rid):
    """Single-turn requests keep their claim: four keys, three replies, nothing read or kept for
    an episode they are not."""
    await store.redis.set(wire.ckpt_episode_key(rid), b"junk that is no episode state")
    c = await store.claim(rid, "w1", 0, ttl_s=5)
    assert c.episode is None and await store.redis.ttl(wire.ckpt_episode_key(rid)) == -1
    with pytest.raises(CorruptCheckpoint, match="episode state"):
        await store.claim(rid, "w2", 0, ttl_s=5, steal=True, episode=True)


async def test_a_stale_lease_can_write_neither_env_tokens_nor_episode_state(store, rid):
    """Fencing holds for an episode's environment tokens and its state as for model tokens: a
    zombie that ran a tool after a takeover cannot add its result or move the episode on."""
    zombie = await store.claim(rid, "zombie", 0, ttl_s=5, episode=True)
    await store.append(rid, "zombie", zombie.epoch, 0, [1, 2], [0.0, 0.0], ttl_s=5)
    await store.put_episode(rid, "zombie", zombie.epoch, _state(2, turn=1), ttl_s=5)
    new = await store.claim(rid, "new", 0, ttl_s=5, steal=True, episode=True)
    assert new.episode == _state(2, turn=1)
    with pytest.raises(LeaseLost):
        await store.append_env(rid, "zombie", zombie.epoch, 2, [7], _state(3, turn=1, env_state='"zombie"'), ttl_s=5)
    with pytest.raises(LeaseLost):
        await store.put_episode(rid, "zombie", zombie.epoch, _state(2, turn=9), ttl_s=5)
    await store.append_env(rid, "new", new.epoch, 2, [8], _state(3, turn=1, env_state='"new"'), ttl_s=5)
    assert (await store.read(rid))[0] == [1, 2, 8]
    assert (await store.episode(rid)).env_state == '"new"'
    assert [s.worker_id for s in await store.segments(rid) if s.kind == "env"] == ["new"]
    await store.finish(rid, new.epoch, 3)
    with pytest.raises(AlreadyFinished):
        await store.append_env(rid, "new", new.epoch, 3, [9], _state(4), ttl_s=5)
    with pytest.raises(AlreadyFinished):
        await store.put_episode(rid, "new", new.epoch, _state(3, done=True), ttl_s=5)


async def test_env_tokens_and_state_must_continue_the_checkpoint(store, rid):
    """An env reply lands exactly where the checkpoint ends, and a state describes exactly the
    tokens there are: otherwise nothing is written (tokens, history and state unchanged)."""
    c = await store.claim(rid, "w1", 0, ttl_s=5, episode=True)
    await store.append(rid, "w1", c.epoch, 0, [1, 2, 3], [0.0] * 3, ttl_s=5)
    hist = await store.redis.lrange(wire.ckpt_history_key(rid), 0, -1)
    with pytest.raises(OffsetMismatch):
        await store.append_env(rid, "w1", c.epoch, 2, [7], _state(3), ttl_s=5)
    with pytest.raises(OffsetMismatch):  # the state does not end where the env tokens do
        await store.append_env(rid, "w1", c.epoch, 3, [7], _state(3), ttl_s=5)
    with pytest.raises(OffsetMismatch):
        await store.put_episode(rid, "w1", c.epoch, _state(2), ttl_s=5)
    with pytest.raises(CheckpointError, match="invalid episode state"):  # never written
        await store.put_episode(rid, "w1", c.epoch, _state(3, env_state="{nope"), ttl_s=5)
    assert (await store.read(rid))[0] == [1, 2, 3] and await store.episode(rid) is None
    assert await store.redis.lrange(wire.ckpt_history_key(rid), 0, -1) == hist


async def test_an_env_append_renews_the_lease_and_keeps_the_state_as_long_as_the_tokens(store, rid):
    c = await store.claim(rid, "w1", 0, ttl_s=0.5, episode=True)
    await store.append_env(rid, "w1", c.epoch, 0, [5], _state(1), ttl_s=5)
    assert 4000 < await store.redis.pttl(wire.ckpt_lease_key(rid)) <= 5000
    assert 0 < await store.redis.ttl(wire.ckpt_episode_key(rid)) <= store.keep_s
    assert 0 < await store.redis.ttl(wire.ckpt_tokens_key(rid)) <= store.keep_s
