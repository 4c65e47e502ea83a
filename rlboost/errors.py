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


# ---------------------------------------------------------------- the dataflow (rlboost/pool_client.py)


class RequestsDeadLettered(RlboostError, RuntimeError):
    """Requests of a step were moved to the dead-letter queue (delivered `worker.max_deliver`
    times without an answer): the step cannot complete, so it fails now instead of waiting
    for results that will never come."""

    def __init__(self, step: int, ids: list[str], why: str = "after worker.max_deliver deliveries without an "
                 "answer") -> None:
        shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        super().__init__(f"step {step}: {len(ids)} requests dead-lettered {why} ({shown}): the step cannot "
                         "complete; the RB_DLQ stream holds them and `rlboost replay REQUEST_ID` shows each one's life")
        self.step, self.ids = step, ids


# ---------------------------------------------------------------- the run lease (rlboost/runlease.py)


class RunLeaseError(RlboostError, RuntimeError):
    pass


class RunLeaseHeld(RunLeaseError):
    """Another `rlboost run` holds these servers: this one refuses to start (exit 2). `holder`:
    its lease record (`wire.RunLease`); `lapses_in_s`: when its lease lapses if it died."""

    def __init__(self, message: str, holder: object, lapses_in_s: float) -> None:
        super().__init__(message)
        self.holder, self.lapses_in_s = holder, lapses_in_s


class RunLeaseLost(RunLeaseError):
    """This run's lease lapsed and another run took the servers: this one stops (sharing them
    is what the lease prevents)."""


# One vocabulary for every script: a code means the same thing whichever script answers it.
# Codes >= 0 are successes (a new length, an epoch, 1).
STALE_EPOCH, OFFSET_MISMATCH, FINISHED, REDIS_REFUSED, LEASE_HELD = -1, -2, -3, -4, -5


class RedisRefused(CheckpointError):
    """Redis refused a command inside a script (a key of the wrong type); its message follows."""


LUA_CODES: dict[int, tuple[type[CheckpointError], str]] = {
    STALE_EPOCH: (LeaseLost, "stale epoch"),
    OFFSET_MISMATCH: (OffsetMismatch, "the tokens do not continue (or total) the checkpoint"),
    FINISHED: (AlreadyFinished, "the request is finished"),
    REDIS_REFUSED: (RedisRefused, "Redis refused a command of the script"),
    LEASE_HELD: (LeaseHeld, "another owner holds a live lease"),
}
# What each script can answer (a reader of a script checks its returns against this).
SCRIPT_CODES: dict[str, frozenset[int]] = {
    "claim": frozenset({FINISHED, LEASE_HELD}),
    "append": frozenset({STALE_EPOCH, OFFSET_MISMATCH, FINISHED, REDIS_REFUSED}),
    "finish": frozenset({STALE_EPOCH, OFFSET_MISMATCH}),
    "renew": frozenset({STALE_EPOCH, FINISHED}),
    "release": frozenset({STALE_EPOCH}),
    "append_env": frozenset({STALE_EPOCH, OFFSET_MISMATCH, FINISHED}),  # an episode's env tokens + state
    "episode": frozenset({STALE_EPOCH, OFFSET_MISMATCH, FINISHED}),  # an episode's state alone
}


def lua_error(script: str, code: int, detail: str) -> CheckpointError | None:
    """The error a script's reply stands for (None: a success). `detail` names the request."""
    code = int(code)
    if code >= 0:
        return None
    if code not in SCRIPT_CODES[script]:
        return CheckpointError(f"{detail}: {script} answered {code}, a code it never returns")
    kind, meaning = LUA_CODES[code]
    if kind is LeaseHeld:  # carries holder and wait time: built by the claim caller
        raise ValueError("LeaseHeld is built by the claim caller")
    return kind(f"{detail}: {meaning}")
