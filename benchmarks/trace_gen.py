"""Spot traces nobody tuned for: a seeded generator of market-like preemptible availability, in
the Bamboo format (`ms,add|remove,nodeN`, benchmarks/spot.py), so `rlboost bench trace` judges an
operating point on a family of traces instead of the two it was tuned on.

The market, as the Bamboo traces show it (`fit` measures these; p3 / g4dn):
- capacity arrives in **bursts** (adds within a minute of each other): one every ~10-14 min on
  average (median gap 6 / 9 min), of ~2 instances on average and up to 13-21 at once;
- an instance **lives** a heavy-tailed time: median ~60 min, quartiles ~25 and ~120 min, a few
  for 6-7 h (lognormal: median m, spread s = ln(p75 / p50) / 0.674 ~ 0.9);
- **mass preemptions**: the provider reclaims a large share of a zone at once (the held-out trace
  that bent the fleet policy lost most of its instances in one minute);
- a **ceiling**: the pool never offers more than a few dozen (32 / 24 at once; 24 / 12.6 on
  average);
- **zones**: instances come from a few zones; a mass preemption takes a share of one zone.

`Market` holds these parameters. `Market.fitted()` is the centre, fitted to both Bamboo traces;
`Market.drawn(seed)` draws each parameter from a range around it and beyond it (shorter and longer
lives, rarer and denser bursts, more frequent and larger mass preemptions, smaller and larger
pools), so seeds span easier and harsher markets than the two real traces. `generate(market,
hours, seed)` plays the market: a pure function of its arguments.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rlboost.benchmarks.spot import Event, intervals, parse_trace


@dataclass(frozen=True)
class Market:
    life_median_min: float = 60.0  # an instance's lifetime: lognormal with this median ...
    life_spread: float = 0.95  # ... and this sigma (ln p75/p50 over 0.674)
    burst_gap_min: float = 7.0  # mean minutes between capacity bursts (exponential gaps)
    burst_size: float = 2.3  # mean instances a burst offers (1 + geometric)
    ceiling: int = 28  # the most instances up at once (a burst past it offers fewer)
    initial: int = 8  # instances up when the trace starts
    mass_per_hour: float = 0.25  # mass preemptions per hour (Poisson)
    mass_share: float = 0.6  # the share of the struck zone's instances a mass preemption takes
    zones: int = 3

    @staticmethod
    def fitted() -> "Market":
        """The centre: the two Bamboo traces' statistics (`fit` on each, averaged)."""
        return Market()

    @staticmethod
    def drawn(seed: int) -> "Market":
        """A market around the fitted one and beyond it, by seed (seed 0 included: no seed is
        the fitted market itself, so a tuned-on centre is never what a seed judges)."""
        r = random.Random(f"market/{seed}")
        c = Market.fitted()
        return replace(c,
                       life_median_min=c.life_median_min * math.exp(r.uniform(-1.0, 0.6)),  # ~22-110 min
                       life_spread=r.uniform(0.6, 1.3),
                       burst_gap_min=c.burst_gap_min * math.exp(r.uniform(-0.7, 0.9)),  # ~3.5-17 min
                       burst_size=r.uniform(1.2, 4.5),
                       ceiling=r.randint(10, 40),
                       initial=r.randint(0, 12),
                       mass_per_hour=r.choice([0.0, 0.15, 0.3, 0.6, 1.0]),
                       mass_share=r.uniform(0.4, 0.9),
                       zones=r.randint(1, 4))


def generate(market: Market, hours: float, seed: int) -> list[Event]:
    """Add/remove events of `hours` of `market`, seeded. Instances are node1, node2, ... in order
    of arrival; an instance alive at the end has no remove (it outlives the trace)."""
    r = random.Random(f"trace/{seed}")
    end_s = hours * 3600.0
    events: list[Event] = []
    alive: dict[str, tuple[float, int]] = {}  # node -> (its scheduled death, zone)
    count = 0

    def life_s() -> float:
        return max(60.0, 60.0 * market.life_median_min * math.exp(r.gauss(0.0, market.life_spread)))

    def arrive(t: float, n: int) -> None:
        nonlocal count
        for _ in range(min(n, market.ceiling - len(alive))):
            count += 1
            node = f"node{count}"
            alive[node] = (t + life_s(), r.randrange(market.zones))
            events.append(Event(t, "add", node))

    def expire(until: float) -> None:
        for node, (death, _) in sorted(alive.items(), key=lambda kv: kv[1][0]):
            if death <= until:
                del alive[node]
                events.append(Event(death, "remove", node))

    arrive(0.0, market.initial)
    t_burst = r.expovariate(1.0 / (60.0 * market.burst_gap_min))
    t_mass = r.expovariate(market.mass_per_hour / 3600.0) if market.mass_per_hour > 0 else math.inf
    while True:
        t = min(t_burst, t_mass)
        if t >= end_s:
            break
        expire(t)
        if t == t_burst:
            size = 1 + min(int(r.expovariate(1.0 / max(1e-9, market.burst_size - 1.0))), 4 * market.ceiling)
            arrive(t, size)
            t_burst = t + r.expovariate(1.0 / (60.0 * market.burst_gap_min))
        else:  # a zone is struck: a share of its instances go within the same minute
            zone = r.randrange(market.zones)
            struck = [n for n, (_, z) in alive.items() if z == zone]
            for node in r.sample(struck, round(market.mass_share * len(struck))):
                death = t + r.uniform(0.0, 60.0)
                alive[node] = (death, zone)
            t_mass = t + r.expovariate(market.mass_per_hour / 3600.0)
    expire(end_s - 1e-3)
    return sorted(events, key=lambda e: (e.t_s, e.kind != "remove"))


def write(events: list[Event], path: Path) -> Path:
    """The events as a Bamboo-format file (`parse_trace` reads it back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{round(e.t_s * 1000)},{e.kind},{e.node}\n" for e in events))
    return path


def synthetic(seed: int, hours: float, directory: Path) -> Path:
    """The trace file of `synthetic:<seed>`: `Market.drawn(seed)` played for `hours`."""
    return write(generate(Market.drawn(seed), hours, seed), directory / f"synthetic-{seed}.csv")


def fit(events: list[Event]) -> dict:
    """A trace's market statistics, in `Market`'s terms (and the alive count's mean and max):
    what the generator's centre was fitted to, and what a test compares a generated trace on."""
    if not events:
        return {}
    end = max(e.t_s for e in events)
    ivs = intervals(events, 0.0, end)
    lives = sorted(i.down_s - i.up_s for i in ivs if i.preempted and i.down_s > i.up_s)
    adds = sorted(e.t_s for e in events if e.kind == "add" and e.t_s > 0)
    bursts = _groups(adds, 60.0)
    gaps = [b[0] - a[-1] for a, b in zip(bursts, bursts[1:])]
    alive = [sum(1 for i in ivs if i.up_s <= t < i.down_s) for t in range(0, int(end), 60)]

    def q(xs: list[float], p: float) -> float:
        return xs[int(p * (len(xs) - 1))] if xs else 0.0

    return {"hours": round(end / 3600, 2), "instances": len(ivs),
            "life_median_min": round(q(lives, 0.5) / 60, 1),
            "life_spread": round(math.log(q(lives, 0.75) / q(lives, 0.5)) / 0.674, 2) if q(lives, 0.5) > 0 else 0.0,
            "burst_gap_min": round(sum(gaps) / len(gaps) / 60, 1) if gaps else 0.0,
            "burst_size": round(len(adds) / len(bursts), 2) if bursts else 0.0,
            "alive_mean": round(sum(alive) / len(alive), 1) if alive else 0.0, "ceiling": max(alive, default=0),
            "mass_preemptions": sum(1 for g in _groups(sorted(e.t_s for e in events if e.kind == "remove"), 60.0)
                                    if len(g) >= 5)}


def _groups(ts: list[float], within_s: float) -> list[list[float]]:
    out: list[list[float]] = []
    for t in ts:
        if out and t - out[-1][-1] <= within_s:
            out[-1].append(t)
        else:
            out.append([t])
    return out


BUNDLED = Path(__file__).resolve().parent / "traces"  # the two Bamboo traces, copied unchanged (its README)
REAL = {"p3": "bamboo-p3-trace.csv", "g4dn": "bamboo-g4dn-trace.csv"}


def expand(spec: str) -> list[str]:
    """`p3,g4dn,synthetic:1-8` -> ["p3", "g4dn", "synthetic:1", ..., "synthetic:8"] (a path stays a path)."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, _, seeds = part.partition(":")
        if name == "synthetic":
            lo, _, hi = seeds.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"--traces {part!r}: synthetic:SEED or synthetic:FIRST-LAST")
            out += [f"synthetic:{k}" for k in range(int(lo), int(hi or lo) + 1)]
        else:
            out.append(part)
    return out


def trace_file(name: str, hours: float, directory: Path) -> Path:
    """The file of one `--traces` entry: a bundled real trace by name, a generated one
    (`synthetic:<seed>`, `hours` long, written into `directory`), or a path."""
    if name in REAL:
        return BUNDLED / REAL[name]
    if name.startswith("synthetic:"):
        return synthetic(int(name.partition(":")[2]), hours, directory)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--traces {name!r}: not p3, g4dn, synthetic:SEED or a trace file")
    return path


# A look at the family: python -m rlboost.benchmarks.trace_gen. Not named `main`: a module with a
# top-level `main` is a `rlboost bench NAME` (rlboost/cli.py), called as main(argv, settings).
def show_family() -> None:
    import json

    for name in REAL:
        print(json.dumps({"trace": name, **fit(parse_trace(BUNDLED / REAL[name]))}))
    for seed in range(1, 9):
        m = Market.drawn(seed)
        print(json.dumps({"trace": f"synthetic:{seed}", **fit(generate(m, 11.0, seed)),
                          "market": {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(m).items()}}))


if __name__ == "__main__":
    show_family()
