// Routing pieces shared by moe.cu's moe_route and router.cu's fused router (one copy each): the warp arg-max
// with the lower id winning ties, the n_group > 1 group filter, the token -> expert tile alignment, and a pruned
// verify's live mask applied before it (live_rows).
#pragma once
#include "common.cuh"

#define ROUTE_EPL 16                 // experts per lane of a routing warp: E <= 512

// (value, index) arg-max across the warp; ties -> lower index.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, off);
        int oi = __shfl_xor_sync(0xffffffffu, i, off);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
}

// n_group > 1: a group scores the sum of its top-2 choices; only the best topk_group groups stay selectable
// (the rule of moe_route; not on Kimi's path, where n_group = 1).
__device__ void keep_best_groups(float (&choice)[ROUTE_EPL], int E, int n_group, int topk_group, int lane) {
    const int per_group = E / n_group;
    float group_score = DD_NEG_INF;                                  // lane gi holds group gi's score
    for (int gi = 0; gi < n_group; ++gi) {
        float v1 = DD_NEG_INF; int i1 = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < ROUTE_EPL; ++j) {
            int e = lane + 32 * j;
            if (e < E && e / per_group == gi && choice[j] > v1) { v1 = choice[j]; i1 = e; }
        }
        warp_argmax(v1, i1);
        float v2 = DD_NEG_INF; int i2 = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < ROUTE_EPL; ++j) {
            int e = lane + 32 * j;
            if (e < E && e / per_group == gi && e != i1 && choice[j] > v2) { v2 = choice[j]; i2 = e; }
        }
        warp_argmax(v2, i2);
        if (lane == gi) group_score = v1 + v2;
    }
    u32 kept = 0;
    for (int r = 0; r < topk_group; ++r) {
        const bool taken = (kept >> lane) & 1u;
        float v = taken ? DD_NEG_INF : group_score;
        int i = (lane < n_group && !taken) ? lane : 0x7fffffff;
        warp_argmax(v, i);
        kept |= 1u << i;
    }
#pragma unroll
    for (int j = 0; j < ROUTE_EPL; ++j) {
        int e = lane + 32 * j;
        if (e < E && !((kept >> (e / per_group)) & 1u)) choice[j] = DD_NEG_INF;
    }
}

// Token -> expert tiles of 8 pairs (moe_route's alignment, any block size of whole warps). id_of(p) reads pair
// p's expert (align_tiles: from global ids [P] through L2; the fused router's single token block: from its
// shared copy, two L2 round trips fewer). Shared: count [E] int, tile_start [E + 1] int, rank [P] short
// (dynamic, the caller's), and the scan's 32 warp totals (static, one array for every instance of the template).
__shared__ int align_warp_total[32];

// P <= 32 pairs (M <= 4 tokens at top-8: AR and short chains), warp 0 alone: lane p holds pair p's expert and counts by
// shuffles the pairs of its expert before it (its slot), all of them, and the tiles of every smaller expert (its
// tile). No shared memory and no block barrier, where the block path takes four barriers and a 2E-int scan (the
// step's AR router: 1.6-2.7 us from routed to exit, H100 stamps). Pairs of an expert in pair order: exactly
// moe_stream.align_tiles, the numpy twin (the block path's order within an expert follows its atomics).
template <typename IdOf>
__device__ __forceinline__ void align_tiles_warp(IdOf id_of, int P, int* __restrict__ tile_expert,
                                                 int* __restrict__ tile_pairs, int* __restrict__ num_tiles, int lane) {
    const int e = lane < P ? id_of(lane) : 0x7fffffff;
    int slot = 0, count = 0;                                         // pairs of e before this one, pairs of e
    for (int q = 0; q < P; ++q) {
        const int eq = __shfl_sync(0xffffffffu, e, q);
        slot += eq == e && q < lane;
        count += eq == e;
    }
    const int own = lane < P && slot == 0 ? (count + 7) >> 3 : 0;  // an expert's tiles, on its first pair's lane
    int first = 0, total = 0;                                        // tiles of the experts below e, of all
    for (int q = 0; q < P; ++q) {
        const int eq = __shfl_sync(0xffffffffu, e, q), oq = __shfl_sync(0xffffffffu, own, q);
        first += eq < e ? oq : 0;
        total += oq;
    }
    if (lane < P) {
        tile_pairs[(first + (slot >> 3)) * 8 + (slot & 7)] = lane;
        if (slot == 0) {
            for (int z = 0; z < own; ++z) tile_expert[first + z] = e;
            for (int r = count; r < own * 8; ++r) tile_pairs[first * 8 + r] = -1;   // the last tile's free slots
        }
    }
    if (lane == 0) *num_tiles = total;
}

template <typename IdOf>
__device__ __forceinline__ void align_tiles_of(IdOf id_of, int P, int E, unsigned char* smem,
                                               int* __restrict__ tile_expert, int* __restrict__ tile_pairs,
                                               int* __restrict__ num_tiles) {
    if (P <= 32) {                                                   // uniform over the block
        if (threadIdx.x < 32) align_tiles_warp(id_of, P, tile_expert, tile_pairs, num_tiles, threadIdx.x);
        return;
    }
    int* warp_total = align_warp_total;
    int* count = (int*)smem;
    int* tile_start = count + E;
    short* rank = (short*)(tile_start + E + 1);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) rank[p] = (short)atomicAdd(&count[id_of(p)], 1);
    __syncthreads();
    // exclusive scan of tiles per expert over the block (a one-warp scan took ceil(E / 32) dependent rounds):
    // thread i owns experts [i per, i per + per); its sum, a warp scan, the warps' totals scanned by warp 0
    const int per = (E + blockDim.x - 1) / blockDim.x, e0 = threadIdx.x * per;
    int own = 0;
    for (int q = 0; q < per; ++q)
        if (e0 + q < E) own += (count[e0 + q] + 7) >> 3;
    int incl = own;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int total = lane < warps ? warp_total[lane] : 0;
        int before = total;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int o = __shfl_up_sync(0xffffffffu, before, off);
            if (lane >= off) before += o;
        }
        if (lane < warps) warp_total[lane] = before - total;         // the warps before this one
    }
    __syncthreads();
    int start = warp_total[warp] + incl - own;
    for (int q = 0; q < per; ++q) {
        const int e = e0 + q;
        if (e >= E) break;
        const int n = count[e];
        tile_start[e] = start;
        for (int z = 0; z < (n + 7) >> 3; ++z) tile_expert[start + z] = e;
        for (int r = n; r < ((n + 7) & ~7); ++r) tile_pairs[start * 8 + r] = -1;   // the last tile's free slots
        start += (n + 7) >> 3;
    }
    if (threadIdx.x == blockDim.x - 1) { tile_start[E] = start; *num_tiles = start; }   // past every expert
    __syncthreads();
    for (int p = threadIdx.x; p < P; p += blockDim.x) {              // the other slots: each pair in its tile
        const int e = id_of(p), r = rank[p];
        tile_pairs[(tile_start[e] + (r >> 3)) * 8 + (r & 7)] = p;
    }
}

__device__ void align_tiles(const int* ids, int P, int E, unsigned char* smem, int* __restrict__ tile_expert,
                            int* __restrict__ tile_pairs, int* __restrict__ num_tiles) {
    align_tiles_of([ids](int p) { return ld_cg_s32(&ids[p]); }, P, E, smem, tile_expert, tile_pairs, num_tiles);
}

// A pruned verify's live mask (issue 53), applied by the aligning block before it aligns (both routing kernels):
// routed_ids [P] = the ids as routed (every row's: tree_prune and the stats read them), and live_ids / live_w [P]
// (what the alignment and the experts read) = the routing with each dead row's (live 0, not row 0 = the tree's
// root) k pairs on the root's k experts at weight 0: the tile lists name only experts a live row reads, and a dead
// row's routed part is 0 x expert = 0. The ids come from ids [P] (global, through L2) or, with one token block,
// from the block's shared copy ids_s (its dead rows rewritten as well); w [P] is read only when copying.
// live_ids / live_w are either ids / w themselves (the router's own buffers: only dead rows are written, so row 0,
// read across threads, is never written) or other buffers (a given routing stays as given: every pair written).
// The caller syncs the block before the alignment reads them. Numpy twin: plugins/prune_ops.py route_live_twin.
__device__ void live_rows(const int* ids, const float* w, int* ids_s, const int* live, int P, int topk,
                          int* __restrict__ routed_ids, int* live_ids, float* live_w) {
    const bool copy = live_ids != ids;
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
        const int r = p / topk, s = p - r * topk;
        const int e = ids_s ? ids_s[p] : ld_cg_s32(ids + p);
        const bool dead = r != 0 && ld_cg_s32(live + r) == 0;
        routed_ids[p] = e;
        if (dead) {
            const int root = ids_s ? ids_s[s] : ld_cg_s32(ids + s);
            live_ids[p] = root;
            live_w[p] = 0.0f;
            if (ids_s) ids_s[p] = root;
        } else if (copy) {
            live_ids[p] = e;
            live_w[p] = ld_cg_f32(w + p);
        }
    }
}
