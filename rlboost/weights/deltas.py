"""Sparse deltas between two versions of a tensor: what changed, bit-exact, zstd-compressed.

An RL step moves every weight a little, but in the publish dtype (bf16) most elements keep
their bit pattern: an update smaller than half a unit in the last place (ULP) rounds back to the
same value. So a version is shipped as the elements whose bits changed. Per tensor, the smallest of:
- "same": no element changed (no bytes);
- "sparse3": the changed positions and, there, the change of the bit patterns (below);
- "xor": the XOR of the old and new bit patterns over the whole tensor (zero where unchanged);
- "raw": the new bit patterns (a new tensor, a changed shape, or a delta that would not pay).
The formats before are still read: "sparse2" (positions as byte gaps, differences zigzagged, with
an optional band; still written with `fmt="sparse2"`, for workers older than sparse3) and
"sparse" (uint32 gaps, XORs). A reader that does not know an encoding refuses the manifest that
names it (`rlboost.weights.manifest.ENCODINGS`), so a new format gets a new name.

Why "sparse3" is laid out the way it is (measured on `rlboost bench weights`' GRPO updates):
- which elements change depends mostly on their magnitude: a step of size lr crosses a rounding
  boundary with a probability of about lr / ULP, and the ULP halves with every exponent step
  down (on the bench at lr 1e-6: 1 % of the elements of exponent -8 change a step, 16 % of -12,
  99 % of -20). The decoder holds the base, so both sides can tell the small elements apart: the
  *band*, the elements of magnitude below a threshold the encoder picks per tensor (at an
  exponent step, where its estimated bits pay, at most BAND3_MAX_FRACTION of the elements), is
  ordered by magnitude and its changes are coded by their ranks in it, so they come in runs;
  every other change by its gap in the tensor. The positions cost 6.2 bits a change instead of
  7.4 on the bench's steps (5.0 would be each exponent's own rate; more classes or a full sort
  saved a little more for much more decoding);
- each of the two gap streams is its own zstd frame (zstd then codes each one's statistics);
  gaps are one byte each, 255 escaping to a uint32 kept apart;
- the value change: its sign a bit each (`np.packbits`: 1 bit, where zstd coded the zigzagged
  difference in about 2.7 bits), then |new - old| - 1 of the bit patterns as integers (a one-ULP
  step is 0: 87 % of them), byte planes, a zstd frame.
On the bench's lr 1e-6 steps a delta is 0.74 % of the version where sparse2 took 1.0 %, for
about three times sparse2's decoding (finding the band is a pass over the base: ~1.5 ns an
element); docs/benchmarks/weights.md has the figures.

"sparse3" payload: a 32-byte header `<Q6I` (the band's threshold on the bit pattern's magnitude
`bits & ~sign`, 0 = no band; changes in the band; escapes of the band's and of the rest's gaps;
the bytes of their two zstd frames and of the steps' frame), the band's gap frame, the rest's gap
frame, ceil(count / 8) bytes of signs, the steps' frame.

Decoding treats the payload as hostile: every frame's decompressed size must fit what the tensor's
shape, dtype and count imply (a frame declaring any other size is refused before allocating), the
header must add up to the payload, positions must fall inside the tensor (and ranks inside the
band), and the caller compares the result's SHA-256 with the manifest before anything uses it.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from typing import TYPE_CHECKING

import numpy as np

from rlboost.weights.errors import DeltaCorrupt

if TYPE_CHECKING:
    import torch

ZSTD_LEVEL = 3  # fast; higher levels buy a few % at several times the publish time
SPARSE2_ZSTD_LEVEL = 9  # its payload is small: 2% fewer bytes than level 3 at about the same time (19: 4%, 4x)
_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_HEADER = struct.Struct("<QB3xII")  # sparse2: band threshold, exponent shift, changes in the band, escapes
# sparse3: the band's threshold; changes in the band; escapes of the band's and of the rest's gaps;
# the bytes of their two zstd frames and of the steps' frame
_HEADER3 = struct.Struct("<Q6I")
_EXP_SHIFT = {"bfloat16": 7, "float16": 10, "float32": 23, "float64": 52}  # where the exponent starts
BAND_MAX_FRACTION = 1 / 8  # of a tensor's elements at most: bounds the decoder's work
BAND3_MAX_FRACTION = 1 / 16  # sparse3: its band holds at most this share of a tensor's elements
BAND3_SAMPLE = 16  # the encoder estimates the magnitudes' spread from every 16th element
# its streams are small: level 12 codes the bench's deltas ~4 % smaller than 9 at about the same
# publish time (68 MB/s on gap bytes here); 15 gains ~1 % more at a third of the speed
SPARSE3_ZSTD_LEVEL = 12


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


def _zstd(data: bytes, level: int = 0) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=level or ZSTD_LEVEL).compress(data)


def _unzstd(payload: bytes | memoryview, expect: int | tuple[int, int]) -> bytes:
    """Exactly `expect` bytes (or between `expect`'s two bounds) out of `payload`, or DeltaCorrupt.
    A frame must declare its size (the publisher's do), and that size must fit: nothing is
    allocated for what a hostile frame claims beyond what the tensor can hold."""
    import zstandard

    lo, hi = expect if isinstance(expect, tuple) else (expect, expect)
    want = f"{lo}" if lo == hi else f"{lo} to {hi}"
    try:
        declared = zstandard.frame_content_size(payload)
        if not lo <= declared <= hi:
            raise DeltaCorrupt(f"delta payload declares {'more than' if declared > hi else declared} "
                               f"bytes, expected {want}")
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=declared)
    except zstandard.ZstdError as e:
        raise DeltaCorrupt(f"delta payload does not decompress: {e}") from None
    if len(out) != declared:
        raise DeltaCorrupt(f"delta payload decompresses to {len(out)} bytes, expected {declared}")
    return out


def _zigzag(d: np.ndarray) -> np.ndarray:
    """Signed differences to unsigned, small magnitudes small: 0, -1, 1, -2 -> 0, 1, 2, 3."""
    return ((d << 1) ^ (d >> (d.itemsize * 8 - 1))).view(_UNSIGNED[d.itemsize])


def _unzigzag(z: np.ndarray) -> np.ndarray:
    z = z.view(_UNSIGNED[z.itemsize])
    return ((z >> 1) ^ (np.zeros(1, z.dtype) - (z & 1))).view(_SIGNED[z.itemsize])


def _gaps(g: np.ndarray) -> tuple[bytes, int]:
    """Gaps as one byte each, 255 meaning "255 + the next escape" (uint32 byte planes, after all the
    bytes): most gaps between changes are short. (bytes, escapes)."""
    esc = g >= 255
    return np.minimum(g, 255).astype(np.uint8).tobytes() + _planes((g[esc] - 255).astype(np.uint32)), \
        int(np.count_nonzero(esc))


def _ungaps(b: bytes | memoryview, count: int, escapes: int) -> np.ndarray:
    """`_gaps`' bytes back to `count` gaps (uint64); the caller checked the length."""
    g = np.frombuffer(b, np.uint8, count).astype(np.uint64)
    at = np.flatnonzero(g == 255)
    if at.size != escapes:
        raise DeltaCorrupt("sparse delta: its positions do not match their escapes")
    if escapes:
        g[at] += _unplanes(memoryview(b)[count:count + 4 * escapes], np.uint32)
    return g


def _positions(raw: bytes | memoryview, count: int, escapes: int) -> np.ndarray:
    """`_gaps`' bytes (exactly `count` gaps and their escapes) to positions, int64: change j is at
    the gaps up to it plus one per change before it (< (2**32 + 255) * 2**32: no wrap)."""
    if escapes:
        r = np.cumsum(_ungaps(raw, count, escapes), dtype=np.int64)
    else:
        g = np.frombuffer(raw, np.uint8, count)
        if count and g.max() == 255:
            raise DeltaCorrupt("sparse delta: its positions do not match their escapes")
        r = g.astype(np.int64)  # then summed in place: a widening cumsum of uint8 is many times slower
        np.cumsum(r, out=r)
    r += np.arange(count, dtype=np.int64)
    return r


def _magnitude(b: np.ndarray) -> np.ndarray:
    """The bit pattern without its sign bit, unsigned: orders floats of a sign by magnitude."""
    u = b.view(_UNSIGNED[b.itemsize])
    return u & u.dtype.type((1 << (8 * b.itemsize - 1)) - 1)


def _band(mag: np.ndarray, threshold: int, shift: int) -> np.ndarray:
    """Indices of the elements whose magnitude is below `threshold`, ordered by exponent (stable):
    the order both sides rank the band's changes in."""
    members = np.flatnonzero(mag < threshold)
    return members[np.argsort((mag[members] >> mag.dtype.type(shift)).astype(np.uint16), kind="stable")]


def _bits_needed(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    """About the bits that say which `k` of `n` elements changed (binary entropy), elementwise."""
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    return n * h


def _threshold(mag: np.ndarray, changed: np.ndarray, shift: int) -> int:
    """The band: the smallest exponents up to where ranking them apart stops paying, estimated
    from each exponent's change rate (the bits of the band's exponents, each at its own rate, plus
    the rest's at theirs), within BAND_MAX_FRACTION of the elements; 0 if no band pays."""
    exp = (mag >> mag.dtype.type(shift)).astype(np.int64)
    n = np.cumsum(np.bincount(exp))
    k = np.cumsum(np.bincount(exp[changed], minlength=n.size))
    band = np.cumsum(_bits_needed(np.diff(n, prepend=0), np.diff(k, prepend=0)))
    total = band + _bits_needed(n[-1] - n, k[-1] - k)
    fits = np.flatnonzero(n <= mag.size * BAND_MAX_FRACTION)
    if fits.size == 0:
        return 0
    best = int(fits[np.argmin(total[fits])])
    return (best + 1) << shift if total[best] < 0.98 * _bits_needed(n[-1:], k[-1:])[0] else 0


def _sparse2(ob: np.ndarray, nb: np.ndarray, changed: np.ndarray, dtype_name: str, band: bool) -> bytes:
    """The format before sparse3, zstd-compressed as one frame: a 20-byte header `<QB3xII` (band
    threshold on the magnitude, 0 = no band; the exponent's shift; changes in the band; escapes),
    `count` gap bytes (the band's rank gaps, ranked by exponent, then the tensor gaps of the rest),
    the escapes' uint32 planes, then the `count` zigzagged differences of the bit patterns as byte
    planes. Written with `fmt="sparse2"` (no band) for workers older than sparse3; the band was
    an opt-in of Nov 26-28 builds, still read."""
    shift = _EXP_SHIFT.get(dtype_name)
    mag = _magnitude(ob)
    threshold = 0 if shift is None or not band else _threshold(mag, changed, shift)
    if threshold:
        members = _band(mag, threshold, shift)
        ranks = np.flatnonzero(changed[members])
        rest = np.flatnonzero(changed & (mag >= threshold))
        idx = np.concatenate([members[ranks], rest])
        gaps = np.concatenate([np.diff(ranks, prepend=-1) - 1, np.diff(rest, prepend=-1) - 1])
    else:
        shift, ranks = 0, np.zeros(0, np.int64)
        idx = np.flatnonzero(changed)
        gaps = np.diff(idx, prepend=-1) - 1
    signed = _SIGNED[nb.itemsize]
    diffs = _zigzag(nb.view(signed)[idx] - ob.view(signed)[idx])  # wraps: exact for any bit patterns
    pos, escapes = _gaps(gaps)
    return _zstd(_HEADER.pack(threshold, shift, ranks.size, escapes) + pos + _planes(diffs), SPARSE2_ZSTD_LEVEL)


def _threshold3(mag: np.ndarray, changed_mag: np.ndarray, shift: int) -> int:
    """sparse3's band: the elements of magnitude below the returned threshold (at an exponent
    step), chosen to minimise the estimated bits of the positions (the band's changes at each
    exponent's own rate, as the band is ordered by magnitude; the rest's gaps over the whole
    tensor), within BAND3_MAX_FRACTION of the elements; 0, no band, where it saves under 2 %.
    `changed_mag`: the changed elements' magnitudes. Each exponent's element count is estimated
    from every BAND3_SAMPLE-th element (a threshold needs no more)."""
    step = BAND3_SAMPLE if mag.size >= BAND3_SAMPLE << 12 else 1
    n = np.bincount((mag[::step] >> mag.dtype.type(shift)).astype(np.intp)) * (mag.size / -(-mag.size // step))
    k = np.bincount((changed_mag >> mag.dtype.type(shift)).astype(np.intp))
    size = max(n.size, k.size)
    n, k = np.pad(n, (0, size - n.size)), np.pad(k, (0, size - k.size))
    n = np.maximum(n, k)  # an estimate is never below the changes
    total_n, total_k = mag.size, int(k.sum())
    band = np.concatenate([[0.0], np.cumsum(_bits_needed(n, k))])  # i: the band = exponents < i
    inside_n, inside_k = np.concatenate([[0], np.cumsum(n)]), np.concatenate([[0], np.cumsum(k)])
    cost = band + _bits_needed(np.full(size + 1, total_n), total_k - inside_k)
    cost[inside_n > total_n * BAND3_MAX_FRACTION] = np.inf  # the decoder sorts the band: keep it small
    i = int(np.argmin(cost))
    return i << shift if i and cost[i] < 0.98 * cost[0] else 0


def _sparse3(ob: np.ndarray, nb: np.ndarray, changed: np.ndarray, dtype_name: str) -> bytes:
    shift = _EXP_SHIFT.get(dtype_name)
    mag = _magnitude(ob)
    idx = np.flatnonzero(changed)
    changed_mag = mag[idx]
    threshold = 0 if shift is None else _threshold3(mag, changed_mag, shift)
    if threshold:
        band = np.flatnonzero(mag < threshold)
        band = _by_magnitude(band, mag[band])
        ranks = np.flatnonzero(changed[band])
        rest = idx[changed_mag >= threshold]
        idx = np.concatenate([band[ranks], rest])
    else:
        ranks, rest = np.zeros(0, np.int64), idx
    signed = _SIGNED[nb.itemsize]
    d = nb.view(signed)[idx] - ob.view(signed)[idx]  # wraps: exact for any bit patterns
    neg = d < 0
    steps = np.where(neg, -d, d).view(_UNSIGNED[nb.itemsize]) - 1  # |d| - 1: mostly 0 (one ULP)
    streams = [_gaps(np.diff(ranks, prepend=-1) - 1), _gaps(np.diff(rest, prepend=-1) - 1)]
    frames = [_zstd(g, SPARSE3_ZSTD_LEVEL) for g, _ in streams]  # each its own frame: zstd codes them apart
    tail = _zstd(_planes(steps), SPARSE3_ZSTD_LEVEL)
    return b"".join([_HEADER3.pack(threshold, ranks.size, *(e for _, e in streams), *map(len, frames), len(tail)),
                     *frames, np.packbits(neg).tobytes(), tail])


SPARSE_FORMATS = ("sparse3", "sparse2")  # what `encode` writes; sparse2 for readers older than sparse3


def encode(old: torch.Tensor | None, new: torch.Tensor, *, fmt: str = "sparse3") -> tuple[str, int, bytes]:
    """(encoding, changed elements, payload) of `new` given `old`; the smallest that is exact.
    `fmt`: the sparse format to write, "sparse3" or "sparse2" (the format before, no band: what
    builds before sparse3 read, for a fleet upgraded while the trainer publishes)."""
    nb = bits(new)
    if old is None or old.shape != new.shape or old.dtype != new.dtype or nb.size >= 1 << 32:
        return "raw", nb.size, _zstd(_planes(nb))
    ob = bits(old)
    changed = ob != nb
    n = int(np.count_nonzero(changed))
    if n == 0:
        return "same", 0, b""
    options = []
    if n * 2 < nb.size:  # positions + differences: worth trying while a minority of elements changed
        dtype_name = str(new.dtype).removeprefix("torch.")
        options.append(("sparse2", _sparse2(ob, nb, changed, dtype_name, False)) if fmt == "sparse2"
                       else ("sparse3", _sparse3(ob, nb, changed, dtype_name)))
    if n * 8 > nb.size:  # the dense XOR only pays once changes are no longer rare
        options.append(("xor", _zstd(_planes(ob ^ nb))))
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
        raise DeltaCorrupt(f"the base tensor does not fit the delta ({enc[:20]}, {numel} elements)")
    if enc == "same":
        return base  # read only from here on: no copy
    if enc == "xor":
        planes = _unzstd(payload, numel * itemsize)
        return _xor_planes(base, planes) if inplace else base ^ _unplanes(planes, dtype)
    if enc not in ("sparse", "sparse2", "sparse3"):
        raise DeltaCorrupt(f"unknown delta encoding {enc[:20]!r}")
    if not 0 < count <= numel or numel >= 1 << 32:
        raise DeltaCorrupt(f"sparse delta of {count} elements for a tensor of {numel}")
    out = base if inplace else base.copy()
    if enc == "sparse3":
        return _decode3(out, count, payload, numel, itemsize)
    if enc == "sparse":  # the format before sparse2: uint32 gaps, XORs
        raw = _unzstd(payload, count * (4 + itemsize))
        gaps = _unplanes(memoryview(raw)[:count * 4], np.uint32).astype(np.int64)
        idx = np.cumsum(gaps + 1) - 1
        if idx[-1] >= numel:
            raise DeltaCorrupt("sparse delta writes past the end of the tensor")
        out[idx] ^= _unplanes(memoryview(raw)[count * 4:], dtype)
        return out
    raw = memoryview(_unzstd(payload, (_HEADER.size + count * (1 + itemsize), _HEADER.size + count * (5 + itemsize))))
    threshold, shift, in_band, escapes = _HEADER.unpack_from(raw)
    npos = count + 4 * escapes
    if len(raw) != _HEADER.size + npos + count * itemsize or in_band > count or shift >= 8 * itemsize \
            or threshold >> (8 * itemsize - 1) > 1 or (threshold - 1) >> shift >= 1 << 16 and threshold:
        raise DeltaCorrupt("sparse2 delta: its header does not fit the tensor")
    if not in_band and not escapes:  # the usual case (no band, every gap short): the positions in two passes
        idx = _positions(raw[_HEADER.size:_HEADER.size + count], count, 0)
        if idx[-1] >= numel:
            raise DeltaCorrupt("sparse2 delta writes past the end of the tensor")
        return _add_at(out, idx, raw[_HEADER.size + npos:], itemsize)
    gaps = _ungaps(raw[_HEADER.size:_HEADER.size + npos], count, escapes) + np.uint64(1)
    # every gap + 1 >= 1 and count * (2**32 + 255) < 2**64: the sums below never wrap
    idx = np.empty(count, np.int64)
    if in_band:
        band = _band(_magnitude(out), threshold, shift)
        ranks = np.cumsum(gaps[:in_band]) - np.uint64(1)
        if ranks[-1] >= band.size:
            raise DeltaCorrupt("sparse2 delta ranks past the end of its band")
        idx[:in_band] = band[ranks.astype(np.int64)]
    if in_band < count:
        rest = np.cumsum(gaps[in_band:]) - np.uint64(1)
        if rest[-1] >= numel:
            raise DeltaCorrupt("sparse2 delta writes past the end of the tensor")
        idx[in_band:] = rest.astype(np.int64)
    return _add_at(out, idx, raw[_HEADER.size + npos:], itemsize)


def _decode3(out: np.ndarray, count: int, payload: bytes | memoryview, numel: int, itemsize: int) -> np.ndarray:
    """sparse3: a header, the gaps of the band's changes (ranks in the band, ordered by magnitude)
    and of the rest's (positions in the tensor), a zstd frame each, the signs (a bit each), the
    steps (|difference| - 1, byte planes, a zstd frame)."""
    payload = memoryview(payload)
    if len(payload) < _HEADER3.size:
        raise DeltaCorrupt("sparse3 delta: shorter than its header")
    threshold, in_band, *rest = _HEADER3.unpack_from(payload)
    escapes, lengths = rest[:2], rest[2:]
    sizes = (in_band, count - in_band)
    signs = (count + 7) // 8
    if in_band > count or threshold >> (8 * itemsize - 1) or in_band and not threshold \
            or any(e > n for e, n in zip(escapes, sizes)) or _HEADER3.size + sum(lengths) + signs != len(payload):
        raise DeltaCorrupt("sparse3 delta: its header does not fit the tensor")
    at = _HEADER3.size

    def ranks(i: int, limit: int, what: str) -> np.ndarray:
        """Stream i's positions (in the band, or in the tensor)."""
        nonlocal at
        r = _positions(_unzstd(payload[at:at + lengths[i]], sizes[i] + 4 * escapes[i]), sizes[i], escapes[i])
        at += lengths[i]
        if r.size and r[-1] >= limit:
            raise DeltaCorrupt(f"sparse3 delta points past the end of {what}")
        return r

    idx = np.empty(count, np.int64)
    band = _band3(out, threshold) if in_band else np.zeros(0, np.int64)
    idx[:in_band] = band[ranks(0, band.size, "its band")]
    idx[in_band:] = ranks(1, numel, "the tensor")
    neg = np.unpackbits(np.frombuffer(payload, np.uint8, signs, at), count=count).view(bool)
    d = _unplanes(_unzstd(payload[at + signs:], count * itemsize), _UNSIGNED[itemsize]) + _UNSIGNED[itemsize](1)
    np.negative(d, out=d, where=neg)  # |d| back to d, wrapping
    signed = out.view(_SIGNED[itemsize])
    signed[idx] += d.view(_SIGNED[itemsize])  # wraps; a position named twice (only a hostile payload) fails the SHA-256
    return out


_CHUNK = 1 << 20  # elements per pass of `_band3`, through its thread's scratch buffers
_SCRATCH = threading.local()


def _band3(bits: np.ndarray, threshold: int) -> np.ndarray:
    """The band of the base `bits` (magnitude below `threshold`) ordered by magnitude (stable),
    found in chunks through this thread's scratch buffers, allocated once: no temporary the size
    of the tensor (in a rebuild on a few threads, a freed big buffer is unmapped and faulted in
    again for the next tensor, which cost more than the passes themselves)."""
    u = bits.view(_UNSIGNED[bits.itemsize])
    keep = u.dtype.type((1 << (8 * bits.itemsize - 1)) - 1)
    bufs = getattr(_SCRATCH, "bufs", None) or {}
    if u.dtype not in bufs:
        bufs[u.dtype] = (np.empty(_CHUNK, u.dtype), np.empty(_CHUNK, bool))
        _SCRATCH.bufs = bufs
    mag, below = bufs[u.dtype]
    found: list[np.ndarray] = []
    for lo in range(0, u.size, _CHUNK):
        k = min(_CHUNK, u.size - lo)
        np.bitwise_and(u[lo:lo + k], keep, out=mag[:k])
        np.less(mag[:k], threshold, out=below[:k])
        found.append(np.flatnonzero(below[:k]) + lo)
    members = np.concatenate(found)
    return _by_magnitude(members, u[members] & keep)


def _by_magnitude(members: np.ndarray, magnitudes: np.ndarray) -> np.ndarray:
    """The band's members ordered by their magnitudes (stable): its change rate falls steeply with
    the exponent, so ordered its changes come in runs that cost few bits."""
    return members[np.argsort(magnitudes, kind="stable")]


def _add_at(out: np.ndarray, idx: np.ndarray, planes: memoryview, itemsize: int) -> np.ndarray:
    """Add the zigzagged differences (byte planes) to the bit patterns at `idx`, in place."""
    diffs = _unzigzag(_unplanes(planes, _UNSIGNED[itemsize]))
    signed = out.view(_SIGNED[itemsize])
    signed[idx] += diffs  # wraps; a position named twice (only a hostile payload) fails the SHA-256
    return out
