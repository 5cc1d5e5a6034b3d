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
// last block to arrive (handoff_last: an acq_rel ticket), each reading in a fixed order (deterministic):
//   1. the last of the S k-splits of (mb, nb) sums the S partials [S, M, E] of its experts -> logits
//   2. the last of the NB n-blocks of mb routes its rows, one warp per token (route_token)
//   3. the last of the MB token blocks aligns all M * topk pairs into tiles of 8 (as moe_route)
// A hand-off that has one contributor is skipped (S = 1 writes the logits directly).
// fold = 1 (the plan's choice for few rows): 1 and 2 are one hand-off, to the last of all S x NB blocks of mb,
// which sums all its rows' partials itself into the logits and a shared copy, routes from that copy and,
// with G > 1, routes each token with G = ceil(E / 32) warps, one expert a thread (route_block). With one token
// block (MB = 1) the ids are also kept in shared memory for step 3 (no L2 round trips to read them back).
// route = 0: the ids are given (topk_ids is an input; bench step's given routing): the logits are still
// computed (their cost is real), steps 2's routing is skipped and step 3 aligns the given ids.
//
// Routing one token (one warp, lane l holds experts l + 32 j): the top-k of the 32 lane maxima's k-th,
// T, bounds the token's top-k from below (k lanes hold an element >= T); the candidates >= T come from
// exactly k lanes (<= k ceil(E/32) of them, ~k in practice), and each candidate's rank is the number of
// candidates that beat it: no chain of k dependent arg-max rounds. "Beats" is (value, lower id), a strict
// total order, so the ranks are distinct and equal those of moe_route's arg-max rounds: the same ids in
// the same order, and the same weights bit for bit (same fp32 sigmoid, sum in selection order).
#include "route_common.cuh"

#define RT_MAX_WARPS 16

// A hand-off to the last block to arrive: common.cuh's arrive_last without its fences. There every thread runs
// fence.sc (MEMBAR.SC.GPU) before the ticket and again in the last block: two full fences of up to 512 threads
// on the critical path of each hand-off. Here the block's barrier orders every thread's writes before thread
// 0's ticket, one atomic with acq_rel semantics at gpu scope (its release is cumulative over what the barrier
// ordered, the PTX memory model's pattern of a grid barrier); in the last block its acquire, then the barrier,
// order every thread's later reads after the other blocks' writes (which stay .cg reads, from L2). The last
// block resets the counter: every other block has taken its ticket.
__device__ __forceinline__ bool handoff_last(u32* counter, u32 expected) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 prev;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(counter) : "memory");
        s_last = prev == expected - 1;
        if (s_last) asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(counter), "r"(0u) : "memory");
    }
    __syncthreads();
    return s_last;
}

// logits[at] = sum over s = 0..S-1 of p[s stride], in that order: 8 loads in flight, then their sum in order
__device__ __forceinline__ float sum_splits(const float* p, int S, size_t stride) {
    float v = 0.f;
    for (int s0 = 0; s0 < S; s0 += 8) {
        float part[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) part[u] = s0 + u < S ? __ldcg(p + (s0 + u) * stride) : 0.f;
#pragma unroll
        for (int u = 0; u < 8; ++u)
            if (s0 + u < S) v += part[u];
    }
    return v;
}

__device__ __forceinline__ bool beats(float av, int ai, float bv, int bi) {
    return av > bv || (av == bv && ai < bi);
}

// Per-warp scratch of warp_topk: candidates (choice, id, score) [cmax], the selection (id, score) [topk].
struct RouteScratch {
    float* cand_v;
    int* cand_i;
    float* cand_s;
    int* sel_i;
    float* sel_s;
    int cmax;                        // topk * ceil(E / 32)
};

__device__ __forceinline__ RouteScratch route_scratch(unsigned char* base, int warp, int topk, int E) {
    RouteScratch r;
    r.cmax = topk * ((E + 31) >> 5);
    float* w = (float*)base + (size_t)warp * (3 * r.cmax + 2 * topk);
    r.cand_v = w;
    r.cand_i = (int*)(w + r.cmax);
    r.cand_s = w + 2 * r.cmax;
    r.sel_i = (int*)(w + 3 * r.cmax);
    r.sel_s = w + 3 * r.cmax + topk;
    return r;
}

// One warp's top-k of a token (lane l holds experts l + 32 j, j < ROUTE_EPL; past E: not there), into sc.sel_*
// in selection order. The logits row and the bias are in shared memory (`shared`, the folded hand-off's sums
// and its copy of the bias) or global (the row written by other blocks: read through L2).
__device__ void warp_topk(const float* row, bool shared, const float* bias, int E, int topk, int n_group,
                          int topk_group, const RouteScratch& sc, int lane) {
    // every load first, unconditional (index clamped), so the 16 round trips to L2 overlap: with the loads
    // inside `if (e < E)` each waited for the previous slot's sigmoid (its division has a called slow
    // path), 16 L2 latencies in a row, ~7 us a token on the H200 (moe_route's top-k has the same pattern)
    float logit[ROUTE_EPL], add[ROUTE_EPL];
    if (shared) {                                                    // (two loops: no global load of a shared row)
#pragma unroll
        for (int j = 0; j < ROUTE_EPL; ++j) logit[j] = row[min(lane + 32 * j, E - 1)];
    } else {
#pragma unroll
        for (int j = 0; j < ROUTE_EPL; ++j) logit[j] = __ldcg(row + min(lane + 32 * j, E - 1));
    }
#pragma unroll
    for (int j = 0; j < ROUTE_EPL; ++j) add[j] = bias ? bias[min(lane + 32 * j, E - 1)] : 0.0f;
    // g = sigmoid(logit) = 1 / (1 + exp(-logit)), fp32 (as moe_route): every exp first (no branch), then the
    // divisions (each with its called slow path), so a slot's exp no longer waits for the previous division
    float score[ROUTE_EPL], choice[ROUTE_EPL], den[ROUTE_EPL];
#pragma unroll
    for (int j = 0; j < ROUTE_EPL; ++j) den[j] = 32 * j < E ? 1.0f + expf(-logit[j]) : 1.0f;
#pragma unroll
    for (int j = 0; j < ROUTE_EPL; ++j) {
        score[j] = 0.0f;
        choice[j] = DD_NEG_INF;                                      // past E: loses to every expert
        if (lane + 32 * j < E) {
            score[j] = 1.0f / den[j];
            choice[j] = score[j] + add[j];                           // selection only
        }
    }
    if (n_group > 1) keep_best_groups(choice, E, n_group, topk_group, lane);

    float best_v = choice[0];                                        // the lane's best (value, lowest id)
    int best_i = lane;
#pragma unroll
    for (int j = 1; j < ROUTE_EPL; ++j)
        if (choice[j] > best_v) { best_v = choice[j]; best_i = lane + 32 * j; }
    int lane_rank = 0;                                               // lanes whose best beats this lane's
#pragma unroll
    for (int src = 0; src < 32; ++src) {
        const float ov = __shfl_sync(0xffffffffu, best_v, src);
        const int oi = __shfl_sync(0xffffffffu, best_i, src);
        lane_rank += beats(ov, oi, best_v, best_i);
    }
    const u32 at_k = __ballot_sync(0xffffffffu, lane_rank == topk - 1);
    const int t_lane = at_k ? __ffs(at_k) - 1 : 0;                   // (ranks are a permutation of 0..31)
    const float t_v = __shfl_sync(0xffffffffu, best_v, t_lane);
    const int t_i = __shfl_sync(0xffffffffu, best_i, t_lane);

    u32 cand = 0;                                                    // elements that T does not beat: >= T
#pragma unroll
    for (int j = 0; j < ROUTE_EPL; ++j)
        if (!beats(t_v, t_i, choice[j], lane + 32 * j)) cand |= 1u << j;
    const int n = __popc(cand);
    int incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
    }
    const int count = min(__shfl_sync(0xffffffffu, incl, 31), sc.cmax);
    int slot = incl - n;
#pragma unroll
    for (int j = 0; j < ROUTE_EPL; ++j) {
        if ((cand >> j) & 1u) {
            if (slot < sc.cmax) {
                sc.cand_v[slot] = choice[j];
                sc.cand_i[slot] = lane + 32 * j;
                sc.cand_s[slot] = score[j];
            }
            ++slot;
        }
    }
    __syncwarp();
    for (int c = lane; c < count; c += 32) {                         // rank = candidates that beat this one
        const float v = sc.cand_v[c];
        const int id = sc.cand_i[c];
        int rank = 0;
#pragma unroll 4
        for (int q = 0; q < count; ++q) rank += beats(sc.cand_v[q], sc.cand_i[q], v, id);
        if (rank < topk) { sc.sel_i[rank] = id; sc.sel_s[rank] = sc.cand_s[c]; }
    }
    __syncwarp();
}

// One warp routes one token: its top-k, the weights normalised in selection order (as moe_route), written to
// ids_out / w_out and, with one token block, to the block's shared copy of the ids (ids_s, else null).
__device__ void route_token(const float* row, bool shared, const float* bias, int E, int topk, int n_group,
                            int topk_group, float scaling, int* ids_out, float* w_out, int* ids_s,
                            const RouteScratch& sc, int lane) {
    warp_topk(row, shared, bias, E, topk, n_group, topk_group, sc, lane);
    if (lane < topk) {
        float sum = 0.0f;
        for (int q = 0; q < topk; ++q) sum += sc.sel_s[q];           // selection order, as moe_route
        ids_out[lane] = sc.sel_i[lane];
        w_out[lane] = sc.sel_s[lane] / (sum + 1e-20f) * scaling;
        if (ids_s) ids_s[lane] = sc.sel_i[lane];
    }
    __syncwarp();                                                    // the scratch is free for the next token
}

// route_block's shared memory a token (floats): the G <= 16 warp bests (value, id), the candidate count, the
// candidates (choice, id, score) [32 topk], the selection (id, score) [topk]
__device__ __forceinline__ int block_route_floats(int topk) { return 36 + 98 * topk; }

// Few tokens, one expert a thread (the plan's G = ceil(E / 32) >= topk warps a token, rows G <= W, n_group = 1,
// the logits and bias in shared memory): warp c of token r holds experts 32 c + lane. Each warp's best (value,
// lowest id) by warp_argmax; T = the topk-th best of the G warp bests (every warp ranks them by shuffles): the
// topk warps whose best T does not beat hold >= topk elements that T does not beat, so T bounds the token's
// top-k from below, and every element T does not beat lies in one of those warps (<= 32 topk candidates). The
// candidates take slots by a shared atomic (their order is no part of the result); a candidate's rank is the
// number of candidates that beat it, and the ranks under topk are the selection in order: moe_route's ids,
// the weights summed in that order (bit for bit). Three block barriers instead of a warp's serial chain of
// ceil(E / 32) sigmoids and its lane ranking; every thread of the block calls it.
__device__ void route_block(const float* lg, const float* bs, int rows, int row0, int E, int topk, int G,
                            float scaling, int* topk_ids, float* topk_w, int* ids_s, float* scratch, int warp,
                            int lane) {
    const int r = warp / G, c = warp - r * G, e = 32 * c + lane;    // token r, its warp c, this thread's expert
    const bool active = r < rows;
    float* wm_v = scratch + (size_t)(active ? r : 0) * block_route_floats(topk);
    int* wm_i = (int*)(wm_v + 16);
    int* count = (int*)(wm_v + 32);
    float* cand_v = wm_v + 36;
    int* cand_i = (int*)(cand_v + 32 * topk);
    float* cand_s = cand_v + 64 * topk;
    int* sel_i = (int*)(cand_v + 96 * topk);
    float* sel_s = cand_v + 97 * topk;
    float score = 0.0f, choice = DD_NEG_INF;                         // past E: loses to every expert
    if (active && e < E) {
        score = 1.0f / (1.0f + expf(-lg[(size_t)r * E + e]));      // g = sigmoid(logit), fp32 (as moe_route)
        choice = score + bs[e];                                      // selection only
    }
    if (active) {
        float v = choice;
        int i = e;
        warp_argmax(v, i);
        if (lane == 0) { wm_v[c] = v; wm_i[c] = i; }
        if (c == 0 && lane == 0) *count = 0;
    }
    __syncthreads();
    if (active) {
        const float bv = lane < G ? wm_v[lane] : DD_NEG_INF;        // lane l < G: warp l's best
        const int bi = lane < G ? wm_i[lane] : 0x7fffffff - lane;
        int rank = 0;
        for (int src = 0; src < G; ++src) {
            const float ov = __shfl_sync(0xffffffffu, bv, src);
            const int oi = __shfl_sync(0xffffffffu, bi, src);
            rank += beats(ov, oi, bv, bi);
        }
        const u32 at_k = __ballot_sync(0xffffffffu, lane < G && rank == topk - 1);
        const int t_lane = at_k ? __ffs(at_k) - 1 : 0;               // (G >= topk: the ranks 0..G-1 are distinct)
        const float t_v = __shfl_sync(0xffffffffu, bv, t_lane);
        const int t_i = __shfl_sync(0xffffffffu, bi, t_lane);
        if (e < E && !beats(t_v, t_i, choice, e)) {
            const int slot = atomicAdd(count, 1);
            if (slot < 32 * topk) { cand_v[slot] = choice; cand_i[slot] = e; cand_s[slot] = score; }
        }
    }
    __syncthreads();
    if (active) {
        const int n = min(*count, 32 * topk);
        for (int q0 = 32 * c + lane; q0 < n; q0 += 32 * G) {         // rank = candidates that beat this one
            const float v = cand_v[q0];
            const int id = cand_i[q0];
            int rank = 0;
#pragma unroll 4
            for (int q = 0; q < n; ++q) rank += beats(cand_v[q], cand_i[q], v, id);
            if (rank < topk) { sel_i[rank] = id; sel_s[rank] = cand_s[q0]; }
        }
    }
    __syncthreads();
    if (active && c == 0 && lane < topk) {
        float sum = 0.0f;
        for (int q = 0; q < topk; ++q) sum += sel_s[q];              // selection order, as moe_route
        const size_t at = (size_t)(row0 + r) * topk + lane;
        topk_ids[at] = sel_i[lane];
        topk_w[at] = sel_s[lane] / (sum + 1e-20f) * scaling;
        if (ids_s) ids_s[r * topk + lane] = sel_i[lane];
    }
}

// Dynamic shared memory (plugins/router.py router_smem): the maximum of
//   GEMM     x rows [8 MT][CPS 64 + 32] bf16, then W warps x ceil(CPS / KW) chunks x 2 KB of weights
//   KW sum   [W][MT][32] float4 (KW > 1)
//   routing  ids_s + lg + W x (3 topk ceil(E/32) + 2 topk) x 4 B, or (G > 1) rows x (36 + 98 topk) x 4 B
//   tiles    ids_s + (2 E + 1) x 4 B + M topk x 2 B
//   (ids_s: M topk x 4 B rounded to 16 when MB = 1; lg: rows x E x 4 B, then the bias E x 4 B, each rounded
//   to 16, when folded)
//   x [M, K] bf16   w [ceil(E/16), K/64, 4, 32] uint4 (layout.tile_bf16)   bias [E] fp32 or null
//   logits [M, E] fp32 (written)   partial [S, M, E] fp32 (S > 1)   counters [MB NB + MB + 1] (zero, reset)
//   topk_ids, topk_w [M, topk] (written; topk_ids read when route = 0)   tile lists as moe_route
template <int MT>
__device__ __forceinline__ void router_impl(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                            const float* __restrict__ bias, float* logits, float* partial,
                                            u32* counters, int* topk_ids, float* topk_w, int* tile_expert,
                                            int* tile_pairs, int* num_tiles, int M, int E, int K, int S, int TW,
                                            int topk, int n_group, int topk_group, float scaling, int route,
                                            int fold, int G) {
    extern __shared__ __align__(16) unsigned char smem[];
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
        const int n = nt * 16 + g;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int m = mt * 8 + 2 * t + q;
                if (m >= rows) continue;
                float* row = dst + (size_t)(row0 + m) * E;
                if (n < E) row[n] = acc[mt][q];
                if (n + 8 < E) row[n + 8] = acc[mt][2 + q];
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
        if (S * NB > 1) {
            if (!handoff_last(&counters[mb], (u32)(S * NB))) return;
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
            if (!handoff_last(&counters[mb * NB + nb], (u32)S)) return;
            const int e0 = nb * TW * 16, ne = min(TW * 16, E - e0);
            for (int item = threadIdx.x; item < rows * ne; item += blockDim.x) {
                const size_t at = (size_t)(row0 + item / ne) * E + e0 + item % ne;
                logits[at] = sum_splits(partial + at, S, split_stride);
            }
        }
        // 2. the last n-block of mb routes its rows
        if (NB > 1) {
            if (!handoff_last(&counters[MB * NB + mb], (u32)NB)) return;
        } else {
            __syncthreads();                                         // this block's logits visible to the block
        }                                                            // (and the GEMM's shared memory free)
    }
    if (route && G > 1) {
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
    // 3. the last token block aligns every token's pairs (one token block: from its shared copy of the ids)
    if (MB > 1) {
        if (!handoff_last(&counters[MB * NB + MB], (u32)MB)) return;
        align_tiles(topk_ids, M * topk, E, smem, tile_expert, tile_pairs, num_tiles);
        return;
    }
    __syncthreads();
    if (!route) {                                                    // the given ids
        for (int q = threadIdx.x; q < M * topk; q += blockDim.x) ids_s[q] = ld_cg_s32(topk_ids + q);
        __syncthreads();
    }
    align_tiles_of([ids_s](int q) { return ids_s[q]; }, M * topk, E, after_ids, tile_expert, tile_pairs, num_tiles);
}

#define DD_ROUTER(MT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(RT_MAX_WARPS * 32, 1) router_fused_mt##MT(               \
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, const float* __restrict__ bias,      \
        float* logits, float* partial, u32* counters, int* topk_ids, float* topk_w, int* tile_expert,     \
        int* tile_pairs, int* num_tiles, int M, int E, int K, int S, int TW, int topk, int n_group,       \
        int topk_group, float scaling, int route, int fold, int G) {                                      \
        router_impl<MT>(x, w, bias, logits, partial, counters, topk_ids, topk_w, tile_expert, tile_pairs, \
                        num_tiles, M, E, K, S, TW, topk, n_group, topk_group, scaling, route, fold, G);   \
    }
DD_ROUTER(1)
DD_ROUTER(2)
DD_ROUTER(3)
DD_ROUTER(4)
DD_ROUTER(5)
DD_ROUTER(6)
DD_ROUTER(7)
DD_ROUTER(8)
