// DDTree on the GPU, part 2: the target's token at every tree node (the one sampling definition of
// docs/interfaces.md section 5, float64) and the acceptance walk (docs/ddtree.md 2.4).
// numpy twins: ddtree/tree/sampling.py sample and ddtree/tree/walk.py accept_walk.
// Launcher: ddtree/plugins/tree_sample.py. One kernel per mode, grid (S, n): a block per 16384-token
// slice of a row; the last slice of a row to finish decides the row; the last block of all walks.
// Top-p without top-k is sample_top_p.cu's (three kernels).
//
//   sample_greedy    the largest (logit, -id) key (256-thread blocks: every slice of B = 64 in one wave)
//   sample_gumbel    the largest z + g, z = l / T (no filter); float64 only for tokens whose float32
//                    estimate can still win
//   sample_filtered  top-k (then top-p over its survivors): the slice's C = top_k largest keys; the row
//                    merges them into the survivors, takes the top-p prefix of their softmax (float64) and
//                    Gumbel-max over the kept.
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

union FilteredSmem {
    struct { TopKeysSmem top; u64 picked[SP_CAND]; } slice;
    struct { TopKeysSmem top; u64 merged[SP_MERGED]; double prob[SP_MERGED]; } row;
};

// The row decision from the merged candidates (the top-k survivors): writes target[r].
__device__ void filtered_row(FilteredSmem& sm, const u64* lists, int S, int C, u32 position, const SampleArgs& a,
                             int* target, int r) {
    __shared__ int s_valid, s_kept;
    __shared__ double s_norm;
    __shared__ Winner scratch[32];
    u64* merged = sm.row.merged;
    double* prob = sm.row.prob;
    const int want = a.top_k;
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
        for (int i = 0; i < valid; ++i) norm += prob[i];     // softmax over the top-k survivors
        s_valid = valid; s_norm = norm;
    }
    __syncthreads();
    const int valid = s_valid;
    for (int i = threadIdx.x; i < valid; i += SP_THREADS) prob[i] /= s_norm;
    __syncthreads();
    if (threadIdx.x == 0) {                                 // top-p prefix length over (prob desc, id asc)
        int L = valid;                                      // not reached (rounding, or top_p >= 1): all
        double cum = 0.0;                                   // sequential, like numpy's cumsum
        for (int i = 0; i < valid && a.top_p < 1.0; ++i) {
            cum += prob[i];
            if (cum >= a.top_p) { L = i + 1; break; }
        }
        s_kept = L;
    }
    __syncthreads();
    const int L = s_kept;
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

// params: the device record (C = params->candidates = top_k <= SP_CAND); keys [n, S, C]
extern "C" __global__ void __launch_bounds__(SP_THREADS)
sample_filtered(const float* __restrict__ logits, int V, const int* __restrict__ query_pos, SP_ARGS,
                u64* __restrict__ slice_keys, int* __restrict__ target, int* status, SP_WALK_ARGS) {
    __shared__ __align__(16) FilteredSmem sm;
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x, n = gridDim.y;
    const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V;
    pdl_wait();
    SP_MAKE_ARGS;
    check_mode(sp, SP_TOP_K, status);
    const int C = a.candidates;                             // top_k
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
    if (arrive_last(row_tickets + r, (u32)S))
        filtered_row(sm, slice_keys + (size_t)r * S * C, S, C, (u32)query_pos[r] + 1u, a, target, r);
    walk_if_last(done_ticket, (u32)(S * n), target, n, SP_WALK);
    pdl_trigger();
}

// ---- the vocab-parallel nodes (description/nodes.py VocabWinner, AcceptWalk; launcher plugins/vocab_nodes.py) --------
// At any tp a rank picks the winner of its vocab slice per row (node_vocab_winner); the ranks' winners are
// gathered and every rank merges them and walks the tree (node_accept_walk). numpy twins:
// backends/numpy_math.vocab_winner and accept_walk_winners.

// logits [q, V] fp32 of this rank's slice (global id vocab_start + v), grid (S, q) -> value [q] (the winning
// float64 value rounded to float32) and id [q] (global). temperature [1] fp32 and seed [2] (low, high word) are
// read on the device, so one kernel serves both: T == 0 the largest logit (value = the logit); T > 0 the
// largest l / T + g(seed, sample_pos[r], id) (gumbel_best: sample_gumbel's noise, for the position given).
// Ties -> the lower id. Each slice writes its winner; the row's last slice merges the S winners.
extern "C" __global__ void __launch_bounds__(SP_THREADS)
node_vocab_winner(const float* __restrict__ logits, int V, int vocab_start, const int* __restrict__ sample_pos,
                  const float* __restrict__ temperature, const int* __restrict__ seed, Winner* __restrict__ slice_wins,
                  float* __restrict__ value, int* __restrict__ id, u32* __restrict__ row_tickets) {
    __shared__ Winner scratch[32];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x;
    const int lo = vocab_start + s * SP_SLICE, hi = vocab_start + min(V, (s + 1) * SP_SLICE);
    const float* row = logits + (size_t)r * V - vocab_start;       // row[g]: global id g's logit, g in [lo, hi)
    pdl_wait();
    const float t = *temperature;
    Winner w{DD_NEG_INF, 0x7fffffff};
    if (t == 0.f) {
#pragma unroll 8
        for (int g = lo + threadIdx.x; g < hi; g += SP_THREADS) w = better(w, Winner{(double)row[g], g});
    } else {
        const SampleArgs a{(double)t, 1.0, 0, 0, (u32)seed[0], (u32)seed[1], 0.f, 0.f};
        w = gumbel_best(row, lo + threadIdx.x, hi, SP_THREADS, (u32)sample_pos[r], a, [](int, float) { return true; });
    }
    w = block_winner(w, scratch);
    if (threadIdx.x == 0) slice_wins[r * S + s] = w;
    if (arrive_last(row_tickets + r, (u32)S)) {
        Winner best{DD_NEG_INF, 0x7fffffff};
        for (int i = threadIdx.x; i < S; i += SP_THREADS) {
            const volatile Winner* p = slice_wins + r * S + i;      // written by the row's other blocks
            best = better(best, Winner{p->value, p->id});
        }
        best = block_winner(best, scratch);
        if (threadIdx.x == 0) { value[r] = (float)best.value; id[r] = best.id; }
    }
    pdl_trigger();
}

// The ranks' winners win_value / win_id [tp, n] -> target [n] (the largest value, the lowest id among equal
// values), then accept_walk over the tree tokens / parents [n] (depth derived from the parents, as
// tree/build.py Tree.from_parents: parents[i] < i) -> accepted [n] (-1 after the path), count [1], bonus [1].
// One block of SP_WALK_THREADS; n <= 256 nodes.
#define SP_WALK_THREADS 256
extern "C" __global__ void __launch_bounds__(SP_WALK_THREADS)
node_accept_walk(const int* __restrict__ tokens, const int* __restrict__ parents, const float* __restrict__ win_value,
                 const int* __restrict__ win_id, int tp, int n, int* target, int* accepted, int* count, int* bonus) {
    __shared__ int s_dep[256];
    pdl_wait();
    for (int i = threadIdx.x; i < n; i += SP_WALK_THREADS) {
        float best = win_value[i];
        int who = win_id[i];
        for (int r = 1; r < tp; ++r) {
            const float v = win_value[r * n + i];
            const int g = win_id[r * n + i];
            if (v > best || (v == best && g < who)) { best = v; who = g; }
        }
        target[i] = who;
        int dep = 0;
        for (int j = i; j > 0 && dep < n; j = parents[j]) ++dep;
        s_dep[i] = dep;
    }
    __threadfence();                                     // target is read back past L1 (accept_walk's ld.cg)
    __syncthreads();
    accept_walk(target, tokens, parents, s_dep, n, accepted, count, bonus);
    pdl_trigger();
}
