"""Launcher for the fused W4A16 MoE (kernels/moe.cu), 1 <= M <= max_tokens <= 256 tokens.

    moe = FusedMoE(gpu, MoEShape(hidden, inter, experts, topk), weights, router=...)
    moe.run(x, out, M)                    # router GEMM -> route -> gate_up -> down + combine
    moe.run(x, out, M, topk=(ids, w))     # given routing (tests, benchmarks)

Letters: M tokens, H hidden, I expert intermediate (per rank), E experts, P = M * topk pairs.
Weights are in the layout of ddtree/plugins/layout.py, stacked over experts. Every workspace is
allocated here for max_tokens; run() only launches, so it can be captured in a CUDA graph, and no
step reads anything back to the host (the tile count stays on the device).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import SkinnyGemm

SOURCE = "moe.cu"
STAGE_BYTES = 2 * (32 * 16 + 32 * 8)               # W4Stage: one warp's ring slot (two tiles + scales)
MAX_EXPERTS, MAX_PAIRS, MAX_TOPK = 512, 4096, 32


@dataclass(frozen=True)
class MoEShape:
    hidden: int                   # H
    inter: int                    # I per rank
    experts: int                  # E
    topk: int
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0          # routed_scaling_factor
    max_tokens: int = 256

    def __post_init__(self):
        if self.hidden % 64 or self.inter % 64:
            raise ValueError(f"MoE kernel needs hidden and inter multiples of 64, got {self.hidden}, {self.inter}")
        if not 1 <= self.topk <= min(MAX_TOPK, self.experts) or self.experts > MAX_EXPERTS:
            raise ValueError(f"MoE kernel: need topk <= 32, topk <= experts <= {MAX_EXPERTS}; "
                             f"got topk {self.topk}, experts {self.experts}")
        if not 1 <= self.max_tokens <= 256 or self.max_tokens * self.topk > MAX_PAIRS:
            raise ValueError(f"MoE kernel: max_tokens must be in [1, 256] with max_tokens * topk <= {MAX_PAIRS}")
        if self.n_group > 1 and (self.experts % self.n_group or self.n_group > 32
                                 or not 1 <= self.topk_group <= self.n_group):
            raise ValueError(f"MoE kernel: bad grouping n_group {self.n_group}, topk_group {self.topk_group} "
                             f"for {self.experts} experts")

    def max_tiles(self, M: int) -> int:
        """Upper bound of sum_e ceil(count_e / 8) over any routing of M tokens."""
        pairs = M * self.topk
        return (pairs + 7 * min(self.experts, pairs)) // 8


@dataclass(frozen=True)
class MoEPlan:
    tiles: int        # grid z: max tiles (blocks past the real count exit at once)
    gu_warps: int
    gu_tpw: int       # pairs of 16-row tiles per warp
    gu_nb: int
    gu_splits: int
    gu_smem: int
    dn_warps: int
    dn_tpw: int
    dn_nb: int
    dn_smem: int


def plan_moe(shape: MoEShape, M: int, sm_count: int, smem_limit: int, stages: int, gu_splits: int | None = None,
             gu_warps: int | None = None, gu_tpw: int = 1, dn_warps: int | None = None,
             dn_tpw: int | None = None) -> MoEPlan:
    """Split-K for gate_up so that even M = 1 (8 tiles) covers the SMs; the deepest ring that fits."""
    tiles = shape.max_tiles(M)
    busy_tiles = min(tiles, max(M * shape.topk // 8, min(M * shape.topk, shape.experts)))   # typical
    kc, ring = shape.hidden // 64, stages * STAGE_BYTES

    def x_bytes(kspan):
        return 8 * (kspan + 32) * 2

    # as many warps per block as fit with a modest k-split: the dequant + mma chains need occupancy
    gu_warps = gu_warps or max([w for w in (16, 8, 4) if x_bytes(min(shape.hidden, 2048)) + w * ring <= smem_limit]
                               or [4])
    gu_nb = -(-(shape.inter // 8) // (gu_warps * 2 * gu_tpw))
    if gu_splits is None:
        fits = [s for s in range(1, kc + 1) if kc % s == 0 and x_bytes(kc // s * 64) + gu_warps * ring <= smem_limit
                and kc // s >= min(8, kc)]
        if not fits:
            raise ValueError(f"MoE gate_up: hidden {shape.hidden} has no k-split that fits {smem_limit} B of smem")
        want = [s for s in fits if busy_tiles * gu_nb * s >= 0.9 * sm_count]   # H200 sweep: S=2 beat S=4 at M=1
        gu_splits = want[0] if want else fits[-1]
    elif kc % gu_splits:
        raise ValueError(f"MoE gate_up: splits {gu_splits} must divide hidden / 64 = {kc}")
    gu_smem = x_bytes(kc // gu_splits * 64) + gu_warps * ring
    # down: with a short K (I <= 512: TP8) each warp has few chunks per tile, so fewer warps with two tile
    # pairs each keep the rings busy (H200 sweep, TP8: -15 % at M = 16..64); TP1: 8 warps x one pair
    short_k = shape.inter // 64 <= 8
    dn_tpw = dn_tpw or (2 if short_k else 1)
    dn_warps = dn_warps or (4 if short_k else
                            max([w for w in (8, 4) if x_bytes(shape.inter) + w * ring <= smem_limit] or [4]))
    dn_nb = -(-(shape.hidden // 16) // (dn_warps * 2 * dn_tpw))
    dn_smem = x_bytes(shape.inter) + dn_warps * ring
    if max(gu_smem, dn_smem) > smem_limit:
        raise ValueError(f"MoE: shared memory {max(gu_smem, dn_smem)} B exceeds the device's {smem_limit}")
    return MoEPlan(tiles, gu_warps, gu_tpw, gu_nb, gu_splits, gu_smem, dn_warps, dn_tpw, dn_nb, dn_smem)


class FusedMoE:
    def __init__(self, gpu: Gpu, shape: MoEShape, weights: dict[str, DeviceArray],
                 router: DeviceArray | None = None, bias: DeviceArray | None = None):
        """weights: {"gate_up", "gate_up_scale", "down", "down_scale"} device arrays stacked over experts
        (layout.repack_experts); router (layout.tile_bf16 of the [E, H] bf16 gate) and bias [E] fp32 are
        needed only for routed runs."""
        E, H, I = shape.experts, shape.hidden, shape.inter
        want = {"gate_up": (E, I // 16, H // 64, 2, 32, 4), "gate_up_scale": (E, I // 16, H // 64, 2, 8, 4),
                "down": (E, H // 32, I // 64, 2, 32, 4), "down_scale": (E, H // 32, I // 64, 2, 8, 4)}
        for key, shp in want.items():
            if key not in weights or tuple(weights[key].shape) != shp:
                got = tuple(weights[key].shape) if key in weights else "missing"
                raise ValueError(f"FusedMoE: weights[{key!r}] must be {list(shp)}, got {got}")
        self.gpu, self.shape, self.w, self.router, self.bias = gpu, shape, weights, router, bias
        self._overrides: dict[int, MoEPlan] = {}
        self.stages = gpu.defines(SOURCE)["DD_STAGES"]
        mx = shape.max_tokens
        plans = [self.plan(m) for m in range(1, mx + 1)]
        P = mx * shape.topk
        self.topk_ids = gpu.alloc((mx, shape.topk), np.int32)
        self.topk_w = gpu.alloc((mx, shape.topk), np.float32)
        self.tile_expert = gpu.alloc(shape.max_tiles(mx), np.int32)
        self.tile_pairs = gpu.alloc((shape.max_tiles(mx), 8), np.int32)
        self.num_tiles = gpu.zeros(1, np.int32)
        self.act = gpu.alloc((P, I), np.uint16)
        self.y = gpu.alloc((P, H), np.float32)
        part = max(p.tiles * p.gu_nb * p.gu_splits * p.gu_warps * 2 * p.gu_tpw * 32 * 4 for p in plans)
        self.gu_partial = gpu.alloc(part, np.float32)
        self.gu_counters = gpu.zeros(max(p.tiles * p.gu_nb for p in plans), np.uint32)
        self.dn_counters = gpu.zeros(mx * max(p.dn_nb for p in plans), np.uint32)
        self.logits = None
        if router is not None:
            self.logits = gpu.alloc((mx, E), np.float32)
            self.router_gemm = SkinnyGemm(gpu, E, H, mx, out_f32=True)

    def plan(self, M: int) -> MoEPlan:
        if M in self._overrides:
            return self._overrides[M]
        return plan_moe(self.shape, M, self.gpu.sm_count, self.gpu.smem_optin, self.stages)

    def override(self, M: int, **kw) -> MoEPlan:
        """Benchmark sweeps: force plan_moe keywords for M (grows the workspaces if the plan needs more;
        call it before capturing a graph)."""
        p = plan_moe(self.shape, M, self.gpu.sm_count, self.gpu.smem_optin, self.stages, **kw)
        part = p.tiles * p.gu_nb * p.gu_splits * p.gu_warps * 2 * p.gu_tpw * 32 * 4
        if part > self.gu_partial.shape[0]:
            self.gu_partial = self.gpu.alloc(part, np.float32)
        if p.tiles * p.gu_nb > self.gu_counters.shape[0]:
            self.gu_counters = self.gpu.zeros(p.tiles * p.gu_nb, np.uint32)
        if self.shape.max_tokens * p.dn_nb > self.dn_counters.shape[0]:
            self.dn_counters = self.gpu.zeros(self.shape.max_tokens * p.dn_nb, np.uint32)
        self._overrides[M] = p
        return p

    def route(self, x: DeviceArray | int, M: int, stream=None) -> None:
        """Router logits (fp32) + top-k + alignment."""
        if self.router is None:
            raise ValueError("FusedMoE.route: constructed without router weights")
        self.router_gemm.run(x, self.router, self.logits, M, stream=stream)
        self._launch_route(self.logits, M, self.topk_ids, self.topk_w, stream)

    def _launch_route(self, logits, M, ids, weights, stream) -> None:
        s = self.shape
        self.gpu.launch(self.gpu.kernel(SOURCE, "moe_route"), 1, 1024, 0,
                        ptr(logits), ptr(self.bias), np.int32(M), np.int32(s.experts), np.int32(s.topk),
                        np.int32(s.n_group), np.int32(s.topk_group), np.float32(s.scaling), ptr(ids), ptr(weights),
                        ptr(self.tile_expert), ptr(self.tile_pairs), ptr(self.num_tiles), stream=stream)

    def run(self, x: DeviceArray | int, out: DeviceArray | int, M: int, shared: DeviceArray | int | None = None,
            topk: tuple | None = None, stream=None) -> None:
        """out[M, H] bf16 = sum_k w_k expert_k(x) (+ shared[M, H]). topk = (ids [M, topk] int32,
        weights [M, topk] fp32) device arrays skips the router and uses that routing."""
        if not 1 <= M <= self.shape.max_tokens:
            raise ValueError(f"FusedMoE: M = {M} outside [1, {self.shape.max_tokens}]")
        if topk is None:
            self.route(x, M, stream)
            ids, weights = self.topk_ids, self.topk_w
        else:
            ids, weights = topk
            self._launch_route(None, M, ids, weights, stream)
        self.experts(x, out, M, ids, weights, shared, stream)

    def experts(self, x, out, M, ids, weights, shared=None, stream=None) -> None:
        """gate_up + down/combine, after the route kernel filled the tile lists."""
        s, p, g = self.shape, self.plan(M), self.gpu
        g.allow_smem(SOURCE, "moe_gate_up", p.gu_smem)
        g.allow_smem(SOURCE, "moe_down", p.dn_smem)
        g.launch(g.kernel(SOURCE, "moe_gate_up"), (p.gu_nb, p.gu_splits, p.tiles), p.gu_warps * 32, p.gu_smem,
                 ptr(x), ptr(self.w["gate_up"]), ptr(self.w["gate_up_scale"]), ptr(self.tile_expert),
                 ptr(self.tile_pairs), ptr(self.num_tiles), ptr(self.act), ptr(self.gu_partial),
                 ptr(self.gu_counters), np.int32(s.hidden), np.int32(s.inter // 8), np.int32(s.topk),
                 np.int32(p.gu_splits), np.int32(p.gu_tpw), stream=stream)
        g.launch(g.kernel(SOURCE, "moe_down"), (p.dn_nb, 1, p.tiles), p.dn_warps * 32, p.dn_smem,
                 ptr(self.act), ptr(self.w["down"]), ptr(self.w["down_scale"]), ptr(self.tile_expert),
                 ptr(self.tile_pairs), ptr(self.num_tiles), ptr(self.y), ptr(weights), ptr(shared), ptr(out),
                 ptr(self.dn_counters), np.int32(s.inter), np.int32(s.hidden // 16), np.int32(s.topk),
                 np.int32(p.dn_tpw), stream=stream)
