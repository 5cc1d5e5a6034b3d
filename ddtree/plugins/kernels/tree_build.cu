// DDTree on the GPU, part 1: drafter logits -> per-depth top-k log-probabilities -> the budgeted
// best-first tree (docs/ddtree.md 2.2; tensors and tie rules: docs/interfaces.md section 4).
// numpy twins: ddtree/tree/build.py topk_logprobs and build_tree. Launcher: ddtree/plugins/tree_build.py.
//
//   draft_lse_parts  grid (S, D)  per 16384-token slice of each depth row: (max, sum exp(x - max)) fp32
//   draft_topk       grid (S, D)  lse from the parts (same order in every block); the slice's K largest
//                                 keys (logp = x - lse, ties -> lower id). The last slice of a row to
//                                 finish merges the row's S lists into the table row; the last row to
//                                 finish builds the tree (best_first, tree_best_first.cuh). Two launches.
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

#include "tree_best_first.cuh"   // the node word, best_first (pops or candidates), tree_outputs

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

// ---- the vocab-parallel nodes (description/nodes.py VocabTopK, TreeBuild; launcher plugins/vocab_nodes.py) ------------
// At any tp a rank takes the top-k of its vocab slice with its (max, sum exp) (node_vocab_topk); the ranks'
// candidates are gathered, and every rank builds the same tree from them (node_tree_build). numpy twins:
// backends/numpy_math.vocab_topk and tree_build.

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
