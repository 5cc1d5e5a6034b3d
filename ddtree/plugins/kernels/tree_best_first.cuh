// DDTree tree build, the selection half, included by tree_build.cu after its constants and shared-memory union
// (TreeSmem, Candidates): the node word, and the best-first tree from the [D, K] table: B pops on one warp
// (best_first_pops) or one block-wide top-B over the candidate table (candidate_select; plugins/tree_candidates.py),
// then the tree tensors (tree_outputs). numpy twins: ddtree/tree/build.py build_tree, plugins/tree_candidates.py
// candidate_tree.
#pragma once

// ---- the node word ------------------------------------------------------------------------------
// A frontier candidate or popped node in one u32, read and written only through these:
//   bits  0-15 parent  (node index, < n <= 256)
//   bits 16-23 depth   (1..D; the root is depth 0 and has no word)
//   bits 24-31 rank    (0..K-1: its place in its depth's top-K list)
__device__ __forceinline__ u32 node_pack(int parent, int depth, int rank) {
    return (u32)parent | (u32)depth << 16 | (u32)rank << 24;
}
__device__ __forceinline__ int node_parent(u32 m) { return (int)(m & 0xffff); }
__device__ __forceinline__ int node_depth(u32 m) { return (int)((m >> 16) & 0xff); }
__device__ __forceinline__ int node_rank(u32 m) { return (int)(m >> 24); }
// the next sibling (same parent and depth, rank + 1); the caller checks rank + 1 < K <= 256
__device__ __forceinline__ u32 node_next_sibling(u32 m) { return m + (1u << 24); }

// ---- best-first selection ------------------------------------------------------------------------
// A candidate is a rank tuple (r_1 .. r_d) packed big-endian as bytes r_j + 1 in (hi, lo), zero after
// depth d, so integer order is the lexicographic order with a prefix before its extensions.
__device__ __forceinline__ u64 tuple_hi(int byte) { return byte < 8 ? 1ull << (8 * (7 - byte)) : 0ull; }
__device__ __forceinline__ u64 tuple_lo(int byte) { return byte < 8 ? 0ull : 1ull << (8 * (15 - byte)); }
__device__ __forceinline__ bool tuple_less(u64 ha, u64 la, u64 hb, u64 lb) { return ha != hb ? ha < hb : la < lb; }

// The rank tuple of a frontier candidate (node word m): its rank at its depth, then its ancestors'
// ranks from the node records.
template <typename Build>
__device__ void slot_tuple(const Build& b, u32 m, u64& h, u64& l) {
    const int d = node_depth(m);
    h = tuple_hi(d - 1) * (node_rank(m) + 1u);
    l = tuple_lo(d - 1) * (node_rank(m) + 1u);
    for (int j = node_parent(m); j > 0; j = node_parent(b.nm[j])) {
        const u32 mj = b.nm[j];
        h += tuple_hi(node_depth(mj) - 1) * (node_rank(mj) + 1u);
        l += tuple_lo(node_depth(mj) - 1) * (node_rank(mj) + 1u);
    }
}

struct TreeOut {
    int *tokens, *parents, *depth, *positions, *count;
    float* scores;
    u32* vis;
};

// table [D, K] keys (descending per row) -> nodes 1 .. nodes-1 in b.nm / b.score; returns nodes. One block;
// warp 0 pops, lane L owning frontier slots L + 32 j: a pop is the lane-local best then a warp max on the
// score's order key; only when two lanes hold the same best score do rank tuples decide.
__device__ int best_first_pops(TreeSmem& sm, const u64* table, int D, int K, int B) {
    auto& b = sm.build;
    for (int e = threadIdx.x; e < D * K; e += TB_THREADS) b.lp[e / K][e % K] = key_value(ld_cg_u64(table + e));
    __syncthreads();
    DD_TRACE(7, true);
    DD_TRACE_CLOCK(10);
    __shared__ int s_nodes;
    if (threadIdx.x < 32) {
        // lane L holds slots L + 32 j in registers: score, parent's score, node word. Rank tuples are
        // rebuilt from the node records only to break equal scores (rare).
        const int lane = threadIdx.x;
        float sc[8], ps[8];
        u32 mt[8], valid = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) { sc[j] = 0.f; ps[j] = 0.f; mt[j] = 0; }
        if (lane == 0) { sc[0] = __fadd_rn(0.f, b.lp[0][0]); mt[0] = node_pack(0, 1, 0); valid = 1; }   // ranks (0)
        int nodes = 1, next_free = 1;
        while (nodes <= B) {
            float v[8];                                  // lane-local best score (a max tree), then its slot
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = (valid >> j) & 1 ? sc[j] : DD_NEG_INF;
            const float ms = fmaxf(fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3])), fmaxf(fmaxf(v[4], v[5]), fmaxf(v[6], v[7])));
            u32 at_best = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) at_best |= (((valid >> j) & 1) && sc[j] == ms) ? 1u << j : 0u;
            int mj = __ffs(at_best) - 1;
            if (__popc(at_best) > 1) {                   // equal scores within the lane: smaller tuple
                u64 bh = ~0ull, bl = ~0ull;
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if ((at_best >> j) & 1) {
                        u64 h, l;
                        slot_tuple(b, mt[j], h, l);
                        if (tuple_less(h, l, bh, bl)) { bh = h; bl = l; mj = j; }
                    }
            }
            const u32 my_key = mj >= 0 ? order32(ms) : 0u;       // order32 never returns 0 for a float
            const u32 top = redux_max_u32(my_key);
            if (top == 0) break;                                 // frontier empty
            const u32 holders = __ballot_sync(0xffffffffu, my_key == top);
            int wl = __ffs(holders) - 1;
            const int b0 = mj & 1, b1 = mj & 2, b2 = mj & 4;   // select slot mj's fields (a select tree)
            u32 m = b2 ? (b1 ? (b0 ? mt[7] : mt[6]) : (b0 ? mt[5] : mt[4])) : (b1 ? (b0 ? mt[3] : mt[2]) : (b0 ? mt[1] : mt[0]));
            float p = b2 ? (b1 ? (b0 ? ps[7] : ps[6]) : (b0 ? ps[5] : ps[4])) : (b1 ? (b0 ? ps[3] : ps[2]) : (b0 ? ps[1] : ps[0]));
            if (__popc(holders) > 1) {                           // equal best scores in several lanes
                u64 h = ~0ull, l = ~0ull;
                if (my_key == top) slot_tuple(b, m, h, l);
                int who = my_key == top ? lane : -1;
#pragma unroll
                for (int o = 16; o; o >>= 1) {
                    const u64 oh = __shfl_xor_sync(0xffffffffu, h, o), ol = __shfl_xor_sync(0xffffffffu, l, o);
                    const int ow = __shfl_xor_sync(0xffffffffu, who, o);
                    if (ow >= 0 && (who < 0 || tuple_less(oh, ol, h, l))) { h = oh; l = ol; who = ow; }
                }
                wl = who;
            }
            const int wj = __shfl_sync(0xffffffffu, mj, wl);
            const float pscore = __shfl_sync(0xffffffffu, p, wl);
            m = __shfl_sync(0xffffffffu, m, wl);
            const float bs = unorder32(top);
            const int d = node_depth(m), r = node_rank(m), node = nodes++;
            const bool sibling = r + 1 < K, child = d < D;
            const int f = child ? next_free++ : -1;
            const float sib_score = sibling ? __fadd_rn(pscore, b.lp[d - 1][r + 1]) : 0.f;
            const float child_score = child ? __fadd_rn(bs, b.lp[d][0]) : 0.f;
            if (lane == 0) { b.nm[node] = m; b.score[node] = bs; }    // token, parent, depth later, in parallel
            // the next sibling replaces the popped candidate in its slot (or the slot empties); the first
            // child (rank 0 one level deeper) takes a fresh slot. Per-lane bit masks, not a dynamic index
            // (which would move the arrays to local memory).
            const u32 pop_bit = lane == wl ? 1u << wj : 0u;
            const u32 child_bit = child && lane == (f & 31) ? 1u << (f >> 5) : 0u;
            const u32 child_meta = node_pack(node, d + 1, 0);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const bool popped = (pop_bit >> j) & 1, born = (child_bit >> j) & 1;
                sc[j] = born ? child_score : (popped && sibling ? sib_score : sc[j]);
                ps[j] = born ? bs : ps[j];
                mt[j] = born ? child_meta : (popped && sibling ? node_next_sibling(mt[j]) : mt[j]);
            }
            valid = (valid & ~(sibling ? 0u : pop_bit)) | child_bit;
            __syncwarp();                                // node records visible to the tie paths
        }
        if (lane == 0) s_nodes = nodes;
    }
    __syncthreads();
    return s_nodes;
}

// The same nodes from the candidate table: the B largest keys order32(score) << 32 | (0x1FFF - lex) << 16 | index
// (score descending, then the rank tuple ascending: the pops' order; the index only finds the entry again), then
// parents through node_of[index]. Returns nodes (1 + the valid candidates, at most B + 1).
__device__ int candidate_select(TreeSmem& sm, const u64* table, int D, int K, int B, Candidates cand) {
    auto& c = sm.cand;
    __shared__ float scratch[32];
    u64 tup[TB_CAND_ITEMS];
    u32 meta[TB_CAND_ITEMS];
#pragma unroll
    for (int j = 0; j < TB_CAND_ITEMS; ++j) {             // the launch-constant table: in flight with the lp loads
        const int i = j * TB_THREADS + threadIdx.x;
        tup[j] = i < cand.n ? cand.tuple[i] : 0ull;
        meta[j] = i < cand.n ? cand.meta[i] : 0u;
    }
    for (int e = threadIdx.x; e < D * K; e += TB_THREADS) c.lp[e] = key_value(ld_cg_u64(table + e));
    __syncthreads();
    u64 keys[TB_CAND_ITEMS];
    float valid = 0.f;
#pragma unroll
    for (int j = 0; j < TB_CAND_ITEMS; ++j) {
        float s = 0.f;                                     // the pops' fold: 0 + logp[0][r_1] + ...
        bool ok = tup[j] != 0ull;
#pragma unroll
        for (int d = 0; d < TB_CAND_MAX_DEPTH; ++d) {
            const int byte = (int)(tup[j] >> (8 * (7 - d))) & 0xff;
            if (byte == 0) break;
            ok = ok && d < D && byte <= K;
            if (ok) s = __fadd_rn(s, c.lp[d * K + byte - 1]);
        }
        const int i = j * TB_THREADS + threadIdx.x;
        keys[j] = ok ? (u64)order32(s) << 32 | (u64)((0x1fffu - (meta[j] >> 16)) << 16 | (u32)i) : 0ull;
        valid += ok ? 1.f : 0.f;
    }
    const int n_valid = (int)block_reduce(valid, SumOp<float>(), 0.f, scratch);   // exact: <= 6144
    const int picked = min(B, n_valid);
    if (cand.n <= TB_THREADS) {                           // a key a thread (B <= 20 at depth 7): one sort
        const u64 v = block_sort_desc_1<TB_THREADS>(keys[0], c.top.thread_max);
        if (threadIdx.x < picked) c.picked[threadIdx.x] = v;
    } else {
        block_top_keys<TB_THREADS, TB_CAND_ITEMS>(keys, picked, c.top, c.picked);
    }
    unsigned short* node_of = reinterpret_cast<unsigned short*>(c.top.cand);     // [index] -> node
    __syncthreads();
    for (int r = threadIdx.x; r < picked; r += TB_THREADS) node_of[(u32)c.picked[r] & 0xffffu] = (unsigned short)(r + 1);
    __syncthreads();
    for (int r = threadIdx.x; r < picked; r += TB_THREADS) {
        const u64 key = c.picked[r];
        const int i = (int)((u32)key & 0xffffu);
        const u64 t = cand.tuple[i];
        const int p = (int)(cand.meta[i] & 0xffffu);
        const int d = 8 - (__ffsll((long long)t) - 1) / 8;  // bytes past the depth are zero
        const int rank = (int)(t >> (8 * (8 - d))) & 0xff;
        // the parent precedes its child in any consistent order; NaN scores (flagged: TB_STATUS_NAN_DRAFT) are
        // not one, so a parent not among the earlier nodes hangs the node on the root (no stray index)
        int q = p == 0xffff ? 0 : node_of[p];
        if (q != 0 && (q > r || ((u32)c.picked[q - 1] & 0xffffu) != (u32)p)) q = 0;
        c.nm[r + 1] = node_pack(q, d, rank - 1);
        c.score[r + 1] = key_value(key);
    }
    __syncthreads();
    return picked + 1;
}

// Nodes 0 .. nodes-1 (node words nm, scores; tokens from the table's keys) -> the tree tensors, n = B + 1 rows.
__device__ void tree_outputs(const u32* nm, const float* score, const u64* table, int K, int nodes, int B, int root,
                             int start, TreeOut o) {
    const int n = B + 1, W = (n + 31) >> 5;
    for (int i = threadIdx.x; i < n; i += TB_THREADS) {
        const bool real = i > 0 && i < nodes;
        const u32 m = real ? nm[i] : 0u;
        const int dep = node_depth(m);
        o.tokens[i] = i == 0 ? root : (real ? key_id(ld_cg_u64(table + (dep - 1) * K + node_rank(m))) : -1);
        o.parents[i] = real ? node_parent(m) : -1;
        o.depth[i] = dep;
        o.positions[i] = start + dep;
        o.scores[i] = real ? score[i] : 0.f;
        for (int w = 0; w < W; ++w) {                    // the row's ancestors-or-self, word w
            u32 bits = 0;
            if (i < nodes)
                for (int j = i; j >= 0; j = j ? node_parent(nm[j]) : -1)
                    if ((j >> 5) == w) bits |= 1u << (j & 31);
            o.vis[(size_t)i * W + w] = bits;
        }
    }
    if (threadIdx.x == 0) *o.count = nodes;
    DD_TRACE(9, true);
}

// table [D, K] keys (descending per row) -> the tree.
__device__ void best_first(TreeSmem& sm, const u64* table, int D, int K, int B, int root, int start, Candidates cand,
                           TreeOut o) {
    DD_TRACE(6, true);
    if (cand.n > 0) {
        const int nodes = candidate_select(sm, table, D, K, B, cand);
        DD_TRACE(8, true);
        DD_TRACE_CLOCK(11);
        tree_outputs(sm.cand.nm, sm.cand.score, table, K, nodes, B, root, start, o);
    } else {
        const int nodes = best_first_pops(sm, table, D, K, B);
        DD_TRACE(8, true);
        DD_TRACE_CLOCK(11);
        tree_outputs(sm.build.nm, sm.build.score, table, K, nodes, B, root, start, o);
    }
}
