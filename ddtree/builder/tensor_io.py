"""Bounded-memory tensor IO for the builder: row-range reads from a checkpoint, positional writes.

TensorReader reads a checkpoint tensor, or a range of its rows, with pread into a fresh numpy
array. It never memory-maps a shard: pages a mapping touches count toward the process's resident
memory until the mapping is closed, and a 600 GB checkpoint must stream through a process that
holds a few tensors at a time. Shard headers are parsed by model/safetensors_io.SafetensorsFile;
the checkpoint's own `verify()` has already checked every dtype and shape against the config.

RankFileWriter writes one safetensors file whose header (all names, dtypes, shapes) is known up
front, accepting row blocks of any tensor in any order (`write(name, first_row, block)`), so the
stacked experts [E, ...] of four tensors can be filled expert by expert. Every row is written
exactly once or close() fails naming the tensor; the file appears under its name only when complete.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ddtree.model.safetensors_io import NUMPY_DTYPE, CheckpointError, SafetensorsFile, header_bytes
from ddtree.model.tensors import TensorSpec


class TensorReader:
    """Canonical name -> tensor or row range of a Checkpoint / DrafterCheckpoint, read with pread."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        prefix = getattr(ckpt.config, "tensor_prefix", "")
        self._prefixes = tuple(dict.fromkeys(("", prefix, "model.")))      # stored name = prefix + name
        self._files: dict[Path, tuple[SafetensorsFile, int]] = {}

    def _locate(self, name: str) -> tuple[SafetensorsFile, str, int]:
        path = self.ckpt.shard_of(name)
        if path not in self._files:
            self._files[path] = (SafetensorsFile(path), os.open(path, os.O_RDONLY))
        shard, fd = self._files[path]
        for p in self._prefixes:
            if p + name in shard:
                return shard, p + name, fd
        raise CheckpointError(f"{path}: tensor '{name}' is not in this shard")

    def spec(self, name: str) -> TensorSpec:
        shard, stored, _ = self._locate(name)
        return shard.entries[stored]

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor as stored (bf16 as uint16 bits); a 1-D tensor's elements."""
        shard, stored, fd = self._locate(name)
        spec = shard.entries[stored]
        n = spec.shape[0] if spec.shape else 1
        if not 0 <= start <= stop <= n:
            raise CheckpointError(f"{shard.path}: rows [{start}, {stop}) of tensor '{stored}' are outside 0..{n}")
        row_bytes = spec.nbytes // max(n, 1)
        out = np.empty((stop - start, *spec.shape[1:]), dtype=NUMPY_DTYPE[spec.dtype])
        view = memoryview(out.reshape(-1)).cast("B")
        offset = shard.data_start + shard.offsets[stored][0] + start * row_bytes
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{shard.path}: short read of tensor '{stored}' at byte {offset + done}")
            done += got
        return out if spec.shape else out.reshape(())

    def read(self, name: str) -> np.ndarray:
        spec = self.spec(name)
        return self.rows(name, 0, spec.shape[0] if spec.shape else 1)

    def close(self) -> None:
        for _, fd in self._files.values():
            os.close(fd)
        self._files.clear()


class RankFileWriter:
    """One safetensors file written by row blocks at known offsets (pwrite), complete on close()."""

    def __init__(self, path, specs: dict[str, TensorSpec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.specs = specs
        self.partial = self.path.with_name(self.path.name + ".partial")
        head, self.offsets = header_bytes(specs, {"format": "pt", **(metadata or {})})
        self.data_start = len(head)
        self.size = self.data_start + sum(s.nbytes for s in specs.values())
        self.rows_done = {n: np.zeros(s.shape[0] if s.shape else 1, dtype=bool) for n, s in specs.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, head, 0)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, first_row: int, block: np.ndarray) -> None:
        if name not in self.specs:
            raise CheckpointError(f"{self.path}: tensor '{name}' is not in this file's header")
        spec = self.specs[name]
        block = np.ascontiguousarray(block)
        shape = spec.shape or (1,)
        if block.dtype != NUMPY_DTYPE[spec.dtype] or block.shape[1:] != shape[1:]:
            raise CheckpointError(f"{self.path}: tensor '{name}' is {spec.dtype} {list(spec.shape)}; got a "
                                  f"row block {block.dtype} {list(block.shape)}")
        rows = slice(first_row, first_row + block.shape[0])
        done = self.rows_done[name]
        if first_row < 0 or rows.stop > len(done):
            raise CheckpointError(f"{self.path}: rows [{rows.start}, {rows.stop}) of tensor '{name}' are "
                                  f"outside 0..{len(done)}")
        if done[rows].any():
            raise CheckpointError(f"{self.path}: rows of tensor '{name}' in [{rows.start}, {rows.stop}) "
                                  "were already written")
        row_bytes = spec.nbytes // len(done)
        view = memoryview(block.reshape(-1)).cast("B")
        offset = self.data_start + self.offsets[name] + first_row * row_bytes
        written = 0
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], offset + written)
        done[rows] = True

    def close(self) -> int:
        """Checks that every row of every tensor was written, then renames into place; returns the size."""
        missing = [n for n, d in self.rows_done.items() if not d.all()]
        os.close(self.fd)
        self.fd = -1
        if missing:
            raise CheckpointError(f"{self.path}: tensors not fully written: {missing[:5]}")
        os.replace(self.partial, self.path)
        return self.size

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.partial.unlink(missing_ok=True)
