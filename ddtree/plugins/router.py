"""Launcher for the fused MoE router (kernels/router.cu), 1 <= M <= max_tokens <= 256 tokens.

    router = FusedRouter(gpu, RouterShape(experts, hidden, topk, ...), weight, bias)
    router.run(x, M, logits, ids, weights, tiles)               # logits, top-k, tile lists: one launch
    router.run(x, M, logits, ids, weights, tiles, given=True)   # ids given: logits + tile lists only
    router.run(..., live=live, routed_ids=routed)                 # a pruned verify: dead rows on the root's experts

Letters: M tokens, H hidden (K of the GEMM), E experts, S k-splits, W warps a block, TW weight tiles (16
experts) a block, KW = W / TW warps a tile, MT 8-token sub-tiles a block, MB token blocks, NB = E/16/TW
n-blocks, L lanes a row in the route phase. The weight comes tiled (layout.tile_bf16), the bias fp32 or None.
Workspaces (split partials, the scores [max_tokens, E] that route_rows reads, hand-off counters) are allocated
here for max_tokens; run() only launches (graph-safe). FusedMoE.route uses it (plugins/moe.py); the kernel
writes the outputs of the router GEMM + moe_route pair it replaces.

A pruned verify's live mask (issue 53) is applied inside the launch, before the alignment (plugins/prune_ops.py
live_args and route_live_twin, the rule's numpy twin).

select_ref is the numpy twin of the kernel's top-k selection, one warp a token, L = 16 lanes a token or
G = ceil(E / 32) warps (checked against routing.topk_lowest_id on the CPU); the routing rule's twin is
ddtree/model/routing.py route_logits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import supports_pdl, token_tiles
from ddtree.plugins.prune_ops import live_args

SOURCE = "router.cu"
MAX_WARPS = 16                          # RT_MAX_WARPS in router.cu
LANE_EXPERTS = 16                       # RT_EPL: E <= 512
ROW_SLOTS = {32: LANE_EXPERTS, 16: 24}  # experts a lane of route_rows<L, SL> (router.cu): E <= 512 at 32, 384 at 16
WARP_CHOICES = (1, 2, 4, 8, 16)        # 1 and 2 serve short hiddens (the tiny model: 128 = 2 chunks)
# Cost model of plan_router (us). Guesses from the H200's datasheet and the route kernel's timings in
# kernels/NOTES.md, to be replaced by a fit to tests/plugins/sweep_router.py's sweep.
DRAM_B_PER_US = 4.0e6                   # the weights stream once from HBM
SM_B_PER_US = 5.0e4                     # what one SM pulls from L2 (weights, token rows, partials)
HANDOFF_US = 0.5                        # one hand-off: barrier, ticket (acq_rel atomic), barrier
ROUTE_US = 1.0                          # one token routed by one warp (~7 us before the loads were hoisted)
BLOCK_ROUTE_US = 0.6                    # one token routed by G = ceil(E / 32) warps (route_block)
# The folded hand-off (fitted to the H200 sweep at 1..3 rows, tests/plugins/sweep_router.py --few, kernels/NOTES.md):
FOLD_ROUND_US = 0.65                    # the last block's pass over rows x E logits: an L2 round trip a 32 W items
FOLD_SAVED_US = 1.0                     # saved beyond HANDOFF_US: the logits' L2 round trip, the second ticket
# The kernel's static shared memory, bounded (144 B in the sm_90 cubin: arrive_last's flag, align_tiles' 32 warp
# totals): a block's static + dynamic bytes must fit the device's opt-in limit, so plans leave this much of it.
# (Before it, the sm_90 plans of 129..144 rows took the whole 232448 B beside 16 static bytes.)
STATIC_SMEM = 256


def check_routing(who: str, experts: int, topk: int, n_group: int, topk_group: int, max_tokens: int,
                  max_experts: int) -> None:
    """The routing shape both routing kernels take (this fused router and moe.cu's moe_route), or a ValueError
    naming `who` and the bad value."""
    if not 1 <= topk <= min(32, experts) or experts > max_experts:
        raise ValueError(f"{who}: need 1 <= topk <= 32, topk <= experts <= {max_experts}; "
                         f"got topk {topk}, experts {experts}")
    if not 1 <= max_tokens <= 256:
        raise ValueError(f"{who}: max_tokens must be in [1, 256], got {max_tokens}")
    if n_group > 1 and (experts % n_group or n_group > 32 or not 1 <= topk_group <= n_group):
        raise ValueError(f"{who}: bad grouping n_group {n_group}, topk_group {topk_group} for {experts} experts")


@dataclass(frozen=True)
class RouterShape:
    experts: int                  # E
    hidden: int                   # H = K
    topk: int
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0          # routed_scaling_factor
    max_tokens: int = 256

    def __post_init__(self):
        if self.hidden % 64 or self.hidden < 64:
            raise ValueError(f"fused router: hidden must be a positive multiple of 64, got {self.hidden}")
        check_routing("fused router", self.experts, self.topk, self.n_group, self.topk_group, self.max_tokens,
                      32 * LANE_EXPERTS)


@dataclass(frozen=True)
class RouterPlan:
    mt: int          # 8-token sub-tiles a block (1..8)
    mb: int          # token blocks
    warps: int       # W
    tiles: int       # TW: 16-expert weight tiles a block
    nb: int          # n-blocks
    splits: int      # S
    smem: int        # dynamic shared memory, bytes
    fold: bool = False      # one hand-off to the last of all S x NB blocks: it sums every partial, routes from smem
    route_warps: int = 1    # G: warps a token in the routing block (route_block when > 1; folded plans only)
    lanes: int = 0          # L: lanes a row of route_rows from the stored scores (16 or 32: row_lanes,
                            # lanes_allowed) or 0: a warp a token from the logits (route_token)

    @property
    def kw(self) -> int:
        return self.warps // self.tiles

    @property
    def blocks(self) -> int:
        return self.mb * self.splits * self.nb

    @property
    def kernel(self) -> str:
        return f"router_fused_mt{self.mt}"

    def partial_floats(self, M: int, E: int) -> int:
        return self.splits * M * E if self.splits > 1 else 0


def _up16(n: int) -> int:
    return -(-n // 16) * 16


def router_smem(M: int, shape: RouterShape, mt: int, warps: int, tiles: int, splits: int, fold: bool = False,
                route_warps: int = 1, lanes: int = 0) -> int:
    """Bytes of dynamic shared memory: the largest of the kernel's phases (router.cu's table)."""
    E, k = shape.experts, shape.topk
    chunks = shape.hidden // 64 // splits
    per_warp = -(-chunks // (warps // tiles))
    gemm = 8 * mt * (chunks * 64 + 32) * 2 + warps * per_warp * 2048
    kw_sum = warps * mt * 32 * 16 if warps > tiles else 0
    rows = min(M, 8 * mt)
    ids = _up16(M * k * 4) if -(-M // (8 * mt)) == 1 else 0          # one token block: the ids' shared copy
    logits = _up16(rows * E * 4) + _up16(E * 4) if fold else 0         # folded: the logits rows and the bias
    if lanes:                                # route_rows: the bias, a round's scores, each segment's candidates
        segments = warps * 32 // lanes
        scratch = E + min(rows, segments) * E + segments * (2 * k * -(-E // lanes) + k)
    elif route_warps > 1:                    # route_block
        scratch = rows * (36 + 98 * k)
    else:                                    # warp_topk, a warp a token
        scratch = warps * (3 * k * -(-E // 32) + 2 * k)
    route = ids + logits + scratch * 4
    align = ids + (2 * E + 1) * 4 + M * k * 2
    return max(gemm, kw_sum, route, align)


def spread_warps(rows: int, warps: int, shape: RouterShape) -> int:
    """G of a folded plan: ceil(E / 32) warps a token (route_block: one expert a thread) where the block has
    them for every row and G >= topk (the k-th warp best bounds the top-k) and the routing is not grouped
    (n_group > 1 needs a token's experts in one warp); else 1 (a warp a token)."""
    g = -(-shape.experts // 32)
    return g if shape.n_group == 1 and g >= shape.topk and rows * g <= warps else 1


def lanes_allowed(shape: RouterShape, fold: bool) -> tuple[int, ...]:
    """The lanes a row the kernel's route phase takes (router.cu): 0 (route_token, a warp a token from the
    logits) always; route_rows (the scores stored by the logits' writers) unfolded (a folded plan's logits are
    in shared memory), ungrouped (n_group > 1 needs a token's experts in one warp) and with E % 4 == 0 (rows of
    scores staged in 16-byte copies): 32, and 16 where topk <= 16 (the topk-th of 16 lane maxima) and E <= 384
    (the kernel's 24 experts a lane)."""
    if fold or shape.n_group > 1 or shape.experts % 4:
        return (0,)
    return (0, 32, 16) if shape.topk <= 16 and shape.experts <= 16 * ROW_SLOTS[16] else (0, 32)


def row_lanes(rows: int, warps: int, shape: RouterShape, fold: bool) -> int:
    """L the plan prefers: 16 (route_rows, two rows a warp: 17..32 rows in one round of 16 warps instead of two,
    33..64 in two instead of three or four) where the block routes more rows than 16 and than its warps (more
    than one round of a warp a token) and 16 lanes are allowed (lanes_allowed); else 0 (route_token, as before:
    1..16 rows keep it; 32 lanes only when forced, by FusedRouter.override)."""
    return 16 if rows > max(16, warps) and 16 in lanes_allowed(shape, fold) else 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_cost(M: int, shape: RouterShape, p: RouterPlan, sm_count: int) -> float:
    """Modelled microseconds of one launch (module constants above)."""
    E, K = shape.experts, shape.hidden
    rows = min(M, 8 * p.mt)
    chunks = K // 64 // p.splits
    block_bytes = p.tiles * chunks * 2048 + rows * chunks * 128
    load = max(E * K * 2 / DRAM_B_PER_US, -(-p.blocks // sm_count) * block_bytes / SM_B_PER_US)
    if p.fold:
        reduce = -(-rows * E // (32 * p.warps)) * FOLD_ROUND_US - FOLD_SAVED_US
    else:
        reduce = p.splits * rows * min(16 * p.tiles, E) * 4 / SM_B_PER_US if p.splits > 1 else 0.0
    handoffs = (p.mb > 1) + ((p.splits * p.nb > 1) if p.fold else (p.splits > 1) + (p.nb > 1))
    if p.route_warps > 1:
        route = BLOCK_ROUTE_US
    else:
        route = -(-rows // (p.warps * 32 // (p.lanes or 32))) * ROUTE_US
    return load + reduce + handoffs * HANDOFF_US + route


def plan_router(M: int, shape: RouterShape, sm_count: int, smem_limit: int, warps: int | None = None,
                tiles: int | None = None, splits: int | None = None, fold: bool | None = None) -> RouterPlan:
    """Token blocks of <= 64 rows (gemm.token_tiles, the skinny GEMM's); W, TW, S and fold (forced by the knobs,
    for sweeps) by the smallest plan_cost among the plans whose shared memory (dynamic + STATIC_SMEM) fits
    `smem_limit` (the device's opt-in bytes a block), each warp with >= 1
    chunk unless K has fewer chunks than a block's warps (the route phase still uses them all). A folded plan
    routes with spread_warps warps a token; an unfolded one with row_lanes lanes a row where that fits."""
    E, kc = shape.experts, shape.hidden // 64
    nt = -(-E // 16)
    if warps is not None and warps not in WARP_CHOICES:
        raise ValueError(f"fused router: warps must be one of {WARP_CHOICES}, got {warps}")
    if splits is not None and (splits < 1 or kc % splits):
        raise ValueError(f"fused router: splits {splits} must divide hidden / 64 = {kc}")
    if tiles is not None and not 1 <= tiles <= min(nt, MAX_WARPS):
        raise ValueError(f"fused router: tiles {tiles} must be in [1, {min(nt, MAX_WARPS)}] (16 experts each)")
    mt, mb = token_tiles(M)
    options = []
    for w in (warps,) if warps else WARP_CHOICES:
        for tw in (tiles,) if tiles else [d for d in range(1, min(nt, w) + 1)]:
            if w % tw:
                continue
            for s in (splits,) if splits else _divisors(kc):
                if kc // s < w // tw and not (s == 1 and kc < w // tw):
                    continue                          # a warp without a chunk, unless K itself is that short:
                                                      # the route phase still uses every warp (a token a warp)
                nb = -(-nt // tw)
                folds = (False, True) if s > 1 and nb > 1 else (False,)   # a fold saves a hand-off only there
                for fo in (fold,) if fold is not None else folds:
                    g = spread_warps(min(M, 8 * mt), w, shape) if fo else 1
                    smem = router_smem(M, shape, mt, w, tw, s, fo, g)
                    if smem + STATIC_SMEM <= smem_limit:
                        options.append(RouterPlan(mt, mb, w, tw, nb, s, smem, fo, g))
    if not options:
        raise ValueError(f"fused router: no plan for M = {M} (warps {warps}, tiles {tiles}, splits {splits}, "
                         f"fold {fold}) "
                         f"fits {smem_limit} B of shared memory with every warp given a chunk (or K that short)")
    # near-ties (within 3 %: the weights' DRAM floor binds most plans at few rows) go to more warps, then fewer
    # splits: 16 warps were the best or within 2 % at 1, 17 and 65 rows in the H200 sweep (kernels/NOTES.md);
    # then the cheaper of folded or not
    cost = {p: plan_cost(M, shape, p, sm_count) for p in options}
    near = [p for p in options if cost[p] <= 1.03 * min(cost.values())]
    best = min(near, key=lambda p: (-p.warps, p.splits, p.tiles, cost[p]))
    # then the route phase's lanes a row on the knobs chosen as before (the GEMM part of the plan does not
    # change with them): row_lanes' where its shared memory fits, else a warp a token
    lanes = row_lanes(min(M, 8 * mt), best.warps, shape, best.fold)
    smem = router_smem(M, shape, mt, best.warps, best.tiles, best.splits, best.fold, best.route_warps, lanes)
    return replace(best, lanes=lanes, smem=smem) if lanes and smem + STATIC_SMEM <= smem_limit else best


def invariant_knobs(shape: RouterShape, sm_count: int, smem_limit: int) -> dict:
    """The batch-invariant plan's knobs: the warps, tiles and k-splits planned for the row count with the
    widest token block (the most shared memory for token rows), used at every M up to max_tokens."""
    widest = max(range(1, shape.max_tokens + 1), key=lambda m: token_tiles(m)[0])
    p = plan_router(widest, shape, sm_count, smem_limit)
    return {"warps": p.warps, "tiles": p.tiles, "splits": p.splits}


class FusedRouter:
    def __init__(self, gpu: Gpu, shape: RouterShape, weight: DeviceArray | int, bias: DeviceArray | int | None,
                 pdl: bool = True, invariant: bool = False):
        """weight: the [E, H] bf16 router gate in layout.tile_bf16 (device); bias [E] fp32 or None.
        invariant: the batch-invariant plan (docs/interfaces.md section 6): the warps, tiles and k-splits
        planned for max_tokens at every M, so a row's logit sums run in one order whatever the rows beside it."""
        self.gpu, self.shape, self.weight, self.bias = gpu, shape, weight, bias
        self.pdl = pdl and supports_pdl(gpu)
        self._overrides: dict[int, RouterPlan] = {}
        self.fixed = invariant_knobs(shape, gpu.sm_count, gpu.smem_optin) if invariant else {}
        plans = [(m, self.plan(m)) for m in range(1, shape.max_tokens + 1)]
        self.partial = gpu.alloc(max([p.partial_floats(m, shape.experts) for m, p in plans] + [1]), np.float32)
        self.counters = gpu.zeros(max(p.mb * p.nb + p.mb + 1 for _, p in plans), np.uint32)
        # route_rows' sigmoids [M, E], for shapes where some plan (or an override) can take lanes > 0
        self.score = gpu.alloc(shape.max_tokens * shape.experts, np.float32) \
            if lanes_allowed(shape, False) != (0,) else None

    def plan(self, M: int) -> RouterPlan:
        if M in self._overrides:
            return self._overrides[M]
        return plan_router(M, self.shape, self.gpu.sm_count, self.gpu.smem_optin, **self.fixed)

    def override(self, M: int, warps: int | None = None, tiles: int | None = None, splits: int | None = None,
                 fold: bool | None = None, route_warps: int | None = None, lanes: int | None = None) -> RouterPlan:
        """Sweeps: force a plan for M (grows the workspaces if it needs more; call it before capturing);
        route_warps: 1 (a warp a token) or, in a folded plan that can take it, spread_warps' G; lanes: 0 (a warp
        a token from the logits) or route_rows' 32 or 16 lanes a row where lanes_allowed has them."""
        p = plan_router(M, self.shape, self.gpu.sm_count, self.gpu.smem_optin, warps, tiles, splits, fold)
        if route_warps is not None:
            rows = min(M, 8 * p.mt)
            g = spread_warps(rows, p.warps, self.shape) if p.fold else 1
            if route_warps not in (1, g):
                raise ValueError(f"fused router: route_warps {route_warps} must be 1 or {g} ({rows} rows, "
                                 f"{p.warps} warps, fold {p.fold}: G = ceil(E / 32) >= topk, rows G <= warps)")
            smem = router_smem(M, self.shape, p.mt, p.warps, p.tiles, p.splits, p.fold, route_warps, p.lanes)
            if smem + STATIC_SMEM > self.gpu.smem_optin:
                raise ValueError(f"fused router: route_warps {route_warps} needs {smem} B of shared memory")
            p = replace(p, route_warps=route_warps, smem=smem)
        if lanes is not None:
            s = self.shape
            ok = lanes_allowed(s, p.fold)
            if lanes not in ok:
                raise ValueError(f"fused router: lanes {lanes} must be one of {ok} (fold {p.fold}, n_group "
                                 f"{s.n_group}, topk {s.topk}, experts {s.experts})")
            smem = router_smem(M, s, p.mt, p.warps, p.tiles, p.splits, p.fold, p.route_warps, lanes)
            if smem + STATIC_SMEM > self.gpu.smem_optin:
                raise ValueError(f"fused router: lanes {lanes} needs {smem} B of shared memory")
            p = replace(p, lanes=lanes, smem=smem)
        if p.partial_floats(M, self.shape.experts) > self.partial.shape[0]:
            self.partial = self.gpu.alloc(p.partial_floats(M, self.shape.experts), np.float32)
        if p.mb * p.nb + p.mb + 1 > self.counters.shape[0]:
            self.counters = self.gpu.zeros(p.mb * p.nb + p.mb + 1, np.uint32)
        self._overrides[M] = p
        return p

    def run(self, x: DeviceArray | int, M: int, logits, ids, weights, tiles: tuple, given: bool = False,
            stream=None, live=None, routed_ids=None, live_ids=None, live_w=None) -> None:
        """logits [M, E] fp32, ids [M, topk] int32, weights [M, topk] fp32 (written; ids and weights read when
        `given`), tiles = (tile_expert, tile_pairs, num_tiles) as FusedMoE allocates them (written). live: a pruned
        verify's mask [M] int32 (live_args: routed_ids written, and live_ids / live_w, by default ids / weights
        themselves, hold the routing the tiles align); None: as before, the kernel's outputs bit for bit."""
        masks = live_args("fused router", ids, weights, given, live, routed_ids, live_ids, live_w)
        s = self.shape
        if not 1 <= M <= s.max_tokens:
            raise ValueError(f"fused router: M = {M} outside [1, {s.max_tokens}]")
        p, g = self.plan(M), self.gpu
        if p.lanes not in lanes_allowed(s, p.fold):            # the kernel trusts the plan's lanes
            raise ValueError(f"fused router: plan for M = {M} has lanes {p.lanes}, not one of "
                             f"{lanes_allowed(s, p.fold)} (fold {p.fold}, n_group {s.n_group}, topk {s.topk})")
        tile_expert, tile_pairs, num_tiles = tiles
        g.allow_smem(SOURCE, p.kernel, p.smem)
        g.launch(g.kernel(SOURCE, p.kernel), (p.mb, p.splits, p.nb), p.warps * 32, p.smem,
                 ptr(x), ptr(self.weight), ptr(self.bias), ptr(logits), ptr(self.score), ptr(self.partial),
                 ptr(self.counters),
                 ptr(ids), ptr(weights), ptr(tile_expert), ptr(tile_pairs), ptr(num_tiles), np.int32(M),
                 np.int32(s.experts), np.int32(s.hidden), np.int32(p.splits), np.int32(p.tiles), np.int32(s.topk),
                 np.int32(s.n_group), np.int32(s.topk_group), np.float32(s.scaling), np.int32(0 if given else 1),
                 np.int32(p.fold), np.int32(p.route_warps), np.int32(p.lanes), *masks, stream=stream, pdl=self.pdl)


def warp_topk_ref(choice: np.ndarray, k: int, lanes: int = 32) -> list[tuple[float, int]]:
    """One warp's top-k (warp_topk, route_rows<32, 16>), or one segment's of 16 lanes (route_rows<16, 24>), in
    numpy: lane l holds ids l + lanes j, j < ROW_SLOTS[lanes] (past E: -inf); T = the k-th best of the lane
    maxima; the candidates are the elements T does not beat; an id's place is the number of candidates that
    beat it -> [(value, id)] in selection order."""
    E = choice.shape[0]
    per_lane = ROW_SLOTS[lanes]
    if k > lanes or E > lanes * per_lane:
        raise ValueError(f"warp_topk_ref: topk {k} > {lanes} lanes or E {E} > {lanes} x {per_lane} slots")
    slots = [[l + lanes * j for j in range(per_lane)] for l in range(lanes)]
    value = lambda i: choice[i] if i < E else -np.inf     # noqa: E731
    order_key = lambda v, i: (-v, i)                      # noqa: E731   smaller = better
    maxima = sorted((min(((value(i), i) for i in lane), key=lambda a: order_key(*a)) for lane in slots),
                    key=lambda a: order_key(*a))
    t = order_key(*maxima[k - 1])
    cand = [(value(i), i) for lane in slots for i in lane if order_key(value(i), i) <= t]
    if len(cand) > k * -(-E // lanes):
        raise AssertionError(f"warp_topk_ref: {len(cand)} candidates exceed the kernel's buffer of k ceil(E/L)")
    cand.sort(key=lambda a: order_key(*a))
    return cand[:k]


def block_topk_ref(choice: np.ndarray, k: int) -> list[tuple[float, int]]:
    """route_block's top-k, in numpy: warp c holds ids 32 c + l (past E: -inf), G = ceil(E / 32) >= k warps;
    T = the k-th best of the G warp bests; the candidates are the elements T does not beat (<= 32 k); an id's
    place is the number of candidates that beat it -> [(value, id)] in selection order."""
    E = choice.shape[0]
    G = -(-E // 32)
    if G < k:
        raise ValueError(f"block_topk_ref: G = ceil({E} / 32) = {G} < topk {k}")
    value = lambda i: choice[i] if i < E else -np.inf     # noqa: E731
    order_key = lambda v, i: (-v, i)                      # noqa: E731   smaller = better
    bests = sorted((min(((value(i), i) for i in range(32 * c, 32 * c + 32)), key=lambda a: order_key(*a))
                    for c in range(G)), key=lambda a: order_key(*a))
    t = order_key(*bests[k - 1])
    cand = [(value(i), i) for i in range(E) if order_key(value(i), i) <= t]
    if len(cand) > 32 * k:
        raise AssertionError(f"block_topk_ref: {len(cand)} candidates exceed route_block's buffer of 32 k")
    cand.sort(key=lambda a: order_key(*a))
    return cand[:k]


def select_ref(choice: np.ndarray, k: int, route_warps: int = 1, lanes: int = 0) -> np.ndarray:
    """The kernel's selection for one token, in numpy: choice [E] -> the k best ids in selection order
    ((value, lower id) first): one warp (warp_topk_ref; lanes 0 or 32), a segment of 16 lanes (route_rows,
    lanes 16) or, route_warps > 1, route_block (block_topk_ref)."""
    chosen = warp_topk_ref(choice, k, lanes or 32) if route_warps == 1 else block_topk_ref(choice, k)
    return np.array([i for _, i in chosen], dtype=np.int64)


def route_ref(logits: np.ndarray, bias: np.ndarray | None, shape: RouterShape, route_warps: int = 1,
              lanes: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's routing of fp32 logits [M, E] in numpy float32 (sigmoid, + bias for the choice, the groups'
    top-2 sums, select_ref with route_warps warps or `lanes` lanes a token, weights normalised in selection order)
    -> ids [M, topk], weights [M, topk]."""
    M, E = logits.shape
    k, one = shape.topk, np.float32(1.0)
    ids = np.zeros((M, k), np.int64)
    weights = np.zeros((M, k), np.float32)
    for m in range(M):
        score = one / (one + np.exp(-logits[m].astype(np.float32)))
        choice = score + (np.float32(0.0) if bias is None else bias.astype(np.float32))
        if shape.n_group > 1:
            grouped = choice.reshape(shape.n_group, -1)
            top2 = -np.sort(-grouped, axis=1)[:, :2]
            group_score = top2[:, 0] + top2[:, 1]
            kept = np.argsort(-group_score, kind="stable")[:shape.topk_group]
            mask = np.zeros(shape.n_group, bool)
            mask[kept] = True
            choice = np.where(np.repeat(mask, E // shape.n_group), choice, -np.inf).astype(np.float32)
        ids[m] = select_ref(choice, k, route_warps, lanes)
        picked = score[ids[m]]
        total = np.float32(0.0)
        for s in picked:                                     # selection order, fp32
            total = np.float32(total + s)
        weights[m] = picked / (total + np.float32(1e-20)) * np.float32(shape.scaling)
    return ids, weights
