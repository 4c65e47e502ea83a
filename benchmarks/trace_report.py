"""What `rlboost bench trace` shows: the table of policies and the plot of available vs rented
instances beside each run's throughput (benchmarks/trace.py runs them)."""

from __future__ import annotations

from pathlib import Path

from rlboost.benchmarks.report import print_table as _table
from rlboost.benchmarks.spot import Interval, available


def rented_of(run: dict) -> list[Interval]:
    """The instances a hybrid run rented, from its JSON."""
    return [Interval(node, up, down, pre) for node, up, down, pre in run.get("rented_intervals", [])]


def print_table(policies: dict, published: dict[str, float] | None = None, model: dict[str, float] | None = None) -> None:
    """`published`: the paper's figures; `model`: the timing model alone (no system overhead)."""

    def bounded(key: str):  # the columns against colocated and the bound: hybrid runs only
        return lambda row: row[1].get(key) if "bound" in row[1] else None

    columns = [("policy", "<20", lambda row: row[0]), ("tokens/s", ">10,.0f", lambda row: row[1]["throughput"]),
               ("$/h", ">9.2f", lambda row: row[1]["cost_per_hour"]),
               ("tok/s per $/h", ">15.2f", lambda row: row[1]["cost_efficiency"]),
               ("rented", ">8.2f", lambda row: row[1].get("avg_instances_rented")),
               ("x coloc", ">9.2f", bounded("throughput_ratio")), ("cost eff", ">+9.0%", bounded("cost_efficiency_gain")),
               ("bound", ">8,.0f", bounded("bound")), ("of bound", ">9.0%", bounded("bound_fraction")),
               ("of avail", ">9.0%", bounded("availability_fraction")),
               ("preempt", ">9", lambda row: row[1]["preemptions"]),
               ("regen", ">10", lambda row: row[1]["regenerated_tokens"]),
               ("hand-offs", ">10", lambda row: row[1].get("handoffs", 0))]
    for title, spec, figures in (("published", ">11,.0f", published), ("model", ">9,.0f", model)):
        if figures:
            columns.append((title, spec, lambda row, f=figures: f.get(row[0])))
    print()
    _table(policies.items(), columns, sep="")


def plot(ivs: list[Interval], duration: float, policies: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [duration * i / 600 for i in range(601)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    ax1.step([t / 60 for t in ts], [available(ivs, t) for t in ts], where="post", color="gray", label="available")
    for name, r in policies.items():  # each hybrid run's rented instances
        if ivs and name.startswith("hybrid") and r.get("rented_intervals") is not None:
            fleet = rented_of(r)
            ax1.step([t / 60 for t in ts], [available(fleet, t) for t in ts], where="post", ls="--", lw=1,
                     label=f"rented: {name}")
    if ivs:
        ax1.legend(loc="upper left", fontsize=7)
    ax1.set_xlabel("minutes into the segment")
    ax1.set_ylabel("preemptible instances up (2xH100 each)", color="gray")
    ax1.set_title("available vs rented instances, per-step throughput")
    axr = ax1.twinx()
    for name, r in policies.items():
        if r.get("series"):
            axr.step([x / 60 for x, _ in r["series"]], [y for _, y in r["series"]], where="pre", label=name)
    axr.set_ylabel("tokens/s (modelled)")
    axr.legend(loc="upper right", fontsize=8)
    names = list(policies)
    ax2.bar(names, [policies[n]["throughput"] for n in names], color="tab:blue")
    ax2.set_ylabel("tokens/s (modelled)", color="tab:blue")
    ax3 = ax2.twinx()
    ax3.plot(names, [policies[n]["cost_efficiency"] for n in names], "o-", color="tab:red")
    ax3.set_ylabel("tokens/s per $/h", color="tab:red")
    ax2.set_title("throughput (bars) and cost efficiency (dots) per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
