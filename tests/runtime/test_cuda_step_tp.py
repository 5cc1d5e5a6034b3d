"""CPU checks of the tp > 1 step graphs (runtime/cuda_step_tp.py): which sampling parameters the node kernels take,
which TopPRanks takes (top-p without top-k) and which run the primitives (top-k); that the TreeBuild launcher the
step makes with its `start` is the one the cuda backend's tree_build op launches (the same launcher key), else the
verify would read positions nobody wrote; and
the AR and DDTree bodies of both ranks of a tp 2 model run through the cuda backend on a recording GPU (no device):
every op's shape and dtype checks pass, both ranks launch the same collectives in the same order (the one-shot's
device counter needs it), and the capture pass allocates nothing and launches only on the capture's stream. The
top-p steps (TopPRanks in the graphs): test_cuda_step_tp_top_p.py, on these fakes."""
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree.backends.cuda_backend import CudaOps
from ddtree.backends.cuda_tensor import Tensor
from ddtree.plugins.device import DeviceArray
from ddtree.runtime.cuda_step_tp import GREEDY, GUMBEL, TOP_P, TpSteps, node_sampling
from ddtree.tree.sampling import SamplingParams


@pytest.mark.parametrize("params, mode", [
    (SamplingParams(), GREEDY),
    (SamplingParams(temperature=0.0, top_k=5, top_p=0.5), GREEDY),        # T = 0 ignores the filters
    (SamplingParams(temperature=0.8, seed=3), GUMBEL),
    (SamplingParams(temperature=0.8, top_k=1024), GUMBEL),                  # top_k >= V keeps every token
    (SamplingParams(temperature=0.8, top_p=1.5), GUMBEL),
    (SamplingParams(temperature=0.8, top_k=20), None),
    (SamplingParams(temperature=0.8, top_k=20, top_p=0.9), None),          # top-k and top-p: the primitives
    (SamplingParams(temperature=0.8, top_p=0.95), TOP_P),
    (SamplingParams(temperature=0.8, top_k=1024, top_p=0.95), TOP_P),
    (SamplingParams(temperature=0.0, top_p=0.95), GREEDY),
])
def test_node_sampling(params, mode):
    assert node_sampling(params, 1024) == mode


def test_the_plan_names_are_the_samplers():
    from ddtree.plugins import tree_sample
    assert (GREEDY, GUMBEL, TOP_P) == (tree_sample.GREEDY, tree_sample.GUMBEL, tree_sample.TOP_P)


class RecordingOps:
    """What CudaOps.tree_build touches of self: the launcher it asks for is recorded, nothing launches."""

    def __init__(self):
        self.keys, self.where, self.stream = [], "tree_build", None

    def _dense(self, what, *pairs):
        pass

    def launcher(self, key, make):
        self.keys.append(key)
        return type("Launcher", (), {"run": lambda *a, **k: None})()

    def new(self, shape, dtype):
        return Tensor(0, tuple(shape), np.dtype(dtype), tuple(np.ones(len(shape), int)))


def test_the_tree_launcher_key_is_the_backends():
    tp, D, k, budget = 2, 7, 16, 16

    def t(shape, dtype):
        return Tensor(0, shape, np.dtype(dtype), ())
    ops = RecordingOps()
    CudaOps.tree_build(ops, t((1,), np.int32), t((tp, D, k), np.float32), t((tp, D, k), np.int32),
                       t((tp, D), np.float32), t((tp, D), np.float32), budget)
    steps = TpSteps.__new__(TpSteps)
    steps.tp, steps.gpu = tp, None
    steps.block_pos = type("Buffer", (), {"view": lambda self, offset, shape: ("block_pos", offset, shape)})()
    made = []

    class Ops:
        def launcher(self, key, make):
            made.append(key)
            return type("Launcher", (), {})()
    steps.ops = Ops()
    build = steps._tree_build(D, k, budget)
    assert made == ops.keys and build.start == ("block_pos", 0, (1,))


class RecordingGpu:
    """Addresses and recorded launches (kernel name, stream), no device; downloads are zeros."""
    arch, sm_count, smem_optin, l2_bytes, name = "sm_90", 132, 232448, 60 << 20, "recording GPU"

    def __init__(self, device_id: int = 0):
        self.launches, self.allocations, self.next = [], 0, 0x100000
        self.stream = SimpleNamespace(handle=0, wait=lambda other: None)
        self.dev = SimpleNamespace(set_current=lambda: None,               # eager branches: a side stream
                                   create_stream=lambda: SimpleNamespace(handle=1, wait=lambda other: None))

    def alloc(self, shape, dtype):
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        a = DeviceArray(self, self.next, shape, np.dtype(dtype))
        self.next += -(-max(1, a.nbytes) // 256) * 256
        self.allocations += 1
        return a

    zeros = alloc

    def upload(self, array):
        return self.alloc(np.shape(array), np.asarray(array).dtype)

    def mapped(self, shape, dtype):
        return np.zeros(shape, dtype), self.alloc(shape, dtype).ptr

    def download(self, a):
        return np.zeros(a.shape, a.dtype)

    def copy_in(self, dst, array):
        pass

    def memset(self, a, byte):
        pass

    def sync(self):
        pass

    def copy_d2d(self, dst, src, nbytes, stream=None):
        self.launches.append(("copy", stream))

    def kernel(self, source, name, defines=None, arch=None):
        return name

    def defines(self, source):
        from ddtree.plugins.compile import defines_for
        return defines_for(source, self.arch)

    def allow_smem(self, *args, **kwargs):
        pass

    def launch(self, kernel, grid, block, smem, *args, stream=None, pdl=False, cluster=None):
        self.launches.append((kernel, stream))


class RecordingOneShot:
    """The one-shot all-reduce's calls, in order (ProcessRankMember launches them); with `launches` (the rank's
    RecordingGpu.launches) also among the kernels, as ("all_gather", stream)."""

    def __init__(self, rank: int, nranks: int):
        self.rank, self.nranks, self.calls, self.launches = rank, nranks, [], None

    def __call__(self, x, out, elems, stream=None):
        self.calls.append(("all_reduce", elems))
        if self.launches is not None:
            self.launches.append(("all_reduce", stream))

    def all_gather(self, x, out, nbytes, stream=None):
        self.calls.append(("all_gather", nbytes))
        if self.launches is not None:
            self.launches.append(("all_gather", stream))


@pytest.fixture
def recording_device(monkeypatch):
    import ddtree.plugins.device as device

    class Driver:
        def cuMemGetInfo(self):
            return 0, 100 << 30, 140 << 30

        def cuMemsetD32Async(self, address, word, count, stream):
            return (0,)

    def check(result, what=""):
        _, *values = result
        return values[0] if len(values) == 1 else (tuple(values) or None)
    import ddtree.plugins.kv_cache as kv_cache
    import ddtree.runtime.cuda_executor as cuda_executor
    for module in (device, kv_cache, cuda_executor):     # each imported the driver's functions by name
        monkeypatch.setattr(module, "_driver", lambda: Driver(), raising=False)
        monkeypatch.setattr(module, "check", check, raising=False)
    for module in (device, cuda_executor):
        monkeypatch.setattr(module, "Gpu", RecordingGpu, raising=False)


def ranks_of(preset: str, tp: int):
    """Every rank of a tp `tp` plan of `preset` as CudaExecutors on recording GPUs (zero weights, as
    rank_tensor_specs shapes them), at tp > 1 each with a ProcessRankMember over a recording one-shot."""
    from ddtree.builder.plan import make_plan
    from ddtree.builder.weights import rank_tensor_specs
    from ddtree.description.opset import RankLayout
    from ddtree.model.presets import get_preset
    from ddtree.parallel.cuda_collectives import ProcessRankMember
    from ddtree.runtime.cuda_executor import CudaExecutor
    cfg, dcfg = get_preset(preset)
    plan = make_plan(cfg, dcfg, tp)
    dtypes = {"BF16": np.uint16, "F32": np.float32, "I32": np.int32}
    tensors = {name: np.zeros(spec.shape, dtypes[spec.dtype]) for name, spec in rank_tensor_specs(plan).items()}
    if tp == 1:
        return [CudaExecutor.of_weights(cfg, dcfg, plan.to_dict(), tensors, max_context=256, graphs=True)]
    ranks = []
    for r in range(tp):
        ex = CudaExecutor.of_weights(cfg, dcfg, plan.to_dict(), tensors, rank=r, max_context=256, graphs=True,
                                     collective=ProcessRankMember(RecordingOneShot(r, tp)))
        ex.layouts = [RankLayout.from_plan(plan.to_dict(), q) for q in range(tp)]
        ranks.append(ex)
    return ranks


class CaptureBuilder:
    """A graph builder's split / join (cuda.core GraphBuilder): the branches' builders are the capture's too."""
    is_join_required = False

    def __init__(self, name: str = "capture stream"):
        self.name = name

    def split(self, n: int):
        return (self, *(CaptureBuilder(self.name) for _ in range(n - 1)))

    @staticmethod
    def join(main, *sides):
        return main


def run_bodies(ex, params_list) -> None:
    """Each step body of ex.steps eagerly (it allocates what it needs), then as a capture would record it: it must
    allocate nothing and launch only on the capture's builder or builders split from it (the branches)."""
    steps, ops, gpu = ex.steps, ex.ops, ex.gpu
    b = ex.drafter_config.block_size
    for params in params_list:
        steps.set_params(params)
        for body in (lambda: steps._ddtree_body(16, b), steps._ar_body, lambda: steps._ddtree_body(4, b)):
            body()
            allocations, launched = gpu.allocations, len(gpu.launches)
            ops.stream, ops.capturing = CaptureBuilder(), True
            try:
                body()
            finally:
                ops.stream, ops.capturing = None, False
            assert gpu.allocations == allocations, "the capture pass allocated"
            assert {getattr(stream, "name", stream) for _, stream in gpu.launches[launched:]} == {"capture stream"}


@pytest.mark.parametrize("preset", ["tiny", "small-mla"])
def test_both_ranks_bodies_launch_the_same_collectives_and_capture_without_allocating(recording_device, preset):
    ranks = ranks_of(preset, 2)
    b = ranks[0].drafter_config.block_size
    for ex in ranks:
        steps, ops, gpu = ex.steps, ex.ops, ex.gpu
        assert isinstance(steps, TpSteps) and steps.sampler is None
        run_bodies(ex, (SamplingParams(), SamplingParams(temperature=0.8, seed=3)))
        assert steps.plan.mode == GUMBEL
        build = ops.kernels[("tree_build", 2, b - 1, 16, 16)]
        assert build.start.ptr == steps.block_pos.ptr                    # the verify's positions: start + depth
        kernels = [name for name, _ in gpu.launches]
        assert "node_tree_build" in kernels and "draft_merge" in kernels and "node_accept_walk" in kernels
    calls = [ex.ops.collective.one_shot.calls for ex in ranks]
    assert calls[0] == calls[1] and {kind for kind, _ in calls[0]} == {"all_reduce", "all_gather"}


def test_tp1_bodies_still_capture_without_allocating(recording_device):
    """GpuSteps (tp 1) after the drafter and update phases became methods shared with TpSteps."""
    from ddtree.runtime.cuda_step import GpuSteps
    (ex,) = ranks_of("tiny", 1)
    assert type(ex.steps) is GpuSteps and ex.steps.sampler is not None
    run_bodies(ex, (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=3)))
    kernels = [name for name, _ in ex.gpu.launches]
    assert "draft_topk" in kernels and "sample_kept" in kernels and "step_commit" in kernels


def test_a_step_whose_peer_did_not_answer_hands_on_no_tokens():
    """The one-shot's error bits and NCCL's asynchronous error are read before a graph step's tokens leave the rank
    (TpSteps._answered through ProcessRankMember.check)."""
    from ddtree.parallel.cuda_collectives import ProcessRankMember
    from ddtree.parallel.nccl_group import NcclError
    from ddtree.plugins.allreduce import AllReduceError

    class OneShot:
        rank, nranks, max_bytes = 0, 2, 1 << 20

        def __init__(self, late):
            self.late = late

        def check(self):
            if self.late:
                raise AllReduceError(f"rank(s) {self.late} did not publish")

    class Nccl:
        rank, nranks, code, aborted = 0, 2, 0, False

        def async_error(self):
            return self.code

        def abort(self):
            self.aborted = True
    one, nccl = OneShot([]), Nccl()
    steps = TpSteps.__new__(TpSteps)
    steps.ops = SimpleNamespace(collective=ProcessRankMember(one_shot=one, nccl=nccl, one_shot_max_bytes=4096))
    assert steps._answered([5, 7]) == [5, 7]
    one.late = [1]
    with pytest.raises(AllReduceError, match=r"rank\(s\) \[1\] did not publish"):
        steps._answered([5, 7])
    one.late, nccl.code = [], 5
    with pytest.raises(NcclError, match="asynchronous error 5"):
        steps._answered([5, 7])
    assert nccl.aborted

