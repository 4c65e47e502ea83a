"""Per-worker counters in a memory-mapped file, so they survive a SIGKILL.

A killed worker cannot report what it lost. Its engine bumps `generated` as tokens come off
each step and the worker bumps `checkpointed` as appends are accepted, both straight into a
shared mapping; whoever reads the file after the kill (the chaos bench) knows exactly how many
tokens the worker had generated and never made durable, i.e. how many must be regenerated.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

FIELDS = ("generated", "checkpointed", "fenced", "handed_off", "results", "claims", "dead_lettered",
          "handoff_rounds",  # a seeding engine's completed hand-offs (SIGUSR2)
          "request_errors",  # requests the engine could not serve: answered with an error result
          "stalls",  # heartbeats skipped for lack of progress (rlboost bench faults: stalled workers)
          "wrong_weights",  # requests refused because the engine held other weights (must stay 0)
          "publishes_given_up",  # token chunks / lease events not stored after their retries
          "env_tokens",  # episodes: environment tokens (tool results, env turns) fenced into checkpoints
          "episode_turns",  # episodes: model turns whose environment phase ended in a next turn
          "to_env_pool",  # episodes sent to the environment pool at a tool call (env.inline = false)
          # an environment worker's (workers/env_worker.py):
          "tool_phases", "tool_calls",  # tool phases run (each a model turn's calls and the reply), calls run
          "sent_back",  # episodes sent back to their pool's resume lane after their tools
          "handed_back",  # episodes handed back to the environment lane (a drain past its grace, a failure)
          # a gauge, not a counter (`set`, not `add`): the worker's live asyncio tasks at its last
          # heartbeat tick, so `rlboost bench soak` can watch for leaked tasks from outside the process
          "asyncio_tasks",
          "carried")  # requests moved to a newer version in flight (async's in-flight update)
_FMT = "<" + "q" * len(FIELDS)
_SIZE = struct.calcsize(_FMT)


class Counters:
    """int64 counters; backed by a file when `path` is given, else by anonymous memory."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        if path:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, _SIZE)
                self._map = mmap.mmap(fd, _SIZE)
            finally:
                os.close(fd)
        else:
            self._map = mmap.mmap(-1, _SIZE)
        self._index = {name: i * 8 for i, name in enumerate(FIELDS)}

    def add(self, name: str, n: int = 1) -> None:
        off = self._index[name]
        (v,) = struct.unpack_from("<q", self._map, off)
        struct.pack_into("<q", self._map, off, v + n)

    def set(self, name: str, value: int) -> None:
        """For a gauge field (`asyncio_tasks`)."""
        struct.pack_into("<q", self._map, self._index[name], value)

    def get(self, name: str) -> int:
        return struct.unpack_from("<q", self._map, self._index[name])[0]

    def snapshot(self) -> dict[str, int]:
        return dict(zip(FIELDS, struct.unpack_from(_FMT, self._map, 0), strict=True))


def read_counters(path: str | os.PathLike[str]) -> dict[str, int]:
    data = Path(path).read_bytes()[:_SIZE].ljust(_SIZE, b"\0")
    return dict(zip(FIELDS, struct.unpack(_FMT, data), strict=True))
