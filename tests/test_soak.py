"""`rlboost bench soak`: the growth judgement on synthetic series (fast), and a short soak (slow)."""

import math
import random
import sys

import pytest

from rlboost.benchmarks.soak import judge

T = [i * 10.0 for i in range(60)]  # ten minutes, a sample every 10 s


def noisy(f, sd=1.0, seed=0):
    rng = random.Random(seed)
    return [f(t) + rng.gauss(0, sd) for t in T]


def test_a_linear_leak_fails():
    v = judge(T, noisy(lambda t: 100 + 0.05 * t))  # +30 over the run, noise sd 1
    assert not v.ok and v.why == "grows"
    assert v.slope_per_h == pytest.approx(180, rel=0.1)


def test_a_slow_leak_without_noise_fails():
    assert not judge(T, [50 + 0.02 * t for t in T]).ok  # +12 on 50..62: over the 5 % tolerance


@pytest.mark.parametrize("seed", range(20))
def test_a_noisy_flat_series_passes(seed):
    v = judge(T, noisy(lambda t: 100, sd=5.0, seed=seed))
    assert v.ok and v.why == "flat"


def test_a_sawtooth_passes():
    # RSS that grows between collections and drops back: teeth of 20 every 100 s
    v = judge(T, [100 + 20 * ((t % 100) / 100) for t in T])
    assert v.ok, v


def test_a_warmup_ramp_that_levels_off_passes():
    v = judge(T, noisy(lambda t: 100 + 50 * (1 - math.exp(-t / 120)), sd=0.5))
    assert v.ok and v.why in ("flat", "levels off"), v


def test_a_ramp_that_levels_off_only_late_passes_but_a_steady_one_does_not():
    late = judge(T, [100 + 50 * (1 - math.exp(-t / 200)) for t in T])
    assert late.ok and late.why == "levels off", late
    assert not judge(T, [100 + 0.1 * t for t in T]).ok


def test_a_shrinking_series_passes_and_too_few_samples_say_so():
    assert judge(T, [200 - 0.1 * t for t in T]).ok
    assert judge(T[:4], [1, 2, 3, 4]).why == "too few samples"


@pytest.mark.slow
@pytest.mark.timeout(900)  # five minutes of soak, then the drain and the count: past the suite's 300 s
def test_a_five_minute_soak_loses_nothing_and_samples_every_resource(tmp_path):
    """Issue 29's CI soak: `--minutes 5`, every fault kind (servers restarted in the first half)."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "rlboost.cli", "bench", "soak", "--minutes", "5", "--workers", "2",
                          "--every", "6", "--sample-s", "5", "--retention", "300"],
                         capture_output=True, text=True, timeout=800, env={**__import__("os").environ,
                                                                          "OMP_NUM_THREADS": "1"})
    assert "lost 0 dup 0 mismatched 0" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    import json

    result = json.loads(out.stdout.strip().splitlines()[-1])
    series = {r["series"] for r in result["resources"]}
    assert result["completed"] > 0 and result["lost"] == result["duplicated"] == 0
    assert result["requests"] == result["published"]  # every request published was counted, once
    for name in ("redis keys", "redis used_memory_mb", "js RB_RESULTS msgs", "js RB_REQUESTS mb",
                 "files data", "mb cache", "rss_mb workers (total)", "fds workers (total)",
                 "asyncio_tasks workers (total)"):
        assert name in series, (name, sorted(series))
    assert any(s.startswith("rss_mb nats-server[") for s in series)
    assert any(s.startswith("fds redis-server[") for s in series)
    assert any(s.startswith("asyncio_tasks w001") for s in series)  # slot 1's worker: never killed


def test_the_task_gauge_is_set_not_added(tmp_path):
    from rlboost.workers.counters import Counters, read_counters

    c = Counters(tmp_path / "w.counters")
    c.set("asyncio_tasks", 7)
    c.set("asyncio_tasks", 5)
    c.add("generated", 3)
    got = read_counters(tmp_path / "w.counters")
    assert got["asyncio_tasks"] == 5 and got["generated"] == 3


@pytest.mark.slow
def test_a_soak_fails_a_worker_that_leaks_tasks_and_memory(tmp_path):
    import asyncio
    from pathlib import Path

    from rlboost.benchmarks import soak

    a = soak.parser().parse_args(["--minutes", "1", "--workers", "2", "--every", "6", "--sample-s", "3"])
    out = asyncio.run(soak.soak(a, tmp_path, launcher=(str(Path(__file__).with_name("leaky_worker.py")),)))
    rows = {r["series"]: r for r in out["resources"]}
    assert out["lost"] == out["duplicated"] == 0
    assert not out["resources_ok"]
    assert rows["asyncio_tasks w001"]["verdict"] == "grows", rows["asyncio_tasks w001"]
    assert rows["rss_mb w001"]["verdict"] == "grows", rows["rss_mb w001"]
