// Device functions of top-p without top-k shared by sample_top_p.cu (one rank holds the whole row) and
// sample_top_p_ranks.cu (the row split over tp ranks): the fixed-point bins of a slice, the crossing-bin
// decision from the bin sums, the lazy Gumbel-max, a slice's pass over its tokens and the crossing bin's cut
// with its certificate. numpy twins: ddtree/plugins/top_p_bins.py (one rank), top_p_ranks.py (the ranks).
#pragma once
#include "sample_common.cuh"

#define SP_MAX_THREADS 256
#define SP_KEPT_CHUNK 8                     // sample_kept: logits loaded per batch (8 round trips -> 4 per slice)
#define SP_QUEUE (32 * SP_KEPT_CHUNK + 32)  // sample_kept: a warp's kept tokens waiting for a full warp (u32 ids)
#define SP_TOKEN_EPS (1.5 * 0x1p-35)        // per token, relative (top_p_bins.py TOKEN_EPS)
#define SP_ARG_EPS 0x1p-44                  // per token and unit of |d| (ARG_EPS)
#define SP_CLAMP_EPS 0x1p-16                // per token of bin 4095, in s_4095 (CLAMP_EPS)
#define SP_BIN_SLACK 0x1p-51                // per bin, relative (BIN_SLACK)
#define SP_U64 0x1p-53
#define SP_SUM_SLACK (64 * SP_U64)          // float64 sums, x norm (SUM_SLACK)

#ifdef DD_PROFILE
extern "C" __device__ unsigned long long sp_prof[32];
__device__ unsigned long long sp_prof[32];
#define SP_CLOCK(t) __syncthreads(); const long long t = clock64()
#define SP_PROF(slot, t0, t1) \
    do { if (threadIdx.x == 0) atomicAdd(&sp_prof[slot], (unsigned long long)((t1) - (t0))); } while (0)
#else
#define SP_CLOCK(t) do {} while (0)
#define SP_PROF(slot, t0, t1) do {} while (0)
#endif
#ifndef SP_ABLATE
#define SP_ABLATE 0
#endif
// sp_prof slots: sample_mass (per block) loads + wait, token loop, bin flush, blocks; its last blocks: decide,
// count. sample_kept (per block): wait + state, slice loop, winners + ticket, blocks; last blocks: slice
// winners, sort (the keys loaded before it), cut, Gumbel of the prefix, certify + writes, count; the decide's
// wait for its bin sums (loaded and cleared). (tests/plugins/profile_top_p.py)
enum { SP_PROF_MASS_LOAD, SP_PROF_MASS_TOKENS, SP_PROF_MASS_FLUSH, SP_PROF_MASS_BLOCKS, SP_PROF_MASS_DECIDE,
       SP_PROF_MASS_LAST, SP_PROF_KEPT_WAIT = 8, SP_PROF_KEPT_LOOP, SP_PROF_KEPT_MERGE, SP_PROF_KEPT_BLOCKS,
       SP_PROF_ROW_WINS, SP_PROF_ROW_SORT, SP_PROF_ROW_CUT, SP_PROF_ROW_GUMBEL, SP_PROF_ROW_CERTIFY,
       SP_PROF_ROW_LAST, SP_PROF_DECIDE_LOADS };

struct MinIntOp { __device__ int operator()(int a, int b) const { return min(a, b); } };
struct MaxIntOp { __device__ int operator()(int a, int b) const { return max(a, b); } };

// Exclusive block scan (every thread gets its exclusive prefix; `total` the block's sum). blockDim.x a
// multiple of 32; scratch: 32 T of shared memory.
template <typename T>
__device__ T block_scan_excl(T v, T& total, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    T x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    T excl = __shfl_up_sync(0xffffffffu, x, 1);
    if (lane == 0) excl = T(0);
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T w = lane < warps ? scratch[lane] : T(0);
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const T y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        scratch[lane] = w;                                   // inclusive sums of the warp totals
    }
    __syncthreads();
    const T before = warp ? scratch[warp - 1] : T(0);
    total = scratch[warps - 1];
    __syncthreads();
    return before + excl;
}

// Bound of |M_b - the exact mass of bin b| (top_p_bins.py bin_errors).
__device__ __forceinline__ double bin_error(int b, double m, double s_clamp, int V) {
    if (b == TP_CLAMP) return s_clamp * (double)V * SP_CLAMP_EPS + SP_BIN_SLACK * m;
    return (1.02 * (SP_TOKEN_EPS + SP_ARG_EPS * (double)(b + 1) * (1.0 / 128.0)) + SP_BIN_SLACK) * m;
}

// The row's crossing bin from its fixed-point bin sums F (thread t holds bins PER t .. PER t + PER - 1):
// bin masses, the first bin whose cumulative mass reaches top_p x norm, the error bounds above and below it
// -> *state. All threads call it (512-thread blocks).
__device__ void decide_bins(const u64 (&F)[SP_BINS / SP_THREADS], const double* bin_scale, const SampleArgs& a,
                            int V, float l_top, RowState* state) {
    constexpr int PER = SP_BINS / SP_THREADS;
    __shared__ double dscratch[32];
    __shared__ int iscratch[32];
    __shared__ double s_above;
    double m[PER], sum = 0.0;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int b = threadIdx.x * PER + j;
        m[j] = bin_scale[b] * ((double)F[j] * 0x1p-35);
        sum += m[j];
    }
    double norm;
    const double excl = block_scan_excl(sum, norm, dscratch);
    const double goal = a.top_p * norm;
    int found = 0x7fffffff, last = -1;
    double c = excl;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int b = threadIdx.x * PER + j;
        if (m[j] > 0.0) {
            if (found == 0x7fffffff && c + m[j] >= goal) found = b;
            last = b;
        }
        c += m[j];
    }
    found = block_reduce(found, MinIntOp(), 0x7fffffff, iscratch);
    last = block_reduce(last, MaxIntOp(), -1, iscratch);
    const int bin = found != 0x7fffffff ? found : max(last, 0);     // not reached (rounding): the last bin
    double err_above = 0.0, err_below = 0.0;
    c = excl;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int b = threadIdx.x * PER + j;
        const double e = bin_error(b, m[j], bin_scale[TP_CLAMP], V);
        if (b < bin) err_above += e;
        else if (b > bin) err_below += e;
        else s_above = c;
        c += m[j];
    }
    err_above = block_reduce(err_above, SumOp<double>(), 0.0, dscratch);
    err_below = block_reduce(err_below, SumOp<double>(), 0.0, dscratch);
    if (threadIdx.x == 0) *state = RowState{l_top, bin, s_above, norm, err_above, err_below, 0ull, 0u, 0u};
}

// A slice's tokens (vals[j]: token lo + j SP_THREADS + threadIdx.x, -inf past the row) into the block's
// shared bins (two u32 halves: exact sums; per block and bin hi < 2^31, lo < 2^32).
__device__ __forceinline__ void mass_tokens(const float (&vals)[SP_ITEMS], float l_top, const SampleArgs& a,
                                            u32* hist_hi, u32* hist_lo) {
#pragma unroll
    for (int j = 0; j < SP_ITEMS; ++j) {
        int b;
        const long long F = tp_token_fixed(vals[j], l_top, a.inv_t32, a.inv_t_lo, b);
        if (F) {
            atomicAdd(&hist_hi[b], (u32)(F >> 18));
            atomicAdd(&hist_lo[b], (u32)F & 0x3ffffu);
        }
    }
}

// The block's shared bins added into the row's global bins [SP_BINS] (64-bit adds, exact in any order).
__device__ __forceinline__ void mass_flush(const u32* hist_hi, const u32* hist_lo, u64* row_mass) {
    for (int i = threadIdx.x; i < SP_BINS; i += SP_THREADS) {
        const u64 F = ((u64)hist_hi[i] << 18) + (u64)hist_lo[i];
        if (F) atomicAdd(row_mass + i, F);
    }
}

// Gumbel-max without float64 per token. A thread's winner so far is held as the bounds [lo, hi] of its
// value z + g (the float32 estimate z32 + gumbel32 +- DD_GUMBEL_MARGIN: gumbel32 is within 2e-4 of
// gumbel64, z32 within 1.2e-7 |z| of z, and the margin's room covers the float32 roundings of the sums).
// A token whose bounds lie wholly above the winner's replaces it, wholly below is dropped; only
// overlapping bounds (about one token in 10^3) compute both float64 values and decide exactly as
// better() (value, then the lower id). The old form kept the winner's float64 value and computed a new
// one whenever a lane's estimate could reach it: inside a warp nearly every token step had such a lane,
// so the warp ran a float64 division and two float64 logs per token (the sample_kept time of issue 23).
struct Lazy { float lo, hi, l; int id; };
#define SP_LAZY_NONE Lazy{DD_NEG_INF, DD_NEG_INF, 0.0f, 0x7fffffff}

// Does the winner (bl, bid) stay ahead of token (l, v) (noise word x) by better() on the float64 values?
// The rare overlap: out of line, so that the slice loop's eight inlined token steps stay small.
__device__ __noinline__ bool lazy_stays(float bl, int bid, float l, int v, u32 x, u32 position, double T,
                                        u32 seed_lo, u32 seed_hi) {
    if (bid == 0x7fffffff) return false;
    const double mine = (double)l / T + gumbel64(x);
    const double theirs = (double)bl / T + gumbel64(philox_word0(position, (u32)bid, seed_lo, seed_hi));
    return better(Winner{theirs, bid}, Winner{mine, v}).id == bid;
}

// best <- the better of best and token (l, v) (exactly better() on the float64 values).
__device__ __forceinline__ void lazy_consider(Lazy& best, float l, int v, u32 position, const SampleArgs& a) {
    const float z32 = l * a.inv_t32;
    const float margin = DD_GUMBEL_MARGIN(z32);
    if (z32 + DD_GUMBEL_MAX + margin < best.lo) return;              // cannot win at any noise
    const u32 x = philox_word0(position, (u32)v, a.seed_lo, a.seed_hi);
    const float est = z32 + gumbel32(x);
    const float lo = est - margin, hi = est + margin;
    if (hi < best.lo) return;
    if (!(lo > best.hi)                                               // overlapping (or NaN): decide exactly
        && lazy_stays(best.l, best.id, l, v, x, position, a.temperature, a.seed_lo, a.seed_hi)) return;
    best = Lazy{lo, hi, l, v};
}

// Two lazy winners finished together (their float64 chains overlap), as lazy_finish.
__device__ __forceinline__ void lazy_finish2(const Lazy& p, const Lazy& q, u32 position, const SampleArgs& a,
                                             Winner& wp, Winner& wq) {
    float tp = p.lo, tq = q.lo;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        tp = fmaxf(tp, __shfl_xor_sync(0xffffffffu, tp, o));
        tq = fmaxf(tq, __shfl_xor_sync(0xffffffffu, tq, o));
    }
    const bool np = p.id != 0x7fffffff && !(p.hi < tp), nq = q.id != 0x7fffffff && !(q.hi < tq);
    wp = wq = Winner{DD_NEG_INF, 0x7fffffff};
    if (np || nq) {
        const u32 xp = philox_word0(position, (u32)p.id, a.seed_lo, a.seed_hi);
        const u32 xq = philox_word0(position, (u32)q.id, a.seed_lo, a.seed_hi);
        const double vp = (double)p.l / a.temperature + gumbel64(xp);
        const double vq = (double)q.l / a.temperature + gumbel64(xq);
        if (np) wp = Winner{vp, p.id};
        if (nq) wq = Winner{vq, q.id};
    }
}

// The block's largest (x, y) (every thread; all call it). A barrier inside; the caller's next barrier ends
// the reads of `tops`.
__device__ __forceinline__ float2 block_max2(float x, float y) {
    __shared__ float2 tops[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
        y = fmaxf(y, __shfl_xor_sync(0xffffffffu, y, o));
    }
    if (lane == 0) tops[warp] = make_float2(x, y);
    __syncthreads();
    for (int w = 0; w < warps; ++w) {
        x = fmaxf(x, tops[w].x);
        y = fmaxf(y, tops[w].y);
    }
    return make_float2(x, y);
}

// A lazy winner's exact Winner, or none when its hi is below `top` (another thread's lo: it cannot win).
__device__ __forceinline__ Winner lazy_exact(const Lazy& w, float top, u32 position, const SampleArgs& a) {
    if (w.id == 0x7fffffff || w.hi < top) return Winner{DD_NEG_INF, 0x7fffffff};
    return Winner{(double)w.l / a.temperature + gumbel64(philox_word0(position, (u32)w.id, a.seed_lo, a.seed_hi)),
                  w.id};
}

// lazy_finish2 against the whole block's bounds, then the block's two winners (every thread; all call it).
// A thread whose hi is below the best lo of the block (not only of its warp) cannot win and computes no
// float64 value, so one or two warps of a block run the float64 Gumbels, not all 16: with two blocks an SM,
// 32 warps each running two float64 -log(-log(u)) kept the FP64 pipe busy for thousands of cycles a block.
__device__ void lazy_block_finish2(const Lazy& p, const Lazy& q, u32 position, const SampleArgs& a, Winner& wp,
                                   Winner& wq, Winner* scratch) {
    const float2 top = block_max2(p.lo, q.lo);
    wp = block_winner(lazy_exact(p, top.x, position, a), scratch);    // its barriers end the reads of tops
    wq = block_winner(lazy_exact(q, top.y, position, a), scratch);
}

// The warp's lazy winners -> exact Winners: a lane whose hi is below another lane's lo cannot win the
// block and reports none; the others compute their float64 value (all lanes call it, converged).
__device__ __forceinline__ Winner lazy_finish(const Lazy& w, u32 position, const SampleArgs& a) {
    float top = w.lo;
#pragma unroll
    for (int o = 16; o; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    if (w.id == 0x7fffffff || w.hi < top) return Winner{DD_NEG_INF, 0x7fffffff};
    const u32 x = philox_word0(position, (u32)w.id, a.seed_lo, a.seed_hi);
    return Winner{(double)w.l / a.temperature + gumbel64(x), w.id};
}

// Is the cut with the crossing bin's first `cut + 1` tokens above it (prefix sums p_cut, p_prev before it,
// total the bin's) the definition's, whatever the roundings? (top_p_bins.py certify)
__device__ bool certify(const RowState& st, double scale, u64 p_prev, u64 p_cut, u64 total, int cut, int count,
                        double top_p, int V, double z_top) {
    const double slack = SP_SUM_SLACK * st.norm;
    const double eps = 1.02 * (SP_TOKEN_EPS + SP_ARG_EPS * (double)(st.bin + 1) * (1.0 / 128.0)) + SP_BIN_SLACK;
    double A[2], B[2], ea[2], eb[2];
    const u64 p[2] = {p_cut, p_prev};
    const int k[2] = {cut + 1, cut};                          // bin tokens in the prefix
    for (int i = 0; i < 2; ++i) {
        const double a_in = scale * ((double)p[i] * 0x1p-35), b_in = scale * ((double)(total - p[i]) * 0x1p-35);
        const double e_a = st.bin == TP_CLAMP ? scale * SP_CLAMP_EPS * k[i] : eps * a_in;
        const double e_b = st.bin == TP_CLAMP ? scale * SP_CLAMP_EPS * (count - k[i]) : eps * b_in;
        A[i] = st.above + a_in;
        B[i] = st.norm - A[i];
        ea[i] = st.err_above + e_a + slack;
        eb[i] = st.err_below + e_b + slack;
    }
    const double e_def = 1.05 * SP_U64 * ((double)V + 4.0 * fabs(z_top) + log2((double)max(V, 2)) + 200.0)
                         + 8.0 * SP_U64;
    const double low = (A[0] - ea[0]) / ((A[0] - ea[0]) + B[0] + eb[0]);
    const double high = (A[1] + ea[1]) / ((A[1] + ea[1]) + fmax(B[1] - eb[1], 0.0));
    return low - e_def >= top_p && high + e_def < top_p;
}

// Could the cut token and the next in key order have equal float64 probabilities with different logits
// (the definition then orders them by id)? The bin's last token: the nearest float below. (order_tie)
__device__ bool order_tie(const u64* keys, int cut, int count, double T, double z_top) {
    const float l_cut = key_value(keys[cut]);
    const float l_next = cut + 1 < count ? key_value(keys[cut + 1]) : nextafterf(l_cut, DD_NEG_INF);
    if (l_next == l_cut) return false;
    const double d_cut = fabs((double)l_cut / T - z_top);
    return ((double)l_cut - (double)l_next) / T <= 0x1p-44 * (1.0 + fabs(z_top) + d_cut);
}

// One slice's pass of sample_kept (row[lo .. hi) of the row, token v's id id0 + v: ids and noise are the whole
// row's): the tokens of the bins above st.bin into `above`, those of st.bin into `in_bin` (lazy Gumbel winners),
// st.bin's keys into keys_out[*bin_count ..] (slots past SP_MAX_BIN_KEYS counted, not stored); returns this
// thread's count of tokens above st.bin. queue: this warp's SP_QUEUE u32 of shared memory.
__device__ __forceinline__ u32 kept_slice(const float* row, int lo, int hi, int id0, const RowState& st,
                                          u32 position, const SampleArgs& a, u32* bin_count, u64* keys_out,
                                          u32* queue, Lazy& above, Lazy& in_bin) {
    const int lane = threadIdx.x & 31;
    int queued = 0;                                              // warp-uniform
    u32 kept = 0u;
#pragma unroll 1
    for (int c = 0; c < SP_ITEMS; c += SP_KEPT_CHUNK) {
        float vals[SP_KEPT_CHUNK];           // loaded first, all in flight (a load inside the branchy body below
#pragma unroll                               // waits a round trip per token: one LDG per iteration in the SASS)
        for (int j = 0; j < SP_KEPT_CHUNK; ++j) {
            const int v = lo + (c + j) * SP_THREADS + threadIdx.x;
            vals[j] = v < hi ? row[v] : DD_NEG_INF;
        }
#pragma unroll
        for (int j = 0; j < SP_KEPT_CHUNK; ++j) {            // warp-uniform: every lane reaches the ballot
            const int v = lo + (c + j) * SP_THREADS + threadIdx.x;
            const float l = vals[j];
            const int b = v < hi ? tp_token_bin(l, st.l_top, a.inv_t32) : SP_BINS;
            const bool at_cut = b == st.bin;
            const u32 votes = __ballot_sync(0xffffffffu, at_cut);
            if (votes) {                                         // the crossing bin's tokens: one atomic a warp
                int base = 0;
                if (lane == 0) base = (int)atomicAdd(bin_count, (u32)__popc(votes));
                base = __shfl_sync(0xffffffffu, base, 0);
                const int slot = base + __popc(votes & ((1u << lane) - 1u));
                if (at_cut && slot < SP_MAX_BIN_KEYS) keys_out[slot] = pack_key(l, id0 + v);
            }
            const bool take = b <= st.bin && SP_ABLATE != 1;        // onto the warp's queue
            const u32 takes = __ballot_sync(0xffffffffu, take);
            if (take) queue[queued + __popc(takes & ((1u << lane) - 1u))] = (u32)v | (at_cut ? 0x80000000u : 0u);
            queued += __popc(takes);
            kept += b < st.bin;
        }
        // Gumbel over the queued tokens, 32 at a time (every lane busy; the last chunk drains the queue).
        // A lane's winner may take any of the warp's tokens: the maximum does not depend on who saw what.
        const int leave = c + SP_KEPT_CHUNK < SP_ITEMS ? 31 : 0;
        __syncwarp();
        while (queued > leave) {
            const int k = min(queued, 32);
            queued -= k;
            if (lane < k) {
                const u32 e = queue[queued + lane];
                const int v = (int)(e & 0x7fffffffu);
                Lazy w = e >> 31 ? in_bin : above;
                lazy_consider(w, row[v], id0 + v, position, a);       // row[v]: just loaded, from L1
                if (e >> 31) in_bin = w; else above = w;
            }
        }
        __syncwarp();
    }
    return kept;
}

// block_sort_desc_1 (select.cuh) stopped at n keys (n a power of two <= SP_THREADS, block-uniform): thread i's
// key v (i < n; the others' are ignored) -> buf[0 .. n) descending. The merges wider than n are skipped: a
// crossing bin of <= 32 tokens sorts within warps (no block barrier), 256 with 6 barrier pairs, not 10.
__device__ __forceinline__ void sort_desc_upto(u64 v, u64* buf, int n) {
    const int i = threadIdx.x;
#pragma unroll
    for (int k = 2; k <= SP_THREADS; k <<= 1) {
        if (k > n) break;
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
            u64 o;
            if (j >= 32) {
                buf[i] = v;
                __syncthreads();
                o = buf[i ^ j];
                __syncthreads();
            } else {
                o = __shfl_xor_sync(0xffffffffu, v, j);
            }
            const bool keep_max = ((i & k) == 0) == (i < (i ^ j));
            v = keep_max ? (v > o ? v : o) : (v < o ? v : o);
        }
    }
    buf[i] = v;
    __syncthreads();
}

// The crossing bin's cut (the row's last block): keys[0 .. count) its tokens' keys in any order, zeros up to
// pow2_at_least(count), 0 < count <= SP_MAX_BIN_KEYS (shared memory, SP_MAX_BIN_KEYS u64). Sorts them into
// key order (logit desc, id asc), sums their F along it (exact), cuts at the first whose cumulative mass
// reaches top_p x norm, draws the Gumbel winner of the kept prefix merged with w_above (token: every
// thread), certifies the cut (flags: thread 0's; SP_STATUS_INEXACT when not certified or an order tie).
// wscratch: 32 Winners of shared memory (the caller's, so the block holds one such buffer).
struct BinCut { Winner token; int cut; u64 cut_key; u32 flags; };
__device__ BinCut bin_cut(const RowState& st, int count, int V, u32 position, const SampleArgs& a,
                          const double* bin_scale, Winner w_above, u64* keys, Winner* wscratch) {
    constexpr int PER = SP_MAX_BIN_KEYS / SP_THREADS;
    __shared__ u64 uscratch[32];
    __shared__ int iscratch[32];
    __shared__ u64 s_p_cut, s_p_prev;
    if (threadIdx.x == 0) s_p_prev = 0ull;
    SP_CLOCK(t_loaded);
    const int n_pad = pow2_at_least(count);
    __syncthreads();
    if (n_pad <= SP_THREADS) {
        const u64 k = keys[threadIdx.x];                 // keys[n_pad ..] are stale: masked below
        __syncthreads();
        sort_desc_upto(threadIdx.x < n_pad ? k : 0ull, keys, n_pad);
    } else {
        block_sort_desc<SP_THREADS>(keys, n_pad);
    }
    SP_CLOCK(t_sorted);
    SP_PROF(SP_PROF_ROW_SORT, t_loaded, t_sorted);
    long long F[PER];                                    // positions PER t .. PER t + PER - 1
    u64 local = 0ull;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = threadIdx.x * PER + j;
        int b;
        F[j] = i < count ? tp_token_fixed(key_value(keys[i]), st.l_top, a.inv_t32, a.inv_t_lo, b) : 0ll;
        local += (u64)F[j];
    }
    u64 total;
    const u64 excl = block_scan_excl(local, total, uscratch);
    const double scale = bin_scale[st.bin], goal = a.top_p * st.norm;
    int found = 0x7fffffff;
    u64 P = excl;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = threadIdx.x * PER + j;
        P += (u64)F[j];
        if (i < count && found == 0x7fffffff && st.above + scale * ((double)P * 0x1p-35) >= goal) found = i;
    }
    found = block_reduce(found, MinIntOp(), 0x7fffffff, iscratch);
    const int cut = found != 0x7fffffff ? found : count - 1;     // not reached (rounding): the whole bin
    SP_CLOCK(t_cut);
    SP_PROF(SP_PROF_ROW_CUT, t_sorted, t_cut);
    P = excl;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = threadIdx.x * PER + j;
        P += (u64)F[j];
        if (i == cut) s_p_cut = P;
        if (i == cut - 1) s_p_prev = P;
    }
    Lazy w = SP_LAZY_NONE;                               // Gumbel-max over the kept prefix of the bin
    for (int i = threadIdx.x; i <= cut; i += SP_THREADS)  // strided: every thread busy, not PER in a row
        lazy_consider(w, key_value(keys[i]), key_id(keys[i]), position, a);
    BinCut out{block_winner(better(w_above, lazy_finish(w, position, a)), wscratch), cut, keys[cut], 0u};
    SP_CLOCK(t_gumbel);
    SP_PROF(SP_PROF_ROW_GUMBEL, t_cut, t_gumbel);
    if (threadIdx.x == 0) {
        const double z_top = (double)st.l_top / a.temperature;
        const bool certified = certify(st, scale, s_p_prev, s_p_cut, total, cut, count, a.top_p, V, z_top);
        if (!certified || order_tie(keys, cut, count, a.temperature, z_top)) out.flags = SP_STATUS_INEXACT;
    }
    SP_CLOCK(t_certified);
    SP_PROF(SP_PROF_ROW_CERTIFY, t_gumbel, t_certified);
    return out;
}

// The largest logit of row[lo, hi) (a block of SP_MAX_THREADS threads; every thread gets it), a NaN flagged in status.
__device__ __forceinline__ float slice_max_of(const float* row, int lo, int hi, int* status, float* scratch) {
    float m = DD_NEG_INF;
    bool nan = false;
#pragma unroll 8
    for (int v = lo + threadIdx.x; v < hi; v += SP_MAX_THREADS) {
        const float l = row[v];
        nan |= l != l;
        m = fmaxf(m, l);
    }
    if (nan) atomicOr(status, SP_STATUS_NAN_TARGET);
    return block_reduce(m, MaxOp(), DD_NEG_INF, scratch);
}
