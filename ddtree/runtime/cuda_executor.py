"""The executor on one GPU: an engine's layer functions (description/layers.py) through the cuda backend, at tp 1 or as
one rank process of tp N (runtime/cuda_ranks.py).

    ex = CudaExecutor(engine_dir, gpu=0, max_context=4096)
    logits, taps = ex.target_forward(ids, pos, visible, ex.new_target_cache(), taps=(0, 1))

Same primitives as EngineExecutor (docs/interfaces.md section 6), the same layer functions, on the kernels of
ddtree/plugins: weights in bf16 as stored (GEMM weights tiled once at load, W_UK^T transposed once, the
experts in the kernel layout the engine stores), activations bf16, logits float32. The primitives download
the logits for the loop's interface, and their sample / tree_build / accept_walk run on the host exactly as
EngineExecutor's (so the two differ only in the logits). The loops' steps (ar_step, ddtree_step) are captured
CUDA graphs instead (runtime/cuda_step.py; a rank of tp N: runtime/cuda_step_tp.py, the collectives inside):
sampling, tree, walk and compaction on the device, one record read per step. One sequence at a time: the caches
are allocated once at load (max_context rows) and handed out reset by new_target_cache / new_drafter_cache.

The memory plan (weights, KV caches, workspaces) is printed on stderr before anything is allocated, and a
plan larger than the GPU's free memory is refused naming both numbers.

The kernels take at most MAX_TOKENS (256) rows a call, so a longer prompt runs as consecutive target_forward
chunks of <= 256 rows, each seeing the cache (the chunks before it) and itself causally, and a longer drafter
context as consecutive drafter calls that each append <= 256 context rows (the same block; only the last
call's logits are kept). A call the GPU path cannot take is a CudaRequestError naming the limit.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ddtree.backends.cuda_backend import MAX_TOKENS, CudaOps
from ddtree.backends.cuda_tensor import Tensor
from ddtree.description import layers, stack
from ddtree.description.opset import RankLayout
from ddtree.engine_dir import STORED, check_engine, engine_configs, load_rank_tensors, tokenizer_dir
from ddtree.model.bf16 import as_float, f32_to_bf16
from ddtree.plugins.device import Gpu, _driver, check
from ddtree.runtime import loop, vocab_parallel
from ddtree.runtime.cuda_lanes import LanePool
from ddtree.runtime.cuda_model import (
    GpuDraftCache,
    GpuTargetCache,
    HeldCaches,
    cache_bytes,
    device_caches,
    draft_feeds,
    target_feeds,
    target_layers,
)
from ddtree.runtime.cuda_step import GpuSteps
from ddtree.runtime.cuda_step_tp import TpSteps
from ddtree.runtime.cuda_weights import CudaWeights
from ddtree.runtime.engine_executor import checked_drafter_inputs, checked_forward_inputs
from ddtree.runtime.executor import Executor
from ddtree.runtime.loop import RequestError
from ddtree.runtime.pruning import expert_bytes
from ddtree.tree.build import Tree, build_tree, pack_visibility
from ddtree.tree.sampling import SamplingParams

WORKSPACE_BYTES = 256 << 20      # activations arena + kernel workspaces, a stated allowance (tiny to Kimi tp 8)
class MemoryPlanError(RequestError, MemoryError):
    """The memory plan does not fit in the GPU's free memory."""


class CudaRequestError(RequestError):
    """A call the GPU executor cannot take: its shape, the ids, a position past the caches, a mask it cannot chunk."""


def prefill_chunks(visible: np.ndarray, T: int, limit: int = MAX_TOKENS) -> list[tuple[int, int]]:
    """visible [q, T + q] -> consecutive row ranges [a, b) of <= limit rows, each of which sees the whole
    cache and every row of the chunks before it and nothing after itself (what one kernel call can take)."""
    q = visible.shape[0]
    bounds = [(a, min(a + limit, q)) for a in range(0, q, limit)]
    for a, b in bounds:
        if not visible[a:b, : T + a].all() or visible[a:b, T + b:].any():
            raise CudaRequestError(
                f"target_forward: {q} new tokens are more than the GPU kernels' {limit} per call, and rows "
                f"{a}..{b - 1} do not see exactly the cache and the rows before them (only a causal prompt "
                f"runs in chunks; a tree verify takes at most {limit} nodes: lower --budget)")
    return bounds


def gpu_unavailable(gpu: int = 0) -> str | None:
    """Why GPU `gpu` cannot run the executor (the cuda extra missing, no driver or GPU, a bad index), or None."""
    try:
        import cuda.core  # noqa: F401
        from cuda.bindings import driver  # cuda: the cuda extra
    except ImportError as e:
        return f"cuda-python is not installed ({e}; pip install -e '.[cuda]')"
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:                                # cuda-bindings without a driver library
        return f"no CUDA driver ({e})"
    if err != driver.CUresult.CUDA_SUCCESS:
        return f"no CUDA GPU is visible (cuInit: {err.name})"
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS or not 0 <= gpu < count:
        return f"--gpu {gpu}: this machine has {count if err == driver.CUresult.CUDA_SUCCESS else 0} CUDA GPU(s)"
    return None


class CudaExecutor(HeldCaches, Executor):
    name = "cuda"
    prunes_in_step = True         # --prune auto: its DDTree step graph prunes inside (tp 1; tp > 1 cannot prune)

    def __init__(self, engine_dir, gpu: int = 0, max_context: int | None = None, verify: bool = True,
                 graphs: bool = True, cap_context: bool = False, kernel_plan: str = "fast", rank: int = 0,
                 collective=None, host_group=None, checked: tuple | None = None):
        """cap_context: a max_context above the model's context is cut to it (a computed default), else an error.
        kernel_plan: "fast" or "batch-invariant" (backends/cuda_backend.py KERNEL_PLANS: DDTree == AR bitwise).
        graphs: the loops' steps (ar_step, ddtree_step) run as captured CUDA graphs (runtime/cuda_step.py);
        False: every step is the composition of the primitives below (host sampling, tree and walk).
        A tp > 1 engine: this process is rank `rank` (runtime/ranks.py), with `collective` its GPU collective for
        the layers' all-reduces (parallel/cuda_collectives.py) and `host_group` the ranks' host group (parallel/shm_group.py)
        that gathers the primitives' logits slices, so every rank samples, builds and walks the same tree from the
        same bits (the rank-symmetric step); its steps are graphs with the collectives inside (runtime/cuda_step_tp.py)
        when the collective is capturable, else the primitives. checked: check_engine's result when the caller has
        it."""
        self.engine_dir = Path(engine_dir)
        self.meta, digests = checked if checked is not None else check_engine(self.engine_dir, verify)
        tp = int(self.meta["tp"])
        if tp != 1 and (collective is None or host_group is None):
            raise NotImplementedError(f"cuda executor: the engine is tp {tp}; its ranks run as processes, each with "
                                      "its GPU collective and the host group (runtime/ranks.py RankProcesses)")
        cfg, d = engine_configs(self.engine_dir, self.meta)
        tensors = load_rank_tensors(self.engine_dir, rank, self.meta["weight_files"], convert=STORED, digests=digests)
        self.host_group = host_group
        self._setup(cfg, d, self.meta["plan"], rank, tensors, gpu, max_context, cap_context, graphs, collective,
                    kernel_plan)
        self.tokenizer_dir = tokenizer_dir(self.engine_dir)

    @classmethod
    def of_weights(cls, cfg, dcfg, plan: dict, tensors: dict, rank: int = 0, gpu: int = 0,
                   max_context: int | None = None, collective=None, graphs: bool = False,
                   kernel_plan: str = "fast") -> "CudaExecutor":
        """Rank `rank` of `plan` (TPPlan.to_dict()) over tensors given in memory (its rank tensors as an engine
        stores them: a test's model, bench/hash_model.py), no engine directory. collective: the GPU collective
        of tp > 1 (parallel/cuda_collectives.py), None at tp 1."""
        self = cls.__new__(cls)
        self.engine_dir, self.tokenizer_dir, self.host_group = None, None, None
        self.meta = {"tp": plan["tp"], "plan": plan}
        self._setup(cfg, dcfg, plan, rank, tensors, gpu, max_context, False, graphs, collective, kernel_plan)
        return self

    def _setup(self, cfg, d, plan: dict, rank: int, tensors: dict, gpu: int, max_context, cap_context: bool,
               graphs: bool, collective, kernel_plan: str = "fast") -> None:
        """The memory plan, then the weights, ops and caches of rank `rank` on GPU `gpu`."""
        self.config, self.drafter_config = cfg, d
        context = int(cfg.max_position_embeddings)
        self.max_context = int(max_context or min(context, 4096))
        if self.max_context > context:
            if not cap_context:
                raise RequestError(f"--max-context {self.max_context} is more than the model's context of {context} "
                                   "tokens (max_position_embeddings)")
            self.max_context = context
        self.moe_inter = plan["per_rank"]["moe_intermediate"]
        self.lay = RankLayout.from_plan(plan, rank)
        self.layouts = [RankLayout.from_plan(plan, r) for r in range(self.lay.tp)]
        S = self.max_context
        mem = {"weights": CudaWeights.plan_bytes(tensors), "KV": sum(cache_bytes(cfg, d, self.lay.tp, S).values()),
               "workspaces": WORKSPACE_BYTES + S * (cfg.qk_rope_head_dim + d.head_dim) * 4}
        self.memory_plan = mem                   # bytes by part (what the plan line below prints)
        self.gpu = Gpu(gpu)
        free, total = check(_driver().cuMemGetInfo(), "cuMemGetInfo")
        need = sum(mem.values())
        print(f"cuda executor: memory plan on {self.gpu.name} (GPU {gpu}), max_context {S}: "
              + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items())
              + f"; total {need / 2**20:.1f} MiB of {free / 2**20:.1f} MiB free", file=sys.stderr)
        if need > free:
            raise MemoryPlanError(f"cuda executor: the plan needs {need / 2**30:.2f} GiB but GPU {gpu} has "
                                  f"{free / 2**30:.2f} GiB free (lower --max-context)")
        self.store = CudaWeights(self.gpu, tensors, cfg, S)
        if collective is not None and not hasattr(collective, "all_reduce"):
            collective = collective(self.gpu)           # made on this GPU (a rank process's one-shot all-reduce)
        self.ops = CudaOps(self.gpu, self.lay, self.store, collective=collective, kernel_plan=kernel_plan)
        self.kernel_plan = kernel_plan
        self.target_cache, self.draft_cache = device_caches(self.gpu, cfg, d, self.lay.tp, S)
        # tp > 1: graphs only over a collective that launches without host syncs (not the ranks-as-threads one)
        self.graphs = graphs and (self.lay.tp == 1 or getattr(collective, "capturable", False))
        self.steps = (GpuSteps if self.lay.tp == 1 else TpSteps)(self) if self.graphs else None
        self.lanes = None                               # --max-num-seqs > 1: request lanes (lane_pool)
        if self.lay.tp != 1:                            # TpSteps have no pruned verify: Pruner.for_executor refuses
            self.prune_forward = None

    def device_stats(self) -> dict:
        """The GPU, the memory plan (bytes), which collective carries a tp N rank's all-reduces, and the step
        graphs' counters."""
        out = {"device": self.gpu.name, "memory": dict(self.memory_plan)}
        collective = getattr(self.ops.collective, "collective", None)    # a stand-in or a real one (tp > 1)
        if collective is not None:
            out["allreduce"] = collective.describe()
        if self.steps is not None:
            out.update(self.steps.stats())
        if self.lanes is not None:
            out.update(lanes=len(self.lanes.lanes), **self.lanes.batch.stats())
        return out

    def ar_step(self, state, params: SamplingParams) -> list[int]:
        """The AR loop's step (runtime/loop.py): one replay of the AR graph."""
        return self.steps.ar_step(state, params) if self.steps else loop.ar_step(self, state, params)

    def drafter_prefill(self, state) -> None:
        """The DDTree loop's hook after the prefill (runtime/loop.py): the step graphs' drafter window."""
        if self.steps:
            self.steps.drafter_prefill(state)

    def ddtree_step(self, state, params: SamplingParams, budget: int) -> list[int]:
        """The DDTree loop's step (runtime/loop.py): one replay of the step graph of (budget, block, mode)."""
        return self.steps.ddtree_step(state, params, budget) if self.steps else loop.ddtree_step(self, state, params, budget)

    def _logits(self, t: Tensor) -> np.ndarray:
        """[q, V_r] of this rank -> [q, V]: at tp > 1 the ranks' slices gathered through the host group."""
        local = self.ops.host(t).astype(np.float32)
        if self.host_group is None:
            return local
        return np.concatenate(list(self.host_group.all_gather(self.lay.rank, local, "logits slices")), axis=1)

    def _vocab(self, logits) -> tuple[list[np.ndarray], list[int]]:
        """vocab_parallel's inputs: the ranks' slices of the gathered logits (tp > 1 rank processes), else the
        logits whole."""
        if self.host_group is None:
            return [np.asarray(logits)], [0]
        return vocab_parallel.split_logits(logits, self.layouts)

    def bind_thread(self) -> None:
        """This GPU current on the calling thread (the executor contract's ability: a server's engine thread)."""
        self.gpu.bind_thread()

    def lane_pool(self, lanes: int):
        """--max-num-seqs: the executor's request lanes (runtime/cuda_lanes.py LanePool), grown to `lanes`
        (a RequestError naming the flag where tp > 1, graphs off, or the lanes do not fit)."""
        if self.lanes is None:
            self.lanes = LanePool(self)
        return self.lanes.grow(lanes)

    # primitives --------------------------------------------------------------------------------
    def prune_forward(self, ids, pos, visible, cache: GpuTargetCache, taps=(), pruning: stack.Pruning | None = None):
        """target_forward with the verify pruned inside (the composition's steps: runtime/pruning.py Pruner.verify,
        whose feeds are host arrays, uploaded once here): on_route and the final live mask get host arrays."""
        ops = self.ops
        feeds = {k: ops.bind(f"prune_{k}", np.asarray(v)) for k, v in pruning.feeds.items()}

        def on_route(L: int, routed, live) -> None:
            if pruning.on_route is not None:
                pruning.on_route(L, ops.host(routed).copy(), ops.host(live).copy())
        dev = stack.Pruning(pruning.at, feeds, on_route)
        out = self.target_forward(ids, pos, visible, cache, taps, dev)
        pruning.feeds = {**pruning.feeds, "live": ops.host(dev.feeds["live"]).copy()}
        return out

    @property
    def expert_bytes(self) -> int:
        """One routed expert's bytes on this rank (its four kernel-layout tensors): tree_prune's cost unit."""
        return expert_bytes(lambda name: self.store.device(name).nbytes, self.config,
                            self.lay.expert_stop - self.lay.expert_start)

    def target_forward(self, ids, pos, visible, cache: GpuTargetCache, taps=(), pruning: stack.Pruning | None = None):
        """ids [q], pos [q], visible [q, T+q] -> logits [q, V] float32 (a rank of tp N: its vocab slice [q, V/N]),
        {L: h [q, H] float32}. pruning: a pruned verify over device feeds (prune_forward)."""
        cfg, ops = self.config, self.ops
        T = cache.length
        ids, pos, visible = checked_forward_inputs(ids, pos, visible, T, cfg.vocab_size, CudaRequestError)
        q = len(ids)
        if pos.min() < 0 or pos.max() >= self.max_context:
            raise CudaRequestError(f"target_forward: positions {pos.min()}..{pos.max()} must be in 0.."
                                   f"{self.max_context - 1} (--max-context {self.max_context})")
        cache.reserve(T + q)
        if q > self.ops.max_tokens:
            if pruning is not None:
                raise CudaRequestError(f"target_forward: a pruned verify of {q} rows (one call takes "
                                       f"{self.ops.max_tokens})")
            return self._chunked(ids, pos, visible, cache, taps)
        cache.dev.set_length(T)
        step = {"ids": ops.bind("ids", ids.astype(np.int32)), "pos": ops.bind("pos", pos.astype(np.int32)),
                "cache_len": Tensor.of(cache.dev.lengths, host=np.array([T], np.int32)),
                "tree_mask": ops.bind("tree_mask", pack_visibility(visible[:, T:]).view(np.int32))}
        tapped = {}

        def tap(L: int, h: Tensor) -> None:
            tapped[L] = as_float(ops.host(h), np.float32)
        h = target_layers(self, step, cache, tap, taps, prune=pruning)
        cache.length = T + q
        return self._logits(ops.call(layers.head_logits, cfg, feeds={"h": h})["logits"]), tapped

    def _chunked(self, ids, pos, visible, cache: GpuTargetCache, taps):
        """A prompt longer than one kernel call: consecutive calls of <= max_tokens rows (prefill_chunks)."""
        T, logits, tapped = cache.length, [], {L: [] for L in taps}
        for a, b in prefill_chunks(visible, T, self.ops.max_tokens):
            lg, tp = self.target_forward(ids[a:b], pos[a:b], visible[a:b, : T + b], cache, taps)
            logits.append(lg)
            for L in taps:
                tapped[L].append(tp[L])
        return np.concatenate(logits), {L: np.concatenate(v) for L, v in tapped.items()}

    def drafter_forward(self, block_ids, pos, ctx_taps, cache: GpuDraftCache) -> np.ndarray:
        """block_ids [b], pos [b], ctx_taps [n, K H] -> draft logits [b-1, V] float32."""
        d = self.drafter_config
        ctx_taps = checked_drafter_inputs(ctx_taps, block_ids, d, min_rows=1, error=CudaRequestError)
        T, n = cache.length, len(ctx_taps)
        cache.reserve(T + n)
        rows, starts = self.ops.max_tokens, range(0, n, self.ops.max_tokens)     # <= max_tokens context rows a call
        for a in starts[:-1]:
            self._draft(block_ids, pos, ctx_taps[a: a + rows], cache)           # appends rows; its logits unused
        return self._draft(block_ids, pos, ctx_taps[starts[-1]:], cache)

    def _draft(self, block_ids, pos, ctx_taps, cache: GpuDraftCache) -> np.ndarray:
        """One drafter call: appends ctx_taps' <= max_tokens rows to the cache and drafts the block after them."""
        d, ops = self.drafter_config, self.ops
        T, n, b = cache.length, len(ctx_taps), len(block_ids)
        self.gpu.copy_in(cache.lengths, np.array([T], np.int32))
        feeds = {"ctx_taps": f32_to_bf16(ctx_taps.astype(np.float64)), "ids": np.asarray(block_ids, np.int32),
                 "pos": ops.bind("draft_pos", np.asarray(pos, np.int32)),
                 "cache_len": Tensor.of(cache.lengths, host=np.array([T], np.int32))}
        logits = stack.drafter_forward(ops.run, self.config, d, feeds, draft_feeds(cache), b)["logits"]
        cache.length = T + n
        return self._logits(logits)

    def compact(self, cache: GpuTargetCache, start: int, keep) -> None:
        """Keep the verify's rows start + keep[i] at start + i (every layer), through the op set."""
        keep = np.asarray(keep, dtype=np.int32).reshape(-1)
        if not 0 <= start <= cache.length:
            raise CudaRequestError(f"compact: start {start} must be within the cache length {cache.length}")
        cache.dev.set_length(start)
        step = {"cache_len": Tensor.of(cache.dev.lengths, host=np.array([start], np.int32)),
                "accepted": self.ops.bind("accepted", keep), "accepted_count": np.array([len(keep)], np.int32)}
        stack.compact(self.ops.run, self.config, step, target_feeds(cache))
        cache.length = start + len(keep)

    def sample(self, logits, positions, params: SamplingParams) -> np.ndarray:
        return vocab_parallel.sample(*self._vocab(logits), positions, params)

    def tree_build(self, root_token: int, draft_logits: np.ndarray, budget: int) -> Tree:
        logp, ids = vocab_parallel.topk_logprobs(*self._vocab(draft_logits), budget)
        return build_tree(root_token, logp, ids, budget)
