"""CPU tests of top-p across ranks on the GPU (kernels/sample_top_p_ranks.cu, plugins/top_p_ranks_gpu.py): the
kernels compile for sm_90 and sm_120 within the static shared memory a block may hold (48 KB, under sm_120's
99 KB), the exchanged record's layout is the launcher's, and the launcher refuses bad arguments by name and, on
a recording GPU and collective, launches the five kernels around three all-gathers of the sizes it states,
without a host sync."""
import re

import numpy as np
import pytest
from test_allreduce import shared_bytes

from ddtree.plugins import compile as kc
from ddtree.plugins import top_p_ranks_gpu as tr
from ddtree.plugins.device import DeviceArray
from ddtree.tree.sampling import SamplingParams

KERNELS = ("topp_ranks_max", "topp_ranks_mass", "topp_ranks_decide", "topp_ranks_scan", "topp_ranks_cut")
TOP_P = SamplingParams(temperature=0.8, top_p=0.9, seed=5)


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_kernels_compile_within_the_static_shared_memory(arch):
    cubin = kc.compile_cubin(tr.SOURCE, arch).read_bytes()
    for name in KERNELS:
        used = shared_bytes(cubin, name)
        assert 0 < used <= 48 * 1024 <= 99 * 1024, (name, used)
    # the crossing bin's keys (32 KB) are the cut's; the scan holds only the warps' queues
    assert shared_bytes(cubin, "topp_ranks_cut") >= 8 * tr.MAX_BIN_KEYS
    assert shared_bytes(cubin, "topp_ranks_scan") < 8 * tr.MAX_BIN_KEYS


def test_the_record_layout_is_the_kernels():
    src = (kc.KERNEL_DIR / tr.SOURCE).read_text()
    assert re.search(r"static_assert\(sizeof\(RankRow\) == 48 \+ 8 \* SP_MAX_BIN_KEYS", src)
    fields = re.search(r"struct RankRow \{(.*?)\};", src, re.S).group(1)
    assert re.findall(r"^\s*(\w+) ", fields, re.M) == ["Winner", "u32", "u32", "u64"]
    assert tr.RECORD_DTYPE.itemsize == 48 + 8 * tr.MAX_BIN_KEYS
    assert [tr.RECORD_DTYPE.fields[f][1] for f in ("above_value", "bin_value", "count", "kept_above", "keys")] == \
        [0, 16, 32, 36, 48]


class RecordingGpu:
    """What the launcher touches of a Gpu: allocations (fake addresses), kernels by name, launches recorded."""
    arch, stream = "sm_90", None

    def __init__(self):
        self.next, self.calls = 1 << 20, []

    def alloc(self, shape, dtype):
        a = DeviceArray(self, self.next, tuple(shape) if isinstance(shape, tuple) else (shape,), np.dtype(dtype))
        self.next += max(a.nbytes, 1) + 256
        return a

    zeros = alloc

    def upload(self, array):
        return self.alloc(array.shape, array.dtype)

    def kernel(self, source, name):
        assert source == tr.SOURCE
        return name

    def launch(self, kernel, grid, block, smem, *args, stream=None, pdl=False):
        self.calls.append(("launch", kernel, grid, block[0]))

    def sync(self):
        raise AssertionError("run() must not sync")


class RecordingCollective:
    def __init__(self, gpu):
        self.gpu = gpu

    def all_gather(self, gpu, x, out, stream=None):
        assert x.contiguous and out.contiguous and out.shape == (4, *x.shape) and out.dtype == x.dtype
        self.gpu.calls.append(("gather", int(np.prod(x.shape)) * x.itemsize, x.ptr, out.ptr))


@pytest.fixture
def recorded(monkeypatch):
    memsets = []

    class Driver:
        def cuMemsetD32Async(self, address, word, count, stream):
            memsets.append((address, word))
            return (0,)
    import ddtree.plugins.device as device
    monkeypatch.setattr(device, "_driver", lambda: Driver())
    monkeypatch.setattr(device, "check", lambda result, what: None)
    gpu = RecordingGpu()
    gpu.stream = type("S", (), {"handle": 0})()
    return gpu, memsets


def test_a_run_is_five_launches_around_three_gathers_of_the_stated_bytes(recorded):
    gpu, memsets = recorded
    V_r, n = 20480, 65
    sampler = tr.TopPRanks(gpu, RecordingCollective(gpu), ranks=4, vocab=4 * V_r, slice_vocab=V_r, max_rows=80)
    logits, pos = gpu.alloc((n, V_r), np.float32), gpu.alloc((n,), np.int32)
    out = sampler.run(logits, 2 * V_r, pos, TOP_P, n)
    S = -(-V_r // tr.SLICE)
    kinds = [c[0] if c[0] == "gather" else c[1] for c in gpu.calls]
    assert kinds == ["topp_ranks_max", "gather", "topp_ranks_mass", "gather", "topp_ranks_decide",
                     "topp_ranks_scan", "gather", "topp_ranks_cut"]
    grids = {c[1]: c[2] for c in gpu.calls if c[0] == "launch"}
    assert grids["topp_ranks_max"] == grids["topp_ranks_mass"] == grids["topp_ranks_scan"] == (S, n, 1)
    assert grids["topp_ranks_decide"] == grids["topp_ranks_cut"] == (n, 1, 1)
    sent = [c[1] for c in gpu.calls if c[0] == "gather"]
    assert sent == list(tr.exchange_bytes(n).values()) == [4 * n, 32768 * n, tr.RECORD_BYTES * n]
    assert len(memsets) == 8 and all(a - sampler.params.ptr in range(0, 32, 4) for a, _ in memsets)
    assert out.tokens.shape == out.flags.shape == (n,)


@pytest.mark.parametrize("kwargs, match", [
    ({"ranks": 1}, r"ranks must be in 2\.\.64"),
    ({"vocab": 0}, r"vocab must be in 1\.\."),
    ({"vocab": 1 << 29}, r"vocab must be in 1\.\.268435456"),
    ({"slice_vocab": 200000}, r"slice_vocab must be in 1\.\.vocab \(163840\)"),
    ({"max_rows": 257}, r"max_rows must be in 1\.\.256"),
    ({"collective": object()}, r"collective needs all_gather")])
def test_constructor_errors_name_the_argument(recorded, kwargs, match):
    gpu, _ = recorded
    args = {"collective": RecordingCollective(gpu), "ranks": 4, "vocab": 163840, "slice_vocab": 40960, **kwargs}
    with pytest.raises(ValueError, match=match):
        tr.TopPRanks(gpu, **args)


@pytest.mark.parametrize("call, match", [
    (lambda g, s: s.run(g.alloc((8, 40960), np.float16), 0, None, TOP_P, 8), r"float32 slice \[>= 8, 40960\]"),
    (lambda g, s: s.run(g.alloc((8, 40961), np.float32), 0, None, TOP_P, 8), r"got float32 \[8, 40961\]"),
    (lambda g, s: s.run(g.alloc((4, 40960), np.float32), 0, None, TOP_P, 8), r"\[>= 8, 40960\]"),
    (lambda g, s: s.run(g.alloc((8, 40960), np.float32), 0, None, TOP_P, 0), r"n 0 must be in 1\.\.16"),
    (lambda g, s: s.run(g.alloc((17, 40960), np.float32), 0, None, TOP_P, 17), r"n 17 must be in 1\.\.16"),
    (lambda g, s: s.run(g.alloc((8, 40960), np.float32), 122881, None, TOP_P, 8), r"offset .* 0\.\.122880"),
    (lambda g, s: s.run(g.alloc((8, 40960), np.float32), -1, None, TOP_P, 8), r"offset .* got -1"),
    (lambda g, s: s.run(g.alloc((8, 40960), np.float32), 1.0, None, TOP_P, 8), r"offset .* an int"),
    (lambda g, s: s.set_params(SamplingParams(temperature=0.0)), r"top-p alone .* \(greedy"),
    (lambda g, s: s.set_params(SamplingParams(temperature=1.0, top_p=0.9, top_k=50)), r"top_k 50 \(top_k"),
    (lambda g, s: s.set_params(SamplingParams(temperature=1.0)), r"top_p 1\.0.*\(gumbel")])
def test_run_errors_name_the_argument_before_any_launch(recorded, call, match):
    gpu, _ = recorded
    sampler = tr.TopPRanks(gpu, RecordingCollective(gpu), ranks=4, vocab=163840, slice_vocab=40960, max_rows=16)
    with pytest.raises(ValueError, match=match):
        call(gpu, sampler)
    assert not gpu.calls
