"""A rollout worker that leaks on purpose: every heartbeat tick it starts 5 asyncio tasks that
never end and keeps 512 KiB it never frees. Test-only, for showing that `rlboost bench soak`
fails a real leak: `python tests/leaky_worker.py worker <rlboost worker args>`."""

from __future__ import annotations

import asyncio
import runpy

from rlboost.workers.worker import RolloutWorker

_kept: list = []
_beat = RolloutWorker._beat


async def _leaky_beat(self) -> None:
    for _ in range(5):
        _kept.append(asyncio.get_running_loop().create_task(asyncio.Event().wait()))
    _kept.append(bytearray(512 << 10))  # written, so the pages count in RSS
    _kept[-1][::4096] = b"\1" * len(range(0, 512 << 10, 4096))
    await _beat(self)


if __name__ == "__main__":
    RolloutWorker._beat = _leaky_beat
    runpy.run_module("rlboost.cli", run_name="__main__", alter_sys=True)
