// DFlash drafter block attention (the op set's draft_attention after its rope and cache append):
//   o[i, hq] = softmax_k(q[i, hq] . key_k * scale) . value_k   over the keys visible to block token i:
//   keys = context cache rows [0, C) (C = cache_len[0] + n: the n new context rows are already roped and
//   appended by the kernels before this one; row r sits at position r) then the block's own b rows
//   (k, v at positions pos[0 .. b)); non-causal; with a sliding window a key is visible iff
//   pos[i] - k_pos < window (window 0: all). GQA: query head hq reads kv head hq / g (g = Hq / Hk).
// Numpy twin: ddtree/plugins/reference.py draft_block_attention. Launcher: plugins/draft_attention.py.
// Per-step scalars (cache_len, pos) are read on the device, so a captured graph serves every step.
//
// Plain and correct (CUDA cores, fp32): a block owns one kv head, up to 32 query rows (b g of them,
// row r = token r / g, head h g + r % g) and one split of the keys; its 8 warps own 4 rows each. Keys
// go through shared memory 32 at a time (K as 32-bit words padded to D / 2 + 1 per row: lane j reads
// key j's words conflict-free), one key per lane for the scores, then an online softmax (base 2: q is
// pre-scaled by scale log2 e) with each lane owning D / 32 output dims. Splits write (m, l, acc) partials
// that draft_attention_combine merges (splits = 1 writes o directly); a split with no visible key for a
// row leaves m = -inf, l = 0 there. A window skips the cache rows below min(pos) - window + 1 entirely.
#include "common.cuh"

#define DA_WARPS 8
#define DA_RPW 4                          // query rows per warp
#define DA_ROWS (DA_WARPS * DA_RPW)       // query rows per block
#define DA_TILE 32                        // keys per shared-memory tile (one per lane)

struct DraftArgs {
    const bf16_t* q; int q_tok;                 // [b, Hq, D] at q + i q_tok + hq D
    const bf16_t* k; const bf16_t* v; int kv_tok, v_tok;   // block keys / values [b, Hk, D] at + j kv_tok (v_tok) + h D
    const bf16_t* cache_k; const bf16_t* cache_v;   // [S, Hk, D]
    const int* cache_len; int n_new;            // C = cache_len[0] + n_new context rows
    const int* pos; int b;                      // [b] block positions
    int Hq, Hk, window; float scale_log2;
    float* part_o; float2* part_ml;             // [splits, b Hq, D] unnormalised, [splits, b Hq] (m, l)
    bf16_t* o;                                  // [b, Hq D] (splits == 1)
};

template <int D>
__device__ __forceinline__ void draft_attention(const DraftArgs& a) {
    constexpr int PER = D / 32, KW = D / 2 + 1;                           // dims per lane, K words per row
    __shared__ u32 ks[DA_TILE][KW];
    __shared__ __align__(16) bf16_t vs[DA_TILE][D];
    __shared__ float qs[DA_ROWS][D];
    __shared__ int range[2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int h = blockIdx.x, g = a.Hq / a.Hk, rows = a.b * g, r0 = blockIdx.y * DA_ROWS;
    const int split = blockIdx.z, splits = gridDim.z;

    pdl_wait();
    if (threadIdx.x == 0) {                                               // this split's key range
        const int C = a.cache_len[0] + a.n_new;
        int lo = 0;
        if (a.window > 0) {
            int min_pos = a.pos[0];
            for (int i = 1; i < a.b; ++i) min_pos = min(min_pos, a.pos[i]);
            lo = min(C, max(0, min_pos - a.window + 1));
        }
        const int L = C - lo + a.b, tiles = (L + DA_TILE - 1) / DA_TILE, per = (tiles + splits - 1) / splits;
        range[0] = lo + min(L, split * per * DA_TILE);                   // key index space [lo, C + b)
        range[1] = lo + min(L, (split + 1) * per * DA_TILE);
    }
    for (int e = threadIdx.x; e < DA_ROWS * D; e += blockDim.x) {        // queries, pre-scaled, fp32
        const int r = e / D, d = e - r * D, row = r0 + r;
        float val = 0.f;
        if (row < rows) {
            const int i = row / g, hq = h * g + row % g;
            val = bf16_to_f32(a.q[(long long)i * a.q_tok + hq * D + d]) * a.scale_log2;
        }
        qs[r][d] = val;
    }
    __syncthreads();
    const int C = a.cache_len[0] + a.n_new, k_begin = range[0], k_end = range[1];

    int q_pos[DA_RPW];
    float m[DA_RPW], l[DA_RPW], acc[DA_RPW][PER];
#pragma unroll
    for (int i = 0; i < DA_RPW; ++i) {
        const int row = r0 + warp + DA_WARPS * i;
        q_pos[i] = row < rows ? a.pos[row / g] : 0;
        m[i] = DD_NEG_INF; l[i] = 0.f;
#pragma unroll
        for (int e = 0; e < PER; ++e) acc[i][e] = 0.f;
    }

    for (int t0 = k_begin; t0 < k_end; t0 += DA_TILE) {
        __syncthreads();                                                  // the previous tile is consumed
        for (int e = threadIdx.x; e < DA_TILE * (D / 8); e += blockDim.x) {   // 16-byte pieces of K and V
            const int j = e / (D / 8), c = (e - j * (D / 8)) * 8, kk = t0 + j;
            uint4 kv = make_uint4(0u, 0u, 0u, 0u), vv = kv;
            if (kk < k_end) {
                const long long off = kk < C ? ((long long)kk * a.Hk + h) * D + c
                                             : (long long)(kk - C) * a.kv_tok + h * D + c;
                const long long v_off = kk < C ? off : (long long)(kk - C) * a.v_tok + h * D + c;
                kv = *(const uint4*)((kk < C ? a.cache_k : a.k) + off);
                vv = *(const uint4*)((kk < C ? a.cache_v : a.v) + v_off);
            }
            ks[j][c / 2] = kv.x; ks[j][c / 2 + 1] = kv.y; ks[j][c / 2 + 2] = kv.z; ks[j][c / 2 + 3] = kv.w;
            *(uint4*)&vs[j][c] = vv;
        }
        __syncthreads();
        const int kk = t0 + lane;                                         // this lane's key
        const int k_pos = kk < C ? kk : (kk < k_end ? a.pos[kk - C] : 0);
        float s[DA_RPW];
#pragma unroll
        for (int i = 0; i < DA_RPW; ++i) s[i] = 0.f;
#pragma unroll 8
        for (int w = 0; w < D / 2; ++w) {
            const u32 kw = ks[lane][w];
            const float k0 = bf16lo_to_f32(kw), k1 = bf16hi_to_f32(kw);
#pragma unroll
            for (int i = 0; i < DA_RPW; ++i) {
                const float2 qq = *(const float2*)&qs[warp + DA_WARPS * i][2 * w];
                s[i] = fmaf(qq.x, k0, fmaf(qq.y, k1, s[i]));
            }
        }
        float p[DA_RPW];
#pragma unroll
        for (int i = 0; i < DA_RPW; ++i) {
            const bool visible = kk < k_end && (a.window <= 0 || q_pos[i] - k_pos < a.window);
            float tile_max = visible ? s[i] : DD_NEG_INF;
#pragma unroll
            for (int off = 16; off; off >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
            const float m_new = fmaxf(m[i], tile_max);
            if (m_new == DD_NEG_INF) { p[i] = 0.f; continue; }           // nothing visible yet (warp-uniform)
            const float corr = exp2f(m[i] - m_new);                        // m = -inf -> 0
            p[i] = visible ? exp2f(s[i] - m_new) : 0.f;
            float sum = p[i];
#pragma unroll
            for (int off = 16; off; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            l[i] = l[i] * corr + sum;
            m[i] = m_new;
#pragma unroll
            for (int e = 0; e < PER; ++e) acc[i][e] *= corr;
        }
#pragma unroll 4
        for (int j = 0; j < DA_TILE; ++j) {
            float vals[PER];
#pragma unroll
            for (int e = 0; e < PER; ++e) vals[e] = bf16_to_f32(vs[j][lane * PER + e]);
#pragma unroll
            for (int i = 0; i < DA_RPW; ++i) {
                const float pj = __shfl_sync(0xffffffffu, p[i], j);
#pragma unroll
                for (int e = 0; e < PER; ++e) acc[i][e] = fmaf(pj, vals[e], acc[i][e]);
            }
        }
    }
    pdl_trigger();
#pragma unroll
    for (int i = 0; i < DA_RPW; ++i) {
        const int row = r0 + warp + DA_WARPS * i;
        if (row >= rows) continue;
        const int tok = row / g, hq = h * g + row % g, out_row = tok * a.Hq + hq;
        if (splits == 1) {
            const float inv = 1.f / l[i];
#pragma unroll
            for (int e = 0; e < PER; ++e) a.o[(long long)out_row * D + lane * PER + e] = f32_to_bf16(acc[i][e] * inv);
        } else {
            float* po = a.part_o + ((long long)split * a.b * a.Hq + out_row) * D + lane * PER;
#pragma unroll
            for (int e = 0; e < PER; ++e) po[e] = acc[i][e];
            if (lane == 0) a.part_ml[(long long)split * a.b * a.Hq + out_row] = make_float2(m[i], l[i]);
        }
    }
}

#define DD_DEFINE_DRAFT(D)                                                                               \
    extern "C" __global__ void __launch_bounds__(DA_WARPS * 32)                                          \
    draft_attention_d##D(const bf16_t* q, int q_tok, const bf16_t* k, const bf16_t* v, int kv_tok,       \
                         int v_tok, const bf16_t* cache_k, const bf16_t* cache_v, const int* cache_len,  \
                         int n_new, const int* pos, int b, int Hq, int Hk, int window, float scale_log2, \
                         float* part_o, float2* part_ml, bf16_t* o) {                                    \
        const DraftArgs a = {q, q_tok, k, v, kv_tok, v_tok, cache_k, cache_v, cache_len, n_new, pos, b,   \
                             Hq, Hk, window, scale_log2, part_o, part_ml, o};                            \
        draft_attention<D>(a);                                                                           \
    }
DD_DEFINE_DRAFT(32)
DD_DEFINE_DRAFT(64)
DD_DEFINE_DRAFT(128)

// Grid (b Hq), block (D, G): o[row] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s. The split weights go
// through shared memory once; thread group g sums splits g, g + G, ... (loads only, all in flight), then group 0
// adds the G partial sums in group order (a fixed order: the same bits every launch).
#define DA_MAX_SPLITS 160                 // plugins/draft_attention.py MAX_SPLITS
#define DA_COMBINE_THREADS 1024           // D G
extern "C" __global__ void __launch_bounds__(DA_COMBINE_THREADS)
draft_attention_combine(const float* part_o, const float2* part_ml, bf16_t* o, int rows, int splits) {
    __shared__ float w_s[DA_MAX_SPLITS];
    __shared__ float num_s[DA_COMBINE_THREADS], den_s[DA_COMBINE_THREADS];
    __shared__ float M_s;
    pdl_wait();
    const int row = blockIdx.x, d = threadIdx.x, D = blockDim.x, g = threadIdx.y, G = blockDim.y;
    const int t = g * D + d;
    if (t < 32) {
        float M = DD_NEG_INF;
        for (int s = t; s < splits; s += 32) M = fmaxf(M, part_ml[(long long)s * rows + row].x);
#pragma unroll
        for (int off = 16; off; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
        if (t == 0) M_s = M;
    }
    __syncthreads();
    for (int s = t; s < splits; s += D * G) {
        const float m = part_ml[(long long)s * rows + row].x;
        w_s[s] = m == DD_NEG_INF ? 0.f : exp2f(m - M_s);             // a split with no visible key adds 0 x 0
    }
    __syncthreads();
    float num = 0.f, den = 0.f;
#pragma unroll 4
    for (int s = g; s < splits; s += G) {
        const float w = w_s[s];
        num += w * part_o[((long long)s * rows + row) * D + d];
        den += w * part_ml[(long long)s * rows + row].y;
    }
    num_s[t] = num;
    den_s[t] = den;
    __syncthreads();
    pdl_trigger();
    if (g == 0) {
        for (int i = 1; i < G; ++i) {
            num += num_s[i * D + d];
            den += den_s[i * D + d];
        }
        o[(long long)row * D + d] = f32_to_bf16(num / den);
    }
}
