"""What a weight cache's pulls cost: bytes and where they came from, copies refused, time spent.

One `CacheStats` per `WeightCache` (its `stats`), counted by every part of a pull: the disk layout
(`rlboost.weights.disk`), the blob fetcher (`rlboost.weights.fetch`), versions taken whole from
peers (`rlboost.weights.peer_versions`) and the coordinator (`rlboost.weights.cache`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheStats"]


@dataclass
class CacheStats:
    bytes_fetched: int = 0
    shards_fetched: int = 0
    shards_reused: int = 0  # already in the local cache, verified
    shards_refused: int = 0  # received or found corrupt / truncated, never used
    delta_bytes_fetched: int = 0  # of bytes_fetched, delta blobs
    reconstructed: int = 0  # versions rebuilt from deltas
    paths_refused: int = 0  # a way to a version that failed verification (another was tried)
    fetch_s: float = 0.0  # wall time fetching shards and blobs (hashing them as they arrive)
    rebuild_s: float = 0.0  # wall time replaying deltas, verifying and writing rebuilt versions
    # where the bytes came from (received, accepted or not): the origin store, or peers
    origin_bytes: int = 0
    peer_bytes: int = 0
    peer_blobs: int = 0  # blobs taken from a peer, verified
    peer_rejected: int = 0  # copies a peer served that failed verification (another source was tried)
    peer_versions: int = 0  # versions taken whole from a peer (nothing replayed)
