// The attention's split merge and absorb_out as one launch (issue 48): the op set's mla_attention_out pattern's
// second kernel, after the split kernel of kernels/mla_decode.cu or mla_attention.cu (any form: all write the same
// partials). Per token m and head h:
//   o_lat[m, h, :R] = sum_s 2^(lse_s - lse) o_s[m, h, :R]      (mla_attention_combine's merge, lse = log2 sum 2^lse_s)
//   out[m, h, :Dv]  = bf16(o_lat) @ W_UV[h]^T                  (mla_absorb.cu's absorb_out, W_UV read from kv_b)
// Numpy twin: ddtree/plugins/reference.py mla_merge_absorb. Launcher: ddtree/plugins/mla_absorb.py MlaAbsorb.merged.
//
// Why one launch: at one to a few tokens the combine and the absorb are each a kernel boundary on the layer's
// chain (timeline, H100 AR: split kernel end -> combine end 3.0 us -> absorb end 1.9 us) for ~1 MB of L2 reads
// and 1 MB of weights. Here the absorb's weights are in registers before the PDL wait and the merge feeds the mma
// from shared memory.
//
// Grid (C, heads, token blocks) in clusters of (C, 1, 1), block 512 threads (16 warps). Block j of head h's cluster owns the
// latent's k-span [j KS, (j + 1) KS) (KS = 32 KC, C = R / KS <= 8) for up to 8 MT tokens: it merges only its span
// (every partial is read once over the cluster), multiplies it by its span of W_UV[h] (warp n < Dv / 16: output
// columns [16 n, 16 n + 16), the mma of absorb_gemm: weights the A operand, 8 tokens the B), keeps the [tokens, Dv]
// partial product in shared memory, and after a cluster barrier sums its share of the outputs over the C blocks'
// products in rank order (distributed shared memory): a fixed order, deterministic.
// Merge: thread (group, column) of `groups` x `ncol` (ncol = rows x KS / 4 float4 columns) sums splits group,
// group + groups, .. in order, the groups then add up in order (as the combine; the grouping differs from the
// combine's, so the last bits may). The first AA_PREFETCH partials of a thread are loaded right after the wait,
// beside the log2-sum-exps: with 16 warps every split of a column is in flight at once up to 12 x groups splits
// (one token: 32 groups; 9 tokens: 3), where the first form's 8 warps (prefetch 8, then 4 at a time) took a
// budget 8 tree's 34 splits in 8 round trips (H100: the step 1.3 % slower at budget 8, 0.6 % faster at AR).
//   part_o [splits, rows_all, R] fp32, part_lse [splits, rows_all] fp32 (log2), rows_all = M heads, row = m heads + h
//   w [heads, Dv, R] bf16 at w + h w_head + c w_row (kv_b's W_UV rows as stored)
//   out [M, heads, Dv] bf16 at out + m o_tok + h o_head
// Dynamic shared memory: rows x splits floats (the merge weights), rows = tokens of the block (launcher: <= 4096).
#include "common.cuh"

#define AA_THREADS 512           // 16 warps: more (group, column) pairs, so fewer splits a thread in turn
#define AA_PREFETCH 12          // partials a thread loaded beside the log2-sum-exps (every split up to 12 x groups)

template <int MT, int KC>
__device__ __forceinline__ void attention_absorb(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                                                 const bf16_t* __restrict__ w, long long w_head, int w_row,
                                                 bf16_t* __restrict__ out, int o_tok, int o_head, int M, int H, int R,
                                                 int Dv, int n_splits) {
    constexpr int TB = 8 * MT, KS = 32 * KC, XS = KS + 8;           // tokens a block; x rows padded by 16 B
    constexpr int DVP = 128 + 4;                                     // product row stride (Dv <= 128)
    __shared__ __align__(16) bf16_t xs[TB][XS];                      // the merged span, bf16 (the mma's B)
    __shared__ __align__(16) float prod[TB][DVP];                    // this block's [tokens, Dv] partial product
    __shared__ __align__(16) float4 red[AA_THREADS];
    __shared__ float inv_s[TB];
    extern __shared__ float wgt[];                                   // [rows][n_splits]: 2^(lse_s - max), then row
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int j = cluster_ctarank(), C = gridDim.x, h = blockIdx.y, m0 = blockIdx.z * TB;
    const int rows = min(TB, M - m0), k0 = j * KS, rows_all = M * H;

    // this warp's span of W_UV rows before the wait: the weights come from no earlier kernel
    const bool mma_warp = warp < Dv / 16;
    uint4 wa[KC], wb[KC];
    if (mma_warp) {
        const bf16_t* wg = w + h * w_head + (long long)(16 * warp + g) * w_row + k0 + 8 * t;
#pragma unroll
        for (int c = 0; c < KC; ++c) {
            wa[c] = __ldg((const uint4*)(wg + 32 * c));
            wb[c] = __ldg((const uint4*)(wg + 8 * (long long)w_row + 32 * c));
        }
    }
    for (int i = tid; i < TB * XS / 8; i += AA_THREADS) ((uint4*)&xs[0][0])[i] = make_uint4(0u, 0u, 0u, 0u);
    pdl_wait();                                                      // the partials come from the split kernel
    pdl_trigger();

    // thread -> (group, column): column = (row, float4 of the span); a row's float4 i holds dims k0 + 4 i .. + 3
    const int ncol = rows * (KS / 4), groups = max(1, AA_THREADS / ncol);
    const int group = tid / ncol < groups ? tid / ncol : -1, col0 = tid % ncol;
    const size_t step = (size_t)rows_all * R;
    auto at = [&](int col) {                                         // split 0's float4 of a column
        const int r = col / (KS / 4), i = col - r * (KS / 4);
        return (const float4*)(part_o + (size_t)((m0 + r) * H + h) * R + k0 + 4 * i);
    };
    float4 pre[AA_PREFETCH];
    if (group >= 0) {
        const float4* p = at(col0);
#pragma unroll
        for (int u = 0; u < AA_PREFETCH; ++u) {
            const int s = group + u * groups;
            pre[u] = s < n_splits ? ld_cg_f4((const float4*)((const float*)p + s * step)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    for (int i = tid; i < rows * n_splits; i += AA_THREADS) {
        const int r = i / n_splits, s = i - r * n_splits;
        wgt[i] = ld_cg_f32(part_lse + (size_t)s * rows_all + (m0 + r) * H + h);
    }
    __syncthreads();
    for (int r = warp; r < rows; r += AA_THREADS / 32) {             // a warp a row: max, weights, their sum
        float* wr = wgt + r * n_splits;
        float mx = DD_NEG_INF;
        for (int s = lane; s < n_splits; s += 32) mx = fmaxf(mx, wr[s]);
#pragma unroll
        for (int sh = 16; sh; sh >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, sh));
        const float m_use = mx == DD_NEG_INF ? 0.f : mx;           // every split empty: weights 0, output 0
        float sum = 0.f;
        for (int s = lane; s < n_splits; s += 32) {
            const float e = exp2f(wr[s] - m_use);
            wr[s] = e;
            sum += e;
        }
#pragma unroll
        for (int sh = 16; sh; sh >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, sh);
        if (lane == 0) inv_s[r] = sum > 0.f ? 1.f / sum : 0.f;
    }
    __syncthreads();

    // the merge: a column's splits of this group in order, then (groups > 1) the groups in order
    auto merge = [&](int col, int grp, int grps, bool prefetched) {
        const int r = col / (KS / 4);
        const float* wr = wgt + r * n_splits;
        const float* p = (const float*)at(col);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        int s = grp;
        if (prefetched) {
#pragma unroll
            for (int u = 0; u < AA_PREFETCH; ++u, s += grps) {
                if (s < n_splits) {
                    const float e = wr[s];
                    acc.x += e * pre[u].x; acc.y += e * pre[u].y; acc.z += e * pre[u].z; acc.w += e * pre[u].w;
                }
            }
        }
        for (; s + 3 * grps < n_splits; s += 4 * grps) {
            float4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) v[u] = ld_cg_f4((const float4*)(p + (size_t)(s + u * grps) * step));
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float e = wr[s + u * grps];
                acc.x += e * v[u].x; acc.y += e * v[u].y; acc.z += e * v[u].z; acc.w += e * v[u].w;
            }
        }
        for (; s < n_splits; s += grps) {
            const float4 v = ld_cg_f4((const float4*)(p + (size_t)s * step));
            const float e = wr[s];
            acc.x += e * v.x; acc.y += e * v.y; acc.z += e * v.z; acc.w += e * v.w;
        }
        return acc;
    };
    auto store_x = [&](int col, float4 acc) {                        // normalised, bf16, into the mma's B tile
        const int r = col / (KS / 4), i = col - r * (KS / 4);
        const float inv = inv_s[r];
        *(uint2*)&xs[r][4 * i] = make_uint2(pack_bf16x2(acc.x * inv, acc.y * inv), pack_bf16x2(acc.z * inv, acc.w * inv));
    };
    if (groups == 1) {                                               // >= 256 columns: a thread a column at a time
        for (int col = tid; col < ncol; col += AA_THREADS) store_x(col, merge(col, 0, 1, col == tid));
    } else {
        if (group >= 0) red[tid] = merge(col0, group, groups, true);
        __syncthreads();
        if (group == 0) {
            float4 acc = red[col0];
            for (int g2 = 1; g2 < groups; ++g2) {
                const float4 v = red[g2 * ncol + col0];
                acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
            }
            store_x(col0, acc);
        }
    }
    __syncthreads();

    // this span's product: absorb_gemm's mma (rows g, g + 8 of the warp's 16 columns; 8 tokens a sub-tile)
    if (mma_warp) {
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
#pragma unroll
        for (int c = 0; c < KC; ++c) {
            const u32 a0[4] = {wa[c].x, wb[c].x, wa[c].y, wb[c].y};         // k 8t + 0..3 of rows g, g + 8
            const u32 a1[4] = {wa[c].z, wb[c].z, wa[c].w, wb[c].w};         // k 8t + 4..7
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 xb = *(const uint4*)&xs[mt * 8 + g][32 * c + 8 * t];
                mma_bf16_16816(acc[mt], a0, xb.x, xb.y);
                mma_bf16_16816(acc[mt], a1, xb.z, xb.w);
            }
        }
        // acc[mt] = {(col n, token m), (n, m + 1), (n + 8, m), (n + 8, m + 1)}, n = 16 warp + g, m = 8 mt + 2t
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                prod[mt * 8 + 2 * t + q][16 * warp + g] = acc[mt][q];
                prod[mt * 8 + 2 * t + q][16 * warp + g + 8] = acc[mt][2 + q];
            }
        }
    }
    cluster_sync();                                                  // every block's product is written
    // this block's share of the outputs (float4 e = j, j + C, ..): the C products summed in rank order
    const int q4 = Dv / 4;
    for (int e = j * AA_THREADS + tid; e < rows * q4; e += C * AA_THREADS) {
        const int r = e / q4, c = 4 * (e - r * q4);
        const u32 local = smem_addr(&prod[r][c]);
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int rank = 0; rank < C; ++rank) {
            const float4 v = ld_dsmem_f4(local, rank);
            sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
        }
        *(uint2*)(out + (long long)(m0 + r) * o_tok + h * (long long)o_head + c) =
            make_uint2(pack_bf16x2(sum.x, sum.y), pack_bf16x2(sum.z, sum.w));
    }
    cluster_sync();                                                  // no block leaves while its product is read
}

#define DD_DEFINE_ATTENTION_ABSORB(MT, KC)                                                                       \
    extern "C" __global__ void __launch_bounds__(AA_THREADS) mla_attention_absorb_mt##MT##_kc##KC(              \
            const float* part_o, const float* part_lse, const bf16_t* w, long long w_head, int w_row,          \
            bf16_t* out, int o_tok, int o_head, int M, int H, int R, int Dv, int n_splits) {                     \
        attention_absorb<MT, KC>(part_o, part_lse, w, w_head, w_row, out, o_tok, o_head, M, H, R, Dv, n_splits); \
    }
DD_DEFINE_ATTENTION_ABSORB(1, 1)
DD_DEFINE_ATTENTION_ABSORB(1, 2)
DD_DEFINE_ATTENTION_ABSORB(2, 1)
DD_DEFINE_ATTENTION_ABSORB(2, 2)
DD_DEFINE_ATTENTION_ABSORB(4, 1)
DD_DEFINE_ATTENTION_ABSORB(4, 2)
