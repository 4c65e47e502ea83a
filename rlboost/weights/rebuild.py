"""Rebuild a version from a base version's files and the deltas since, straight into its files.

`rebuild(...)` is the cache's replay step (`WeightCache` picks the path and installs the result).
Per tensor, on one of a few threads: read the base tensor's bytes from the base's safetensors
files into a scratch buffer the thread reuses, apply each version's delta to it in place, check
the result's SHA-256 against the target manifest, and only then write it at its place in the
output files, whose headers are known from the manifest before any tensor is rebuilt.

Why it is built this way (a late joiner's provisioning rate is bound by this step, on few cores,
while the download runs on the event loop):
- no copy-on-write mapping is written: a write fault on a privately mapped page makes the kernel
  flush that page from every CPU's TLB (an inter-processor interrupt per page, dear on a VM), which
  cost more than the replay itself; the base is read with `preadv` into the scratch buffer instead;
- no tensor-sized allocation per tensor: a freed big buffer is unmapped, another TLB flush, and
  the buffer's pages are faulted in again next time;
- every bulk step (file reads and writes, zstd, numpy, SHA-256) releases the GIL, so the threads
  run in parallel with each other and with the download, and the event loop is not held up;
- no safetensors serializer: it would copy every tensor into one bytes object first.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path

import numpy as np

from rlboost.weights import deltas
from rlboost.weights.errors import DeltaCorrupt, StoreError
from rlboost.weights.manifest import Delta, Manifest, TensorEntry
from rlboost.weights.safetensors_io import ITEMSIZE, Span, header_bytes, read_header

__all__ = ["BaseFiles", "rebuild", "layout", "write_all", "OUT_FILE_BYTES"]

OUT_FILE_BYTES = 256 << 20  # a rebuilt version is written in files of about this size

FileRange = tuple[int, int, int]  # (open file descriptor, offset, bytes)


class BaseFiles:
    """Where each tensor of the base version lies on disk: its bytes in C order as segments of
    safetensors files (a snapshot splits a big tensor into row blocks, one segment each).

    `shard_file(sha)`: the path of one of a snapshot's shards (a caller whose shards are still
    arriving waits in it until that one is verified); `whole_files`: the files of a version the
    cache rebuilt, whole tensors under their own names. Headers are parsed once per file and
    every span is checked against the manifest's dtype and shape."""

    def __init__(self, start: Manifest, *, shard_file: Callable[[str], Path] | None = None,
                 whole_files: list[Path] | None = None) -> None:
        self.entries = {t.name: t for t in start.tensors}
        self.shard_file = shard_file
        self._files: dict[str, tuple[int, dict[str, Span]]] = {}  # shard id or path -> (fd, spans)
        self._whole: dict[str, tuple[int, Span]] = {}
        self._lock = threading.Lock()
        try:
            for path in whole_files or ():
                fd, spans = self._open(str(path), path)
                self._whole.update((name, (fd, sp)) for name, sp in spans.items())
        except BaseException:
            self.close()
            raise

    def _open(self, key: str, path: Path) -> tuple[int, dict[str, Span]]:
        with self._lock:
            if key not in self._files:
                with open(path, "rb") as f:  # the header through a buffered file, the data by fd
                    spans = read_header(f)
                    self._files[key] = (os.dup(f.fileno()), spans)
            return self._files[key]

    def segments(self, name: str) -> list[FileRange] | None:
        """The tensor's bytes, or None if the base has no tensor of that name."""
        e = self.entries.get(name)
        if e is None:
            return None
        if self.shard_file is None:
            where = [self._whole[name]] if name in self._whole else []
        else:
            where = [(fd, spans.get(p.key)) for p in e.parts
                     for fd, spans in [self._open(p.shard, self.shard_file(p.shard))]]
        if not where or any(sp is None for _, sp in where):
            raise StoreError(f"tensor {name} is missing from the base version's files")
        _check(e, [sp for _, sp in where])
        return [(fd, sp.start, sp.stop - sp.start) for fd, sp in where]

    def close(self) -> None:
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()


def _check(e: TensorEntry, spans: list[Span]) -> None:
    """The spans, joined along the first dimension (a snapshot's row blocks), are exactly the
    manifest's dtype and shape."""
    shape = spans[0].shape
    if len(spans) > 1:
        shape = [sum(sp.shape[0] if sp.shape else 0 for sp in spans)] + shape[1:]
    if shape != e.shape or any(sp.dtype != e.dtype or sp.shape[1:] != e.shape[1:] for sp in spans):
        raise StoreError(f"tensor {e.name}: {spans[0].dtype} {shape} in the base's files does not match the manifest")


def _read_into(buf: memoryview, segments: list[FileRange]) -> None:
    pos = 0
    for fd, offset, n in segments:
        done = 0
        while done < n:  # a read may return short (2 GiB at most per call); EOF early is an error
            got = os.preadv(fd, [buf[pos + done:pos + n]], offset + done)
            if got <= 0:
                raise StoreError("a base version's file is shorter than its header says")
            done += got
        pos += n


def write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):  # a write moves 2 GiB at most per call
        done += os.pwrite(fd, data[done:], offset + done)


def rebuild(target: Manifest, chain: list[tuple[Manifest, Delta]], base: BaseFiles, blobs: dict[str, bytes],
            out_dir: Path, threads: int) -> list[Path]:
    """Replay `chain`'s deltas (oldest first: each a version and the delta that reaches it, the
    last one `target`'s) on `base`'s tensors and write
    the target's tensors into safetensors files in `out_dir` (`tensors-<i>.safetensors`), every one
    checked against the target's SHA-256 before it is written. Raises DeltaCorrupt on the first
    tensor that does not match (the caller discards `out_dir`). `blobs`: every delta blob of the
    chain by id, verified.

    Only the target's hashes are checked: the intermediate versions are never installed or
    served, and a bad delta anywhere in the chain shows up in the target's hash."""
    steps = [({t.name: t for t in m.tensors}, {dt.name: dt for dt in d.tensors}) for m, d in chain]
    jobs, files = layout(target.tensors, out_dir)
    local = threading.local()

    def one(entry: TensorEntry, fd: int, offset: int) -> None:
        nbytes = math.prod(entry.shape) * ITEMSIZE[entry.dtype]
        segments = base.segments(entry.name)
        x = None
        if segments is not None:
            x = _scratch(local, sum(n for _, _, n in segments))
            _read_into(memoryview(x), segments)
            x = x.view(deltas.bits_dtype(ITEMSIZE[base.entries[entry.name].dtype]))
        for tensors, dts in steps:
            e = tensors.get(entry.name)
            if e is None:
                x = None  # absent from this version: the next one that has it ships it raw
                continue
            d = dts[entry.name]
            payload = memoryview(blobs[d.blob])[d.offset:d.offset + d.length] if d.length else b""
            # in place: `x` is this thread's scratch buffer or an earlier step's result
            x = deltas.decode(x, d.enc, d.count, payload, math.prod(e.shape), ITEMSIZE[e.dtype], inplace=True)
        if x is None or x.nbytes != nbytes or hashlib.sha256(x).hexdigest() != entry.sha256:
            raise DeltaCorrupt(f"v{target.version} tensor {entry.name}: the rebuilt tensor does not match "
                               f"the manifest's SHA-256 (corrupt delta, wrong base or a lying hash)")
        write_all(fd, memoryview(x).cast("B"), offset)

    paths = []
    try:
        for path, header, fd in files:
            write_all(fd, memoryview(header), 0)
            paths.append(path)
        # every tensor submitted at once, taken in manifest order (the order its shards arrive in):
        # a thread waiting for a shard does not hold up the others
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="weights-rebuild") as pool:
            futures = [pool.submit(one, *job) for job in jobs]
            done, _ = wait_all(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                f.cancel()  # after a failure: the ones not started yet never start
            for f in done:
                f.result()
    finally:
        for _, _, fd in files:
            os.close(fd)
    return paths


def layout(entries: list[TensorEntry], out_dir: Path) -> tuple[list[tuple[TensorEntry, int, int]],
                                                               list[tuple[Path, bytes, int]]]:
    """Group the tensors into files of about OUT_FILE_BYTES (manifest order) and place each one:
    ([(entry, fd, offset)] in manifest order, [(path, header, fd)]). Within a file the tensors are
    ordered by falling item size, so each starts aligned to its own (the data starts 8-aligned)."""
    groups: list[list[TensorEntry]] = [[]]
    size = 0
    for e in entries:
        if size >= OUT_FILE_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += math.prod(e.shape) * ITEMSIZE[e.dtype]
    placed: dict[str, tuple[int, int]] = {}
    files = []
    try:
        for i, group in enumerate(groups):
            group = sorted(group, key=lambda e: -ITEMSIZE[e.dtype])
            header, offsets = header_bytes([(e.name, e.dtype, e.shape) for e in group])
            path = out_dir / f"tensors-{i:05d}.safetensors"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            files.append((path, header, fd))
            placed.update((e.name, (fd, off)) for e, off in zip(group, offsets))
    except BaseException:
        for _, _, fd in files:
            os.close(fd)
        raise
    return [(e, *placed[e.name]) for e in entries], files


def _scratch(local: threading.local, nbytes: int) -> np.ndarray:
    """This thread's reusable buffer, `nbytes` long (grown when a bigger tensor comes): its pages
    are faulted in once, not once per tensor."""
    buf = getattr(local, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = local.buf = np.empty(max(nbytes, 1 << 20), np.uint8)
    return buf[:nbytes]
