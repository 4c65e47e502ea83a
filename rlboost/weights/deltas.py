"""Sparse deltas between two versions of a tensor: what changed, bit-exact, zstd-compressed.

An RL step moves every weight a little, but in the publish dtype (bf16) most elements keep
their bit pattern: an update smaller than half a unit in the last place rounds back to the same
value. So a version is shipped as the elements whose bits changed. Per tensor, the smallest of:
- "same": no element changed (no bytes);
- "sparse": the changed positions (gaps between them, uint32) and the XOR of the old and new bit
  patterns there (a step of one unit in the last place flips a run of low bits: the XOR is far
  more regular than the new value, about half the bytes once compressed);
- "xor": the XOR of the old and new bit patterns over the whole tensor (zero where unchanged);
- "raw": the new bit patterns (a new tensor, a changed shape, or a delta that would not pay).
Every array is split into byte planes (all first bytes, then all second bytes, ...) before zstd:
the high byte of a bf16 (sign and exponent) barely changes, the low byte is noise, and zstd
compresses each plane far better apart than interleaved.

Decoding treats the payload as hostile: the decompressed size must be exactly what the tensor's
shape, dtype and count imply (a frame declaring any other size is refused before allocating), positions
must fall inside the tensor, and the caller compares the result's SHA-256 with the manifest
before anything uses it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from rlboost.weights.errors import DeltaCorrupt

if TYPE_CHECKING:
    import torch

ZSTD_LEVEL = 3  # fast; higher levels buy a few % at several times the publish time
_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def bits(t: torch.Tensor) -> np.ndarray:
    """A tensor's bit patterns as a flat integer array (a view when the tensor is contiguous on the CPU)."""
    import torch

    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()


def bits_dtype(itemsize: int) -> type[np.integer]:
    """The integer type `bits()` and `decode()` use for elements of `itemsize` bytes."""
    dtype = _BITS.get(itemsize)
    if dtype is None:
        raise DeltaCorrupt(f"no bit type of {itemsize} bytes")
    return dtype


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of the tensor's bytes in C order: what the manifest names and a pull verifies."""
    return hashlib.sha256(memoryview(bits(t)).cast("B")).hexdigest()


def _planes(a: np.ndarray) -> bytes:
    cols = a.view(np.uint8).reshape(-1, a.itemsize)
    return b"".join(cols[:, i].tobytes() for i in range(a.itemsize))  # column copies: ~5x a transpose


def _unplanes(b: bytes | memoryview, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """Byte planes back to elements, into `out` (same size, any dtype of that width) if given."""
    size = np.dtype(dtype).itemsize
    planes = np.frombuffer(b, np.uint8).reshape(size, -1)
    cols = (np.empty((planes.shape[1], size), np.uint8) if out is None
            else out.view(np.uint8).reshape(-1, size))
    for i in range(size):  # strided column writes: ~10x faster than a transposing copy
        cols[:, i] = planes[i]
    return cols.view(dtype).reshape(-1)


def _xor_planes(x: np.ndarray, b: bytes | memoryview) -> np.ndarray:
    """`x ^= _unplanes(b)` in place, plane by plane: no temporary the size of the tensor."""
    cols = x.view(np.uint8).reshape(-1, x.itemsize)
    planes = np.frombuffer(b, np.uint8).reshape(x.itemsize, -1)
    for i in range(x.itemsize):
        np.bitwise_xor(cols[:, i], planes[i], out=cols[:, i])
    return x


def _zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def _unzstd(payload: bytes | memoryview, expect: int) -> bytes:
    """Exactly `expect` bytes out of `payload`, or DeltaCorrupt. A frame must declare its size
    (the publisher's do), and that size must be `expect`: nothing is allocated for what a
    hostile frame claims beyond what the tensor can hold."""
    import zstandard

    try:
        declared = zstandard.frame_content_size(payload)
        if declared != expect:
            raise DeltaCorrupt(f"delta payload declares {'more than' if declared > expect else declared} "
                               f"bytes, expected {expect}")
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=expect)
    except zstandard.ZstdError as e:
        raise DeltaCorrupt(f"delta payload does not decompress: {e}") from None
    if len(out) != expect:
        raise DeltaCorrupt(f"delta payload decompresses to {len(out)} bytes, expected {expect}")
    return out


def encode(old: torch.Tensor | None, new: torch.Tensor) -> tuple[str, int, bytes]:
    """(encoding, changed elements, payload) of `new` given `old`; the smallest that is exact."""
    nb = bits(new)
    if old is None or old.shape != new.shape or old.dtype != new.dtype or nb.size >= 1 << 32:
        return "raw", nb.size, _zstd(_planes(nb))
    x = bits(old) ^ nb
    idx = np.flatnonzero(x)
    n = idx.size
    if n == 0:
        return "same", 0, b""
    options = []
    if n * 2 < nb.size:  # positions + XORs: worth trying while a minority of elements changed
        gaps = np.diff(idx, prepend=-1) - 1
        options.append(("sparse", _zstd(_planes(gaps.astype(np.uint32)) + _planes(x[idx]))))
    if n * 8 > nb.size:  # the dense XOR only pays once changes are no longer rare
        options.append(("xor", _zstd(_planes(x))))
    if n * 2 >= nb.size:  # the new bits beat an XOR only when most elements changed
        options.append(("raw", _zstd(_planes(nb))))
    enc, payload = min(options, key=lambda o: len(o[1]))
    return enc, n, payload


def decode(base: np.ndarray | None, enc: str, count: int, payload: bytes | memoryview, numel: int,
           itemsize: int, inplace: bool = False) -> np.ndarray:
    """The new tensor's bit patterns (flat) from the base's (`bits()` of the base tensor, or None
    for "raw"). `inplace`: the caller owns `base` (a private copy-on-write mapping, or an earlier
    decode's result, a scratch buffer) and it may be overwritten, also by a "raw" delta: a chain
    of deltas costs no copy and no tensor-sized allocation per version.
    Raises DeltaCorrupt for anything that does not fit."""
    dtype = bits_dtype(itemsize)
    fits = base is not None and base.size == numel and base.itemsize == itemsize
    if enc == "raw":  # written over the base when the caller owns it: no allocation
        return _unplanes(_unzstd(payload, numel * itemsize), dtype, out=base if inplace and fits else None)
    if not fits:
        raise DeltaCorrupt(f"the base tensor does not fit the delta ({enc}, {numel} elements)")
    if enc == "same":
        return base  # read only from here on: no copy
    if enc == "xor":
        planes = _unzstd(payload, numel * itemsize)
        return _xor_planes(base, planes) if inplace else base ^ _unplanes(planes, dtype)
    if enc != "sparse":
        raise DeltaCorrupt(f"unknown delta encoding {enc[:20]!r}")
    if not 0 < count <= numel:
        raise DeltaCorrupt(f"sparse delta of {count} elements for a tensor of {numel}")
    raw = _unzstd(payload, count * (4 + itemsize))
    gaps = _unplanes(memoryview(raw)[:count * 4], np.uint32).astype(np.int64)
    idx = np.cumsum(gaps + 1) - 1
    if idx[-1] >= numel:
        raise DeltaCorrupt("sparse delta writes past the end of the tensor")
    out = base if inplace else base.copy()
    out[idx] ^= _unplanes(memoryview(raw)[count * 4:], dtype)
    return out
