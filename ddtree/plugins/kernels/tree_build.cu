// DDTree on the GPU, part 1: drafter logits -> per-depth top-k log-probabilities -> the budgeted
// best-first tree (docs/ddtree.md 2.2; tensors and tie rules: docs/interfaces.md section 4).
// numpy twins: ddtree/tree/build.py topk_logprobs and build_tree. Launcher: ddtree/plugins/tree_build.py.
//
//   draft_lse_parts  grid (S, D)  per 16384-token slice of each depth row: (max, sum exp(x - max)) fp32
//   draft_topk       grid (S, D)  lse from the parts (same order in every block); the slice's K largest
//                                 keys (logp = x - lse, ties -> lower id). The last slice of a row to
//                                 finish merges the row's S lists into the table row; the last row to
//                                 finish builds the tree (best_first below). Two launches in all.
//   draft_merge      grid D       the same merge + build from lists given by the caller (tensor-parallel
//                                 ranks' candidates, or a table in tests)
// The build: with a candidate table (plugins/tree_candidates.py: every node that can be among the B best,
// sorted so a budget's candidates are a prefix), one block-wide top-B of their keys (candidate_select);
// without one (depth > 8, or a budget whose candidates pass TB_MAX_CAND) the B pops on one warp. Same tree.
//
// Letters: D depths (rows), V vocab, S = ceil(V / 16384) slices, K = min(B, V) per-depth candidates,
// B budget (drafted nodes, root excluded), n = B + 1 nodes, W = ceil(n / 32) visibility words per row.
#include "select.cuh"

#define TB_THREADS 512
#define TB_ITEMS 32
#define TB_SLICE (TB_THREADS * TB_ITEMS)
#define TB_MAX_DEPTH 16                  // rank tuples are 16 bytes (one byte per depth)
#define TB_MAX_K 256
#define TB_MAX_LIST_KEYS 4096            // S * K keys per row, merged in registers (8 per thread)
#define TB_STATUS_NAN_DRAFT 1
#define TB_CAND_ITEMS 12
#define TB_MAX_CAND (TB_THREADS * TB_CAND_ITEMS)   // candidate table entries (tree_candidates.MAX_CANDIDATES)
#define TB_CAND_MAX_DEPTH 8                        // tuples in one u64
#define TB_CAND_LP (TB_CAND_MAX_DEPTH * TB_MAX_K)  // the [D, K] log-probabilities, flat

// One block's shared memory, by phase (they never overlap in time).
union TreeSmem {
    struct { TopKeysSmem top; u64 picked[TB_MAX_K]; } slice;                   // slice top-K
    struct { TopKeysSmem top; u64 merged[TB_MAX_K]; } merge;                   // row merge
    struct {                                                                    // best-first build
        float lp[TB_MAX_DEPTH][TB_MAX_K];
        u32 nm[TB_MAX_K];                        // popped nodes' node words (node_pack below)
        float score[TB_MAX_K];
    } build;
    struct {                                                                    // candidate build
        float lp[TB_CAND_LP];                    // [D][K]
        TopKeysSmem top;                         // the selection; then top.cand holds node_of (u16)
        u64 picked[TB_MAX_K];
        u32 nm[TB_MAX_K];
        float score[TB_MAX_K];
    } cand;
};
static_assert(sizeof(u64) * DD_TOP_CAND >= sizeof(unsigned short) * TB_MAX_CAND, "node_of fits top.cand");

// The candidate table (plugins/tree_candidates.py): n entries of this launch's budget, none (n = 0): the pops.
//   tuple [n] u64  ranks r_j + 1 as bytes, big-endian     meta [n] u32  parent's index (0xFFFF: root) | lex << 16
struct Candidates {
    const u64* tuple;
    const u32* meta;
    int n;
};

// logits [D, V] fp32 -> parts [D, S] float2 (slice max, slice sum of exp(x - max))
extern "C" __global__ void __launch_bounds__(TB_THREADS)
draft_lse_parts(const float* __restrict__ logits, int V, float2* __restrict__ parts, int* status) {
    __shared__ float scratch[32];
    const int s = blockIdx.x, d = blockIdx.y, S = gridDim.x;
    const float* row = logits + (size_t)d * V;
    const int lo = s * TB_SLICE, hi = min(V, lo + TB_SLICE);
    pdl_wait();
    float m = DD_NEG_INF;
    bool nan = false;
#pragma unroll 8
    for (int v = lo + threadIdx.x; v < hi; v += TB_THREADS) {
        const float x = row[v];
        nan |= x != x;
        m = fmaxf(m, x);
    }
    if (nan) atomicOr(status, TB_STATUS_NAN_DRAFT);
    m = block_reduce(m, MaxOp(), DD_NEG_INF, scratch);
    float sum = 0.f;
#pragma unroll 8
    for (int v = lo + threadIdx.x; v < hi; v += TB_THREADS) sum += expf(row[v] - m);
    sum = block_reduce(sum, SumOp<float>(), 0.f, scratch);
    if (threadIdx.x == 0) parts[d * S + s] = make_float2(m, sum);
    pdl_trigger();
}

// lse of row d from its S parts, in slice order: top = max m_s, lse = top + log(sum_s sum_s * exp(m_s - top))
__device__ __forceinline__ float row_lse(const float2* parts, int S) {
    float top = DD_NEG_INF;
    for (int s = 0; s < S; ++s) top = fmaxf(top, parts[s].x);
    float total = 0.f;
    for (int s = 0; s < S; ++s) total += parts[s].y * expf(parts[s].x - top);
    return top + logf(total);
}

// The S lists of one row (global, written by this or an earlier kernel) -> the row's K largest keys,
// descending, into table_row [K] (and decoded log-probabilities / ids for inspection): the same top-K
// selection as a slice, over the S * K keys (8 per thread).
__device__ void merge_row(TreeSmem& sm, const u64* lists_row, int S, int K, u64* table_row, float* logp_row,
                          int* ids_row) {
    u64 keys[TB_MAX_LIST_KEYS / TB_THREADS];
    load_keys_cg<TB_THREADS>(keys, lists_row, S * K);
    block_top_keys<TB_THREADS, TB_MAX_LIST_KEYS / TB_THREADS>(keys, K, sm.merge.top, sm.merge.merged);
    for (int r = threadIdx.x; r < K; r += TB_THREADS) {
        const u64 key = sm.merge.merged[r];
        table_row[r] = key;
        logp_row[r] = key_value(key);
        ids_row[r] = key_id(key);
    }
}

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

#define TB_BUILD_ARGS const int* __restrict__ root, const int* __restrict__ start, int B, \
    u64* __restrict__ table, float* __restrict__ table_logp, int* __restrict__ table_ids, \
    int* tokens, int* parents, int* depth, int* positions, float* scores, u32* vis, int* count, \
    u32* row_tickets, u32* done_ticket, const u64* __restrict__ cand_tuple, const u32* __restrict__ cand_meta, int n_cand
#define TB_OUT TreeOut{tokens, parents, depth, positions, count, scores, vis}
#define TB_CAND Candidates{cand_tuple, cand_meta, n_cand}

// Row d done: merge it; the last row done builds the tree.
__device__ void finish_row(TreeSmem& sm, const u64* lists, int d, int D, int S, int K, TB_BUILD_ARGS) {
    DD_TRACE(4, d == 0);
    merge_row(sm, lists + (size_t)d * S * K, S, K, table + (size_t)d * K, table_logp + d * K, table_ids + d * K);
    DD_TRACE(5, d == 0);
    if (arrive_last(done_ticket, (u32)D)) best_first(sm, table, D, K, B, *root, *start, TB_CAND, TB_OUT);
}

// -> lists [D, S, K] (each slice's K largest (logp, id) keys, descending), then the table and the tree
extern "C" __global__ void __launch_bounds__(TB_THREADS)
draft_topk(const float* __restrict__ logits, int V, const float2* __restrict__ parts, int K,
           u64* __restrict__ lists, TB_BUILD_ARGS) {
    __shared__ __align__(16) TreeSmem sm;
    __shared__ float s_lse;
    const int s = blockIdx.x, d = blockIdx.y, S = gridDim.x, D = gridDim.y;
    const float* row = logits + (size_t)d * V;
    const int lo = s * TB_SLICE, hi = min(V, lo + TB_SLICE);
    // the logits come from two launches back (before draft_lse_parts): read them before waiting for it
    float x[TB_ITEMS];
#pragma unroll
    for (int j = 0; j < TB_ITEMS; ++j) {
        const int v = lo + j * TB_THREADS + threadIdx.x;
        x[j] = v < hi ? row[v] : 0.f;
    }
    pdl_wait();
    DD_TRACE(0, blockIdx.x == 0 && blockIdx.y == 0);
    if (threadIdx.x == 0) s_lse = row_lse(parts + d * S, S);
    __syncthreads();
    const float lse = s_lse;
    u64 keys[TB_ITEMS];
#pragma unroll
    for (int j = 0; j < TB_ITEMS; ++j) {
        const int v = lo + j * TB_THREADS + threadIdx.x;
        keys[j] = v < hi ? pack_key(__fsub_rn(x[j], lse), v) : 0ull;
    }
    const int k = min(K, hi - lo);
    DD_TRACE(1, blockIdx.x == 0 && blockIdx.y == 0);
    block_top_keys<TB_THREADS, TB_ITEMS>(keys, k, sm.slice.top, sm.slice.picked);
    DD_TRACE(2, blockIdx.x == 0 && blockIdx.y == 0); DD_TRACE_LAST(3);
    u64* out = lists + ((size_t)d * S + s) * K;
    for (int r = threadIdx.x; r < K; r += TB_THREADS) out[r] = r < k ? sm.slice.picked[r] : 0ull;
    if (arrive_last(row_tickets + d, (u32)S))
        finish_row(sm, lists, d, D, S, K, root, start, B, table, table_logp, table_ids, tokens, parents, depth,
                   positions, scores, vis, count, row_tickets, done_ticket, cand_tuple, cand_meta, n_cand);
    pdl_trigger();
}

// lists [D, S, K] from the caller -> the table and the tree (grid D)
extern "C" __global__ void __launch_bounds__(TB_THREADS)
draft_merge(const u64* __restrict__ lists, int S, int K, TB_BUILD_ARGS) {
    __shared__ __align__(16) TreeSmem sm;
    pdl_wait();
    finish_row(sm, lists, blockIdx.x, gridDim.x, S, K, root, start, B, table, table_logp, table_ids, tokens,
               parents, depth, positions, scores, vis, count, row_tickets, done_ticket, cand_tuple, cand_meta, n_cand);
    pdl_trigger();
}

// ---- the vocab-parallel nodes (ops/nodes.py VocabTopK, TreeBuild; launcher plugins/vocab_nodes.py) ------------
// At any tp a rank takes the top-k of its vocab slice with its (max, sum exp) (node_vocab_topk); the ranks'
// candidates are gathered, and every rank builds the same tree from them (node_tree_build). numpy twins:
// ops/numpy_math.vocab_topk and tree_build.

// logits [rows, V] fp32 of this rank's slice (global id vocab_start + v), grid (S, rows) -> per row the k
// largest (x, -id) keys as raw values [rows, k] and global ids [rows, k], row_max [rows] and row_sumexp [rows]
// = sum of exp(x - row_max) fp32. Each slice writes its (max, sum exp(x - max)) part and its k largest keys;
// the row's last slice combines the parts in slice order (top = max m_s, sum_s sum_s exp(m_s - top)) and merges
// the S lists (S k <= TB_MAX_LIST_KEYS). k <= TB_MAX_K and k <= V.
extern "C" __global__ void __launch_bounds__(TB_THREADS)
node_vocab_topk(const float* __restrict__ logits, int V, int vocab_start, int k, float2* __restrict__ parts,
                u64* __restrict__ lists, float* __restrict__ values, int* __restrict__ ids,
                float* __restrict__ row_max, float* __restrict__ row_sumexp, u32* __restrict__ row_tickets) {
    __shared__ __align__(16) TreeSmem sm;
    __shared__ float scratch[32];
    const int s = blockIdx.x, d = blockIdx.y, S = gridDim.x;
    const float* row = logits + (size_t)d * V;
    const int lo = s * TB_SLICE, hi = min(V, lo + TB_SLICE);
    pdl_wait();
    float x[TB_ITEMS], m = DD_NEG_INF;
#pragma unroll
    for (int j = 0; j < TB_ITEMS; ++j) {
        const int v = lo + j * TB_THREADS + threadIdx.x;
        x[j] = v < hi ? row[v] : DD_NEG_INF;
        m = fmaxf(m, x[j]);
    }
    m = block_reduce(m, MaxOp(), DD_NEG_INF, scratch);
    float sum = 0.f;
    u64 keys[TB_ITEMS];
#pragma unroll
    for (int j = 0; j < TB_ITEMS; ++j) {
        const int v = lo + j * TB_THREADS + threadIdx.x;
        sum += v < hi ? expf(x[j] - m) : 0.f;
        keys[j] = v < hi ? pack_key(x[j], vocab_start + v) : 0ull;
    }
    sum = block_reduce(sum, SumOp<float>(), 0.f, scratch);
    const int kk = min(k, hi - lo);
    block_top_keys<TB_THREADS, TB_ITEMS>(keys, kk, sm.slice.top, sm.slice.picked);
    u64* out = lists + ((size_t)d * S + s) * k;
    for (int r = threadIdx.x; r < k; r += TB_THREADS) out[r] = r < kk ? sm.slice.picked[r] : 0ull;
    if (threadIdx.x == 0) parts[d * S + s] = make_float2(m, sum);
    if (arrive_last(row_tickets + d, (u32)S)) {
        if (threadIdx.x == 0) {                          // the parts in slice order (S = 1: m and sum as they are)
            const float* p = reinterpret_cast<const float*>(parts + d * S);
            float top = DD_NEG_INF, total = 0.f;
            for (int i = 0; i < S; ++i) top = fmaxf(top, ld_cg_f32(p + 2 * i));
            for (int i = 0; i < S; ++i)
                total = __fadd_rn(total, __fmul_rn(ld_cg_f32(p + 2 * i + 1), expf(__fsub_rn(ld_cg_f32(p + 2 * i), top))));
            row_max[d] = top;
            row_sumexp[d] = S == 1 ? sum : total;
        }
        u64 all[TB_MAX_LIST_KEYS / TB_THREADS];
        load_keys_cg<TB_THREADS>(all, lists + (size_t)d * S * k, S * k);
        block_top_keys<TB_THREADS, TB_MAX_LIST_KEYS / TB_THREADS>(all, k, sm.merge.top, sm.merge.merged);
        for (int r = threadIdx.x; r < k; r += TB_THREADS) {
            values[d * k + r] = key_value(sm.merge.merged[r]);
            ids[d * k + r] = key_id(sm.merge.merged[r]);
        }
    }
    pdl_trigger();
}

// The ranks' gathered candidates values / cand_ids [tp, D, k] (raw logits, global ids) and parts row_max /
// row_sumexp [tp, D] -> the tree (grid D). Block d: the normaliser in numpy's fp32 operations and rank order
// (top = max_r m_r, total = s_0 exp(m_0 - top) + s_1 exp(m_1 - top) + ..., lse = top + log(total)), the tp k keys
// (logp = x - lse, id), their K = min(B, tp k) largest into the table row; the last row done builds the tree
// (best_first, as draft_merge). tp k <= TB_MAX_LIST_KEYS, K <= TB_MAX_K.
extern "C" __global__ void __launch_bounds__(TB_THREADS)
node_tree_build(const float* __restrict__ values, const int* __restrict__ cand_ids, const float* __restrict__ row_max,
                const float* __restrict__ row_sumexp, int tp, int k, int K, TB_BUILD_ARGS) {
    __shared__ __align__(16) TreeSmem sm;
    __shared__ float s_lse;
    const int d = blockIdx.x, D = gridDim.x;
    pdl_wait();
    if (threadIdx.x == 0) {
        float top = row_max[d];
        for (int r = 1; r < tp; ++r) top = fmaxf(top, row_max[r * D + d]);
        float total = __fmul_rn(row_sumexp[d], expf(__fsub_rn(row_max[d], top)));
        for (int r = 1; r < tp; ++r)
            total = __fadd_rn(total, __fmul_rn(row_sumexp[r * D + d], expf(__fsub_rn(row_max[r * D + d], top))));
        s_lse = __fadd_rn(top, logf(total));
    }
    __syncthreads();
    const float lse = s_lse;
    u64 keys[TB_MAX_LIST_KEYS / TB_THREADS];
#pragma unroll
    for (int j = 0; j < TB_MAX_LIST_KEYS / TB_THREADS; ++j) {
        const int e = j * TB_THREADS + threadIdx.x, r = e / k;
        const size_t at = ((size_t)r * D + d) * k + (e - r * k);
        keys[j] = e < tp * k ? pack_key(__fsub_rn(values[at], lse), cand_ids[at]) : 0ull;
    }
    block_top_keys<TB_THREADS, TB_MAX_LIST_KEYS / TB_THREADS>(keys, K, sm.merge.top, sm.merge.merged);
    for (int r = threadIdx.x; r < K; r += TB_THREADS) {
        const u64 key = sm.merge.merged[r];
        table[d * K + r] = key;
        table_logp[d * K + r] = key_value(key);
        table_ids[d * K + r] = key_id(key);
    }
    if (arrive_last(done_ticket, (u32)D)) best_first(sm, table, D, K, B, *root, *start, TB_CAND, TB_OUT);
    pdl_trigger();
}
