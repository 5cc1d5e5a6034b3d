// Shared by sample.cu and sample_top_p.cu: the sampling parameter record, per-row state, the pruned
// Gumbel-max loop and the acceptance walk (ddtree/tree/walk.py).
#pragma once
#include "select.cuh"
#include "top_p_fixed.cuh"

#define SP_THREADS 512
#define SP_ITEMS 32
#define SP_SLICE (SP_THREADS * SP_ITEMS)
#define SP_CAND 256                      // the largest top_k (candidates per slice of sample_filtered)
#define SP_MERGED 512                    // merge buffer (>= SP_CAND + 1, a power of two)
#define SP_MAX_LIST_KEYS 3072            // S * C keys of one row, merged in registers (6 per thread)
#define SP_BINS TP_BINS                  // top-p: probability mass per 1/128 of z below the top
#define SP_MAX_BIN_KEYS 4096             // tokens of the crossing bin sorted in shared memory
#define SP_STATUS_NAN_TARGET 2
#define SP_STATUS_BIN_OVERFLOW 4         // a crossing bin held more tokens than SP_MAX_BIN_KEYS
#define SP_STATUS_WRONG_MODE 8           // a mode's kernels ran with the parameters of another mode
#define SP_STATUS_INEXACT 16             // a top-p cut within the certified bound of top_p (top_p_bins.py)

// The sampling parameters in device memory (written by TreeSampler.set_params between graph replays, never
// a kernel argument: a captured graph reads whatever the record holds at replay). The launcher normalises
// top_k (0 < top_k < V, else 0); candidates = C, the keys per slice of sample_filtered (0 for greedy and
// plain Gumbel). numpy twin: tree_sample.py SAMPLE_PARAMS_DTYPE (natural alignment, no padding: offsets
// 0, 8, 16, 20, 24, 28; tests/plugins/test_tree_plans.py reads this declaration and checks the twin).
struct SampleParamsDev {
    double temperature, top_p;
    int top_k, candidates;
    u32 seed_lo, seed_hi;
};
static_assert(sizeof(SampleParamsDev) == 32, "SampleParamsDev layout");

struct SampleArgs {                      // the record as the kernels use it
    double temperature, top_p;
    int top_k, candidates;
    u32 seed_lo, seed_hi;
    float inv_t32, inv_t_lo;             // 1/T as a float pair (hi, lo): top-p weights (top_p_fixed.cuh)
};
// Every sampling kernel takes the record's address; SP_MAKE_ARGS reads it after griddepcontrol.wait.
#define SP_ARGS const SampleParamsDev* __restrict__ params
#define SP_MAKE_ARGS const SampleParamsDev sp = *params; \
    const SampleArgs a{sp.temperature, sp.top_p, sp.top_k, sp.candidates, sp.seed_lo, sp.seed_hi, \
                       (float)(1.0 / sp.temperature), \
                       (float)(1.0 / sp.temperature - (double)(float)(1.0 / sp.temperature))}

// Modes (the launcher's plan; the kernels a graph holds): greedy T = 0; plain Gumbel T > 0, C = 0;
// top-k (sample_filtered) T > 0, C = top_k > 0; top-p alone (sample_top_p.cu) T > 0, C > 0, top_k == 0.
// A record of another mode raises SP_STATUS_WRONG_MODE (block (0, 0) checks; check_status reports it).
#define SP_GREEDY 0
#define SP_GUMBEL 1
#define SP_TOP_K 2
#define SP_TOP_P 3
__device__ __forceinline__ void check_mode(const SampleParamsDev& p, int mode, int* status) {
    if (blockIdx.x | blockIdx.y | threadIdx.x) return;
    const bool ok = mode == SP_GREEDY ? p.temperature == 0.0
                  : mode == SP_GUMBEL ? p.temperature > 0.0 && p.candidates == 0
                  : p.temperature > 0.0 && p.candidates > 0 && (p.top_k == 0) == (mode == SP_TOP_P);
    if (!ok) atomicOr(status, SP_STATUS_WRONG_MODE);
}

// Per-row state of top-p alone (sample_top_p.cu): sample_mass's decision, then sample_kept's cut.
// numpy twin: tree_sample.py ROW_STATE_DTYPE (tests read it back).
struct RowState {
    float l_top;                         // the row's largest logit
    int bin;                             // the crossing bin b*: kept = bins < b*, and a key-order prefix of b*
    double above, norm;                  // mass of the bins < b*, and of the whole row (units of exp(0))
    double err_above, err_below;         // error bounds of the masses of the bins < b* and > b*
    u64 cut_key;                         // the last kept key of b* (0 when b* overflowed)
    u32 kept, flags;                     // tokens kept; SP_STATUS_INEXACT / SP_STATUS_BIN_OVERFLOW of this row
};
static_assert(sizeof(RowState) == 56, "RowState layout");

// Best z + g over the tokens `take(v)` accepts among lo, lo + stride, .. < hi; float64 only where the
// float32 estimate (gumbel32) can still win. Ascending v: equal values keep the lower id.
template <typename Take>
__device__ Winner gumbel_best(const float* row, int lo, int hi, int stride, u32 position, const SampleArgs& a,
                              Take take) {
    const float inv_t32 = 1.0f / (float)a.temperature;
    Winner best{DD_NEG_INF, 0x7fffffff};
#pragma unroll 4
    for (int v = lo; v < hi; v += stride) {
        const float l = row[v];
        if (!take(v, l)) continue;
        const float z32 = l * inv_t32;
        const float margin = DD_GUMBEL_MARGIN(z32);
        if ((double)(z32 + DD_GUMBEL_MAX + margin) < best.value) continue;       // cannot win at any noise
        const u32 x = philox_word0(position, (u32)v, a.seed_lo, a.seed_hi);
        if ((double)(z32 + gumbel32(x) + margin) < best.value) continue;
        const double value = (double)l / a.temperature + gumbel64(x);
        if (value > best.value || best.id == 0x7fffffff) best = Winner{value, v};
    }
    return best;
}

// A slice's Gumbel winner -> slice_wins [n, S]; the row's last slice merges the row's S winners (larger
// value, ties to the lower id) and returns true, with `token` the row's token. All threads call it.
__device__ bool row_winner(Winner w, Winner* slice_wins, int r, int s, int S, u32* row_tickets, Winner* scratch,
                           int& token) {
    w = block_winner(w, scratch);
    if (threadIdx.x == 0) slice_wins[r * S + s] = w;
    if (!arrive_last(row_tickets + r, (u32)S)) return false;
    Winner best{DD_NEG_INF, 0x7fffffff};
    for (int i = threadIdx.x; i < S; i += blockDim.x) {
        const volatile Winner* p = slice_wins + r * S + i;      // written by the row's other blocks
        best = better(best, Winner{p->value, p->id});
    }
    token = block_winner(best, scratch).id;
    return true;
}

// The acceptance walk over n nodes (all target tokens written): accepted [n] node indices in depth order
// then -1, count [1], bonus [1]. Children of a node carry distinct tokens (distinct top-k ranks), so at
// most one child matches; the matched nodes whose ancestors all match form the accepted path. The tree is
// copied to shared memory first: the ancestor chains are dependent loads.
__device__ void accept_walk(const int* target, const int* tokens, const int* parents, const int* depth, int n,
                            int* accepted, int* count, int* bonus) {
    __shared__ short par[256];
    __shared__ unsigned char match[256], dep[256];
    __shared__ int tgt[256], s_path[256], s_depth;
    if (threadIdx.x == 0) s_depth = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        tgt[i] = ld_cg_s32(target + i);
        par[i] = (short)parents[i];
        dep[i] = (unsigned char)depth[i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        match[i] = i == 0 || (tokens[i] >= 0 && par[i] >= 0 && tokens[i] == tgt[par[i]]);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        bool on_path = true;
        for (int j = i; j > 0 && on_path; j = par[j]) on_path = match[j];
        if (on_path) {
            s_path[dep[i]] = i;
            atomicMax(&s_depth, dep[i]);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) accepted[i] = i <= s_depth ? s_path[i] : -1;
    if (threadIdx.x == 0) {
        *count = s_depth + 1;
        *bonus = tgt[s_path[s_depth]];
    }
}

// Walk pointers (tokens == null: plain sampling, no walk)
struct WalkArgs { const int *tokens, *parents, *depth; int *accepted, *count, *bonus; };
#define SP_WALK_ARGS const int* tokens, const int* parents, const int* depth, int* accepted, int* count, \
    int* bonus, u32* row_tickets, u32* done_ticket
#define SP_WALK WalkArgs{tokens, parents, depth, accepted, count, bonus}

// The last block of the whole grid (all n rows' tokens written) walks the tree.
__device__ __forceinline__ void walk_if_last(u32* done_ticket, u32 blocks, const int* target, int n, WalkArgs w) {
    if (arrive_last(done_ticket, blocks) && w.tokens)
        accept_walk(target, w.tokens, w.parents, w.depth, n, w.accepted, w.count, w.bonus);
}
