"""What each `ddtree` plugin's enqueue launches: a runner per node (node_runner), the same kernels the `cuda`
backend launches for that op.

    runner = node_runner(spec, attrs)                                  # attach_to_context
    runner.prepare(in_dims, in_types, out_dims, out_types)             # on_shape_change: kernels, workspaces
    runner.enqueue(in_dims, in_types, in_ptrs, out_dims, out_ptrs, stream)   # launches only: capturable

    Rope, KvAppend, KvCompact, MlaTreeAttention, DraftAttention, VocabWinner, VocabTopK, TreeBuild, AcceptWalk
                  the CudaOps op of the node (backends/tensorrt/plugin_ops.py OpRunner: a dry pass at on_shape_change,
                  then launches into TensorRT's buffers)
    MarlinMoE     the fused W4A16 MoE (plugins/moe.py FusedMoE: moe_route on the graph's fp32 router logits, then
                  gate_up and down, which adds the shared expert's output); the node gets the router's logits
                  from the graph, so the fused router of the cuda backend's moe op is not part of it
    AllReduce     world_size 1: a device copy; more ranks: the collective registered for the device
    AllGather     (register_rank_collective: the one-shot all-reduce, NCCL), looked up at on_shape_change and never
                  serialised, as TensorRT-LLM's all-reduce plugin does with its communicator
Dims are tuples of ints, types 'bfloat16' | 'float32' | 'int32', pointers ints, stream a cudaStream_t handle, so a
GPU test can drive a runner without TensorRT; cuda-python is imported only when a kernel is prepared. One plan
serves every layer of its kind: the weights' pointers change from call to call, the workspaces do not.
"""
from __future__ import annotations

import numpy as np

from ddtree.backends.tensorrt.plugin_ops import STAND_IN, OpRunner, PreparedGpu, cuda_stream, current_device, device_gpu
from ddtree.description.nodes import NodeSpec
from ddtree.parallel.rank_collective import RankCollective  # noqa: F401  (what register_rank_collective takes)
from ddtree.plugins.device import DeviceArray, _driver, check
from ddtree.plugins.moe import FusedMoE, MoEShape

MAX_TOKENS = 256
NUMPY_DTYPES = {"bfloat16": np.uint16, "float32": np.float32, "int32": np.int32}
_COLLECTIVES: dict[int, object] = {}


class MissingKernelError(RuntimeError):
    """A plugin was asked to run a case its kernels do not cover."""


def missing(spec: NodeSpec, case: str = "") -> MissingKernelError:
    """The error of a plugin whose enqueue launches nothing yet (`case` empty), or of a case its kernels lack."""
    if case:
        why = f" {case}: its kernel ({spec.kernel}) does not cover it"
    else:
        why = (f": its enqueue does not launch its CUDA kernel yet ({spec.kernel}; "
               f"{', '.join('ddtree/plugins/kernels/' + f for f in spec.kernel_files)})")
    return MissingKernelError(f"ddtree::{spec.op} plugin cannot run{why}; plans that contain this node build, "
                              "but do not execute")


def register_rank_collective(device: int, collective) -> None:
    """The collective the AllReduce / AllGather plugins of `device` use at world_size > 1 (register it before
    deserialising the rank's plans). `collective` has all_reduce(x, out, elems, stream) (bf16, rank-ordered sum)
    and all_gather(x, out, nbytes, stream) (out = every rank's x in rank order): e.g. parallel/rank_collective.py RankCollective."""
    _COLLECTIVES[int(device)] = collective


def _itemsize(dtype: str) -> int:
    return np.dtype(NUMPY_DTYPES[dtype]).itemsize


class CollectiveRunner:
    def __init__(self, spec: NodeSpec, attrs: dict, device: int | None = None):
        self.spec, self.attrs, self.device = spec, attrs, device
        self.collective = None

    def prepare(self, in_dims, in_types, out_dims, out_types) -> None:
        ws = self.attrs["world_size"]
        if ws == 1:
            return
        device = current_device() if self.device is None else self.device
        if device not in _COLLECTIVES:
            raise missing(self.spec, f"at world_size {ws} on GPU {device}: no rank collective is registered for "
                          "it (backends/tensorrt/kernels.py register_rank_collective, before the plans are deserialised)")
        self.collective = _COLLECTIVES[device]

    def enqueue(self, in_dims, in_types, in_ptrs, out_dims, out_ptrs, stream) -> None:
        elems = int(np.prod(in_dims[0]))
        nbytes = elems * _itemsize(in_types[0])
        s = cuda_stream(stream)
        if self.attrs["world_size"] == 1:
            if int(out_ptrs[0]) != int(in_ptrs[0]) and nbytes:
                check(_driver().cuMemcpyDtoDAsync(int(out_ptrs[0]), int(in_ptrs[0]), nbytes, s.handle),
                      "cuMemcpyDtoDAsync")
        elif self.spec.op == "AllReduce":
            if in_types[0] != "bfloat16":
                raise ValueError(f"ddtree::AllReduce plugin: {in_types[0]} partials; the all-reduce sums bf16")
            self.collective.all_reduce(int(in_ptrs[0]), int(out_ptrs[0]), elems, s)
        else:
            self.collective.all_gather(int(in_ptrs[0]), int(out_ptrs[0]), nbytes, s)


class MoERunner:
    """MarlinMoE: FusedMoE made at on_shape_change on stand-in weights of the node's shapes; each enqueue points
    it at that call's layer (its weights, bias) and launches route + gate_up + down."""
    WANT = ("bfloat16", "float32", "float32", "int32", "bfloat16", "int32", "bfloat16", "bfloat16")
    KEYS = ("gate_up", "gate_up_scale", "down", "down_scale")

    def __init__(self, spec: NodeSpec, attrs: dict, device: int | None = None):
        self.spec, self.attrs, self.device = spec, attrs, device
        self.moe, self.prepared = None, set()

    def _layer(self, gpu, in_dims, in_types, in_ptrs) -> tuple[dict, object]:
        weights = {k: DeviceArray(gpu, int(in_ptrs[3 + i]), tuple(in_dims[3 + i]), np.dtype(NUMPY_DTYPES[in_types[3 + i]]))
                   for i, k in enumerate(self.KEYS)}
        return weights, DeviceArray(gpu, int(in_ptrs[2]), tuple(in_dims[2]), np.dtype(np.float32))

    def prepare(self, in_dims, in_types, out_dims, out_types) -> None:
        a = self.attrs
        if a["experts"] != a["n_routed_experts"]:
            raise missing(self.spec, "for expert-parallel placement (--experts ep: the fused MoE kernel indexes a "
                          "rank's experts from 0 and has no skip for the experts of other ranks)")
        if tuple(in_types) != self.WANT:
            raise ValueError(f"ddtree::MarlinMoE plugin: input dtypes {list(in_types)}, the kernel takes "
                             f"{list(self.WANT)}")
        M = int(in_dims[0][0])
        if not 1 <= M <= MAX_TOKENS:
            raise ValueError(f"ddtree::MarlinMoE plugin: {M} tokens; the kernel takes 1..{MAX_TOKENS}")
        key = tuple(tuple(d) for d in in_dims)
        if key in self.prepared:
            return
        stand_in = [STAND_IN * (1 + i) for i in range(8)]
        if self.moe is None:
            gpu = PreparedGpu(device_gpu(current_device() if self.device is None else self.device),
                              "ddtree::MarlinMoE plugin")
            shape = MoEShape(a["hidden"], a["inter"], a["experts"], a["topk"], a["n_group"], a["topk_group"],
                             a["routed_scaling_factor"], max_tokens=MAX_TOKENS)
            weights, bias = self._layer(gpu, in_dims, in_types, stand_in)
            self.moe = FusedMoE(gpu, shape, weights, bias=bias)
        self.moe.gpu.dry = True                           # kernels loaded, shared memory set, nothing launched
        try:
            self._launch(in_dims, in_types, stand_in, stand_in[:1], None)
        finally:
            self.moe.gpu.dry = False
        self.prepared.add(key)

    def _launch(self, in_dims, in_types, in_ptrs, out_ptrs, stream) -> None:
        moe, M = self.moe, int(in_dims[0][0])
        moe.w, moe.bias = self._layer(moe.gpu, in_dims, in_types, in_ptrs)     # this call's layer
        moe.launch_route(int(in_ptrs[1]), M, moe.topk_ids, moe.topk_w, stream)  # routing on the graph's logits
        moe.experts(int(in_ptrs[0]), int(out_ptrs[0]), M, moe.topk_ids, moe.topk_w, int(in_ptrs[7]), stream)

    def enqueue(self, in_dims, in_types, in_ptrs, out_dims, out_ptrs, stream) -> None:
        if tuple(tuple(d) for d in in_dims) not in self.prepared:
            raise RuntimeError(f"ddtree::MarlinMoE plugin: enqueue with input shapes {list(in_dims)} that "
                               "on_shape_change did not prepare")
        self.moe.gpu.frozen = True
        try:
            self._launch(in_dims, in_types, in_ptrs, out_ptrs, cuda_stream(stream))
        finally:
            self.moe.gpu.frozen = False


def node_runner(spec: NodeSpec, attrs: dict, device: int | None = None):
    """The runner of one plugin instance (device None: the current CUDA device at on_shape_change)."""
    if not spec.wired:
        raise missing(spec)
    if spec.op in ("AllReduce", "AllGather"):
        return CollectiveRunner(spec, attrs, device)
    if spec.op == "MarlinMoE":
        return MoERunner(spec, attrs, device)
    return OpRunner(spec, attrs, device)
