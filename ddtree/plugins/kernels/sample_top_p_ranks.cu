// Top-p without top-k over a vocab split across tp ranks: each rank runs these kernels on its logits slice
// [n, V_r] (first global id `offset`) and all-gathers between them (the launcher: ddtree/plugins/top_p_ranks_gpu.py,
// the protocol and its numpy twin: ddtree/plugins/top_p_ranks.py). Every rank decides what one rank holding the
// whole row decides (sample_top_p.cu: the same device functions, top_p_common.cuh) and ends with the same tokens.
//
//   topp_ranks_max     grid (S, n): the slice's largest logit (NaN check, mode check); the row's last slice block
//                      writes the rank's row maximum -> row_max [n]                   [all-gather -> [tp, n]]
//   topp_ranks_mass    grid (S, n): l_top = the max over the ranks; every token's F into its bin (shared u32
//                      halves), 64-bit global adds -> rank_mass [n, SP_BINS]          [all-gather -> [tp, n, BINS]]
//   topp_ranks_decide  grid (n): the ranks' bins summed in rank order (integers: exact, the single rank's sums),
//                      the crossing bin b*, the masses and bounds -> state [n]; clears rank_mass
//   topp_ranks_scan    grid (S, n): the slice's Gumbel winners above b* and in b* and b*'s keys (global ids) into
//                      the row's record; the row's last slice block merges the slices' winners into it
//                      -> records [n] RankRow                                          [all-gather -> [tp, n]]
//   topp_ranks_cut     grid (n): the ranks' b* keys (at most SP_MAX_BIN_KEYS in all, else the bin is kept whole
//                      and flagged BIN_OVERFLOW) sorted, cut and certified as on one rank, the Gumbel winner of
//                      the kept prefix merged with every rank's winner above b* -> tokens [n], flags [n], state;
//                      clears the rank's records for the next launch
// Letters: n rows, V the whole vocab, V_r this rank's slice, S its slices of SP_SLICE, tp ranks.
#include "top_p_common.cuh"

#define SPR_MAX_RANKS 64                 // tp (the launcher checks it)

// A row's exchanged record (one per rank and row). Winners hold global ids; keys pack_key(l, global id).
struct RankRow {
    Winner above, in_bin;            // the rank's Gumbel winners over its tokens above b* and in b*
    u32 count, kept_above;           // the rank's tokens in b* (keys past SP_MAX_BIN_KEYS not stored), above b*
    u32 pad[2];
    u64 keys[SP_MAX_BIN_KEYS];
};
static_assert(sizeof(RankRow) == 48 + 8 * SP_MAX_BIN_KEYS, "RankRow layout (top_p_ranks_gpu.py RECORD_BYTES)");

// logits [n, V_r] -> slice_max [n, S] -> row_max [n]; row_tickets [n] zero (reset by the last block)
extern "C" __global__ void __launch_bounds__(SP_MAX_THREADS)
topp_ranks_max(const float* __restrict__ logits, int V_r, SP_ARGS, float* __restrict__ slice_max,
               float* __restrict__ row_max, u32* row_tickets, int* status) {
    __shared__ float scratch[32];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x;
    const int lo = s * SP_SLICE, hi = min(V_r, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V_r;
    pdl_wait();
    check_mode(*params, SP_TOP_P, status);
    const float m = slice_max_of(row, lo, hi, status, scratch);
    if (threadIdx.x == 0) slice_max[r * S + s] = m;
    if (arrive_last(row_tickets + r, (u32)S) && threadIdx.x == 0) {
        float top = DD_NEG_INF;
        for (int i = 0; i < S; ++i) top = fmaxf(top, ld_cg_f32(slice_max + r * S + i));
        row_max[r] = top;
    }
    pdl_trigger();
}

// The row's top over the ranks: all_max [tp, n] (the gathered row maxima).
__device__ __forceinline__ float ranks_top(const float* all_max, int tp, int n, int r) {
    float top = DD_NEG_INF;
    for (int t = 0; t < tp; ++t) top = fmaxf(top, all_max[t * n + r]);
    return top;
}

// all_max [tp, n] -> rank_mass [n, SP_BINS] u64 (zero before: topp_ranks_decide clears it)
extern "C" __global__ void __launch_bounds__(SP_THREADS)
topp_ranks_mass(const float* __restrict__ logits, int V_r, SP_ARGS, const float* __restrict__ all_max, int tp,
                u64* __restrict__ rank_mass) {
    __shared__ u32 hist_hi[SP_BINS], hist_lo[SP_BINS];
    const int s = blockIdx.x, r = blockIdx.y, n = gridDim.y;
    const int lo = s * SP_SLICE, hi = min(V_r, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V_r;
    for (int i = threadIdx.x; i < SP_BINS; i += SP_THREADS) { hist_hi[i] = 0u; hist_lo[i] = 0u; }
    pdl_wait();
    float vals[SP_ITEMS];
#pragma unroll
    for (int j = 0; j < SP_ITEMS; ++j) {
        const int v = lo + j * SP_THREADS + threadIdx.x;
        vals[j] = v < hi ? row[v] : DD_NEG_INF;
    }
    SP_MAKE_ARGS;
    const float l_top = ranks_top(all_max, tp, n, r);
    __syncthreads();
    mass_tokens(vals, l_top, a, hist_hi, hist_lo);
    __syncthreads();
    mass_flush(hist_hi, hist_lo, rank_mass + (size_t)r * SP_BINS);
    pdl_trigger();
}

// all_mass [tp, n, SP_BINS] -> state [n]; clears rank_mass [n, SP_BINS] (gathered already). V: the whole row's.
extern "C" __global__ void __launch_bounds__(SP_THREADS)
topp_ranks_decide(SP_ARGS, const float* __restrict__ all_max, const u64* __restrict__ all_mass, int tp, int V,
                  const double* __restrict__ bin_scale, u64* __restrict__ rank_mass, RowState* __restrict__ state) {
    constexpr int PER = SP_BINS / SP_THREADS;
    const int r = blockIdx.x, n = gridDim.x;
    pdl_wait();
    SP_MAKE_ARGS;
    u64 F[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) F[j] = 0ull;
    for (int t = 0; t < tp; ++t) {                                // rank order (integers: any order is exact)
        const u64* part = all_mass + ((size_t)t * n + r) * SP_BINS + threadIdx.x * PER;
#pragma unroll
        for (int j = 0; j < PER; ++j) F[j] += part[j];
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) rank_mass[(size_t)r * SP_BINS + threadIdx.x * PER + j] = 0ull;
    decide_bins(F, bin_scale, a, V, ranks_top(all_max, tp, n, r), state + r);
    pdl_trigger();
}

// state [n] -> records [n] RankRow (count, kept_above zero before: topp_ranks_cut clears them); slice_wins
// [n, S, 2]; row_tickets [n] zero. offset: this rank's first global id; query_pos [n]: position query_pos + 1.
extern "C" __global__ void __launch_bounds__(SP_THREADS, 2)
topp_ranks_scan(const float* __restrict__ logits, int V_r, int offset, const int* __restrict__ query_pos, SP_ARGS,
                const RowState* __restrict__ state, Winner* __restrict__ slice_wins, RankRow* __restrict__ records,
                u32* row_tickets) {
    __shared__ Winner scratch[32];
    __shared__ u32 queues[SP_THREADS / 32 * SP_QUEUE];
    const int s = blockIdx.x, r = blockIdx.y, S = gridDim.x;
    const int lo = s * SP_SLICE, hi = min(V_r, lo + SP_SLICE);
    const float* row = logits + (size_t)r * V_r;
    pdl_wait();
    SP_MAKE_ARGS;
    const RowState st = state[r];
    const u32 position = (u32)query_pos[r] + 1u;
    RankRow* rec = records + r;
    const int lane = threadIdx.x & 31;
    Lazy above = SP_LAZY_NONE, in_bin = SP_LAZY_NONE;
    u32 kept = kept_slice(row, lo, hi, offset, st, position, a, &rec->count, rec->keys,
                          queues + (threadIdx.x >> 5) * SP_QUEUE, above, in_bin);
#pragma unroll
    for (int o = 16; o; o >>= 1) kept += __shfl_xor_sync(0xffffffffu, kept, o);
    if (lane == 0 && kept) atomicAdd(&rec->kept_above, kept);
    Winner w_above, w_bin;
    lazy_finish2(above, in_bin, position, a, w_above, w_bin);
    w_above = block_winner(w_above, scratch);
    w_bin = block_winner(w_bin, scratch);
    if (threadIdx.x == 0) {
        slice_wins[2 * (r * S + s)] = w_above;
        slice_wins[2 * (r * S + s) + 1] = w_bin;
    }
    if (arrive_last(row_tickets + r, (u32)S)) {
        w_above = w_bin = Winner{DD_NEG_INF, 0x7fffffff};
        for (int i = threadIdx.x; i < S; i += SP_THREADS) {       // written by the row's other blocks: past L1
            const volatile Winner* p = slice_wins + 2 * (r * S + i);
            w_above = better(w_above, Winner{p[0].value, p[0].id});
            w_bin = better(w_bin, Winner{p[1].value, p[1].id});
        }
        w_above = block_winner(w_above, scratch);
        w_bin = block_winner(w_bin, scratch);
        if (threadIdx.x == 0) {
            rec->above = w_above;
            rec->in_bin = w_bin;
        }
    }
    pdl_trigger();
}

// all_records [tp, n] RankRow -> tokens [n] (global ids), flags [n], state[n].cut_key / kept / flags; status |=
// flags, inexact_rows += flagged rows; clears records[r].count / kept_above (gathered already).
extern "C" __global__ void __launch_bounds__(SP_THREADS)
topp_ranks_cut(const int* __restrict__ query_pos, SP_ARGS, const RankRow* __restrict__ all_records, int tp, int V,
               const double* __restrict__ bin_scale, RowState* __restrict__ state, RankRow* __restrict__ records,
               int* __restrict__ tokens, int* __restrict__ flags_out, int* status, u32* inexact_rows) {
    __shared__ u64 keys[SP_MAX_BIN_KEYS];
    __shared__ Winner wscratch[32];
    __shared__ int s_base[SPR_MAX_RANKS + 1];
    const int r = blockIdx.x, n = gridDim.x;
    pdl_wait();
    SP_MAKE_ARGS;
    const RowState st = state[r];
    const u32 position = (u32)query_pos[r] + 1u;
    if (threadIdx.x == 0) {
        int base = 0;
        for (int t = 0; t < tp; ++t) {
            s_base[t] = base;
            base += (int)all_records[(size_t)t * n + r].count;
        }
        s_base[tp] = base;
        records[r].count = 0u;                                   // ready for the next launch
        records[r].kept_above = 0u;
    }
    Winner w_above{DD_NEG_INF, 0x7fffffff}, w_bin{DD_NEG_INF, 0x7fffffff};
    u32 kept = 0u;
    for (int t = 0; t < tp; ++t) {                              // any order: better() is a total order
        const RankRow& p = all_records[(size_t)t * n + r];
        w_above = better(w_above, p.above);
        w_bin = better(w_bin, p.in_bin);
        kept += p.kept_above;
    }
    __syncthreads();
    const int count = s_base[tp];
    Winner token = w_above;
    u32 flags = 0u;
    u64 cut_key = 0ull;
    if (count > SP_MAX_BIN_KEYS) {                               // kept whole: not the definition's cut
        token = better(w_above, w_bin);
        kept += (u32)count;
        flags = SP_STATUS_BIN_OVERFLOW;
    } else if (count > 0) {                                      // (0 only for rows without a finite top: NaN)
        const int n_pad = pow2_at_least(count);
        for (int i = threadIdx.x; i < n_pad; i += SP_THREADS) {
            u64 k = 0ull;
            if (i < count) {                                     // key i: rank t's key i - base[t]
                int t = 0;
                while (i >= s_base[t + 1]) ++t;
                k = all_records[(size_t)t * n + r].keys[i - s_base[t]];
            }
            keys[i] = k;
        }
        const BinCut c = bin_cut(st, count, V, position, a, bin_scale, w_above, keys, wscratch);
        token = c.token;
        kept += (u32)(c.cut + 1);
        cut_key = c.cut_key;
        flags = c.flags;
    }
    if (threadIdx.x == 0) {
        tokens[r] = token.id == 0x7fffffff ? 0 : token.id;
        flags_out[r] = (int)flags;
        state[r].cut_key = cut_key;
        state[r].kept = kept;
        state[r].flags = flags;
        if (flags) {
            atomicOr(status, (int)flags);
            atomicAdd(inexact_rows, 1u);
        }
    }
    pdl_trigger();
}
