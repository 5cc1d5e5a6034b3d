"""GPU: what the MarlinMoE and AllReduce plugins' enqueue launches (backends/tensorrt/kernels.py runners, prepared and
then called with device pointers and a stream as TensorRT would) equals the ddtree nodes' numpy implementations run
by onnx.reference on the same inputs. No TensorRT needed (plans themselves run only on SM120)."""
import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from ddtree.backends.onnx_nodes import ops_for
from ddtree.backends.tensorrt.kernels import node_runner
from ddtree.description.nodes import DOMAIN, NODES
from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.model.int4 import pack_int4, quantize_int4
from ddtree.plugins import layout

pytestmark = pytest.mark.gpu
H, I, E, TOPK = 256, 128, 8, 2
ATTRS = {"rank": 0, "world_size": 1, "hidden": H, "inter": I, "experts": E, "n_routed_experts": E,
         "expert_start": 0, "topk": TOPK, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
         "group_size": 32}


@pytest.fixture(scope="module")
def gpu():
    from ddtree.plugins.device import Gpu
    g = Gpu()
    yield g
    g.free_all()


def experts(rng) -> dict[str, np.ndarray]:
    """E random INT4 experts (compressed-tensors) -> stacked kernel layout."""
    def int4(n, k):
        q, s = quantize_int4(rng.standard_normal((n, k)) * 0.05, 32)
        return pack_int4(q), s, np.array([n, k])
    return layout.repack_experts([(int4(I, H), int4(I, H), int4(H, I)) for _ in range(E)])


def numpy_moe(inputs: list[np.ndarray], attrs: dict) -> np.ndarray:
    """The MarlinMoE node alone in an ONNX graph, run by onnx.reference."""
    types = [TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.INT32, TensorProto.BFLOAT16,
             TensorProto.INT32, TensorProto.BFLOAT16, TensorProto.FLOAT]
    names = [f"in{i}" for i in range(8)]
    graph = helper.make_graph(
        [helper.make_node("MarlinMoE", names, ["y"], domain=DOMAIN, **attrs)], "moe",
        [helper.make_tensor_value_info(n, t, a.shape) for n, t, a in zip(names, types, inputs)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, inputs[0].shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)])
    feeds = {n: (a.view(ml_dtypes.bfloat16) if t == TensorProto.BFLOAT16 else a)
             for n, t, a in zip(names, types, inputs)}
    return ReferenceEvaluator(model, new_ops=ops_for(None)).run(None, feeds)[0]


@pytest.mark.parametrize("M", [1, 5, 64])
def test_marlin_moe_plugin_launch_equals_the_node(gpu, M):
    rng = np.random.default_rng(M)
    packed = experts(rng)
    x = f32_to_bf16(rng.standard_normal((M, H)).astype(np.float32))
    logits = (rng.standard_normal((M, E)) * 2).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    shared = f32_to_bf16(rng.standard_normal((M, H)).astype(np.float32) * 0.1)
    host = [x, logits, bias, packed["gate_up"], packed["gate_up_scale"], packed["down"], packed["down_scale"], shared]
    dev = [gpu.upload(a) for a in host]
    out = gpu.alloc((M, H), np.uint16)
    gpu.memset(out, 0xFF)                                              # NaN: an unwritten row fails
    types = ["bfloat16", "float32", "float32", "int32", "bfloat16", "int32", "bfloat16", "bfloat16"]
    stream = int(gpu.stream.handle)
    runner = node_runner(NODES["MarlinMoE"], ATTRS, device=0)
    dims = [a.shape for a in host]
    runner.prepare(dims, types, [(M, H)], ["bfloat16"])
    runner.enqueue(dims, types, [d.ptr for d in dev], [(M, H)], [out.ptr], stream)
    got = bf16_to_f32(out.numpy()).astype(np.float64)
    want = numpy_moe([bf16_to_f32(x), logits, bias, *host[3:7], bf16_to_f32(shared)], ATTRS).astype(np.float64)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < 1e-2, f"relative error {rel:.2e}"


@pytest.mark.parametrize("op", ["AllReduce", "AllGather"])
def test_collective_plugins_at_one_rank_copy(gpu, op):
    x = np.arange(24, dtype=np.uint16).reshape(4, 6)
    src, dst = gpu.upload(x), gpu.zeros((4, 6), np.uint16)
    runner = node_runner(NODES[op], {"rank": 0, "world_size": 1}, device=0)
    runner.prepare([x.shape], ["bfloat16"], [x.shape], ["bfloat16"])
    runner.enqueue([x.shape], ["bfloat16"], [src.ptr], [x.shape], [dst.ptr], int(gpu.stream.handle))
    gpu.sync()
    np.testing.assert_array_equal(dst.numpy(), x)
