// Fused MoE router for 1 <= M <= 256 tokens (issue 22), one launch: the fp32 logits x W^T, then sigmoid,
// + e_score_correction_bias for the choice only, (grouped) top-k with the lowest id winning ties, normalise,
// x routed_scaling_factor, and the token -> expert tile lists that moe_route writes (same outputs, same
// layout; kernels/moe.cu reads them). Launcher and plan: ddtree/plugins/router.py (FusedRouter, plan_router).
// Numpy twins: ddtree/model/routing.py route_logits over ddtree/plugins/reference.py gemm (the rule), and
// ddtree/plugins/router.py select_ref (this kernel's selection: lane maxima, threshold, candidates, ranks).
//
// Grid (MB, S, NB), block W = TW * KW warps. Block (mb, s, nb) owns token rows [8 MT mb, +8 MT), the 16-row
// weight tiles [TW nb, +TW) (16 experts each) and k-chunks [CPS s, +CPS) of 64 (CPS = K / 64 / S); warp
// (kw, tw) streams tile tw's chunks kw, kw + KW, ... . Every chunk a warp needs is requested at once
// (cp.async, evict-first), before griddepcontrol.wait: the weights never depend on the previous kernel.
// The KW warps of a tile are summed in shared memory (fixed order); then three hand-offs, each to the
// last block to arrive (common.cuh arrive_last: an acq_rel ticket), each reading in a fixed order (deterministic):
//   1. the last of the S k-splits of (mb, nb) sums the S partials [S, M, E] of its experts -> logits
//   2. the last of the NB n-blocks of mb routes its rows: lanes = 0, a warp per token from the logits
//      (route_token), or lanes = L (32 or 16: two rows a warp), L lanes a row (route_rows, route_select.cuh)
//      from the scores [M, E] (g = sigmoid(logit)) that step 1 (or the GEMM itself at S = 1) stored beside
//      the logits, computed in parallel over the NB blocks (lanes > 0: unfolded, n_group = 1, E % 4 == 0)
//   3. the last of the MB token blocks aligns all M * topk pairs into tiles of 8 (as moe_route)
// A hand-off that has one contributor is skipped (S = 1 writes the logits directly).
// fold = 1 (the plan's choice for few rows): 1 and 2 are one hand-off, to the last of all S x NB blocks of mb,
// which sums all its rows' partials itself into the logits and a shared copy, routes from that copy (lanes = 0)
// and, with G > 1, routes each token with G = ceil(E / 32) warps, one expert a thread (route_block). With one token
// block (MB = 1) the ids are also kept in shared memory for step 3 (no L2 round trips to read them back).
// route = 0: the ids are given (topk_ids is an input; bench step's given routing): the logits are still
// computed (their cost is real), steps 2's routing is skipped and step 3 aligns the given ids.
// live (a pruned verify, issue 53; null: none, the kernel as before bit for bit): step 3 first applies the live
// mask (route_common.cuh live_rows, one place for every routing variant): routed_ids = the ids as routed, and
// live_ids / live_w = the routing with each dead row's pairs on the root's (row 0's) experts at weight 0, which
// step 3 aligns and the experts read. Routed here (route = 1) they are topk_ids / topk_w themselves (rewritten in
// place, as plugins/prune_ops.py route_live_twin); given (route = 0) they are other buffers (the router's own),
// so the given routing stays as given.
// The selection of one token's top-k (warp_topk / route_token, route_block) is route_select.cuh.
#include "route_select.cuh"
#include "stamps.cuh"     // STAMP / STAMP_COMMIT: empty unless -D DD_STEP_STAMPS (the one-token-block paths')

#define RT_MAX_WARPS 16

// logits[at] = sum over s = 0..S-1 of p[s stride], in that order (common.cuh sum_partials: 8 loads in flight)
__device__ __forceinline__ float sum_splits(const float* p, int S, size_t stride) {
    float v = 0.f;
    sum_partials<8>(v, S, [&](int s) { return __ldcg(p + s * stride); });
    return v;
}

// Dynamic shared memory (plugins/router.py router_smem): the maximum of
//   GEMM     x rows [8 MT][CPS 64 + 32] bf16, then W warps x ceil(CPS / KW) chunks x 2 KB of weights
//   KW sum   [W][MT][32] float4 (KW > 1)
//   routing  ids_s + lg + W x (3 topk ceil(E/32) + 2 topk) x 4 B, or (G > 1) rows x (36 + 98 topk) x 4 B, or
//            (lanes = L > 0) ids_s + (E + R E + W (32 / L) (2 topk ceil(E/L) + topk)) x 4 B with R =
//            min(rows, W 32 / L) (the bias, a round's scores, the segments' candidates and selections)
//   tiles    ids_s + (2 E + 1) x 4 B + M topk x 2 B
//   (ids_s: M topk x 4 B rounded to 16 when MB = 1; lg: rows x E x 4 B, then the bias E x 4 B, each rounded
//   to 16, when folded)
//   x [M, K] bf16   w [ceil(E/16), K/64, 4, 32] uint4 (layout.tile_bf16)   bias [E] fp32 or null
//   logits [M, E] fp32 (written)   score [M, E] fp32 (lanes > 0: written, then read)   partial [S, M, E] (S > 1)
//   counters [MB NB + MB + 1] (zero, reset)
//   topk_ids, topk_w [M, topk] (written; topk_ids read when route = 0)   tile lists as moe_route
//   live [M] int32 or null   routed_ids, live_ids [M, topk] int32, live_w [M, topk] fp32 (written when live)
template <int MT>
__device__ __forceinline__ void router_impl(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                            const float* __restrict__ bias, float* logits, float* score,
                                            float* partial, u32* counters, int* topk_ids, float* topk_w,
                                            int* tile_expert, int* tile_pairs, int* num_tiles, int M, int E, int K,
                                            int S, int TW, int topk, int n_group, int topk_group, float scaling,
                                            int route, int fold, int G, int lanes_in, const int* live,
                                            int* routed_ids, int* live_ids, float* live_w) {
    extern __shared__ __align__(16) unsigned char smem[];
    // lanes a row of the route phase as planned: the launcher takes only what plugins/router.py lanes_allowed
    // allows (unfolded, ungrouped, E % 4 == 0, at 16 lanes topk <= 16 and E <= 16 x 24), and checks it per launch
    const int lanes = lanes_in;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int W = blockDim.x >> 5, KW = W / TW, tw = warp % TW, kw = warp / TW;
    const int MB = gridDim.x, NB = gridDim.z, mb = blockIdx.x, s = blockIdx.y, nb = blockIdx.z;
    const int KC = K >> 6, CPS = KC / S, c0 = s * CPS, CPW = (CPS + KW - 1) / KW;
    const int kspan = CPS * 64, xstride = kspan + 32;               // +64 B per row: conflict-free uint4 reads
    const int row0 = mb * 8 * MT, rows = min(8 * MT, M - row0);
    const int NT = (E + 15) >> 4, nt = nb * TW + tw;
    const int my_chunks = nt < NT ? max(0, (CPS - kw + KW - 1) / KW) : 0;
    bf16_t* xs = (bf16_t*)smem;                                      // [8 MT][xstride]
    uint4* wbuf = (uint4*)(smem + (size_t)8 * MT * xstride * 2) + (size_t)warp * CPW * 128;   // [CPW][4][32]

    // every chunk of this warp in flight at once (2 KB each: [4][32 lanes] uint4, j = 2 h + row half)
    STAMP(0);
    const u64 policy = evict_first_policy();
    const uint4* wp = (const uint4*)w + ((size_t)nt * KC + c0 + kw) * 128 + lane;
    for (int i = 0; i < my_chunks; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) cp_async16_stream(wbuf + i * 128 + j * 32 + lane, wp + 32 * j, policy);
        wp += (size_t)KW * 128;
    }
    cp_async_commit();
    pdl_wait();                                                      // x written; earlier readers of our outputs done
    pdl_trigger();
    STAMP(1);
    const int vec_per_row = kspan >> 3;
    for (int i = threadIdx.x; i < 8 * MT * vec_per_row; i += blockDim.x) {
        const int r = i / vec_per_row, v = i - r * vec_per_row;
        bf16_t* dst = xs + r * xstride + v * 8;
        if (r < rows) cp_async16(dst, x + (size_t)(row0 + r) * K + c0 * 64 + v * 8);
        else *(uint4*)dst = make_uint4(0u, 0u, 0u, 0u);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // acc[mt] = {(n, m), (n, m+1), (n+8, m), (n+8, m+1)} with n = tile row g, m = token 8 mt + 2t
    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
    for (int i = 0; i < my_chunks; ++i) {
        const int c = kw + i * KW;
        const uint4* wc = wbuf + i * 128 + lane;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 row_g = wc[64 * h], row_g8 = wc[64 * h + 32];
            const u32 a_u0[4] = {row_g.x, row_g8.x, row_g.y, row_g8.y};   // k 32h + 8t + 0..3
            const u32 a_u1[4] = {row_g.z, row_g8.z, row_g.w, row_g8.w};   // k 32h + 8t + 4..7
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (mt * 8 >= rows) continue;                        // all-zero token rows
                const uint4 xb = *(const uint4*)(xs + (mt * 8 + g) * xstride + c * 64 + 32 * h + 8 * t);
                mma_bf16_16816(acc[mt], a_u0, xb.x, xb.y);
                mma_bf16_16816(acc[mt], a_u1, xb.z, xb.w);
            }
        }
    }
    if (KW > 1) {                                                    // tile tw = sum over kw = 0..KW-1, in order
        __syncthreads();                                             // x rows and weight slots are free
        float4* red = (float4*)smem;                                 // [W][MT][32]
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            red[(warp * MT + mt) * 32 + lane] = make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
        __syncthreads();
        if (kw == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
                for (int k = 0; k < KW; ++k) {
                    const float4 v = red[((k * TW + tw) * MT + mt) * 32 + lane];
                    sum.x += v.x; sum.y += v.y; sum.z += v.z; sum.w += v.w;
                }
                acc[mt][0] = sum.x; acc[mt][1] = sum.y; acc[mt][2] = sum.z; acc[mt][3] = sum.w;
            }
        }
    }
    if (kw == 0 && nt < NT) {                                        // this block's [rows, 16 TW] of split s
        float* dst = S == 1 ? logits : partial + (size_t)s * M * E;
        const bool scores = S == 1 && route && lanes;               // the logits are final: their scores too
        const int n = nt * 16 + g;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int m = mt * 8 + 2 * t + q;
                if (m >= rows) continue;
                const size_t at = (size_t)(row0 + m) * E + n;
                if (n < E) dst[at] = acc[mt][q];
                if (n + 8 < E) dst[at + 8] = acc[mt][2 + q];
                if (scores && n < E) score[at] = route_sigmoid(acc[mt][q]);
                if (scores && n + 8 < E) score[at + 8] = route_sigmoid(acc[mt][2 + q]);
            }
        }
    }

    // shared memory of the routing block (router.py router_smem): ids_s [M topk] int with one token block (the
    // aligner's copy of the ids), then lg [rows][E] fp32 when folded, then the warps' routing scratch and
    // (G > 1) the tokens' selections; the alignment's arrays reuse what follows ids_s once routing is done
    int* ids_s = MB == 1 ? (int*)smem : nullptr;
    unsigned char* after_ids = smem + (MB == 1 ? ((M * topk * 4 + 15) & ~15) : 0);
    float* lg = (float*)after_ids;
    float* bs = lg + ((rows * E + 3) & ~3);                          // folded: the bias (0 without one) [E]
    unsigned char* scratch = after_ids + (fold ? ((rows * E * 4 + 15) & ~15) + ((E * 4 + 15) & ~15) : 0);
    const size_t split_stride = (size_t)M * E;
    if (fold) {
        // 1+2 folded: the last of all S x NB blocks of mb sums every expert's partials of its rows (the same
        // order as below) into the logits and lg, and routes them from shared memory: one hand-off and one
        // L2 round trip fewer, for few rows (the plan's choice: one block reads S rows E floats)
        STAMP(2);
        if (S * NB > 1) {
            if (!arrive_last(&counters[mb], (u32)(S * NB))) {
                STAMP_COMMIT(1);
                return;
            }
            STAMP(3);
        } else {
            __syncthreads();                                         // this block's logits visible to the block
        }
        for (int item = threadIdx.x; item < rows * E; item += blockDim.x) {   // (rows E >= E)
            const size_t at = (size_t)row0 * E + item;
            const float b = item < E && bias ? bias[item] : 0.0f;   // in flight with the partials
            lg[item] = S > 1 ? sum_splits(partial + at, S, split_stride) : __ldcg(logits + at);
            if (item < E) bs[item] = b;
        }
        __syncthreads();
        if (S > 1)
            for (int item = threadIdx.x; item < rows * E; item += blockDim.x)
                logits[(size_t)row0 * E + item] = lg[item];
    } else {
        // 1. the last k-split of (mb, nb): logits = sum over s = 0..S-1 of partial[s], in that order (a row's
        //    order depends on S and KW alone, not on M: the batch-invariant plan fixes both)
        if (S > 1) {
            if (!arrive_last(&counters[mb * NB + nb], (u32)S)) return;
            const int e0 = nb * TW * 16, ne = min(TW * 16, E - e0);
            for (int item = threadIdx.x; item < rows * ne; item += blockDim.x) {
                const size_t at = (size_t)(row0 + item / ne) * E + e0 + item % ne;
                const float v = sum_splits(partial + at, S, split_stride);
                logits[at] = v;
                if (route && lanes) score[at] = route_sigmoid(v);   // over the NB blocks, off the route's chain
            }
        }
        // 2. the last n-block of mb routes its rows
        if (NB > 1) {
            if (!arrive_last(&counters[MB * NB + mb], (u32)NB)) return;
        } else {
            __syncthreads();                                         // this block's logits visible to the block
        }                                                            // (and the GEMM's shared memory free)
    }
    if (route && lanes) {                                            // from the stored scores, L lanes a row
        if (lanes == 16) route_rows<16, 24>(score, bias, rows, row0, E, topk, scaling, topk_ids, topk_w, ids_s,
                                            scratch, warp, lane, W);
        else if (E <= 32 * 12) route_rows<32, 12>(score, bias, rows, row0, E, topk, scaling, topk_ids, topk_w,
                                                  ids_s, scratch, warp, lane, W);
        else route_rows<32, 16>(score, bias, rows, row0, E, topk, scaling, topk_ids, topk_w, ids_s, scratch, warp,
                                lane, W);
    } else if (route && G > 1) {
        route_block(lg, bs, rows, row0, E, topk, G, scaling, topk_ids, topk_w, ids_s, (float*)scratch, warp, lane);
    } else if (route) {
        const RouteScratch sc = route_scratch(scratch, warp, topk, E);
        for (int r = warp; r < rows; r += W) {
            const int m = row0 + r;
            route_token(fold ? lg + (size_t)r * E : logits + (size_t)m * E, fold, fold ? bs : bias, E, topk,
                        n_group, topk_group, scaling, topk_ids + (size_t)m * topk, topk_w + (size_t)m * topk,
                        ids_s ? ids_s + (size_t)m * topk : nullptr, sc, lane);
        }
    }
    STAMP(4);
    // 3. the last token block aligns every token's pairs (one token block: from its shared copy of the ids),
    //    with a live mask after moving the dead rows' pairs onto the root's experts (live_rows)
    if (MB > 1) {
        if (!arrive_last(&counters[MB * NB + MB], (u32)MB)) return;
        if (live) {
            live_rows(topk_ids, topk_w, nullptr, live, M * topk, topk, routed_ids, live_ids, live_w);
            __syncthreads();
        }
        align_tiles(live ? live_ids : topk_ids, M * topk, E, smem, tile_expert, tile_pairs, num_tiles);
        return;
    }
    __syncthreads();
    if (!route) {                                                    // the given ids
        for (int q = threadIdx.x; q < M * topk; q += blockDim.x) ids_s[q] = ld_cg_s32(topk_ids + q);
        __syncthreads();
    }
    if (live) {                                                      // ids_s's dead rows rewritten as well
        live_rows(topk_ids, topk_w, ids_s, live, M * topk, topk, routed_ids, live_ids, live_w);
        __syncthreads();
    }
    align_tiles_of([ids_s](int q) { return ids_s[q]; }, M * topk, E, after_ids, tile_expert, tile_pairs, num_tiles);
    STAMP(5);
    STAMP_COMMIT(1);
}

#define DD_ROUTER(MT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(RT_MAX_WARPS * 32, 1) router_fused_mt##MT(               \
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias,      \
        float* logits, float* score, float* partial, u32* counters, int* topk_ids, float* topk_w,         \
        int* tile_expert, int* tile_pairs, int* num_tiles, int M, int E, int K, int S, int TW, int topk,  \
        int n_group, int topk_group, float scaling, int route, int fold, int G, int lanes,                \
        const int* live, int* routed_ids, int* live_ids, float* live_w) {                                 \
        router_impl<MT>(x, w, bias, logits, score, partial, counters, topk_ids, topk_w, tile_expert,      \
                        tile_pairs, num_tiles, M, E, K, S, TW, topk, n_group, topk_group, scaling, route, \
                        fold, G, lanes, live, routed_ids, live_ids, live_w);                              \
    }
DD_ROUTER(1)
DD_ROUTER(2)
DD_ROUTER(3)
DD_ROUTER(4)
DD_ROUTER(5)
DD_ROUTER(6)
DD_ROUTER(7)
DD_ROUTER(8)
