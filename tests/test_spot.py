"""Spot traces and cost accounting: parsing with named errors, segments, sampling, hand-computed costs."""

from __future__ import annotations

import pytest

from rlboost.benchmarks.costs import Prices, cost_efficiency, cost_per_hour, run_cost
from rlboost.benchmarks.spot import Interval, TraceError, available, instance_seconds, intervals, parse_trace, sample_nodes

TRACE = """0,add,node1
0,add,node2
60000,remove,node1
90000,add,node3
120000,add,node1
150000,remove,node2
"""


def test_parse_segment_and_count(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text(TRACE)
    events = parse_trace(f)
    assert [e.kind for e in events].count("add") == 4
    ivs = intervals(events, start_s=30, duration_s=100)  # [30, 130)
    assert Interval("node1", 0, 30, True) in ivs  # up before the segment, preempted at 60 s
    assert Interval("node2", 0, 100, False) in ivs  # outlives the segment
    assert Interval("node3", 60, 100, False) in ivs
    assert Interval("node1", 90, 100, False) in ivs  # came back
    assert available(ivs, 10) == 2 and available(ivs, 95) == 3
    assert instance_seconds(ivs) == 30 + 100 + 40 + 10


@pytest.mark.parametrize("bad,what", [("12,add", "line 2"), ("x,add,node1", "not an integer"),
                                      ("5,launch,node1", "line 2")])
def test_malformed_line_is_named(tmp_path, bad, what):
    f = tmp_path / "t.csv"
    f.write_text(f"0,add,node1\n{bad}\n")
    with pytest.raises(TraceError, match=what):
        parse_trace(f)


def test_sampling_is_seeded_and_sized(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("".join(f"0,add,node{i}\n" for i in range(20)))
    events = parse_trace(f)
    a, b = sample_nodes(events, 0.5, seed=3), sample_nodes(events, 0.5, seed=3)
    assert a == b and len(a) == 10 and a != sample_nodes(events, 0.5, seed=4)


def test_bundled_traces_parse():
    from pathlib import Path

    for name in ("bamboo-p3-trace.csv", "bamboo-g4dn-trace.csv"):
        path = Path(__file__).parents[2] / "shared" / "traces" / name
        if path.exists():
            assert len(parse_trace(path)) > 100


def test_costs_by_hand():
    # 8 reserved GPUs for 2 h at $10.47 + 3 instance-hours of 2-GPU spot at $2.66
    dollars = run_cost(7200, 8, 3 * 3600, 2, Prices())
    assert dollars == pytest.approx(8 * 2 * 10.47 + 2 * 3 * 2.66)
    rate = cost_per_hour(dollars, 7200)
    assert rate == pytest.approx((167.52 + 15.96) / 2)
    assert cost_efficiency(10_000, rate) == pytest.approx(10_000 / rate)


def test_rented_fleet_is_capped_and_replaced():
    from rlboost.benchmarks.spot import rented

    ivs = [Interval("a", 0, 10, True), Interval("b", 0, 100, False), Interval("c", 5, 50, True)]
    assert rented(ivs, 0) == ivs
    # at most one: a until its preemption, then b takes over at once
    assert rented(ivs, 1) == [Interval("a", 0, 10, True), Interval("b", 10, 100, False)]
    two = rented(ivs, 2)
    assert Interval("c", 10, 50, True) in two and instance_seconds(two) == 10 + 100 + 40
    assert max(available(two, t) for t in range(100)) == 2


def test_uptime_clipped_to_the_run():
    ivs = [Interval("a", 0, 100, False), Interval("b", 50, 80, True)]
    assert instance_seconds(ivs, until_s=60) == 60 + 10
    # a run of 60 s: 8 reserved GPUs + 70 instance-seconds of 2 GPUs
    assert run_cost(60, 8, instance_seconds(ivs, until_s=60), 2) == pytest.approx(
        8 * 60 / 3600 * 10.47 + 2 * 70 / 3600 * 2.66)


def test_blank_lines_and_comments_are_skipped_and_errors_name_the_line(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("# a comment\n\n0,add,node1\n1000,remove,node1\n2000,add\n")
    with pytest.raises(TraceError, match=r"line 5"):
        parse_trace(f)
