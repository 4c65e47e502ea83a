"""The checkpoint store's operation history: one JSON line per operation and the outcome the
store gave, written when a history directory is set (`HISTORY_ENV`), for the linearizability
check of `benchmarks/history.py`. Also importable from rlboost.checkpoint."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from rlboost.errors import AlreadyFinished, LeaseHeld, LeaseLost, OffsetMismatch

__all__ = ["HISTORY_ENV", "History"]

HISTORY_ENV = "RLBOOST_STORE_HISTORY"
# A refusal the store decided (its script's code): the operation did not happen. Any other error
# (a timeout, a lost connection) leaves it unknown: it may have happened (Jepsen's "info").
_REFUSALS = (LeaseLost, OffsetMismatch, AlreadyFinished, LeaseHeld)
_quote = json.encoder.encode_basestring_ascii  # a JSON string literal, by the C encoder


class History:
    """The store's operation history of one process: one JSON line per operation, appended
    (O_APPEND) to `<dir>/<pid>-<n>.jsonl`. Fields: `op` (claim, append, append_env, episode,
    renew, release, finish), `rid`, `owner` ("" where the call does not name it), `epoch`,
    `off` (the offset written at; a claim's: the checkpoint length it resumed from; a finish's:
    its total), `n` (tokens written), `res` (`ok` the store accepted, `fail` it refused, `info`
    unknown: the call failed without the store's answer), `out` (the new length, the claim's
    epoch, 1, or the error's name), `err` (its message, if any), `t0`/`t1` (CLOCK_MONOTONIC at
    the call and at its answer: comparable between the processes of one machine), `ts` (wall
    time at the call), `pid`. Written after the answer, one write per call (a flush's appends
    share one); a process killed between an answer and its line loses that line."""

    _count = 0

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.pid = os.getpid()

    @classmethod
    def open(cls, directory: str | None) -> History | None:
        if not directory:
            return None
        os.makedirs(directory, exist_ok=True)
        cls._count += 1
        return cls(os.path.join(directory, f"{os.getpid()}-{cls._count}.jsonl"))

    def record(self, op: str, rid: str, owner: str, epoch: int, offset: int, n: int, out: object,
               t0: float) -> None:
        self.record_many(op, [(rid, owner, epoch, offset, n, out)], t0)

    def record_many(self, op: str, rows: Sequence[tuple[str, str, int, int, int, object]], t0: float) -> None:
        # Formatted by hand, not json.dumps per line: a flush records every request it wrote,
        # and this is what the recording costs (names are JSON-quoted by the C encoder).
        t1 = time.monotonic()
        tail = ',"t0":%.6f,"t1":%.6f,"ts":%.6f,"pid":%d}' % (t0, t1, time.time() - (t1 - t0), self.pid)
        head = '{"op":"%s",' % op
        lines = []
        for rid, owner, epoch, offset, n, out in rows:
            if isinstance(out, BaseException):
                res = '"res":"%s","out":%s,"err":%s' % ("fail" if isinstance(out, _REFUSALS) else "info",
                                                        _quote(type(out).__name__), _quote(str(out)[:200]))
            else:
                res = '"res":"ok","out":%d' % out  # type: ignore[str-format]
            lines.append('%s"rid":%s,"owner":%s,"epoch":%d,"off":%d,"n":%d,%s%s' % (
                head, _quote(rid), _quote(owner), epoch, offset, n, res, tail))
        if lines:
            os.write(self.fd, ("\n".join(lines) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)
