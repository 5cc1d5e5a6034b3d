"""The GPU of the kernel tests: one per test module, its allocations freed after the module."""
import pytest


@pytest.fixture(scope="module")
def gpu():
    from ddtree.plugins.device import Gpu
    g = Gpu()
    yield g
    g.free_all()
