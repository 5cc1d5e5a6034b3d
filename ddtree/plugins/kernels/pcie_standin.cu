// A PCIe collective's stand-in on one GPU (plugins/pcie_standin.py PcieStandin; ddtree bench step --collectives
// pcie): the bytes a real one-shot would land in this rank move once through global memory, and the kernel keeps
// the SMs a one-shot occupies until the modelled time of the collective has passed, so whatever the step overlaps
// with it, it overlaps for real. It computes nothing (out = `copies` copies of x, in rank-slot order).
//
// Each block reads %globaltimer (ns) when it starts, copies its share with 16-byte vectors (grid-stride), then
// waits with __nanosleep until hold_ns have passed since its own start. The blocks of one launch start within
// a few hundred ns of each other, so the kernel lasts hold_ns plus that skew (the test holds it to 10 %).
#include "common.cuh"

// x: n16 16-byte vectors; out: copies x n16 vectors (copy c at c * n16). hold_ns: the modelled collective time.
extern "C" __global__ void pcie_standin(const uint4* __restrict__ x, uint4* __restrict__ out, u64 n16, u32 copies,
                                        u64 hold_ns) {
    const u64 t0 = global_ns();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
        const uint4 v = x[i];
        for (u32 c = 0; c < copies; ++c) out[c * n16 + i] = v;
    }
    if (threadIdx.x == 0) {                    // one thread a block holds it; the others leave (as a one-shot's
        while (global_ns() - t0 < hold_ns)     // waiting blocks do: their warps parked on a flag poll)
            __nanosleep(256);
    }
}
