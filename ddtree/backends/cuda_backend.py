"""The cuda backend: the op set (description/opset.py) on one GPU with the kernels of ddtree/plugins.

    ops = CudaOps(gpu, lay, store)                      # store: the rank's weights on the device (CudaWeights)
    out = ops.call(layers.decoder_layer, cfg, L, inter, feeds={"h": h, ...}, arena=L % 2)   # {name: Tensor}

A tensor is a `Tensor`: a device address, shape, dtype and element strides, so reshape and slice are views
(no launch); an op whose kernel cannot take the strides it is given raises (or copies, where it says so).
Outputs are written into an arena: buffers allocated on first use per (layer function, arena, op site,
shape, dtype) and reused by every later call with the same shapes, so a second call allocates nothing (what
CUDA graph capture needs). `arena` lets the caller alternate two arenas between consecutive layers, so a
layer never writes over the output of the layer before it (its input). Feeds are Tensors / DeviceArrays
(bound as they are) or small numpy arrays (uploaded into a per-name buffer; their host copy is kept for the
host-side uses listed in LAUNCHERS). Activations (ACT) are bf16 bits (uint16), ACC is float32.

tp 1: all_reduce / all_gather are the identity and all_reduce_add_rms_norm is add + RMSNorm; at tp > 1 they go
through the rank's `collective` (parallel/cuda_collectives.py), or, with standin=True (ddtree bench step), move their
bytes once on this GPU without summing anything, and without either they raise naming what is missing. The sampling and tree ops launch the node kernels of
plugins/vocab_nodes.py at any tp (per-rank winners / top-k, then the gathered merge, on the device, no host
round trip; the TensorRT plugins launch the same): at tp 1 the GPU step (runtime/cuda_step.py) runs the heads
without them (layers.head_logits, draft_logits) and fuses vocab_topk + tree_build (plugins/tree_build.py) and
vocab_winner + accept_walk (plugins/tree_sample.py) in their kernels. The pruning ops (moe_live, tree_prune,
accept_walk_live; issue 53): backends/cuda_prune.py PRUNE_LAUNCHERS.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ddtree.backends.cuda_branch import BranchOps
from ddtree.backends.cuda_cache import CacheOps
from ddtree.backends.cuda_moe import MoeOps
from ddtree.backends.cuda_prune import PruneOps
from ddtree.backends.cuda_requests import RequestOps
from ddtree.backends.cuda_tensor import Tensor, dense_strides
from ddtree.backends.cuda_vocab import VocabOps
from ddtree.description.opset import ACC, ACT, F32, I32, OP_NAMES, PATTERNS, REQUEST_OPS, Ops, RankLayout
from ddtree.parallel.cuda_collectives import CollectiveOps
from ddtree.plugins.device import DeviceArray
from ddtree.plugins.draft_attention import DraftAttention
from ddtree.plugins.gemm import SkinnyGemm
from ddtree.plugins.layer_ops import LayerOps
from ddtree.plugins.mla_absorb import MlaAbsorb
from ddtree.plugins.mla_attention import MlaTreeAttention
from ddtree.plugins.mla_invariant import MlaInvariantAttention

DTYPES = {ACT: np.dtype(np.uint16), ACC: np.dtype(np.float32), I32: np.dtype(np.int32), F32: np.dtype(np.float32)}
MAX_TOKENS = 256                       # rows of one call: the GEMM / MoE / absorb kernels' limit
# "fast": each kernel's split plan follows the row count (a verify row's sums run in another order than the
# one-token decode's: DDTree departs from AR only at near-ties, runtime/near_tie.py). "batch-invariant": one plan
# for every row count and the position-ordered attention, so DDTree == AR bitwise (slower; docs/interfaces.md 6).
KERNEL_PLANS = ("fast", "batch-invariant")

# op -> how it is implemented here
LAUNCHERS = {
    "input": "a Tensor bound per call (numpy feeds uploaded into a per-name buffer, host copy kept)",
    "weight": "CudaWeights: the rank's tensor as stored, or only its kernel layout (tile_bf16, W_UK^T)",
    "output": "the Tensor itself (the caller downloads what it needs)",
    "shape": "Tensor.shape",
    "reshape": "a view (contiguous, or row-strided with dense rows)", "slice": "a strided view",
    "cast": "identity between equal dtypes (ACC and F32 are both float32); F32 -> ACT plugins/layer_ops.py "
            "LayerOps.cast_f32_bf16; other pairs raise",
    "add": "plugins/layer_ops.py LayerOps.add (add_rows: one pass into a new tensor; the GEMM-epilogue fusion is "
           "missing)",
    "rms_norm": "plugins/layer_ops.py LayerOps.rms_norm (rows, strided; [m, n, d] as m n rows of d)",
    "all_reduce_add_rms_norm": "plugins/layer_ops.py LayerOps.add_rms_norm from h into a new h (h_in), after "
                               "all_reduce at tp > 1",
    "linear": "plugins/gemm.py SkinnyGemm.run (weight tiled once at load by plugins/layout.tile_bf16)",
    "swiglu_mlp": "plugins/gemm.py SkinnyGemm.run twice: [gate; up] interleaved per 8 rows and tiled once, the "
                  "SwiGLU in that GEMM's epilogue (swiglu=True), then down",
    "embed": "plugins/layer_ops.py LayerOps.embed",
    "rope": "plugins/layer_ops.py LayerOps.rope_interleaved from the strided view into a dense copy, one pass "
            "(RopeTable.interleaved: cos/sin built in float64)",
    "kv_append": "the kv_append kernel of plugins/kv_cache.py on the op's cache and cache_len",
    "kv_append_normed": "one kv_append_normed kernel (plugins/kv_cache.py): RMSNorm of c_kv, rope of k_pe and the "
                        "append, the bits of rms_norm + rope + kv_append",
    "kv_compact": "the kv_compact kernel of plugins/kv_cache.py (one layer; its count from the host copy, or read "
                  "on the device when the count is a device tensor: the captured step)",
    "mla_absorb_q": "plugins/mla_absorb.py MlaAbsorb.q (q_nope read inside q_all; W_UK^T prepared at load)",
    "mla_absorb_q_rope": "plugins/mla_absorb.py MlaAbsorb.q_rope: absorb_q and the rope of q_pe in one launch (the "
                         "bits of mla_absorb_q + rope)",
    "mla_tree_attention": "plugins/mla_attention.py MlaTreeAttention.run",
    "kv_append_requests": "backends/cuda_requests.py: one kv_append launch per request (its rows, cache and length; "
                          "the row offsets from their host copy)",
    "mla_tree_attention_requests": "backends/cuda_requests.py: one tree attention launch per request, in order on the "
                                   "stream, each on its rows, cache, length and own mask, into its rows of one output",
    "mla_absorb_out": "plugins/mla_absorb.py MlaAbsorb.out (kv_b as stored)",
    "moe": "backends/cuda_moe.py: plugins/moe.py FusedMoE route + experts (router tiled at load; the shared expert by "
           "swiglu_mlp on a parallel branch beside the router, added in down; with a given routing: the router "
           "GEMM, then the route kernel aligns the given ids: route_given)",
    "draft_attention": "the context rows roped at cache_len + i (LayerOps.positions_from, rope_rotate_half) and "
                       "written at cache_len (LayerOps.rows_at; cache_len read on the device), q / k roped into "
                       "dense copies (one pass each), then plugins/draft_attention.py DraftAttention.run",
    "all_reduce": "identity at tp 1; tp > 1: the rank's collective (parallel/cuda_collectives.py: ranks as threads, "
                  "allreduce_sum_local; rank processes, ProcessRankMember: the one-shot over CUDA IPC, capturable) "
                  "or a stand-in (bench step)",
    "all_gather": "a [1, ...] view at tp 1; tp > 1: the rank's collective (copies in rank order) or a stand-in",
    "vocab_winner": "plugins/vocab_nodes.py VocabWinner (kernels/sample.cu node_vocab_winner: greedy or Gumbel "
                    "by the temperature on the device)",
    "vocab_topk": "plugins/vocab_nodes.py VocabTopK (kernels/tree_build.cu node_vocab_topk)",
    "tree_build": "plugins/vocab_nodes.py TreeBuild (kernels/tree_build.cu node_tree_build: the ranks' normaliser, "
                  "merge and best-first build)",
    "accept_walk": "plugins/vocab_nodes.py AcceptWalk (kernels/sample.cu node_accept_walk: the ranks' winners "
                   "merged, then the walk)",
}
if set(LAUNCHERS) != set(OP_NAMES) | set(PATTERNS) | set(REQUEST_OPS):
    raise ImportError(f"backends/cuda_backend.py: LAUNCHERS "
                      f"{sorted(set(LAUNCHERS) ^ (set(OP_NAMES) | set(PATTERNS) | set(REQUEST_OPS)))} "
                      "differ from the op set, its patterns and its request ops")


class CudaOps(BranchOps, CacheOps, CollectiveOps, MoeOps, PruneOps, RequestOps, VocabOps, Ops):
    """One rank's ops on one GPU (tp 1). `store`: CudaWeights of the rank (runtime/cuda_executor.py)."""

    def __init__(self, gpu, lay: RankLayout, store, max_tokens: int = MAX_TOKENS, collective=None,
                 kernel_plan: str = "fast"):
        """collective: at tp > 1, this rank's member of a GPU collective (parallel/cuda_collectives.py:
        all_reduce(gpu, x, out, stream), all_gather(...)), which the all-reduces and all-gathers go through
        (captured only when it is `capturable`: the rank processes' one-shot, not the threads' host barriers; ddtree
        bench step's stand-ins, bench/bench_ops.py, move the bytes once on this GPU). kernel_plan: "fast" (plans by row count)
        or "batch-invariant" (KERNEL_PLANS: every GEMM, absorb and MoE split fixed for all row counts, and the
        position-ordered attention of plugins/mla_invariant.py, so a verify row is bitwise the decode's)."""
        if kernel_plan not in KERNEL_PLANS:
            raise ValueError(f"cuda backend: kernel plan {kernel_plan!r}; choose from {', '.join(KERNEL_PLANS)}")
        self.gpu, self.lay, self.store, self.max_tokens = gpu, lay, store, max_tokens
        self.collective = collective
        self.invariant = kernel_plan == "batch-invariant"
        self.tag = ""                       # a collective's launch tag (bench attribution), "" elsewhere
        self.k = LayerOps(gpu)
        self.arena: dict[tuple, object] = {}
        self.bound: dict[tuple, object] = {}               # (name, shape, dtype) -> upload buffer
        self.kernels: dict[tuple, object] = {}             # launcher objects by their shapes
        self.iota = gpu.upload(np.arange(max_tokens * 128, dtype=np.int32))     # rows for gather copies
        self.feeds, self.outputs, self.where, self.site, self.key = {}, {}, "", 0, ()
        self.calls = 0                      # layer-function calls so far (a prefetch joins at the end of the next)
        self.stream = None                  # None: the GPU's stream; a graph builder while capturing
        self.capturing = False              # recording a graph: no uploads, no allocations
        self.graph_plans = False            # the plans a captured graph needs (attention for max_context)
        self.branches = True                # parallel branches where ops are independent (backends/cuda_branch.py)
        self.lane = 0                       # the branch launching now (0: the main chain)
        self.moe_down_cols = None           # FusedMoE(down_cols=): None the measured range; True wherever it fits
        self.moe_down_prefetch = 0          # FusedMoE(down_prefetch=): gate_up asks L2 for the down weights when its
                                            # launch has at most this many tiles (0: never)
        self.main_first = False             # captured graphs: the main chain's kernels at the greatest stream
                                            # priority, the branches' at the lowest (Gpu.capture main_first)
        self.shared_fork = "routed"         # where the MoE's shared-expert branch forks: after the routing, beside
                                            # the routed gate_up (H100: AR -6.6 %, budget 8 tree -2.5 %), or
                                            # "router": beside the router (backends/cuda_moe.py)
        self.shared_join = "down"           # where it joins: before the down launch, or "experts": before the
                                            # experts' launch (only with shared_fork "router")
        self.prefetch_next = True            # the next layer's attention weights staged in L2 ...
        self.prefetch_next_beside = "collective"    # ... beside the MLP all-reduce (PCIe: tens of us the HBM idles)
                                                    # or "experts": beside the routed experts (ops.prefetch)
        self.prefetch_chunk = None                      # bytes one prefetch thread asks for: None by the call's
                                                        # rows (plugins/prefetch.py chunk_for), every call's (an
                                                        # int), or {site: bytes} per prefetch site
        self.chain_norms = True             # a layer's closing add and the next layer's input norm as one launch
                                            # (description/layers.py chained_norms; the stack's layers: cuda_model.py)
        self.prefetch_bytes = gpu.l2_bytes // 3         # ops.prefetch's L2 budget a call (0: none), or {site:
                                                        # bytes} (plugins/prefetch.py SITES); a third of L2 (H200:
                                                        # o_proj + router) beat 0, 16 MiB and 3/4 (NOTES)

    # ---- the call, buffers -----------------------------------------------------------------------
    def call(self, fn, *args, feeds: dict, arena: int = 0) -> dict:
        self.feeds = {k: self.bind(k, v) for k, v in feeds.items()}
        self.outputs, self.site, self.key = {}, 0, (fn.__name__, arena)
        self.rows = self.feeds["h"].shape[0] if "h" in self.feeds else 1      # a layer call's rows (the prefetch)
        self.where = f"{fn.__name__}({', '.join(str(a) for a in args if isinstance(a, int))}) on {self.gpu.name}"
        self.calls += 1                                     # the prefetches' age (BranchOps.join_pending)
        fn(self, *args)
        self.release_held()                                 # a prefetch(beside="experts") that no MoE took
        self.join_pending()
        return self.outputs

    def capture_graph(self, body):
        """body's launches recorded into an executable CUDA graph (nothing runs): these ops in capture mode (no
        allocation, no host feed) with the graphs' plans (attention planned for the caches' rows). The prefetch
        branches an eager run left open are joined first, and the ones the last calls leave open before the graph
        ends (it must rejoin its branches: BranchOps.join_pending)."""
        def record(builder):
            self.stream, self.capturing = builder, True
            body()
            self.join_pending(every=True)
        self.join_pending(every=True)
        self.graph_plans = True
        try:
            return self.gpu.capture(record, main_first=self.main_first)
        finally:
            self.capturing, self.graph_plans, self.stream = False, False, None

    def run(self, kind: str, fn, args: tuple, feeds: dict, layer: int | None = None) -> dict:
        """description/stack.py's run: a decoder or drafter layer on arena layer % 2 (consecutive layers never
        share their scratch), every other call on arena 0."""
        return self.call(fn, *args, feeds=feeds, arena=0 if layer is None else layer % 2)

    def bind(self, name: str, value) -> Tensor:
        """A feed as a Tensor: device arrays as they are, numpy arrays uploaded into a per-(name, shape) buffer."""
        if not isinstance(value, np.ndarray):
            return Tensor.of(value)
        if self.capturing:
            raise RuntimeError(f"cuda backend: feed '{name}' is a host array while capturing a graph (bind it first)")
        value = np.ascontiguousarray(value)
        key = (name, value.shape, value.dtype.str)
        if key not in self.bound:
            self.bound[key] = self.gpu.alloc(value.shape, value.dtype)
        self.gpu.copy_in(self.bound[key], value)
        return Tensor.of(self.bound[key], host=value)

    def site_key(self, shape, dtype) -> tuple:
        """The arena key of the next op site: (layer function, arena, site number, shape, dtype)."""
        return (*self.key, self.site, tuple(int(s) for s in shape), np.dtype(dtype).str)

    def new(self, shape, dtype) -> Tensor:
        """The next op site's output buffer (allocated on first use, then reused)."""
        shape, dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        key = self.site_key(shape, dtype)
        self.site += 1
        if key not in self.arena:
            if self.capturing:
                raise RuntimeError(f"cuda backend: {self.where} allocates while capturing (run it once first)")
            self.arena[key] = self.gpu.alloc(shape, dtype)
        return Tensor.of(self.arena[key])

    def copy(self, x: Tensor) -> Tensor:
        return self.copy_into(x, self.new(x.shape, x.dtype))

    def copy_into(self, x: Tensor, out: Tensor) -> Tensor:
        """x -> out (contiguous, same shape): a gather kernel where rows are 16-byte multiples, else a DMA copy."""
        if not x.contiguous:
            raise ValueError(f"{self.where}: copy of a strided tensor {x.shape} {x.strides}")
        W, rows = x.shape[-1], int(np.prod(x.shape[:-1]))
        if W * x.itemsize % 16 == 0 and rows <= self.iota.shape[0]:
            self.k.gather_rows(x.ptr, self.iota, out.ptr, rows, W, rows, itemsize=x.itemsize, stream=self.stream)
        else:
            self.gpu.copy_d2d(out.ptr, x.ptr, rows * W * x.itemsize, stream=self.stream)
        return out

    def host(self, x: Tensor) -> np.ndarray:
        if x.host is not None:
            return x.host
        if not x.contiguous:
            raise ValueError(f"{self.where}: download of a strided tensor")
        return DeviceArray(self.gpu, x.ptr, x.shape, x.dtype).numpy()

    def upload(self, array) -> Tensor:
        array = np.ascontiguousarray(array)
        out = self.new(array.shape, array.dtype)
        self.gpu.copy_in(DeviceArray(self.gpu, out.ptr, out.shape, out.dtype), array)
        return replace(out, host=array)

    def launcher(self, key: tuple, make):
        if self.lane:                       # a branch's own launchers: no workspace shared with a parallel chain
            key = (*key, self.lane)
        if key not in self.kernels:
            self.kernels[key] = make()
        return self.kernels[key]

    def _rows(self, x: Tensor, what: str) -> int:
        if not 1 <= x.shape[0] <= self.max_tokens:
            raise ValueError(f"{self.where}: {what} of {x.shape[0]} rows (the kernels take 1..{self.max_tokens})")
        return x.shape[0]

    # ---- graph boundary ------------------------------------------------------------------------
    def input(self, name, shape, dtype):
        if name not in self.feeds:
            raise KeyError(f"{self.where}: input '{name}' {shape} was not fed")
        x = self.feeds[name]
        if len(x.shape) != len(shape) or any(isinstance(d, int) and x.shape[i] != d for i, d in enumerate(shape)):
            raise ValueError(f"{self.where}: input '{name}' must be {shape}, got {list(x.shape)}")
        if x.dtype != DTYPES[dtype]:
            raise ValueError(f"{self.where}: input '{name}' must be {DTYPES[dtype].name}, got {x.dtype.name}")
        return x

    def weight(self, name):
        return self.store.tensor(name)

    def output(self, name, x, shape, dtype):
        self.outputs[name] = x

    def shape(self, x):
        return tuple(x.shape)

    # ---- layout ----------------------------------------------------------------------------------
    def reshape(self, x, shape):
        new = tuple(x.shape[i] if d == 0 else int(d) for i, d in enumerate(shape))
        if int(np.prod(new)) != int(np.prod(x.shape)):
            raise ValueError(f"{self.where}: reshape {x.shape} -> {new}")
        if x.contiguous:
            return replace(x, shape=new, strides=dense_strides(new), host=None)
        if len(x.shape) == 2 and new[0] == x.shape[0] and x.strides[1] == 1:     # [q, D] strided rows -> [q, ...]
            return replace(x, shape=new, strides=(x.strides[0], *dense_strides(new[1:])), host=None)
        raise ValueError(f"{self.where}: reshape of a strided {x.shape} {x.strides} to {new} needs a copy")

    def slice(self, x, axis, start, stop):
        shape = list(x.shape)
        shape[axis] = stop - start
        return replace(x, ptr=x.ptr + start * x.strides[axis] * x.itemsize, shape=tuple(shape), name=None, host=None)

    def cast(self, x, dtype):
        want = DTYPES[dtype]
        if x.dtype == want:
            return x
        if x.dtype == np.float32 and want == np.uint16 and x.contiguous:
            out = self.new(x.shape, want)
            self.k.cast_f32_bf16(x.ptr, out.ptr, int(np.prod(x.shape)), stream=self.stream)
            return out
        raise NotImplementedError(f"cuda backend: cast {x.dtype.name} -> {want.name} has no kernel")

    # ---- dense math ------------------------------------------------------------------------------
    def add(self, a, b):
        if not (a.contiguous and b.contiguous) or a.shape != b.shape:
            raise ValueError(f"{self.where}: add of {a.shape} {a.strides} and {b.shape} {b.strides} (dense, one shape)")
        out = self.new(a.shape, np.uint16)
        self.k.add(a.ptr, b.ptr, out.ptr, int(np.prod(a.shape)), stream=self.stream)
        return out

    def rms_norm(self, x, w, eps):
        D, rows = w.shape[0], int(np.prod(x.shape[:-1]))
        stride, group, group_stride = x.row_groups("rms_norm")        # heads of a column slice: a token's group
        out = self.new(x.shape, np.uint16)
        self.k.rms_norm(x.ptr, w.ptr, out.ptr, rows, D, eps, x_stride=stride, x_group=group,
                        x_group_stride=group_stride, stream=self.stream)
        return out

    def all_reduce_add_rms_norm(self, partial, h, w, eps, tag):
        self._single_rank(f"all_reduce_add_rms_norm ({tag})")
        partial = self._reduced(partial)
        if not (h.contiguous and partial.contiguous):
            raise ValueError(f"{self.where}: all_reduce_add_rms_norm of a strided h {h.strides} or partial")
        h1, x2 = self.new(h.shape, np.uint16), self.new(h.shape, np.uint16)
        self.k.add_rms_norm(h1.ptr, partial.ptr, w.ptr, x2.ptr, h.shape[0], h.shape[1], eps, stream=self.stream,
                            h_in=h.ptr)
        return h1, x2

    def _gemm(self, x, tiled, N: int, out_dtype, swiglu: bool = False) -> Tensor:
        M, K = self._rows(x, "linear"), x.shape[1]
        if len(x.shape) == 2 and not x.contiguous and x.strides[1] == 1 and K * x.itemsize % 16 == 0:
            dense = self.new(x.shape, x.dtype)              # a column slice (tp > 1's fc input): rows made dense
            self.k.gather_rows(x.ptr, self.iota, dense.ptr, M, K, M, src_stride=x.strides[0], itemsize=x.itemsize,
                               stream=self.stream)
            x = dense
        if len(x.shape) != 2 or not x.contiguous:
            raise ValueError(f"{self.where}: linear needs a dense [m, K] input, got {x.shape} {x.strides}")
        f32 = np.dtype(out_dtype) == np.float32
        gemm = self.launcher(("gemm", N, K, f32), lambda: SkinnyGemm(self.gpu, N, K, self.max_tokens, out_f32=f32,
                                                                          invariant=self.invariant))
        out = self.new((M, N // 2 if swiglu else N), out_dtype)
        gemm.run(x.ptr, tiled, out.ptr, M, stream=self.stream, swiglu=swiglu)
        return out

    def linear(self, x, w, out=ACT):
        return self._gemm(x, self.store.tiled(w.name), w.shape[0], DTYPES[out])

    def linears(self, x, ws) -> tuple:
        """One GEMM where the store holds ws side by side (CudaWeights.tiled_group), its outputs column views of
        one [m, sum N] buffer; one GEMM a weight otherwise (the op's default)."""
        group = self.store.tiled_group(tuple(w.name for w in ws))
        if group is None:
            return super().linears(x, ws)
        y = self._gemm(x, group, sum(w.shape[0] for w in ws), DTYPES[ACT])
        starts = np.cumsum([0] + [w.shape[0] for w in ws])
        return tuple(self.slice(y, 1, int(a), int(b)) for a, b in zip(starts[:-1], starts[1:]))

    def swiglu_mlp(self, x, gate, up, down):
        I = gate.shape[0]
        act = self._gemm(x, self.store.gate_up(gate.name, up.name), 2 * I, np.uint16, swiglu=True)   # [m, I]
        return self._gemm(act, self.store.tiled(down.name), down.shape[0], np.uint16)

    def embed(self, ids, table):
        q, H = self._rows(ids, "embed"), table.shape[1]
        out = self.new((q, H), np.uint16)
        self.k.embed(ids.ptr, table.ptr, out.ptr, q, H, self.lay.vocab_start, table.shape[0], stream=self.stream)
        return out

    # ---- MLA (the latent cache's ops: CacheOps, backends/cuda_cache.py) -----------------------------------
    def rope(self, x, pos, rope):
        return self._roped(x, pos.ptr, self.store.rope_table("interleaved", rope, x.shape[2]), self.k.rope_interleaved)

    def _roped(self, x, pos_ptr: int, table, launch) -> Tensor:
        """A dense copy of x [q, n, d] (token and head strides as they are, elements dense) roped in one pass."""
        if len(x.shape) != 3 or x.strides[2] != 1:
            raise ValueError(f"{self.where}: rope of {x.shape} {x.strides}: [q, n, d] with dense elements")
        out = self.new(x.shape, np.uint16)
        launch(out.ptr, pos_ptr, table, x.shape[0], x.shape[1], stream=self.stream, src=x.ptr,
               src_token_stride=x.strides[0], src_head_stride=x.strides[1])
        return out

    def _absorb(self, spec):
        return self.launcher(("absorb", spec.heads, spec.nope_dim, spec.v_dim, spec.kv_lora_rank), lambda: MlaAbsorb(
            self.gpu, spec.heads, spec.nope_dim, spec.v_dim, spec.kv_lora_rank, self.max_tokens, invariant=self.invariant))

    def mla_absorb_q(self, q_nope, kv_b, spec):
        q, N, Dn = q_nope.shape
        extra = q_nope.strides[1] - Dn
        if q_nope.strides != (N * (Dn + extra), Dn + extra, 1):
            raise ValueError(f"{self.where}: mla_absorb_q reads q_nope inside [q, N, Dn + Dr], got {q_nope.strides}")
        out = self.new((q, N, spec.kv_lora_rank), np.uint16)
        self._absorb(spec).q(q_nope.ptr, self.store.uk_t(kv_b.name, spec), out.ptr, self._rows(q_nope, "absorb"),
                             rope=extra, stream=self.stream)
        return out

    def mla_absorb_q_rope(self, q_all, kv_b, pos, rope, spec):
        q, N, D = q_all.shape
        if q_all.strides != (N * D, D, 1) or D != spec.nope_dim + spec.rope_dim:
            raise ValueError(f"{self.where}: mla_absorb_q_rope reads a dense q_all [q, N, Dn + Dr], got {q_all.shape} "
                             f"{q_all.strides}")
        q_lat = self.new((q, N, spec.kv_lora_rank), np.uint16)
        q_rope = self.new((q, N, spec.rope_dim), np.uint16)
        self._absorb(spec).q_rope(q_all.ptr, self.store.uk_t(kv_b.name, spec), q_lat.ptr, q_rope.ptr, pos.ptr,
                                  self.store.rope_table("interleaved", rope, spec.rope_dim),
                                  self._rows(q_all, "absorb"), stream=self.stream)
        return q_lat, q_rope

    def mla_tree_attention(self, q_lat, q_rope, cache, cache_len, tree_mask, spec):
        q = self._rows(q_lat, "mla_tree_attention")
        out = self.new((q, spec.heads, spec.kv_lora_rank), np.uint16)
        self._attend(q_lat, q_rope, cache, cache_len, tree_mask, spec, out.ptr)
        return out

    def _attend(self, q_lat, q_rope, cache, cache_len, tree_mask, spec, out_ptr) -> None:
        """One tree attention launch (the plan's split + combine) into out_ptr [q, N_r, R] bf16."""
        q, S = q_lat.shape[0], cache.shape[0]
        form = MlaInvariantAttention if self.invariant else MlaTreeAttention
        attn = self.launcher(("mla", spec.heads, spec.softmax_scale, S), lambda: form(
            self.gpu, spec.heads, spec.softmax_scale, latent=spec.kv_lora_rank, rope=spec.rope_dim,
            max_q=self.max_tokens, max_context=S))
        attn.run(q_lat.ptr, q_rope.ptr, cache.ptr, tree_mask.ptr, cache_len.ptr, q, out_ptr,
                 context_hint=self.attention_keys(S, q, cache_len), stream=self.stream)

    def attention_keys(self, S: int, q: int, cache_len) -> int | None:
        """The keys the attention plans its split for: the cache's rows + q when the host knows them, None (the
        whole cache of S rows) inside a captured graph."""
        return None if cache_len.host is None or self.graph_plans else min(S, int(cache_len.host[0]) + q)

    def mla_absorb_out(self, o_lat, kv_b, spec):
        q = self._rows(o_lat, "absorb")
        out = self.new((q, spec.heads * spec.v_dim), np.uint16)
        self._absorb(spec).out(o_lat.ptr, kv_b.ptr, out.ptr, q, stream=self.stream)
        return out

    # ---- drafter ---------------------------------------------------------------------------------
    @staticmethod
    def _heads(x, n: int) -> Tensor:
        """x [rows, n d] (or already [rows, n, d]) as a [rows, n, d] view."""
        if len(x.shape) == 3:
            return x
        return replace(x, shape=(x.shape[0], n, x.shape[1] // n), strides=(x.strides[0], x.shape[1] // n, 1),
                       host=None)

    def draft_attention(self, q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, rope, spec):
        b, n, (S, Hk, d) = q.shape[0], ctx_k.shape[0], cache_k.shape
        if cache_len.host is not None and int(cache_len.host[0]) + n > S:
            raise ValueError(f"{self.where}: {n} context rows after {int(cache_len.host[0])} exceed the drafter "
                             f"cache's {S}")
        table = self.store.rope_table("rotate_half", rope, d, spec.attention_factor)
        if n:              # the new context rows, roped at cache_len + i and written there (all on the device)
            ctx_pos = self.new((n,), np.int32)
            self.k.positions_from(cache_len.ptr, ctx_pos.ptr, n, stream=self.stream)
            ctx_k_r = self._roped(self._heads(ctx_k, Hk), ctx_pos.ptr, table, self.k.rope_rotate_half)
            for src, dst in ((ctx_k_r, cache_k), (ctx_v, cache_v)):        # ctx_v: a column slice of k | v
                self.k.rows_at(dst.ptr, S, cache_len.ptr, src.ptr, n, Hk * d, stream=self.stream,
                               src_stride=src.token_stride(Hk * d, "draft_attention ctx_v"))
        q_r = self._roped(self._heads(q, spec.heads), pos.ptr, table, self.k.rope_rotate_half)
        k_r = self._roped(self._heads(k, Hk), pos.ptr, table, self.k.rope_rotate_half)
        attn = self.launcher(("draft", spec.heads, Hk, d, S), lambda: DraftAttention(
            self.gpu, spec.heads, Hk, d, max_context=S))
        out = self.new((b, spec.heads * d), np.uint16)
        attn.run(q_r.ptr, k_r.ptr, v.ptr, cache_k.ptr, cache_v.ptr, cache_len.ptr, n, pos.ptr, out.ptr, b,
                 window=spec.sliding_window, stream=self.stream,
                 v_tok=v.token_stride(Hk * d, "draft_attention v"))          # v: a column slice of q | k | v
        return out, cache_k, cache_v
