"""The seeding-window rule and its per-fleet-size memory."""

from __future__ import annotations

import math

import pytest

from rlboost.offload import SeedWindow


def test_rule_moves_a_third_of_the_wait_difference():
    w = SeedWindow(initial_s=20.0, floor_s=5.0)
    assert w.window(4) == 20.0
    assert w.update(4, trainer_waiting_s=9.0, preemptible_waiting_s=3.0) == pytest.approx(22.0)
    assert w.update(4, trainer_waiting_s=0.0, preemptible_waiting_s=12.0) == pytest.approx(18.0)


def test_floor_holds():
    w = SeedWindow(initial_s=6.0, floor_s=5.0)
    w.window(2)
    assert w.update(2, trainer_waiting_s=0.0, preemptible_waiting_s=30.0) == 5.0


def test_no_preemptible_worker_means_colocated():
    w = SeedWindow()
    assert w.window(0) == math.inf
    assert w.update(0, 100.0, 0.0) == w.t_seed  # nothing learned from a colocated step


def test_memory_per_fleet_size_is_an_ema_and_is_recalled_when_the_fleet_changes():
    w = SeedWindow(initial_s=10.0, floor_s=1.0, ema=0.5)
    w.window(4)
    w.update(4, trainer_waiting_s=6.0, preemptible_waiting_s=0.0)  # 12
    w.update(4, trainer_waiting_s=6.0, preemptible_waiting_s=0.0)  # 14 -> memory 0.5*12 + 0.5*14
    assert w.memory[4] == pytest.approx(13.0)
    w.window(1)  # unseen size: start from the nearest known
    assert w.t_seed == pytest.approx(13.0)
    w.update(1, trainer_waiting_s=0.0, preemptible_waiting_s=9.0)  # 10
    assert w.memory[1] == pytest.approx(10.0)
    assert w.window(4) == pytest.approx(13.0)  # back to four workers: what suited four
    assert w.window(1) == pytest.approx(10.0)
