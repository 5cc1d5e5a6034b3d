// Top-p without top-k: three kernels on grid (S, n), float32 per token, float64 per bin and at the cut.
// Launcher: ddtree/plugins/tree_sample.py. numpy twin of the decision and its bound:
// ddtree/plugins/top_p_bins.py (the derivation is its docstring). The device functions (bins, decision, lazy
// Gumbel, the slice pass, the cut) are top_p_common.cuh's, shared with sample_top_p_ranks.cu.
//
//   sample_row_max  each slice's largest logit (and the NaN check); 256-thread blocks.
//   sample_mass     every token's F = round(exp(r) 2^35) (top_p_fixed.cuh: float32, no float64) into its
//                   bin (1/128 of z below the row's top) by two u32 shared atomics (hi, lo: exact sums),
//                   then 64-bit global adds per bin. The row's last slice block: bin masses
//                   M_b = s_b F_b 2^-35 (s_b = exp(-b/128), a float64 table), the first bin whose
//                   cumulative mass reaches top_p x norm (b*), and the error bounds of the masses above and
//                   below it -> RowState.
//   sample_kept     Gumbel-max over the tokens of the bins above b* (and, apart, over b*'s), b*'s tokens
//                   gathered (each warp queues its kept tokens and runs the Gumbel 32 at a time;
//                   lazy_consider: float32 bounds, float64 only where two overlap, and once a lane at the end);
//                   the row's last slice block sorts them into key order (logit desc, id asc:
//                   the definition's order), sums their F along it (exact) and cuts at the first whose
//                   cumulative reaches top_p x norm; certify() says whether that is the definition's cut
//                   whatever the roundings; Gumbel-max over the kept prefix decides the row's token. The
//                   last block of all walks the tree.
//
// Diagnosis builds (tests/plugins/profile_top_p.py ... stamps): -D DD_PROFILE=1 sums each phase's clock64
// cycles (thread 0, after a barrier) over the blocks into sp_prof[] (slots: SP_PROF_*); -D SP_ABLATE=1 drops the
// Gumbel of sample_kept's slice loop, =2 its last block's cut (both: wrong tokens, for timing only).
//
// Uncertified cuts are kept and flagged SP_STATUS_INEXACT (RowState.flags and the status word: the
// launcher's check_status raises unless told to allow it); a crossing bin of more than SP_MAX_BIN_KEYS
// tokens is kept whole and flagged SP_STATUS_BIN_OVERFLOW. Letters: n rows, V vocab, S slices.
#include "top_p_common.cuh"


// logits [n, V] -> slice_max [n, S]
extern "C" __global__ void __launch_bounds__(SP_MAX_THREADS)
sample_row_max(const float* __restrict__ logits, int V, SP_ARGS, float* __restrict__ slice_max, int* status) {
    __shared__ float scratch[32];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x;
    const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V;
    pdl_wait();
    check_mode(*params, SP_TOP_P, status);
    const float m = slice_max_of(row, lo, hi, status, scratch);
    if (threadIdx.x == 0) slice_max[r * S + s] = m;
    pdl_trigger();
}
// The row's crossing bin from its global bins (the row's last slice block), which it clears for the next launch.
__device__ void mass_decide(u64* row_mass, const double* bin_scale, const SampleArgs& a, int V, float l_top,
                            RowState* state) {
    constexpr int PER = SP_BINS / SP_THREADS;
    SP_CLOCK(t_start);
    u64 F[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) F[j] = ld_cg_u64(row_mass + threadIdx.x * PER + j);   // all in flight
#pragma unroll
    for (int j = 0; j < PER; ++j) row_mass[threadIdx.x * PER + j] = 0;                   // ready for the next launch
#ifdef DD_PROFILE
#pragma unroll
    for (int j = 0; j < PER; ++j) asm volatile("" :: "l"(F[j]));                       // the loads landed
    SP_CLOCK(t_loaded);
    SP_PROF(SP_PROF_DECIDE_LOADS, t_start, t_loaded);
#endif
    decide_bins(F, bin_scale, a, V, l_top, state);
}

// slice_max [n, S] (sample_row_max) -> state [n]; mass [n, SP_BINS] u64, zero before the first launch (the
// row's last block clears it); bin_scale [SP_BINS] float64 exp(-b / 128)
extern "C" __global__ void __launch_bounds__(SP_THREADS)
sample_mass(const float* __restrict__ logits, int V, SP_ARGS, const float* __restrict__ slice_max,
            const double* __restrict__ bin_scale, RowState* __restrict__ state, u64* __restrict__ mass,
            u32* row_tickets) {
    __shared__ u32 hist_hi[SP_BINS], hist_lo[SP_BINS];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x;
    const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V;
    SP_CLOCK(t_start);
    float vals[SP_ITEMS];                                    // written two launches back: loaded before the wait
#pragma unroll
    for (int j = 0; j < SP_ITEMS; ++j) {
        const int v = lo + j * SP_THREADS + threadIdx.x;
        vals[j] = v < hi ? ld_cg_f32(row + v) : DD_NEG_INF;
    }
    for (int i = threadIdx.x; i < SP_BINS; i += SP_THREADS) { hist_hi[i] = 0u; hist_lo[i] = 0u; }
    pdl_wait();
    SP_MAKE_ARGS;
    float l_top = DD_NEG_INF;
    for (int i = 0; i < S; ++i) l_top = fmaxf(l_top, slice_max[r * S + i]);
    SP_CLOCK(t_loaded);
    __syncthreads();
    mass_tokens(vals, l_top, a, hist_hi, hist_lo);                // per block and bin: hi < 2^31, lo < 2^32
    SP_CLOCK(t_tokens);
    __syncthreads();
    u64* row_mass = mass + (size_t)r * SP_BINS;
    mass_flush(hist_hi, hist_lo, row_mass);
    SP_CLOCK(t_flushed);
    SP_PROF(SP_PROF_MASS_LOAD, t_start, t_loaded);
    SP_PROF(SP_PROF_MASS_TOKENS, t_loaded, t_tokens);
    SP_PROF(SP_PROF_MASS_FLUSH, t_tokens, t_flushed);
    SP_PROF(SP_PROF_MASS_BLOCKS, 0, 1);
    pdl_trigger();                                   // sample_kept's blocks may start (they wait for this grid)
    if (arrive_last(row_tickets + r, (u32)S)) {
        SP_CLOCK(t_decide);
        mass_decide(row_mass, bin_scale, a, V, l_top, state + r);
        SP_CLOCK(t_decided);
        SP_PROF(SP_PROF_MASS_DECIDE, t_decide, t_decided);
        SP_PROF(SP_PROF_MASS_LAST, 0, 1);
    }
}

// The row's cut and token (its last slice block of sample_kept). row_counts [2 n]: the crossing bin's
// tokens gathered, the tokens kept above it (both cleared here).
__device__ void kept_row(const RowState& st, int r, int S, int V, u32 position, const SampleArgs& a,
                         const double* bin_scale, const Winner* slice_wins, const u64* keys_in, u32* row_counts,
                         RowState* state, int* target, int* status, u32* full_row_rows, u32* inexact_rows,
                         u64* keys /* shared [SP_MAX_BIN_KEYS] */) {
    __shared__ Winner wscratch[32];
    __shared__ int s_count;
    __shared__ u32 s_kept_above;
    if (threadIdx.x == 0) {
        s_count = ld_cg_s32((const int*)row_counts + 2 * r);
        s_kept_above = (u32)ld_cg_s32((const int*)row_counts + 2 * r + 1);
        row_counts[2 * r] = 0u;                              // the row's other blocks are done with them
        row_counts[2 * r + 1] = 0u;
    }
    SP_CLOCK(t_start);
    Winner w_above{DD_NEG_INF, 0x7fffffff}, w_bin{DD_NEG_INF, 0x7fffffff};
    for (int i = threadIdx.x; i < S; i += SP_THREADS) {      // written by the row's other blocks: past L1
        const volatile Winner* p = slice_wins + 2 * (r * S + i);
        w_above = better(w_above, Winner{p[0].value, p[0].id});
        w_bin = better(w_bin, Winner{p[1].value, p[1].id});
    }
    w_above = block_winner(w_above, wscratch);
    w_bin = block_winner(w_bin, wscratch);
    const int count = s_count;
    Winner token = w_above;
    u32 kept = s_kept_above, flags = 0u;
    u64 cut_key = 0ull;
    SP_CLOCK(t_wins);
    SP_PROF(SP_PROF_ROW_WINS, t_start, t_wins);
    if (SP_ABLATE == 2) {
    } else if (count > SP_MAX_BIN_KEYS) {                           // kept whole: not the definition's cut
        token = better(w_above, w_bin);
        kept += (u32)count;
        flags = SP_STATUS_BIN_OVERFLOW;
    } else if (count > 0) {                                  // (0 only for rows without a finite top: NaN)
        const int n_pad = pow2_at_least(count);
        for (int i = threadIdx.x; i < n_pad; i += SP_THREADS) keys[i] = i < count ? ld_cg_u64(keys_in + i) : 0ull;
        const BinCut c = bin_cut(st, count, V, position, a, bin_scale, w_above, keys, wscratch);
        token = c.token;
        kept += (u32)(c.cut + 1);
        cut_key = c.cut_key;
        flags = c.flags;
    }
    SP_PROF(SP_PROF_ROW_LAST, 0, 1);
    if (threadIdx.x == 0) {
        target[r] = token.id == 0x7fffffff ? 0 : token.id;
        state[r].cut_key = cut_key;
        state[r].kept = kept;
        state[r].flags = flags;
        if (flags) {
            atomicOr(status, (int)flags);
            atomicAdd(inexact_rows, 1u);
        }
        if (kept > SP_CAND) atomicAdd(full_row_rows, 1u);    // more than the old candidate path could hold
    }
}

// state [n] (sample_mass) -> target [n]; slice_wins [n, S, 2] (above the bin, in it); bin_keys [n,
// SP_MAX_BIN_KEYS]; row_counts [2 n] zero before the first launch; full_row_rows / inexact_rows: running
// counts of rows that kept more than SP_CAND tokens / were flagged (diagnostics)
extern "C" __global__ void __launch_bounds__(SP_THREADS, 2)     // 2 blocks an SM: <= 64 registers
sample_kept(const float* __restrict__ logits, int V, const int* __restrict__ query_pos, SP_ARGS,
            const double* __restrict__ bin_scale, RowState* __restrict__ state, Winner* __restrict__ slice_wins,
            u64* __restrict__ bin_keys, u32* __restrict__ row_counts, int* __restrict__ target, int* status,
            u32* full_row_rows, u32* inexact_rows, SP_WALK_ARGS) {
    __shared__ Winner scratch[32];
    __shared__ u64 smem[SP_MAX_BIN_KEYS];        // the warps' queues (slice loop), then the last block's keys
    static_assert(SP_THREADS / 32 * SP_QUEUE * 4 <= SP_MAX_BIN_KEYS * 8, "queues fit the keys buffer");
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x, n = gridDim.y;
    const int lo = s * SP_SLICE, hi = min(V, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V;
    SP_CLOCK(t_start);
    pdl_wait();
    SP_MAKE_ARGS;
    const RowState st = state[r];
    const u32 position = (u32)query_pos[r] + 1u;
    u64* keys_out = bin_keys + (size_t)r * SP_MAX_BIN_KEYS;
    const int lane = threadIdx.x & 31;
    u32* queue = (u32*)smem + (threadIdx.x >> 5) * SP_QUEUE;    // ids (bit 31: in the crossing bin)
    Lazy above = SP_LAZY_NONE, in_bin = SP_LAZY_NONE;
    SP_CLOCK(t_loop);
    u32 kept = kept_slice(row, lo, hi, 0, st, position, a, row_counts + 2 * r, keys_out, queue, above, in_bin);
    SP_CLOCK(t_looped);
#pragma unroll
    for (int o = 16; o; o >>= 1) kept += __shfl_xor_sync(0xffffffffu, kept, o);
    if (lane == 0 && kept) atomicAdd(row_counts + 2 * r + 1, kept);
    Winner w_above, w_bin;
    lazy_block_finish2(above, in_bin, position, a, w_above, w_bin, scratch);
    if (threadIdx.x == 0) {
        slice_wins[2 * (r * S + s)] = w_above;
        slice_wins[2 * (r * S + s) + 1] = w_bin;
    }
    SP_CLOCK(t_merged);
    SP_PROF(SP_PROF_KEPT_WAIT, t_start, t_loop);
    SP_PROF(SP_PROF_KEPT_LOOP, t_loop, t_looped);
    SP_PROF(SP_PROF_KEPT_MERGE, t_looped, t_merged);
    SP_PROF(SP_PROF_KEPT_BLOCKS, 0, 1);
    pdl_trigger();                                   // the next launch's blocks may start (they wait for this grid)
    if (arrive_last(row_tickets + r, (u32)S))
        kept_row(st, r, S, V, position, a, bin_scale, slice_wins, keys_out, row_counts, state, target, status,
                 full_row_rows, inexact_rows, smem);
    walk_if_last(done_ticket, (u32)(S * n), target, n, SP_WALK);
}
