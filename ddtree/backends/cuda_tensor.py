"""The cuda backend's tensor: a device address with a shape, dtype and element strides (backends/cuda_backend.py).

reshape and slice of the op set are views of it (no launch); a kernel that takes a row stride reads
`row_stride`. Host-only: importing it needs no GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


def dense_strides(shape) -> tuple:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= int(d)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Tensor:
    ptr: int
    shape: tuple
    dtype: np.dtype
    strides: tuple                       # in elements
    name: str | None = None              # a weight's rank-file name (its prepared layouts are found by it)
    host: np.ndarray | None = None       # host copy of a small fed input (cache_len, positions, ...)

    @staticmethod
    def of(a, host=None, name=None) -> "Tensor":
        """A DeviceArray (or Tensor) as a dense Tensor."""
        if isinstance(a, Tensor):
            return a if host is None else replace(a, host=host)
        return Tensor(int(a.ptr), tuple(a.shape), np.dtype(a.dtype), dense_strides(a.shape), name, host)

    @property
    def contiguous(self) -> bool:
        return self.strides == dense_strides(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def at(self, offset_elems: int, shape) -> "Tensor":
        """A dense sub-tensor offset_elems into this one (e.g. cache rows from T)."""
        return Tensor(self.ptr + offset_elems * self.itemsize, tuple(shape), self.dtype, dense_strides(shape))

    def row_stride(self, what: str) -> int:
        """[q, D] or [q, n, D] as rows of D with unit inner stride: the element step between rows (raises when
        the rows are not evenly spaced)."""
        if self.strides[-1] != 1 or len(self.shape) not in (2, 3):
            raise ValueError(f"{what}: needs [q, D] or [q, n, D] rows with unit stride, got {self.shape} {self.strides}")
        if len(self.shape) == 2 or self.shape[1] == 1:
            return self.strides[0]
        if self.shape[0] > 1 and self.strides[0] != self.shape[1] * self.strides[1]:
            raise ValueError(f"{what}: strides {self.strides} of {self.shape} are not rows of one stride")
        return self.strides[1]

    def row_groups(self, what: str) -> tuple[int, int, int]:
        """Rows of D as (stride, group, group_stride): groups of `group` rows `stride` apart, the groups
        `group_stride` apart. A [q, n, D] column slice of a wider output (a token's n heads together, the tokens
        further apart: the drafter's q of its q | k | v GEMM) is q groups of n; what row_stride takes is one group."""
        if len(self.shape) == 3 and self.shape[1] > 1 and self.strides[2] == 1 \
                and self.strides[0] != self.shape[1] * self.strides[1]:
            return self.strides[1], self.shape[1], self.strides[0]
        stride = self.row_stride(what)
        return stride, 1, stride

    def token_stride(self, width: int, what: str) -> int:
        """The element step between the tokens of [rows, width] or [rows, n, width / n] whose width values a token
        are dense (a column slice of a wider GEMM output has that output's row stride)."""
        if (self.strides[-1] != 1 or (len(self.shape) == 3 and self.strides[1] != self.shape[2])
                or self.strides[0] < width or int(np.prod(self.shape[1:])) != width):
            raise ValueError(f"{what}: {self.shape} with strides {self.strides} is not rows of {width} dense values")
        return self.strides[0]
