"""Launcher for the absorbed-MLA per-head projections (kernels/mla_absorb.cu), the op set's mla_absorb_q and
mla_absorb_out:

    absorb = MlaAbsorb(gpu, heads=8, nope=128, v=128, latent=512)      # one per layer shape, max_tokens 256
    w_uk_t = gpu.upload(uk_transposed(kv_b, heads, nope, v))           # once at load: W_UK^T [N_r, R, Dn]
    absorb.q(q_all, w_uk_t, q_lat, M, rope=Dr)                          # q_nope read inside q_all
    absorb.q_rope(q_all, w_uk_t, q_lat, q_rope, pos, table, M)          # + q_pe roped into q_rope, one launch
    absorb.out(o_lat, kv_b, o, M)                                       # kv_b [N_r (Dn + Dv), R] as stored

Weights: absorb_out reads W_UV from kv_b in the checkpoint's layout; absorb_q needs W_UK with its rows along
Dn, so its half of kv_b is transposed once at load (uk_transposed). An engine keeps W_UK^T and kv_b (or
kv_b's W_UV rows: pass their buffer with w_head = Dv R); the numpy twins read kv_b itself.
Plans (token block MT, K split over warps) are fixed per (M, shape), so run() only launches (graph-safe).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import supports_pdl

SOURCE = "mla_absorb.cu"
MAX_WARPS = 8                                      # ABSORB_MAX_WARPS in mla_absorb.cu
MAX_TOKENS = 256


@dataclass(frozen=True)
class AbsorbPlan:
    mt: int          # 8-token sub-tiles per block (1, 2, 4)
    mb: int          # token blocks
    ks: int          # warps per block, each 1 / ks of K

    def grid(self, heads: int, n_out: int) -> tuple[int, int, int]:
        return n_out // 16, heads, self.mb


def plan_absorb(M: int, heads: int, n_out: int, K: int, sm_count: int, ks: int | None = None) -> AbsorbPlan:
    """Up to 32 tokens per block (MT 4: decode reads each weight once); K split over up to 8 warps while
    the (head, 16-row tile, token block) warps are fewer than 4 per SM and each warp keeps >= 2 k-chunks
    of 32 (absorb_out at tp 8: 64 tiles -> 8 warps each). `ks` forces the K split (the batch-invariant
    plan: the one of M = 1 for every M, so a row's sum runs in the same order whatever its batch)."""
    mt = min(4, 1 << max(0, (-(-M // 8) - 1).bit_length()))
    mb = -(-M // (8 * mt))
    if ks is not None:
        return AbsorbPlan(mt, mb, ks)
    tiles, ks = (n_out // 16) * heads * mb, 1
    while ks < MAX_WARPS and K % (64 * ks) == 0 and tiles * ks < 4 * sm_count:
        ks *= 2
    return AbsorbPlan(mt, mb, ks)


def uk_transposed(kv_b: np.ndarray, heads: int, nope: int, v: int) -> np.ndarray:
    """kv_b [N_r (Dn + Dv), R] (any dtype, bf16 bits kept) -> W_UK^T [N_r, R, Dn], contiguous: absorb_q's
    weight, prepared once at load."""
    w = np.asarray(kv_b).reshape(heads, nope + v, -1)
    return np.ascontiguousarray(w[:, :nope].transpose(0, 2, 1))


class MlaAbsorb:
    """absorb_q / absorb_out of one layer shape (heads N_r, Dn, Dv, R) for M <= max_tokens tokens."""

    def __init__(self, gpu: Gpu, heads: int, nope: int, v: int, latent: int, max_tokens: int = MAX_TOKENS,
                 pdl: bool = True, invariant: bool = False):
        """invariant: the batch-invariant plan (every M takes M = 1's K split over warps)."""
        for name, value, step in (("nope (Dn)", nope, 32), ("v (Dv)", v, 16), ("latent (R)", latent, 32)):
            if value < step or value % step:
                raise ValueError(f"MLA absorb: {name} = {value} must be a positive multiple of {step} "
                                 f"(16-row mma tiles of outputs, 32-wide k chunks)")
        if heads < 1 or not 1 <= max_tokens <= MAX_TOKENS:
            raise ValueError(f"MLA absorb: heads {heads} must be >= 1 and max_tokens {max_tokens} in [1, {MAX_TOKENS}]")
        self.gpu, self.heads, self.nope, self.v, self.latent = gpu, heads, nope, v, latent
        self.max_tokens = max_tokens
        self.pdl = pdl and supports_pdl(gpu)
        # (n_out, K) of absorb_q and absorb_out, and their K splits under the batch-invariant plan (M = 1's)
        self.shapes = {"q": (latent, nope), "out": (v, latent)}
        self.fixed_ks = {k: plan_absorb(1, heads, *nk, gpu.sm_count).ks if invariant else None
                         for k, nk in self.shapes.items()}

    def plan_q(self, M: int) -> AbsorbPlan:
        return plan_absorb(M, self.heads, *self.shapes["q"], self.gpu.sm_count, self.fixed_ks["q"])

    def plan_out(self, M: int) -> AbsorbPlan:
        return plan_absorb(M, self.heads, *self.shapes["out"], self.gpu.sm_count, self.fixed_ks["out"])

    def _launch(self, p: AbsorbPlan, n_out: int, K: int, x, x_tok: int, x_head: int, w, w_head: int, w_row: int,
                out, o_tok: int, o_head: int, M: int, stream, rope: tuple = ()) -> None:
        """rope: the fused rope's trailing kernel arguments (mla_absorb_q_rope_mt<MT>), empty for the plain kernel."""
        if not 1 <= M <= self.max_tokens:
            raise ValueError(f"MLA absorb: M = {M} outside [1, {self.max_tokens}]")
        if any(s % 8 for s in (x_tok, x_head, w_head, w_row)):
            raise ValueError(f"MLA absorb: strides {x_tok, x_head, w_head, w_row} must be multiples of 8 (16-byte loads)")
        name = f"mla_absorb_q_rope_mt{p.mt}" if rope else f"mla_absorb_mt{p.mt}"
        self.gpu.launch(self.gpu.kernel(SOURCE, name), p.grid(self.heads, n_out), p.ks * 32, 0,
                        ptr(x), np.int32(x_tok), np.int32(x_head), ptr(w), np.int64(w_head), np.int32(w_row),
                        ptr(out), np.int32(o_tok), np.int32(o_head), np.int32(M), np.int32(K), *rope,
                        stream=stream, pdl=self.pdl)

    def q(self, q_nope: DeviceArray | int, w_uk_t: DeviceArray | int, q_lat: DeviceArray | int, M: int,
          rope: int = 0, stream=None) -> None:
        """q_nope [M, N_r, Dn], W_UK^T [N_r, R, Dn] (uk_transposed) -> q_lat [M, N_r, R] bf16. rope = Dr reads
        q_nope where it sits inside q_all [M, N_r, Dn + Dr] (head stride Dn + Dr); 0: a dense q_nope."""
        N, Dn, R = self.heads, self.nope, self.latent
        self._launch(self.plan_q(M), R, Dn, q_nope, N * (Dn + rope), Dn + rope, w_uk_t, R * Dn, Dn,
                     q_lat, N * R, R, M, stream)

    def q_rope(self, q_all: DeviceArray | int, w_uk_t: DeviceArray | int, q_lat: DeviceArray | int,
               q_rope: DeviceArray | int, pos: DeviceArray | int, table, M: int, stream=None) -> None:
        """q and the query's rope in one launch: q_all [M, N_r, Dn + Dr] (q_b's output) -> q_lat [M, N_r, R]
        (as q(rope=Dr), the same sums) and q_rope [M, N_r, Dr] dense = rope_interleaved(q_pe, pos) with
        `table` (layer_ops.RopeTable, its dim Dr), the same bits as LayerOps.rope_interleaved from the view."""
        N, Dn, R, Dr = self.heads, self.nope, self.latent, table.dim
        if Dr < 2 or Dr % 2:
            raise ValueError(f"MLA absorb q_rope: the rope table's dim {Dr} must be even and >= 2")
        pe = ptr(q_all) + np.uint64(Dn * 2)                            # q_pe: after q_nope in every head
        self._launch(self.plan_q(M), R, Dn, q_all, N * (Dn + Dr), Dn + Dr, w_uk_t, R * Dn, Dn, q_lat, N * R, R, M,
                     stream, rope=(pe, ptr(q_rope), ptr(pos), ptr(table.table), np.int32(table.max_pos),
                                   np.int32(Dr // 2)))

    def out(self, o_lat: DeviceArray | int, kv_b: DeviceArray | int, o: DeviceArray | int, M: int, stream=None) -> None:
        """o_lat [M, N_r, R] bf16, kv_b [N_r (Dn + Dv), R] as stored -> o [M, N_r Dv] bf16."""
        N, Dn, Dv, R = self.heads, self.nope, self.v, self.latent
        w_uv = ptr(kv_b) + np.uint64(Dn * R * 2)                       # head 0's W_UV rows
        self._launch(self.plan_out(M), Dv, R, o_lat, N * R, R, w_uv, (Dn + Dv) * R, R, o, N * Dv, Dv, M, stream)
