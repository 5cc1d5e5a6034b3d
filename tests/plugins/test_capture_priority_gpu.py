"""GPU test of Gpu.capture(main_first=True) (plugins/device.py): the kernels launched on the capture's own builder
take the context's greatest stream priority, those on a builder split off it (a parallel branch, as
backends/cuda_branch.py forks them) a lower one, and the graph still computes what the launches compute."""
import numpy as np
import pytest

from ddtree.plugins.randfill import fill_device, hash_u32

pytestmark = pytest.mark.gpu


def test_main_chain_nodes_outrank_branch_nodes(gpu):
    from cuda.bindings import driver
    _, least, greatest = driver.cuCtxGetStreamPriorityRange()
    a, b, c = (gpu.alloc((1024,), np.uint32) for _ in range(3))

    def record(builder):
        fill_device(gpu, a, 1, (0xFFFFFFFF, 0), stream=builder)
        main, side = builder.split(2)
        fill_device(gpu, b, 2, (0xFFFFFFFF, 0), stream=side)          # the branch
        fill_device(gpu, c, 3, (0xFFFFFFFF, 0), stream=main)
        type(main).join(main, side)

    graph = gpu.capture(record, main_first=True)
    assert gpu.capture_priorities == {int(greatest): 2, int(least): 1}, (gpu.capture_priorities, least, greatest)
    for x in (a, b, c):
        gpu.memset(x, 0)
    gpu.replay(graph)
    gpu.sync()
    for x, seed in ((a, 1), (b, 2), (c, 3)):
        np.testing.assert_array_equal(x.numpy(), hash_u32(1024, seed))
