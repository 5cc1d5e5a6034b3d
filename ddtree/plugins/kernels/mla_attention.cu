// Absorbed MLA attention of q new tokens over the latent cache, with the DDTree ancestor mask among
// the new tokens (docs/interfaces.md sections 3 and 4). Numpy twin: ddtree/plugins/reference.py
// mla_tree_attention; launcher and split plan: ddtree/plugins/mla_attention.py.
//
// Shapes (R = q * H query rows, row r = token r / H, head r % H; MQA: every head reads the same cache;
// latent DL = MLA_DL, rope DR = MLA_DR, DK = DL + DR: NVRTC defines, Kimi 512 / 64 / 576):
//   q_lat  [R, DL] bf16      W_UK^T q_nope per head         q_rope [R, DR] bf16 (roped)
//   cache  [>= T + q, DK]    one layer: c_kv (DL) then k_pe (DR) per token; the q tree entries are
//                            already appended at T .. T + q - 1 (tree node i at T + i)
//   vis    [q, W] u32        W = ceil(q / 32); bit j of row i: tree node j is i or an ancestor of i
//   lengths[0] = T           the committed prefix, read on the device so a captured graph serves any T
//   out    [R, DL] bf16      softmax(scale * (q_lat . c_kv + q_rope . k_pe)) @ c_kv   (before W_UV)
//   lse    [R] fp32 or null  natural-log sum of exp of the visible scaled scores
//
// Cascade (docs/hardware-and-kernels.md section 7): grid (row tiles, splits). Splits 0 .. P-1 cover the
// prefix [0, T) in equal chunks with no mask; the tree keys [T, T + q) get their own split (tree_own)
// or ride at the end of the last prefix split, and only there is the visibility mask read. Each split
// writes its normalised partial output and log2-sum-exp; mla_attention_combine merges them exactly
// (o = sum_s 2^(lse_s - lse) o_s). With a single split the kernel writes out / lse itself.
//
// Block: NPAIR warp pairs; pair p owns 16 query rows, the two warps of a pair split the 32 keys of a
// block for the scores (16 each) and the DL output dims for P.V (DL / 2 each: DL / 4 fp32 accumulators per
// thread, 128 for Kimi). The pair swaps row maxima and its bf16 probabilities through shared memory (named barrier
// per pair). Keys stream through a STAGES-deep ring of 32-key blocks shared by all pairs, filled by bulk
// copies (one per key row, spread over the warps) that complete on the stage's mbarrier.
// kernels/mla_decode.cu is the bandwidth-bound form of the same contract (q * H <= 64).
#include "mla_common.cuh"

#define MLA_NB 32                  // keys per block
#define MLA_PROW 40                // probability row stride in bf16: 80 B = 5 x 16 B
#define MLA_HALF (MLA_DL / 2)      // output dims per warp of a pair (Kimi: 256)
#define MLA_NT (MLA_HALF / 8)      // its 8-dim n-tiles (Kimi: 32, 128 fp32 accumulators per thread)

template <int NPAIR, int STAGES>
struct MlaSmem {
    bf16_t q[NPAIR * 16][MLA_ROW];             // this block's query rows [q_lat | q_rope]
    bf16_t kv[STAGES][MLA_NB][MLA_ROW];        // key blocks [c_kv | k_pe]
    bf16_t p[NPAIR][16][MLA_PROW];             // a pair's probabilities of the current block
    float swap[NPAIR][2][16];                  // a pair's per-warp row maxima, then row sums
    u64 full[STAGES];                          // key block landed (phase = use count & 1)
};

template <int NPAIR, int STAGES>
__device__ __forceinline__ void mla_attention_split(
        const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_rope, const bf16_t* __restrict__ cache,
        const u32* __restrict__ vis, const int* __restrict__ lengths, bf16_t* __restrict__ out,
        float* __restrict__ lse_out, float* __restrict__ part_o, float* __restrict__ part_lse,
        int R, int H, int q, int P, int tree_own, float scale_log2) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    MlaSmem<NPAIR, STAGES>& sm = *reinterpret_cast<MlaSmem<NPAIR, STAGES>*>(smem_raw);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int pair = warp >> 1, half = warp & 1;
    const int rows_per_block = NPAIR * 16, row0 = blockIdx.x * rows_per_block;
    const int split = blockIdx.y, n_splits = P + tree_own;

    PROF_NS
    PROF_T(0)
    pdl_wait();                                      // queries, lengths and new cache entries come from earlier kernels
    pdl_trigger();
    PROF_T(1)
    // ---- loads: the query rows (cp.async, in flight while T is read), then the key ring (bulk copies,
    // one key row per copy: a few instructions instead of 72 cp.async per key; keys past `end` copy the
    // last valid row, whose probability the mask sets to 0) ------------------------------------------------
    mla_load_queries<NPAIR * 16>(sm.q, q_lat, q_rope, row0, R);
    cp_async_commit();
    const int T = ld_cg_s32(lengths);

    // key range of this split; keys >= T are tree nodes and only visible along ancestor chains
    const MlaKeyRange range = mla_split_range(split, T, P, tree_own, q, H, R, row0, rows_per_block, MLA_NB);
    const int begin = range.begin, end = range.end;
    const int nblk = end > begin ? (end - begin + MLA_NB - 1) / MLA_NB : 0;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) mbar_init(&sm.full[i], 1);
        mbar_init_fence();
    }
    __syncthreads();                                 // barriers initialised
    // MLA_NB = 32 key rows, one bulk copy each, spread over the warps (a copy may complete before thread 0
    // arms the barrier: the transaction count may go negative, the phase cannot complete before the arrive)
    auto load_block = [&](int b) {
        if (b >= nblk) return;
        if (threadIdx.x == 0) mbar_expect_tx(&sm.full[b % STAGES], MLA_NB * MLA_DK * 2);
        constexpr int per_warp = MLA_NB / (2 * NPAIR);
        if (lane < per_warp) {
            const int k = warp * per_warp + lane, key = min(begin + b * MLA_NB + k, end - 1);
            bulk_copy_g2s(sm.kv[b % STAGES][k], cache + (size_t)key * MLA_DK, MLA_DK * 2, &sm.full[b % STAGES]);
        }
    };
#pragma unroll
    for (int b = 0; b < STAGES - 1; ++b) load_block(b);
    cp_async_wait<0>();
    __syncthreads();                                 // the query rows landed

    // ---- running state: rows g and g + 8 of this pair's tile --------------------------------------
    float o[MLA_NT][4];                              // dims half*MLA_HALF + 8 nt + 2t (+1); rows g (0,1), g+8 (2,3)
#pragma unroll
    for (int nt = 0; nt < MLA_NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m_run[2] = {DD_NEG_INF, DD_NEG_INF}, l_run[2] = {0.f, 0.f};
    const int r_lo = row0 + pair * 16 + g, r_hi = r_lo + 8;
    const int W = (q + 31) >> 5;
    const u32* vis_lo = vis + (size_t)min(r_lo / H, q - 1) * W;
    const u32* vis_hi = vis + (size_t)min(r_hi / H, q - 1) * W;
    const bool rows_valid[2] = {r_lo < R, r_hi < R};
    const bf16_t* qa = &sm.q[pair * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][(lane >> 4) * 8];   // A: x4 over (rows, k)

    PROF_INIT
    PROF_T(2)
    for (int b = 0; b < nblk; ++b) {
        PROF_MARK(5)
        if (b) __syncthreads();                      // everyone is done with block b - 1's slot
        fence_proxy_async();                         // (its reads) before the bulk copies that refill it
        load_block(b + STAGES - 1);
        PROF_MARK(1)
        mbar_wait(&sm.full[b % STAGES], (b / STAGES) & 1);
        PROF_MARK(0)
        const bf16_t (*kv)[MLA_ROW] = sm.kv[b % STAGES];
        const int key0 = begin + b * MLA_NB;

        // scores of 16 rows x this warp's 16 keys (two n-tiles), over MLA_DK dims: four accumulator chains
        // (n-tile x even / odd 16-dim step), half the dependent-mma depth of two (H200, one warp per SMSP:
        // the two-chain loop took ~36 mma latencies per block)
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const bf16_t* kb = &kv[half * 16 + (lane & 7) + (lane >> 4) * 8][((lane >> 3) & 1) * 8];  // B: x4 over (keys, k)
#pragma unroll
        for (int k = 0; k + 32 <= MLA_DK; k += 32) {
            u32 a[4], bk[4], a1[4], bk1[4];
            ldsm_x4(a, qa + k);
            ldsm_x4(bk, kb + k);
            ldsm_x4(a1, qa + k + 16);
            ldsm_x4(bk1, kb + k + 16);
            mma_bf16_16816(s[0], a, bk[0], bk[1]);
            mma_bf16_16816(s[1], a, bk[2], bk[3]);
            mma_bf16_16816(s_odd[0], a1, bk1[0], bk1[1]);
            mma_bf16_16816(s_odd[1], a1, bk1[2], bk1[3]);
        }
#if MLA_DK % 32 != 0
        {                                            // the last 16 dims when MLA_DK is an odd multiple of 16
            constexpr int k = MLA_DK - 16;
            u32 a[4], bk[4];
            ldsm_x4(a, qa + k);
            ldsm_x4(bk, kb + k);
            mma_bf16_16816(s[0], a, bk[0], bk[1]);
            mma_bf16_16816(s[1], a, bk[2], bk[3]);
        }
#endif
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] += s_odd[nt][e];
        PROF_MARK(2)
        // scale to log2 units, mask keys past the split and tree keys off the ancestor chain
        const bool masked = key0 + MLA_NB > T;
        float mx[2] = {DD_NEG_INF, DD_NEG_INF};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + half * 16 + nt * 8 + 2 * t + (e & 1), hi = e >> 1;
                float v = s[nt][e] * scale_log2;
                if (masked) {
                    bool ok = key < end;
                    if (ok && key >= T && rows_valid[hi]) {
                        const int j = key - T;
                        ok = ((hi ? vis_hi : vis_lo)[j >> 5] >> (j & 31)) & 1u;
                    }
                    if (!ok) v = DD_NEG_INF;
                }
                s[nt][e] = v;
                mx[hi] = fmaxf(mx[hi], v);
            }
        }
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 1));
            mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 2));
        }
        if (t == 0) { sm.swap[pair][half][g] = mx[0]; sm.swap[pair][half][g + 8] = mx[1]; }
        named_barrier(1 + pair, 64);
        float alpha[2], m_use[2];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const float m_new = fmaxf(m_run[hi], fmaxf(mx[hi], sm.swap[pair][half ^ 1][g + 8 * hi]));
            m_use[hi] = m_new == DD_NEG_INF ? 0.f : m_new;       // a row with nothing visible yet stays at 0
            alpha[hi] = exp2f(m_run[hi] - m_use[hi]);
            m_run[hi] = m_new;
        }
        // probabilities (bf16) to the pair's buffer; this warp's share of the row sums
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const float p0 = exp2f(s[nt][0] - m_use[0]), p1 = exp2f(s[nt][1] - m_use[0]);
            const float p2 = exp2f(s[nt][2] - m_use[1]), p3 = exp2f(s[nt][3] - m_use[1]);
            sum[0] += p0 + p1;
            sum[1] += p2 + p3;
            const int col = half * 16 + nt * 8 + 2 * t;
            *(u32*)&sm.p[pair][g][col] = pack_bf16x2(p0, p1);
            *(u32*)&sm.p[pair][g + 8][col] = pack_bf16x2(p2, p3);
        }
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) l_run[hi] = l_run[hi] * alpha[hi] + sum[hi];
        PROF_MARK(3)
#pragma unroll
        for (int nt = 0; nt < MLA_NT; ++nt) {
            o[nt][0] *= alpha[0]; o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1]; o[nt][3] *= alpha[1];
        }
        named_barrier(1 + pair, 64);                 // both halves of P written (and both maxima read)
        PROF_MARK(4)

        // o[16 rows, this warp's MLA_HALF dims] += P[16, 32 keys] . c_kv[32 keys, dims]
#pragma unroll
        for (int kk = 0; kk < MLA_NB; kk += 16) {
            u32 a[4];
            ldsm_x4(a, &sm.p[pair][(lane & 7) + ((lane >> 3) & 1) * 8][kk + (lane >> 4) * 8]);
            const bf16_t* vb = &kv[kk + (lane & 7) + ((lane >> 3) & 1) * 8][half * MLA_HALF + (lane >> 4) * 8];
#pragma unroll
            for (int nt = 0; nt < MLA_NT; nt += 2) {
                u32 bv[4];
                ldsm_x4_trans(bv, vb + nt * 8);
                mma_bf16_16816(o[nt], a, bv[0], bv[1]);
                mma_bf16_16816(o[nt + 1], a, bv[2], bv[3]);
            }
        }
    }
    PROF_MARK(5)
    PROF_T(3)
    PROF_PRINT("tree", nblk)

    // ---- finish: full row sums from both halves, normalise, write -----------------------------------
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], 1);
        l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], 2);
    }
    named_barrier(1 + pair, 64);                     // the partner no longer reads the maxima
    if (t == 0) { sm.swap[pair][half][g] = l_run[0]; sm.swap[pair][half][g + 8] = l_run[1]; }
    named_barrier(1 + pair, 64);
    float inv[2], lse2[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        const float l = l_run[hi] + sm.swap[pair][half ^ 1][g + 8 * hi];
        inv[hi] = l > 0.f ? 1.f / l : 0.f;
        lse2[hi] = l > 0.f ? m_run[hi] + log2f(l) : DD_NEG_INF;
    }
    const int rr[2] = {r_lo, r_hi};
    if (n_splits == 1) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            if (!rows_valid[hi]) continue;
            u32* dst = (u32*)(out + (size_t)rr[hi] * MLA_DL + half * MLA_HALF + 2 * t);
#pragma unroll
            for (int nt = 0; nt < MLA_NT; ++nt)
                dst[nt * 4] = pack_bf16x2(o[nt][2 * hi] * inv[hi], o[nt][2 * hi + 1] * inv[hi]);
            if (lse_out && half == 0 && t == 0) lse_out[rr[hi]] = lse2[hi] * 0.69314718055994531f;
        }
    } else {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            if (!rows_valid[hi]) continue;
            float2* dst = (float2*)(part_o + ((size_t)split * R + rr[hi]) * MLA_DL + half * MLA_HALF + 2 * t);
#pragma unroll
            for (int nt = 0; nt < MLA_NT; ++nt)
                dst[nt * 4] = make_float2(o[nt][2 * hi] * inv[hi], o[nt][2 * hi + 1] * inv[hi]);
            if (half == 0 && t == 0) part_lse[(size_t)split * R + rr[hi]] = lse2[hi];
        }
    }
    PROF_TIMELINE("tree")
}

// Merge the splits (both forms write the same partials): lse = log2 sum_s 2^lse_s, out = sum_s 2^(lse_s - lse) o_s.
// Grid (R, MLA_DL / (4 * lanes)), block 256 = groups x lanes with groups = 256 / lanes a power of two: thread
// (group, lane) sums splits group, group + groups, .. for 4 dims, then the groups add up in shared memory.
// The first CMB_PREFETCH of a thread's partials are loaded right after the wait, before the weights are
// known, so their L2 round trip overlaps the one of the log-sum-exps (the rest: loads unrolled by 4,
// independent, in flight together). Dynamic smem: n_splits floats (the weights) + groups * lanes float4.
// Empty splits carry lse = -inf and zero outputs, so their weight 0 multiplies zeros.
#define CMB_PREFETCH 8                // partials per thread loaded before the weights (a float4 each)
extern "C" __global__ void __launch_bounds__(256)
mla_attention_combine(const float* __restrict__ part_o, const float* __restrict__ part_lse, bf16_t* __restrict__ out,
                      float* __restrict__ lse_out, int R, int n_splits, int lanes) {
    extern __shared__ __align__(16) float cmb[];
    float4* red = (float4*)cmb;                      // [groups][lanes]
    float* w = cmb + 4 * blockDim.x;                 // [n_splits]
    __shared__ float s_max[8], s_sum[8];
#ifdef DD_PROFILE
    const u64 prof_entry = global_ns();
#endif
    pdl_wait();
    pdl_trigger();
    const int r = blockIdx.x, groups = blockDim.x / lanes;
    const int group = threadIdx.x / lanes, lane = threadIdx.x - group * lanes, d = (blockIdx.y * lanes + lane) * 4;
    const int warp = threadIdx.x >> 5;
    const float* base = part_o + (size_t)r * MLA_DL + d;
    const size_t step = (size_t)R * MLA_DL;
    float4 pre[CMB_PREFETCH];                        // splits group + u * groups, u < CMB_PREFETCH
#pragma unroll
    for (int u = 0; u < CMB_PREFETCH; ++u) {
        const int s = group + u * groups;
        pre[u] = s < n_splits ? ld_cg_f4((const float4*)(base + (size_t)s * step)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float m = DD_NEG_INF;
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
        const float v = ld_cg_f32(&part_lse[(size_t)s * R + r]);
        w[s] = v;
        m = fmaxf(m, v);
    }
#pragma unroll
    for (int sh = 16; sh; sh >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, sh));
    if ((threadIdx.x & 31) == 0) s_max[warp] = m;
    __syncthreads();
    m = s_max[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); ++i) m = fmaxf(m, s_max[i]);
    const float m_use = m == DD_NEG_INF ? 0.f : m;
    float wsum = 0.f;
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
        const float e = exp2f(w[s] - m_use);
        w[s] = e;
        wsum += e;
    }
#pragma unroll
    for (int sh = 16; sh; sh >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, sh);
    if ((threadIdx.x & 31) == 0) s_sum[warp] = wsum;
    __syncthreads();
    wsum = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) wsum += s_sum[i];

    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int u = 0; u < CMB_PREFETCH; ++u) {
        const int s = group + u * groups;
        if (s < n_splits) {
            const float e = w[s];
            acc.x += e * pre[u].x; acc.y += e * pre[u].y; acc.z += e * pre[u].z; acc.w += e * pre[u].w;
        }
    }
    int s = group + CMB_PREFETCH * groups;
    for (; s + 3 * groups < n_splits; s += 4 * groups) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = ld_cg_f4((const float4*)(base + (size_t)(s + u * groups) * step));
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const float e = w[s + u * groups];
            acc.x += e * v[u].x; acc.y += e * v[u].y; acc.z += e * v[u].z; acc.w += e * v[u].w;
        }
    }
    for (; s < n_splits; s += groups) {
        const float4 v = ld_cg_f4((const float4*)(base + (size_t)s * step));
        const float e = w[s];
        acc.x += e * v.x; acc.y += e * v.y; acc.z += e * v.z; acc.w += e * v.w;
    }
    red[threadIdx.x] = acc;
    __syncthreads();
    if (group == 0) {
        for (int g2 = 1; g2 < groups; ++g2) {
            const float4 v = red[g2 * lanes + lane];
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
        *(uint2*)(out + (size_t)r * MLA_DL + d) = make_uint2(pack_bf16x2(acc.x * inv, acc.y * inv),
                                                             pack_bf16x2(acc.z * inv, acc.w * inv));
        if (lse_out && blockIdx.y == 0 && lane == 0)
            lse_out[r] = wsum > 0.f ? (m_use + log2f(wsum)) * 0.69314718055994531f : DD_NEG_INF;
    }
#ifdef DD_PROFILE
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0)
        printf("combine block 0: entry %llu exit %llu\n", prof_entry, global_ns());
#endif
}

#define DD_DEFINE_MLA(NPAIR, STAGES)                                                                   \
    extern "C" __global__ void __launch_bounds__(NPAIR * 64, 1)                                         \
    mla_attention_p##NPAIR##_s##STAGES(const bf16_t* q_lat, const bf16_t* q_rope, const bf16_t* cache,  \
                                       const u32* vis, const int* lengths, bf16_t* out, float* lse_out,  \
                                       float* part_o, float* part_lse, int R, int H, int q, int P,       \
                                       int tree_own, float scale_log2) {                                 \
        mla_attention_split<NPAIR, STAGES>(q_lat, q_rope, cache, vis, lengths, out, lse_out, part_o,     \
                                           part_lse, R, H, q, P, tree_own, scale_log2);                  \
    }

// (pairs, stages) compiled; ddtree/plugins/mla_attention.py VARIANTS lists the same set
#if !defined(MLA_TREE_QREG) && !defined(MLA_TREE_WGMMA)   // the forms below have cubins of their own: not these again
DD_DEFINE_MLA(1, 2)
DD_DEFINE_MLA(1, 3)
DD_DEFINE_MLA(1, 4)
DD_DEFINE_MLA(2, 2)
DD_DEFINE_MLA(2, 3)
DD_DEFINE_MLA(4, 2)
DD_DEFINE_MLA(4, 3)

// sizeof(MlaSmem) of each variant above, in that order: the launcher's smem_bytes must agree (GPU test).
extern "C" __global__ void mla_attention_smem_sizes(int* out) {
    out[0] = sizeof(MlaSmem<1, 2>); out[1] = sizeof(MlaSmem<1, 3>); out[2] = sizeof(MlaSmem<1, 4>);
    out[3] = sizeof(MlaSmem<2, 2>); out[4] = sizeof(MlaSmem<2, 3>); out[5] = sizeof(MlaSmem<4, 2>);
    out[6] = sizeof(MlaSmem<4, 3>);
}
#endif

// The tree form with the query fragments in registers (form "tree_qreg"): compiled only with -D MLA_TREE_QREG,
// a cubin of its own (with the combine), so the one above stays byte-identical (the measured kernels).
#ifdef MLA_TREE_QREG
#include "mla_tree_qreg.cuh"
#endif

// The tree form on sm_90a's warpgroup MMA (form "tree_wgmma"): compiled only with -D MLA_TREE_WGMMA, for sm_90a.
#ifdef MLA_TREE_WGMMA
#include "mla_tree_wgmma.cuh"
#endif
