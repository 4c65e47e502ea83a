"""`rlboost bench trace --traces p3,g4dn,synthetic:1-8`: one operating point judged on a family
of traces, not on the two it was tuned on (benchmarks/trace_gen.py makes the synthetic ones).

Every trace is cut and sampled as `--trace` is (`--start`, `--duration`, `--fraction`, `--seed`);
the reserved-only baselines (colocated, disaggregated) do not depend on the trace and run once;
each hybrid run (`--mode` x `--fleet`) runs on every trace. Each hybrid row is judged against
colocated, the linear oracle, its own bound and the availability-aware bound
(`trace_model.availability_bound`); the summary gives, per hybrid run, the median over the
traces and the worst trace of each figure. The plot (`--out`, trace.png) is the worst trace's:
available vs rented instances and the per-step throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from rlboost.benchmarks import report
from rlboost.benchmarks.spot import Interval, instance_seconds, intervals, parse_trace, sample_nodes
from rlboost.benchmarks.trace_gen import expand, trace_file
from rlboost.benchmarks.trace_report import plot, print_table
from rlboost.config import Settings
from rlboost.services import running_services

FIGURES = ("throughput_ratio", "cost_efficiency_gain", "availability_fraction", "bound_fraction", "oracle_fraction")


def family_intervals(a: argparse.Namespace, workdir: Path) -> dict[str, list[Interval]]:
    """Each named trace's availability intervals of the segment (generated traces are written
    into `workdir`/traces, long enough for the segment)."""
    hours = (a.start + a.duration) / 3600 + 0.1
    out = {}
    for name in expand(a.traces):
        events = parse_trace(trace_file(name, hours, workdir / "traces"))
        nodes = sample_nodes(events, a.fraction, a.seed)
        out[name] = intervals([e for e in events if e.node in nodes], a.start, a.duration)
    return out


def family_runs(a: argparse.Namespace, traces: dict[str, list[Interval]], hybrids: list[tuple[str, str, str]]) -> list:
    """(label, policy, intervals, mode, fleet) for `evaluate`: the baselines once, each hybrid run
    (label, mode, fleet) on each trace as `<trace>|<label>`."""
    names = [x for x in a.policies.split(",") if x]
    runs: list[tuple] = [(x, x, [], "sync", "all") for x in names if x != "hybrid"]
    if "hybrid" in names:
        runs += [(f"{t}|{label}", "hybrid", ivs, mode, fleet) for t, ivs in traces.items() for label, mode, fleet in hybrids]
    return runs


def per_trace(policies: dict, traces: dict[str, list[Interval]], a: argparse.Namespace, summarise) -> dict[str, dict]:
    """trace -> its policies (the baselines and its own hybrid rows), each judged by `summarise`."""
    base = {k: v for k, v in policies.items() if "|" not in k}
    out = {}
    for t, ivs in traces.items():
        own = {k.partition("|")[2]: v for k, v in policies.items() if k.startswith(f"{t}|")}
        out[t] = summarise({**base, **own}, ivs, a)["policies"]
    return out


def summary(rows: dict[str, dict]) -> dict[str, dict]:
    """Per hybrid run: each figure's median over the traces, its worst value and which trace."""
    labels = sorted({k for r in rows.values() for k, v in r.items() if "availability_bound" in v or "bound" in v
                     and k.startswith("hybrid")})
    out: dict[str, dict] = {}
    for label in labels:
        got = {t: r[label] for t, r in rows.items() if label in r}
        s: dict = {"traces": len(got)}
        for f in FIGURES:
            xs = {t: v[f] for t, v in got.items() if v.get(f) is not None}
            if xs:
                worst = min(xs, key=xs.get)
                s[f] = {"median": round(statistics.median(xs.values()), 3), "worst": xs[worst], "worst_trace": worst}
        out[label] = s
    return out


def run_family(a: argparse.Namespace, s: Settings, hybrids: list[tuple[str, str, str]], evaluate, summarise) -> int:
    """The whole `--traces` command: runs, per-trace rows, the summary table, one JSON line."""
    t_wall = time.monotonic()
    out_dir = report.out_dir(a, prefix="rlboost-trace-out-")
    try:
        traces = family_intervals(a, out_dir)
    except (ValueError, OSError) as e:
        print(f"rlboost bench trace: {e}", flush=True)
        return 2
    for t, ivs in traces.items():
        print(f"trace {t}: {len(ivs)} availability intervals, {sum(i.preempted for i in ivs)} preemptions, "
              f"{instance_seconds(ivs) / a.duration:.2f} instances up on average", flush=True)
    runs = family_runs(a, traces, hybrids)
    if not (s.services.nats_url and s.services.redis_url):
        s.services.data_dir = tempfile.mkdtemp(prefix="rlboost-trace-")
    with running_services(s.services) as (nats_url, redis_url):
        policies = asyncio.run(evaluate(a, nats_url, redis_url, out_dir, runs))
    rows = per_trace(policies, traces, a, summarise)
    for t, r in rows.items():
        print(f"\n{t}:", end="")
        print_table(r)
    judged = summary(rows)
    print("\nover the traces (median / worst, the worst's trace):")
    for label, figs in judged.items():
        parts = [f"{f} {v['median']:.3g} / {v['worst']:.3g} ({v['worst_trace']})" for f, v in figs.items()
                 if isinstance(v, dict)]
        print(f"  {label}: " + "; ".join(parts), flush=True)
    first = next(iter(judged), None)
    worst = judged[first]["cost_efficiency_gain"]["worst_trace"] if first and "cost_efficiency_gain" in judged[first] \
        else next(iter(traces))
    lean = {t: {k: {f: v for f, v in row.items() if f not in ("series", "rented_series", "decisions", "rented_intervals")}
                for k, row in r.items()} for t, r in rows.items()}
    result = {"traces": lean, "summary": judged, "worst_trace": worst, "segment": [a.start, a.duration],
              "fraction": a.fraction, "seed": a.seed, "speed": a.speed, "fleet": a.fleet, "mode": a.mode,
              "wall_s": round(time.monotonic() - t_wall, 1)}
    return report.finish("trace", {**result, "rows": rows}, out_dir, line=result,
                         plot=lambda path: plot(traces[worst], a.duration, rows[worst], path))
