"""What `rlboost bench trace` shows: the table of policies and the plot of available vs rented
instances beside each run's throughput (benchmarks/trace.py runs them)."""

from __future__ import annotations

from pathlib import Path

from rlboost.benchmarks.spot import Interval, available


def rented_of(run: dict) -> list[Interval]:
    """The instances a hybrid run rented, from its JSON."""
    return [Interval(node, up, down, pre) for node, up, down, pre in run.get("rented_intervals", [])]


def print_table(policies: dict, published: dict[str, float] | None = None, model: dict[str, float] | None = None) -> None:
    """`published`: the paper's figures; `model`: the timing model alone (no system overhead)."""
    print(f"\n{'policy':20}{'tokens/s':>10}{'$/h':>9}{'tok/s per $/h':>15}{'rented':>8}{'x coloc':>9}{'cost eff':>9}"
          f"{'bound':>8}{'of bound':>9}{'preempt':>9}{'regen':>10}{'hand-offs':>10}"
          + (f"{'published':>11}" if published else "") + (f"{'model':>9}" if model else ""))
    for name, r in policies.items():
        pub = f"{published[name]:>11,.0f}" if published and name in published else ""
        mod = f"{model[name]:>9,.0f}" if model and name in model else ""
        extra = (f"{r['avg_instances_rented']:>8.2f}" if "avg_instances_rented" in r else f"{'':>8}") + (
            f"{r['throughput_ratio']:>9.2f}{r['cost_efficiency_gain']:>+9.0%}{r['bound']:>8,.0f}{r['bound_fraction']:>9.0%}"
            if "bound" in r else f"{'':>34}")
        print(f"{name:20}{r['throughput']:>10,.0f}{r['cost_per_hour']:>9.2f}{r['cost_efficiency']:>15.2f}{extra}"
              f"{r['preemptions']:>9}{r['regenerated_tokens']:>10}{r.get('handoffs', 0):>10}{pub}{mod}")


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
