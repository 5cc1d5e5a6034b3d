// Bandwidth-bound form of kernels/mla_attention.cu for few query rows (q * H <= 64: decode, small trees):
// the same inputs, split ranges, mask and outputs (partials for mla_attention_combine), computed with the
// keys as the mma M dimension and 8 query rows as N (the 8-token trick of the MoE kernel), so no mma lane
// is padding at 8 rows and one warp holds all MLA_DL output dims of its 8 rows (MLA_DL / 4 fp32 accumulators:
// 128 for Kimi's 512; the dims are NVRTC defines, mla_common.cuh).
//
// Block: RG row groups of 8 query rows x KS key streams = RG * KS warps; warp (rg, ks) handles rows
// 8 rg .. 8 rg + 7 for the 16-key sub-blocks ks, ks + KS, .. of the split, with its own running max / sum /
// output. Every key is read from memory once per block, whatever RG. Sub-blocks stream through a ring of
// RS slots (slot = sub-block mod RS, RS a multiple of KS, so a stream owns RS / KS slots): the stream's
// row-group-0 warp fills a slot with bulk copies (one 2 x MLA_DK-byte key row per lane, completing on the slot's
// `full` mbarrier), the RG warps of the stream consume it and arrive on its `empty` mbarrier, and the
// filler refills it with the sub-block RS ahead once all have. No block-wide barrier inside the loop. At
// the end the KS warps of each row group merge through shared memory (exact log-sum-exp weights) and the
// block writes one split's result.
// Per warp and 16 keys: S^T [16 keys, 8 rows] = K [16, DK] . Q^T (four independent accumulator chains; a
// last 16-dim k-step when DK is an odd multiple of 16), P^T goes through a 256-byte shared tile to become
// the B operand, O^T [DL, 8] += V^T [DL, 16] . P^T.
#include "mla_common.cuh"

#define DEC_ROWS 8                 // query rows per block (the mma N)
#define DEC_PROW 24                // P^T row stride in bf16 (48 B)
#define DEC_MT (MLA_DL / 16)       // 16-dim m-tiles of O^T (Kimi: 32)
#define DEC_OROW (MLA_DL + 4)      // merge-area row in fp32: + 4 puts lanes (g, t) of a store on 32 distinct banks

template <int RG, int KS, int RS>
struct DecodeSmem {
    static constexpr int W = RG * KS;
    bf16_t q[RG * DEC_ROWS][MLA_ROW];
    union {
        bf16_t kv[RS][16][MLA_ROW];
        struct { float o[W][DEC_ROWS][DEC_OROW]; float m[W][DEC_ROWS]; float l[W][DEC_ROWS]; } merge;
    };
    bf16_t pt[W][DEC_ROWS][DEC_PROW];          // a warp's probabilities, [row][key]
    u64 full[RS];                              // slot landed (phase = use count & 1)
    u64 empty[RS];                             // the RG consumers are done with the slot
};

__device__ __forceinline__ void ldsm_x2(u32 (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

template <int RG, int KS, int RS>
__device__ __forceinline__ void mla_decode_split(
        const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_rope, const bf16_t* __restrict__ cache,
        const u32* __restrict__ vis, const int* __restrict__ lengths, bf16_t* __restrict__ out,
        float* __restrict__ lse_out, float* __restrict__ part_o, float* __restrict__ part_lse,
        int R, int H, int q, int P, int tree_own, float scale_log2) {
    static_assert(RS % KS == 0 && RS >= 2 * KS, "each key stream owns RS / KS >= 2 slots");
    constexpr int NB = 16 * KS;                      // keys per round of the streams (chunks align to it)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    DecodeSmem<RG, KS, RS>& sm = *reinterpret_cast<DecodeSmem<RG, KS, RS>*>(smem_raw);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int rg = warp / KS, ks = warp - rg * KS;
    const int row0 = blockIdx.x * RG * DEC_ROWS, split = blockIdx.y, n_splits = P + tree_own;

    PROF_NS
    PROF_T(0)
    pdl_wait();
    pdl_trigger();
    PROF_T(1)
    mla_load_queries<RG * DEC_ROWS>(sm.q, q_lat, q_rope, row0, R);        // in flight while T is read
    cp_async_commit();
    const int T = ld_cg_s32(lengths);
    const MlaKeyRange range = mla_split_range(split, T, P, tree_own, q, H, R, row0, RG * DEC_ROWS, NB);
    const int begin = range.begin, end = range.end;
    const int nsub = end > begin ? (end - begin + 15) / 16 : 0;     // 16-key sub-blocks

    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < RS; ++i) {
            mbar_init(&sm.full[i], 1);
            mbar_init(&sm.empty[i], RG);
        }
        mbar_init_fence();
    }
    __syncthreads();                                 // barriers initialised
    // sub-block j (of this warp's stream; called by its row-group-0 warp) into slot j % RS, one key row per
    // lane. Keys past `end` copy the last valid row: finite values whose probability the mask sets to 0.
    auto load_sub = [&](int j) {
        if (j >= nsub) return;
        u64* bar = &sm.full[j % RS];
        if (lane == 0) mbar_expect_tx(bar, 16 * MLA_DK * 2);
        __syncwarp();
        if (lane < 16) {
            const int key = min(begin + j * 16 + lane, end - 1);
            bulk_copy_g2s(sm.kv[j % RS][lane], cache + (size_t)key * MLA_DK, MLA_DK * 2, bar);
        }
    };
    if (rg == 0)
        for (int j = ks; j < RS; j += KS) load_sub(j);
    cp_async_wait<0>();
    __syncthreads();                                 // the query rows landed

    // O^T accumulators: m-tile mt = dims 16 mt .. +15; c0,c1 = (dim 16mt+g, rows 2t, 2t+1), c2,c3 = dim +8
    float o[DEC_MT][4];
#pragma unroll
    for (int mt = 0; mt < DEC_MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
    float m_run[2] = {DD_NEG_INF, DD_NEG_INF}, l_run[2] = {0.f, 0.f};   // rows 2t, 2t+1 (l: this lane's keys)
    const int W_vis = (q + 31) >> 5;
    const int r0 = row0 + rg * DEC_ROWS + 2 * t, r1 = r0 + 1;
    const bool rows_valid[2] = {r0 < R, r1 < R};
    const u32* vis_r[2] = {vis + (size_t)min(r0 / H, q - 1) * W_vis, vis + (size_t)min(r1 / H, q - 1) * W_vis};
    const bf16_t* qb = &sm.q[rg * DEC_ROWS + (lane & 7)][(lane >> 3) * 8];      // B: x4 = 2 k-steps of Q^T
    bf16_t (*pt)[DEC_PROW] = sm.pt[warp];

    PROF_INIT
    PROF_T(2)
    for (int sub = ks; sub < nsub; sub += KS) {
        PROF_MARK(5)
        PROF_MARK(1)
        mbar_wait(&sm.full[sub % RS], (sub / RS) & 1);
        PROF_MARK(0)
        const bf16_t (*kv)[MLA_ROW] = sm.kv[sub % RS];                          // this warp's 16 keys
        const int key0 = begin + sub * 16;

        float s[4][4];
#pragma unroll
        for (int c = 0; c < 4; ++c) s[c][0] = s[c][1] = s[c][2] = s[c][3] = 0.f;
        const bf16_t* ka = &kv[(lane & 7) + ((lane >> 3) & 1) * 8][(lane >> 4) * 8];   // A: x4 over (keys, k)
#pragma unroll
        for (int k = 0; k + 32 <= MLA_DK; k += 32) {
            u32 a0[4], a1[4], bq[4];
            ldsm_x4(bq, qb + k);
            ldsm_x4(a0, ka + k);
            ldsm_x4(a1, ka + k + 16);
            mma_bf16_16816(s[(k >> 5) & 1 ? 2 : 0], a0, bq[0], bq[1]);
            mma_bf16_16816(s[(k >> 5) & 1 ? 3 : 1], a1, bq[2], bq[3]);
        }
#if MLA_DK % 32 != 0
        {                                            // the last 16 dims (lanes 0-15 address the x2 of Q^T)
            constexpr int k = MLA_DK - 16;
            u32 a0[4], bq[2];
            ldsm_x2(bq, qb + k);
            ldsm_x4(a0, ka + k);
            mma_bf16_16816(s[(k >> 5) & 1 ? 2 : 0], a0, bq[0], bq[1]);
        }
#endif
        // c0 = (key g, row 2t), c1 = (key g, row 2t+1), c2 = (key g+8, row 2t), c3 = (key g+8, row 2t+1)
        float sc[4], mx[2] = {DD_NEG_INF, DD_NEG_INF};
        PROF_MARK(2)
        const bool masked = key0 + 16 > T;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = key0 + g + 8 * (e >> 1), hi = e & 1;
            float v = (s[0][e] + s[1][e] + s[2][e] + s[3][e]) * scale_log2;
            if (masked) {
                bool ok = key < end;
                if (ok && key >= T && rows_valid[hi]) {
                    const int j = key - T;
                    ok = (vis_r[hi][j >> 5] >> (j & 31)) & 1u;
                }
                if (!ok) v = DD_NEG_INF;
            }
            sc[e] = v;
            mx[hi] = fmaxf(mx[hi], v);
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
#pragma unroll
            for (int sh = 4; sh < 32; sh <<= 1) mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], sh));
            const float m_new = fmaxf(m_run[hi], mx[hi]);
            m_use[hi] = m_new == DD_NEG_INF ? 0.f : m_new;
            alpha[hi] = exp2f(m_run[hi] - m_use[hi]);
            m_run[hi] = m_new;
        }
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = exp2f(sc[e] - m_use[e & 1]);
        l_run[0] = l_run[0] * alpha[0] + p[0] + p[2];
        l_run[1] = l_run[1] * alpha[1] + p[1] + p[3];
        __syncwarp();                                // the previous block's P^T reads are done
        pt[2 * t][g] = f32_to_bf16(p[0]);
        pt[2 * t + 1][g] = f32_to_bf16(p[1]);
        pt[2 * t][g + 8] = f32_to_bf16(p[2]);
        pt[2 * t + 1][g + 8] = f32_to_bf16(p[3]);
        __syncwarp();
        u32 bp[2];
        ldsm_x2(bp, &pt[lane & 7][((lane >> 3) & 1) * 8]);                     // (keys 2t.., row g), keys +8
        PROF_MARK(3)
#pragma unroll
        for (int mt = 0; mt < DEC_MT; ++mt) {
            o[mt][0] *= alpha[0]; o[mt][1] *= alpha[1];
            o[mt][2] *= alpha[0]; o[mt][3] *= alpha[1];
        }
        PROF_MARK(4)
        const bf16_t* va = &kv[(lane & 7) + (lane >> 4) * 8][((lane >> 3) & 1) * 8];   // A^T: x4.trans over (keys, dims)
#pragma unroll
        for (int mt = 0; mt < DEC_MT; ++mt) {
            u32 a[4];
            ldsm_x4_trans(a, va + 16 * mt);
            mma_bf16_16816(o[mt], a, bp[0], bp[1]);
        }
        __syncwarp();                                // every lane's reads of the slot are done
        if (lane == 0) mbar_arrive(&sm.empty[sub % RS]);
        if (rg == 0 && sub + RS < nsub) {            // refill: same stream, same slot, once all RG are done
            mbar_wait(&sm.empty[sub % RS], (sub / RS) & 1);
            fence_proxy_async();
            load_sub(sub + RS);
        }
    }
    PROF_MARK(5)
    PROF_T(3)
    PROF_PRINT("decode", nsub)
    __syncthreads();                                 // every issued copy was waited for: the ring becomes the merge area

    // ---- merge the warps: weights 2^(m_w - M) / L per (row, stream), exact ------------------------------
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
#pragma unroll
        for (int sh = 4; sh < 32; sh <<= 1) l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], sh);
    if (g == 0) {
        sm.merge.m[warp][2 * t] = m_run[0]; sm.merge.m[warp][2 * t + 1] = m_run[1];
        sm.merge.l[warp][2 * t] = l_run[0]; sm.merge.l[warp][2 * t + 1] = l_run[1];
    }
#pragma unroll
    for (int mt = 0; mt < DEC_MT; ++mt) {
        sm.merge.o[warp][2 * t][16 * mt + g] = o[mt][0];
        sm.merge.o[warp][2 * t + 1][16 * mt + g] = o[mt][1];
        sm.merge.o[warp][2 * t][16 * mt + g + 8] = o[mt][2];
        sm.merge.o[warp][2 * t + 1][16 * mt + g + 8] = o[mt][3];
    }
    __syncthreads();
    // one thread per row: m[w][row] becomes the stream's weight 2^(m_w - M) / L, l[w0][row] the row's log2-sum-exp
    for (int rowb = threadIdx.x; rowb < RG * DEC_ROWS; rowb += blockDim.x) {
        const int w0 = (rowb / DEC_ROWS) * KS, row = rowb % DEC_ROWS;     // the KS warps of this row group
        float M = DD_NEG_INF;
#pragma unroll
        for (int k = 0; k < KS; ++k) M = fmaxf(M, sm.merge.m[w0 + k][row]);
        const float M_use = M == DD_NEG_INF ? 0.f : M;
        float e[KS], L = 0.f;
#pragma unroll
        for (int k = 0; k < KS; ++k) {
            e[k] = exp2f(sm.merge.m[w0 + k][row] - M_use);
            L += e[k] * sm.merge.l[w0 + k][row];
        }
        const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
        for (int k = 0; k < KS; ++k) sm.merge.m[w0 + k][row] = e[k] * inv;
        sm.merge.l[w0][row] = L > 0.f ? M_use + log2f(L) : DD_NEG_INF;
    }
    __syncthreads();
    // 4 dims per item: consecutive threads take consecutive 16-byte pieces of a row (coalesced writes)
    for (int i = threadIdx.x; i < RG * DEC_ROWS * (MLA_DL / 4); i += blockDim.x) {
        const int rowb = i / (MLA_DL / 4), d = (i - rowb * (MLA_DL / 4)) * 4, r = row0 + rowb;
        if (r >= R) continue;
        const int w0 = (rowb / DEC_ROWS) * KS, row = rowb % DEC_ROWS;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int k = 0; k < KS; ++k) {
            const float e = sm.merge.m[w0 + k][row];
            const float4 x = *(const float4*)&sm.merge.o[w0 + k][row][d];
            v.x += e * x.x; v.y += e * x.y; v.z += e * x.z; v.w += e * x.w;
        }
        const float lse2 = sm.merge.l[w0][row];
        if (n_splits == 1) {
            *(uint2*)(out + (size_t)r * MLA_DL + d) = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
            if (lse_out && d == 0) lse_out[r] = lse2 * 0.69314718055994531f;
        } else {
            *(float4*)(part_o + ((size_t)split * R + r) * MLA_DL + d) = v;
            if (d == 0) part_lse[(size_t)split * R + r] = lse2;
        }
    }
    PROF_TIMELINE("decode")
}

#define DD_DEFINE_DECODE(RG, KS, RS)                                                                   \
    extern "C" __global__ void __launch_bounds__(RG * KS * 32)                                          \
    mla_decode_r##RG##_k##KS##_s##RS(const bf16_t* q_lat, const bf16_t* q_rope, const bf16_t* cache,    \
                                     const u32* vis, const int* lengths, bf16_t* out, float* lse_out,    \
                                     float* part_o, float* part_lse, int R, int H, int q, int P,         \
                                     int tree_own, float scale_log2) {                                   \
        mla_decode_split<RG, KS, RS>(q_lat, q_rope, cache, vis, lengths, out, lse_out, part_o, part_lse, \
                                     R, H, q, P, tree_own, scale_log2);                                  \
    }

// (row groups, key streams, ring slots) compiled; ddtree/plugins/mla_attention.py VARIANTS lists the same set
DD_DEFINE_DECODE(1, 2, 4)
DD_DEFINE_DECODE(1, 3, 9)
DD_DEFINE_DECODE(1, 4, 8)
DD_DEFINE_DECODE(2, 2, 4)
DD_DEFINE_DECODE(2, 3, 9)
DD_DEFINE_DECODE(4, 2, 8)
DD_DEFINE_DECODE(8, 1, 7)

extern "C" __global__ void mla_decode_smem_sizes(int* out) {
    out[0] = sizeof(DecodeSmem<1, 2, 4>); out[1] = sizeof(DecodeSmem<1, 3, 9>); out[2] = sizeof(DecodeSmem<1, 4, 8>);
    out[3] = sizeof(DecodeSmem<2, 2, 4>); out[4] = sizeof(DecodeSmem<2, 3, 9>); out[5] = sizeof(DecodeSmem<4, 2, 8>);
    out[6] = sizeof(DecodeSmem<8, 1, 7>);
}
