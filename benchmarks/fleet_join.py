"""A fleet-join model (`rlboost bench weights --model-fleet`): how long 1, 10 and 100 instances
take to hold the current version of an 8B and a 70B bf16 model, pulled from the origin alone or
from each other, as a whole version (a joiner with an empty cache) or as a delta (a follower that
holds the previous version). A model for what this box cannot run, not a measurement of a fleet.

Assumptions (each a flag of the command, printed with the table):
- an instance receives at most `link_gbps` and verifies (SHA-256 of every byte, as the cache
  does) at `verify_mb_s` per thread on `verify_threads` threads: its rate is the smaller one;
- the origin (S3 or a mount) serves at most `origin_gbps` in all;
- origin-only: every instance pulls every byte from the origin, so the origin carries N x size;
- peers: each blob leaves the origin once and instances forward what they verified, piece by
  piece (`piece_mb`); the version spreads along a pipelined tree, one piece-time per level:
  size / min(rate, origin) + ceil(log2 N) x piece / rate;
- a follower's version is `delta_ratio` of the full bytes on the wire (measured by `bench
  weights`), then rebuilt from the previous one: decoded at `decode_ns` an element per thread
  (sparse3 finds its band with a pass over the base tensor) and every rebuilt tensor hashed (as
  the cache does), on `verify_threads` threads, after the transfer;
- a joiner with peers takes the version whole (a holder serves a rebuilt version's files), so a
  joiner replays nothing in either column.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import asdict, dataclass

from rlboost.benchmarks.report import print_table

GB = 1e9
MODELS = {"8B": 8e9 * 2, "70B": 70e9 * 2}  # bf16: two bytes a parameter
FLEETS = (1, 10, 100)


@dataclass(frozen=True)
class Bandwidth:
    link_gbps: float = 25.0  # an instance's network link
    origin_gbps: float = 40.0  # the origin's total egress to this fleet
    verify_mb_s: float = 1000.0  # SHA-256 per thread (measured on this box by `measure_verify`)
    verify_threads: int = 8
    piece_mb: float = 64.0
    delta_ratio: float = 0.0074  # `bench weights`' median at lr 1e-6, sparse3 (Nov 29, 2026)
    decode_ns: float = 2.5  # a delta's decode per element and thread (sparse3, this box, Nov 29, 2026)

    def verify_bytes_s(self) -> float:
        return self.verify_mb_s * 1e6 * self.verify_threads

    def rebuild_s(self, size: float) -> float:
        """A follower's replay of one delta on a bf16 version of `size` bytes: decode, then hash."""
        return size / self.verify_bytes_s() + size / 2 * self.decode_ns * 1e-9 / self.verify_threads

    def instance_bytes_s(self) -> float:
        return min(self.link_gbps * GB / 8, self.verify_bytes_s())

    def origin_bytes_s(self) -> float:
        return self.origin_gbps * GB / 8


def origin_only_s(size: float, n: int, bw: Bandwidth) -> float:
    """Every instance pulls `size` from the origin: the slower of its own rate and its share."""
    return size / min(bw.instance_bytes_s(), bw.origin_bytes_s() / n)


def peers_s(size: float, n: int, bw: Bandwidth) -> float:
    """Each blob leaves the origin once; the instances forward verified pieces to each other."""
    rate = bw.instance_bytes_s()
    piece = min(size, bw.piece_mb * 1e6)
    return size / min(rate, bw.origin_bytes_s()) + math.ceil(math.log2(n)) * piece / rate if n > 1 else \
        size / min(rate, bw.origin_bytes_s())


def table(bw: Bandwidth) -> list[dict]:
    rows = []
    for model, size in MODELS.items():
        for what, nbytes, rebuild in (("join (whole version)", size, 0.0),
                                      ("follow (delta)", size * bw.delta_ratio, bw.rebuild_s(size))):
            for n in FLEETS:
                rows.append({"model": model, "pull": what, "instances": n, "bytes_gb": round(nbytes / GB, 2),
                             "origin_only_s": round(origin_only_s(nbytes, n, bw) + rebuild, 1),
                             "peers_s": round(peers_s(nbytes, n, bw) + rebuild, 1),
                             "origin_gb_origin_only": round(n * nbytes / GB, 1),
                             "origin_gb_peers": round(nbytes / GB, 1)})
    return rows


def measure_verify(mb: int = 256) -> float:
    """SHA-256 MB/s of one thread on this box (what the cache's checks cost per byte)."""
    buf = os.urandom(mb * 1024 * 1024)
    t0 = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    return round(mb * 1024 * 1024 / 1e6 / (time.perf_counter() - t0), 1)


def report(bw: Bandwidth) -> dict:
    rows = table(bw)
    print(f"fleet-join model (assumptions: {asdict(bw)})")
    print_table(rows, [("model", "<5", "model"), ("pull", "<21", "pull"), ("N", ">4", "instances"),
                       ("GB", ">7", "bytes_gb"), ("origin-only s", ">14", "origin_only_s"), ("peers s", ">8", "peers_s"),
                       ("origin GB (only / peers)", ">26",
                        lambda r: f"{r['origin_gb_origin_only']:>12} / {r['origin_gb_peers']}")])
    return {"model_fleet": rows, "assumptions": asdict(bw)}
