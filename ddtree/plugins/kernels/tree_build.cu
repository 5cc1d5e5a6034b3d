// DDTree on the GPU, part 1: drafter logits -> per-depth top-k log-probabilities -> the budgeted
// best-first tree (ddtree.md 2.2; tensors and tie rules: interfaces.md section 4).
// numpy twins: ddtree/tree/build.py topk_logprobs and build_tree. Launcher: ddtree/plugins/tree_build.py.
//
//   draft_lse_parts  grid (S, D)  per 16384-token slice of each depth row: (max, sum exp(x - max)) fp32
//   draft_topk       grid (S, D)  lse from the parts (same order in every block); the slice's K largest
//                                 keys (logp = x - lse, ties -> lower id). The last slice of a row to
//                                 finish merges the row's S lists into the table row; the last row to
//                                 finish builds the tree (best_first below). Two launches in all.
//   draft_merge      grid D       the same merge + build from lists given by the caller (tensor-parallel
//                                 ranks' candidates, or a table in tests)
//
// Letters: D depths (rows), V vocab, S = ceil(V / 16384) slices, K = min(B, V) per-depth candidates,
// B budget (drafted nodes, root excluded), n = B + 1 nodes, W = ceil(n / 32) visibility words per row.
#include "select.cuh"

#define TB_THREADS 512
#define TB_ITEMS 32
#define TB_SLICE (TB_THREADS * TB_ITEMS)
#define TB_MAX_DEPTH 16                  // rank tuples are 16 bytes (one byte per depth)
#define TB_MAX_K 256
#define TB_MAX_LIST_KEYS 4096            // S * K per row, merged in shared memory
#define TB_STATUS_NAN_DRAFT 1

struct SlotMeta { short parent; unsigned char depth, rank; float parent_score; };

// One block's shared memory, by phase (they never overlap in time).
union TreeSmem {
    struct { u32 hist[DD_SEL_BINS]; u64 picked[TB_MAX_K]; } slice;              // slice top-K
    struct { u64 lists[TB_MAX_LIST_KEYS]; u64 merged[TB_MAX_K]; } merge;        // row merge
    struct {                                                                    // best-first build
        float lp[TB_MAX_DEPTH][TB_MAX_K];
        int ids[TB_MAX_DEPTH][TB_MAX_K];
        u64 th[TB_MAX_K], tl[TB_MAX_K];          // frontier slots' rank tuples
        SlotMeta meta[TB_MAX_K];
        int tok[TB_MAX_K], par[TB_MAX_K];
        unsigned char dep[TB_MAX_K];
        float score[TB_MAX_K];
    } build;
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
    for (int v = lo + threadIdx.x; v < hi; v += TB_THREADS) {
        const float x = row[v];
        nan |= x != x;
        m = fmaxf(m, x);
    }
    if (nan) atomicOr(status, TB_STATUS_NAN_DRAFT);
    m = block_reduce(m, MaxOp(), DD_NEG_INF, scratch);
    float sum = 0.f;
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

// The S descending lists of one row (global, written by this or an earlier kernel) -> the row's K largest
// keys into table_row [K] (and decoded log-probabilities / ids for inspection).
__device__ void merge_row(TreeSmem& sm, const u64* lists_row, int S, int K, u64* table_row, float* logp_row,
                          int* ids_row) {
    load_cg_u64(sm.merge.lists, lists_row, S * K, TB_THREADS);
    __syncthreads();
    block_merge_desc<TB_THREADS>(sm.merge.lists, S, K, K, sm.merge.merged);
    for (int r = threadIdx.x; r < K; r += TB_THREADS) {
        const u64 key = sm.merge.merged[r];
        table_row[r] = key;
        logp_row[r] = key_value(key);
        ids_row[r] = key_id(key);
    }
}

// ---- best-first selection ------------------------------------------------------------------------
// A candidate is a rank tuple (r_1 .. r_d) packed big-endian as bytes r_j + 1 in (hi, lo), zero after
// depth d, so integer order is the lexicographic order with a prefix before its extensions.
__device__ __forceinline__ u64 tuple_hi(int byte) { return byte < 8 ? 1ull << (8 * (7 - byte)) : 0ull; }
__device__ __forceinline__ u64 tuple_lo(int byte) { return byte < 8 ? 0ull : 1ull << (8 * (15 - byte)); }
__device__ __forceinline__ bool tuple_less(u64 ha, u64 la, u64 hb, u64 lb) { return ha != hb ? ha < hb : la < lb; }

struct TreeOut {
    int *tokens, *parents, *depth, *positions, *count;
    float* scores;
    u32* vis;
};

// table [D, K] keys (descending per row) -> the tree. One block; warp 0 pops, lane L owning frontier slots
// L + 32 j: a pop is the lane-local best (score in registers) then a warp max on the score's order key;
// only when two lanes hold the same best score do rank tuples (shared memory) decide.
__device__ void best_first(TreeSmem& sm, const u64* table, int D, int K, int B, int root, int start, TreeOut o) {
    auto& b = sm.build;
    for (int e = threadIdx.x; e < D * K; e += TB_THREADS) {
        u64 key;
        asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(key) : "l"(table + e) : "memory");
        b.lp[e / K][e % K] = key_value(key);
        b.ids[e / K][e % K] = key_id(key);
    }
    __syncthreads();
    __shared__ int s_nodes;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float sc[8];
        u32 valid = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) sc[j] = 0.f;
        if (lane == 0) {                                 // slot 0: the first child of the root, ranks (0)
            sc[0] = __fadd_rn(0.f, b.lp[0][0]); valid = 1;
            b.th[0] = tuple_hi(0); b.tl[0] = 0;
            b.meta[0] = SlotMeta{0, 1, 0, 0.f};
        }
        int nodes = 1, next_free = 1;
        __syncwarp();
        while (nodes <= B) {
            // lane-local best: highest score, equal scores -> smaller tuple
            int mine = -1;
            float ms = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (!((valid >> j) & 1)) continue;
                const int slot = lane + 32 * j;
                if (mine < 0 || sc[j] > ms ||
                    (sc[j] == ms && tuple_less(b.th[slot], b.tl[slot], b.th[mine], b.tl[mine]))) {
                    mine = slot; ms = sc[j];
                }
            }
            const u32 my_key = mine >= 0 ? order32(ms) : 0u;   // order32 never returns 0 for a float
            const u32 top = redux_max_u32(my_key);
            if (top == 0) break;                                 // frontier empty
            const u32 holders = __ballot_sync(0xffffffffu, my_key == top);
            int slot;
            if (__popc(holders) == 1) {
                slot = __shfl_sync(0xffffffffu, mine, __ffs(holders) - 1);
            } else {                                             // equal best scores in several lanes
                slot = my_key == top ? mine : -1;
#pragma unroll
                for (int o = 16; o; o >>= 1) {
                    const int other = __shfl_xor_sync(0xffffffffu, slot, o);
                    if (other >= 0 && (slot < 0 || tuple_less(b.th[other], b.tl[other], b.th[slot], b.tl[slot])))
                        slot = other;
                }
            }
            const float bs = __shfl_sync(0xffffffffu, ms, slot & 31);
            const SlotMeta m = b.meta[slot];
            const u64 bh = b.th[slot], bl = b.tl[slot];
            __syncwarp();                                        // all lanes read the slot before it changes
            const int d = m.depth, r = m.rank, node = nodes++;
            const int owner = slot & 31, jw = slot >> 5;
            const bool sibling = r + 1 < K, child = d < D;
            const int f = child ? next_free++ : -1;
            if (lane == 0) {
                b.tok[node] = b.ids[d - 1][r]; b.par[node] = m.parent; b.dep[node] = (unsigned char)d;
                b.score[node] = bs;
                if (sibling) { b.meta[slot].rank = (unsigned char)(r + 1); b.th[slot] = bh + tuple_hi(d - 1); b.tl[slot] = bl + tuple_lo(d - 1); }
                if (child) { b.meta[f] = SlotMeta{(short)node, (unsigned char)(d + 1), 0, bs}; b.th[f] = bh + tuple_hi(d); b.tl[f] = bl + tuple_lo(d); }
            }
            // the next sibling replaces the popped candidate in its slot (or the slot empties);
            // the first child (rank 0 one level deeper) takes a fresh slot
            const float sib_score = sibling ? __fadd_rn(m.parent_score, b.lp[d - 1][r + 1]) : 0.f;
            const float child_score = child ? __fadd_rn(bs, b.lp[d][0]) : 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (lane == owner && j == jw) {
                    if (sibling) sc[j] = sib_score; else valid &= ~(1u << j);
                }
                if (child && lane == (f & 31) && j == (f >> 5)) { sc[j] = child_score; valid |= 1u << j; }
            }
            __syncwarp();
        }
        if (lane == 0) s_nodes = nodes;
    }
    __syncthreads();
    const int nodes = s_nodes, n = B + 1, W = (n + 31) >> 5;
    for (int i = threadIdx.x; i < n; i += TB_THREADS) {
        const bool real = i > 0 && i < nodes;
        const int dep = real ? b.dep[i] : 0;
        o.tokens[i] = i == 0 ? root : (real ? b.tok[i] : -1);
        o.parents[i] = real ? b.par[i] : -1;
        o.depth[i] = dep;
        o.positions[i] = start + dep;
        o.scores[i] = real ? b.score[i] : 0.f;
        for (int w = 0; w < W; ++w) {                    // the row's ancestors-or-self, word w
            u32 bits = 0;
            if (i < nodes)
                for (int j = i; j >= 0; j = j ? b.par[j] : -1)
                    if ((j >> 5) == w) bits |= 1u << (j & 31);
            o.vis[(size_t)i * W + w] = bits;
        }
    }
    if (threadIdx.x == 0) *o.count = nodes;
}

#define TB_BUILD_ARGS const int* __restrict__ root, const int* __restrict__ start, int B, \
    u64* __restrict__ table, float* __restrict__ table_logp, int* __restrict__ table_ids, \
    int* tokens, int* parents, int* depth, int* positions, float* scores, u32* vis, int* count, \
    u32* row_tickets, u32* done_ticket
#define TB_OUT TreeOut{tokens, parents, depth, positions, count, scores, vis}

// Row d done: merge it; the last row done builds the tree.
__device__ void finish_row(TreeSmem& sm, const u64* lists, int d, int D, int S, int K, TB_BUILD_ARGS) {
    merge_row(sm, lists + (size_t)d * S * K, S, K, table + (size_t)d * K, table_logp + d * K, table_ids + d * K);
    if (arrive_last(done_ticket, (u32)D)) best_first(sm, table, D, K, B, *root, *start, TB_OUT);
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
    pdl_wait();
    if (threadIdx.x == 0) s_lse = row_lse(parts + d * S, S);
    __syncthreads();
    const float lse = s_lse;
    u64 keys[TB_ITEMS];
#pragma unroll
    for (int j = 0; j < TB_ITEMS; ++j) {
        const int v = lo + j * TB_THREADS + threadIdx.x;
        keys[j] = v < hi ? pack_key(__fsub_rn(row[v], lse), v) : 0ull;
    }
    const int k = min(K, hi - lo);
    block_top_keys<TB_THREADS, TB_ITEMS>(keys, k, sm.slice.hist, sm.slice.picked, pow2_at_least(k));
    u64* out = lists + ((size_t)d * S + s) * K;
    for (int r = threadIdx.x; r < K; r += TB_THREADS) out[r] = r < k ? sm.slice.picked[r] : 0ull;
    if (arrive_last(row_tickets + d, (u32)S))
        finish_row(sm, lists, d, D, S, K, root, start, B, table, table_logp, table_ids, tokens, parents, depth,
                   positions, scores, vis, count, row_tickets, done_ticket);
    pdl_trigger();
}

// lists [D, S, K] from the caller -> the table and the tree (grid D)
extern "C" __global__ void __launch_bounds__(TB_THREADS)
draft_merge(const u64* __restrict__ lists, int S, int K, TB_BUILD_ARGS) {
    __shared__ __align__(16) TreeSmem sm;
    pdl_wait();
    finish_row(sm, lists, blockIdx.x, gridDim.x, S, K, root, start, B, table, table_logp, table_ids, tokens,
               parents, depth, positions, scores, vis, count, row_tickets, done_ticket);
    pdl_trigger();
}
