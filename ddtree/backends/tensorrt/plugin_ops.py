"""A plugin's share of the cuda backend: the CudaOps op of its node (backends/cuda_backend.py) on TensorRT's tensors.

    runner = OpRunner(spec, attrs)                                # attach_to_context: no GPU work yet
    runner.prepare(in_dims, in_types, out_dims, out_types)        # on_shape_change: kernels, workspaces
    runner.enqueue(in_dims, in_types, in_ptrs, out_dims, out_ptrs, stream)   # enqueue: launches only (capturable)

prepare runs the node's op once as a *dry pass*: every kernel load and allocation is real, every launch and copy
is skipped, and the tensors are stand-in addresses. So the workspaces, split partials, rope tables and compiled
kernels an op needs at these shapes exist before enqueue, which allocates nothing (an allocation there raises,
naming the op) and never syncs; so shapes must not change while a stream is captured (on_shape_change allocates).
Outputs: an op writes its result into an arena buffer of its op site
(CudaOps.new); prepare notes which site each returned output came from, and enqueue hands TensorRT's output buffer
to that site instead, so the kernel writes in place. An output returned as (a view of) an input, as the identity
collectives at one rank do, is copied into TensorRT's buffer; an in-place cache TensorRT aliased needs nothing.
Per-step scalars (cache_len, accepted_count, temperature, the seed) stay device tensors the kernels read: no
Tensor here carries a host copy, so the cuda backend takes its device paths (attention planned for the cache's
capacity, kv_compact counting on the device).

One Gpu per device and process serves every plugin (its compiled modules and rope tables are shared); each
runner has its own CudaOps (arena) and its own PreparedGpu view of that Gpu.
"""
from __future__ import annotations

import numpy as np

from ddtree.backends.cuda_backend import CudaOps
from ddtree.backends.cuda_tensor import Tensor, dense_strides
from ddtree.description.nodes import NodeSpec, rope_config
from ddtree.description.opset import DraftAttentionSpec, MlaSpec, RankLayout
from ddtree.plugins.device import Gpu, check
from ddtree.plugins.layer_ops import RopeTable

NUMPY_DTYPES = {"bfloat16": np.dtype(np.uint16), "float32": np.dtype(np.float32), "int32": np.dtype(np.int32)}
STAND_IN = 1 << 44                      # dry-pass addresses: STAND_IN * (1 + index), never dereferenced

_GPUS: dict[int, object] = {}
_TABLES: dict[tuple, object] = {}


def device_gpu(device: int):
    """The process's Gpu of `device` (created once)."""
    if device not in _GPUS:
        _GPUS[device] = Gpu(device)
    return _GPUS[device]



def current_device() -> int:
    from cuda.bindings import driver  # cuda: the cuda extra

    return int(check(driver.cuCtxGetDevice(), "cuCtxGetDevice"))


def cuda_stream(handle: int):
    from cuda.core import Stream  # cuda: the cuda extra
    return Stream.from_handle(int(handle))

class PreparedGpu:
    """A Gpu whose launches and copies are skipped while `dry` and whose allocations, uploads and syncs raise while
    `frozen` (inside enqueue). Everything else is the Gpu's."""

    def __init__(self, gpu, what: str):
        self._gpu, self.what = gpu, what
        self.dry = self.frozen = False

    def __getattr__(self, name):
        return getattr(self._gpu, name)

    def _no(self, act: str):
        if self.frozen:
            raise RuntimeError(f"{self.what}: enqueue would {act}; a plugin's enqueue only launches (its workspaces "
                               "are made by on_shape_change for the shapes it is given)")

    def launch(self, *args, **kw) -> None:
        if not self.dry:
            self._gpu.launch(*args, **kw)

    def copy_d2d(self, *args, **kw) -> None:
        if not self.dry:
            self._gpu.copy_d2d(*args, **kw)

    def alloc(self, shape, dtype):
        self._no(f"allocate {shape} {np.dtype(dtype).name}")
        return self._gpu.alloc(shape, dtype)

    def zeros(self, shape, dtype):
        a = self.alloc(shape, dtype)
        self._gpu.memset(a, 0)
        return a

    def upload(self, array):
        self._no(f"upload {np.shape(array)}")
        return self._gpu.upload(array)

    def copy_in(self, dst, array) -> None:
        self._no("copy host data in (a sync)")
        self._gpu.copy_in(dst, array)

    def memset(self, a, byte: int) -> None:
        self._no("memset on its own stream")
        self._gpu.memset(a, byte)

    def sync(self) -> None:
        self._no("synchronise")
        self._gpu.sync()


class PluginStore:
    """What CudaOps asks its weight store for, for plugin ops that hold no weights: the rope tables (one per rope,
    dims and positions in the process, shared by every plugin on the device) and the latent dims."""

    def __init__(self, gpu, latent: tuple[int, int], max_pos: int):
        self.gpu, self.latent, self.max_pos = gpu, latent, max_pos

    def rope_table(self, kind: str, rope, dim: int, factor: float | None = None):
        gpu = getattr(self.gpu, "_gpu", self.gpu)          # the Gpu itself (not a PreparedGpu view)
        key = (gpu.dev.device_id, kind, rope, dim, factor, self.max_pos)
        if key not in _TABLES:
            _TABLES[key] = RopeTable.of(gpu, kind, rope, dim, factor, self.max_pos)
        return _TABLES[key]


def rope_positions(attrs: dict) -> int:
    """Rope table rows for a node's rope: the model's positions (original max x YaRN factor; NaN past them)."""
    return int(attrs["rope_original_max_position"] * max(1.0, attrs["rope_factor"]))


def mla_spec(a: dict) -> MlaSpec:
    """The MLA attention's spec from its node (the nope / value dims belong to the absorbs, not to this op)."""
    return MlaSpec(a["heads"], a["kv_lora_rank"], 0, a["qk_rope_head_dim"], 0, float(a["softmax_scale"]))


def draft_spec(a: dict) -> DraftAttentionSpec:
    return DraftAttentionSpec(a["heads"], a["kv_heads"], a["head_dim"], a["sliding_window"],
                              float(a["attention_factor"]))


def entry_split(width: int) -> tuple[int, int]:
    """A (kv_lora_rank, qk_rope_head_dim) of a latent-cache entry `width` wide, for KvCompact, whose node carries
    only the cache: kv_compact moves whole entries (KV_DK = their sum is all it reads), so any split the latent
    kernels' constraints admit (compile.latent_defines) compiles the same kernel; the widest rope first."""
    for rope in range(min(64, width - 32), 0, -16):
        if rope % 16 == 0 and (width - rope) % 32 == 0:
            return width - rope, rope
    raise ValueError(f"KvCompact: a cache entry of {width} elements is no kv_lora_rank (multiple of 32) + "
                     "qk_rope_head_dim (multiple of 16)")


def kv_compact(ops, x: list) -> tuple:
    ops.store.latent = entry_split(x[0].shape[1])
    return (ops.kv_compact(*x),)


# node -> the CudaOps call on its inputs (in NodeSpec.inputs order); each returns the node's outputs in order
OP_CALLS = {
    "Rope": lambda ops, a, x: (ops.rope(x[0], x[1], rope_config(a)),),
    "KvAppend": lambda ops, a, x: (ops.kv_append(x[2], x[3], x[0], x[1]),),
    "KvCompact": lambda ops, a, x: kv_compact(ops, x),
    "MlaTreeAttention": lambda ops, a, x: (ops.mla_tree_attention(*x, mla_spec(a)),),
    "DraftAttention": lambda ops, a, x: ops.draft_attention(*x, rope_config(a), draft_spec(a)),
    "VocabWinner": lambda ops, a, x: ops.vocab_winner(*x),
    "VocabTopK": lambda ops, a, x: ops.vocab_topk(x[0], a["k"]),
    "TreeBuild": lambda ops, a, x: ops.tree_build(*x, a["budget"]),
    "AcceptWalk": lambda ops, a, x: ops.accept_walk(*x),
}


def layout_of(a: dict) -> RankLayout:
    """The rank layout a node's op reads: its rank, tp and (vocab nodes) its vocab slice."""
    start = a.get("vocab_start", 0)
    return RankLayout(a["rank"], a["world_size"], start, start + a.get("vocab_size", 0), 0, 0, 0, 0)


class PluginOps(CudaOps):
    """CudaOps whose op sites in `outputs` ({arena key: Tensor}) write into the given tensors (TensorRT's outputs)."""

    outputs_at: dict = {}

    def new(self, shape, dtype) -> Tensor:
        k = self.site_key(shape, dtype)
        if k in self.outputs_at:
            self.site += 1
            return self.outputs_at[k]
        return super().new(shape, dtype)


def tensors(dims, types, ptrs) -> list[Tensor]:
    out = []
    for d, t, p in zip(dims, types, ptrs):
        if t not in NUMPY_DTYPES:
            raise ValueError(f"plugin tensor of dtype {t}: the ddtree kernels take {', '.join(NUMPY_DTYPES)}")
        shape = tuple(int(x) for x in d)
        out.append(Tensor(int(p), shape, NUMPY_DTYPES[t], dense_strides(shape)))
    return out


class OpRunner:
    """The cuda backend's op of one plugin node (OP_CALLS), prepared per input shapes and then only launched."""

    def __init__(self, spec: NodeSpec, attrs: dict, device: int | None = None):
        if spec.op not in OP_CALLS:
            raise KeyError(f"ddtree::{spec.op} has no cuda-backend op call here")
        self.spec, self.attrs, self.device = spec, attrs, device
        self.ops = None
        self.prepared: dict[tuple, dict] = {}      # input dims -> {arena key: output index}

    def _make_ops(self):
        device = current_device() if self.device is None else self.device
        gpu = PreparedGpu(device_gpu(device), f"ddtree::{self.spec.op} plugin")
        a = self.attrs
        latent = (a.get("kv_lora_rank", 0), a.get("qk_rope_head_dim", 0))
        max_pos = rope_positions(a) if "rope_factor" in a else 0
        ops = PluginOps(gpu, layout_of(a), PluginStore(gpu, latent, max_pos))
        ops.graph_plans = True                      # plans for the shapes' limits, never a host hint
        return ops

    def _call(self, ins: list[Tensor], stream) -> tuple:
        ops = self.ops
        ops.key, ops.site, ops.stream = (self.spec.op,), 0, stream
        ops.where = f"ddtree::{self.spec.op} plugin on {ops.gpu.name}"
        return tuple(OP_CALLS[self.spec.op](ops, self.attrs, ins))

    def prepare(self, in_dims, in_types, out_dims, out_types) -> None:
        """The dry pass at these shapes (on_shape_change): allocations real, launches skipped."""
        key = tuple(tuple(int(x) for x in d) for d in in_dims)
        if key in self.prepared:
            return
        if self.ops is None:
            self.ops = self._make_ops()
        ins = tensors(in_dims, in_types, [STAND_IN * (1 + i) for i in range(len(in_dims))])
        gpu = self.ops.gpu
        gpu.dry = True
        try:
            results = self._call(ins, None)
        finally:
            gpu.dry = False
        self.prepared[key] = self._output_sites(results)

    def _output_sites(self, results: tuple) -> dict:
        """Which arena buffer (op site) each output was written to; outputs that are views of inputs get none."""
        by_ptr = {int(buf.ptr): k for k, buf in self.ops.arena.items()}
        sites = {}
        for i, r in enumerate(results):
            k = by_ptr.get(int(r.ptr))
            if k is not None and r.contiguous:
                sites[k] = i
        return sites

    def enqueue(self, in_dims, in_types, in_ptrs, out_dims, out_ptrs, stream: int) -> None:
        """Launch the op on TensorRT's buffers, on TensorRT's stream (a cudaStream_t handle)."""
        key = tuple(tuple(int(x) for x in d) for d in in_dims)
        if key not in self.prepared:
            raise RuntimeError(f"ddtree::{self.spec.op} plugin: enqueue with input shapes {list(key)} that "
                               "on_shape_change did not prepare")
        ins = tensors(in_dims, in_types, in_ptrs)
        sites, ops = self.prepared[key], self.ops
        ops.outputs_at = {k: Tensor(int(out_ptrs[i]), k[-2], np.dtype(k[-1]), dense_strides(k[-2]))
                          for k, i in sites.items()}     # TensorRT's output i takes the place of site k's buffer
        ops.capturing, ops.gpu.frozen = True, True
        try:
            results = self._call(ins, cuda_stream(stream))
            for i, r in enumerate(results):
                if int(r.ptr) == int(out_ptrs[i]):
                    continue
                if not r.contiguous:
                    raise RuntimeError(f"ddtree::{self.spec.op} plugin: output {i} is a strided view {r.strides}")
                ops.gpu.copy_d2d(int(out_ptrs[i]), int(r.ptr), int(np.prod(r.shape)) * r.itemsize, stream=stream)
        finally:
            ops.capturing, ops.gpu.frozen, ops.outputs_at = False, False, {}
