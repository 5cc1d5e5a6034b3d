// DDTree on the GPU, part 2: the target's token at every tree node (the one sampling definition of
// docs/interfaces.md section 5, float64) and the acceptance walk (docs/ddtree.md 2.4).
// numpy twins: ddtree/tree/sampling.py sample and ddtree/tree/walk.py accept_walk.
// Launcher: ddtree/plugins/tree_sample.py. One kernel per mode, grid (S, n): a block per 16384-token
// slice of a row; the last slice of a row to finish decides the row; the last block of all walks.
//
//   sample_greedy    the largest (logit, -id) key (256-thread blocks: every slice of B = 64 in one wave)
//   sample_gumbel    the largest z + g, z = l / T (no filter); float64 only for tokens whose float32
//                    estimate can still win
//   sample_filtered  the slice's C largest keys (C = top_k, or 256 for top-p alone) and, for top-p alone,
//                    (slice max, largest logit left out, sum of exp(z - z_max)). The row: top-k survivors,
//                    then the top-p prefix from the candidates when they decide it (every candidate above
//                    the largest logit left out is in its exact place), then Gumbel-max over the kept.
//                    Rows the candidates do not decide go to sample_top_p.cu (RowState.needs_full_row).
//
// The softmax normaliser of top-p sums exp(z - z_max) in float64 for tokens within 20 of the maximum and
// in float32 below (each < 2e-9 of the largest term): the kept set can differ from a float64 sum only
// when the cumulative probability lands within ~1e-9 of top_p (a near-tie, docs/interfaces.md 6).
//
// Letters: n rows (tree nodes), V vocab, S = ceil(V / 16384) slices, C candidates per slice.
#include "sample_common.cuh"

#define SP_GREEDY_THREADS 256

// logits [n, V] fp32 -> target [n] int32 (the token for position query_pos + 1)
extern "C" __global__ void __launch_bounds__(SP_GREEDY_THREADS)
sample_greedy(const float* __restrict__ logits, int V, SP_ARGS, u64* __restrict__ slice_keys,
              int* __restrict__ target, int* status, SP_WALK_ARGS) {
    __shared__ u64 scratch[32];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x, n = gridDim.y;
    const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V;
    pdl_wait();
    check_mode(*params, SP_GREEDY, status);
    u64 best = 0;
    bool nan = false;
#pragma unroll 8
    for (int v = lo + threadIdx.x; v < hi; v += SP_GREEDY_THREADS) {
        const float l = row[v];
        nan |= l != l;
        const u64 key = pack_key(l, v);
        best = key > best ? key : best;
    }
    if (nan) atomicOr(status, SP_STATUS_NAN_TARGET);
    best = block_reduce(best, MaxU64Op(), 0ull, scratch);
    if (threadIdx.x == 0) slice_keys[r * S + s] = best;
    if (arrive_last(row_tickets + r, (u32)S)) {
        u64 row_best = 0;
        for (int i = threadIdx.x; i < S; i += SP_GREEDY_THREADS) {
            const u64 k = ld_cg_u64(slice_keys + r * S + i);
            row_best = k > row_best ? k : row_best;
        }
        row_best = block_reduce(row_best, MaxU64Op(), 0ull, scratch);
        if (threadIdx.x == 0) target[r] = key_id(row_best);
    }
    walk_if_last(done_ticket, (u32)(S * n), target, n, SP_WALK);
    pdl_trigger();
}

extern "C" __global__ void __launch_bounds__(SP_THREADS)
sample_gumbel(const float* __restrict__ logits, int V, const int* __restrict__ query_pos, SP_ARGS,
              Winner* __restrict__ slice_wins, int* __restrict__ target, int* status, SP_WALK_ARGS) {
    __shared__ Winner scratch[32];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x, n = gridDim.y;
    const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
    pdl_wait();
    SP_MAKE_ARGS;
    check_mode(sp, SP_GUMBEL, status);
    const u32 position = (u32)query_pos[r] + 1u;
    Winner w = gumbel_best(logits + (size_t)r * V, lo + threadIdx.x, hi, SP_THREADS, position, a,
                           [](int, float) { return true; });
    int token;
    if (row_winner(w, slice_wins, r, s, S, row_tickets, scratch, token) && threadIdx.x == 0) target[r] = token;
    walk_if_last(done_ticket, (u32)(S * n), target, n, SP_WALK);
    pdl_trigger();
}

struct SliceParts { float max, left_out; double sum; };   // left_out: largest logit not among the C sent

union FilteredSmem {
    struct { TopKeysSmem top; u64 picked[SP_CAND]; } slice;
    struct { TopKeysSmem top; u64 merged[SP_MERGED]; double prob[SP_MERGED]; } row;
};

// The row decision from the merged candidates: writes target[r], or hands the row to sample_top_p.cu.
__device__ void filtered_row(FilteredSmem& sm, const u64* lists, const SliceParts* parts, int S, int C,
                             u32 position, const SampleArgs& a, int* target, RowState* state, int r,
                             u32* full_row_rows) {
    __shared__ int s_valid, s_certified, s_kept, s_left_out;
    __shared__ double s_norm;
    __shared__ Winner scratch[32];
    u64* merged = sm.row.merged;
    double* prob = sm.row.prob;
    const bool top_p_alone = a.top_k == 0;
    const int want = top_p_alone ? SP_CAND + 1 : a.top_k;   // + 1: the largest left out of the merge
    u64 keys[SP_MAX_LIST_KEYS / SP_THREADS];                 // the row's S * C candidates, 6 per thread
    load_keys_cg<SP_THREADS>(keys, lists, S * C);
    block_top_keys<SP_THREADS, SP_MAX_LIST_KEYS / SP_THREADS>(keys, want, sm.row.top, merged);
    const float l_top = key_value(merged[0]);
    for (int i = threadIdx.x; i < want; i += SP_THREADS)
        prob[i] = merged[i] ? exp((double)key_value(merged[i]) / a.temperature - (double)l_top / a.temperature) : 0.0;
    __syncthreads();
    if (threadIdx.x == 0) {
        int valid = 0;
        while (valid < want && merged[valid]) ++valid;
        double norm = 0.0;
        float left_out = DD_NEG_INF;
        int certified = valid;
        if (top_p_alone) {                                  // normaliser over the whole row from the parts
            if (valid > SP_CAND) left_out = key_value(merged[SP_CAND]);
            for (int s = 0; s < S; ++s) {                   // written by the row's other blocks: past L1
                const volatile SliceParts* p = parts + s;
                left_out = fmaxf(left_out, p->left_out);
                norm += exp((double)p->max / a.temperature - (double)l_top / a.temperature) * p->sum;
            }
            valid = min(valid, SP_CAND);
            certified = 0;                                  // candidates above everything left out
            while (certified < valid && key_value(merged[certified]) > left_out) ++certified;
        } else {
            for (int i = 0; i < valid; ++i) norm += prob[i];     // softmax over the top-k survivors
        }
        s_valid = valid; s_certified = certified; s_norm = norm; s_left_out = left_out != DD_NEG_INF;
    }
    __syncthreads();
    const int valid = s_valid;
    for (int i = threadIdx.x; i < valid; i += SP_THREADS) prob[i] /= s_norm;
    __syncthreads();
    if (threadIdx.x == 0) {                                 // top-p prefix length over (prob desc, id asc)
        int L = valid;
        bool decided = a.top_p >= 1.0;
        double cum = 0.0;                                   // sequential, like numpy's cumsum
        for (int i = 0; i < s_certified && !decided; ++i) {
            cum += prob[i];
            if (cum >= a.top_p) { L = i + 1; decided = true; }
        }
        if (!decided && !s_left_out) decided = true;        // every token was a candidate: keep them all
        s_kept = decided ? L : -1;
        if (!decided) {
            atomicAdd(full_row_rows, 1u);
            state[r].needs_full_row = 1;
            state[r].l_top = l_top;
            state[r].norm = s_norm;
        }
    }
    __syncthreads();
    const int L = s_kept;
    if (L < 0) return;
    // kept: the first L in (prob desc, id asc) order; probabilities never rise along `merged`, so only
    // the run of probabilities equal to the L-th needs its members ordered by id
    const double p_b = prob[L - 1];
    int run_start = L - 1;
    while (run_start > 0 && prob[run_start - 1] == p_b) --run_start;
    const int need = L - run_start;
    Winner w{DD_NEG_INF, 0x7fffffff};
    for (int i = threadIdx.x; i < valid; i += SP_THREADS) {
        bool kept = i < run_start;
        if (!kept && prob[i] == p_b) {
            int lower = 0;                                  // run members with a lower id
            for (int j = run_start; j < valid && prob[j] == p_b; ++j) lower += key_id(merged[j]) < key_id(merged[i]);
            kept = lower < need;
        }
        if (!kept) continue;
        const int id = key_id(merged[i]);
        const double value = (double)key_value(merged[i]) / a.temperature
                             + gumbel64(philox_word0(position, (u32)id, a.seed_lo, a.seed_hi));
        w = better(w, Winner{value, id});
    }
    w = block_winner(w, scratch);
    if (threadIdx.x == 0) target[r] = w.id;
}

// params: the device record (C = params->candidates <= SP_CAND); keys [n, S, C], parts [n, S], state [n] (zeroed by the full-row kernels after use); full_row_rows: a
// running count of rows handed to the full-row kernels (diagnostics for tests and benchmarks)
extern "C" __global__ void __launch_bounds__(SP_THREADS)
sample_filtered(const float* __restrict__ logits, int V, const int* __restrict__ query_pos, SP_ARGS,
                u64* __restrict__ slice_keys, SliceParts* __restrict__ parts, RowState* __restrict__ state,
                int* __restrict__ target, int* status, u32* full_row_rows, int full_row_follows, SP_WALK_ARGS) {
    __shared__ __align__(16) FilteredSmem sm;
    __shared__ u64 scratch[32];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x, n = gridDim.y;
    const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V;
    pdl_wait();
    SP_MAKE_ARGS;
    check_mode(sp, full_row_follows ? SP_TOP_P : SP_TOP_K, status);
    const int C = a.candidates;                             // top_k, or SP_CAND for top-p alone
    u64 keys[SP_ITEMS];
    bool nan = false;
#pragma unroll
    for (int j = 0; j < SP_ITEMS; ++j) {
        const int v = lo + j * SP_THREADS + threadIdx.x;
        const float l = v < hi ? row[v] : 0.f;
        nan |= l != l;
        keys[j] = v < hi ? pack_key(l, v) : 0ull;
    }
    if (nan) atomicOr(status, SP_STATUS_NAN_TARGET);
    const int k = min(C, hi - lo);
    block_top_keys<SP_THREADS, SP_ITEMS>(keys, k, sm.slice.top, sm.slice.picked);
    u64* out = slice_keys + ((size_t)r * S + s) * C;
    for (int i = threadIdx.x; i < C; i += SP_THREADS) out[i] = i < k ? sm.slice.picked[i] : 0ull;
    if (a.top_k == 0) {                                     // top-p alone: this slice's share of the normaliser
        const u64 t = sm.slice.picked[k - 1];
        u64 below = 0;                                      // largest key left out
#pragma unroll
        for (int j = 0; j < SP_ITEMS; ++j) if (keys[j] < t && keys[j] > below) below = keys[j];
        below = block_reduce(below, MaxU64Op(), 0ull, scratch);
        const float l_max = key_value(sm.slice.picked[0]);
        float tail = 0.f;
        double sum = 0.0;
#pragma unroll
        for (int j = 0; j < SP_ITEMS; ++j)
            if (keys[j]) sum += softmax_weight(key_value(keys[j]), l_max, a, tail);
        sum += (double)tail;
        sum = block_reduce(sum, SumOp<double>(), 0.0, (double*)scratch);
        if (threadIdx.x == 0) parts[r * S + s] = SliceParts{l_max, below ? key_value(below) : DD_NEG_INF, sum};
    }
    if (arrive_last(row_tickets + r, (u32)S))
        filtered_row(sm, slice_keys + (size_t)r * S * C, parts + r * S, S, C, (u32)query_pos[r] + 1u, a, target,
                     state, r, full_row_rows);
    if (!full_row_follows) walk_if_last(done_ticket, (u32)(S * n), target, n, SP_WALK);
    pdl_trigger();
}
