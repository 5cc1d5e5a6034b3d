// Skinny GEMM past 16 rows with the tokens as the mma's M side (issue 22): out[M, N] = x[M, K] @ w[N, K]^T
// (+ residual), or the SwiGLU epilogue of gemm.cu. Included by gemm.cu (one module); numpy twin
// ddtree/plugins/reference.py gemm; launcher plugins/gemm.py (GemmPlan.tm).
//
// Why it was tried: gemm.cu's loop puts 16 weight rows in A and 8 tokens in B, and past 16 rows it looked
// issue-bound (ncu at 65 rows: DRAM 30 %, 4.7 cycles between a warp's instructions; ddtree/plugins/kernels/NOTES.md
// "what binds"): the A fragment {row g, row g + 8} is assembled from two ring reads (register moves), each x fragment
// is one LDS.128 per 8 tokens, and every cp.async recomputes its ring address. Measured (the same NOTES, 2026-12-03):
// this kernel issues ~40 % of those instructions per mma and is no faster, so it is a sweep knob (SkinnyGemm(tm=True)).
// Here tokens are A (16 a tile) and the
// weights B: a tile's rows g and g + 8 are two n8 mma whose B fragments are halves of one ring read (no moves);
// the token rows sit in shared memory in A-fragment order, so one conflict-free LDS.128 is one A fragment; the
// ring's chunk slots are unrolled, so copies and reads use immediate offsets.
//
//   x [M, K] bf16   w [ceil(N/16), K/64, 4, 32] uint4 (layout.tile_bf16)   residual [M, N] bf16 or null (may alias out)
//   out [M, N] bf16 | fp32 (out_f32), or swiglu: [M, N / 2] bf16 (N % 16 == 0, no residual)
//   partial [NB, MB, S, warps * G, TT, 2, 32] float4 and counters [NB * MB] when S > 1
// Grid (MB = ceil(M / 16 TT), S, NB), block warps * 32; a warp owns G consecutive 16-row weight tiles.
// dynamic smem = 16 TT * (K / S) * 2 (token rows) + warps * NS * G * 2 KB (weight ring; NS = TmSlots<G>).
//
// Shared memory of the token rows: xa[tt][c][h][s][lane] uint4 = the A fragment of 16-token tile tt, chunk c,
// half h and k step s: {x[g][k0..1], x[g+8][k0..1], x[g][k2..3], x[g+8][k2..3]} with k0 = 32h + 8t + 4s (the
// permuted k of layout.tile_bf16, the order gemm.cu reads x in), g = lane / 4, t = lane % 4.
// Each output's k sum runs chunk by chunk, h then s, as in gemm.cu; within one mma the hardware's order may
// differ from gemm.cu's transposed product, so the bits may differ from it (the batch-invariant plan keeps gemm.cu).
#pragma once

template <int G>
struct TmSlots {                    // chunk slots of a warp's ring: ~16 KB of weights a warp, at least 3 slots
    static constexpr int value = G == 1 ? 8 : G == 2 ? 4 : 3;
};

template <int TT, int G>
struct GemmTm {
    static constexpr int NS = TmSlots<G>::value;
    typedef float Acc[TT][2][4];   // [token tile][tile rows g | g + 8 as n8 halves][C fragment]

    // ring slot s of a warp: [G tiles][4 = 2 h + (row g | row g + 8)][32 lanes] uint4
    static __device__ __forceinline__ void issue(uint4* ring, const uint4* const (&wt)[G], int chunk, int slot,
                                                 int chunks, u64 policy, int lane) {
        if (chunk < chunks) {
#pragma unroll
            for (int j = 0; j < G; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    cp_async16_stream(ring + ((slot * G + j) * 4 + q) * 32 + lane, wt[j] + (size_t)chunk * 128 + 32 * q,
                                      policy);
        }
        cp_async_commit();                                   // empty past the last chunk: the group count stays fixed
    }

    static __device__ __forceinline__ void compute(Acc (&acc)[G], const uint4* ring, const uint4* xa, int slot,
                                                   int c, int tt_stride, int lane) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint4 wg[G], wg8[G];
#pragma unroll
            for (int j = 0; j < G; ++j) {
                wg[j] = ring[((slot * G + j) * 4 + 2 * h) * 32 + lane];
                wg8[j] = ring[((slot * G + j) * 4 + 2 * h + 1) * 32 + lane];
            }
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) {
                const uint4 f0 = xa[tt * tt_stride + (c * 4 + 2 * h) * 32 + lane];
                const uint4 f1 = xa[tt * tt_stride + (c * 4 + 2 * h + 1) * 32 + lane];
                const u32 a0[4] = {f0.x, f0.y, f0.z, f0.w}, a1[4] = {f1.x, f1.y, f1.z, f1.w};
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    mma_bf16_16816(acc[j][tt][0], a0, wg[j].x, wg[j].y);     // rows g:     k 8t + 0..3
                    mma_bf16_16816(acc[j][tt][0], a1, wg[j].z, wg[j].w);     //             k 8t + 4..7
                    mma_bf16_16816(acc[j][tt][1], a0, wg8[j].x, wg8[j].y);   // rows g + 8
                    mma_bf16_16816(acc[j][tt][1], a1, wg8[j].z, wg8[j].w);
                }
            }
        }
    }

    // C fragment: v[tt][nh] = {(m, n), (m, n + 1), (m + 8, n), (m + 8, n + 1)}, m = row0 + 16 tt + g,
    // n = 16 tile + 8 nh + 2t
    static __device__ __forceinline__ void finish(const Acc& v, int tile, int row0, int M, int N, int g, int t,
                                                  const bf16_t* residual, void* out, int out_f32, int swiglu) {
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int m = row0 + 16 * tt + g + 8 * q;
                if (m >= M) continue;
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    if (swiglu) {                                // gate = tile row g (nh 0), up = row g + 8 (nh 1)
                        const int ch = tile * 8 + 2 * t + e;
                        if (2 * ch < N) {
                            const float gate = bf16_to_f32(f32_to_bf16(v[tt][0][2 * q + e]));
                            const float up = bf16_to_f32(f32_to_bf16(v[tt][1][2 * q + e]));
                            ((bf16_t*)out)[(size_t)m * (N >> 1) + ch] = f32_to_bf16(silu(gate) * up);
                        }
                        continue;
                    }
#pragma unroll
                    for (int nh = 0; nh < 2; ++nh) {
                        const int n = tile * 16 + 8 * nh + 2 * t + e;
                        if (n >= N) continue;
                        const size_t o = (size_t)m * N + n;
                        float val = v[tt][nh][2 * q + e];
                        if (residual) val += bf16_to_f32(residual[o]);
                        if (out_f32) ((float*)out)[o] = val;
                        else ((bf16_t*)out)[o] = f32_to_bf16(val);
                    }
                }
            }
    }

    static __device__ __forceinline__ void run(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                               const bf16_t* residual, void* out, float4* __restrict__ partial,
                                               u32* __restrict__ counters, int M, int N, int K, int S, int out_f32,
                                               int swiglu) {
        extern __shared__ __align__(16) unsigned char smem[];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int warps = blockDim.x >> 5;
        const int KC = K >> 6, CPS = KC / S, c0 = blockIdx.y * CPS;
        const int row0 = blockIdx.x * 16 * TT, NT = (N + 15) >> 4, nb = blockIdx.z;
        uint4* xa = (uint4*)smem;                                // [TT][CPS][2 h][2 s][32]
        const int tt_stride = CPS * 128;
        uint4* ring = xa + TT * tt_stride + warp * NS * G * 128;  // this warp's [NS][G][4][32]

        const int tile0 = (nb * warps + warp) * G;
        const uint4* wt[G];                                       // tiles past N re-read the last (never stored)
#pragma unroll
        for (int j = 0; j < G; ++j) wt[j] = (const uint4*)w + ((size_t)min(tile0 + j, NT - 1) * KC + c0) * 128 + lane;
        const u64 policy = evict_first_policy();
        // weights first (independent of earlier kernels): NS - 1 chunks ahead
#pragma unroll
        for (int s = 0; s < NS - 1; ++s) issue(ring, wt, s, s, CPS, policy, lane);
        pdl_wait();                                               // x (and residual) written by the previous kernel
        pdl_trigger();
        // token rows in A-fragment order: item (tt, g, 8 c + 4 h + t) loads rows g and g + 8 of k 8 (8 c + 4 h + t).
        // Plain loads (the fragment interleaves two rows at 4-byte grain, which cp.async cannot), XB items a thread
        // in flight at once: one L2 round trip per XB items instead of one per item.
        constexpr int XB = 8;
        const int per_row = CPS * 8, items = TT * 8 * per_row;
        for (int i0 = threadIdx.x; i0 < items; i0 += XB * blockDim.x) {
            uint4 va[XB], vb[XB];
#pragma unroll
            for (int b = 0; b < XB; ++b) {
                const int i = i0 + b * blockDim.x;
                const int tg = i / per_row, cht = i - tg * per_row, ma = row0 + 16 * (tg >> 3) + (tg & 7);
                const size_t k = (size_t)(c0 * 8 + cht) * 8;
                va[b] = vb[b] = make_uint4(0u, 0u, 0u, 0u);
                if (i < items && ma < M) va[b] = *(const uint4*)(x + (size_t)ma * K + k);
                if (i < items && ma + 8 < M) vb[b] = *(const uint4*)(x + (size_t)(ma + 8) * K + k);
            }
#pragma unroll
            for (int b = 0; b < XB; ++b) {
                const int i = i0 + b * blockDim.x;
                if (i >= items) break;
                const int tg = i / per_row, cht = i - tg * per_row;
                uint4* dst = xa + (tg >> 3) * tt_stride + ((cht >> 3) * 4 + ((cht >> 2) & 1) * 2) * 32 + (tg & 7) * 4 + (cht & 3);
                dst[0] = make_uint4(va[b].x, vb[b].x, va[b].y, vb[b].y);
                dst[32] = make_uint4(va[b].z, vb[b].z, va[b].w, vb[b].w);
            }
        }
        __syncthreads();

        Acc acc[G];
#pragma unroll
        for (int j = 0; j < G; ++j)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                for (int nh = 0; nh < 2; ++nh) acc[j][tt][nh][0] = acc[j][tt][nh][1] = acc[j][tt][nh][2] = acc[j][tt][nh][3] = 0.f;
        for (int cb = 0; cb < CPS; cb += NS) {
#pragma unroll
            for (int s = 0; s < NS; ++s) {                        // slot s holds chunk cb + s
                if (cb + s < CPS) {
                    cp_async_wait<NS - 2>();                      // chunk cb + s landed (this lane's own copies)
                    issue(ring, wt, cb + s + NS - 1, (s + NS - 1) % NS, CPS, policy, lane);
                    compute(acc, ring, xa, s, cb + s, tt_stride, lane);
                }
            }
        }
        cp_async_wait<0>();

        const size_t part_base = ((size_t)nb * gridDim.x + blockIdx.x) * S;
        if (S == 1) {
#pragma unroll
            for (int j = 0; j < G; ++j)
                if (tile0 + j < NT) finish(acc[j], tile0 + j, row0, M, N, g, t, residual, out, out_f32, swiglu);
            return;
        }
        const int ntb = warps * G;
#pragma unroll
        for (int j = 0; j < G; ++j)
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                for (int nh = 0; nh < 2; ++nh)
                    partial[((((part_base + blockIdx.y) * ntb + warp * G + j) * TT + tt) * 2 + nh) * 32 + lane] =
                        make_float4(acc[j][tt][nh][0], acc[j][tt][nh][1], acc[j][tt][nh][2], acc[j][tt][nh][3]);
        if (!arrive_last(&counters[(size_t)nb * gridDim.x + blockIdx.x], (u32)S)) return;
#pragma unroll
        for (int j = 0; j < G; ++j) {
            if (tile0 + j >= NT) continue;
            Acc sum;
#pragma unroll
            for (int tt = 0; tt < TT; ++tt)
#pragma unroll
                for (int nh = 0; nh < 2; ++nh) {
                    sum[tt][nh][0] = sum[tt][nh][1] = sum[tt][nh][2] = sum[tt][nh][3] = 0.f;
                    sum_partials<8>(sum[tt][nh], S, [&](int s) {  // fixed order: deterministic
                        return ld_cg_f4(
                            &partial[((((part_base + s) * ntb + warp * G + j) * TT + tt) * 2 + nh) * 32 + lane]);
                    });
                }
            finish(sum, tile0 + j, row0, M, N, g, t, residual, out, out_f32, swiglu);
        }
    }
};

#define DD_DEFINE_GEMM_TM(NAME, TT, G)                                                                  \
    extern "C" __global__ void __launch_bounds__(DD_GEMM_MAX_WARPS * 32, 1)                             \
    NAME(const bf16_t* x, const bf16_t* w, const bf16_t* residual, void* out, float4* partial,           \
         u32* counters, int M, int N, int K, int S, int out_f32, int swiglu) {                           \
        GemmTm<TT, G>::run(x, w, residual, out, partial, counters, M, N, K, S, out_f32, swiglu);         \
    }
// 17..80 rows in one token block (TT = ceil(M / 16) tiles of 16; 81..256 rows in blocks of <= 5 tiles), one or
// two weight tiles a warp (plugins/gemm.py plan_gemm)
DD_DEFINE_GEMM_TM(gemm_bf16_tm2_g1, 2, 1)
DD_DEFINE_GEMM_TM(gemm_bf16_tm3_g1, 3, 1)
DD_DEFINE_GEMM_TM(gemm_bf16_tm4_g1, 4, 1)
DD_DEFINE_GEMM_TM(gemm_bf16_tm5_g1, 5, 1)
DD_DEFINE_GEMM_TM(gemm_bf16_tm2_g2, 2, 2)
DD_DEFINE_GEMM_TM(gemm_bf16_tm3_g2, 3, 2)
DD_DEFINE_GEMM_TM(gemm_bf16_tm4_g2, 4, 2)
DD_DEFINE_GEMM_TM(gemm_bf16_tm5_g2, 5, 2)
