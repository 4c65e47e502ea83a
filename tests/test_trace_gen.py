"""The spot-trace family (benchmarks/trace_gen.py): every generated trace is a well-formed
Bamboo trace, a pure function of its seed, within its market's ceiling; the fitted market looks
like the two real traces; the drawn markets reach past them on both sides."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from rlboost.benchmarks.spot import intervals, parse_trace
from rlboost.benchmarks.trace_gen import BUNDLED, REAL, Market, expand, fit, generate, synthetic, trace_file, write


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), market_seed=st.integers(0, 10_000), hours=st.floats(0.1, 3.0))
def test_a_generated_trace_is_well_formed_and_within_its_ceiling(tmp_path_factory, seed, market_seed, hours):
    m = Market.drawn(market_seed)
    events = generate(m, hours, seed)
    path = write(events, tmp_path_factory.mktemp("t") / "x.csv")
    back = parse_trace(path)
    assert [(round(e.t_s, 3), e.kind, e.node) for e in back] == [(round(e.t_s, 3), e.kind, e.node) for e in events]
    kinds = Counter((e.node, e.kind) for e in events)
    assert all(n == 1 for n in kinds.values())  # each instance arrives once and goes at most once
    up: set[str] = set()
    for e in events:
        assert 0 <= e.t_s <= hours * 3600
        if e.kind == "add":
            up.add(e.node)
        else:
            assert e.node in up  # no instance goes before it came
            up.discard(e.node)
        assert len(up) <= m.ceiling


def test_a_trace_is_a_pure_function_of_its_market_and_seed(tmp_path):
    a = synthetic(3, 2.0, tmp_path / "a")
    b = synthetic(3, 2.0, tmp_path / "b")
    assert a.read_text() == b.read_text()
    assert synthetic(4, 2.0, tmp_path / "c").read_text() != a.read_text()


def test_the_fitted_market_looks_like_the_real_traces():
    real = [fit(parse_trace(BUNDLED / REAL[n])) for n in ("p3", "g4dn")]
    lo = {k: min(r[k] for r in real) for k in ("life_median_min", "alive_mean", "ceiling")}
    hi = {k: max(r[k] for r in real) for k in ("life_median_min", "alive_mean", "ceiling")}
    for seed in range(4):
        f = fit(generate(Market.fitted(), 11.0, seed))
        assert 0.6 * lo["life_median_min"] <= f["life_median_min"] <= 1.4 * hi["life_median_min"], f
        assert 0.7 * lo["alive_mean"] <= f["alive_mean"] <= 1.3 * hi["alive_mean"], f
        assert f["ceiling"] <= hi["ceiling"], f


def test_the_drawn_markets_reach_past_the_real_traces_on_both_sides():
    fits = [fit(generate(Market.drawn(s), 11.0, s)) for s in range(1, 9)]
    lives = [f["life_median_min"] for f in fits]
    alive = [f["alive_mean"] for f in fits]
    assert min(lives) < 40 and max(lives) > 70  # the real traces: 59 and 61 min
    assert min(alive) < 12 and max(alive) > 20  # the real traces: 12.6 and 24
    assert any(f["mass_preemptions"] >= 3 for f in fits) and any(f["mass_preemptions"] == 0 for f in fits)
    assert len({f["instances"] for f in fits}) == len(fits)


def test_an_instance_outliving_the_trace_has_no_remove():
    m = Market(life_median_min=10_000, life_spread=0.1, mass_per_hour=0.0, initial=5)
    events = generate(m, 1.0, 0)
    assert {e.kind for e in events} == {"add"}
    ivs = intervals(events, 0.0, 3600.0)
    assert len(ivs) >= 5 and not any(i.preempted for i in ivs)


def test_traces_named_on_the_command_line(tmp_path):
    assert expand("p3, g4dn,synthetic:1-3,synthetic:7") == ["p3", "g4dn", "synthetic:1", "synthetic:2",
                                                            "synthetic:3", "synthetic:7"]
    assert len(parse_trace(trace_file("p3", 1.0, tmp_path))) == 344
    assert trace_file("synthetic:2", 1.0, tmp_path).parent == tmp_path
    for bad in ("synthetic:x", "synthetic:1-y"):
        try:
            expand(bad)
        except ValueError as e:
            assert "synthetic:SEED" in str(e)
        else:
            raise AssertionError(bad)
    try:
        trace_file("nope", 1.0, tmp_path)
    except ValueError as e:
        assert "not p3, g4dn" in str(e)
    else:
        raise AssertionError("nope")


def test_the_availability_bound_follows_what_the_trace_offers():
    from rlboost.benchmarks.spot import Interval
    from rlboost.benchmarks.trace_model import TRAIN_S_PER_TOKEN, availability_bound

    g = 4 * TRAIN_S_PER_TOKEN  # GPU-s per token generated
    per_n = lambda n: min(1 / TRAIN_S_PER_TOKEN, (8 + 2 * n) / (g + 8 * TRAIN_S_PER_TOKEN))  # noqa: E731
    # nothing for the first half, then one instance, then (a quarter) two of them
    ivs = [Interval("a", 50.0, 100.0, False), Interval("b", 75.0, 100.0, False)]
    b = availability_bound(ivs, 100.0, g, reserved_only=1000.0)
    want = (50 * 1000.0 + 25 * per_n(1) + 25 * per_n(2)) / 100
    assert abs(b["availability_bound"] - want) < 1e-6 and b["none_available_s"] == 50.0
    # many instances: the trainer is the limit
    many = [Interval(f"n{k}", 0.0, 100.0, False) for k in range(400)]
    assert abs(availability_bound(many, 100.0, g, 1000.0)["availability_bound"] - 1 / TRAIN_S_PER_TOKEN) < 1e-6
