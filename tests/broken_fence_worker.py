"""A rollout worker whose checkpoint store has a deliberately broken fence: the batched append
(`_APPEND_MANY`) without its epoch check, so a superseded lease holder's write at the current end
of a checkpoint is accepted. Test-only, for showing that the history checker
(benchmarks/history.py) catches it: `python tests/broken_fence_worker.py worker <rlboost worker args>`.
The store registers (and, on a Redis without ACLs, loads) the modified script like any other."""

from __future__ import annotations

import runpy

from rlboost import checkpoint

EPOCH_CHECK = "if m[1] ~= epoch or m[4] ~= digest then return -1 end"  # the fence: epoch and the lease's proof

if __name__ == "__main__":
    assert EPOCH_CHECK in checkpoint._APPEND_MANY, "the append script changed: update this test worker"
    checkpoint._APPEND_MANY = checkpoint._APPEND_MANY.replace(EPOCH_CHECK, "")
    runpy.run_module("rlboost.cli", run_name="__main__", alter_sys=True)
