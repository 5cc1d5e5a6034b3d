// Tree form with the query fragments held in registers (issue 23; mla_attention.cu compiles it
// only with -D MLA_TREE_QREG, into a cubin of its own, so the measured tree / combine cubin stays
// byte-identical). Launcher: ddtree/plugins/mla_attention.py form "tree_qreg" (the default where qreg_default
// says: H200 numbers in NOTES.md "Query fragments in registers"); the same contract, key ranges,
// partials and combine as mla_attention_split, and the same math: online softmax in log2 units, the row
// maxima and sums of a row group's warps swapped through shared memory, P.V by mma, (o, lse2) partials.
//
// What differs is the scores. In mla_attention_split each warp of a pair re-reads its 16 query rows' A
// fragments from shared memory every 32-key step (36 ldmatrix.x4 at 576 dims, as many as for its keys).
// Here a group of G warps shares 16 query rows and warp `part` owns the k-steps [part * QR_KSP, ..) of the
// key dims for all 32 keys: it loads the group's query fragments for those dims once (QR_KSP x 4
// registers: 72 at Kimi's 576 dims for G = 2, 36 for G = 4) and per step reads only the keys' B fragments.
// The G partial score tiles meet through shared memory (each warp writes its 16 x 32 fp32 partial, one
// named barrier, each warp adds the G partials of the 32 / G keys it owns, in warp order). From there the
// step is mla_attention_split's with G warps instead of 2: each owns 32 / G keys for the softmax and
// MLA_DL / G output dims for P.V (G = 4: 64 fp32 accumulators a thread instead of 128).
// The query rows land in the ring's last slot (refilled by the first step only after every warp holds its
// fragments), so the block has no query tile: 2 groups x 2 slots fit sm_120's 99 KB.

#define MLA_KS (MLA_DK / 16)                 // 16-dim k-steps of a key (Kimi: 36)
#define MLA_XROW 40                          // partial-score row stride in fp32 (32 keys + 8): float2 stores
                                             // of a half-warp hit 32 distinct banks

template <int NGRP, int G, int STAGES>
struct MlaQregSmem {
    bf16_t kv[STAGES][MLA_NB][MLA_ROW];      // key blocks [c_kv | k_pe]; the query rows in slot STAGES - 1 first
    bf16_t p[NGRP][16][MLA_PROW];            // a group's probabilities of the current block
    float x[NGRP][G][16][MLA_XROW];          // x[group][part]: warp part's partial scores of the 32 keys
    float swap[NGRP][G][16];                 // a group's per-warp row maxima, then row sums
    u64 full[STAGES];                        // key block landed (phase = use count & 1)
};

template <int NGRP, int G, int STAGES>
__device__ __forceinline__ void mla_attention_split_qreg(
        const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_rope, const bf16_t* __restrict__ cache,
        const u32* __restrict__ vis, const int* __restrict__ lengths, bf16_t* __restrict__ out,
        float* __restrict__ lse_out, float* __restrict__ part_o, float* __restrict__ part_lse,
        int R, int H, int q, int P, int tree_own, float scale_log2) {
    constexpr int KSP = (MLA_KS + G - 1) / G;        // k-steps per warp (the last warps may hold fewer)
    constexpr int KEYS = MLA_NB / G, NTK = KEYS / 8; // keys a warp owns after the exchange, their 8-key n-tiles
    constexpr int DH = MLA_DL / G, NT = DH / 8;      // output dims a warp owns, their n-tiles
    static_assert(NGRP * 16 <= MLA_NB, "the block's query rows borrow one 32-row ring slot");
    static_assert(STAGES >= 2, "the query rows borrow the slot that the prologue leaves empty");
    static_assert((G == 2 || G == 4) && DH % 16 == 0, "P.V steps 16 output dims per ldmatrix.x4.trans");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    MlaQregSmem<NGRP, G, STAGES>& sm = *reinterpret_cast<MlaQregSmem<NGRP, G, STAGES>*>(smem_raw);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int grp = warp / G, part = warp % G;
    const int rows_per_block = NGRP * 16, row0 = blockIdx.x * rows_per_block;
    const int split = blockIdx.y, n_splits = P + tree_own;

    pdl_wait();                                      // queries, lengths and new cache entries come from earlier kernels
    pdl_trigger();
    bf16_t (*qrows)[MLA_ROW] = sm.kv[STAGES - 1];
    mla_load_queries<NGRP * 16>(qrows, q_lat, q_rope, row0, R);
    cp_async_commit();
    const int T = ld_cg_s32(lengths);
    const MlaKeyRange range = mla_split_range(split, T, P, tree_own, q, H, R, row0, rows_per_block, MLA_NB);
    const int begin = range.begin, end = range.end;
    const int nblk = end > begin ? (end - begin + MLA_NB - 1) / MLA_NB : 0;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < STAGES; ++i) mbar_init(&sm.full[i], 1);
        mbar_init_fence();
    }
    __syncthreads();                                 // barriers initialised
    auto load_block = [&](int b) {                   // as in mla_attention_split
        if (b >= nblk) return;
        if (threadIdx.x == 0) mbar_expect_tx(&sm.full[b % STAGES], MLA_NB * MLA_DK * 2);
        constexpr int per_warp = MLA_NB / (NGRP * G);
        if (lane < per_warp) {
            const int k = warp * per_warp + lane, key = min(begin + b * MLA_NB + k, end - 1);
            bulk_copy_g2s(sm.kv[b % STAGES][k], cache + (size_t)key * MLA_DK, MLA_DK * 2, &sm.full[b % STAGES]);
        }
    };
#pragma unroll
    for (int b = 0; b < STAGES - 1; ++b) load_block(b);
    cp_async_wait<0>();
    __syncthreads();                                 // the query rows landed

    // this warp's query A fragments: its group's 16 rows, k-steps k_step0 .. k_step0 + my_ks - 1
    const int k_step0 = part * KSP, my_ks = max(0, min(KSP, MLA_KS - k_step0));
    u32 qf[KSP][4];
    {
        const bf16_t* qa = &qrows[grp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][k_step0 * 16 + (lane >> 4) * 8];
#pragma unroll
        for (int i = 0; i < KSP; ++i)
            if (MLA_KS % G == 0 || i < my_ks) ldsm_x4(qf[i], qa + 16 * i);
    }
    __syncthreads();                                 // every warp holds its fragments: the slot may be refilled

    float o[NT][4];                                  // dims part*DH + 8 nt + 2t (+1); rows g (0,1), g+8 (2,3)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m_run[2] = {DD_NEG_INF, DD_NEG_INF}, l_run[2] = {0.f, 0.f};
    const int r_lo = row0 + grp * 16 + g, r_hi = r_lo + 8;
    const int W = (q + 31) >> 5;
    const u32* vis_lo = vis + (size_t)min(r_lo / H, q - 1) * W;
    const u32* vis_hi = vis + (size_t)min(r_hi / H, q - 1) * W;
    const bool rows_valid[2] = {r_lo < R, r_hi < R};
    const int bar = 1 + grp, bar_threads = 32 * G;

    for (int b = 0; b < nblk; ++b) {
        if (b) __syncthreads();                      // everyone is done with block b - 1's slot
        fence_proxy_async();                         // (its reads, and the query fragments') before the refill
        load_block(b + STAGES - 1);
        mbar_wait(&sm.full[b % STAGES], (b / STAGES) & 1);
        const bf16_t (*kv)[MLA_ROW] = sm.kv[b % STAGES];
        const int key0 = begin + b * MLA_NB;

        // partial scores of 16 rows x 32 keys (n-tiles 0..3) over this warp's k-steps: four chains
        float s4[4][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        const bf16_t* kb = &kv[(lane & 7) + (lane >> 4) * 8][k_step0 * 16 + ((lane >> 3) & 1) * 8];  // B: x4 (keys, k)
#pragma unroll
        for (int i = 0; i < KSP; ++i) {
            if (MLA_KS % G == 0 || i < my_ks) {
                u32 b0[4], b1[4];
                ldsm_x4(b0, kb + 16 * i);                    // keys 0..15
                ldsm_x4(b1, kb + 16 * MLA_ROW + 16 * i);     // keys 16..31
                mma_bf16_16816(s4[0], qf[i], b0[0], b0[1]);
                mma_bf16_16816(s4[1], qf[i], b0[2], b0[3]);
                mma_bf16_16816(s4[2], qf[i], b1[0], b1[1]);
                mma_bf16_16816(s4[3], qf[i], b1[2], b1[3]);
            }
        }
        // the group's partials meet: s = this warp's KEYS keys (part * KEYS ..) over all dims, summed in warp order
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            *(float2*)&sm.x[grp][part][g][nt * 8 + 2 * t] = make_float2(s4[nt][0], s4[nt][1]);
            *(float2*)&sm.x[grp][part][g + 8][nt * 8 + 2 * t] = make_float2(s4[nt][2], s4[nt][3]);
        }
        named_barrier(bar, bar_threads);
        float s[NTK][4];
#pragma unroll
        for (int nt = 0; nt < NTK; ++nt) {
            const int col = part * KEYS + nt * 8 + 2 * t;
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int w = 0; w < G; ++w) {
                const float2 lo = *(const float2*)&sm.x[grp][w][g][col];
                const float2 hi = *(const float2*)&sm.x[grp][w][g + 8][col];
                s[nt][0] += lo.x; s[nt][1] += lo.y; s[nt][2] += hi.x; s[nt][3] += hi.y;
            }
        }

        // from here as mla_attention_split (G warps): scale, mask, the group's maxima, probabilities, P.V
        const bool masked = key0 + MLA_NB > T;
        float mx[2] = {DD_NEG_INF, DD_NEG_INF};
#pragma unroll
        for (int nt = 0; nt < NTK; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + part * KEYS + nt * 8 + 2 * t + (e & 1), hi = e >> 1;
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
        if (t == 0) { sm.swap[grp][part][g] = mx[0]; sm.swap[grp][part][g + 8] = mx[1]; }
        named_barrier(bar, bar_threads);
        float alpha[2], m_use[2];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            float m_new = m_run[hi];
#pragma unroll
            for (int w = 0; w < G; ++w) m_new = fmaxf(m_new, sm.swap[grp][w][g + 8 * hi]);
            m_use[hi] = m_new == DD_NEG_INF ? 0.f : m_new;       // a row with nothing visible yet stays at 0
            alpha[hi] = exp2f(m_run[hi] - m_use[hi]);
            m_run[hi] = m_new;
        }
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < NTK; ++nt) {
            const float p0 = exp2f(s[nt][0] - m_use[0]), p1 = exp2f(s[nt][1] - m_use[0]);
            const float p2 = exp2f(s[nt][2] - m_use[1]), p3 = exp2f(s[nt][3] - m_use[1]);
            sum[0] += p0 + p1;
            sum[1] += p2 + p3;
            const int col = part * KEYS + nt * 8 + 2 * t;
            *(u32*)&sm.p[grp][g][col] = pack_bf16x2(p0, p1);
            *(u32*)&sm.p[grp][g + 8][col] = pack_bf16x2(p2, p3);
        }
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) l_run[hi] = l_run[hi] * alpha[hi] + sum[hi];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            o[nt][0] *= alpha[0]; o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1]; o[nt][3] *= alpha[1];
        }
        named_barrier(bar, bar_threads);             // all of P written, every maximum and partial read
#pragma unroll
        for (int kk = 0; kk < MLA_NB; kk += 16) {
            u32 a[4];
            ldsm_x4(a, &sm.p[grp][(lane & 7) + ((lane >> 3) & 1) * 8][kk + (lane >> 4) * 8]);
            const bf16_t* vb = &kv[kk + (lane & 7) + ((lane >> 3) & 1) * 8][part * DH + (lane >> 4) * 8];
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                u32 bv[4];
                ldsm_x4_trans(bv, vb + nt * 8);
                mma_bf16_16816(o[nt], a, bv[0], bv[1]);
                mma_bf16_16816(o[nt + 1], a, bv[2], bv[3]);
            }
        }
    }

    // ---- finish: full row sums from the group's warps, normalise, write -----------------------------
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], 1);
        l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], 2);
    }
    named_barrier(bar, bar_threads);                 // no warp of the group still reads the maxima
    if (t == 0) { sm.swap[grp][part][g] = l_run[0]; sm.swap[grp][part][g + 8] = l_run[1]; }
    named_barrier(bar, bar_threads);
    float inv[2], lse2[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < G; ++w) l += sm.swap[grp][w][g + 8 * hi];
        inv[hi] = l > 0.f ? 1.f / l : 0.f;
        lse2[hi] = l > 0.f ? m_run[hi] + log2f(l) : DD_NEG_INF;
    }
    const int rr[2] = {r_lo, r_hi};
    if (n_splits == 1) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            if (!rows_valid[hi]) continue;
            u32* dst = (u32*)(out + (size_t)rr[hi] * MLA_DL + part * DH + 2 * t);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                dst[nt * 4] = pack_bf16x2(o[nt][2 * hi] * inv[hi], o[nt][2 * hi + 1] * inv[hi]);
            if (lse_out && part == 0 && t == 0) lse_out[rr[hi]] = lse2[hi] * 0.69314718055994531f;
        }
    } else {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            if (!rows_valid[hi]) continue;
            float2* dst = (float2*)(part_o + ((size_t)split * R + rr[hi]) * MLA_DL + part * DH + 2 * t);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                dst[nt * 4] = make_float2(o[nt][2 * hi] * inv[hi], o[nt][2 * hi + 1] * inv[hi]);
            if (part == 0 && t == 0) part_lse[(size_t)split * R + rr[hi]] = lse2[hi];
        }
    }
}

#define DD_DEFINE_MLA_QREG(NGRP, G, STAGES)                                                               \
    extern "C" __global__ void __launch_bounds__(NGRP * G * 32, 1)                                        \
    mla_attention_qreg_r##NGRP##_w##G##_s##STAGES(const bf16_t* q_lat, const bf16_t* q_rope,             \
                                                  const bf16_t* cache, const u32* vis, const int* lengths, \
                                                  bf16_t* out, float* lse_out, float* part_o,            \
                                                  float* part_lse, int R, int H, int q, int P,           \
                                                  int tree_own, float scale_log2) {                      \
        mla_attention_split_qreg<NGRP, G, STAGES>(q_lat, q_rope, cache, vis, lengths, out, lse_out, part_o, \
                                                  part_lse, R, H, q, P, tree_own, scale_log2);           \
    }

// (16-row groups, warps per group, stages) compiled; ddtree/plugins/mla_attention.py QREG_VARIANTS lists the same
// set (4-warp groups only where MLA_DL / 4 is a multiple of 16)
DD_DEFINE_MLA_QREG(1, 2, 2)
DD_DEFINE_MLA_QREG(1, 2, 3)
DD_DEFINE_MLA_QREG(2, 2, 2)
DD_DEFINE_MLA_QREG(2, 2, 3)
#if MLA_DL % 64 == 0
DD_DEFINE_MLA_QREG(1, 4, 2)
DD_DEFINE_MLA_QREG(1, 4, 3)
DD_DEFINE_MLA_QREG(2, 4, 2)
#endif

// sizeof(MlaQregSmem) of each variant above, in that order: the launcher's smem_bytes must agree (GPU test).
extern "C" __global__ void mla_attention_qreg_smem_sizes(int* out) {
    out[0] = sizeof(MlaQregSmem<1, 2, 2>); out[1] = sizeof(MlaQregSmem<1, 2, 3>);
    out[2] = sizeof(MlaQregSmem<2, 2, 2>); out[3] = sizeof(MlaQregSmem<2, 2, 3>);
    out[4] = sizeof(MlaQregSmem<1, 4, 2>); out[5] = sizeof(MlaQregSmem<1, 4, 3>);
    out[6] = sizeof(MlaQregSmem<2, 4, 2>);
}
