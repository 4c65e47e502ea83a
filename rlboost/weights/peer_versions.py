"""A version rebuilt from deltas, taken whole from a peer that holds it (`rlboost.weights.peers`).

Its files are the same bytes on every worker (the layout follows from the manifest, every
tensor's bytes are its SHA-256), so a late joiner with no cached base can take them from a holder
instead of the nearest snapshot and the deltas since, and replays nothing. The files are laid
out as this cache would write them and fetched in pieces of whole tensors (about
`PEER_PIECE_BYTES`, HTTP ranges) in parallel, each checked as it arrives (the header byte for
byte, every tensor against its SHA-256), then installed as a rebuilt version.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import queue
import random
import shutil
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from rlboost.logs import get_logger
from rlboost.weights.blobstore import Buffer
from rlboost.weights.disk import CacheDir
from rlboost.weights.fetch import all_or_none
from rlboost.weights.manifest import Manifest
from rlboost.weights.peerhttp import PeerBusy, PeerError
from rlboost.weights.rebuild import layout, write_all
from rlboost.weights.safetensors_io import ITEMSIZE
from rlboost.weights.stats import CacheStats

if TYPE_CHECKING:
    from rlboost.weights.peers import PeerNetwork

log = get_logger(component="weights")

__all__ = ["PeerVersions", "PEER_PIECE_BYTES"]

PEER_PIECE_BYTES = 16 << 20  # a version taken whole from peers comes in pieces of about this size, in parallel
Region = tuple[int, int, str]  # (offset in the file, bytes, SHA-256; "" for the header, compared byte for byte)


class PeerVersions:
    """Takes versions whole from `peers` into `disk`, at most as many pieces at a time as `sem`
    lets through, checked on `pool`'s threads (the blob fetcher's)."""

    def __init__(self, peers: PeerNetwork, disk: CacheDir, stats: CacheStats, sem: asyncio.Semaphore,
                 pool: ThreadPoolExecutor) -> None:
        self.peers, self.disk, self.stats, self.sem, self.pool = peers, disk, stats, sem, pool

    async def take(self, target: Manifest) -> bool:
        """True: `target` is installed, checked and advertised. False (nothing kept) when no
        holder serves every file: the caller takes the snapshot and the deltas."""
        peers, digest = self.peers, target.digest()
        if not all(e.sha256 for e in target.tensors):
            return False  # a tensor without a hash could not be checked
        st = await peers.version_state(digest)
        holders = [(h, url) for h, url in st.holders.items() if h != peers.peer_id]
        if not holders:
            return False
        random.shuffle(holders)
        t0 = time.perf_counter()
        tmp = self.disk.tmp_version_dir(target.version)
        try:
            jobs, files = await asyncio.to_thread(layout, target.tensors, tmp)
            try:
                spans: dict[int, list[Region]] = {fd: [] for _, _, fd in files}
                for entry, fd, offset in jobs:
                    spans[fd].append((offset, math.prod(entry.shape) * ITEMSIZE[entry.dtype], entry.sha256))
                pieces = []  # (file index, fd, header, regions): whole tensors, about PEER_PIECE_BYTES each
                for index, (_, header, fd) in enumerate(files):
                    for regions in _pieces([(0, len(header), "")] + sorted(spans[fd]), PEER_PIECE_BYTES):
                        pieces.append((index, fd, header, regions))
                bad: set[str] = set()  # holders that failed or lied: not asked again for this version
                await all_or_none([asyncio.create_task(self._piece(target, digest, holders, bad, *piece))
                                   for piece in pieces])
            finally:
                for _, _, fd in files:
                    os.close(fd)
            (tmp / "manifest.json").write_bytes(target.encode())
            await asyncio.to_thread(self.disk.install, tmp, self.disk.vdir(target.version))
        except PeerError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log.info("weights: no peer served the version whole; taking the snapshot and the deltas",
                     version=target.version, error=str(e))
            return False
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            self.stats.fetch_s += time.perf_counter() - t0
        self.disk.mark_checked(target)
        self.stats.peer_versions += 1
        await peers.advertise_version(digest)
        return True

    async def _piece(self, target: Manifest, digest: str, holders: list[tuple[str, str]], bad: set[str],
                     index: int, fd: int, header: bytes, regions: list[Region]) -> None:
        """One piece of file `index` from the first holder that serves it right; a busy one is
        asked again a little later, until `peers.wait_s`."""
        peers = self.peers
        start, stop = regions[0][0], regions[-1][0] + regions[-1][1]
        deadline = time.monotonic() + peers.wait_s
        async with self.sem:
            while time.monotonic() < deadline:
                busy = False
                for h, url in [x for x in holders if x[0] not in bad][:peers.tries]:
                    try:
                        if await self._take_piece(peers.read_version(url, digest, index, start, stop),
                                                  fd, header, regions):
                            return
                        self.stats.peer_rejected += 1
                        log.warning("peer served a version file that failed verification; not asked "
                                    "again", version=target.version, file=index, peer=h, url=url)
                    except PeerBusy:
                        busy = True
                        continue
                    except PeerError as e:
                        log.info("peer could not serve a version file; trying the next source",
                                 version=target.version, file=index, peer=h, error=str(e))
                    bad.add(h)
                if not busy:
                    break
                await asyncio.sleep(0.05 + random.random() * 0.2)
        raise PeerError(f"no peer served version {target.version} file {index}")

    async def _take_piece(self, chunks: AsyncIterator[Buffer], fd: int, header: bytes, regions: list[Region]) -> bool:
        """Stream a piece of a version file (`regions`, back to back) from a peer into `fd` through a
        worker thread that writes each chunk at its place and checks it (`_check_to_fd`); True when
        every byte checked out."""
        loop = asyncio.get_running_loop()
        q: queue.SimpleQueue[Buffer | None] = queue.SimpleQueue()
        sink = loop.run_in_executor(self.pool, _check_to_fd, fd, q, header, regions)
        size, n = regions[-1][0] + regions[-1][1] - regions[0][0], 0
        try:
            async with contextlib.aclosing(chunks) as body:
                async for chunk in body:
                    n += len(chunk)
                    if n > size:
                        break  # longer than the manifest allows: a lie, stop reading
                    q.put(chunk)
        finally:
            q.put(None)
            self.stats.peer_bytes += n
            ok = await sink
        if ok and n == size:
            self.stats.bytes_fetched += n
            return True
        return False


def _pieces(regions: list[Region], piece: int) -> list[list[Region]]:
    """Back-to-back regions cut into runs of about `piece` bytes (a region is never split: its
    SHA-256 is checked whole; one of no bytes, an empty tensor, joins the run before it, so every
    run has bytes to ask for)."""
    out: list[list[Region]] = [[]]
    for r in regions:
        if out[-1] and r[1] and sum(n for _, n, _ in out[-1]) + r[1] > piece:
            out.append([])
        out[-1].append(r)
    return out


def _check_to_fd(fd: int, chunks: queue.SimpleQueue, header: bytes, regions: list[Region]) -> bool:
    """(thread) Write chunks until None at their places in `fd`, checking them against `regions`
    ((offset, bytes, SHA-256), ascending, back to back from the first's offset; one of no hash
    is the file's header, compared byte for byte). True if every region checked out and nothing
    came past the last."""
    size = regions[-1][0] + regions[-1][1]
    pos, i, ok = regions[0][0], 0, all(a[0] + a[1] == b[0] for a, b in zip(regions, regions[1:]))
    h = hashlib.sha256()
    while (chunk := chunks.get()) is not None:
        if not ok:
            continue  # drain: the receiver stops on its own
        mv = memoryview(chunk).cast("B")
        if pos + len(mv) > size:
            ok = False
            continue
        write_all(fd, mv, pos)
        off = 0
        while off < len(mv):
            start, n, sha = regions[i]
            take = min(len(mv) - off, start + n - (pos + off))
            piece = mv[off:off + take]
            if sha:
                h.update(piece)
            elif piece != header[pos + off:pos + off + take]:
                ok = False
                break
            off += take
            if pos + off == start + n:  # a region ends here
                if sha:
                    ok = ok and h.hexdigest() == sha
                    h = hashlib.sha256()
                i += 1
                if i == len(regions):
                    break
        pos += len(mv)
    empty = hashlib.sha256().hexdigest()  # regions of no bytes left at the end (an empty tensor)
    return ok and pos == size and all(n == 0 and sha in ("", empty) for _, n, sha in regions[i:])

