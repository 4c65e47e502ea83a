"""The Prometheus exporter: names by convention, values visible on a real scrape."""

from __future__ import annotations

import urllib.request

import pytest

from rlboost import metrics


@pytest.fixture(scope="module")
def endpoint():
    port = metrics.start_metrics_server(0)
    yield f"http://127.0.0.1:{port}/metrics"
    metrics.stop_metrics_server()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # the exposition sorts labels
    head = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(head + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{head} not in scrape")


def test_names_follow_prometheus_conventions():
    text = metrics.render().decode()
    for name in ("rlboost_worker_tokens_generated_total", "rlboost_handoffs_total", "rlboost_regenerated_tokens_total",
                 "rlboost_weight_pulls_total", "rlboost_weight_pull_bytes_total", "rlboost_cost_dollars_total"):
        assert f"# TYPE {name} counter" in text or f"# TYPE {name[:-len('_total')]} counter" in text, name
    for name in ("rlboost_worker_inflight_requests", "rlboost_policy_version", "rlboost_queue_pending_requests"):
        assert f"# TYPE {name} gauge" in text, name
    assert 'rlboost_build_info{' in text


def test_scrape_shows_values(endpoint):
    metrics.TOKENS_GENERATED.labels("spot", "emulated").inc(5)
    metrics.HANDOFFS.labels("spot").inc()
    metrics.REGENERATED_TOKENS.labels("spot").inc(7)
    metrics.WEIGHT_PULLS.labels("miss").inc()
    metrics.WEIGHT_PULL_BYTES.inc(1 << 20)
    metrics.QUEUE_PENDING.labels("spot", "fresh").set(42)
    metrics.COST_DOLLARS.labels("spot").inc(0.25)
    metrics.observe_worker("spot", inflight=3, slots=32, policy_version=9, draining=True)
    text = scrape(endpoint)
    assert sample(text, "rlboost_worker_tokens_generated_total", pool="spot", engine="emulated") >= 5
    assert sample(text, "rlboost_handoffs_total", pool="spot") >= 1
    assert sample(text, "rlboost_regenerated_tokens_total", pool="spot") >= 7
    assert sample(text, "rlboost_weight_pulls_total", outcome="miss") >= 1
    assert sample(text, "rlboost_weight_pull_bytes_total") >= 1 << 20
    assert sample(text, "rlboost_queue_pending_requests", pool="spot", lane="fresh") == 42
    assert sample(text, "rlboost_cost_dollars_total", pool="spot") >= 0.25
    assert sample(text, "rlboost_worker_inflight_requests", pool="spot") == 3
    assert sample(text, "rlboost_worker_draining", pool="spot") == 1
    assert sample(text, "rlboost_policy_version", role="worker") == 9
    assert "process_cpu_seconds_total" in text  # process collector on the same registry


def test_counter_sync_turns_snapshots_into_increments(endpoint):
    sync = metrics.CounterSync("sync-pool", "torch")
    sync({"generated": 10, "checkpointed": 8, "handed_off": 1})
    sync({"generated": 25, "checkpointed": 24, "handed_off": 1, "unknown": 3})
    text = scrape(endpoint)
    assert sample(text, "rlboost_worker_tokens_generated_total", pool="sync-pool", engine="torch") == 25
    assert sample(text, "rlboost_worker_tokens_checkpointed_total", pool="sync-pool") == 24
    assert sample(text, "rlboost_handoffs_total", pool="sync-pool") == 1


def test_second_start_is_idempotent(endpoint):
    port = int(endpoint.split(":")[2].split("/")[0])
    assert metrics.start_metrics_server(0) == port


async def test_queue_pending_reads_the_environment_lane_once(js, endpoint):
    """The trainer's poller sets the env lane's backlog from the one `rb-env` consumer (every
    pool's lane), labelled pool="*" (what keda.yaml's env-worker trigger counts), beside each
    pool's fresh and resume lanes."""
    import asyncio

    from rlboost import bus, wire

    await bus.provision(js, pools=("spot", "gpu"))  # two pools' lanes, one environment consumer
    for pool, n in (("spot", 2), ("gpu", 3)):
        for i in range(n):
            await js.publish(wire.env_subject(pool), f"{pool}-{i}".encode())
    await js.publish(wire.request_subject("spot"), b"fresh")
    stop = asyncio.Event()
    poller = asyncio.create_task(metrics.poll_queue_pending(js, ("spot", "gpu"), stop, interval_s=0.05))
    try:
        for _ in range(100):  # until the first poll is in
            text = scrape(endpoint)
            if 'lane="env"' in text:
                break
            await asyncio.sleep(0.05)
        assert sample(text, "rlboost_queue_pending_requests", pool=metrics.ENV_LANE_POOL, lane="env") == 5
        assert sample(text, "rlboost_queue_ack_pending_requests", pool=metrics.ENV_LANE_POOL, lane="env") == 0
        assert sample(text, "rlboost_queue_pending_requests", pool="spot", lane="fresh") == 1
        assert sample(text, "rlboost_queue_pending_requests", pool="gpu", lane="resume") == 0
        assert not [line for line in text.splitlines() if 'lane="env"' in line and 'pool="spot"' in line]
    finally:
        stop.set()
        await poller
