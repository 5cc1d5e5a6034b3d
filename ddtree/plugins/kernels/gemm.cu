// BF16 skinny GEMM for M <= 256 tokens: out[M, N] = x[M, K] @ w[N, K]^T (+ residual[M, N]), or with swiglu
// out[M, N / 2] = silu(gate) * up where w holds [gate; up] interleaved per 8 rows (layout.fuse_gate_up), so a
// lane's two accumulator rows g | g + 8 of a 16-row tile are the gate and up of one channel: the SwiGLU of
// LayerOps.silu_mul on the bf16-rounded pair, in the epilogue, with no [M, 2I] round trip or extra launch.
// Numpy twin: ddtree/plugins/reference.py gemm. Launcher and split plan: ddtree/plugins/gemm.py
// (SkinnyGemm, plan_gemm).
// Any N, K % 64 == 0. The weight comes tiled (ddtree/plugins/layout.py tile_bf16: rows padded to 16,
// per (16-row tile, 64-k chunk) 2 KB in fragment order), so each warp streams contiguous memory.
//
// Weight rows are the A operand (16 output channels per mma), tokens the B operand (8 per mma), so the
// weight matrix is streamed exactly once per token block of 8 * MT tokens. Each warp owns `tpw`
// 16-row tiles and streams them through a private cp.async ring (evict-first: read once); the block's
// token rows for its k-split sit in shared memory. k is read in the permuted order of
// ddtree/plugins/layout.py (lane t owns k = 32h + 8t .. +8 of each 64-wide chunk).
// Split-K partials are reduced by the last block to arrive (fixed order, deterministic).
// Programmatic dependent launch: the weight ring is filled before griddepcontrol.wait (weights never
// depend on the previous kernel), the token rows and the residual are read after it.
#include "common.cuh"

#define DD_GEMM_MAX_WARPS 8

static_assert(DD_STAGES >= 4, "the paired loop keeps two stages free and two in flight");
struct Bf16Ring {                   // one warp's ring: [stage][(row g | row g+8) x (h0 | h1)][lane]
    uint4 w[DD_STAGES][4][32];      // 16 rows x 64 k bf16 = 2 KB per stage
};

// Grid (MB = ceil(M / (8 MT)), S, NB), MT in 1..8 (plugins/gemm.py token_tiles), block warps * 32 (token blocks fastest, so the blocks that
// share a weight tile run together and re-reads hit L2; warps <= DD_GEMM_MAX_WARPS),
// dynamic smem = 8 MT * (K/S + 32) * 2 + warps * sizeof(Bf16Ring).
//   x [M, K] bf16   w [ceil(N/16), K/64, 4, 32] uint4 (tile_bf16)   residual [M, N] bf16 or null (may alias out)
//   out [M, N] bf16 (out_f32 = 0) or fp32 (out_f32 = 1); swiglu = 1: out [M, N / 2] bf16 (N % 16 == 0, no residual)
//   partial [NB, MB, S, warps * tpw, MT, 32] float4 and counters [NB * MB] when S > 1
template <int MT>
__device__ __forceinline__ void skinny_gemm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                            const bf16_t* residual, void* out, float4* __restrict__ partial,
                                            u32* __restrict__ counters, int M, int N, int K, int S, int tpw,
                                            int out_f32, int swiglu) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warps = blockDim.x >> 5;
    const int KC = K >> 6, CPS = KC / S, c0 = blockIdx.y * CPS;
    const int kspan = CPS * 64, xstride = kspan + 32;    // +64 B per row: conflict-free uint4 reads
    const int row0 = blockIdx.x * 8 * MT, NT = (N + 15) >> 4, nb = blockIdx.z;
    bf16_t* xs = (bf16_t*)smem;                          // [8 MT][xstride]
    Bf16Ring& ring = ((Bf16Ring*)(smem + 8 * MT * xstride * 2))[warp];

    const int ntb = warps * tpw, nt_begin = (nb * warps + warp) * tpw;
    const int my_tiles = max(0, min(tpw, NT - nt_begin));
    const int items = my_tiles * CPS;
    // paired: a warp's two tiles stream chunk by chunk (tile 0 chunk c, tile 1 chunk c, ...) and each x fragment
    // loaded from shared memory feeds both tiles' mma: half the x reads per weight byte, which bind past 16
    // rows. Each tile's sum runs in the same order as alone (bitwise the same outputs).
    const bool paired = my_tiles == 2;
    // tiled weights: (tile, chunk) = 2 KB contiguous = [4][32 lanes] uint4, so a warp streams 2 KB per step
    const uint4* wbase = (const uint4*)w + ((size_t)nt_begin * KC + c0) * 128 + lane;
    const u64 policy = evict_first_policy();
    int issue_r = 0, issue_c = 0, issue_st = 0;
    auto issue = [&]() {                                 // (tile, chunk) in the order the loop consumes them
        if (issue_r < my_tiles && issue_c < CPS) {
            const uint4* wp = wbase + ((size_t)issue_r * KC + issue_c) * 128;
#pragma unroll
            for (int j = 0; j < 4; ++j)                  // j = 2 h + (row g | row g+8)
                cp_async16_stream(&ring.w[issue_st][j][lane], wp + 32 * j, policy);
            if (paired) {
                if (++issue_r == 2) { issue_r = 0; ++issue_c; }
            } else if (++issue_c == CPS) {
                issue_c = 0; ++issue_r;
            }
        }
        cp_async_commit();
        if (++issue_st == DD_STAGES) issue_st = 0;
    };
    // weights first (independent of earlier kernels): all stages but one ahead, two when paired (a paired step
    // issues tile 0 and tile 1 of a chunk before it reads the two oldest stages)
#pragma unroll 1
    for (int st = 0; st < DD_STAGES - (paired ? 2 : 1); ++st) issue();
    pdl_wait();                                            // x (and residual) written by the previous kernel
    pdl_trigger();
    const int vec_per_row = kspan >> 3;
    for (int i = threadIdx.x; i < 8 * MT * vec_per_row; i += blockDim.x) {
        int row = i / vec_per_row, v = i - row * vec_per_row;
        bf16_t* dst = xs + row * xstride + v * 8;
        if (row0 + row < M) cp_async16(dst, x + (size_t)(row0 + row) * K + c0 * 64 + v * 8);
        else *(uint4*)dst = make_uint4(0u, 0u, 0u, 0u);
    }
    cp_async_commit();
    cp_async_wait<0>();                                    // x is the newest group: everything landed
    __syncthreads();

    const size_t part_base = ((size_t)nb * gridDim.x + blockIdx.x) * S;
    // acc[mt] = {(n, m), (n, m+1), (n+8, m), (n+8, m+1)} with n = tile row g, m = token 8 mt + 2t
    auto finish = [&](int r, const float (&v)[MT][4]) {
        const int n = (nt_begin + r) * 16 + g;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int m = row0 + mt * 8 + 2 * t + q;
                if (m >= M) continue;
                float lo = v[mt][q], hi = v[mt][2 + q];
                if (swiglu) {                            // channel 8 tile + g: gate = row g, up = row g + 8
                    if (n < N) {
                        const float gate = bf16_to_f32(f32_to_bf16(lo)), up = bf16_to_f32(f32_to_bf16(hi));
                        ((bf16_t*)out)[(size_t)m * (N >> 1) + (nt_begin + r) * 8 + g] = f32_to_bf16(silu(gate) * up);
                    }
                    continue;
                }
                const size_t o = (size_t)m * N + n;
                if (n < N) {
                    if (residual) lo += bf16_to_f32(residual[o]);
                    if (out_f32) ((float*)out)[o] = lo;
                    else ((bf16_t*)out)[o] = f32_to_bf16(lo);
                }
                if (n + 8 < N) {
                    if (residual) hi += bf16_to_f32(residual[o + 8]);
                    if (out_f32) ((float*)out)[o + 8] = hi;
                    else ((bf16_t*)out)[o + 8] = f32_to_bf16(hi);
                }
            }
        }
    };

    auto store_partial = [&](int r, const float (&v)[MT][4]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            size_t idx = (((part_base + blockIdx.y) * ntb + warp * tpw + r) * MT + mt) * 32 + lane;
            partial[idx] = make_float4(v[mt][0], v[mt][1], v[mt][2], v[mt][3]);
        }
    };
    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
    int r = 0, c = 0, st = 0;
    if (paired) {
        float acc1[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc1[mt][0] = acc1[mt][1] = acc1[mt][2] = acc1[mt][3] = 0.f;
        for (c = 0; c < CPS; ++c) {
            cp_async_wait<DD_STAGES - 4>();              // the two oldest stages (tile 0 and 1, chunk c) landed
            issue();
            issue();
            const int st1 = st + 1 == DD_STAGES ? 0 : st + 1;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 g0 = ring.w[st][2 * h][lane], g08 = ring.w[st][2 * h + 1][lane];
                const uint4 g1 = ring.w[st1][2 * h][lane], g18 = ring.w[st1][2 * h + 1][lane];
                const u32 a0_u0[4] = {g0.x, g08.x, g0.y, g08.y}, a0_u1[4] = {g0.z, g08.z, g0.w, g08.w};
                const u32 a1_u0[4] = {g1.x, g18.x, g1.y, g18.y}, a1_u1[4] = {g1.z, g18.z, g1.w, g18.w};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const uint4 xb = *(const uint4*)(xs + (mt * 8 + g) * xstride + c * 64 + 32 * h + 8 * t);
                    mma_bf16_16816(acc[mt], a0_u0, xb.x, xb.y);
                    mma_bf16_16816(acc[mt], a0_u1, xb.z, xb.w);
                    mma_bf16_16816(acc1[mt], a1_u0, xb.x, xb.y);
                    mma_bf16_16816(acc1[mt], a1_u1, xb.z, xb.w);
                }
            }
            st = st1 + 1 == DD_STAGES ? 0 : st1 + 1;
        }
        if (S == 1) {
            finish(0, acc);
            finish(1, acc1);
        } else {
            store_partial(0, acc);
            store_partial(1, acc1);
        }
    }
    for (int it = 0; it < (paired ? 0 : items); ++it) {
        cp_async_wait<DD_STAGES - 2>();
        issue();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 row_g = ring.w[st][2 * h][lane], row_g8 = ring.w[st][2 * h + 1][lane];
            const u32 a_u0[4] = {row_g.x, row_g8.x, row_g.y, row_g8.y};   // k 32h + 8t + 0..3
            const u32 a_u1[4] = {row_g.z, row_g8.z, row_g.w, row_g8.w};   // k 32h + 8t + 4..7
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 xb = *(const uint4*)(xs + (mt * 8 + g) * xstride + c * 64 + 32 * h + 8 * t);
                mma_bf16_16816(acc[mt], a_u0, xb.x, xb.y);
                mma_bf16_16816(acc[mt], a_u1, xb.z, xb.w);
            }
        }
        if (++st == DD_STAGES) st = 0;
        if (++c == CPS) {
            if (S == 1) {
                finish(r, acc);
            } else {
                store_partial(r, acc);
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
            c = 0;
            ++r;
        }
    }
    cp_async_wait<0>();

    if (S == 1) return;
    if (!arrive_last(&counters[(size_t)nb * gridDim.x + blockIdx.x], (u32)S)) return;
    for (int r = 0; r < my_tiles; ++r) {
        float sum[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            sum[mt][0] = sum[mt][1] = sum[mt][2] = sum[mt][3] = 0.f;
            for (int s = 0; s < S; ++s) {                // fixed order: deterministic
                float4 v = ld_cg_f4(&partial[(((part_base + s) * ntb + warp * tpw + r) * MT + mt) * 32 + lane]);
                sum[mt][0] += v.x; sum[mt][1] += v.y; sum[mt][2] += v.z; sum[mt][3] += v.w;
            }
        }
        finish(r, sum);
    }
}

#define DD_DEFINE_GEMM(MT)                                                                            \
    extern "C" __global__ void __launch_bounds__(DD_GEMM_MAX_WARPS * 32, 1)                           \
    gemm_bf16_mt##MT(const bf16_t* x, const bf16_t* w, const bf16_t* residual, void* out,            \
                     float4* partial, u32* counters, int M, int N, int K, int S, int tpw, int out_f32, \
                     int swiglu) {                                                                      \
        skinny_gemm<MT>(x, w, residual, out, partial, counters, M, N, K, S, tpw, out_f32, swiglu);    \
    }
// every sub-tile count 1..8: plugins/gemm.py token_tiles gives a block exactly the 8-token sub-tiles it needs
// (M = 17: 3, 33: 5, 65: two blocks of 5), not the next power of two (4, 8, two of 8), whose zero rows cost
// their x loads and mma like real ones
DD_DEFINE_GEMM(1)
DD_DEFINE_GEMM(2)
DD_DEFINE_GEMM(3)
DD_DEFINE_GEMM(4)
DD_DEFINE_GEMM(5)
DD_DEFINE_GEMM(6)
DD_DEFINE_GEMM(7)
DD_DEFINE_GEMM(8)
