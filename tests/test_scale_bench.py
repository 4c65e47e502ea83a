"""`rlboost bench scale` end to end at small N on servers of its own: every request comes back
exactly once with the emulated reference's tokens, through a 30% mass preemption, and the figures
the scale table is built from are in its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_scale_small_fleet_loses_nothing_and_reports_every_figure(tmp_path):
    p = subprocess.run([sys.executable, "-m", "rlboost.cli", "--data-dir", str(tmp_path / "data"), "bench", "scale",
                        "--workers", "4,16", "--idle", "1", "--warmup", "2", "--seconds", "3", "--tokens", "64"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and [r["workers"] for r in out["runs"]] == [4, 16]
    for r in out["runs"]:
        assert r["lost"] == r["duplicated"] == r["mismatched"] == r["stray"] == 0
        assert r["requests"] >= r["workers"] * r["slots"] and r["result_tokens"] > 0
        assert r["tokens_per_s"] > 0 and r["claims"] > 0 and r["claim_p99_ms"] >= r["claim_p50_ms"] > 0
        assert r["nats_msgs_per_token"] > 0 and r["nats_bytes_per_token"] > 0 and r["redis_cmds_per_token"] > 0
        assert set(r["cpu_s_per_mtok"]) == {"nats-server", "redis-server", "hosts"}
        assert r["rss_mb"]["nats-server"] > 0 and r["rss_mb"]["redis-server"] > 0
        idle = r["idle_per_worker_s"]
        assert idle["nats_msgs"] > 0 and "redis_cmds" in idle  # heartbeats and pulls even with nothing to do
    pre = out["runs"][-1]["preemption"]  # only the largest N is preempted
    assert "preemption" not in out["runs"][0]
    assert pre["preempted_workers"] == round(0.3 * 16) and pre["reclaimed"] == pre["orphaned_requests"]
    assert pre["orphaned_requests"] == 0 or pre["handoff_p99_ms"] is not None
    assert set(out["fit"]) == {"nats-server", "redis-server", "hosts"}
    assert all({"cpu_s_per_mtok", "cpu_ms_per_worker_s", "r2"} <= set(v) for v in out["fit"].values())
