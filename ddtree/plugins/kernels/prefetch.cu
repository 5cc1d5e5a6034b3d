// Stage bytes in L2 ahead of the kernel that reads them (plugins/prefetch.py L2Prefetch; the cuda backend's
// ops.prefetch: the next GEMMs' weights while the latency-bound tree attention runs).
//
// cp.async.bulk.prefetch.L2 (sm_90+): the L2 fetches [p, p + len) from DRAM on its own; the issuing thread does
// not wait and no SM holds the bytes, so the kernel ends in a few us while the fill goes on beside whatever runs
// next. A prefetch never changes a value: it only moves lines into L2 (a later reader hits or misses).
#include "common.cuh"

// Up to four buffers in one launch (the weights one layer reads next): chunk c of the concatenation goes to
// thread c; buffer b holds ceil(n_b / chunk) chunks, its last clipped to n_b. Every p_b 16-byte aligned, n_b and
// chunk multiples of 16, n_b = 0 for an unused slot (the launcher checks).
extern "C" __global__ void l2_prefetch(const unsigned char* __restrict__ p0, u64 n0, const unsigned char* __restrict__ p1,
                                       u64 n1, const unsigned char* __restrict__ p2, u64 n2,
                                       const unsigned char* __restrict__ p3, u64 n3, u32 chunk) {
    const unsigned char* p[4] = {p0, p1, p2, p3};
    const u64 n[4] = {n0, n1, n2, n3};
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        const u64 chunks = (n[b] + chunk - 1) / chunk;
        if (c < chunks) {
            const u64 at = c * chunk;
            const u32 len = (u32)min((u64)chunk, n[b] - at);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p[b] + at), "r"(len) : "memory");
            return;
        }
        c -= chunks;
    }
}

// The address translations of up to four buffers made ready ahead of a reader whose addresses are not known yet
// (the routed experts: which of a layer's 384 experts a token reads is decided by the router, on the chain): one
// 4-byte load every `stride` bytes (a page), the buffers' pages numbered as l2_prefetch numbers its chunks (that
// kernel is left as measured, so the walk is written twice), a thread a page. The TLB entry of each page stays
// behind for the reader; the loaded words are dropped (no value anywhere changes). A diagnosis kernel
// (plugins/prefetch.py PageTouch, tests/plugins/profile_moe_pages.py): measured, not in the step.
extern "C" __global__ void touch_pages(const unsigned char* __restrict__ p0, u64 n0, const unsigned char* __restrict__ p1,
                                       u64 n1, const unsigned char* __restrict__ p2, u64 n2,
                                       const unsigned char* __restrict__ p3, u64 n3, u64 stride) {
    const unsigned char* p[4] = {p0, p1, p2, p3};
    const u64 n[4] = {n0, n1, n2, n3};
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        const u64 pages = (n[b] + stride - 1) / stride;
        if (c < pages) {
            u32 v;
            asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p[b] + c * stride) : "memory");
            return;
        }
        c -= pages;
    }
}
