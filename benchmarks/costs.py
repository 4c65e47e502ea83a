"""What a run costs and what it buys: instance-uptime accounting at configured GPU prices.

Defaults are the published evaluation's prices: reserved (on-demand) H100 at $10.47/GPU-h,
preemptible H100 at $2.66/GPU-h. The reserved cluster is charged for the whole run; each
preemptible instance for its uptime. Cost efficiency = throughput / cost rate ($/h), i.e.
tokens per dollar-hour: the figure the published +28-49% refers to.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prices:
    reserved_gpu_hour: float = 10.47
    preemptible_gpu_hour: float = 2.66


def run_cost(duration_s: float, reserved_gpus: int, preemptible_instance_s: float, gpus_per_instance: int,
             prices: Prices = Prices()) -> float:
    """Dollars for a run of `duration_s` on the reserved cluster plus preemptible uptime."""
    reserved = reserved_gpus * duration_s / 3600 * prices.reserved_gpu_hour
    preemptible = gpus_per_instance * preemptible_instance_s / 3600 * prices.preemptible_gpu_hour
    return reserved + preemptible


def cost_per_hour(dollars: float, duration_s: float) -> float:
    return dollars / (duration_s / 3600)


def cost_efficiency(tokens_per_s: float, dollars_per_hour: float) -> float:
    """Throughput per cost rate: tokens/s per $/h."""
    return tokens_per_s / dollars_per_hour
