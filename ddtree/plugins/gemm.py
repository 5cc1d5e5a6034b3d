"""Launcher for the BF16 skinny GEMM (kernels/gemm.cu): out[M, N] = x[M, K] @ w[N, K]^T (+ residual).

For attention projections, shared experts, dense layer 0, the router (fp32 out) and lm_head, M <= 256.
The weight is passed tiled (ddtree.plugins.layout.tile_bf16), once at build time. The weight rows are the mma's
M side (gemm_bf16_mt<MT>, 8-token sub-tiles); SkinnyGemm(tm=True) puts the tokens there past 16 rows instead
(gemm_bf16_tm<TT>_g<G>, kernels/gemm_tm.cuh: 16-token tiles, 17..80 rows in one block; a sweep knob, not faster).
Past 16 rows on a swept device the plan is the sweep's (gemm_measured.py), elsewhere plan_gemm's fitted cost.
All workspaces are allocated in the constructor for max_tokens; run() only launches (graph-safe).
With pdl (default on sm_90+) a launch may start while the previous kernel in the stream drains: it
fills its weight ring, then waits for that kernel before reading x.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm_measured import measured_gemm_knobs

SOURCE = "gemm.cu"
MAX_WARPS = 8                                      # DD_GEMM_MAX_WARPS in gemm.cu
MAX_MT = 9                                         # 8-token sub-tiles a block computes, at most (gemm.cu kernels)
G4_MTS = (3, 5, 9)                                 # token tiles compiled with four tiles a warp (gemm_bf16_mt<MT>_g4)
G4_STAGES = 12                                     # their ring stages a warp (RingStages<4> in gemm.cu)
# 65..72 rows in one block of 9 sub-tiles (the weights streamed once, 72 rows computed instead of 80) for one-tile
# warps of 14..64 MB weights, at the plan's (warps, splits) where the rows fit: H200, tp 8, same call
# (tests/plugins/sweep_gemm_tiles.py), o_proj 27.5 -> 22.9 us, dense_down 48.2 -> 41.2 at 65 rows; where the rows
# do not fit the plan's split (q_a, dense gate_up) other splits were slower (q_a 28.0 -> 34.5), so no change there
ONE_BLOCK_BYTES = (14_000_000, 64 << 20)
WAVES_X_BYTES = 64 * 1024                          # M <= 16: token rows of one k-split, at most
# split-K through distributed shared memory (gemm.cu dsmem): 2..8 splits (the portable cluster size), at most two
# tiles a warp (a warp's partial sits in its own ring once its tiles are done; the one-tile loop over more tiles
# would still be streaming), the 8-row kernels, sm_90+
DSMEM_SPLITS = (2, 8)
# tokens as the mma's M side past 16 rows (kernels/gemm_tm.cuh gemm_bf16_tm<TT>_g<G>): TT 16-token tiles a block,
# G = tpw weight tiles a warp, a ring of TM_SLOTS[G] chunk slots of G tiles a warp
TM_TTS = (2, 3, 4, 5)
TM_SLOTS = {1: 8, 2: 4}


def supports_pdl(gpu) -> bool:
    """Programmatic dependent launch (griddepcontrol) needs sm_90 or newer."""
    return int(gpu.arch[3:].rstrip("a")) >= 90


def token_tiles(M: int, max_mt: int = 8) -> tuple[int, int]:
    """(MT, MB): the fewest token blocks of at most 8 max_mt rows, each with the 8-token sub-tiles it needs (MT =
    1..9, every count compiled): M = 17 -> (3, 1), 33 -> (5, 1), 65 -> (5, 2), or (9, 1) with max_mt 9 (the weights
    streamed once, 72 rows computed instead of 80). A sub-tile past M costs its x loads and mma like a real one
    (the kernel's time grows with MT past 16 rows), so MT is not rounded to a power of two."""
    if not 1 <= max_mt <= MAX_MT:
        raise ValueError(f"skinny GEMM: token sub-tiles per block must be in [1, {MAX_MT}], got {max_mt}")
    sub = -(-M // 8)
    mb = -(-sub // max_mt)
    return -(-sub // mb), mb


def tm_tiles(M: int) -> tuple[int, int]:
    """(TT, MB) of the tokens-as-M kernels: the fewest token blocks of at most 5 tiles of 16 rows (17..80 rows in
    one block: the weights streamed once), each with the tiles it needs."""
    if M <= 16:
        raise ValueError(f"skinny GEMM: the tokens-as-M kernels take M > 16 rows, got M = {M}")
    tiles = -(-M // 16)
    mb = -(-tiles // TM_TTS[-1])
    return -(-tiles // mb), mb


def grouped4(tpw: int, mt: int) -> bool:
    """Four tiles a warp run as one group (gemm_bf16_mt<MT>_g4) at the token tiles compiled for it; other
    token tiles take the one-tile loop of gemm_bf16_mt<MT> at tpw 4."""
    return tpw == 4 and mt in G4_MTS


def ring_stages(tpw: int, mt: int, stages: int) -> int:
    """A warp's ring stages: the source's DD_STAGES, G4_STAGES for the four-tile group kernel."""
    return G4_STAGES if grouped4(tpw, mt) else stages


@dataclass(frozen=True)
class GemmPlan:
    mt: int          # 8-token sub-tiles per block (1 .. MAX_MT)
    mb: int          # token blocks
    warps: int       # warps per block
    tpw: int         # 16-row weight tiles per warp
    nb: int          # n-blocks
    splits: int      # k-splits (S)
    smem: int        # dynamic shared memory bytes
    tm: bool = False  # tokens as the mma's M side (gemm_tm.cuh): mt counts 16-token tiles, tpw is its G
    dsmem: bool = False  # split-K reduced in a (1, S, 1) cluster through distributed shared memory (DSMEM_SPLITS)

    @property
    def blocks(self) -> int:
        return self.mb * self.nb * self.splits

    @property
    def kernel(self) -> str:
        """tm: gemm_bf16_tm<TT>_g<tpw>; tpw 4 at G4_MTS: the four-tile group kernel (x fragments shared by 4
        tiles); else pairs (tpw 2) or one tile at a time."""
        if self.tm:
            return f"gemm_bf16_tm{self.mt}_g{self.tpw}"
        return f"gemm_bf16_mt{self.mt}" + ("_g4" if grouped4(self.tpw, self.mt) else "")

    @property
    def partial_floats(self) -> int:
        """fp32 of the split-K partials (0 at one split): a float4 a lane per (tile, 8-token sub-tile), two per
        16-token tile of the tm kernels."""
        if self.splits == 1 or self.dsmem:
            return 0
        return self.nb * self.mb * self.splits * self.warps * self.tpw * self.mt * 32 * 4 * (2 if self.tm else 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fitted_cost(p: GemmPlan, M: int, N: int, K: int, sm_count: int) -> tuple:
    """plan_gemm's cost past 16 rows (its docstring), ties to fewer splits then fewer warps."""
    chunks = K // 64 // p.splits
    nbytes = N * K * 2 * (1 + 2 * M / (16 * p.warps * p.tpw)) + (16 * p.splits * M * N if p.splits > 1 else 0)
    fill = min(1.0, p.blocks * p.warps / (4 * sm_count))
    return nbytes / (fill * chunks / (chunks + 8)), p.splits, p.warps


def plan_gemm_tm(M: int, N: int, K: int, sm_count: int, smem_limit: int, warps: int | None = None,
                 splits: int | None = None, tpw: int | None = None, x_budget: int | None = None) -> GemmPlan:
    """The tokens-as-M kernels' plan (M > 16): token blocks of tm_tiles, tpw (= G) 2 for weights >= 64 MB
    else 1, 8 warps where any split fits (else 4) and the k-split by plan_gemm's fitted cost, among those whose
    token rows (16 TT rows of K / S) and rings fit the shared memory; `warps`, `splits`, `tpw` force them,
    `x_budget` caps the token rows."""
    kc = K // 64
    if splits is not None and kc % splits:
        raise ValueError(f"skinny GEMM: splits {splits} must divide K / 64 = {kc}")
    tt, mb = tm_tiles(M)
    if tpw is None:
        tpw = 2 if N * K * 2 >= 64 << 20 else 1
    if tpw not in TM_SLOTS:
        raise ValueError(f"skinny GEMM tokens-as-M: weight tiles a warp must be one of {sorted(TM_SLOTS)}, got {tpw}")
    if warps is not None and not 1 <= warps <= MAX_WARPS:
        raise ValueError(f"skinny GEMM: warps per block must be in [1, {MAX_WARPS}], got {warps}")
    x_cap = x_budget or smem_limit
    options = []
    for w in (warps,) if warps else (4, 8):
        ring = w * TM_SLOTS[tpw] * tpw * 2048
        for s in (splits,) if splits else _divisors(kc):
            x_bytes = 16 * tt * (kc // s) * 64 * 2
            if x_bytes <= min(x_cap, smem_limit - ring - 1024):
                options.append(GemmPlan(tt, mb, w, tpw, -(-(-(-N // 16)) // (w * tpw)), s, x_bytes + ring, tm=True))
    if not splits:                          # at least 4 chunks a warp, unless nothing else fits
        options = [p for p in options if kc // p.splits >= 4 or p.splits == 1] or options
    if not options:
        raise ValueError(f"skinny GEMM: K = {K} leaves no k-split whose {16 * tt} token rows fit the shared memory "
                         f"({smem_limit} B a block, the weight ring included)")
    eight = [p for p in options if p.warps == 8]       # the H200 sweep: the best tm plans had 8 warps
    return min(eight or options, key=lambda p: _fitted_cost(p, M, N, K, sm_count))


def plan_gemm(M: int, N: int, K: int, sm_count: int, smem_limit: int, warps: int | None, stages: int,
              splits: int | None = None, tpw: int | None = None, x_budget: int | None = None,
              max_mt: int | None = None) -> GemmPlan:
    """Token blocking, warps per block (`warps` forces it) and split-K (`splits` forces S, which must divide
    K / 64), the block's token rows (one k-split) in shared memory beside the weight ring (at most `x_budget`
    bytes when given: sweeps). Two weight tiles per warp from 9 tokens for weights >= 64 MB: at 9..16 (H200 sweep)
    the blocks' token-row loads and ramps amortised over twice the weights, +5..9 points; past 16 the two tiles
    share each x fragment (gemm.cu paired): lm_head 137 -> 115 us at 33 rows, 249 -> 195 at 65 (H200, same
    call); smaller weights lose the grid to it (q_b, kv_b, the shared expert and router 30-120 % slower).

    The choice, from an H200 sweep of every (warps, splits) plan of Kimi's tp 8 GEMMs at M = 1..65
    (tests/plugins/sweep_gemm.py; the table in ddtree/plugins/kernels/NOTES.md):
    - M <= 16: 4 warps, token rows in <= 64 KB, the k-split with the fewest whole waves of resident blocks times
      the work per block (chunks per warp + a ramp of ~6): within 9 % of the best plan there.
    - M > 16 (the verify's rows), 4 or 8 warps and any split that fits, by a cost fitted to the sweep:
          bytes = W (1 + 2 M / (16 warps tpw))       the weights, and the token rows each n-block re-reads
                + 16 S M N   (S > 1)                 the fp32 split partials, written and read back
          cost  = bytes / (fill ramp),  fill = min(1, blocks warps / (4 SMs)),  ramp = (K/64/S) / (K/64/S + 8)
      (4 warps in flight a SM keep the copies busy; a warp's pipeline takes ~8 chunks to fill): the sweep's
      GEMMs take 13-21 % less time at 17, 33 and 65 rows than under the waves model, whose splits were too many.
    Ties go to fewer splits, then fewer warps. Then 65..72 rows of a one-tile-a-warp plan of a 14..64 MB weight
    take one block of 9 sub-tiles at the same (warps, splits) where its token rows fit (ONE_BLOCK_BYTES).
    `max_mt` forces the token tile's limit (token_tiles) and skips that rule; tpw 4 forces the four-tile group
    kernel (at token tiles G4_MTS; slower than pairs at every tp 8 shape at 17..65 rows, H200: a sweep knob)."""
    if warps is not None and not 1 <= warps <= MAX_WARPS:
        raise ValueError(f"skinny GEMM: warps per block must be in [1, {MAX_WARPS}], got {warps}")
    kc = K // 64
    if splits is not None and kc % splits:
        raise ValueError(f"skinny GEMM: splits {splits} must divide K / 64 = {kc}")
    mt, mb = token_tiles(M, max_mt or 8)
    # the (warps, splits) choice stays the one fitted to the H200 sweep, whose kernel took a power-of-two tile:
    # candidates are held to that tile's shared memory (the sweep's set), then launched with the exact tile
    swept_mt = min(8, 1 << max(0, (-(-M // 8) - 1).bit_length()))
    if tpw is None:
        tpw = 2 if mt >= 2 and N * K * 2 >= 64 << 20 else 1
    fit_mt = max(swept_mt, mt)
    fitted = M > 16
    x_cap = x_budget or (smem_limit if fitted or splits else WAVES_X_BYTES)   # a forced split: the device's limit

    def plan(w: int, s: int) -> GemmPlan | None:
        ring = w * ring_stages(tpw, mt, stages) * 4 * 32 * 16
        if 8 * fit_mt * ((kc // s) * 64 + 32) * 2 > min(x_cap, smem_limit - ring - 1024):
            return None
        x_bytes = 8 * mt * ((kc // s) * 64 + 32) * 2
        return GemmPlan(mt, mb, w, tpw, -(-(-(-N // 16)) // (w * tpw)), s, x_bytes + ring)

    def fitted_cost(p: GemmPlan) -> tuple:
        return _fitted_cost(p, M, N, K, sm_count)

    def waves_cost(p: GemmPlan) -> tuple:
        per_sm = max(1, min(2, (smem_limit + 1024) // (p.smem + 1024)))
        return -(-p.blocks // (per_sm * sm_count)) * (kc // p.splits + 6), p.splits, p.warps

    ws = (warps,) if warps else ((4, 8) if fitted else (4,))
    ss = (splits,) if splits else _divisors(kc)
    options = [p for p in (plan(w, s) for w in ws for s in ss) if p is not None]
    if not splits:                          # at least 4 chunks a warp, unless nothing else fits
        options = [p for p in options if kc // p.splits >= 4 or p.splits == 1] or options
    if not options:
        raise ValueError(f"skinny GEMM: K = {K} leaves no k-split whose token rows fit the shared memory "
                         f"({smem_limit} B a block, the weight ring included)")
    best = min(options, key=fitted_cost if fitted else waves_cost)
    if max_mt is None and best.tpw == 1 and best.mb == 2 and -(-M // 8) <= MAX_MT \
            and ONE_BLOCK_BYTES[0] <= N * K * 2 < ONE_BLOCK_BYTES[1]:
        try:                                # one block of 9 sub-tiles at the same (warps, splits), where it fits
            return plan_gemm(M, N, K, sm_count, smem_limit, best.warps, stages, best.splits, 1, x_budget, MAX_MT)
        except ValueError:
            pass
    return best


def with_dsmem(p: GemmPlan, allowed: bool) -> GemmPlan:
    """p with its split-K reduced through distributed shared memory where allowed and the plan qualifies
    (DSMEM_SPLITS, the 8-row kernels at <= 2 tiles a warp), else p with the global path."""
    ok = allowed and not p.tm and p.tpw <= 2 and DSMEM_SPLITS[0] <= p.splits <= DSMEM_SPLITS[1]
    return p if p.dsmem == ok else replace(p, dsmem=ok)


class SkinnyGemm:
    """out = x @ w.T (+ residual) for one weight shape [N, K] and M <= max_tokens."""

    def __init__(self, gpu: Gpu, N: int, K: int, max_tokens: int = 256, out_f32: bool = False, pdl: bool = True,
                 invariant: bool = False, tm: bool = False, dsmem: bool = False, measured: bool = True):
        """invariant: the batch-invariant plan (docs/interfaces.md section 6): one k-split for every M (the one
        planned for max_tokens, whose token tile is the largest), so a row's sums run in the same order
        whatever the rows beside it; the warps, token tiles and weight tiles per warp still follow M (they
        change which mma computes a row, not the order of its sum). It keeps the 8-row kernels at every M.
        tm: past 16 rows the tokens-as-M kernels (gemm_tm.cuh; plan_gemm_tm), unless invariant (off by default:
        not faster than the 8-row kernels on the H200, ddtree/plugins/kernels/NOTES.md).
        dsmem: split-K plans that allow it (with_dsmem) reduce their partials in a cluster, not in global memory:
        the same sums in the same order (bitwise the global path's), no partial traffic. Off by default for the
        fitted plans: under them it was slower at some shapes (H200, lm_head 65 rows 193.7 -> 237.1 us); the
        measured plans below take it where their sweep did (dense_down 65 rows 41.2 -> 25.1 us).
        measured: the plans an H200 sweep measured faster at this device, weight shape and M (gemm_measured; the
        cluster split-K where they qualify, whatever `dsmem` says), unless invariant or tm."""
        if N < 1 or K % 64:
            raise ValueError(f"skinny GEMM needs K % 64 == 0 (any N >= 1), got N = {N}, K = {K}")
        if not 1 <= max_tokens <= 256:
            raise ValueError(f"skinny GEMM: max_tokens must be in [1, 256], got {max_tokens}")
        self.gpu, self.N, self.K, self.max_tokens, self.out_f32 = gpu, N, K, max_tokens, out_f32
        self.pdl = pdl and supports_pdl(gpu)
        self.smem_limit = gpu.smem_optin
        defs = gpu.defines(SOURCE)
        self.warps, self.stages = defs["DD_WARPS"], defs["DD_STAGES"]
        self._overrides: dict[int, GemmPlan] = {}
        self.tm = tm and not invariant
        self.dsmem = dsmem and supports_pdl(gpu)
        self.measured = measured and not invariant and not self.tm
        self.fixed_splits = None
        if invariant:
            self.fixed_splits = self.plan(max_tokens).splits
        plans = [self.plan(m) for m in range(1, max_tokens + 1)]
        part = max(p.partial_floats for p in plans)
        self.partial = gpu.alloc(max(part, 4), np.float32)
        self.counters = gpu.zeros(max(p.nb * p.mb for p in plans), np.uint32)

    def plan(self, M: int) -> GemmPlan:
        if M in self._overrides:
            return self._overrides[M]
        return self._plan(M)

    def measured_knobs(self, M: int) -> dict | None:
        """The measured table's knobs that plan(M) takes (gemm_measured), None where it takes the fitted plan."""
        return measured_gemm_knobs(self.gpu.arch, self.gpu.sm_count, self.N, self.K, M) if self.measured else None

    def _plan(self, M: int) -> GemmPlan:
        knobs = self.measured_knobs(M)
        if knobs is not None:
            return with_dsmem(plan_gemm(M, self.N, self.K, self.gpu.sm_count, self.smem_limit,
                                        knobs["warps"], self.stages, knobs["splits"], knobs["tpw"], None,
                                        knobs["max_mt"]), knobs["dsmem"])
        if self.tm and M > 16:
            try:
                return plan_gemm_tm(M, self.N, self.K, self.gpu.sm_count, self.smem_limit)
            except ValueError:                # its 16 TT token rows fit no k-split (sm_120's 99 KB): the 8-row kernels
                pass
        return with_dsmem(plan_gemm(M, self.N, self.K, self.gpu.sm_count, self.smem_limit, None, self.stages,
                                    self.fixed_splits), self.dsmem)

    def override(self, M: int, splits: int | None = None, tpw: int | None = None, warps: int | None = None,
                 x_budget: int | None = None, max_mt: int | None = None, tm: bool | None = None,
                 dsmem: bool | None = None) -> GemmPlan:
        """Benchmark sweeps: force a plan for M (grows the workspaces if needed; call before capturing). tm: the
        tokens-as-M kernels (True) or the 8-row ones (False); None: as plan(M) would."""
        use_tm = (self.tm and M > 16) if tm is None else tm
        if use_tm and max_mt is not None:
            raise ValueError("skinny GEMM: max_mt forces the 8-row kernels' token tile; the tokens-as-M kernels "
                             "take tm_tiles")
        if use_tm:
            p = plan_gemm_tm(M, self.N, self.K, self.gpu.sm_count, self.smem_limit, warps, splits, tpw, x_budget)
        else:
            p = plan_gemm(M, self.N, self.K, self.gpu.sm_count, self.smem_limit, warps, self.stages, splits, tpw,
                          x_budget, max_mt)
        p = with_dsmem(p, self.dsmem if dsmem is None else dsmem and supports_pdl(self.gpu))
        if p.smem > self.smem_limit:
            raise ValueError(f"skinny GEMM plan {p} needs {p.smem} B of shared memory; the device allows {self.smem_limit}")
        need = p.partial_floats
        if need > self.partial.shape[0]:
            self.partial = self.gpu.alloc(need, np.float32)
        if p.nb * p.mb > self.counters.shape[0]:
            self.counters = self.gpu.zeros(p.nb * p.mb, np.uint32)
        self._overrides[M] = p
        return p

    def run(self, x: DeviceArray | int, w: DeviceArray | int, out: DeviceArray | int, M: int,
            residual: DeviceArray | int | None = None, stream=None, swiglu: bool = False) -> None:
        """swiglu: w is [gate; up] interleaved per 8 rows (layout.fuse_gate_up of two [N / 2, K]) and out
        [M, N / 2] bf16 = silu(gate) * up, each of gate and up rounded to bf16 first (LayerOps.silu_mul's bits)."""
        if not 1 <= M <= self.max_tokens:
            raise ValueError(f"skinny GEMM: M = {M} outside [1, {self.max_tokens}]")
        if swiglu and (self.N % 16 or self.out_f32 or residual is not None):
            raise ValueError(f"skinny GEMM swiglu: needs N % 16 == 0 (whole 8-channel tiles), bf16 out and no "
                             f"residual; got N = {self.N}, out_f32 = {self.out_f32}, residual = {residual is not None}")
        p = self.plan(M)
        name = p.kernel
        self.gpu.allow_smem(SOURCE, name, p.smem)
        args = [ptr(x), ptr(w), ptr(residual), ptr(out), ptr(self.partial), ptr(self.counters), np.int32(M),
                np.int32(self.N), np.int32(self.K), np.int32(p.splits)]
        if p.tm:                                                      # the tm kernels' tpw is their template G
            args += [np.int32(1 if self.out_f32 else 0), np.int32(1 if swiglu else 0)]
        else:
            args += [np.int32(p.tpw), np.int32(1 if self.out_f32 else 0), np.int32(1 if swiglu else 0),
                     np.int32(1 if p.dsmem else 0)]
        # dsmem: the grid counts clusters of the S k-split blocks
        grid, cluster = ((p.mb, 1, p.nb), (1, p.splits, 1)) if p.dsmem else ((p.mb, p.splits, p.nb), None)
        self.gpu.launch(self.gpu.kernel(SOURCE, name), grid, p.warps * 32, p.smem, *args, stream=stream,
                        pdl=self.pdl, cluster=cluster)
