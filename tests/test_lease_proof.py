"""A write under a lease needs proof that only the lease's holder has (issue 40, DESIGN.md §6):
with a stolen worker or environment credential, reading the live epoch (HGET, as any credential
can) is not enough to write into a lease another client holds. And the env credential cannot
shorten a finished checkpoint's life to erase it.

Real servers with the roles' ACLs (rlboost/auth.py), as in tests/test_auth.py."""

from __future__ import annotations

import uuid
from urllib.parse import quote

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from rlboost import wire
from rlboost.checkpoint import CheckpointStore, LeaseLost
from rlboost.config import AuthSettings, ServicesSettings
from rlboost.services import EmbeddedServices

PASSWORDS = {"trainer": "trainer-pw", "worker": "worker-pw", "env": "env-pw"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    s = ServicesSettings(data_dir=str(tmp_path_factory.mktemp("rlboost-lease-proof")),
                         auth=AuthSettings(trainer_password=PASSWORDS["trainer"], worker_password=PASSWORDS["worker"],
                                           env_password=PASSWORDS["env"]))
    svc = EmbeddedServices(s)
    st, started = svc.up()
    assert started
    yield st
    svc.stop_recorded()


def url(st, role: str) -> str:
    return f"redis://{role}:{quote(PASSWORDS[role], safe='')}@127.0.0.1:{st.redis_port}/0"


@pytest.fixture
async def stores(secured):
    """(trainer, worker, env) stores, each its own client (its own secret), scripts loaded."""
    made = [CheckpointStore(url(secured, role)) for role in ("trainer", "worker", "env")]
    assert await made[0].load_scripts()
    yield made
    for s in made:
        await s.close()


@pytest.mark.parametrize("thief_role", ["worker", "env"])
async def test_a_stolen_credential_cannot_write_into_a_lease_it_did_not_claim(secured, stores, thief_role):
    """A generation worker holds an episode's lease. A thief with a worker (or env) credential
    reads the live epoch and runs every write script under it: each is refused as not the
    holder's, nothing of it lands, and the holder goes on writing."""
    _, worker, _ = stores
    thief = CheckpointStore(url(secured, thief_role))
    rid = f"proof-{uuid.uuid4().hex[:8]}"
    try:
        c = await worker.claim(rid, "gen-1", 0, ttl_s=10.0, episode=True)
        assert await worker.append(rid, "gen-1", c.epoch, 0, [5, 6], [-0.1, -0.2], 10.0) == 2
        await worker.put_episode(rid, "gen-1", c.epoch, wire.EpisodeState(turn=1, at=2), 10.0)
        epoch = await thief.epoch(rid)  # what any credential can read
        assert epoch == c.epoch
        with pytest.raises(LeaseLost):
            await thief.append_env(rid, "gen-1", epoch, 2, [66, 66], wire.EpisodeState(turn=1, at=4), 10.0)
        with pytest.raises(LeaseLost):
            await thief.put_episode(rid, "gen-1", epoch, wire.EpisodeState(turn=9, at=2), 10.0)
        with pytest.raises(LeaseLost):
            await thief.append(rid, "gen-1", epoch, 2, [66], [0.0], 10.0)
        with pytest.raises(LeaseLost):
            await thief.renew(rid, "gen-1", epoch, 10.0)
        assert not await thief.release(rid, epoch)
        with pytest.raises(LeaseLost):
            await thief.finish(rid, epoch, 2)
        assert isinstance((await thief.finish_many([(rid, epoch, 2)]))[0], LeaseLost)
        assert await thief.release_many([(rid, epoch)]) == [False]
        # nothing of it landed: the holder's tokens, state and lease are as it left them
        assert (await worker.read(rid))[0] == [5, 6]
        assert (await worker.episode(rid)) == wire.EpisodeState(turn=1, at=2)
        assert await worker.owner(rid) == ("gen-1", c.epoch, False)
        assert await worker.append(rid, "gen-1", c.epoch, 2, [7], [-0.3], 10.0) == 3
        await worker.finish(rid, c.epoch, 3)
        assert (await worker.read(rid))[0] == [5, 6, 7]
    finally:
        await thief.close()


async def test_a_claim_of_its_own_is_what_a_stolen_credential_can_write_under(secured, stores):
    """What the secret leaves to a thief: claiming a request itself, which takes the lease from
    its holder openly (a new epoch, a history line under the name it gave); the holder's next
    write is refused and it learns it lost the lease."""
    _, worker, _ = stores
    thief = CheckpointStore(url(secured, "worker"))
    rid = f"proof-{uuid.uuid4().hex[:8]}"
    try:
        c = await worker.claim(rid, "gen-1", 0, ttl_s=10.0)
        assert await worker.append(rid, "gen-1", c.epoch, 0, [5], [-0.1], 10.0) == 1
        t = await thief.claim(rid, "mallory", 0, ttl_s=10.0, steal=True)
        assert await thief.append(rid, "mallory", t.epoch, 1, [66], [0.0], 10.0) == 2
        with pytest.raises(LeaseLost):
            await worker.append(rid, "gen-1", c.epoch, 1, [6], [-0.2], 10.0)
        assert [s.worker_id for s in await worker.segments(rid)] == ["gen-1", "mallory"]
    finally:
        await thief.close()


async def test_a_released_lease_is_free_at_once(stores):
    """A release ends the lease with SET ... PX 1 (the rollout roles have no DEL, the env role no
    PEXPIRE): the next claimant takes it at once, and the released holder cannot write again."""
    _, worker, env = stores
    rid = f"proof-{uuid.uuid4().hex[:8]}"
    c = await worker.claim(rid, "gen-1", 0, ttl_s=30.0, episode=True)
    assert await worker.append(rid, "gen-1", c.epoch, 0, [5], [-0.1], 30.0) == 1
    assert await worker.release(rid, c.epoch)
    e = await env.claim(rid, "env-1", 0, ttl_s=30.0, episode=True, inherit=True)  # no LeaseHeld wait
    assert await worker.redis.pttl(wire.ckpt_lease_key(rid)) > 20_000  # the env worker's lease
    assert e.epoch > c.epoch and e.token_ids == [5]
    with pytest.raises(LeaseLost):
        await worker.renew(rid, "gen-1", c.epoch, 30.0)
    assert await env.release(rid, e.epoch)
    again = await worker.claim(rid, "gen-2", 0, ttl_s=30.0)
    await worker.finish(rid, again.epoch, 1)
    assert await worker.redis.pttl(wire.ckpt_lease_key(rid)) <= 1  # ended (-2 once gone)


@pytest.mark.parametrize("command", [("PEXPIRE", "{k}", 1), ("EXPIRE", "{k}", 1)])
async def test_the_env_credential_cannot_erase_a_finished_checkpoint(secured, stores, command):
    """The env credential's scripts shorten no key's life, so the role may not: a finished
    checkpoint it aims at (tokens, meta, history) keeps its tokens and its TTL."""
    trainer, worker, _ = stores
    rid = f"proof-{uuid.uuid4().hex[:8]}"
    c = await worker.claim(rid, "gen-1", 0, ttl_s=10.0)
    assert await worker.append(rid, "gen-1", c.epoch, 0, [5, 6], [-0.1, -0.2], 10.0) == 2
    await worker.finish(rid, c.epoch, 2)
    env = aioredis.from_url(url(secured, "env"))
    try:
        for key in (wire.ckpt_tokens_key(rid), wire.ckpt_meta_key(rid), wire.ckpt_history_key(rid)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await env.execute_command(*[key if a == "{k}" else a for a in command])
            assert await trainer.redis.ttl(key) > 3600
    finally:
        await env.aclose()
    assert (await trainer.read(rid))[0] == [5, 6] and (await trainer.owner(rid))[2]
