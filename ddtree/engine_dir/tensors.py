"""One rank's tensors, read (and hashed while read) from its safetensors files.

Part of ddtree/engine_dir (the package docstring has the layout).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from ddtree.engine_dir.layout import (
    CONFIG,
    MANIFEST,
    PACKED_SUFFIXES,
    READ_BYTES,
    EngineFormatError,
    rank_dir,
    rank_name,
)
from ddtree.engine_dir.manifest import mismatch
from ddtree.model.bf16 import as_float
from ddtree.model.safetensors_io import NUMPY_DTYPE, SafetensorsFile

STORED, BFLOAT16 = "stored", "bfloat16"


def _converter(convert):
    """convert -> fn(name, safetensors dtype, array as stored) -> array."""
    choice = convert if isinstance(convert, str) else None    # (a numpy dtype == "stored" may raise)
    if choice == STORED:
        return lambda name, dtype, a: a
    if choice == BFLOAT16:                      # for the graphs; ml_dtypes is the `graphs` extra
        import ml_dtypes  # ml_dtypes: the graphs extra
        return lambda name, dtype, a: a.view(ml_dtypes.bfloat16) if dtype == "BF16" else a
    try:
        target = np.dtype(convert) if convert is not None else None      # np.dtype(None) is float64
    except TypeError:
        target = None
    if target is None or target.kind != "f":
        raise ValueError(f"load_rank_tensors: convert={convert!r}: expected {STORED!r}, {BFLOAT16!r} "
                         "or a numpy float dtype")

    def to_float(name, dtype, a):             # dense weights as floats; routed experts stay packed
        if name.endswith(PACKED_SUFFIXES):
            return a
        return as_float(a, target)             # bf16 bits (uint16) exactly, the rest cast
    return to_float


def _read_hashed(path: Path, size: int) -> tuple[bytearray, str]:
    """The whole file in READ_BYTES reads, hashed as it is read: (its bytes, sha256)."""
    buf, h = bytearray(size), hashlib.sha256()
    view = memoryview(buf)
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos: pos + READ_BYTES])
            if not n:
                break
            h.update(view[pos: pos + n])
            pos += n
        if pos != size or f.read(1):
            raise EngineFormatError(f"{path}: changed size while being read ({size} bytes expected)")
    return buf, h.hexdigest()


def load_rank_tensors(root, rank: int, files, convert=STORED, digests: dict | None = None) -> dict[str, np.ndarray]:
    """rank<r>/<files> -> {name: array}. convert: STORED (BF16 as uint16 bits), BFLOAT16 (BF16 as
    ml_dtypes.bfloat16, the graphs' inputs) or a float dtype (every tensor but the routed experts'
    .words/.scales converted, exactly for bf16). digests: {"rank<r>/<file>": {"size", "sha256"}} (from
    check_engine): each file is hashed while it is read (one read) and EngineFormatError names a file whose
    sha256 differs from its manifest entry."""
    fn = _converter(convert)
    out = {}
    for fname in files:
        path = rank_dir(root, rank) / fname
        if not path.is_file():
            raise EngineFormatError(f"{path}: weight file listed in {CONFIG} is missing")
        f = SafetensorsFile(path)
        try:
            rel = f"{rank_name(rank)}/{fname}"
            if digests is None:
                for name, spec in f.entries.items():
                    out[name] = fn(name, spec.dtype, f.read(name))
                continue
            if rel not in digests:
                raise EngineFormatError(f"{path}: weight file not listed in {MANIFEST}")
            buf, actual = _read_hashed(path, digests[rel]["size"])
            if actual != digests[rel]["sha256"]:
                raise EngineFormatError(f"{Path(root)}/{mismatch(rel, actual, {rel: digests[rel]})}")
            for name, spec in f.entries.items():
                begin, _ = f.offsets[name]
                count = int(np.prod(spec.shape, dtype=np.int64))
                a = np.frombuffer(buf, dtype=NUMPY_DTYPE[spec.dtype], count=count, offset=f.data_start + begin)
                out[name] = fn(name, spec.dtype, a.reshape(spec.shape).copy())
        finally:
            f.close()
    return out
