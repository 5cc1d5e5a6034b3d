"""The PCIe stand-in (plugins/pcie_standin.py, kernels/pcie_standin.cu) against its two references: what it writes
is numpy_twin (x, or copies of it in rank slots), and a lone stand-in lasts the modelled time of the collective it
stands for (bench/projection.py's one-shot fit for 8x RTX PRO 6000) within 10 %, timed as the mean of a graph of
back-to-back launches (the step's own situation: captured, one after another)."""
import statistics

import numpy as np
import pytest

from ddtree.bench.projection import ONE_SHOT
from ddtree.plugins.allreduce import grid_for
from ddtree.plugins.pcie_standin import PcieStandin, numpy_twin

pytestmark = pytest.mark.gpu
TP, H = 8, 7168


@pytest.mark.parametrize("rows, copies", [(1, 1), (9, 1), (17, 8)])
def test_it_writes_what_its_twin_says(gpu, rows, copies):
    rng = np.random.default_rng(rows)
    x = rng.integers(0, 2**16, size=(rows, H), dtype=np.uint16)               # bf16 bits, any pattern
    dx = gpu.upload(x)
    out = gpu.upload(np.full((copies, rows, H), 0xDEAD, np.uint16))          # poisoned: every element written
    PcieStandin(gpu).run(dx, out, x.nbytes, copies, hold_us=5.0, blocks=grid_for(x.size)[0])
    gpu.sync()
    np.testing.assert_array_equal(out.numpy().reshape(copies, rows, H), numpy_twin(x, copies).reshape(copies, rows, H))


@pytest.mark.parametrize("rows", [1, 9, 17, 65])
def test_a_lone_standin_lasts_its_modelled_time(gpu, rows):
    nbytes = rows * H * 2
    hold = ONE_SHOT.us(nbytes, TP)                                            # 11.6 us (1 row) .. 242 us (65)
    x, out = gpu.alloc((rows, H), np.uint16), gpu.alloc((rows, H), np.uint16)
    standin, n = PcieStandin(gpu), 20
    blocks = grid_for(rows * H)[0]

    def launches(stream):
        for _ in range(n):
            standin.run(x, out, nbytes, 1, hold, blocks, stream=stream)
    graph = gpu.capture(launches)
    gpu.replay(graph)
    each = statistics.median(gpu.timed_ms(lambda: gpu.replay(graph), 7)) * 1e3 / n
    assert each == pytest.approx(hold, rel=0.10), f"{rows} rows: {each:.2f} us a stand-in against {hold:.2f} modelled"


def test_bad_sizes_are_refused(gpu):
    x = gpu.alloc((16,), np.uint8)
    with pytest.raises(ValueError, match="multiple of 16"):
        PcieStandin(gpu).run(x, x, 10, hold_us=1.0)
    with pytest.raises(ValueError, match=">= 1"):
        PcieStandin(gpu).run(x, x, 16, copies=0, hold_us=1.0)
