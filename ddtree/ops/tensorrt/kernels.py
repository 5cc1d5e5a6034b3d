"""What each `ddtree` plugin's enqueue launches: LAUNCHERS, one per wired op (NodeSpec.wired), else a clear error.

    MarlinMoE     the fused W4A16 MoE (plugins/moe.py: moe_route on the graph's fp32 router logits,
                  then moe_gate_up and moe_down, which adds the shared expert's output); not for --experts ep
    AllReduce     world_size 1: a device copy; more ranks need the cross-rank all-reduce (not written)
    AllGather     world_size 1: a device copy (a leading axis of 1); more ranks: the cross-rank all-gather
    others        MissingKernelError naming the kernel and its files (ops/nodes.py: NodeSpec.kernel, kernel_files)
Plain arguments (dims, dtype names, device pointers, a cudaStream_t handle) so a GPU test can call
these without TensorRT; cuda-python is imported only when a kernel is launched. One plan serves
every layer of its kind, so the weights' pointers change from call to call: the launcher keeps its
workspaces (allocated once, for MAX_TOKENS tokens) and takes the tensors of each call.
"""
from __future__ import annotations

import numpy as np

from ddtree.ops.nodes import NodeSpec

MAX_TOKENS = 256
NUMPY_DTYPES = {"bfloat16": np.uint16, "float32": np.float32, "int32": np.int32}


class MissingKernelError(RuntimeError):
    """A plugin was asked to run, but its enqueue does not launch a CUDA kernel for it (yet)."""


def missing(spec: NodeSpec, case: str = "") -> MissingKernelError:
    """The error of a plugin without a launcher (`case` empty), or of a case its launcher does not cover."""
    if case:
        why = f" {case}: its kernel ({spec.kernel}) does not cover it"
    elif spec.kernel_files:
        why = (f": its enqueue does not launch its CUDA kernel yet ({spec.kernel}; "
               f"{', '.join('ddtree/plugins/kernels/' + f for f in spec.kernel_files)})")
    else:
        why = f": its CUDA kernel ({spec.kernel}) is not written yet"
    return MissingKernelError(f"ddtree::{spec.op} plugin cannot run{why}; plans that contain this node build, "
                              "but do not execute")


def current_device() -> int:
    from cuda.bindings import driver

    from ddtree.plugins.device import check
    return int(check(driver.cuCtxGetDevice(), "cuCtxGetDevice"))


def run_node(spec: NodeSpec, attrs: dict, state: dict, in_dims, in_types, in_ptrs, out_ptrs, stream: int) -> None:
    """Launch node `spec` on device tensors (dims: tuples of ints; types: 'bfloat16' | 'float32' | 'int32')."""
    if spec.op not in LAUNCHERS:
        raise missing(spec)
    LAUNCHERS[spec.op](spec, attrs, state, in_dims, in_types, in_ptrs, out_ptrs, stream)


def launch_collective(spec: NodeSpec, attrs: dict, state: dict, in_dims, in_types, in_ptrs, out_ptrs,
                      stream: int) -> None:
    """All-reduce or all-gather of one rank: a device copy of its input (nothing to sum or gather)."""
    if attrs["world_size"] != 1:
        raise missing(spec, f"at world_size {attrs['world_size']}")
    device_copy(out_ptrs[0], in_ptrs[0], int(np.prod(in_dims[0])) * _itemsize(in_types[0]), stream)


def _itemsize(dtype: str) -> int:
    return np.dtype(NUMPY_DTYPES[dtype]).itemsize


def device_copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import driver

    from ddtree.plugins.device import check
    if dst != src and nbytes:
        check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, driver.CUstream(stream)), "cuMemcpyDtoDAsync")


def launch_marlin_moe(spec: NodeSpec, attrs: dict, state: dict, in_dims, in_types, in_ptrs, out_ptrs,
                      stream: int) -> None:
    """y [M, H] bf16 = routed experts (from router logits fp32 [M, E]) + shared [M, H]."""
    if attrs["experts"] != attrs["n_routed_experts"]:
        raise missing(spec, "for expert-parallel placement (--experts ep: the fused MoE kernel indexes a rank's "
                      "experts from 0 and has no skip for the experts of other ranks)")
    want = ("bfloat16", "float32", "float32", "int32", "bfloat16", "int32", "bfloat16", "bfloat16")
    if tuple(in_types) != want:
        raise ValueError(f"ddtree::MarlinMoE plugin: input dtypes {list(in_types)}, the kernel takes {list(want)}")
    M = int(in_dims[0][0])
    if not 1 <= M <= MAX_TOKENS:
        raise ValueError(f"ddtree::MarlinMoE plugin: {M} tokens; the kernel takes 1..{MAX_TOKENS}")
    from cuda.core import Stream

    from ddtree.plugins.device import DeviceArray, Gpu
    from ddtree.plugins.moe import FusedMoE, MoEShape
    keys = ("gate_up", "gate_up_scale", "down", "down_scale")
    if "moe" not in state:
        gpu = Gpu(current_device())
        shape = MoEShape(attrs["hidden"], attrs["inter"], attrs["experts"], attrs["topk"], attrs["n_group"],
                         attrs["topk_group"], attrs["routed_scaling_factor"], max_tokens=MAX_TOKENS)
        weights = {k: DeviceArray(gpu, in_ptrs[3 + i], tuple(in_dims[3 + i]), np.dtype(NUMPY_DTYPES[in_types[3 + i]]))
                   for i, k in enumerate(keys)}
        state["moe"] = FusedMoE(gpu, shape, weights, bias=DeviceArray(gpu, in_ptrs[2], tuple(in_dims[2]),
                                                                      np.dtype(np.float32)))
    moe = state["moe"]
    moe.w = {k: DeviceArray(moe.gpu, in_ptrs[3 + i], tuple(in_dims[3 + i]), np.dtype(NUMPY_DTYPES[in_types[3 + i]]))
             for i, k in enumerate(keys)}                                     # this call's layer
    moe.bias = DeviceArray(moe.gpu, in_ptrs[2], tuple(in_dims[2]), np.dtype(np.float32))
    s = Stream.from_handle(int(stream))
    moe.launch_route(in_ptrs[1], M, moe.topk_ids, moe.topk_w, s)           # routing on the graph's logits
    moe.experts(in_ptrs[0], out_ptrs[0], M, moe.topk_ids, moe.topk_w, in_ptrs[7], s)


# op -> launcher: exactly the ops whose NodeSpec says wired=True (tests/graphs/test_graph_pieces.py checks it)
LAUNCHERS = {"AllReduce": launch_collective, "AllGather": launch_collective, "MarlinMoE": launch_marlin_moe}
