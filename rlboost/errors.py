"""One root for every error rlboost raises on purpose, and the Lua return codes named in one table.

`except RlboostError` catches every refusal the project makes (bad wire bytes, a corrupt
checkpoint, a lost lease, a weight store problem, a bad config, an engine failure) and nothing
else: a bug (TypeError, KeyError, ...) still surfaces as one. Modules keep their own error
classes where a reader expects them (`wire.WireError`, `checkpoint.LeaseLost`, ...); they all
derive from the root defined here.

The checkpoint scripts (rlboost/checkpoint.py) answer with small negative integers. What each
one means is written once, in `LUA_CODES`, the way nats.py's errors module maps server codes
to exception types: a reader of a script and a reader of the Python side look at the same table.
"""

from __future__ import annotations


class RlboostError(Exception):
    """Root of every deliberate rlboost error."""


# ---------------------------------------------------------------- checkpoints (rlboost/checkpoint.py)


class CheckpointError(RlboostError, RuntimeError):
    pass


class LeaseLost(CheckpointError):
    """The writer's epoch is stale: another worker owns the request now. Drop it."""


class LeaseHeld(CheckpointError):
    """Another live owner holds the lease; retry after `retry_after_s`."""

    def __init__(self, rid: str, holder: str, retry_after_s: float) -> None:
        super().__init__(f"{rid} is leased by {holder} for {retry_after_s:.2f}s more")
        self.holder, self.retry_after_s = holder, retry_after_s


class AlreadyFinished(CheckpointError):
    """The request already has its result; whoever holds the message should just ack it."""


class OffsetMismatch(CheckpointError):
    """An append that does not continue exactly where the checkpoint ends (a bug, never silent)."""


class CorruptCheckpoint(CheckpointError):
    """The checkpoint's keys hold something no rlboost script writes (odd-length token bytes, a
    history line that does not parse, a non-integer epoch). Retrying cannot help: the request
    is dead-lettered at once with this reason."""


# Script name -> return code -> (error type, what it means). Codes >= 0 are successes.
LUA_CODES: dict[str, dict[int, tuple[type[CheckpointError], str]]] = {
    "claim": {-1: (AlreadyFinished, "the request is finished"),
              -2: (LeaseHeld, "another owner holds a live lease")},
    "append": {-1: (LeaseLost, "stale epoch"),
               -2: (OffsetMismatch, "append does not continue the checkpoint"),
               -3: (AlreadyFinished, "the request is finished")},
    "finish": {-1: (LeaseLost, "stale epoch"),
               -2: (OffsetMismatch, "token count does not match the checkpoint")},
    "renew": {-1: (LeaseLost, "stale epoch"),
              -3: (AlreadyFinished, "the request is finished")},
    "release": {-1: (LeaseLost, "stale epoch")},
}


def lua_error(script: str, code: int, detail: str) -> CheckpointError | None:
    """The error a script's reply stands for (None: a success). `detail` names the request."""
    hit = LUA_CODES[script].get(int(code))
    if hit is None:
        return None
    kind, meaning = hit
    if kind is LeaseHeld:  # carries holder and wait time: built by the caller
        raise ValueError("LeaseHeld is built by the claim caller")
    return kind(f"{detail}: {meaning}")
