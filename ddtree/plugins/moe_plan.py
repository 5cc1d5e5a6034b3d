"""The fused W4A16 MoE's plans (kernels/moe.cu; launcher plugins/moe.py FusedMoE): the shapes, the compiled rings
and occupancy variants, plan_moe (the two launches: gate_up k-splits, warps, tiles a warp, ring; down tile pairs)
and plan_moe_stream (the streaming launch's plan on top of it). Host-only: no GPU needed, so every plan can be
checked against sm_90's and sm_120's shared memory on the CPU (tests/plugins/test_plans.py)."""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.plugins.moe_stream import STAGE_BYTES, StreamPlan, plan_stream
from ddtree.plugins.router import check_routing

SOURCE = "moe.cu"
RINGS = ((6, 1), (3, 2), (4, 2), (5, 2), (2, 4))   # (slots, chunks per slot) compiled in moe.cu (DD_MOE_RING)
# Default ring per arch. H200 sweep (ddtree/plugins/kernels/NOTES.md): two 1 KB chunks per slot (one 2.3 KB request per warp) beat
# deeper one-chunk rings at equal or more bytes in flight; 4 x 2 fits 16 gate_up warps at k-split 2 in
# 227 KB. sm_120 (99 KB per block): 3 x 2 keeps the smem of the former 6 x 1 ring.
DEFAULT_RING = {"sm_90": (4, 2), "default": (3, 2)}
ONE_CHUNK_RING = (6, 1)                            # fallback when a k span is not a whole number of slots
# Occupancy variants compiled in moe.cu (DD_MOE_*_OCC): (kernel, ring, warps a block, blocks an SM) at <= 80 registers
OCC_KERNELS = {("gate_up", (3, 2), 8, 3), ("gate_up", (3, 2), 4, 6), ("down", (6, 1), 4, 6), ("down", (6, 1), 8, 3)}
MAX_EXPERTS, MAX_PAIRS = 512, 4096
class RingMismatch(ValueError):
    """A kernel's k span (chunks per split) is not a multiple of its ring's chunks per slot."""

    def __init__(self, which: str, message: str):
        super().__init__(message)
        self.which = which


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
        check_routing("MoE kernel", self.experts, self.topk, self.n_group, self.topk_group, self.max_tokens,
                      MAX_EXPERTS)
        if self.max_tokens * self.topk > MAX_PAIRS:
            raise ValueError(f"MoE kernel: max_tokens * topk = {self.max_tokens * self.topk} > {MAX_PAIRS} pairs")

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
    gu_ring: tuple    # (slots, chunks per slot) of each warp's cp.async ring
    dn_warps: int
    dn_tpw: int
    dn_nb: int
    dn_splits: int    # down k-splits: partial rows y[s] summed by the combine
    dn_smem: int
    dn_ring: tuple
    gu_occ: int = 1   # blocks an SM the gate_up kernel is compiled for (1: the 512-thread bound; else OCC_KERNELS)
    dn_occ: int = 1

    @property
    def gate_up_kernel(self) -> str:
        occ = "_w%do%d" % (self.gu_warps, self.gu_occ) if self.gu_occ > 1 else ""     # OCC_KERNELS
        return "moe_gate_up_r%dc%d" % self.gu_ring + occ

    @property
    def down_kernel(self) -> str:
        occ = "_w%do%d" % (self.dn_warps, self.dn_occ) if self.dn_occ > 1 else ""     # OCC_KERNELS
        return "moe_down_r%dc%d" % self.dn_ring + occ


def plan_moe(shape: MoEShape, M: int, sm_count: int, smem_limit: int, ring: tuple, **knobs) -> MoEPlan:
    """Split-K for gate_up so that even M = 1 (8 tiles) covers the SMs; as many warps as fit.
    `ring` = (slots, chunks per slot) of both kernels unless knobs gu_ring / dn_ring pick another of RINGS;
    a kernel whose k span is not a whole number of `ring` slots (small shapes) gets ONE_CHUNK_RING.
    Other knobs (sweeps and tests): gu_splits, gu_warps, gu_tpw, dn_warps, dn_tpw, dn_splits, and gu_occ / dn_occ
    (blocks an SM: the OCC_KERNELS variant at that ring and warps, <= 80 registers; its shared memory must fit)."""
    try:
        return _plan_moe(shape, M, sm_count, smem_limit, ring, **knobs)
    except RingMismatch as exc:
        if knobs.get(exc.which):                   # a forced ring that does not fit the shape: say so
            raise
        return plan_moe(shape, M, sm_count, smem_limit, ring, **{**knobs, exc.which: ONE_CHUNK_RING})


def _plan_moe(shape: MoEShape, M: int, sm_count: int, smem_limit: int, ring: tuple, gu_splits: int | None = None,
              gu_warps: int | None = None, gu_tpw: int = 1, dn_warps: int | None = None,
              dn_tpw: int | None = None, dn_splits: int | None = None, gu_ring: tuple | None = None,
              dn_ring: tuple | None = None, gu_occ: int = 1, dn_occ: int = 1) -> MoEPlan:
    short_k = shape.inter // 64 <= 8              # TP8: I = 256, 4 chunks per tile pair in the down kernel
    # H200 parts timing: with so few chunks per warp the down kernel is faster on one-chunk slots (TP8 M = 16:
    # 48 vs 54 us), while gate_up (K = 7168) gains from two-chunk slots at every shape
    gu_ring, dn_ring = tuple(gu_ring or ring), tuple(dn_ring or (ONE_CHUNK_RING if short_k else ring))
    for ring_choice in (gu_ring, dn_ring):
        if ring_choice not in RINGS:
            raise ValueError(f"MoE: ring {ring_choice} is not compiled; choose from {RINGS}")
    tiles = shape.max_tiles(M)
    busy_tiles = min(tiles, max(M * shape.topk // 8, min(M * shape.topk, shape.experts)))   # typical
    kc, ring = shape.hidden // 64, gu_ring[0] * gu_ring[1] * STAGE_BYTES

    def x_bytes(kspan):           # 8 token rows (+64 B pad each) + the bias correction (2 float4 per 64 k)
        return 8 * (kspan + 32) * 2 + 2 * kspan

    # as many warps per block as fit with a modest k-split: the dequant + mma chains need occupancy
    gu_warps = gu_warps or max([w for w in (16, 8, 4) if x_bytes(min(shape.hidden, 2048)) + w * ring <= smem_limit]
                               or [4])
    gu_nb = -(-(shape.inter // 8) // (gu_warps * 2 * gu_tpw))
    if gu_splits is None:
        fits = [s for s in range(1, kc + 1) if kc % s == 0 and x_bytes(kc // s * 64) + gu_warps * ring <= smem_limit
                and kc // s >= min(8, kc)]
        if not fits:
            raise ValueError(f"MoE gate_up: hidden {shape.hidden} has no k-split that fits {smem_limit} B of smem")
        fits = [s for s in fits if (kc // s) % gu_ring[1] == 0]
        if not fits:
            raise RingMismatch("gu_ring", f"MoE gate_up: no k-split of hidden / 64 = {kc} chunks is a multiple "
                                          f"of the ring's {gu_ring[1]} chunks per slot")
        want = [s for s in fits if busy_tiles * gu_nb * s >= 0.9 * sm_count]   # H200 sweep: S=2 beat S=4 at M=1
        gu_splits = want[0] if want else fits[-1]
    elif kc % gu_splits:
        raise ValueError(f"MoE gate_up: splits {gu_splits} must divide hidden / 64 = {kc}")
    elif (kc // gu_splits) % gu_ring[1]:
        raise RingMismatch("gu_ring", f"MoE gate_up: splits {gu_splits} must divide hidden / 64 = {kc} into a "
                                      f"multiple of {gu_ring[1]} chunks")
    gu_smem = x_bytes(kc // gu_splits * 64) + gu_warps * ring
    # down: with a short K (I <= 512: TP8) each warp has few chunks per tile, so fewer warps with two tile
    # pairs each keep the rings busy (H200 sweep, TP8: -15 % at M = 16..64); TP1: 8 warps x one pair
    dn_ring_bytes = dn_ring[0] * dn_ring[1] * STAGE_BYTES
    dn_tpw = dn_tpw or (2 if short_k else 1)
    dn_warps = dn_warps or (4 if short_k else
                            max([w for w in (8, 4) if x_bytes(shape.inter) + w * dn_ring_bytes <= smem_limit] or [4]))
    dn_nb = -(-(shape.hidden // 16) // (dn_warps * 2 * dn_tpw))
    dn_splits = dn_splits or 1
    ic = shape.inter // 64
    if ic % dn_splits:
        raise ValueError(f"MoE down: splits {dn_splits} must divide inter / 64 = {ic}")
    if (ic // dn_splits) % dn_ring[1]:
        raise RingMismatch("dn_ring", f"MoE down: splits {dn_splits} must divide inter / 64 = {ic} into a "
                                      f"multiple of {dn_ring[1]} chunks")
    dn_smem = x_bytes(shape.inter // dn_splits) + dn_warps * dn_ring_bytes
    if max(gu_smem, dn_smem) > smem_limit:
        raise ValueError(f"MoE: shared memory {max(gu_smem, dn_smem)} B exceeds the device's {smem_limit}")
    for part, ring_, warps, occ, smem in (("gate_up", gu_ring, gu_warps, gu_occ, gu_smem),
                                          ("down", dn_ring, dn_warps, dn_occ, dn_smem)):
        check_occupancy(part, ring_, warps, occ, smem, smem_limit)
    return MoEPlan(tiles, gu_warps, gu_tpw, gu_nb, gu_splits, gu_smem, gu_ring, dn_warps, dn_tpw, dn_nb, dn_splits,
                   dn_smem, dn_ring, gu_occ, dn_occ)


def check_occupancy(part: str, ring: tuple, warps: int, occ: int, smem: int, smem_limit: int) -> None:
    """An occupancy knob above 1 names a compiled variant (OCC_KERNELS) whose blocks fit an SM's shared memory
    occ at a time (each block's dynamic bytes + 1 KB reserved, the SM holding the opt-in limit + 1 KB)."""
    if occ == 1:
        return
    if (part, tuple(ring), warps, occ) not in OCC_KERNELS:
        have = sorted((r, w, o) for p, r, w, o in OCC_KERNELS if p == part)
        raise ValueError(f"MoE {part}: no kernel for ring {tuple(ring)}, {warps} warps, {occ} blocks an SM; "
                         f"compiled (ring, warps, blocks): {have}")
    if occ * (smem + 1024) > smem_limit + 1024:
        raise ValueError(f"MoE {part}: {occ} blocks an SM of {smem} B shared memory exceed the SM's "
                         f"{smem_limit + 1024}")


def plan_moe_stream(shape: MoEShape, M: int, sm_count: int, smem_limit: int, ring: tuple, l2_bytes: int = 0,
                    base: MoEPlan | None = None, dn_tpw: int | None = None, blocks_per_sm: int | None = None,
                    prefetch: int | None = None, bulk: bool = False, pin: bool = False,
                    **gate_up_knobs) -> StreamPlan:
    """The streaming launch's plan at M (plugins/moe_stream.py plan_stream): the gate_up part of `base` (default
    plan_moe with gate_up_knobs: gu_splits, gu_warps, gu_tpw, gu_ring) for every item; one ring for both parts,
    so a ring whose slots do not divide down's k span (inter / 64 chunks) becomes ONE_CHUNK_RING."""
    base = base or plan_moe(shape, M, sm_count, smem_limit, ring, **gate_up_knobs)
    if (shape.inter // 64) % base.gu_ring[1]:
        base = plan_moe(shape, M, sm_count, smem_limit, ring, gu_splits=base.gu_splits, gu_warps=base.gu_warps,
                        gu_tpw=base.gu_tpw, gu_ring=ONE_CHUNK_RING)
    return plan_stream(shape, M, base, sm_count, smem_limit, l2_bytes, dn_tpw, blocks_per_sm, prefetch, bulk, pin)
