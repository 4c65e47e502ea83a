"""The weight store's errors, all under the project's one root (`rlboost.errors.RlboostError`).

`ObjectMissing` (the store answered: no such blob) is final; `StoreUnavailable` (the store did
not answer) is transient and retried with back-off; the rest are refusals of bytes that do not
match what a manifest promises, which the cache answers by trying another path (a snapshot)."""

from __future__ import annotations

from rlboost.errors import RlboostError


class StoreError(RlboostError, RuntimeError):
    """Root of every weight store error (blob store, manifest, cache, deltas)."""


class StoreUnavailable(StoreError):
    """The store did not answer (network, mount, timeout): transient, retry with back-off."""


class ObjectMissing(StoreError, KeyError):
    """The store answered that the blob does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object missing"


class VersionUnavailable(StoreError):
    """The store has no manifest for the requested version (not yet published, or GC'd)."""


class VersionGone(VersionUnavailable):
    """The store has no manifest for the version but holds a newer one: it was garbage-collected
    (or its publish died), so waiting will not bring it. A request naming it is left over from
    an earlier life of the run or another run: dead-lettered, never waited for."""


class ShardCorrupt(StoreError):
    """A shard or delta blob kept failing verification (truncated / wrong hash) after every retry."""


class DeltaCorrupt(ShardCorrupt):
    """A delta did not reconstruct the tensor its manifest promises (bad encoding, wrong base,
    or a hash that does not match): nothing of it is loaded; the cache tries another path."""
