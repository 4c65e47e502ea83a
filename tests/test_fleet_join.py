"""The fleet-join model (`rlboost bench weights --model-fleet`): its answers move the way the
bandwidth it models says they must."""

from __future__ import annotations

from rlboost.benchmarks.fleet_join import MODELS, Bandwidth, origin_only_s, peers_s, table

BW = Bandwidth(link_gbps=25, origin_gbps=40, verify_mb_s=1000, verify_threads=8, piece_mb=64, delta_ratio=0.02,
               decode_ns=2.0)


def test_origin_only_grows_with_the_fleet_once_the_origin_is_the_bottleneck_and_peers_do_not():
    size = MODELS["8B"]
    assert origin_only_s(size, 1, BW) == peers_s(size, 1, BW) == size / (25e9 / 8)  # one instance: its link
    assert origin_only_s(size, 100, BW) == 100 * size / (40e9 / 8)  # the origin carries 100 copies
    assert peers_s(size, 100, BW) < 1.1 * peers_s(size, 1, BW)  # + log2(100) piece-times
    assert peers_s(size, 100, BW) < origin_only_s(size, 100, BW) / 50


def test_the_table_carries_the_origin_bytes_and_a_follower_pays_its_rebuild():
    rows = {(r["model"], r["pull"], r["instances"]): r for r in table(BW)}
    join = rows[("70B", "join (whole version)", 100)]
    assert join["origin_gb_origin_only"] == 100 * join["origin_gb_peers"] == 100 * 140.0
    follow = rows[("70B", "follow (delta)", 1)]
    assert follow["bytes_gb"] == 2.8
    # every rebuilt byte hashed at 8 GB/s, every element decoded at 2 ns on 8 threads
    assert follow["peers_s"] >= MODELS["70B"] / 8e9 + MODELS["70B"] / 2 * 2e-9 / 8 - 0.1
    slower_link = {(r["model"], r["pull"], r["instances"]): r for r in table(Bandwidth(link_gbps=10, origin_gbps=40))}
    assert slower_link[("8B", "join (whole version)", 1)]["peers_s"] > rows[("8B", "join (whole version)", 1)]["peers_s"]
