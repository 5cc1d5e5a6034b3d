"""Markers: `gpu` and `trt` tests skip themselves when the hardware or wheels are missing."""
import functools
import importlib.util
import os

# small float64 GEMMs of the reference run ~10x faster on one OpenBLAS thread (see ddtree/__init__.py);
# set here too, before any test module imports numpy
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest

from tests.kernel_precompile import Precompile, run_last, wanted

PRECOMPILE = pytest.StashKey[bool]()


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory, request):
    """DDTREE_KERNEL_CACHE for this session: cubins compile once per run, into a temporary folder
    (also seen by ddtree-build subprocesses), never into the user's cache; filled in the background
    (tests/kernel_precompile.py) when the session runs the modules that compile everything."""
    path = tmp_path_factory.mktemp("cubins")
    old = os.environ.get("DDTREE_KERNEL_CACHE")
    os.environ["DDTREE_KERNEL_CACHE"] = str(path)
    background = None
    if request.config.stash.get(PRECOMPILE, False):
        try:
            background = Precompile(path)
        except Exception:          # no loadable NVRTC: the tests that compile say so themselves
            pass
    yield path
    if background is not None:
        background.close()
    if old is None:
        os.environ.pop("DDTREE_KERNEL_CACHE", None)
    else:
        os.environ["DDTREE_KERNEL_CACHE"] = old


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of small tensors: its second OpenMP thread only spins against the other
    processes of a shared 2-core CPU (a greedy continuation measured 13.4 s on 2 threads, 0.5 s on 1). Use it
    with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def gpu_available() -> bool:
    if importlib.util.find_spec("cuda") is None:
        return False
    try:
        from cuda.bindings import driver
        (err,) = driver.cuInit(0)
    except Exception:      # ImportError, or cuda-bindings installed but no driver library (CPU-only CI)
        return False
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    err, count = driver.cuDeviceGetCount()
    return err == driver.CUresult.CUDA_SUCCESS and count > 0


@functools.cache
def trt_available() -> bool:
    return importlib.util.find_spec("tensorrt_rtx_bindings") is not None   # the tensorrt-rtx-cu13-bindings wheel


def pytest_collection_modifyitems(config, items):
    items[:] = run_last(items)
    config.stash[PRECOMPILE] = wanted(items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU and cuda-python")
    skip_trt = pytest.mark.skip(reason="needs the TensorRT-RTX wheels (pip install -e '.[trt]')")
    for item in items:
        if "gpu" in item.keywords and not gpu_available():
            item.add_marker(skip_gpu)
        if "trt" in item.keywords and not trt_available():
            item.add_marker(skip_trt)
