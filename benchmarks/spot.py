"""Spot-availability traces: parse, cut a segment, sample nodes, count what is up.

Format (Bamboo, ../shared/traces): one event per line, `ms,add|remove,nodeN`: at `ms`
milliseconds from the trace start the node became available (`add`) or was preempted
(`remove`). The published RLBoost evaluation cut 2-hour segments from a 12-hour trace and kept
a seeded random 50% of the nodes, each node standing for one 2xH100 preemptible instance.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from rlboost.errors import RlboostError


class TraceError(RlboostError, ValueError):
    """A trace line that is not `ms,add|remove,node`: the message names file and line."""


@dataclass(frozen=True)
class Event:
    t_s: float
    kind: str  # "add" | "remove"
    node: str


@dataclass(frozen=True)
class Interval:
    """One stretch of availability of a node, in seconds from the segment start."""

    node: str
    up_s: float
    down_s: float  # the segment end if the node outlives it
    preempted: bool  # False when the segment ended before the node did


def parse_trace(path: str | Path) -> list[Event]:
    events = []
    for n, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            raise TraceError(f"{path} line {n}: expected `ms,add|remove,node`, got {raw!r}")
        ms, kind, node = parts
        try:
            t = int(ms) / 1000.0
        except ValueError:
            raise TraceError(f"{path} line {n}: time {ms!r} is not an integer number of milliseconds") from None
        if kind not in ("add", "remove") or not node or t < 0:
            raise TraceError(f"{path} line {n}: expected `ms,add|remove,node`, got {raw!r}")
        events.append(Event(t, kind, node))
    return sorted(events, key=lambda e: e.t_s)


def intervals(events: list[Event], start_s: float, duration_s: float) -> list[Interval]:
    """Availability intervals clipped to [start, start + duration), times relative to start.
    A node up when the segment starts is up at 0; an `add` of a node already up is ignored."""
    end_s = start_s + duration_s
    up: dict[str, float] = {}
    out: list[Interval] = []
    for e in events:
        if e.kind == "add":
            up.setdefault(e.node, e.t_s)
        elif e.node in up:
            t_up = up.pop(e.node)
            if e.t_s > start_s and t_up < end_s:
                out.append(Interval(e.node, max(t_up, start_s) - start_s, min(e.t_s, end_s) - start_s, e.t_s < end_s))
    for node, t_up in up.items():
        if t_up < end_s:
            out.append(Interval(node, max(t_up, start_s) - start_s, duration_s, False))
    return sorted(out, key=lambda i: (i.up_s, i.node))


def sample_nodes(events: list[Event], fraction: float, seed: int) -> set[str]:
    nodes = sorted({e.node for e in events})
    k = round(len(nodes) * fraction)
    return set(random.Random(seed).sample(nodes, k))


def available(ivs: list[Interval], t_s: float) -> int:
    return sum(1 for i in ivs if i.up_s <= t_s < i.down_s)


def instance_seconds(ivs: list[Interval], until_s: float | None = None) -> float:
    """Instance uptime summed over the intervals, optionally only up to `until_s` (a run that
    ended before the segment did is charged for the uptime it used)."""
    end = (lambda i: i.down_s) if until_s is None else (lambda i: min(i.down_s, until_s))
    return sum(max(0.0, end(i) - i.up_s) for i in ivs)


def static_intervals(n: int, duration_s: float) -> list[Interval]:
    """`n` instances up for the whole segment, never preempted (calibration, what-if runs)."""
    return [Interval(f"static{k}", 0.0, duration_s, False) for k in range(n)]


def rented(ivs: list[Interval], max_instances: int) -> list[Interval]:
    """The instances a policy that rents at most `max_instances` at a time actually holds: when
    one of its instances is preempted it rents another available one (if any) at once. Each
    rented stretch ends when the node is preempted or the segment ends. 0 = no cap."""
    if max_instances <= 0:
        return list(ivs)
    points = sorted({t for i in ivs for t in (i.up_s, i.down_s)})
    held: dict[Interval, float] = {}  # interval -> rented since
    out: list[Interval] = []
    for t in points:
        for iv in [iv for iv in held if iv.down_s <= t]:
            out.append(Interval(iv.node, held.pop(iv), iv.down_s, iv.preempted))
        for iv in ivs:
            if len(held) >= max_instances:
                break
            if iv not in held and iv.up_s <= t < iv.down_s:
                held[iv] = t
    return sorted(out, key=lambda i: (i.up_s, i.node))
