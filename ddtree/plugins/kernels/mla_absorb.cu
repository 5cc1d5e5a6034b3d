// Absorbed-MLA per-head projections, one batched kernel for both:
//   absorb_q:   q_lat[t, n, :R]  = q_nope[t, n, :Dn] @ W_UK[n]      (W_UK[n] [Dn, R])
//   absorb_out: o[t, n, :Dv]     = o_lat[t, n, :R]   @ W_UV[n]^T    (W_UV[n] [Dv, R])
// Both are y[t, n, :Nout] = x[t, n, :K] @ W[n]^T with W[n] [Nout, K] rows contiguous in K:
//   absorb_out reads W_UV straight from kv_b [N (Dn + Dv), R] as the checkpoint stores it (head stride
//   (Dn + Dv) R, offset Dn R, rows of R); absorb_q reads W_UK^T [N, R, Dn], prepared once at load
//   (ddtree/plugins/mla_absorb.py uk_transposed), as its rows must run along Dn.
// Numpy twins: ddtree/plugins/reference.py mla_absorb_q / mla_absorb_out. Launcher: plugins/mla_absorb.py.
//
// Weight rows are the mma's A operand (16 output channels), tokens its B operand (8 per mma, MT of them),
// as in gemm.cu: the weights are read exactly once per token block and, at decode (q <= 32 tokens: one
// token block), once per call. Lane t owns k = 8t .. 8t + 7 of every 32-wide chunk (the permuted k order
// of gemm.cu; x is read with the same permutation so the dot product is unchanged), so a warp reads
// 64 contiguous bytes of each of its 16 weight rows per chunk, straight from global memory (16-byte
// loads, L1 bypassed: read once). UNROLL chunks are loaded before any mma so the loads overlap.
// K may be split over the block's warps (ks = blockDim.x / 32, each warp K / ks) when there are too
// few (head, 16-row tile) pairs to fill the GPU (absorb_out at tp 8: 8 heads x 8 tiles); the partials
// are summed in shared memory in warp order (deterministic). fp32 accumulation, bf16 out.
//
// mla_absorb_q_rope_mt<MT> is absorb_q with the query's rope in the same launch (the op set's mla_absorb_q_rope
// pattern: one kernel boundary fewer on the query path): every thread of the grid turns at most a few of the
// q x heads x Dr/2 pairs of q_pe with rope.cuh's arithmetic, the bits of layer_ops.cu's rope_interleaved (its first
// pair's loads beside x's, its arithmetic after the mma loop); the absorb's own sums are untouched (same loop, same
// order).
#include "common.cuh"
#include "rope.cuh"

#define ABSORB_MAX_WARPS 8
#define ABSORB_UNROLL 4

__device__ __forceinline__ uint4 ld_stream16(const bf16_t* p) {      // read once: no L1 allocation
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// The query's rope fused into absorb_q (mla_absorb_q_rope): src [M, heads, 2 half] at src + m src_tok + n src_head
// -> out [M, heads, 2 half] dense (absorb_gemm<MT, true>; the plain kernels take the empty default).
struct AbsorbRope {
    const bf16_t* src;
    int src_tok, src_head;
    bf16_t* out;
    const int* pos;
    const float2* table;
    int max_pos, half;
};

// Grid (Nout / 16, heads, ceil(M / (8 MT))), block ks * 32 (ks <= ABSORB_MAX_WARPS, (K / ks) % 32 == 0).
//   x   [M tokens, heads, K] bf16 at x + m x_tok + n x_head (x_tok, x_head multiples of 8)
//   w   [heads, Nout, K] bf16 at w + n w_head + row w_row (w_head, w_row multiples of 8)
//   out [M, heads, Nout] bf16 at out + m o_tok + n o_head
template <int MT, bool ROPE = false>
__device__ __forceinline__ void absorb_gemm(const bf16_t* __restrict__ x, int x_tok, int x_head,
                                            const bf16_t* __restrict__ w, long long w_head, int w_row,
                                            bf16_t* __restrict__ out, int o_tok, int o_head, int M, int K,
                                            const AbsorbRope rope = AbsorbRope{}) {
    __shared__ float4 red[ABSORB_MAX_WARPS][MT][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int ks = blockDim.x >> 5, kspan = K / ks, k0 = warp * kspan;
    const int head = blockIdx.y, n0 = blockIdx.x * 16, row0 = blockIdx.z * 8 * MT;
    const bf16_t* wg = w + head * w_head + (long long)(n0 + g) * w_row + k0 + 8 * t;   // row g; row g + 8 below
    const bf16_t* wg8 = wg + 8 * (long long)w_row;
    const bf16_t* xr[MT];
    bool live[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int m = row0 + mt * 8 + g;                                  // this lane's B column (token)
        live[mt] = m < M;
        xr[mt] = x + (long long)(live[mt] ? m : 0) * x_tok + head * (long long)x_head + k0 + 8 * t;
    }
    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

    uint4 wa[ABSORB_UNROLL], wb[ABSORB_UNROLL];
    auto load_weights = [&](int c0) {
#pragma unroll
        for (int u = 0; u < ABSORB_UNROLL; ++u) {
            const int c = c0 + 32 * u;
            if (c < kspan) { wa[u] = ld_stream16(wg + c); wb[u] = ld_stream16(wg8 + c); }
        }
    };
    load_weights(0);                 // the first chunks before the wait: weights never come from an earlier kernel
    pdl_wait();                      // x comes from the previous kernel
    // the fused rope (ROPE): a thread's first pair of the M x heads x half, its loads issued here beside x's and
    // its arithmetic after the mma loop; the grid's threads stride over the rest there
    const size_t rope_total = ROPE ? (size_t)M * gridDim.y * rope.half : 0;
    const size_t rope_threads = (size_t)gridDim.x * gridDim.y * gridDim.z * blockDim.x;
    const size_t rope_me = ((size_t)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x
                           + threadIdx.x;
    auto rope_at = [&](size_t k) {   // pair k's inputs: q_pe of (token, head) into out's dense [M, heads, 2 half]
        return rope_fetch<true>(k, rope.src, rope.src_tok, rope.src_head, rope.out, gridDim.y * 2 * rope.half,
                                2 * rope.half, rope.pos, rope.table, rope.max_pos, gridDim.y, rope.half);
    };
    RopeHeld rope_held{};
    if (ROPE && rope_me < rope_total) rope_held = rope_at(rope_me);
    for (int c0 = 0; c0 < kspan; c0 += 32 * ABSORB_UNROLL) {
        if (c0) load_weights(c0);
#pragma unroll
        for (int u = 0; u < ABSORB_UNROLL; ++u) {
            const int c = c0 + 32 * u;
            if (c >= kspan) break;
            const u32 a0[4] = {wa[u].x, wb[u].x, wa[u].y, wb[u].y};         // k 8t + 0..3 of rows g, g + 8
            const u32 a1[4] = {wa[u].z, wb[u].z, wa[u].w, wb[u].w};         // k 8t + 4..7
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 xb = live[mt] ? *(const uint4*)(xr[mt] + c) : make_uint4(0u, 0u, 0u, 0u);
                mma_bf16_16816(acc[mt], a0, xb.x, xb.y);
                mma_bf16_16816(acc[mt], a1, xb.z, xb.w);
            }
        }
    }
    if (ROPE) {                      // the first pair's loads were issued before the loop (rope_held)
        if (rope_me < rope_total) rope_finish(rope_held);
        for (size_t k = rope_me + rope_threads; k < rope_total; k += rope_threads) rope_finish(rope_at(k));
    }
    pdl_trigger();
    if (ks > 1) {                                                         // sum the K split in warp order
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) red[warp][mt][lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
        __syncthreads();
        if (warp) return;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
            for (int s = 0; s < ks; ++s) {
                const float4 v = red[s][mt][lane];
                acc[mt][0] += v.x; acc[mt][1] += v.y; acc[mt][2] += v.z; acc[mt][3] += v.w;
            }
        }
    }
    // acc[mt] = {(n, m), (n, m + 1), (n + 8, m), (n + 8, m + 1)}, n = n0 + g, m = row0 + 8 mt + 2t
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int m = row0 + mt * 8 + 2 * t + q;
            if (m >= M) continue;
            bf16_t* o = out + (long long)m * o_tok + head * (long long)o_head + n0 + g;
            o[0] = f32_to_bf16(acc[mt][q]);
            o[8] = f32_to_bf16(acc[mt][2 + q]);
        }
    }
}

#define DD_DEFINE_ABSORB(MT)                                                                               \
    extern "C" __global__ void __launch_bounds__(ABSORB_MAX_WARPS * 32)                                     \
    mla_absorb_mt##MT(const bf16_t* x, int x_tok, int x_head, const bf16_t* w, long long w_head, int w_row, \
                      bf16_t* out, int o_tok, int o_head, int M, int K) {                                  \
        absorb_gemm<MT>(x, x_tok, x_head, w, w_head, w_row, out, o_tok, o_head, M, K);                     \
    }
DD_DEFINE_ABSORB(1)
DD_DEFINE_ABSORB(2)
DD_DEFINE_ABSORB(4)

#define DD_DEFINE_ABSORB_Q_ROPE(MT)                                                                              \
    extern "C" __global__ void __launch_bounds__(ABSORB_MAX_WARPS * 32)                                          \
    mla_absorb_q_rope_mt##MT(const bf16_t* x, int x_tok, int x_head, const bf16_t* w, long long w_head, int w_row, \
                             bf16_t* out, int o_tok, int o_head, int M, int K, const bf16_t* pe, bf16_t* out_pe,    \
                             const int* pos, const float2* table, int max_pos, int half) {                          \
        absorb_gemm<MT, true>(x, x_tok, x_head, w, w_head, w_row, out, o_tok, o_head, M, K,                      \
                        AbsorbRope{pe, x_tok, x_head, out_pe, pos, table, max_pos, half});                         \
    }
DD_DEFINE_ABSORB_Q_ROPE(1)
DD_DEFINE_ABSORB_Q_ROPE(2)
DD_DEFINE_ABSORB_Q_ROPE(4)
