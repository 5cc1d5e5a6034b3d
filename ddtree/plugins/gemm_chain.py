"""A chain of skinny BF16 GEMMs as one persistent launch whose weight stream never waits (kernels/gemm_chain.cu;
issue 48). An experiment, measured against the step's launches and not adopted: docs/performance.md section 4.2.

    chain = GemmChain(gpu, [ChainGemm(1536, 7168, INPUT), ChainGemm(1536, 1536, 0)], max_tokens=17)
    chain.bind(x, [w0, w1])            # the op records for these buffers (tiled weights: layout.tile_bf16)
    chain.run(M)                       # launches only: capturable; chain.outs[i] [M, N_i] bf16 after it
    chain.check()                      # after a sync: a consumer that spun out names the op it waited for

Op i reads x_i = the input x (src INPUT) or op src's output (its first K_i columns), so the chain is any DAG whose
ops come after their source. Each op's output is cut into warp items (a 16-row tile x a k-split); the plan picks
the split per op that minimises the chunks on the busiest warp, and rotates the first warp of each op so the
warps idle in one op take the next op's first items. reference_chain is the numpy twin.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins.compile import defines_for
from ddtree.plugins.device import Gpu, ptr

SOURCE = "gemm_chain.cu"
INPUT = -1                          # src of an op that reads the chain's input x
MAX_OPS = 16                        # GC_MAX_OPS
MAX_MT = 3                          # gemm_chain_mt1..3: up to 24 rows
DEFAULT_MAX_SPINS = 1 << 24         # acquire polls of a dependency before it counts as lost (err names the op)
OP_DTYPE = np.dtype([("w", "<u8"), ("x", "<u8"), ("out", "<u8"), ("partial", "<u8"), ("N", "<i4"), ("K", "<i4"),
                     ("ldx", "<i4"), ("S", "<i4"), ("wait", "<i4"), ("off", "<i4"), ("group_off", "<i4"),
                     ("pad", "<i4")])    # struct ChainOp, 64 bytes


@dataclass(frozen=True)
class ChainGemm:
    N: int                          # output features (rows of w)
    K: int                          # input features; x_i = the source's first K columns
    src: int                        # INPUT, or the index of an earlier op


@dataclass(frozen=True)
class ChainPlan:
    splits: tuple                   # S per op (K / 64 % S == 0)
    offsets: tuple                  # first global warp of each op's items
    group_offsets: tuple            # each op's split-K arrival counters (one a tile)
    groups: int                     # arrival counters in all
    smem: int                       # dynamic shared memory (the warps' rings)


def kernel_constants(arch: str) -> tuple[int, int]:
    """(warps a block, ring stages a warp) compiled for arch (compile.SOURCES, the one table)."""
    d = defines_for(SOURCE, arch)
    return d["GC_WARPS"], d["GC_STAGES"]


def token_tiles(M: int) -> int:
    if not 1 <= M <= 8 * MAX_MT:
        raise ValueError(f"GEMM chain: M = {M} rows outside [1, {8 * MAX_MT}]")
    return -(-M // 8)


def check_chain(ops: list[ChainGemm]) -> None:
    if not 1 <= len(ops) <= MAX_OPS:
        raise ValueError(f"GEMM chain: {len(ops)} ops, expected 1..{MAX_OPS}")
    for i, o in enumerate(ops):
        if o.N < 1 or o.K < 64 or o.K % 64:
            raise ValueError(f"GEMM chain op {i}: needs N >= 1 and K % 64 == 0, got N = {o.N}, K = {o.K}")
        if o.src != INPUT and not 0 <= o.src < i:
            raise ValueError(f"GEMM chain op {i}: src {o.src} is not an earlier op (or INPUT)")
        if o.src != INPUT and o.K > ops[o.src].N:
            raise ValueError(f"GEMM chain op {i}: K = {o.K} exceeds op {o.src}'s N = {ops[o.src].N}")


def weight_bytes(ops: list[ChainGemm]) -> int:
    """The bytes the chain streams: every op's tiled weight (rows padded to 16), bf16."""
    return sum(-(-o.N // 16) * 16 * o.K * 2 for o in ops)


def _items(N: int, S: int) -> int:
    return -(-N // 16) * S


ITEM_CHUNKS = 2        # an item's fixed cost in 2 KB chunks a warp: its x rows' L2 round trip, the partials' hand-off
REDUCE_SPLITS = 8      # partials the last block of a group sums in the time a warp streams one chunk


def item_cost(KC: int, S: int, items: int, units: int, item_chunks: float = ITEM_CHUNKS) -> float:
    """The busiest warp's cost in chunks: rounds x (chunks an item + its fixed cost) + the split-K sum."""
    return -(-items // units) * (KC // S + item_chunks) + (S / REDUCE_SPLITS if S > 1 else 0.0)


def plan_chain(ops: list[ChainGemm], blocks: int, warps: int, stages: int, smem_limit: int,
               item_chunks: float = ITEM_CHUNKS, bulk: bool = False) -> ChainPlan:
    """Per op the k-split S of least item_cost over the grid's warps, fewer splits on a tie. bulk: each ring stage
    also holds its 8-byte mbarrier."""
    check_chain(ops)
    smem = warps * stages * (2048 + (8 if bulk else 0))
    if smem > smem_limit:
        raise ValueError(f"GEMM chain: {warps} warps x {stages} ring stages need {smem} B; "
                         f"the device allows {smem_limit}")
    units = blocks * warps
    splits, offsets, group_offsets, groups, done_items = [], [], [], 0, 0
    for o in ops:
        KC = o.K // 64
        cands = [s for s in range(1, KC + 1) if KC % s == 0]
        S = min(cands, key=lambda s: (item_cost(KC, s, _items(o.N, s), units, item_chunks), s))
        splits.append(S)
        offsets.append(done_items % units)
        group_offsets.append(groups)
        groups += _items(o.N, 1)
        done_items += _items(o.N, S)
    return ChainPlan(tuple(splits), tuple(offsets), tuple(group_offsets), groups, smem)


def warp_items(ops: list[ChainGemm], plan: ChainPlan, units: int) -> list[list[tuple]]:
    """Per global warp, its (op, tile, split) items in the order the kernel runs them (the kernel's first_item /
    next_item, for tests and for reading a plan)."""
    out = [[] for _ in range(units)]
    for i, o in enumerate(ops):
        S = plan.splits[i]
        for j in range(_items(o.N, S)):
            out[(j + plan.offsets[i]) % units].append((i, j // S, j % S))
    return out


def reference_chain(x: np.ndarray, weights: list[np.ndarray], ops: list[ChainGemm]) -> list[np.ndarray]:
    """Numpy twin: out_i = bf16(x_i @ w_i^T) with x_i in bf16 (uint16 bits), float64 sums. x [M, K_0 or more],
    weights [N_i, K_i] bf16 bits -> outputs [M, N_i] bf16 bits."""
    check_chain(ops)
    outs = []
    for o, w in zip(ops, weights):
        src = x if o.src == INPUT else outs[o.src]
        xi = bf16_to_f32(src[:, :o.K]).astype(np.float64)
        outs.append(f32_to_bf16((xi @ bf16_to_f32(w).astype(np.float64).T).astype(np.float32)))
    return outs


class GemmChain:
    """The chain's plan, outputs, partials, counters and op records on one GPU, for up to max_tokens rows."""

    def __init__(self, gpu: Gpu, ops: list[ChainGemm], max_tokens: int = 8 * MAX_MT, max_spins: int = DEFAULT_MAX_SPINS,
                 item_chunks: float = ITEM_CHUNKS, stages: int | None = None, bulk: bool = False,
                 warps: int | None = None):
        """stages / bulk / warps: the ring depth and warps a block (compile.SOURCES' by default) and bulk copies
        instead of cp.async (a compiled variant each; ddtree bench chain sweeps them)."""
        token_tiles(max_tokens)
        self.gpu, self.ops, self.max_tokens, self.max_spins = gpu, list(ops), max_tokens, max_spins
        self.warps, self.stages = kernel_constants(gpu.arch)
        self.stages, self.warps = stages or self.stages, warps or self.warps
        self.defines = {"GC_STAGES": self.stages, "GC_BULK": int(bulk), "GC_WARPS": self.warps}
        self.blocks = gpu.sm_count
        self.plan = plan_chain(self.ops, self.blocks, self.warps, self.stages, gpu.smem_optin, item_chunks, bulk)
        self.outs = [gpu.zeros((max_tokens, o.N), np.uint16) for o in self.ops]
        self.partials = [gpu.alloc(max(4, _items(o.N, S) * MAX_MT * 32 * 4), np.float32)
                         for o, S in zip(self.ops, self.plan.splits)]
        self.done = gpu.zeros(len(self.ops), np.uint32)
        self.groups = gpu.zeros(self.plan.groups, np.uint32)
        self.exits = gpu.zeros(1, np.uint32)
        self.err = gpu.zeros(1, np.uint32)
        self.records = gpu.alloc(len(self.ops) * OP_DTYPE.itemsize, np.uint8)
        self._bound: tuple | None = None

    def _records(self, x, weights) -> np.ndarray:
        rec = np.zeros(len(self.ops), OP_DTYPE)
        for i, (o, w) in enumerate(zip(self.ops, weights)):
            src_ptr, ldx = (ptr(x), o.K) if o.src == INPUT else (ptr(self.outs[o.src]), self.ops[o.src].N)
            rec[i] = (ptr(w), src_ptr, ptr(self.outs[i]), ptr(self.partials[i]), o.N, o.K, ldx,
                      self.plan.splits[i], o.src, self.plan.offsets[i], self.plan.group_offsets[i], 0)
        return rec

    def bind(self, x, weights: list) -> None:
        """Write the op records for input x [>= M, K_0] and the tiled weights (tile_bf16); before capturing."""
        if len(weights) != len(self.ops):
            raise ValueError(f"GEMM chain: {len(weights)} weights for {len(self.ops)} ops")
        key = (ptr(x), *(ptr(w) for w in weights))
        if key != self._bound:
            self.gpu.copy_in(self.records, self._records(x, weights).view(np.uint8))
            self._bound = key

    def run(self, M: int, stream=None) -> None:
        """Launch the bound chain over M rows (launches only: capturable). Different inputs or weights need
        their own GemmChain (the records are one device buffer)."""
        if self._bound is None:
            raise ValueError("GEMM chain: bind(x, weights) before run")
        if M > self.max_tokens:
            raise ValueError(f"GEMM chain: M = {M} exceeds max_tokens {self.max_tokens}")
        name = f"gemm_chain_mt{token_tiles(M)}"
        self.gpu.allow_smem(SOURCE, name, self.plan.smem, self.defines)
        kernel = self.gpu.kernel(SOURCE, name, self.defines)
        self.gpu.launch(kernel, (self.blocks, 1, 1), (self.warps * 32, 1, 1), self.plan.smem, ptr(self.records),
                        np.int32(len(self.ops)), np.int32(M), ptr(self.done), ptr(self.groups),
                        ptr(self.exits), ptr(self.err), np.int32(self.max_spins), stream=stream)

    def check(self) -> None:
        e = int(self.gpu.download(self.err)[0])
        if e:
            raise RuntimeError(f"GEMM chain: a block spun out waiting for op {e - 1}'s output (counters lost)")
