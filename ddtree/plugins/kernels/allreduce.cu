// One-shot all-reduce of bf16 between GPUs that map each other's memory (CUDA IPC + peer access).
// Launcher, layout and protocol: ddtree/plugins/allreduce.py.
//
// Each rank owns one exchange buffer that every peer has mapped (peers[r] = rank r's buffer, as this
// rank sees it; peers[rank] is its own):
//   flags [2 round][2 slot][AR_MAX_RANKS src][AR_MAX_BLOCKS block] u64     (AR_FLAG_BYTES; round 1: two-shot only)
//   data  [2 slot][nranks src][region_bytes]                      (src's part, pushed by src)
// Collective number seq (1, 2, ...; read from state[0] on the device, so graph replays count on) uses
// slot seq & 1. Block b of rank s copies its chunk of x into data[slot][s] of every peer, then publishes
// flags[slot][s][b] = seq there (st.release.sys after the block's barrier: the payload is visible
// first). It waits until its own flags[slot][r][b] == seq for every peer r (ld.acquire.sys, at most
// max_spins polls; past that it sets bit r of *error and goes on), then sums the nranks parts of its
// chunk in rank order 0..nranks-1 in float32 and rounds once to bf16: every rank writes the same bits.
// Once *error is set, later calls skip the waits (a dead peer costs one bound, not one per call).
// allreduce_pull is the alternative: each rank's part stays in its own buffer and every rank reads the peers'.
// allgather_push is the same collective (one numbering, one buffer, the same flags) moving bytes: rank s's
// chunk of x into data[slot][s] of every peer, then every part copied into out in rank order.
// allreduce_two_shot is reduce-scatter + all-gather over the same buffer, slots and counter, with a second flag
// round (flags[1]): rank s pushes chunk d of x into data[slot][s] of rank d, rank d sums its chunk, pushes the sum
// into data[slot][d] of every peer (at chunk d's place, which phase 1 leaves unused), and every rank copies the
// chunks into out. The protocol may change from one collective to the next, the same on every rank.
#include "common.cuh"

#ifndef AR_MAX_RANKS
#define AR_MAX_RANKS 8
#endif
#ifndef AR_MAX_BLOCKS
#define AR_MAX_BLOCKS 32
#endif
#define AR_FLAG_BYTES (2 * 2 * AR_MAX_RANKS * AR_MAX_BLOCKS * 8)

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], uint4 v) {
    float f[8];
    unpack8(v, f);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] += f[j];
}

// The collective this launch is (state[0] + 1) and whether an earlier one already lost a peer.
struct Collective {
    u64 seq;
    int slot, failed;
};
__device__ __forceinline__ Collective begin_collective(const u64* state, const int* error) {
    __shared__ u64 s_seq;
    __shared__ int s_failed;
    if (threadIdx.x == 0) {
        s_seq = *(volatile const u64*)&state[0] + 1;
        s_failed = *(volatile const int*)error;
    }
    __syncthreads();
    return Collective{s_seq, (int)(s_seq & 1), s_failed};
}

// flags[round][slot][src][block] of the exchange buffer at `buffer`.
__device__ __forceinline__ u64* flag_of(u64 buffer, int round, int slot, int src) {
    return (u64*)buffer + ((round * 2 + slot) * AR_MAX_RANKS + src) * AR_MAX_BLOCKS + blockIdx.x;
}

// After the block pushed its chunk: thread r publishes this block's flag of `round` to peer r, then waits (bounded)
// for peer r's flag of this block and round; the block's threads meet on both sides. Round 0: every protocol's
// (only) exchange; round 1: the two-shot's all-gather.
__device__ __forceinline__ void publish_and_wait(const Collective& c, const u64* peers, int rank, int nranks,
                                                 int* error, u32 max_spins, int round = 0) {
    __syncthreads();
    const int r = threadIdx.x;
    if (r < nranks && r != rank) {
        st_release_sys(flag_of(peers[r], round, c.slot, rank), c.seq);
        if (!c.failed) {
            const u64* flag = flag_of(peers[rank], round, c.slot, r);
            u32 spins = 0;
            while (ld_acquire_sys(flag) != c.seq) {
                if (++spins > max_spins) {
                    atomicOr(error, 1 << r);
                    break;
                }
                if (spins > 4096) __nanosleep(200);
            }
        }
    }
    __syncthreads();
}

// Block blockIdx.x's vectors [lo, hi) of n (the same split on every rank).
struct Span {
    u32 lo, hi;
};
__device__ __forceinline__ Span block_span(u32 n) {
    const u32 per = (n + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per;
    return Span{lo, min(n, lo + per)};
}

// src's part of `slot` in the exchange buffer at `buffer` (data[slot][src]).
__device__ __forceinline__ uint4* part_of(u64 buffer, int slot, int src, int nranks, u64 region_bytes) {
    return (uint4*)(buffer + AR_FLAG_BYTES + ((u64)slot * nranks + src) * region_bytes);
}

// The last block to finish moves the device counter on (every block has read it by then).
__device__ __forceinline__ void end_collective(const Collective& c, u64* state) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&state[1], 1ull) == gridDim.x - 1) {
            state[1] = 0;
            state[0] = c.seq;
        }
    }
}

// Vector i of the all-reduce: every rank's part summed in rank order 0..nranks-1 in float32 with one rounding to
// bf16 (plugins/allreduce.py reference_sum), the parts pushed into this rank's own buffer `own` and this rank's
// from x. Push and the two-shot's reduce-scatter both take it, so they give the same bits by construction.
__device__ __forceinline__ uint4 rank_sum(const uint4* x, u64 own, int slot, int rank, int nranks, u64 region_bytes,
                                          u32 i) {
    float acc[8];
    unpack8(rank == 0 ? x[i] : ld_cg_u4(part_of(own, slot, 0, nranks, region_bytes) + i), acc);
    for (int s = 1; s < nranks; ++s)
        add_bf16x8(acc, s == rank ? x[i] : ld_cg_u4(part_of(own, slot, s, nranks, region_bytes) + i));
    return pack8(acc);
}

// x, out: [n8] 16-byte vectors (8 bf16 each); out may be x. grid <= AR_MAX_BLOCKS, the same on every rank.
// state: [0] the last collective's seq, [1] blocks done (reset by the last block). error: bit r = peer r late.
extern "C" __global__ void __launch_bounds__(1024) allreduce_push(
        const uint4* x, uint4* out, u32 n8, const u64* __restrict__ peers, int rank, int nranks,
        u64 region_bytes, u64* state, int* error, u32 max_spins) {
    const Collective c = begin_collective(state, error);
    const Span sp = block_span(n8);

    // push: my chunk into data[slot][rank] of every peer
    for (u32 i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x) {
        const uint4 v = x[i];
        for (int d = 0; d < nranks; ++d)
            if (d != rank) part_of(peers[d], c.slot, rank, nranks, region_bytes)[i] = v;
    }
    publish_and_wait(c, peers, rank, nranks, error, max_spins);

    for (u32 i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x)
        out[i] = rank_sum(x, peers[rank], c.slot, rank, nranks, region_bytes, i);
    end_collective(c, state);
}

// The pull variant (the alternative to push; same buffer, flags, numbering and sum): block b copies its chunk of x
// into data[slot][rank] of its OWN buffer (local writes), publishes as push does, then reads each peer s's chunk from
// data[slot][s] of s's buffer (peer reads) and sums in rank order. Writes cross the link in push, reads in pull:
// on PCIe a peer read is a non-posted round trip, a peer write is posted. Double buffering holds as for push: a
// rank rewrites its slot for k + 2 only after every peer's k + 1 flag, published after that peer's kernel k (all
// its reads of slot k & 1) finished.
extern "C" __global__ void __launch_bounds__(1024) allreduce_pull(
        const uint4* x, uint4* out, u32 n8, const u64* __restrict__ peers, int rank, int nranks,
        u64 region_bytes, u64* state, int* error, u32 max_spins) {
    const Collective c = begin_collective(state, error);
    const Span sp = block_span(n8);
    uint4* own = part_of(peers[rank], c.slot, rank, nranks, region_bytes);
    for (u32 i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x) own[i] = x[i];
    publish_and_wait(c, peers, rank, nranks, error, max_spins);

    for (u32 i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x) {
        uint4 parts[AR_MAX_RANKS];                           // every peer read in flight before the sum
#pragma unroll
        for (int s = 0; s < AR_MAX_RANKS; ++s)
            if (s < nranks) parts[s] = s == rank ? x[i] : ld_cg_u4(part_of(peers[s], c.slot, s, nranks, region_bytes) + i);
        float acc[8];
        unpack8(parts[0], acc);
#pragma unroll
        for (int s = 1; s < AR_MAX_RANKS; ++s)
            if (s < nranks) add_bf16x8(acc, parts[s]);
        out[i] = pack8(acc);
    }
    end_collective(c, state);
}

// Block blockIdx.x's vectors of chunk k (chunk: vectors a chunk, the last cut at n8, perhaps empty): the block's
// share [lo, hi) of every chunk is the same, block_span's split of `chunk`.
__device__ __forceinline__ Span chunk_span(u32 k, u32 chunk, u32 n8) {
    const u32 per = (chunk + gridDim.x - 1) / gridDim.x, lo = min(chunk, blockIdx.x * per);
    const u32 start = min(n8, k * chunk);
    return Span{min(n8, start + lo), min(n8, start + min(chunk, lo + per))};
}

// Two-shot (reduce-scatter + all-gather; the same buffer, slots, counter, error word and sum as push). The n8 vectors
// are cut into nranks chunks of `chunk` = ceil(n8 / nranks) vectors (the last shorter or empty); block b owns
// vectors [lo, hi) of every chunk (the same split on every rank, so block b of every rank touches the same cells).
// Phase 1 (flag round 0): push chunk d of x into data[slot][rank] of rank d, at chunk d's place; wait; sum this
// rank's chunk over every rank's part in rank order, one rounding, into out and into data[slot][rank] of every peer,
// at this rank's chunk's place (phase 1 writes only chunk d's place of rank d's buffer, so the two never meet).
// Phase 2 (flag round 1): wait; copy every peer s's summed chunk from data[slot][s] into out. out may be x: the cell
// (block b, chunk c) of x is read and of out written by block b only, reads first.
extern "C" __global__ void __launch_bounds__(1024) allreduce_two_shot(
        const uint4* x, uint4* out, u32 n8, const u64* __restrict__ peers, int rank, int nranks,
        u64 region_bytes, u64* state, int* error, u32 max_spins) {
    const Collective c = begin_collective(state, error);
    const u32 chunk = (n8 + nranks - 1) / nranks;

    for (int d = 0; d < nranks; ++d) {      // reduce-scatter: chunk d of x to rank d
        if (d == rank) continue;
        uint4* dst = part_of(peers[d], c.slot, rank, nranks, region_bytes);
        const Span sp = chunk_span(d, chunk, n8);
        for (u32 i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x) dst[i] = x[i];
    }
    publish_and_wait(c, peers, rank, nranks, error, max_spins, 0);

    const Span mine = chunk_span(rank, chunk, n8);
    for (u32 i = mine.lo + threadIdx.x; i < mine.hi; i += blockDim.x) {   // my chunk: summed, to every rank
        const uint4 v = rank_sum(x, peers[rank], c.slot, rank, nranks, region_bytes, i);
        out[i] = v;
        for (int d = 0; d < nranks; ++d)
            if (d != rank) part_of(peers[d], c.slot, rank, nranks, region_bytes)[i] = v;
    }
    publish_and_wait(c, peers, rank, nranks, error, max_spins, 1);

    for (int s = 0; s < nranks; ++s) {      // all-gather: every peer's summed chunk into out
        if (s == rank) continue;
        const uint4* src = part_of(peers[rank], c.slot, s, nranks, region_bytes);
        const Span sp = chunk_span(s, chunk, n8);
        for (u32 i = sp.lo + threadIdx.x; i < sp.hi; i += blockDim.x) out[i] = ld_cg_u4(src + i);
    }
    end_collective(c, state);
}

// Bytes [lo, hi) of src into dst in units of T: lo, hi multiples of sizeof(T), both addresses aligned to it.
// Loads bypass L1 (ld.global.cg): a peer wrote the exchange buffer.
template <typename T>
__device__ __forceinline__ void copy_units(char* dst, const char* src, u32 lo, u32 hi) {
    for (u32 i = lo / sizeof(T) + threadIdx.x; i < hi / sizeof(T); i += blockDim.x)
        ((T*)dst)[i] = __ldcg((const T*)src + i);
}
__device__ __forceinline__ void copy_bytes(char* dst, const char* src, u32 lo, u32 hi, int unit) {
    switch (unit) {
        case 16: copy_units<uint4>(dst, src, lo, hi); break;
        case 8: copy_units<unsigned long long>(dst, src, lo, hi); break;
        case 4: copy_units<unsigned int>(dst, src, lo, hi); break;
        case 2: copy_units<unsigned short>(dst, src, lo, hi); break;
        default: copy_units<unsigned char>(dst, src, lo, hi);
    }
}

// out [nranks, nbytes] = every rank's x [nbytes] in rank order (any dtype: bytes). Block b owns bytes
// [b * per16 * 16, (b + 1) * per16 * 16) of every part, cut at nbytes (per16: the 16-byte vectors of a block),
// the same on every rank; it moves them in `unit`-byte words (16, 8, 4, 2 or 1: the launcher's largest that
// divides nbytes and aligns x and out on this rank; ranks may differ in it). x may be out's part `rank` (in
// place); otherwise they do not overlap. nbytes <= region_bytes; grid <= AR_MAX_BLOCKS, the same on every rank.
extern "C" __global__ void __launch_bounds__(1024) allgather_push(
        const char* x, char* out, u32 nbytes, int unit, const u64* __restrict__ peers, int rank, int nranks,
        u64 region_bytes, u64* state, int* error, u32 max_spins) {
    const Collective c = begin_collective(state, error);
    const u32 per16 = ((nbytes + 15) / 16 + gridDim.x - 1) / gridDim.x;      // 16-byte vectors a block
    const u32 lo = min(nbytes, blockIdx.x * per16 * 16), hi = min(nbytes, lo + per16 * 16);

    for (int d = 0; d < nranks; ++d)      // push: my chunk into data[slot][rank] of every peer
        if (d != rank)
            copy_bytes((char*)peers[d] + AR_FLAG_BYTES + ((u64)c.slot * nranks + rank) * region_bytes, x, lo, hi, unit);
    publish_and_wait(c, peers, rank, nranks, error, max_spins);

    const char* mine = (const char*)peers[rank] + AR_FLAG_BYTES + (u64)c.slot * nranks * region_bytes;
    for (int s = 0; s < nranks; ++s)      // every part's chunk, in rank order
        copy_bytes(out + (u64)s * nbytes, s == rank ? x : mine + s * region_bytes, lo, hi, unit);
    end_collective(c, state);
}

// Ranks that share one process and one GPU (parallel/cuda_collectives.py): out = the float32 sum of parts[0..nranks-1]
// in rank order, rounded once to bf16: the bits allreduce_push gives. parts: nranks addresses of [n8] vectors.
extern "C" __global__ void allreduce_sum_local(const u64* __restrict__ parts, int nranks, uint4* out, u32 n8) {
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += gridDim.x * blockDim.x) {
        float acc[8];
        unpack8(((const uint4*)parts[0])[i], acc);
        for (int r = 1; r < nranks; ++r) add_bf16x8(acc, ((const uint4*)parts[r])[i]);
        out[i] = pack8(acc);
    }
}

// Probe: `rounds` round trips of a system-scope flag between two GPUs (thread 0 of one block on each).
// The first side stores k into *peer_flag and waits for *my_flag == k; the other waits, then answers.
// Values are base + k (base: a number larger than any earlier run's, so one buffer serves many probes).
// ns_out[0] = mean round trip in ns (first side), *error = 1 when a wait passed max_spins polls.
extern "C" __global__ void allreduce_pingpong(u64* my_flag, u64* peer_flag, int first, u64 base, u32 rounds,
                                              u32 max_spins, int* error, u64* ns_out) {
    if (threadIdx.x != 0) return;
    const u64 t0 = global_ns();
    for (u32 k = 1; k <= rounds; ++k) {
        if (first) st_release_sys(peer_flag, base + k);
        u32 spins = 0;
        while (ld_acquire_sys(my_flag) != base + k) {
            if (++spins > max_spins) {
                *error = 1;
                return;
            }
        }
        if (!first) st_release_sys(peer_flag, base + k);
    }
    ns_out[0] = (global_ns() - t0) / rounds;
}
