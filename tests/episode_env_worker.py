"""An environment worker process running the counting calculator's tool calls (the env-pool
tests start, kill and restart it): `python tests/episode_env_worker.py NATS REDIS WORKER_ID`."""

from __future__ import annotations

import asyncio
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import episode_env  # noqa: E402

from rlboost.clients import open_clients  # noqa: E402
from rlboost.config import EnvSettings, WorkerSettings  # noqa: E402
from rlboost.workers.counters import Counters  # noqa: E402
from rlboost.workers.env_worker import EnvWorker  # noqa: E402


async def main(nats_url: str, redis_url: str, worker_id: str) -> None:
    settings = WorkerSettings(ack_wait_s=3.0, lease_ttl_s=1.5, heartbeat_s=0.2, drain_grace_s=10.0)
    async with open_clients(nats_url, redis_url, f"episode-env-worker-{worker_id}") as c:
        worker = EnvWorker(settings, EnvSettings(ref=episode_env.ENV_REF, inline=False), c, worker_id=worker_id,
                           counters=Counters(), tokenizer=episode_env.tokenizer())
        worker.install_signal_handlers()
        await worker.run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
