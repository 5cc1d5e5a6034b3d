"""The streaming MoE launch (kernels/moe_stream.cuh, issue 22): gate_up -> down in one persistent kernel.

    plan = plan_stream(shape, M, base, sm_count, smem_limit, l2_bytes)   # base: plan_moe's MoEPlan for M
    items = stream_items(tiles, plan)                                    # the kernel's ticket -> work item
    pinned = pinned_items(tiles, plan)                                  # block b's pinned down item (plan.pin)
    y = simulate_stream(x, ids, w, packed, plan)                        # numpy twin of the schedule

Blocks take work items by ticket: first every gate_up item (tile z, k-split, n-block), then every down item
(tile z, n-block); a down item fills its weight ring, then waits until its tile's act rows are complete
(ready[z] == gu_nb). The sums are the two-kernel path's (moe_gate_up, moe_down at one down k-split) in the
same order, so at the same gate_up k-split the output is bitwise theirs.
Letters as in plugins/moe.py: M tokens, H hidden, I expert intermediate, P = M * topk pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.plugins.reference import as_float, expert_dense, silu

STAGE_BYTES = 2 * (32 * 16 + 8 * 8)     # one chunk of a warp's ring slot: two tiles' INT4 + their scales
REGS_PER_THREAD = 128                   # __launch_bounds__(512, 1) of moe_stream: at most 128 registers
DOWN_WAVES = 2                          # default down items per block of the grid (at least), plan_stream
BAR_BYTES = 8                           # one mbarrier a warp and ring slot (bulk plans)
STATIC_SMEM = 256                       # left of the opt-in limit to the kernel's static shared memory (192 B)


# Where the streaming launch (moe_stream) is the plan's choice, by (arch, hidden, inter per rank): (first M, last M,
# plan_stream / gate_up knobs) of the ranges measured faster. H200, Kimi tp 8 (7168, 256), one device call
# (ddtree/plugins/kernels/NOTES.md "MoE streaming (issue 22)", us, two launches -> this plan): M = 1 27.1 -> 25.1 with
# bulk copies and the pinned down item; 9 / 12 / 16 / 17 / 33 / 65 91.5 -> 87.6 / 117.2 -> 106.2 / 131.9 -> 127.7 /
# 137.1 -> 132.6 / 220.5 -> 208.0 / 329.9 -> 311.5 with 8-warp blocks two an SM, k-split 4 and 7 tile pairs a down
# warp; 2..8 slower than the two launches by 5-50 % whatever the knobs tried; above 65 not measured, the plain
# streaming plan (an earlier call: 318 vs 327 us at 65, taken for the trend). Elsewhere (tp 1, other models and
# archs: not measured) the two launches run. 9..64 rows went back to the two launches after the whole step was
# measured (H200, rank 0 of tp 8, 4K, budget 16, one call, two launches -> streamed at 17 rows): uniform routing
# 16744 -> 16681 us, tree routing with reuse 0.5 (67 experts a layer) 14412 -> 15379; at 65 rows (budget 64)
# these knobs beat the plain streaming plan under both routings (33884 -> 33040, 31513 -> 29446). One row went back
# to the two launches with moe_down_cols (H100, bench moe: 23.5 us against this plan's 26.9 with bulk copies and the
# pinned down item, which stay knobs; the AR step 6266 -> 6063 us: plugins/moe_down_cols.py COLS_MEASURED).
STREAM_MEASURED = {("sm_90", 7168, 256): ((65, 65, dict(gu_warps=8, gu_splits=4, blocks_per_sm=2, dn_tpw=7)),
                                          (66, 256, {}))}


def _measured(arch: str, shape, M: int):
    for first, last, knobs in STREAM_MEASURED.get((arch.rstrip("a"), shape.hidden, shape.inter), ()):
        if first <= M <= last:
            return knobs
    return None


def stream_default(arch: str, shape, M: int) -> bool:
    """Whether FusedMoE(streaming=None) takes the streaming launch at M tokens (the measured table above)."""
    return _measured(arch, shape, M) is not None


def stream_knobs(arch: str, shape, M: int) -> dict:
    """The streaming plan's knobs at M where measured (plan_stream's: bulk, pin, dn_tpw, blocks_per_sm; plan_moe's
    gu_warps, gu_splits), else {}."""
    return dict(_measured(arch, shape, M) or {})


def x_bytes(kspan: int) -> int:
    """Shared memory of a work item's 8 activation rows (+64 B pad each) and its bias corrections."""
    return 8 * (kspan + 32) * 2 + 2 * kspan


@dataclass(frozen=True)
class StreamPlan:
    tiles: int            # max tiles of M tokens (the workspaces' bound)
    warps: int
    ring: tuple           # (slots, chunks per slot) of both parts' rings
    gu_tpw: int
    gu_nb: int            # gate_up n-blocks per tile
    gu_splits: int        # gate_up k-splits (the two-kernel plan's: same sums)
    dn_tpw: int
    dn_nb: int            # down n-blocks per tile (one k-split)
    smem: int
    blocks: int           # the persistent grid
    prefetch_tiles: int   # L2 prefetch of the down weights when a launch has at most this many tiles (0: never)
    bulk: bool = False    # ring slots as bulk copies (copy engine, one mbarrier a slot) instead of cp.async a lane
    pin: bool = False     # (bulk) block b owns down item b from its start: its weights requested before gate_up
    inter_chunks: int = 0  # inter / 64 (down's chunks per tile pair)

    @property
    def pin_slots(self) -> int:
        """Ring slots of a pinned down item a warp (all its chunks: one k-split of inter / 64)."""
        return self.dn_tpw * self.inter_chunks // self.ring[1]

    @property
    def kernel(self) -> str:
        return "moe_stream_r%dc%d" % self.ring + ("_bulk" if self.bulk else "")


def plan_stream(shape, M: int, base, sm_count: int, smem_limit: int, l2_bytes: int = 0, dn_tpw: int | None = None,
                blocks_per_sm: int | None = None, prefetch: int | None = None, bulk: bool = False,
                pin: bool = False) -> StreamPlan:
    """The stream plan for M tokens on top of `base` (plan_moe's MoEPlan for M: gate_up warps, k-split, tile pairs
    per warp and ring, which every item shares). Knobs (sweeps): dn_tpw (down tile pairs per warp; default: the
    most that divide the n-tiles evenly and still leave DOWN_WAVES items per block of the grid at the typical tile
    count: longer items amortise a down item's fixed latency, which one block per SM does not hide),
    blocks_per_sm (default: as many as the shared memory and 128 registers a thread allow), prefetch (the tile
    count up to which gate_up items prefetch the down weights into L2; default 0: off, 1.2 us slower at tp 8,
    M = 1 on the H200), bulk (the slots as bulk copies: nwarps x slots mbarriers more shared memory), pin (bulk
    only: each block's first down item pinned to it, its weights in their own shared memory, requested at the
    block's start; its slots a warp at most the ring's, the kernel's slot walk)."""
    H, I = shape.hidden, shape.inter
    ring, warps = tuple(base.gu_ring), base.gu_warps
    if (I // 64) % ring[1]:
        raise ValueError(f"MoE stream: inter / 64 = {I // 64} chunks is not a multiple of the ring's {ring[1]} "
                         f"chunks per slot")
    if pin and not bulk:
        raise ValueError("MoE stream: pin needs bulk (the pinned slots are bulk copies)")
    smem = max(x_bytes(H // base.gu_splits), x_bytes(I)) + warps * ring[0] * (ring[1] * STAGE_BYTES + BAR_BYTES * bulk)
    threads = warps * 32

    def blocks_fit(smem):
        if smem + STATIC_SMEM > smem_limit:
            raise ValueError(f"MoE stream: shared memory {smem} B (+ {STATIC_SMEM} static) exceeds the device's "
                             f"{smem_limit}")
        return max(1, min((smem_limit + 1024) // (smem + STATIC_SMEM + 1024), 2048 // threads,
                          65536 // (threads * REGS_PER_THREAD)))

    fit = blocks_fit(smem)
    n_tiles = H // 16
    if dn_tpw is None:
        pairs = M * shape.topk
        typical = min(base.tiles, max(pairs // 8, min(pairs, shape.experts)))      # plan_moe's busy tiles
        even = [t for t in range(1, n_tiles // (2 * warps) + 1) if n_tiles % (2 * warps * t) == 0]
        per_grid = sm_count * (blocks_per_sm or fit)
        dn_tpw = max([t for t in even if typical * (n_tiles // (2 * warps * t)) >= DOWN_WAVES * per_grid] or [1])
    pin_slots = dn_tpw * (I // 64) // ring[1]
    if pin:
        if pin_slots > ring[0]:
            raise ValueError(f"MoE stream: a pinned down item's {pin_slots} slots a warp exceed the ring's {ring[0]}")
        smem += warps * pin_slots * (ring[1] * STAGE_BYTES + BAR_BYTES)
        fit = blocks_fit(smem)
    if blocks_per_sm is not None and not 1 <= blocks_per_sm <= fit:
        raise ValueError(f"MoE stream: blocks_per_sm {blocks_per_sm} outside [1, {fit}] (shared memory, registers)")
    blocks = sm_count * (blocks_per_sm or fit)
    dn_nb = -(-n_tiles // (warps * 2 * dn_tpw))
    return StreamPlan(base.tiles, warps, ring, base.gu_tpw, base.gu_nb, base.gu_splits, dn_tpw, dn_nb, smem,
                      blocks, int(prefetch or 0), bool(bulk), bool(pin), I // 64)


def pinned_count(tiles: int, plan: StreamPlan) -> int:
    """Down items pinned to blocks (stream_impl's n_pin): block b < this runs down item b."""
    return min(plan.blocks, tiles * plan.dn_nb) if plan.pin else 0


def stream_items(tiles: int, plan: StreamPlan) -> list[tuple]:
    """Ticket order of the kernel's queue: ("gate_up", z, split, n-block) for every tile z, then ("down", z, n-block)
    for the down items past the pinned ones: the decoding of stream_impl."""
    per_tile, n_pin = plan.gu_nb * plan.gu_splits, pinned_count(tiles, plan)
    items = []
    for ticket in range(tiles * (per_tile + plan.dn_nb) - n_pin):
        if ticket < tiles * per_tile:
            z, r = divmod(ticket, per_tile)
            by, bx = divmod(r, plan.gu_nb)
            items.append(("gate_up", z, by, bx))
        else:
            items.append(("down",) + divmod(ticket - tiles * per_tile + n_pin, plan.dn_nb))
    return items


def pinned_items(tiles: int, plan: StreamPlan) -> list[tuple]:
    """The pinned down items, block b's at b: ("down", z, n-block). A block runs its item after drawing a ticket
    past the gate_up items (every gate_up item is then held by a block that does not wait)."""
    return [("down",) + divmod(d, plan.dn_nb) for d in range(pinned_count(tiles, plan))]


def schedule(tiles: int, plan: StreamPlan) -> list[tuple]:
    """One order the kernel's items may complete in: the gate_up tickets, the pinned items, the queue's down items."""
    queue = stream_items(tiles, plan)
    n_gu = sum(item[0] == "gate_up" for item in queue)
    return queue[:n_gu] + pinned_items(tiles, plan) + queue[n_gu:]


def first_round(n_items: int, blocks: int, look_ahead: bool) -> list[int]:
    """Items each block holds after its first ticket when the blocks start one after another (the launch's ramp
    at its extreme: each draws its tickets before the next starts), drawing the next ticket ahead or not (the
    kernel: ahead unless the queue holds at most `blocks` items). Why the queue within the grid does not look
    ahead: its items then run on distinct blocks, not two a block on half of them."""
    held, ticket = [0] * blocks, 0
    for b in range(blocks):
        for _ in range(2 if look_ahead else 1):
            if ticket < n_items:
                held[b] += 1
                ticket += 1
    return held


def looks_ahead(n_items: int, blocks: int) -> bool:
    """stream_impl's rule: draw the next ticket ahead unless the queue's items fit the grid."""
    return n_items > blocks


def align_tiles(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Twin of route_common.cuh align_tiles (pairs of an expert in pair order; the kernel's order within an
    expert follows its atomics): ids [M, topk] -> tile_expert [T], tile_pairs [T, 8] (-1 padding)."""
    flat = ids.reshape(-1)
    tile_expert, tile_pairs = [], []
    for e in np.unique(flat):
        pairs = np.nonzero(flat == e)[0]
        for i in range(0, len(pairs), 8):
            tile_expert.append(e)
            tile_pairs.append(np.pad(pairs[i:i + 8], (0, 8 - len(pairs[i:i + 8])), constant_values=-1))
    return np.array(tile_expert, np.int32), np.array(tile_pairs, np.int32).reshape(-1, 8)


def simulate_stream(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, packed: dict, plan: StreamPlan,
                    shared: np.ndarray | None = None) -> np.ndarray:
    """Numpy twin of moe_stream's schedule (float64): items in ticket order, each on exactly its slice of the
    kernel (gate_up: its n-tiles' 16 fused rows over its k-split; down: its n-tiles' 16 rows), the split
    partials and the combine handed off by counters as in the kernel. Checks what the kernel relies on: a down
    item finds its tile's act complete, every act row and output element is written exactly once.
    x [M, H], ids / weights [M, topk], packed: kernel-layout experts -> y [M, H]."""
    M, topk = ids.shape
    H = x.shape[1]
    x = as_float(x, np.float64)
    tile_expert, tile_pairs = align_tiles(ids)
    tiles = len(tile_expert)
    gu_rows = plan.warps * 2 * plan.gu_tpw           # fused 16-row n-tiles of a gate_up n-block
    dn_rows = plan.warps * 2 * plan.dn_tpw           # 16-row n-tiles of a down n-block
    dense = {}

    def expert(e):
        if e not in dense:
            dense[e] = (expert_dense(packed["gate_up"][e], packed["gate_up_scale"][e]),   # [2I] fused rows
                        expert_dense(packed["down"][e], packed["down_scale"][e]))         # [H, I]
        return dense[e]

    I = expert(tile_expert[0])[0].shape[0] // 2
    kspan = H // plan.gu_splits
    partial = {}
    arrived = np.zeros((tiles, plan.gu_nb), int)
    ready = np.zeros(tiles, int)
    act = np.full((M * topk, I), np.nan)
    y = np.full((M * topk, H), np.nan)
    out = np.full((M, H), np.nan)
    token_count = np.zeros((M, plan.dn_nb), int)
    for item in schedule(tiles, plan):
        z = item[1]
        pairs = tile_pairs[z][tile_pairs[z] >= 0]
        gate_up, down = expert(tile_expert[z])
        if item[0] == "gate_up":
            _, _, by, bx = item
            f0, f1 = bx * gu_rows, min(I // 8, (bx + 1) * gu_rows)          # fused tiles f: gate and up rows 8f..
            rows = np.concatenate([np.arange(16 * f, 16 * f + 16) for f in range(f0, f1)]) if f1 > f0 else []
            k = slice(by * kspan, (by + 1) * kspan)
            partial[z, bx, by] = x[pairs // topk][:, k] @ gate_up[rows][:, k].T   # [pairs, 16 (f1 - f0)]
            arrived[z, bx] += 1
            if arrived[z, bx] < plan.gu_splits:
                continue
            total = sum(partial[z, bx, s] for s in range(plan.gu_splits))        # fixed split order
            for i, f in enumerate(range(f0, f1)):
                gate, up = total[:, 16 * i:16 * i + 8], total[:, 16 * i + 8:16 * i + 16]
                assert np.isnan(act[pairs, 8 * f:8 * f + 8]).all(), f"act of tile {z} written twice"
                act[pairs, 8 * f:8 * f + 8] = silu(gate) * up
            ready[z] += 1
        else:
            _, _, bx = item
            assert ready[z] == plan.gu_nb, f"down item of tile {z} before its act rows"
            n = slice(16 * bx * dn_rows, min(H, 16 * (bx + 1) * dn_rows))
            assert np.isnan(y[pairs, n]).all()
            y[pairs, n] = act[pairs] @ down[n].T
            for tok in np.unique(pairs // topk):
                token_count[tok, bx] += np.count_nonzero(pairs // topk == tok)
                if token_count[tok, bx] == topk:                               # the last expert block of tok
                    assert np.isnan(out[tok, n]).all()
                    out[tok, n] = sum(weights[tok, j] * y[tok * topk + j, n] for j in range(topk))
                    if shared is not None:
                        out[tok, n] += as_float(shared[tok:tok + 1], np.float64)[0, n]
    assert not np.isnan(act).any() and not np.isnan(out).any(), "an act row or output element was never written"
    return out
