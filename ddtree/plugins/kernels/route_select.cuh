// The fused router's selection of one token's top-k (kernels/router.cu; numpy twins in plugins/router.py
// select_ref and block_topk_ref): a warp a token (warp_topk, route_token) or a block a token (route_block).
//
// Routing one token (one warp, lane l holds experts l + 32 j): the top-k of the 32 lane maxima's k-th,
// T, bounds the token's top-k from below (k lanes hold an element >= T); the candidates >= T come from
// exactly k lanes (<= k ceil(E/32) of them, ~k in practice), and each candidate's rank is the number of
// candidates that beat it: no chain of k dependent arg-max rounds. "Beats" is (value, lower id), a strict
// total order, so the ranks are distinct and equal those of moe_route's arg-max rounds: the same ids in
// the same order, and the same weights bit for bit (same fp32 sigmoid, sum in selection order).
#pragma once
#include "route_common.cuh"

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

// g = sigmoid(logit), fp32, as moe_route (SASS: the exp's scaling and the + 1 one FFMA, then the IEEE division)
__device__ __forceinline__ float route_sigmoid(float logit) {
    return 1.0f / (1.0f + expf(-logit));
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
    // the bias predicated, at immediate offsets (the clamped addresses, kept over the token loop, spilled 180 B
    // on sm_90 once route_rows shared the kernel; SASS: the same 16 loads back to back before the first exp)
#pragma unroll
    for (int j = 0; j < ROUTE_EPL; ++j) add[j] = bias && lane + 32 * j < E ? bias[lane + 32 * j] : 0.0f;
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

// Many rows (unfolded plans, n_group = 1, E % 4 == 0): segments of L lanes route a row each (L = 32: a warp a
// row; 16: two rows a warp, so 17..32 rows take one round of 16 warps, not two), lane `sub` of a segment holding
// experts sub + L j, j < SL (E <= L SL). The scores come made: the logits' writers (the k-split hand-off, or the
// GEMM at S = 1) stored g = route_sigmoid(logit) [M, E] beside the logits, spread over their blocks, so no
// sigmoid is on the routing block's chain. A round's rows (min(rows, W 32 / L)) are staged into shared memory by
// cp.async.cg (from L2, 16 B each, all in flight at once), the bias once. A row's selection is warp_topk's
// within the segment (T = the topk-th of the L lane maxima, topk <= L; the candidates that T does not beat,
// from topk lanes, <= topk ceil(E / L), ranked by comparison): the same ids in the same order and the same
// weights bit for bit as moe_route (the same fp32 scores, choice = g + bias, the sum in selection order). Twin:
// select_ref(.., lanes=L). Every thread of the block runs it (block barriers; shuffles of width L); a segment
// past the round's rows works on -inf choices and writes nothing. Shared memory from `smem` (floats,
// router.py router_smem): the bias [E], the round's scores [round][E], then per segment (warp 32 / L + seg)
// route_rows_floats: candidates (choice, id) [topk ceil(E / L)], the selection's ids [topk] (its scores are
// read from the staged row by id).
__device__ __forceinline__ int route_rows_floats(int topk, int E, int L) {
    return 2 * topk * ((E + L - 1) / L) + topk;
}

template <int L, int SL>
__device__ void route_rows(const float* score, const float* bias, int rows, int row0, int E, int topk,
                           float scaling, int* topk_ids, float* topk_w, int* ids_s, unsigned char* smem,
                           int warp, int lane, int W) {
    constexpr int RPW = 32 / L;                                      // rows a warp routes at once
    constexpr u32 SEG = L == 32 ? 0xffffffffu : (1u << L) - 1;
    const int seg = lane / L, sub = lane % L, round = min(rows, W * RPW), E4 = E >> 2;
    const int r = warp * RPW + seg;                                  // this segment's row of a round
    const int cmax = topk * ((E + L - 1) / L);
    float* bs = (float*)smem;                                        // [E]
    float* sg = bs + E;                                              // [round][E] (E % 4 == 0: 16-byte rows)
    float* cand_v = sg + (size_t)round * E + (size_t)r * route_rows_floats(topk, E, L);
    int* cand_i = (int*)(cand_v + cmax);
    int* sel_i = cand_i + cmax;
    for (int e = threadIdx.x; e < E; e += blockDim.x) bs[e] = bias ? bias[e] : 0.0f;
    for (int base = 0; base < rows; base += round) {
        const int n = min(round, rows - base);
        if (base > 0) __syncthreads();                               // the previous round's rows are read
        const float* src = score + (size_t)(row0 + base) * E;        // (the round's rows are contiguous)
        for (int i = threadIdx.x; i < n * E4; i += blockDim.x) cp_async16(sg + 4 * i, src + 4 * i);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
        const bool active = r < n;
        const float* srow = sg + (size_t)(active ? r : 0) * E;
        float choice[SL];
#pragma unroll
        for (int j = 0; j < SL; ++j) {
            const int e = sub + L * j;
            choice[j] = active && e < E ? srow[e] + bs[e] : DD_NEG_INF;   // selection only; past E: loses
        }
        float best_v = choice[0];                                    // the lane's best (value, lowest id)
        int best_i = sub;
#pragma unroll
        for (int j = 1; j < SL; ++j)
            if (choice[j] > best_v) { best_v = choice[j]; best_i = sub + L * j; }
        int lane_rank = 0;                                           // the segment's lanes whose best beats it
#pragma unroll
        for (int q = 0; q < L; ++q) {
            const float ov = __shfl_sync(0xffffffffu, best_v, q, L);
            const int oi = __shfl_sync(0xffffffffu, best_i, q, L);
            lane_rank += beats(ov, oi, best_v, best_i);
        }
        const u32 at_k = (__ballot_sync(0xffffffffu, lane_rank == topk - 1) >> (seg * L)) & SEG;
        const int t_sub = at_k ? __ffs(at_k) - 1 : 0;                // (ranks are a permutation of 0..L-1)
        const float t_v = __shfl_sync(0xffffffffu, best_v, t_sub, L);
        const int t_i = __shfl_sync(0xffffffffu, best_i, t_sub, L);

        u32 cand = 0;                                                // elements that T does not beat: >= T
#pragma unroll
        for (int j = 0; j < SL; ++j)
            if (!beats(t_v, t_i, choice[j], sub + L * j)) cand |= 1u << j;
        const int c_n = __popc(cand);
        int incl = c_n;
#pragma unroll
        for (int off = 1; off < L; off <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, incl, off, L);
            if (sub >= off) incl += o;
        }
        const int count = min(__shfl_sync(0xffffffffu, incl, L - 1, L), cmax);
        int slot = incl - c_n;
#pragma unroll
        for (int j = 0; j < SL; ++j) {
            if ((cand >> j) & 1u) {
                if (slot < cmax) { cand_v[slot] = choice[j]; cand_i[slot] = sub + L * j; }
                ++slot;
            }
        }
        __syncwarp();
        for (int c = sub; c < count; c += L) {                       // rank = candidates that beat this one
            const float v = cand_v[c];
            const int id = cand_i[c];
            int rank = 0;
#pragma unroll 4
            for (int q = 0; q < count; ++q) rank += beats(cand_v[q], cand_i[q], v, id);
            if (rank < topk) sel_i[rank] = id;
        }
        __syncwarp();
        if (active && sub < topk) {
            float sum = 0.0f;
            for (int q = 0; q < topk; ++q) sum += srow[sel_i[q]];    // selection order, as moe_route
            const int id = sel_i[sub];
            const size_t at = (size_t)(row0 + base + r) * topk + sub;
            topk_ids[at] = id;
            topk_w[at] = srow[id] / (sum + 1e-20f) * scaling;
            if (ids_s) ids_s[at] = id;                               // (one token block: row0 = 0)
        }
        __syncwarp();                                                // the scratch is free for the next row
    }
}
