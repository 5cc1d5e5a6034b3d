// Ordering, selection and noise helpers shared by the tree kernels (tree_build.cu, sample*.cu).
//
// Every "top-k with ties to the lower id" in DDTree (docs/interfaces.md sections 4, 5) becomes a plain
// "k largest distinct u64 keys" here:  key = order32(value) << 32 | (0xFFFFFFFF - id).
// order32 maps fp32 to u32 monotonically (larger value -> larger key, -0 == +0), and the low word makes
// the lower id the larger key on equal values, so keys are distinct and one integer compare decides.
// Key 0 is never a real key (ids < 2^31) and pads short lists. NaN maps to key 1 (below -inf) and
// raises the caller's status flag: the reference rejects NaN logits, the device cannot raise.
#pragma once
#include "common.cuh"

#define DD_SEL_BINS 256

#ifdef DD_TREE_TRACE                     // phase timestamps (ns) for tests/plugins/profile_tree.py
extern "C" __device__ unsigned long long dd_trace[32];
__device__ unsigned long long dd_trace[32];
#define DD_TRACE(slot, cond) do { if (threadIdx.x == 0 && (cond)) dd_trace[slot] = global_ns(); } while (0)
#define DD_TRACE_LAST(slot) do { if (threadIdx.x == 0) atomicMax(&dd_trace[slot], global_ns()); } while (0)
#define DD_TRACE_CLOCK(slot) do { if (threadIdx.x == 0) dd_trace[slot] = clock64(); } while (0)
#else
#define DD_TRACE_CLOCK(slot) do {} while (0)
#define DD_TRACE(slot, cond) do {} while (0)
#define DD_TRACE_LAST(slot) do {} while (0)
#endif

__device__ __forceinline__ u32 redux_max_u32(u32 v) {      // warp-wide max (sm_80+), all lanes get it
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}

__device__ __forceinline__ u32 order32(float v) {
    u32 b = __float_as_uint(v + 0.0f);                       // -0 + 0 = +0: equal values, equal keys
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float unorder32(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ u64 pack_key(float v, int id) {
    u32 hi = (v != v) ? 1u : order32(v);
    return ((u64)hi << 32) | (u64)(0xffffffffu - (u32)id);
}
__device__ __forceinline__ float key_value(u64 k) { return unorder32((u32)(k >> 32)); }
__device__ __forceinline__ int key_id(u64 k) { return (int)(0xffffffffu - (u32)k); }

// Block-wide reduction (every thread gets the result); blockDim.x a multiple of 32.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, T* scratch /*[32]*/) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : identity;
#pragma unroll
        for (int o = 16; o; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (lane == 0) scratch[0] = v;
    }
    __syncthreads();
    v = scratch[0];
    __syncthreads();
    return v;
}

struct MaxOp { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } };
template <typename T> struct SumOp { __device__ T operator()(T a, T b) const { return a + b; } };
struct MaxU64Op { __device__ u64 operator()(u64 a, u64 b) const { return a > b ? a : b; } };

// (value, id) winner: larger value, ties -> lower id (the sampling definition's argmax).
struct Winner { double value; int id; };
__device__ __forceinline__ Winner better(Winner a, Winner b) {
    return (a.value > b.value || (a.value == b.value && a.id < b.id)) ? a : b;
}
__device__ Winner block_winner(Winner w, Winner* scratch /*[32]*/) {
#pragma unroll
    for (int o = 16; o; o >>= 1)
        w = better(w, Winner{__shfl_xor_sync(0xffffffffu, w.value, o), __shfl_xor_sync(0xffffffffu, w.id, o)});
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = w;
    __syncthreads();
    if (warp == 0) {
        w = lane < (int)(blockDim.x >> 5) ? scratch[lane] : Winner{DD_NEG_INF, 0x7fffffff};
#pragma unroll
        for (int o = 16; o; o >>= 1)
            w = better(w, Winner{__shfl_xor_sync(0xffffffffu, w.value, o), __shfl_xor_sync(0xffffffffu, w.id, o)});
        if (lane == 0) scratch[0] = w;
    }
    __syncthreads();
    w = scratch[0];
    __syncthreads();
    return w;
}

// Bitonic sort of n (a power of two) keys in shared memory, descending.
template <int THREADS>
__device__ void block_sort_desc(u64* a, int n) {
    for (int k = 2; k <= n; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n; i += THREADS) {
                const int p = i ^ j;
                if (p > i) {
                    const u64 x = a[i], y = a[p];
                    if (((i & k) == 0) ? (x < y) : (x > y)) { a[i] = y; a[p] = x; }
                }
            }
            __syncthreads();
        }
    }
}

// Bitonic sort of THREADS keys, one per thread, descending: thread i returns the i-th largest (and
// buf[i] holds it). Exchanges within a warp go through shuffles, wider ones through buf: 10 block
// barriers for 512 keys instead of 45. buf: THREADS u64 of shared memory.
template <int THREADS>
__device__ u64 block_sort_desc_1(u64 v, u64* buf) {
    const int i = threadIdx.x;
#pragma unroll
    for (int k = 2; k <= THREADS; k <<= 1) {
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
    return v;
}

struct MinNonzeroU64Op { __device__ u64 operator()(u64 a, u64 b) const { return (!a || (b && b < a)) ? b : a; } };

// The threshold t with exactly K of the block's (distinct, nonzero) keys >= t; K <= number of nonzero
// keys. MSB-first radix select with 8-bit digits, starting at the highest bit where the block's keys
// differ (a slice's keys share their top bits: starting there spreads the first histogram instead of
// piling every key into one bin), stopping as soon as every key under the prefix is needed (usually
// after 2-3 passes). hist: DD_SEL_BINS u32 of shared memory; all threads call it.
template <int THREADS, int ITEMS>
__device__ u64 block_kth_largest(const u64 (&keys)[ITEMS], int K, u32* hist) {
    __shared__ u32 s_pick[3];                                 // digit, keys above it, keys in its bin
    __shared__ u64 scratch[32];
    u64 hi = 0, lo = 0;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) { hi = keys[j] > hi ? keys[j] : hi; lo = MinNonzeroU64Op()(lo, keys[j]); }
    hi = block_reduce(hi, MaxU64Op(), 0ull, scratch);
    lo = block_reduce(lo, MinNonzeroU64Op(), 0ull, scratch);
    if (hi == lo) return hi;                                  // a single key
    int top = 63 - __clzll(hi ^ lo);                          // highest bit where the keys differ
    u64 prefix = top == 63 ? 0ull : hi & (~0ull << (top + 1));
    int remaining = K;
    while (top >= 0) {
        const int low = top >= 7 ? top - 7 : 0;
        const u64 above_mask = top == 63 ? 0ull : (~0ull << (top + 1));
        const u32 digit_mask = (1u << (top - low + 1)) - 1u;
        for (int i = threadIdx.x; i < DD_SEL_BINS; i += THREADS) hist[i] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < ITEMS; ++j)
            if (keys[j] && (keys[j] & above_mask) == prefix) atomicAdd(&hist[(u32)(keys[j] >> low) & digit_mask], 1u);
        __syncthreads();
        if (threadIdx.x < 32) {                               // warp 0: bins from the top, 8 per lane
            const int lane = threadIdx.x;
            u32 mine[8], sum = 0;
#pragma unroll
            for (int b = 0; b < 8; ++b) { mine[b] = hist[255 - 8 * lane - b]; sum += mine[b]; }
            u32 incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                u32 n = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += n;
            }
            const u32 crossing = __ballot_sync(0xffffffffu, incl >= (u32)remaining);
            if (lane == __ffs(crossing) - 1) {
                u32 above = incl - sum;
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    if (above + mine[b] >= (u32)remaining) {
                        s_pick[0] = 255 - 8 * lane - b; s_pick[1] = above; s_pick[2] = mine[b];
                        break;
                    }
                    above += mine[b];
                }
            }
        }
        __syncthreads();
        prefix |= (u64)s_pick[0] << low;
        remaining -= (int)s_pick[1];
        const bool done = (int)s_pick[2] == remaining;
        __syncthreads();                                      // s_pick and hist are rewritten next pass
        if (done) break;
        top = low - 1;
    }
    return prefix;
}

// keys[j] = src[j * THREADS + threadIdx.x] for indices below count, else 0 (the padding key); past L1,
// for keys other blocks of this kernel wrote before their ticket.
template <int THREADS, int ITEMS>
__device__ __forceinline__ void load_keys_cg(u64 (&keys)[ITEMS], const u64* src, int count) {
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        const int e = j * THREADS + threadIdx.x;
        keys[j] = e < count ? ld_cg_u64(src + e) : 0ull;
    }
}

__device__ __forceinline__ int pow2_at_least(int k) { int n = 1; while (n < k) n <<= 1; return n; }

#define DD_TOP_CAND 2048                  // candidates sorted directly (above this: radix select)

struct TopKeysSmem {
    u64 thread_max[1024];                 // one per thread (THREADS <= 1024)
    u64 cand[DD_TOP_CAND];
    u32 hist[DD_SEL_BINS];
    int count;
};

// The block's K largest keys (K <= number of nonzero keys, K <= 1024) into out[0 .. K), descending, zeros
// after (out holds pow2_at_least(K) keys). Prefilter without contended atomics: the K-th largest of the
// per-thread maxima is a lower bound t of the K-th largest key (K threads hold a key >= t), and only keys
// >= t (usually ~K..2K of them) are gathered and sorted; if more than DD_TOP_CAND pass, a radix select
// on the registers decides instead.
template <int THREADS, int ITEMS>
__device__ void block_top_keys(const u64 (&keys)[ITEMS], int K, TopKeysSmem& sm, u64* out) {
    u64 mx = 0;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) mx = keys[j] > mx ? keys[j] : mx;
    if (threadIdx.x == 0) sm.count = 0;
    block_sort_desc_1<THREADS>(mx, sm.thread_max);
    const u64 t = sm.thread_max[K - 1] ? sm.thread_max[K - 1] : 1ull;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {                         // gather keys >= t, one atomic per warp
        const bool take = keys[j] >= t;
        const u32 votes = __ballot_sync(0xffffffffu, take);
        int base = 0;
        if (votes && lane == 0) base = atomicAdd(&sm.count, __popc(votes));
        base = __shfl_sync(0xffffffffu, base, 0);
        const int at = base + __popc(votes & ((1u << lane) - 1u));
        if (take && at < DD_TOP_CAND) sm.cand[at] = keys[j];
    }
    __syncthreads();
    const int m = sm.count, n_out = pow2_at_least(K);
    if (m <= THREADS) {                                       // one candidate per thread: register sort
        block_sort_desc_1<THREADS>(threadIdx.x < m ? sm.cand[threadIdx.x] : 0ull, sm.thread_max);
        for (int i = threadIdx.x; i < n_out; i += THREADS) out[i] = i < K ? sm.thread_max[i] : 0ull;
    } else if (m <= DD_TOP_CAND) {
        const int n = pow2_at_least(m);
        for (int i = m + threadIdx.x; i < n; i += THREADS) sm.cand[i] = 0;
        __syncthreads();
        block_sort_desc<THREADS>(sm.cand, n);
        for (int i = threadIdx.x; i < n_out; i += THREADS) out[i] = i < K ? sm.cand[i] : 0ull;
    } else {
        __shared__ int s_count;
        const u64 kth = block_kth_largest<THREADS, ITEMS>(keys, K, sm.hist);
        if (threadIdx.x == 0) s_count = 0;
        for (int i = threadIdx.x; i < n_out; i += THREADS) out[i] = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < ITEMS; ++j)
            if (keys[j] && keys[j] >= kth) out[atomicAdd(&s_count, 1)] = keys[j];
        __syncthreads();
        block_sort_desc<THREADS>(out, n_out);
    }
    __syncthreads();
}

// ---- Philox4x32-10 and the Gumbel noise of docs/interfaces.md section 5 (numpy twin: ddtree/tree/philox.py) ----
__device__ __forceinline__ u32 philox_word0(u32 c0, u32 c1, u32 k0, u32 k1) {
    u32 c2 = 0, c3 = 0;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    }
    return c0;
}

// g = -log(-log(u)), u = (x + 0.5) / 2^32, in float64 exactly as the definition writes it.
__device__ __forceinline__ double gumbel64(u32 x) {
    const double u = ((double)x + 0.5) * 2.3283064365386963e-10;
    return -log(-log(u));
}

// A float32 estimate of gumbel64(x), within 2e-4 (fast log approximations; used only to skip tokens that
// cannot win, with a margin above that bound). Near u = 1, -log(u) is formed from 1 - u (exact in the
// integer domain) so that it keeps its relative precision.
__device__ __forceinline__ float gumbel32(u32 x) {
    float w;
    if (x >= 0x80000000u) {
        const float r = ((float)(0xffffffffu - x) + 0.5f) * 2.3283064365386963e-10f;          // 1 - u
        w = r < 0.00390625f ? r * (1.0f + 0.5f * r) : -__logf(1.0f - r);
    } else {
        w = -__logf(((float)x + 0.5f) * 2.3283064365386963e-10f);
    }
    return -__logf(w);
}
#define DD_GUMBEL_MAX 22.9f               // gumbel64 of x = 2^32 - 1 is 22.87: no noise is larger
#define DD_GUMBEL_MARGIN(z) (1e-3f + 1e-6f * fabsf(z))   // estimate error (<= 2e-4) + z rounding, with room
