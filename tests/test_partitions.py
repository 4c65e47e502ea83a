"""Links that fail while both ends stay up (`rlboost bench partitions`): real servers, real worker
processes, each worker behind fault relays of its own (benchmarks/relay.py)."""

from __future__ import annotations

import argparse
import asyncio
import os

import pytest

from rlboost import wire
from rlboost.benchmarks import netns, partitions


def _args(**over) -> argparse.Namespace:
    a = partitions.parser().parse_args([])
    for k, v in over.items():
        setattr(a, k, v)
    return a


def _assert_clean(out: dict) -> None:
    assert out["lost"] == out["duplicated"] == out["mismatched"] == out["wrong_version_tokens"] == 0, out
    assert out["stale_writes_accepted"] == out["epochs_reused"] == out["writes_after_takeover"] == 0, out
    assert out["workers_stalled"] == 0, out
    assert out["history_violations"] == 0 and out["history_ops"] > 0, out  # benchmarks/history.py


def _claim(rid: str, worker: str, epoch: int, offset: int) -> wire.LeaseEvent:
    return wire.LeaseEvent(request_id=rid, step=1, worker_id=worker, epoch=epoch, kind="claim", offset=offset, ts=0.0)


def _chunk(rid: str, worker: str, epoch: int, offset: int) -> wire.TokenChunk:
    return wire.TokenChunk(request_id=rid, step=1, worker_id=worker, epoch=epoch, offset=offset, token_ids=[1] * 16,
                          logprobs=[0.0] * 16, policy_version=0, ts=0.0)


def test_the_takeover_check_catches_an_old_lease_writing_past_the_new_ones_start():
    """What a broken fence would leave: the old holder's append at the offset the new holder
    resumed from, accepted. Writes before the takeover point are the old lease's own."""
    events = [_claim("r", "a", 10, 0), _claim("r", "b", 20, 32)]
    fine = [_chunk("r", "a", 10, 0), _chunk("r", "a", 10, 16), _chunk("r", "b", 20, 32)]
    assert partitions.writes_after_takeover(events, fine) == 0
    assert partitions.writes_after_takeover(events, [*fine, _chunk("r", "a", 10, 32)]) == 1
    assert partitions.taken_over(events, "a") == 1 and partitions.taken_over(events, "b") == 0


def test_every_scenario_has_its_fault_and_an_unknown_one_is_refused_before_any_server_starts(tmp_path):
    assert set(partitions.FAULTS) == set(partitions.SCENARIOS + partitions.NETNS_SCENARIOS)
    with pytest.raises(ValueError, match="unknown scenario 'redis_cutt'"):
        asyncio.run(partitions.run_partition("redis_cutt", _args(), tmp_path))
    assert not any(tmp_path.iterdir()), "servers were started for a scenario that does not exist"


@pytest.mark.slow
def test_a_worker_cut_off_from_redis_with_nats_up_loses_nothing_and_comes_back(tmp_path):
    out = asyncio.run(partitions.run_partition("redis_cut", _args(requests=120, cut_s=6.0, timeout=60.0), tmp_path))
    _assert_clean(out)
    assert out["victim_resumed_s"] is not None and out["victim_resumed_s"] < 10


@pytest.mark.slow
def test_a_worker_whose_redis_answers_past_the_lease_ttl_has_no_write_accepted_after_a_takeover(tmp_path):
    out = asyncio.run(partitions.run_partition("redis_slow", _args(requests=120, timeout=60.0), tmp_path))
    _assert_clean(out)
    assert out["taken_over"] > 0, "the slow worker's requests were never claimed by another: nothing was tested"


@pytest.mark.slow
def test_a_worker_whose_redis_connections_go_half_open_loses_nothing_and_comes_back(tmp_path):
    """A call on a dead connection is noticed by the Redis client's socket timeout (5 s) and retried
    on a new one: the worker answers again within that of the link's return, its requests taken
    over meanwhile."""
    out = asyncio.run(partitions.run_partition("redis_half_open", _args(requests=240, cut_s=6.0, timeout=60.0),
                                               tmp_path))
    _assert_clean(out)
    assert out["victim_resumed_s"] is not None and out["victim_resumed_s"] < 10


@pytest.mark.slow
def test_workers_with_every_server_unreachable_idle_and_resume_within_5_s(tmp_path):
    out = asyncio.run(partitions.run_partition("all_unreachable", _args(requests=120, outage_s=12.0, timeout=60.0),
                                               tmp_path))
    _assert_clean(out)
    assert len(out["cpu_pct"]) == 3 and out["cpu_pct_max"] < 5.0, out["cpu_pct"]
    assert out["resumed_s_max"] is not None and out["resumed_s_max"] <= 5.0, out["resumed_s"]


@pytest.mark.slow
def test_a_worker_cut_off_from_nats_with_redis_up_loses_nothing_and_comes_back(tmp_path):
    out = asyncio.run(partitions.run_partition("nats_cut", _args(requests=180, cut_s=6.0, timeout=60.0), tmp_path))
    _assert_clean(out)
    assert out["victim_resumed_s"] is not None and out["victim_resumed_s"] < 5


@pytest.mark.slow
def test_a_worker_whose_nats_connection_goes_half_open_notices_and_comes_back(tmp_path):
    """Before: nats-py's default pings (every 2 min, 2 outstanding) left the worker on the dead
    connection for minutes after the link returned; it claimed nothing more and its drain timed
    out. Workers ping every 2 s now (workers/main.py)."""
    out = asyncio.run(partitions.run_partition("nats_half_open", _args(requests=180, timeout=60.0), tmp_path))
    _assert_clean(out)
    assert out["victim_resumed_s"] is not None and out["victim_resumed_s"] < 10  # from the link going dead


@pytest.mark.slow
def test_a_trainer_cut_off_from_nats_mid_step_takes_every_result_once_and_hears_again_at_once(tmp_path):
    """The trainer's link goes while the workers publish on: their results pile up unheard. Before:
    nats-py reconnected within a second, but the results reader (an ordered consumer the server
    dropped meanwhile) noticed only after two missed idle heartbeats, ~9 s after the link
    returned. `PoolClient.results` follows again from where it left off after each reconnect."""
    out = asyncio.run(partitions.run_partition("trainer_nats_cut", _args(requests=120, cut_s=6.0, timeout=60.0),
                                               tmp_path))
    _assert_clean(out)
    assert out["trainer"] == "returned" and out["taken"] == 120, out
    assert out["taken_lost"] == out["taken_duplicated"] == out["taken_mismatched"] == 0, out
    assert out["taken_wrong_version_tokens"] == 0, out
    assert 0 < out["taken_at_cut"] < 120 and out["results_during_cut"] > 0, "not mid-step: nothing was tested"
    assert out["recovery_s"] is not None and out["recovery_s"] < 3, out["recovery_s"]


@pytest.mark.slow
def test_a_trainer_whose_nats_connection_goes_half_open_notices_and_takes_every_result_once(tmp_path):
    """Before: nats-py's default pings (every 2 min) left the trainer on the dead connection for
    minutes, its step waiting on results it could not hear. It pings every 5 s now
    (`rlboost.pool_client.NATS_OPTIONS`)."""
    out = asyncio.run(partitions.run_partition("trainer_nats_half_open", _args(requests=120, timeout=60.0), tmp_path))
    _assert_clean(out)
    assert out["trainer"] == "returned" and out["taken"] == 120, out
    assert out["taken_lost"] == out["taken_duplicated"] == out["taken_mismatched"] == 0, out
    assert 0 < out["taken_at_cut"] < 120, "not mid-step: nothing was tested"
    assert out["recovery_s"] is not None and out["recovery_s"] < 20, out["recovery_s"]  # from the link going dead


@pytest.mark.slow
def test_a_nats_node_cut_off_from_its_peers_with_workers_on_both_sides_loses_nothing_and_comes_back(tmp_path):
    """`rlboost up --cluster 3` (replication 3) with the routes through relays: the node leading the
    work queue loses every route while w001 and w004 stay connected to it. The majority elects
    another leader and carries on; the isolated workers' publishes go unanswered (their leases, in
    Redis, hold), and once the routes return they store their results, each once."""
    # 300 requests: the majority stores ~90 during the cut; with 120 it sometimes finished the step
    # soon after, and an isolated worker whose requests were taken over had nothing left to
    # resume with (recovery None in a CI run on Nov 28)
    out = asyncio.run(partitions.run_partition("nats_node_isolated", _args(requests=300, workers=4, cut_s=12.0,
                                                                           timeout=90.0), tmp_path))
    _assert_clean(out)
    assert out["isolated_routes_during_cut"] == 0, "a route around the relays: the node was never isolated"
    assert out["isolated_workers"] == ["w001", "w004"]
    assert out["leader_during_cut"] not in (None, out["isolated_node"]), out  # the majority elected its own
    assert out["results_during_cut"] > 0, "the majority stopped while one node of three was cut off"
    assert out["cpu_pct_max"] < 10.0, out["cpu_pct"]  # waiting, not spinning
    assert out["recovery_s"] is not None and out["recovery_s"] < 15, out["isolated_resumed_s"]
    assert out["all_in_s"] is not None


# Real links (benchmarks/netns.py): servers and workers in network namespaces of their own, a cut
# is a veth pair set down at both ends (no reset: open connections hang, new ones find no route).
_NO_NETNS = netns.unavailable()
needs_netns = pytest.mark.skipif(_NO_NETNS is not None, reason=f"no network namespaces here: {_NO_NETNS}")


def _run_netns(name: str, tmp_path, **over) -> dict:
    try:
        return asyncio.run(partitions.run_partition(name, _args(timeout=60.0, **over), tmp_path))
    finally:
        left = [n for n in netns.namespaces() if n.startswith(f"rb-{os.getpid()}-")]
        assert left == [], f"namespaces left behind: {left}"


@pytest.mark.slow
@needs_netns
def test_a_worker_whose_veth_to_redis_goes_down_with_nats_up_loses_nothing_and_comes_back(tmp_path):
    out = _run_netns("netns_redis_cut", tmp_path, requests=120, cut_s=6.0)
    _assert_clean(out)
    assert out["victim_resumed_s"] is not None and out["victim_resumed_s"] < 10


@pytest.mark.slow
@needs_netns
def test_a_worker_whose_veth_to_nats_goes_down_with_redis_up_loses_nothing_and_comes_back(tmp_path):
    out = _run_netns("netns_nats_cut", tmp_path, requests=180, cut_s=6.0)
    _assert_clean(out)
    assert out["victim_resumed_s"] is not None and out["victim_resumed_s"] < 10


@pytest.mark.slow
@needs_netns
def test_a_worker_whose_link_to_redis_flaps_past_the_ack_wait_is_fenced_each_time_and_comes_back(tmp_path):
    """Downs of 6 s (ack wait 3 s): its requests are handed on while it cannot write, then it
    writes again over the restored link; none of its late writes may be accepted."""
    out = _run_netns("netns_flap", tmp_path, requests=360, flaps=3, flap_down_s=6.0)
    _assert_clean(out)
    assert out["flaps"] == 3 and out["flapped"].endswith("-redis")
    assert out["taken_over"] > 0, "nothing of the flapped worker was handed on: the fence was not tested"
    assert out["victim_resumed_s"] is not None and out["victim_resumed_s"] < 10
