// Top-p over the whole vocabulary for rows whose candidates (sample.cu sample_filtered) did not reach
// top_p, e.g. flat distributions that need thousands of tokens. Both kernels run on grid (S, n) and
// return at once for rows that do not need them. Launcher: ddtree/plugins/tree_sample.py.
//
//   sample_mass  each slice adds its tokens' probabilities (float64, the weights of sample_filtered) into
//                4096 bins of z below the row's top (1/128 wide, monotone in the logit). The last slice of
//                the row finds the bin where the cumulative probability reaches top_p, sorts that bin's
//                tokens (key order = probability desc, id asc) and finds the exact cut in it.
//   sample_kept  Gumbel-max over the kept tokens (bins above the cut bin, and the cut bin's prefix); the
//                last slice writes the row's token; the last block of all walks the tree.
//
// Bin masses are fixed point (probability x 2^60 in u64, rounded per token): integer atomics are exact in
// any order, so the result is deterministic; the rounding (<= 2^-61 per token, < 1e-13 for the row) can
// change the kept set only when the cumulative probability lands that close to top_p (a near-tie).
// A cut bin with more than 2048 tokens (2048 logits within 1/128 of z of each other) is kept whole and
// raises SP_STATUS_BIN_OVERFLOW: the launcher's check_status reports it as inexact.
#include "sample_common.cuh"

#define SP_MASS_ONE 1152921504606846976.0          // 2^60: fixed-point unit of probability

union MassSmem {
    u64 hist[SP_BINS];
    double mass[SP_BINS];
    struct { u64 keys[SP_MAX_BIN_KEYS]; double prob[SP_MAX_BIN_KEYS]; } bin;
};

// mass [n, SP_BINS] u64 fixed point, zero before the first launch (the row's last block clears it after use)
extern "C" __global__ void __launch_bounds__(SP_THREADS)
sample_mass(const float* __restrict__ logits, int V, SP_ARGS, RowState* __restrict__ state, u64* __restrict__ mass,
            int* status, u32* row_tickets) {
    __shared__ __align__(16) MassSmem sm;
    __shared__ double s_above;
    __shared__ int s_bin, s_count, s_cut;
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x;
    pdl_wait();
    SP_MAKE_ARGS;
    if (!state[r].needs_full_row) { pdl_trigger(); return; }
    const float l_top = state[r].l_top;
    const double norm = state[r].norm, to_fixed = SP_MASS_ONE / norm;
    const float scale = SP_BINS_PER_UNIT / (float)a.temperature;
    const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V;
    for (int i = threadIdx.x; i < SP_BINS; i += SP_THREADS) sm.hist[i] = 0;
    __syncthreads();
#pragma unroll 8
    for (int v = lo + threadIdx.x; v < hi; v += SP_THREADS) {
        const float l = row[v];
        float tail = 0.f;
        const double e = softmax_weight(l, l_top, a, tail) + (double)tail;
        atomicAdd(&sm.hist[mass_bin(l, l_top, scale)], (u64)__double2ull_rn(e * to_fixed));
    }
    __syncthreads();
    u64* row_mass = mass + (size_t)r * SP_BINS;
    for (int i = threadIdx.x; i < SP_BINS; i += SP_THREADS)
        if (sm.hist[i]) atomicAdd(row_mass + i, sm.hist[i]);
    if (!arrive_last(row_tickets + r, (u32)S)) { pdl_trigger(); return; }
    // ---- the row: the bin where the cumulative probability reaches top_p ----
    for (int i = threadIdx.x; i < SP_BINS; i += SP_THREADS) {
        sm.mass[i] = (double)ld_cg_u64(row_mass + i) / SP_MASS_ONE;
        row_mass[i] = 0;                                     // ready for the next step
    }
    __syncthreads();
    if (threadIdx.x < 32) {                                  // lane l: bins [128 l, 128 l + 128)
        const int lane = threadIdx.x, per = SP_BINS / 32;
        double sum = 0.0;
        for (int b = 0; b < per; ++b) sum += sm.mass[lane * per + b];
        double incl = sum;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const double x = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += x;
        }
        const u32 crossing = __ballot_sync(0xffffffffu, incl >= a.top_p);
        if (lane == 0) s_bin = -1;
        __syncwarp();
        if (crossing && lane == __ffs(crossing) - 1) {
            double above = incl - sum;
            for (int b = 0; b < per; ++b) {
                const double m = sm.mass[lane * per + b];
                if (above + m >= a.top_p) { s_bin = lane * per + b; s_above = above; break; }
                above += m;
            }
        }
    }
    if (threadIdx.x == 0) s_count = 0;
    __syncthreads();
    const int bin = s_bin;
    if (bin < 0) {                                           // never reached (rounding): keep every token
        if (threadIdx.x == 0) state[r].keep_all = 1;
        pdl_trigger();
        return;
    }
    // ---- the cut bin's tokens, sorted, and the exact cut among them ----
#pragma unroll 8
    for (int v = threadIdx.x; v < V; v += SP_THREADS) {
        const float l = row[v];
        if (mass_bin(l, l_top, scale) != bin) continue;
        const int slot = atomicAdd(&s_count, 1);
        if (slot < SP_MAX_BIN_KEYS) sm.bin.keys[slot] = pack_key(l, v);
    }
    __syncthreads();
    const int count = s_count;
    if (count > SP_MAX_BIN_KEYS) {
        if (threadIdx.x == 0) { atomicOr(status, SP_STATUS_BIN_OVERFLOW); state[r].bin = bin; state[r].key_cut = 1; }
        pdl_trigger();
        return;
    }
    const int n_pad = pow2_at_least(count);
    for (int i = count + threadIdx.x; i < n_pad; i += SP_THREADS) sm.bin.keys[i] = 0;
    __syncthreads();
    block_sort_desc<SP_THREADS>(sm.bin.keys, n_pad);
    for (int i = threadIdx.x; i < count; i += SP_THREADS) {  // probabilities in parallel, summed in order
        float tail = 0.f;
        sm.bin.prob[i] = (softmax_weight(key_value(sm.bin.keys[i]), l_top, a, tail) + (double)tail) / norm;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double cum = s_above;
        int cut = count - 1;                                 // not reached inside the bin (rounding): all of it
        for (int i = 0; i < count; ++i) {
            cum += sm.bin.prob[i];
            if (cum >= a.top_p) { cut = i; break; }
        }
        state[r].bin = bin;
        state[r].key_cut = sm.bin.keys[cut];
    }
    pdl_trigger();
}

extern "C" __global__ void __launch_bounds__(SP_THREADS)
sample_kept(const float* __restrict__ logits, int V, const int* __restrict__ query_pos, SP_ARGS,
            RowState* __restrict__ state, Winner* __restrict__ slice_wins, int* __restrict__ target, SP_WALK_ARGS) {
    __shared__ Winner scratch[32];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x, n = gridDim.y;
    pdl_wait();
    SP_MAKE_ARGS;
    const RowState st = state[r];
    if (st.needs_full_row) {
        const float scale = SP_BINS_PER_UNIT / (float)a.temperature;
        const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
        Winner w = gumbel_best(logits + (size_t)r * V, lo + threadIdx.x, hi, SP_THREADS, (u32)query_pos[r] + 1u, a,
                               [&](int v, float l) {
            if (st.keep_all) return true;
            const int b = mass_bin(l, st.l_top, scale);
            return b < st.bin || (b == st.bin && pack_key(l, v) >= st.key_cut);
        });
        int token;
        if (row_winner(w, slice_wins, r, s, S, row_tickets, scratch, token) && threadIdx.x == 0) {
            target[r] = token;
            state[r] = RowState{};
        }
    }
    walk_if_last(done_ticket, (u32)(S * n), target, n, SP_WALK);
    pdl_trigger();
}
