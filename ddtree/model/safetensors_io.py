"""safetensors files read lazily and written as a stream, with bf16 carried as uint16 bits.

The `safetensors` package's numpy API cannot represent BF16 (numpy has no such dtype), which is
most of a Kimi checkpoint, so this module parses the (simple, documented) format itself:
  u64 little-endian N | N bytes of JSON header (space padded) | data buffer
  header: {name: {"dtype", "shape", "data_offsets": [begin, end)}, "__metadata__": {...}}
Reading memory-maps the file and copies out only the requested tensor. Writing takes the full
list of specs first, writes the header, then tensor bytes in order, so a shard is never whole in
memory. Files written here load with the `safetensors` package (tests check that).
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from ddtree.errors import InputError
from ddtree.model.tensors import TensorSpec

# safetensors dtype -> numpy dtype as we hold it in memory (BF16 as raw uint16 bits)
NUMPY_DTYPE = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
               "I8": np.int8, "U8": np.uint8, "I16": np.int16, "U16": np.uint16, "I32": np.int32,
               "U32": np.uint32, "I64": np.int64, "U64": np.uint64, "BOOL": np.bool_}
MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(InputError):
    """A checkpoint file is missing, corrupt, or disagrees with the index or the config."""


class SafetensorsFile:
    """One .safetensors file: header parsed and validated on open, tensors read on demand."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"{self.path}: shard file not found")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{self.path}: truncated file ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{self.path}: corrupt safetensors header (declares {n} header "
                                      f"bytes, file has {size})")
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + n
        data_len = size - self.data_start
        self.entries: dict[str, TensorSpec] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape, (b, end) = e["dtype"], tuple(int(x) for x in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{self.path}: corrupt header entry for tensor '{name}' ({err})") from err
            if dtype not in NUMPY_DTYPE:
                raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {dtype}")
            spec = TensorSpec(dtype, shape)
            if end - b != spec.nbytes or b < 0:
                raise CheckpointError(f"{self.path}: tensor '{name}' offsets [{b}, {end}) do not hold "
                                      f"{dtype} {list(shape)} ({spec.nbytes} bytes)")
            if end > data_len:
                raise CheckpointError(f"{self.path}: truncated file: tensor '{name}' ends at byte "
                                      f"{self.data_start + end}, file has {size}")
            self.entries[name] = spec
            self.offsets[name] = (b, end)
        self._mm: mmap.mmap | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self):
        return self.entries.keys()

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def read(self, name: str) -> np.ndarray:
        """A copy of one tensor; only its pages of the file are touched."""
        if name not in self.entries:
            raise CheckpointError(f"{self.path}: tensor '{name}' is not in this shard")
        spec = self.entries[name]
        b, _ = self.offsets[name]
        count = int(np.prod(spec.shape, dtype=np.int64))
        arr = np.frombuffer(self._map(), dtype=NUMPY_DTYPE[spec.dtype], count=count,
                            offset=self.data_start + b)
        return arr.reshape(spec.shape).copy()

    def close(self):
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def header_bytes(specs: dict[str, TensorSpec], metadata: dict | None) -> tuple[bytes, dict[str, int]]:
    """u64 length + JSON header (space padded so the data buffer is 8-byte aligned, as safetensors
    does) for tensors laid out in `specs` order, and each tensor's offset in the data buffer."""
    header, offsets, off = {}, {}, 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, s in specs.items():
        header[name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        offsets[name] = off
        off += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offsets


def check_array(name: str, spec: TensorSpec, arr: np.ndarray, where: str) -> np.ndarray:
    want = NUMPY_DTYPE[spec.dtype]
    if arr.dtype != want or tuple(arr.shape) != spec.shape:
        raise CheckpointError(f"{where}: tensor '{name}' expected {spec.dtype} {list(spec.shape)} "
                              f"(numpy {np.dtype(want).name}), got {arr.dtype} {list(arr.shape)}")
    return np.ascontiguousarray(arr)


def write_safetensors(path, specs: dict[str, TensorSpec], chunks: Iterable[tuple[str, np.ndarray]],
                      metadata: dict | None = None) -> int:
    """Stream `chunks` ((name, row block) pairs in `specs` order; a tensor may arrive in several
    consecutive row blocks) into `path`. Returns the file size. Checks every byte is accounted for."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".partial")
    names = list(specs)
    written = {n: 0 for n in names}
    idx = 0
    with open(tmp, "wb") as f:
        f.write(header_bytes(specs, metadata or {"format": "pt"})[0])
        for name, block in chunks:
            while idx < len(names) and written[names[idx]] == specs[names[idx]].nbytes and names[idx] != name:
                idx += 1
            if idx >= len(names) or names[idx] != name:
                raise CheckpointError(f"{path}: tensor '{name}' arrived out of order or is not in the shard")
            spec = specs[name]
            block = np.ascontiguousarray(block)
            if block.dtype != NUMPY_DTYPE[spec.dtype] or tuple(block.shape[1:]) != spec.shape[1:]:
                raise CheckpointError(f"{path}: tensor '{name}' expected {spec.dtype} {list(spec.shape)}, "
                                      f"got a block {block.dtype} {list(block.shape)}")
            if written[name] + block.nbytes > spec.nbytes:
                raise CheckpointError(f"{path}: tensor '{name}' got more rows than its shape {list(spec.shape)}")
            f.write(block.tobytes())
            written[name] += block.nbytes
        missing = [n for n in names if written[n] != specs[n].nbytes]
        if missing:
            raise CheckpointError(f"{path}: tensors not fully written: {missing[:5]}")
    os.replace(tmp, path)
    return path.stat().st_size
