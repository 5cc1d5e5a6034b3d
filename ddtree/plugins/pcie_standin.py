"""A PCIe collective's stand-in on one GPU (kernels/pcie_standin.cu): ddtree bench step --collectives pcie.

    standin = PcieStandin(gpu)
    standin.run(x, out, nbytes, copies=1, hold_us=40.4, blocks=4, stream=s)    # out = copies x x, held hold_us

The product's 8 GPUs sit on PCIe (docs/hardware-and-kernels.md section 4); this one GPU has none of it. A stand-in
moves the bytes a one-shot lands in this rank once through global memory (an all-reduce: x -> out; an all-gather:
x into each of the tp rank slots) on the blocks a one-shot would launch (plugins/allreduce.py's grid for that
size), and holds them until the collective's modelled time (bench/projection.py AllReduceModel: latency + bytes
(tp - 1) / tp / bandwidth) has passed. The step around it then pays what the model says, and work that can run
beside a collective (an L2 prefetch on a side branch) runs beside it for real. Its values are not a sum:
numpy_twin is what it writes.
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.device import Gpu, ptr

SOURCE = "pcie_standin.cu"
THREADS = 256


def numpy_twin(x: np.ndarray, copies: int = 1) -> np.ndarray:
    """What the stand-in writes: copies x x (an all-reduce's stand-in: x itself; an all-gather's: [tp, ...])."""
    return np.stack([x] * copies) if copies > 1 else x.copy()


class PcieStandin:
    def __init__(self, gpu: Gpu):
        self.gpu = gpu
        self.kernel = gpu.kernel(SOURCE, "pcie_standin")

    def run(self, x, out, nbytes: int, copies: int = 1, hold_us: float = 0.0, blocks: int = 1,
            stream=None) -> None:
        """x: nbytes (a multiple of 16, 16-byte aligned; 0: the hold alone); out: copies x nbytes. hold_us: the
        modelled time the launch lasts (>= 0); blocks: the SMs it occupies meanwhile (a one-shot's grid)."""
        if nbytes < 0 or nbytes % 16 or int(ptr(x)) % 16 or int(ptr(out)) % 16:
            raise ValueError(f"PCIe stand-in: {nbytes} B at {int(ptr(x)):#x} -> {int(ptr(out)):#x} must be a "
                             "multiple of 16 bytes, 16-byte aligned")
        if copies < 1 or blocks < 1 or not hold_us >= 0:
            raise ValueError(f"PCIe stand-in: copies {copies} and blocks {blocks} must be >= 1, hold {hold_us} us >= 0")
        self.gpu.launch(self.kernel, int(blocks), THREADS, 0, ptr(x), ptr(out), np.uint64(nbytes // 16),
                        np.uint32(copies), np.uint64(round(hold_us * 1e3)), stream=stream)
