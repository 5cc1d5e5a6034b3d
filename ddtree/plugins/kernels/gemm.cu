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
// Split-K partials are reduced by the last block to arrive (fixed order, deterministic), or with dsmem (launched as
// clusters of the S k-split blocks, S <= 8) through distributed shared memory: no partial leaves the cluster.
// Programmatic dependent launch: the weight ring is filled before griddepcontrol.wait (weights never
// depend on the previous kernel), the token rows and the residual are read after it.
#include "common.cuh"

#define DD_GEMM_MAX_WARPS 8

static_assert(DD_STAGES >= 4, "the paired loop keeps two stages free and two in flight");
template <int RS>
struct Bf16Ring {                   // one warp's ring: [stage][(row g | row g+8) x (h0 | h1)][lane]
    uint4 w[RS][4][32];             // 16 rows x 64 k bf16 = 2 KB per stage
};
// Ring stages of a warp: DD_STAGES, or 3 G for a group of G > 2 tiles (a chunk of the group read, two in flight)
template <int G>
struct RingStages {
    static constexpr int value = G > 2 ? 3 * G : DD_STAGES;
};

// Grid (MB = ceil(M / (8 MT)), S, NB), MT in 1..9 (plugins/gemm.py token_tiles), block warps * 32 (token blocks fastest, so the blocks that
// share a weight tile run together and re-reads hit L2; warps <= DD_GEMM_MAX_WARPS),
// dynamic smem = 8 MT * (K/S + 32) * 2 + warps * sizeof(Bf16Ring<RingStages<G>::value>).
// G: the tile group a warp streams chunk by chunk when it owns exactly G tiles (tpw = G; 2: gemm_bf16_mt<MT>,
// 4: gemm_bf16_mt<MT>_g4), each x fragment feeding G tiles' mma; other tile counts run one tile at a time.
//   x [M, K] bf16   w [ceil(N/16), K/64, 4, 32] uint4 (tile_bf16)   residual [M, N] bf16 or null (may alias out)
//   out [M, N] bf16 (out_f32 = 0) or fp32 (out_f32 = 1); swiglu = 1: out [M, N / 2] bf16 (N % 16 == 0, no residual)
//   partial [NB, MB, S, warps * tpw, MT, 32] float4 and counters [NB * MB] when S > 1
template <int MT, int G>
__device__ __forceinline__ void skinny_gemm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                            const bf16_t* residual, void* out, float4* __restrict__ partial,
                                            u32* __restrict__ counters, int M, int N, int K, int S, int tpw,
                                            int out_f32, int swiglu, int dsmem) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int warps = blockDim.x >> 5;
    const int KC = K >> 6, CPS = KC / S, c0 = blockIdx.y * CPS;
    const int kspan = CPS * 64, xstride = kspan + 32;    // +64 B per row: conflict-free uint4 reads
    const int row0 = blockIdx.x * 8 * MT, NT = (N + 15) >> 4, nb = blockIdx.z;
    bf16_t* xs = (bf16_t*)smem;                          // [8 MT][xstride]
    constexpr int RS = RingStages<G>::value;
    static_assert(RS >= 2 * G, "the grouped loop keeps a chunk of the group free and one in flight");
    Bf16Ring<RS>& ring = ((Bf16Ring<RS>*)(smem + 8 * MT * xstride * 2))[warp];

    const int ntb = warps * tpw, nt_begin = (nb * warps + warp) * tpw;
    const int my_tiles = max(0, min(tpw, NT - nt_begin));
    const int items = my_tiles * CPS;
    // grouped: a warp's G tiles stream chunk by chunk (tile 0 chunk c, tile 1 chunk c, ...) and each x fragment
    // loaded from shared memory feeds all G tiles' mma: 1 / G the x reads per weight byte, which bind past 16
    // rows. Each tile's sum runs in the same order as alone (bitwise the same outputs).
    const bool grouped = my_tiles == G;
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
            if (grouped) {
                if (++issue_r == G) { issue_r = 0; ++issue_c; }
            } else if (++issue_c == CPS) {
                issue_c = 0; ++issue_r;
            }
        }
        cp_async_commit();
        if (++issue_st == RS) issue_st = 0;
    };
    // weights first (independent of earlier kernels): all stages but one ahead, G when grouped (a grouped step
    // issues the G tiles of a chunk before it reads the G oldest stages)
#pragma unroll 1
    for (int st = 0; st < RS - (grouped ? G : 1); ++st) issue();
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
    auto finish = [&](int tile, const float (&v)[MT][4]) {   // tile: the global 16-row tile index
        const int n = tile * 16 + g;
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
                        ((bf16_t*)out)[(size_t)m * (N >> 1) + tile * 8 + g] = f32_to_bf16(silu(gate) * up);
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

    // dsmem: the partial stays in this warp's own ring ([r][mt][lane] float4, r < tpw <= 2: plugins/gemm.py
    // with_dsmem) once the warp's copies have all landed; else it goes to global memory
    static_assert(2 * MT * 32 * sizeof(float4) <= sizeof(Bf16Ring<RS>), "two tiles' partials fit a warp's ring");
    float4* my_part = (float4*)&ring;
    auto store_partial = [&](int r, const float (&v)[MT][4]) {
        if (dsmem) cp_async_wait<0>();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float4 f = make_float4(v[mt][0], v[mt][1], v[mt][2], v[mt][3]);
            if (dsmem) {
                my_part[(r * MT + mt) * 32 + lane] = f;
            } else {
                partial[(((part_base + blockIdx.y) * ntb + warp * tpw + r) * MT + mt) * 32 + lane] = f;
            }
        }
    };
    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
    int r = 0, c = 0, st = 0;
    if (grouped) {
        float accg[G][MT][4];
#pragma unroll
        for (int j = 0; j < G; ++j)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) accg[j][mt][0] = accg[j][mt][1] = accg[j][mt][2] = accg[j][mt][3] = 0.f;
        for (c = 0; c < CPS; ++c) {
            cp_async_wait<RS - 2 * G>();                 // the G oldest stages (tiles 0 .. G-1, chunk c) landed
#pragma unroll
            for (int j = 0; j < G; ++j) issue();
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                u32 a_u0[G][4], a_u1[G][4];
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    const int sj = st + j < RS ? st + j : st + j - RS;
                    const uint4 rg = ring.w[sj][2 * h][lane], rg8 = ring.w[sj][2 * h + 1][lane];
                    a_u0[j][0] = rg.x; a_u0[j][1] = rg8.x; a_u0[j][2] = rg.y; a_u0[j][3] = rg8.y;
                    a_u1[j][0] = rg.z; a_u1[j][1] = rg8.z; a_u1[j][2] = rg.w; a_u1[j][3] = rg8.w;
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const uint4 xb = *(const uint4*)(xs + (mt * 8 + g) * xstride + c * 64 + 32 * h + 8 * t);
#pragma unroll
                    for (int j = 0; j < G; ++j) {
                        mma_bf16_16816(accg[j][mt], a_u0[j], xb.x, xb.y);
                        mma_bf16_16816(accg[j][mt], a_u1[j], xb.z, xb.w);
                    }
                }
            }
            st = st + G < RS ? st + G : st + G - RS;
        }
#pragma unroll
        for (int j = 0; j < G; ++j) {
            if (S == 1) finish(nt_begin + j, accg[j]);
            else store_partial(j, accg[j]);
        }
    }
    for (int it = 0; it < (grouped ? 0 : items); ++it) {
        cp_async_wait<RS - 2>();
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
        if (++st == RS) st = 0;
        if (++c == CPS) {
            if (S == 1) {
                finish(nt_begin + r, acc);
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
    if (dsmem) {                 // the S blocks of a k-split cluster (1, S, 1): block rank q sums tiles j = q mod S
        cluster_sync();          // every block's partials written (release / acquire at cluster scope)
        const int q = cluster_ctarank();
        const u32 ring0 = smem_addr(smem + 8 * MT * xstride * 2);
        for (int j = q + S * warp; j < ntb; j += S * warps) {
            const int owner = j / tpw, r = j - owner * tpw;
            if (nb * ntb + j >= NT) break;
            float sum[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                sum[mt][0] = sum[mt][1] = sum[mt][2] = sum[mt][3] = 0.f;
                const u32 local = ring0 + owner * (u32)sizeof(Bf16Ring<RS>) + ((r * MT + mt) * 32 + lane) * 16;
                sum_partials<8>(sum[mt], S, [&](int s) { return ld_dsmem_f4(local, s); });   // the global path's sum
            }
            finish(nb * ntb + j, sum);
        }
        cluster_sync();          // no block leaves while a peer may still read its shared memory
        return;
    }
    if (!arrive_last(&counters[(size_t)nb * gridDim.x + blockIdx.x], (u32)S)) return;
    for (int r = 0; r < my_tiles; ++r) {
        float sum[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            sum[mt][0] = sum[mt][1] = sum[mt][2] = sum[mt][3] = 0.f;
            sum_partials<16>(sum[mt], S, [&](int s) {   // fixed order: deterministic
                return ld_cg_f4(&partial[(((part_base + s) * ntb + warp * tpw + r) * MT + mt) * 32 + lane]);
            });
        }
        finish(nt_begin + r, sum);
    }
}

#define DD_DEFINE_GEMM(NAME, MT, G)                                                                   \
    extern "C" __global__ void __launch_bounds__(DD_GEMM_MAX_WARPS * 32, 1)                           \
    NAME(const bf16_t* x, const bf16_t* w, const bf16_t* residual, void* out, float4* partial,         \
         u32* counters, int M, int N, int K, int S, int tpw, int out_f32, int swiglu, int dsmem) {     \
        skinny_gemm<MT, G>(x, w, residual, out, partial, counters, M, N, K, S, tpw, out_f32, swiglu, dsmem); \
    }
// every sub-tile count 1..9: plugins/gemm.py token_tiles gives a block exactly the 8-token sub-tiles it needs
// (M = 17: 3, 33: 5, 65: two blocks of 5, or one of 9 where the plan takes 9), not the next power of two (4, 8,
// two of 8), whose zero rows cost their x loads and mma like real ones
DD_DEFINE_GEMM(gemm_bf16_mt1, 1, 2)
DD_DEFINE_GEMM(gemm_bf16_mt2, 2, 2)
DD_DEFINE_GEMM(gemm_bf16_mt3, 3, 2)
DD_DEFINE_GEMM(gemm_bf16_mt4, 4, 2)
DD_DEFINE_GEMM(gemm_bf16_mt5, 5, 2)
DD_DEFINE_GEMM(gemm_bf16_mt6, 6, 2)
DD_DEFINE_GEMM(gemm_bf16_mt7, 7, 2)
DD_DEFINE_GEMM(gemm_bf16_mt8, 8, 2)
DD_DEFINE_GEMM(gemm_bf16_mt9, 9, 2)
// four tiles a warp (tpw 4) past 16 rows: each x fragment feeds 16 mma instead of 8 (12-stage rings)
DD_DEFINE_GEMM(gemm_bf16_mt3_g4, 3, 4)
DD_DEFINE_GEMM(gemm_bf16_mt5_g4, 5, 4)
DD_DEFINE_GEMM(gemm_bf16_mt9_g4, 9, 4)
#include "gemm_tm.cuh"
