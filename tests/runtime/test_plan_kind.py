"""PlanKind (runtime/plan_kind.py), with a stand-in TensorRT context and GPU (host memory, graphs as recorded
closures): a (layer, shapes) key runs eagerly once, is captured on its second call and replayed after, so the
context is enqueued twice per key and never again; replays read the feeds written in place and each layer's own
weights; new shapes make a new key; a stream TensorRT says it cannot capture is refused by name. The stand-in plan computes y = x @ w + cache (cache updated in place)."""
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree.runtime.plan_kind import PlanKind

TRT = SimpleNamespace(TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"))


class Memory:
    """Device memory as host arrays by address."""

    def __init__(self):
        self.blocks, self.next = {}, 4096

    def alloc(self, nbytes: int) -> int:
        address, self.next = self.next, self.next + nbytes + 4096
        self.blocks[address] = np.zeros(nbytes, np.uint8)
        return address

    def view(self, address: int, dtype, shape):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return self.blocks[address][:n].view(dtype).reshape(shape)


class FakeGpu:
    def __init__(self):
        self.mem, self.stream = Memory(), SimpleNamespace(handle=7)
        self.recording = None

    def alloc(self, shape, dtype):
        from ddtree.plugins.device import DeviceArray
        shape = tuple(np.atleast_1d(shape))
        return DeviceArray(self, self.mem.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize), shape, np.dtype(dtype))

    def copy_in(self, dst, array):
        self.mem.blocks[dst.ptr][: array.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)

    def download(self, a):
        return self.mem.view(a.ptr, a.dtype, a.shape).copy()

    def capture(self, fn):
        self.recording = []
        fn(SimpleNamespace(stream=SimpleNamespace(handle=8)))
        graph, self.recording = self.recording, None
        return graph

    def replay(self, graph):
        for launch in graph:
            launch()


class FakeEngine:
    num_io_tensors = 4
    names = ("x", "w", "cache", "y")

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return TRT.TensorIOMode.OUTPUT if name == "y" else TRT.TensorIOMode.INPUT

    def get_tensor_dtype(self, name):
        return SimpleNamespace(name="FLOAT")

    def get_aliased_input_tensor(self, name):
        return None


class FakeContext:
    """y = x @ w + cache, then cache += 1 (in place), on the addresses bound when it is enqueued."""

    def __init__(self, gpu):
        self.gpu, self.shapes, self.addresses, self.enqueued, self.capturable = gpu, {}, {}, 0, True

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)

    def get_tensor_shape(self, name):
        return (self.shapes["x"][0], self.shapes["w"][1])

    def set_tensor_address(self, name, address):
        self.addresses[name] = address

    def update_device_memory_size_for_shapes(self):
        return 64

    def set_device_memory(self, address, nbytes):
        self.memory = address

    def is_stream_capturable(self, handle):
        return self.capturable

    def execute_async_v3(self, handle):
        self.enqueued += 1
        bound, shapes, mem = dict(self.addresses), dict(self.shapes), self.gpu.mem

        def kernel():
            x, w = mem.view(bound["x"], np.float32, shapes["x"]), mem.view(bound["w"], np.float32, shapes["w"])
            cache = mem.view(bound["cache"], np.float32, shapes["cache"])
            mem.view(bound["y"], np.float32, (shapes["x"][0], shapes["w"][1]))[...] = x @ w + cache
            cache += 1
        if self.gpu.recording is not None:
            self.gpu.recording.append(kernel)
        else:
            kernel()
        return True


@pytest.fixture
def kind():
    gpu = FakeGpu()
    ctx = FakeContext(gpu)
    weights = {L: gpu.alloc((4, 3), np.float32) for L in (0, 1)}
    for L, w in weights.items():
        gpu.copy_in(w, np.full((4, 3), L + 1, np.float32))
    return PlanKind(TRT, "layer", FakeEngine(), ctx, gpu), ctx, weights


def test_each_key_is_enqueued_twice_then_replayed_with_new_feeds(kind):
    plan, ctx, weights = kind
    rng = np.random.default_rng(0)
    for step in range(4):
        for L in (0, 1):
            x, cache = rng.standard_normal((2, 4)).astype(np.float32), np.full((2, 3), step, np.float32)
            y = plan.call({"x": x, "cache": cache}, lambda name, L=L: weights[L] if name == "w" else None)["y"]
            np.testing.assert_allclose(y, x @ np.full((4, 3), L + 1, np.float32) + step, rtol=1e-6)
    assert ctx.enqueued == plan.enqueues == 4                        # 2 layers x (eager + capture), then replays
    assert len(plan.graphs) == 2
    x = np.ones((3, 4), np.float32)                                  # a new step shape: a new key
    plan.call({"x": x, "cache": np.zeros((3, 3), np.float32)}, lambda name: weights[0] if name == "w" else None)
    assert ctx.enqueued == 5


def test_a_missing_input_and_an_uncapturable_stream_are_named(kind):
    plan, ctx, weights = kind
    with pytest.raises(KeyError, match="plan layer: input 'w' is neither fed nor one of the rank's tensors"):
        plan.call({"x": np.ones((2, 4), np.float32), "cache": np.zeros((2, 3), np.float32)}, lambda name: None)
    ctx.capturable = False
    feeds = {"x": np.ones((2, 4), np.float32), "cache": np.zeros((2, 3), np.float32)}
    plan.call(feeds, lambda name: weights[0])                       # eager: fine
    with pytest.raises(RuntimeError, match="plan layer: TensorRT-RTX says its stream cannot be captured"):
        plan.call(feeds, lambda name: weights[0])
