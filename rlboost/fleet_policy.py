"""How many preemptible instances to rent: the fleet policy (`[fleet]` settings).

Pure (no I/O, no clock): `decide(settings, signals)` takes what a run measures of its last step
and returns the desired number of instances and a one-line reason. The orchestrator's caller
(`rlboost run`, `rlboost bench trace`) acts on it: it rents or releases instances, and exports
the number as `rlboost_fleet_desired_workers` for a scaler (KEDA) to follow.

- `all`: every available instance, up to `max_instances` (0 = no cap);
- `fixed`: `fixed` instances (fewer if fewer are available);
- `cost`: the number that maximises tokens per dollar, approached one instance at a time: move
  one toward the best count within reach if that count's tokens/s per $/h beats the current
  one's by more than `hysteresis`; otherwise hold. `min_tokens_per_s` (a throughput floor) and `max_dollars_per_hour`
  (a $/h ceiling) bound it.

The step model behind `cost` (the hybrid step, DESIGN §1): the instances generate from the
step's start; the reserved cluster seeds for T_seed (generating its share), then trains groups
as they complete. With n instances a step of W tokens takes

    step(n) = max(T(n) + W x trainer_s_per_token,  rest(n),  tail_s)
    rest(n) = (W - reserved_tokens_per_s x T(n)) / (n x instance_tokens_per_s)

T(n) is the seeding window the adaptive rule settles at (the one that balances both sides, never
under its floor `t_seed_s`), `tail_s` the latency of the longest response (no number of instances
shortens it). Past the point where rest(n) falls under the trainer's time (or the tail), an
instance is paid for and idle: its marginal tokens are 0 and `cost` releases it. With no
instance the step runs colocated: W / reserved_tokens_per_s, then training. Preemptions discount
an instance's rate by the output it loses to them (`replace_s` of generation per preemption).

Measurement wins over the model: where the run has measured a step at some instance count
(`seen`), `cost` compares that count's measured tokens/s; elsewhere the model's, scaled by the
ratio measured / modelled at the current count. So a fleet that the model says pays, but that
measures worse (host overhead, a slow network), is released again and not rented twice.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("all", "fixed", "cost")


@dataclass(frozen=True)
class Signals:
    """What the run measured (means over recent steps); seconds and tokens of the same clock."""

    instances: int  # rented now
    available: int  # the instances that could be rented now (rented ones included)
    step_tokens: float  # W: tokens trained per step
    trainer_s_per_token: float  # the trainer's seconds per trained token (8 reserved GPUs training)
    instance_tokens_per_s: float  # one preemptible instance's rollout rate while it has work
    reserved_tokens_per_s: float  # the reserved engines' rollout rate while they seed
    t_seed_s: float  # the seeding window's floor: the adaptive rule shrinks T_seed toward it as the fleet grows
    tail_s: float = 0.0  # the latency of a step's longest response (a floor on its rollout)
    preemptions_per_instance_hour: float = 0.0
    replace_s: float = 0.0  # generation an instance loses per preemption
    seen: tuple[tuple[int, float], ...] = ()  # (instances, tokens/s) measured at each count (recent means)


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    tokens_per_s: float = 0.0  # the model's estimate at `desired` (0 for all / fixed)
    dollars_per_hour: float = 0.0


def step_s(sig: Signals, n: int) -> float:
    """The modelled step time with `n` instances (see the module docstring)."""
    w, rr = sig.step_tokens, max(sig.reserved_tokens_per_s, 1e-9)
    train_s = w * sig.trainer_s_per_token
    if n <= 0:
        return w / rr + train_s
    lost = min(0.9, sig.preemptions_per_instance_hour * sig.replace_s / 3600)
    fleet = n * max(sig.instance_tokens_per_s, 1e-9) * (1 - lost)
    t_seed = max(sig.t_seed_s, min(w / rr, (w - fleet * train_s) / (fleet + rr)))
    rest_s = max(0.0, w - rr * t_seed) / fleet
    return max(t_seed + train_s, rest_s, sig.tail_s)


def tokens_per_s(sig: Signals, n: int) -> float:
    return sig.step_tokens / step_s(sig, n)


def dollars_per_hour(fleet, n: int) -> float:
    return fleet.reserved_dollars_per_hour + n * fleet.instance_dollars_per_hour


def trainer_bound(sig: Signals) -> float:
    """The trainer's throughput with rollout never waiting: what no fleet can exceed."""
    return 1.0 / sig.trainer_s_per_token


def decide(fleet, sig: Signals) -> Decision:
    """`fleet`: a `FleetSettings` (rlboost/config.py). The desired instance count, within
    what is available and `max_instances`."""
    cap = sig.available if fleet.max_instances <= 0 else min(sig.available, fleet.max_instances)
    cap = max(cap, 0)
    if fleet.policy == "all":
        return Decision(cap, f"all: {cap} available" + (f" (max {fleet.max_instances})" if fleet.max_instances else ""))
    if fleet.policy == "fixed":
        n = min(fleet.fixed, cap)
        return Decision(n, f"fixed: {fleet.fixed}" + (f", {cap} available" if n < fleet.fixed else ""))

    def ok(n: int) -> bool:  # within the $/h ceiling
        return not fleet.max_dollars_per_hour or dollars_per_hour(fleet, n) <= fleet.max_dollars_per_hour + 1e-9

    # tokens/s: measured where the run has been, the model elsewhere, scaled to what was measured here
    seen = dict(sig.seen)
    here_n = min(max(sig.instances, 0), cap)
    k = seen[here_n] / tokens_per_s(sig, here_n) if here_n in seen and tokens_per_s(sig, here_n) > 0 else 1.0

    def tps(n: int) -> float:
        return seen[n] if n in seen else k * tokens_per_s(sig, n)

    def eff(n: int) -> float:  # tokens/s per $/h
        return tps(n) / dollars_per_hour(fleet, n)

    n = min(max(sig.instances, 0), cap)
    if n < sig.instances:  # preempted or capped below what we hold
        return _decision(fleet, sig, n, f"cost: only {cap} available")
    if not ok(n):  # over the ceiling (prices changed): shed at once
        while n > 0 and not ok(n):
            n -= 1
        return _decision(fleet, sig, n, f"cost: ${dollars_per_hour(fleet, sig.instances):.2f}/h with {sig.instances} "
                         f"is over the ceiling ${fleet.max_dollars_per_hour:.2f}/h")
    floor = fleet.min_tokens_per_s
    if floor and tps(n) < floor and n < cap and ok(n + 1):
        return _decision(fleet, sig, n + 1, f"cost: {tps(n):,.0f} tokens/s under the floor {floor:,.0f}")
    here = eff(n)

    def reach(counts) -> list[int]:  # looking on, up to the first count measured no better than here
        out = []
        for m in counts:
            out.append(m)
            if m in seen and eff(m) <= here:
                break
        return out

    # The best count within reach, not only the next one: one instance moves a fleet's tokens per
    # dollar by a few percent at most (its price against the reserved cluster's), so a one-step
    # look under the hysteresis held a fleet far below an optimum it could see (instances at 1.5K
    # tokens/s: 4 rented, the trainer saturating at 17, +16% tokens per dollar there).
    ups = reach(m for m in range(n + 1, cap + 1) if ok(m))
    keeps_floor = n > 0 and (not floor or tps(n - 1) >= floor)
    downs = reach(m for m in range(n - 1, -1, -1) if not floor or tps(m) >= floor) if keeps_floor else []
    to_up, to_down = max(ups, key=eff, default=n), max(downs, key=eff, default=n)
    up, down = (eff(to_up) if ups else 0.0), (eff(to_down) if downs else 0.0)
    if up > here * (1 + fleet.hysteresis) and up >= down:  # the better of the two moves, if it pays
        gain = tps(n + 1) - tps(n)
        toward = (f" > the fleet's {here:,.0f}" if to_up == n + 1
                  else f", toward {to_up} ({up:,.1f} tokens/s per $/h against {here:,.1f} now)")
        return _decision(fleet, sig, n + 1, f"cost: one more adds {gain:,.0f} tokens/s"
                         + (" (measured)" if n + 1 in seen else "") + f" for ${fleet.instance_dollars_per_hour:.2f}/h "
                         f"({gain / fleet.instance_dollars_per_hour:,.0f} per $/h){toward}")
    if down > here * (1 + fleet.hysteresis):
        loss = tps(n) - tps(n - 1)
        why = ("measured faster with fewer" if loss < 0 else "the trainer is saturated" if loss < 1e-6 * tps(n)
               else "it pays less than it costs") + (
            f", measured with {n - 1}" if n - 1 in seen else "") + (f", toward {to_down}" if to_down != n - 1 else "")
        return _decision(fleet, sig, n - 1, f"cost: one fewer loses {loss:,.0f} tokens/s, saves "
                         f"${fleet.instance_dollars_per_hour:.2f}/h ({why})")
    bound = n and tps(n + 1) <= tps(n) * (1 + 1e-9)
    return _decision(fleet, sig, n, f"cost: hold {n} ({here:,.1f} tokens/s per $/h"
                     + (", rollout no longer limits the step" if bound else "") + ")")


def _decision(fleet, sig: Signals, n: int, reason: str) -> Decision:
    return Decision(n, reason, round(float(tokens_per_s(sig, n)), 1), round(dollars_per_hour(fleet, n), 2))


def measure(prev: Signals | None, *, trained, live: int, rollout_s: float, step_s: float, t_seed_s: float | None,
            reserved_ids: set[str], trainer_s_per_token: float, available: int, t_seed_floor_s: float,
            sync: bool, token_scale: int = 1, tail_s: float = 0.0) -> Signals:
    """One step's signals from what the orchestrator returned (`trained`: its (group, results)),
    averaged with the previous step's (`prev`). An instance's rate: the tokens the preemptible
    workers generated (read from the results' segments: anyone but the reserved engines) per
    live worker and second of rollout (sync) or of the step (partial, async: they run ahead);
    the reserved engines' rate: their tokens per second of seeding."""
    spot = total = 0
    for _, results in trained:
        for r in results:
            segs = r.segments
            for k, seg in enumerate(segs):
                end = segs[k + 1].offset if k + 1 < len(segs) else len(r.token_ids)
                n = token_scale * max(0, end - seg.offset)
                total += n
                spot += n if seg.worker_id not in reserved_ids else 0
    busy = rollout_s if sync else step_s
    new = {"step_tokens": float(total) or (prev.step_tokens if prev else 1.0),
           "trainer_s_per_token": trainer_s_per_token or (prev.trainer_s_per_token if prev else 0.0),
           "instance_tokens_per_s": spot / (live * busy) if live and busy > 0 and spot else None,
           "reserved_tokens_per_s": (total - spot) / t_seed_s if t_seed_s and total > spot else None}
    if prev is not None:  # a mean with the previous step: one slow step does not move the fleet alone
        new = {k: (v + getattr(prev, k)) / 2 if v is not None and k not in ("step_tokens", "trainer_s_per_token")
               else (getattr(prev, k) if v is None else v) for k, v in new.items()}
    new = {k: (v if v is not None else 0.0) for k, v in new.items()}
    if not new["reserved_tokens_per_s"]:  # never seen seeding yet: colocated's rate is unknown, assume theirs
        new["reserved_tokens_per_s"] = new["instance_tokens_per_s"] or 1.0
    return Signals(instances=live, available=available, t_seed_s=t_seed_floor_s, tail_s=tail_s,
                   preemptions_per_instance_hour=prev.preemptions_per_instance_hour if prev else 0.0,
                   replace_s=prev.replace_s if prev else 0.0,
                   seen=remember(prev.seen if prev else (), live, total / step_s if step_s > 0 else 0.0), **new)


def remember(seen: tuple[tuple[int, float], ...], n: int, tokens_per_s: float) -> tuple[tuple[int, float], ...]:
    """The measured tokens/s at `n` instances: a mean with what was measured there before."""
    d = dict(seen)
    d[n] = (d[n] + tokens_per_s) / 2 if n in d else tokens_per_s
    return tuple(sorted(d.items()))


def settle(fleet, sig: Signals, steps: int = 64) -> Decision:
    """`decide` applied until it holds (a fixed point of the one-at-a-time rule), from
    `sig.instances`: what the policy converges to if the signals stay as they are."""
    d = decide(fleet, sig)
    for _ in range(steps):
        if d.desired == sig.instances:
            return d
        sig = Signals(**{**sig.__dict__, "instances": d.desired})
        d = decide(fleet, sig)
    return d


__all__ = ["POLICIES", "Signals", "Decision", "decide", "measure", "remember", "settle", "step_s", "tokens_per_s", "dollars_per_hour",
           "trainer_bound"]
