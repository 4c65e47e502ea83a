"""The run lease (rlboost/runlease.py): one `rlboost run` per set of servers, on the session's real
NATS. A second run is refused naming the holder; a clean exit releases the lease at once; a
SIGKILLed holder's lease lapses after its TTL (or is taken over at once by a process that can see
it is dead); renewals keep a live one past its TTL; a resumed run waits its previous life out."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import pytest_asyncio

from rlboost import bus, runlease, wire
from rlboost.errors import RunLeaseError, RunLeaseHeld, RunLeaseLost

TTL = 2.0  # seconds: short, so a lapse is seen within the test; renewals every 2/3 s
ROOT = Path(__file__).parents[1]


async def _drop_bucket(js) -> None:
    try:
        await js.delete_key_value(wire.BUCKET_RUN)
    except Exception:  # none yet
        pass


async def _fresh_bucket(nats_url: str) -> None:
    nc = await bus.connect(nats_url)
    try:
        await _drop_bucket(nc.jetstream())
    finally:
        await nc.close()


@pytest_asyncio.fixture
async def kv(nc):
    """The lease bucket, fresh (the session's servers are shared with tests that run `rlboost run`)."""
    await _drop_bucket(nc.jetstream())
    return await runlease.open_bucket(nc.jetstream(), TTL)


async def _until(check, within_s: float, what: str) -> float:
    """Wait for a state; returns the seconds it took."""
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < within_s, f"not within {within_s} s: {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def _forged(run_id: str, host: str = "elsewhere") -> bytes:
    """A lease record of a run on another machine (no pid space shared with this one)."""
    now = time.time()
    return wire.encode(wire.RunLease(run_id=run_id, token="t-" + run_id, host=host, pid=4242, started=now,
                                     renewed=now, ttl_s=TTL, data_dir="/somewhere/data", run_dir="runs/x"))


async def test_a_lease_this_rlboost_cannot_read_refuses_the_run_in_one_line(nc, kv):
    """An entry from the wire that is no lease of this schema (another version's, or junk) is
    refused with a reason, never a traceback; an absurd time in a valid one still describes."""
    js = nc.jetstream()
    other_version = wire.RunLease(v=999, run_id="rother", token="t", host="h", pid=1, started=0.0, renewed=0.0, ttl_s=TTL)
    await kv.put(runlease.KEY, wire.encode(other_version))
    with pytest.raises(RunLeaseError, match="not one this rlboost reads.*schema version 999"):
        await runlease.RunLease.take(js, "rmine", ttl_s=TTL)
    await kv.put(runlease.KEY, b"\xff not json")
    with pytest.raises(RunLeaseError, match="not one this rlboost reads"):
        await runlease.RunLease.take(js, "rmine", ttl_s=TTL)
    odd = wire.RunLease(run_id="rodd", token="t", host="h", pid=1, started=1e300, renewed=time.time(), ttl_s=TTL)
    assert "since ?" in runlease.describe(odd, 1.0)


async def test_a_second_run_is_refused_naming_the_holder_and_a_clean_exit_releases_at_once(nc, kv):
    js = nc.jetstream()
    async with runlease.hold(js, "rfirst", ttl_s=TTL, run_dir="runs/first", data_dir="/data/a") as first:
        with pytest.raises(RunLeaseHeld) as e:
            await runlease.RunLease.take(js, "rsecond", ttl_s=TTL)
        msg = str(e.value)
        assert "\n" not in msg
        for part in ("run rfirst", f"pid {os.getpid()}", "host ", "run dir runs/first", "data dir /data/a",
                     "since ", "lapses in", "RLBOOST_DATA_DIR", "RLBOOST_NATS_URL"):
            assert part in msg, (part, msg)
        assert e.value.holder.run_id == "rfirst" and 0 < e.value.lapses_in_s <= TTL
        # the same run started again in this live process (a resume while it runs) is refused too,
        # after waiting a TTL out during which the holder renewed
        with pytest.raises(RunLeaseHeld, match="it is alive"):
            await runlease.RunLease.take(js, "rfirst", ttl_s=TTL, resume=True)
        assert (await runlease.read(kv))[1].token == first.me.token
    assert await runlease.read(kv) is None  # gone at once, not after the TTL
    second = await runlease.RunLease.take(js, "rsecond", ttl_s=TTL + 1)
    assert (await runlease.read(kv))[1].run_id == "rsecond"
    assert (await kv.status()).ttl == TTL + 1  # the holder's TTL is the bucket's (its max age)
    assert await second.release()


async def test_renewals_keep_the_lease_past_its_ttl(nc, kv):
    js = nc.jetstream()
    async with runlease.hold(js, "rlong", ttl_s=TTL) as lease:
        first_rev, t0 = lease.revision, time.monotonic()

        async def renewed_past_ttl() -> bool:  # renewals went on for two TTLs
            return time.monotonic() - t0 > 2 * TTL and lease.revision >= first_rev + 5

        await _until(renewed_past_ttl, 6 * TTL, "renewals")
        rev, held = await runlease.read(kv)
        assert held.token == lease.me.token and rev == lease.revision and lease.retaken == 0
        assert held.renewed > held.started
    assert await runlease.read(kv) is None


HOLDER = textwrap.dedent("""
    import asyncio, sys
    from rlboost import bus, runlease

    async def main():
        nc = await bus.connect(sys.argv[1])
        async with runlease.hold(nc.jetstream(), sys.argv[2], ttl_s=float(sys.argv[3])):
            print("held", flush=True)
            await asyncio.Event().wait()

    asyncio.run(main())
""")


def _start_holder(nats_url: str, run_id: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, nats_url, run_id, str(TTL)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "held"
    return p


async def test_a_sigkilled_holder_lapses_after_its_ttl(nc, kv, nats_url):
    holder = _start_holder(nats_url, "rkilled")
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        rev, held = await runlease.read(kv)
        assert held.run_id == "rkilled" and held.pid == holder.pid
        assert runlease.holder_dead(held)  # this process can see it: same machine, pid gone
        killed_at = time.monotonic()

        async def lapsed() -> bool:
            return await runlease.read(kv) is None

        took = await _until(lapsed, TTL + 3.0, "the lease to lapse")
        assert took <= TTL + 1.5
        print(f"lapsed {time.monotonic() - killed_at:.2f} s after the SIGKILL (TTL {TTL} s)")
    finally:
        if holder.poll() is None:
            holder.kill()


@pytest.mark.parametrize("reaped", [True, False])  # False: a zombie, its parent has not waited for it yet
async def test_a_dead_holder_on_this_machine_is_taken_over_at_once(nc, kv, nats_url, reaped):
    holder = _start_holder(nats_url, "rdead")
    try:
        holder.send_signal(signal.SIGKILL)
        if reaped:
            holder.wait()
        else:
            while not (Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"):
                await asyncio.sleep(0.01)  # killed: a zombie until waited for
        t0 = time.monotonic()
        lease = await runlease.RunLease.take(nc.jetstream(), "rnext", ttl_s=TTL)
        assert time.monotonic() - t0 < TTL / 2  # not waited out
        assert (await runlease.read(kv))[1].run_id == "rnext"
        await lease.release()
    finally:
        holder.kill()
        holder.wait()


async def test_a_holder_elsewhere_refuses_a_new_run_and_a_resume_of_its_run_waits_it_out(nc, kv):
    """A run on another machine that died: this process cannot prove it, so a new run is refused
    (with the time left), and a resume of that same run waits for its lease to lapse, then holds it."""
    js = nc.jetstream()
    await kv.create(wire.RUN_LEASE_KEY, _forged("rgone"))
    assert not runlease.holder_dead((await runlease.read(kv))[1])
    with pytest.raises(RunLeaseHeld, match=r"run rgone \(host elsewhere, pid 4242.*lapses in [0-2] s"):
        await runlease.RunLease.take(js, "rnew", ttl_s=TTL)
    t0 = time.monotonic()
    lease = await runlease.RunLease.take(js, "rgone", ttl_s=TTL, resume=True)
    waited = time.monotonic() - t0
    assert 0.2 < waited <= TTL + 1.5
    assert (await runlease.read(kv))[1].token == lease.me.token
    await lease.release()


async def test_a_lapsed_lease_is_taken_again_and_one_another_run_took_stops_this_run(nc, kv):
    js = nc.jetstream()
    async with runlease.hold(js, "rstall", ttl_s=TTL) as lease:
        await kv.delete(wire.RUN_LEASE_KEY)  # as if it lapsed (the loop stalled past the TTL), nobody took it

        async def retaken() -> bool:
            return lease.retaken == 1

        await _until(retaken, 3 * TTL, "the renewal to take it again")
        assert (await runlease.read(kv))[1].token == lease.me.token

    with pytest.raises(RunLeaseLost, match="rthief"):
        async with runlease.hold(js, "rstall", ttl_s=TTL):
            await kv.delete(wire.RUN_LEASE_KEY)
            await kv.create(wire.RUN_LEASE_KEY, _forged("rthief"))
            await asyncio.Event().wait()  # the run's work: stopped by the lost lease
    assert (await runlease.read(kv))[1].run_id == "rthief"  # the other run's lease is left alone


async def _holder_now(nats_url: str) -> wire.RunLease | None:
    nc = await bus.connect(nats_url)
    try:
        held = await runlease.read(await nc.jetstream().key_value(wire.BUCKET_RUN))
        return held[1] if held else None
    finally:
        await nc.close()


@pytest.mark.slow  # the whole command in-process (torch, the model): ~9 s
def test_rlboost_run_on_held_servers_exits_2_with_one_line(services, tmp_path, monkeypatch, capsys):
    """The command as a user meets it: while another process holds the servers, `rlboost run`
    is refused in one line, exit 2, before its model loads or a metric is written. The holder's
    own exit (Ctrl-C) releases the lease at once."""
    from rlboost import cli
    from rlboost.trainer.model import init_model_dir
    from rlboost.trainer.tasks import get_task

    nats_url, redis_url = services
    asyncio.run(_fresh_bucket(nats_url))
    model = init_model_dir(tmp_path / "model", get_task("addition"), seed=1)
    (model / "rlboost.json").write_text(json.dumps({**json.loads((model / "rlboost.json").read_text()),
                                                    "trained": True}))
    monkeypatch.setenv("RLBOOST_NATS_URL", nats_url)
    monkeypatch.setenv("RLBOOST_REDIS_URL", redis_url)
    holder = _start_holder(nats_url, "rheld")
    try:
        code = cli.main(["--data-dir", str(tmp_path / "data"), "run", "--model-dir", str(model), "--run-dir",
                         str(tmp_path / "run"), "--steps", "1", "--workers", "0"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith("rlboost run: error: these servers are held by run rheld (host ")
        assert f"pid {holder.pid}" in err[0] and "RLBOOST_DATA_DIR" in err[0]
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
        holder.send_signal(signal.SIGINT)  # a clean exit: asyncio.run cancels the run, which lets go
        assert holder.wait(timeout=30) != -signal.SIGKILL
        assert asyncio.run(_holder_now(nats_url)) is None  # released, not lapsed
    finally:
        if holder.poll() is None:
            holder.kill()
