"""GPU, TensorRT's runtime phase without a plan (the H200 cannot run SM120 plans): every ddtree plugin is created
through its creator from the fields a built plan serialised (fixture: tests/backends/trt_plugin_calls.py), attached,
shaped (on_shape_change) and its enqueue run under a global-mode stream capture with the tensor descriptors the
plan passes. The graph is replayed 3 times, the inputs rewritten in place before each (the recorded calls of the
node in three layers or DDTree steps); each replay equals the cuda backend's op on the same inputs bit for bit,
and the node's numpy implementation (onnx.reference, recorded in the fixture) within bf16 / fp32 rounding.
Global capture mode makes any allocation or sync inside enqueue fail the capture."""
import numpy as np
import pytest

from tests.backends.trt_plugin_calls import load

pytestmark = [pytest.mark.gpu, pytest.mark.trt]
META, ARRAYS = load()
NUMPY = {"bfloat16": np.uint16, "float32": np.float32, "int32": np.int32}
# outputs compared with the numpy node within a relative error (bf16 rounding of computed values); others exact
ROUNDED = {("Rope", 0): 1e-2, ("MlaTreeAttention", 0): 2e-2, ("DraftAttention", 0): 2e-2,
           ("DraftAttention", 1): 1e-2, ("MarlinMoE", 0): 2e-2, ("VocabWinner", 0): 1e-6,
           ("VocabTopK", 3): 1e-5}


@pytest.fixture(scope="module")
def trt():
    from ddtree.backends.tensorrt.loader import TrtUnavailable
    try:
        from ddtree.backends.tensorrt import creators
    except TrtUnavailable as e:
        pytest.skip(f"TensorRT-RTX bindings: {e}")
    return creators


@pytest.fixture(scope="module")
def gpu():
    from ddtree.backends.tensorrt.plugin_ops import device_gpu
    from ddtree.plugins.device import Gpu
    g = device_gpu(0)
    assert isinstance(g, Gpu)
    return g


def call(op: str, i: int, io: str) -> list[np.ndarray]:
    m = META[op]
    n = len(m["in_types"] if io == "in" else m["out_types"])
    return [ARRAYS[f"{op}/{i}/{io}{j}"] for j in range(n)]


def bf16_f64(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def close(op: str, j: int, got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    tol = ROUNDED.get((op, j))
    if tol is None:
        np.testing.assert_array_equal(got, want, err_msg=f"{op} output {j}")
        return
    g, w = (bf16_f64(got), bf16_f64(want)) if dtype == "bfloat16" else (got.astype(np.float64), want.astype(np.float64))
    assert np.isfinite(g).all(), f"{op} output {j}: non-finite values"
    rel = np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
    assert rel < tol, f"{op} output {j}: relative error {rel:.2e} (bound {tol})"


def descs(trt, shapes, types):
    names = {"bfloat16": trt.trt.DataType.BF16, "float32": trt.trt.DataType.FLOAT, "int32": trt.trt.DataType.INT32}
    out = []
    for s, t in zip(shapes, types):
        d = trt.trt.PluginTensorDesc()
        d.dims, d.type, d.format = trt.trt.Dims(list(s)), names[t], trt.trt.TensorFormat.LINEAR
        out.append(d)
    return out


def runtime_plugin(trt, op: str):
    """create_plugin(RUNTIME) from the plan's serialised fields, then attach_to_context (as TensorRT does)."""
    from ddtree.backends.tensorrt.fields import NUMPY_OF_KIND
    m = META[op]
    arrays = [(name, np.asarray(values, NUMPY_OF_KIND[kind])) for name, values, kind in m["fields"]]
    fields = trt.trt.PluginFieldCollection([trt.trt.PluginField(name, a, trt.FIELD_TYPES[m_kind])
                                            for (name, a), (_, _, m_kind) in zip(arrays, m["fields"])])
    plugin = trt.register_creators()[op].create_plugin(m["plan_node"], fields, trt.trt.TensorRTPhase.RUNTIME)
    assert plugin.attrs == m["attrs"] and plugin.phase == trt.trt.TensorRTPhase.RUNTIME
    plugin._keep = arrays
    return plugin.attach_to_context(None)


def eager_op(gpu, op: str, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The cuda backend's op on its own copies of the inputs (no capture): the bits the plugin must give."""
    from ddtree.backends.cuda_backend import CudaOps
    from ddtree.backends.cuda_tensor import Tensor
    from ddtree.backends.tensorrt.plugin_ops import OP_CALLS, PluginStore, layout_of, rope_positions
    m = META[op]
    dev = [Tensor.of(gpu.upload(np.ascontiguousarray(a).astype(NUMPY[t]))) for a, t in zip(inputs, m["in_types"])]
    a = m["attrs"]
    if op in ("AllReduce", "AllGather"):
        return [inputs[0].reshape(-1)]
    if op == "MarlinMoE":
        from ddtree.plugins.device import DeviceArray
        from ddtree.plugins.moe import FusedMoE, MoEShape
        shape = MoEShape(a["hidden"], a["inter"], a["experts"], a["topk"], a["n_group"], a["topk_group"],
                         a["routed_scaling_factor"], max_tokens=256)
        w = {k: DeviceArray(gpu, d.ptr, d.shape, d.dtype) for k, d in zip(("gate_up", "gate_up_scale", "down",
                                                                          "down_scale"), dev[3:7])}
        moe = FusedMoE(gpu, shape, w, bias=DeviceArray(gpu, dev[2].ptr, dev[2].shape, dev[2].dtype))
        M, out = dev[0].shape[0], gpu.alloc(dev[0].shape, np.uint16)
        moe.launch_route(dev[1].ptr, M, moe.topk_ids, moe.topk_w, None)
        moe.experts(dev[0].ptr, out.ptr, M, moe.topk_ids, moe.topk_w, dev[7].ptr, None)
        return [out.numpy()]
    latent = (a.get("kv_lora_rank", 0), a.get("qk_rope_head_dim", 0))
    ops = CudaOps(gpu, layout_of(a), PluginStore(gpu, latent, rope_positions(a) if "rope_factor" in a else 0))
    ops.key, ops.site, ops.where = ("eager", op), 0, f"eager {op}"
    results = OP_CALLS[op](ops, a, dev)
    return [ops.host(r) if r.contiguous else None for r in results]


@pytest.mark.parametrize("op", sorted(META))
def test_plugin_enqueue_captured_and_replayed_equals_the_cuda_backend(trt, gpu, op):
    from cuda.bindings import driver

    from ddtree.description.nodes import NODES
    from ddtree.plugins.device import check
    m, spec = META[op], NODES[op]
    if not spec.wired:
        pytest.fail(f"ddtree::{op} is not wired to its kernels (description/nodes.py)")
    first_in, first_out = call(op, 0, "in"), call(op, 0, "out")
    in_d = descs(trt, [a.shape for a in first_in], m["in_types"])
    out_d = descs(trt, [a.shape for a in first_out], m["out_types"])
    plugin = runtime_plugin(trt, op)
    plugin.on_shape_change(in_d, out_d)
    ins = [gpu.alloc(a.shape, NUMPY[t]) for a, t in zip(first_in, m["in_types"])]
    outs = [ins[spec.aliases[j]] if j in spec.aliases else gpu.alloc(a.shape, NUMPY[t])
            for j, (a, t) in enumerate(zip(first_out, m["out_types"]))]   # TensorRT aliases in-place caches
    stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
    for dst, a in zip(ins, first_in):
        gpu.copy_in(dst, a)
    check(driver.cuStreamBeginCapture(stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
          "cuStreamBeginCapture")
    try:
        plugin.enqueue(in_d, out_d, [a.ptr for a in ins], [o.ptr for o in outs], 0, int(stream))
    finally:
        graph = check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
    exe = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    for replay in range(3):
        i = replay % m["calls"]
        inputs, want = call(op, i, "in"), call(op, i, "out")
        for dst, a in zip(ins, inputs):                         # rewritten in place; outputs poisoned
            gpu.copy_in(dst, a)
        for j, o in enumerate(outs):
            if j not in spec.aliases:
                gpu.memset(o, 0xFF)
        gpu.sync()
        check(driver.cuGraphLaunch(exe, stream), "cuGraphLaunch")
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        got = [o.numpy() for o in outs]
        backend = eager_op(gpu, op, inputs)
        for j, (g, w, b, t) in enumerate(zip(got, want, backend, m["out_types"])):
            assert g.shape == w.shape, f"{op} output {j}: {g.shape} vs the node's {w.shape}"
            if b is not None:
                np.testing.assert_array_equal(g.reshape(-1), np.asarray(b).reshape(-1),
                                              err_msg=f"{op} output {j}, replay {replay}: plugin != cuda backend")
            close(op, j, g, w, t)
    check(driver.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
    check(driver.cuGraphDestroy(graph), "cuGraphDestroy")
    check(driver.cuStreamDestroy(stream), "cuStreamDestroy")


def test_enqueue_with_unprepared_shapes_or_an_allocation_fails_clearly(trt, gpu):
    """enqueue at shapes on_shape_change did not see raises before launching; so does an op that would allocate."""
    op = "MlaTreeAttention"
    first_in, first_out = call(op, 0, "in"), call(op, 0, "out")
    m = META[op]
    plugin = runtime_plugin(trt, op)
    plugin.on_shape_change(descs(trt, [a.shape for a in first_in], m["in_types"]),
                           descs(trt, [a.shape for a in first_out], m["out_types"]))
    other = [(a.shape[0] + 1, *a.shape[1:]) if j in (0, 1, 4) else a.shape for j, a in enumerate(first_in)]
    with pytest.raises(RuntimeError, match="on_shape_change did not prepare"):
        plugin.enqueue(descs(trt, other, m["in_types"]), descs(trt, [a.shape for a in first_out], m["out_types"]),
                       [0] * 5, [0], 0, 0)
    runner = plugin.runner
    runner.ops.gpu.frozen = True
    with pytest.raises(RuntimeError, match="enqueue would allocate"):
        runner.ops.gpu.alloc((4,), np.float32)
    runner.ops.gpu.frozen = False
