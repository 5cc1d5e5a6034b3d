// Phase stamps of the MoE kernels inside the step (diagnosis builds only: -D DD_STEP_STAMPS, set by
// tests/plugins/profile_step_stamps.py; without it every macro below is empty and the kernels are the plain ones).
// Thread 0 of each block notes %globaltimer at up to six points of its kernel (STAMP(i): slots of one shared array
// a block, so a phase inside a helper function lands in the same record), then STAMP_COMMIT(tag) appends one record
// {tag, block, t[6]} to this module's ring (dd_stamp_ring, dd_stamp_count: read back by name, cuLibraryGetGlobal).
// Unset slots stay 0. Tags: 1 the fused router, 2 moe_gate_up, 3 moe_down_cols, 4 moe_route (a given routing's
// alignment: `bench moe`).
#pragma once
#include "common.cuh"

#ifdef DD_STEP_STAMPS
#define DD_STAMP_RING (1 << 18)
struct StampRecord {
    u32 tag, block;
    u64 t[6];
};
extern "C" __device__ StampRecord dd_stamp_ring[DD_STAMP_RING];
extern "C" __device__ u32 dd_stamp_count;
__device__ StampRecord dd_stamp_ring[DD_STAMP_RING];
__device__ u32 dd_stamp_count;

__device__ __forceinline__ u64* stamp_slots() {
    __shared__ u64 slots[6];
    return slots;
}
__device__ __forceinline__ void stamp_at(int i) {
    if (threadIdx.x == 0) {
        if (i == 0)
            for (int k = 1; k < 6; ++k) stamp_slots()[k] = 0;
        stamp_slots()[i] = global_ns();
    }
}
__device__ __forceinline__ void stamp_commit(u32 tag) {
    if (threadIdx.x != 0) return;
    const u32 at = atomicAdd(&dd_stamp_count, 1u) & (DD_STAMP_RING - 1);
    StampRecord r;
    r.tag = tag;
    r.block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    for (int k = 0; k < 6; ++k) r.t[k] = stamp_slots()[k];
    dd_stamp_ring[at] = r;
}
#define STAMP(i) stamp_at(i)
#define STAMP_COMMIT(tag) stamp_commit(tag)
#else
#define STAMP(i) do {} while (0)
#define STAMP_COMMIT(tag) do {} while (0)
#endif
