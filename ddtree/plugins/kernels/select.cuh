// Ordering, selection and noise helpers shared by the tree kernels (tree_build.cu, sample.cu).
//
// Every "top-k with ties to the lower id" in DDTree (interfaces.md sections 4, 5) becomes a plain
// "k largest distinct u64 keys" here:  key = order32(value) << 32 | (0xFFFFFFFF - id).
// order32 maps fp32 to u32 monotonically (larger value -> larger key, -0 == +0), and the low word makes
// the lower id the larger key on equal values, so keys are distinct and one integer compare decides.
// Key 0 is never a real key (ids < 2^31) and pads short lists. NaN maps to key 1 (below -inf) and
// raises the caller's status flag: the reference rejects NaN logits, the device cannot raise.
#pragma once
#include "common.cuh"

#define DD_SEL_BINS 256

__device__ __forceinline__ u32 redux_max_u32(u32 v) {      // warp-wide max (sm_80+), all lanes get it
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}

// Copy n u64 written by other blocks of this kernel (after their fence) into shared memory, past L1.
__device__ __forceinline__ void load_cg_u64(u64* dst, const u64* src, int n, int threads) {
    for (int i = threadIdx.x; i < n; i += threads) {
        u64 v;
        asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(src + i) : "memory");
        dst[i] = v;
    }
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

// Bitonic sort of n (a power of two <= 2 * THREADS) keys in shared memory, descending.
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

// The block's K largest keys (K <= number of nonzero keys, K <= n_pad, n_pad a power of two) into
// out[0 .. K), descending; out[K .. n_pad) = 0. out: n_pad u64 of shared memory.
template <int THREADS, int ITEMS>
__device__ void block_top_keys(const u64 (&keys)[ITEMS], int K, u32* hist, u64* out, int n_pad) {
    __shared__ int s_count;
    const u64 t = block_kth_largest<THREADS, ITEMS>(keys, K, hist);
    if (threadIdx.x == 0) s_count = 0;
    for (int i = threadIdx.x; i < n_pad; i += THREADS) out[i] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < ITEMS; ++j)
        if (keys[j] && keys[j] >= t) out[atomicAdd(&s_count, 1)] = keys[j];
    __syncthreads();
    block_sort_desc<THREADS>(out, n_pad);
}

__device__ __forceinline__ int pow2_at_least(int k) { int n = 1; while (n < k) n <<= 1; return n; }

// Number of keys > key in a descending list of n keys.
__device__ __forceinline__ int count_greater(const u64* list, int n, u64 key) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (list[mid] > key) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Merge S descending lists of L keys each (lists[s * L + r], zeros pad) into the K largest, descending,
// out[0 .. K) (zeros where fewer keys exist). Each key's place is its rank in its own list plus the keys
// greater than it in the others (keys are distinct). out must not alias lists; keep lists in shared
// memory (the binary searches are chains of dependent loads).
template <int THREADS>
__device__ void block_merge_desc(const u64* lists, int S, int L, int K, u64* out) {
    for (int i = threadIdx.x; i < K; i += THREADS) out[i] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < S * L; e += THREADS) {
        const u64 key = lists[e];
        const int s = e / L, r = e - s * L;
        if (!key || r >= K) continue;
        int rank = r;
        for (int o = 0; o < S && rank < K; ++o)
            if (o != s) rank += count_greater(lists + o * L, L, key);
        if (rank < K) out[rank] = key;
    }
    __syncthreads();
}

// ---- Philox4x32-10 and the Gumbel noise of interfaces.md section 5 (numpy twin: ddtree/tree/philox.py) ----
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
