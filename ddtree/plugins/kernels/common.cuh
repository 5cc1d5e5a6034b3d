// Shared device helpers for ddtree kernels (compiled with NVRTC for sm_90 and sm_120).
//
// No CUDA headers: bf16 values travel as their uint16 bit patterns (like ddtree/model/bf16.py), and
// the few instructions we need (bf16 conversion, mma.sync, cp.async) are written as inline PTX, so
// the kernels compile with a bare NVRTC and no toolkit include directory.
//
// Fragment conventions of mma.sync.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"):
//   lane = 4 * g + t  (g = groupID 0..7, t = thread in group 0..3)
//   A (16x16, row-major) regs: a0 = (row g,   k 2t..2t+1)   a1 = (row g+8, k 2t..2t+1)
//                              a2 = (row g,   k 2t+8..+9)   a3 = (row g+8, k 2t+8..+9)
//   B (16x8, k x n)      regs: b0 = (k 2t..2t+1, col g)     b1 = (k 2t+8..2t+9, col g)
//   C (16x8)                  c0,c1 = (row g, cols 2t, 2t+1)   c2,c3 = (row g+8, cols 2t, 2t+1)
// Our kernels put weight rows in A (16 output channels) and up to 8 tokens in B, and read k in the
// permuted order described in ddtree/plugins/layout.py so that every lane loads 16 contiguous bytes.
#pragma once

typedef unsigned short bf16_t;     // bf16 bit pattern
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef DD_WARPS
#define DD_WARPS 8                 // default warps per block of the skinny GEMM (its launcher's plan default)
#endif
#ifndef DD_STAGES
#define DD_STAGES 8                // cp.async ring depth per warp of the skinny GEMM (the MoE rings are templates)
#endif

#define DD_NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf16_to_f32(bf16_t b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ float bf16lo_to_f32(u32 p) { return __uint_as_float(p << 16); }
__device__ __forceinline__ float bf16hi_to_f32(u32 p) { return __uint_as_float(p & 0xffff0000u); }

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {        // round to nearest even
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// D = A * B + C, bf16 inputs, fp32 accumulate.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One repacked INT4 word -> the four A registers of one m16n8k16 step, biased by +136.
// Register j takes nibbles j (low half) and j + 4 (high half): (w >> 4j) & 0x000F000F puts them in the
// mantissas of two bf16 equal to 128 + u = (u - 8) + 136 (magic 0x4300), exactly. The -136 is not
// subtracted here (that was one fma.bf16x2 per register): the caller starts the mma accumulator at
// -136 * sum(x over the k group), so the mma itself removes the bias (w4_mainloop in moe.cu).
// `mask` = 0x000F000F (a parameter so the caller can keep it in one register).
__device__ __forceinline__ void int4_word_biased(u32 w, u32 (&a)[4], u32 mask) {
#pragma unroll
    for (int j = 0; j < 4; ++j) a[j] = ((w >> (4 * j)) & mask) | 0x43004300u;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ u64 evict_first_policy() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}

// Weights are streamed once: bypass L1 and mark them evict-first in L2.
__device__ __forceinline__ void cp_async16_stream(void* dst, const void* src, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "l"(policy) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_addr(dst)), "l"(src) : "memory");
}
// ---- bulk copies (TMA engine, sm_90+) completing on an mbarrier -------------------------------------
// One thread arms the barrier with the bytes to come (mbar_expect_tx), then any threads issue copies; a
// consumer waits for the phase with parity (use count & 1). The copy engine moves the bytes, so the
// issuing threads spend a few instructions per row instead of one cp.async per 16 bytes.
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {      // make the inits visible to the copy engine
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nWAIT_LOOP:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_LOOP;\n}" :: "r"(smem_addr(bar)), "r"(parity) : "memory");
}
// Order this thread's earlier shared-memory accesses (generic proxy) before later bulk copies into it.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// Zero-fill variant: copies src_bytes (0 or 16) and fills the rest of the 16 bytes with zeros.
__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// ldmatrix: lane l gives the address of row (l & 7) of 8x8 matrix (l >> 3); register i of every lane gets
// matrix i's (row lane / 4, cols 2 (lane % 4) .. +1), or with .trans its (rows 2 (lane % 4) .. +1, col lane / 4).
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {     // lo in the low half (lower address)
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void unpack8(uint4 u, float (&f)[8]) {      // 8 bf16 (16 bytes) -> fp32
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) { f[2 * j] = bf16lo_to_f32(w[j]); f[2 * j + 1] = bf16hi_to_f32(w[j]); }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {         // fp32 -> 8 bf16, each rounded once
    return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                      pack_bf16x2(f[6], f[7]));
}
// Named barrier among `threads` threads (a multiple of 32) of the block; id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ uint4 ld_cg_u4(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float4 ld_cg_f4(const float4* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float ld_cg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ u64 ld_cg_u64(const u64* p) {
    u64 v;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ int ld_cg_s32(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Programmatic dependent launch (PTX griddepcontrol, sm_90+; both are no-ops when the kernel was launched
// without the programmatic-serialization attribute). wait: block until the previous kernel in the stream
// has completed and its writes are visible. trigger: let the next kernel's blocks be scheduled (they run
// their own prologue, then wait). Every kernel here triggers only after its own wait, so a kernel that
// starts early can still rely on everything *two* launches back being complete and visible (read such
// data with ld.global.cg before the wait).
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// Thread block clusters (sm_90+): a cluster-wide barrier with release / acquire of shared and global memory, this
// block's rank in its cluster, and a float4 load from block `rank`'s shared memory at this block's address `local`.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ int cluster_ctarank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
}
__device__ __forceinline__ float4 ld_dsmem_f4(u32 local, int rank) {
    u32 remote;
    float4 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(remote) : "memory");
    return v;
}

// sum += the S split-K partials load(0), load(1), ... in split order (the fixed order every reduction here keeps:
// bitwise the plain loop's sum), their loads issued B at a time. sum is float[4] (a float4 load: the GEMMs' and the
// MoE's tails) or one float (the router's logits). The plain loop over a runtime S, unrolled by 4, waited one L2
// round trip every 4 partials: 7 of them for the shared expert's 28 k-splits at one row.
__device__ __forceinline__ void add_partial(float (&sum)[4], float4 v) {
    sum[0] += v.x; sum[1] += v.y; sum[2] += v.z; sum[3] += v.w;
}
__device__ __forceinline__ void add_partial(float& sum, float v) { sum += v; }

template <int B, class Sum, class Load>
__device__ __forceinline__ void sum_partials(Sum& sum, int S, Load load) {
    for (int s0 = 0; s0 < S; s0 += B) {
        decltype(load(0)) v[B];
#pragma unroll
        for (int i = 0; i < B; ++i) v[i] = load(min(s0 + i, S - 1));   // past S: a repeat, not added (no branch)
#pragma unroll
        for (int i = 0; i < B; ++i)
            if (s0 + i < S) add_partial(sum, v[i]);
    }
}

// Split-K / combine hand-off without a second launch: every contributing block publishes its
// partial results, then takes a ticket; the block that takes the last ticket reads all partials in a
// fixed order (so the sum is deterministic) and resets the counter for the next graph replay.
// Must be called by every thread of the block; returns true in the last block.
// One thread takes the ticket after the barrier (the pattern of CUTLASS's split-K semaphore) with one acq_rel
// atomic: bar.sync orders the block's partial stores before thread 0's release, which is cumulative (PTX memory
// model), so the ticket publishes them all; on the last ticket its acquire orders the other blocks' published
// partials before the barrier that releases this block's readers (which read them with ld.global.cg, never L1).
// The counter's reset is a relaxed store: no block of this grid takes a ticket after the last, and the next grid
// to use it starts after this one completes. Before, a fence.sc before a relaxed atomic and another after the
// reset did the same ordering with two more drains on the chain. A fence in every thread made each warp wait on
// its own drain (ncu: membar stalls in moe_down, NOTES "MoE streaming").
#ifndef DD_FENCE_ALL_THREADS
#define DD_FENCE_ALL_THREADS 0       // 1: adds back the fence in every thread of the kernels before 2026-12-02 (A/B)
#endif
// One thread's ticket (after the block's barrier): the acq_rel add, and the relaxed reset by the last taker.
__device__ __forceinline__ bool take_last_ticket(u32* counter, u32 expected) {
    u32 prev;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(counter) : "memory");
    const bool last = prev == expected - 1;
    if (last) asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" :: "l"(counter) : "memory");
    return last;
}

__device__ __forceinline__ bool arrive_last(u32* counter, u32 expected) {
    __shared__ int s_last;
#if DD_FENCE_ALL_THREADS
    __threadfence();
#endif
    __syncthreads();
    if (threadIdx.x == 0) s_last = take_last_ticket(counter, expected);
    __syncthreads();
#if DD_FENCE_ALL_THREADS
    if (s_last) __threadfence();
#endif
    return s_last;
}
