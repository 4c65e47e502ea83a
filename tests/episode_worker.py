"""A rollout worker process serving calculator episodes with the scripted solver (the episode
tests start, kill and restart it): `python tests/episode_worker.py NATS REDIS POOL WORKER_ID
ROWS_JSON TOKEN_S`."""

from __future__ import annotations

import asyncio
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import episode_env  # noqa: E402

from rlboost.clients import open_clients  # noqa: E402
from rlboost.config import WorkerSettings  # noqa: E402
from rlboost.config import EnvSettings  # noqa: E402
from rlboost.workers.counters import Counters  # noqa: E402
from rlboost.workers.engines.scripted import ScriptedEngine  # noqa: E402
from rlboost.workers.worker import RolloutWorker  # noqa: E402


async def main(nats_url: str, redis_url: str, pool: str, worker_id: str, rows_file: str, token_s: float) -> None:
    with open(rows_file, encoding="utf-8") as f:
        rows = json.load(f)
    engine = ScriptedEngine(episode_env.tokenizer(), episode_env.solver(rows), token_s=token_s)
    settings = WorkerSettings(pool=pool, slots=8, checkpoint_tokens=4, ack_wait_s=3.0, lease_ttl_s=1.5,
                              heartbeat_s=0.2)
    async with open_clients(nats_url, redis_url, f"episode-worker-{worker_id}") as c:
        worker = RolloutWorker(settings, engine, c, worker_id=worker_id, counters=Counters(),
                               env=EnvSettings(ref=episode_env.ENV_REF, inline=True))
        worker.install_signal_handlers()
        await worker.run()
        await worker.settled()


if __name__ == "__main__":
    nats, redis, pool, wid, rows, token_s = sys.argv[1:7]
    asyncio.run(main(nats, redis, pool, wid, rows, float(token_s)))
