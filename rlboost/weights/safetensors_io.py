"""Safetensors I/O of a verified version directory, zero-copy, never pickle.

A version directory holds `manifest.json` (the stored manifest: its digest names the weights)
and safetensors files: the snapshot's shards (`<sha256>.safetensors`, tensors split into row
blocks joined here by the manifest's parts), or, for a version the cache reconstructed from
deltas, `tensors-<i>.safetensors` files of whole tensors.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

from rlboost.weights.errors import StoreError, VersionUnavailable
from rlboost.weights.manifest import Manifest

if TYPE_CHECKING:
    import torch

__all__ = ["load_tensors", "read_safetensors", "read_header", "header_bytes", "Span", "ITEMSIZE", "whole_tensor_dir",
           "RECONSTRUCTED_GLOB"]

RECONSTRUCTED_GLOB = "tensors-*.safetensors"


def load_tensors(path: str | os.PathLike[str], expect_version: int | None = None) -> dict[str, torch.Tensor]:
    """A verified version directory -> {name: tensor}. For a torch engine:
    `model.load_state_dict(load_tensors(weights_dir, version))`.

    Safetensors only, never pickle. The files are memory-mapped copy-on-write, so the tensors
    share the page cache the fetch just filled (no read, no copy until the engine copies them
    into its parameters), and writing to a tensor never alters the cached file."""
    import torch

    path = Path(path)
    manifest = Manifest.decode((path / "manifest.json").read_bytes())
    if expect_version is not None and manifest.version != expect_version:
        raise VersionUnavailable(f"{path} holds version {manifest.version}, not {expect_version}")
    flat: dict[str, torch.Tensor] = {}
    rebuilt = sorted(path.glob(RECONSTRUCTED_GLOB))
    if not rebuilt:
        for s in manifest.shards:
            flat.update(read_safetensors(path / f"{s.sha256}.safetensors"))
    else:  # reconstructed from deltas by the cache: whole tensors under their own names
        for f in rebuilt:
            flat.update(read_safetensors(f))
    out: dict[str, torch.Tensor] = {}
    for e in manifest.tensors:
        if rebuilt:
            t = flat.get(e.name)
            if t is None:
                raise StoreError(f"tensor {e.name} is missing from {path}")
        else:
            t = flat[e.parts[0].key] if len(e.parts) == 1 else torch.cat([flat[p.key] for p in e.parts])
        if list(t.shape) != e.shape or str(t.dtype).removeprefix("torch.") != e.dtype:
            raise StoreError(f"tensor {e.name}: {t.dtype} {list(t.shape)} does not match the manifest")
        out[e.name] = t
    return out


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
              "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_ST_CODES = {name: code for code, name in _ST_DTYPES.items()}
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1,
            "float8_e5m2": 1}


class Span(NamedTuple):
    """A tensor inside a safetensors file: dtype (torch name), shape, bytes [start, stop) of the file."""

    dtype: str
    shape: list[int]
    start: int
    stop: int


def read_header(f: BinaryIO) -> dict[str, Span]:
    """The tensors of an open safetensors file, each bounds-checked against the file and its byte
    length checked against its dtype and shape (a hostile header names nothing outside the file)."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise StoreError(f"{f.name}: not a safetensors file")
    hlen = int.from_bytes(head, "little")
    if hlen > size - 8:
        raise StoreError(f"{f.name}: safetensors header longer than the file")
    base = 8 + hlen
    out: dict[str, Span] = {}
    try:
        header = json.loads(f.read(hlen))
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = _ST_DTYPES[spec["dtype"]], [int(d) for d in spec["shape"]]
            start, stop = (int(o) for o in spec["data_offsets"])
            if not 0 <= start <= stop <= size - base or min(shape, default=0) < 0 \
                    or stop - start != math.prod(shape) * ITEMSIZE[dtype]:
                raise StoreError(f"{f.name}: tensor {name[:80]!r} outside the file or of the wrong size")
            out[name] = Span(dtype, shape, base + start, base + stop)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreError(f"{f.name}: malformed safetensors header ({type(e).__name__})") from None
    return out


def header_bytes(tensors: list[tuple[str, str, list[int]]]) -> tuple[bytes, list[int]]:
    """The start of a safetensors file holding (name, dtype, shape) tensors in this order, and
    each tensor's offset in the file: the caller writes the data itself (`WeightCache` writes
    each rebuilt tensor straight to its place). Padded as the safetensors library pads it, so
    the data starts 8-byte aligned; a caller orders tensors by falling item size to keep each
    one aligned to its own."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, pos = [], 0
    for name, dtype, shape in tensors:
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": _ST_CODES[dtype], "shape": shape, "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, [8 + len(text) + o for o in offsets]


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Zero-copy safetensors reader: parse the JSON header, map the file privately, view each
    tensor in place (bounds-checked against the file). `safetensors.torch.load_file` copies
    every byte, which halves the end-to-end pull rate."""
    import mmap

    import torch

    with open(path, "rb") as f:
        spans = read_header(f)
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    out: dict[str, torch.Tensor] = {}
    for name, sp in spans.items():
        dtype = getattr(torch, sp.dtype)
        if sp.stop == sp.start:
            out[name] = torch.empty(sp.shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(mm, dtype=dtype, count=(sp.stop - sp.start) // ITEMSIZE[sp.dtype],
                                         offset=sp.start).view(sp.shape)
    return out


@contextlib.contextmanager
def whole_tensor_dir(weights_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """A folder whose safetensors files hold whole tensors under their own names, for an engine
    that reads the files itself (vLLM): `weights_dir` itself — a model folder, a version the
    cache rebuilt from deltas, a snapshot with no split tensor — or, for a snapshot whose
    publisher split big tensors into row blocks (`name@rows<i>`), a temporary folder of the
    joined tensors, deleted on exit."""
    from safetensors.torch import save_file

    path = Path(weights_dir)
    mpath = path / "manifest.json"
    split = (mpath.exists() and not any(path.glob(RECONSTRUCTED_GLOB))
             and any(len(t.parts) > 1 for t in Manifest.decode(mpath.read_bytes()).tensors))
    if not split:
        yield path
        return
    out = Path(tempfile.mkdtemp(prefix="rlboost-whole-weights-"))
    try:
        for i, (name, t) in enumerate(load_tensors(path).items()):  # one file per tensor: bounded memory
            save_file({name: t.contiguous()}, str(out / f"part-{i:05d}.safetensors"))
        yield out
    finally:
        shutil.rmtree(out, ignore_errors=True)
