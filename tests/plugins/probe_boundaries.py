"""What one kernel boundary costs on this GPU, against a grid barrier inside one persistent kernel (issue 22,
kernel boundaries: is a layer as one persistent kernel worth building?). H200 device script, not a test.

    python3 tests/plugins/probe_boundaries.py [--chain 200] [--json]

Chains of `chain` dependent steps, each step reading the previous step's 17 x 7168 bf16 rows (L2-resident) and
writing its own (an add of one: the size of the step's small kernels), on one block a SM x 256 threads, timed as
graph replays; each also with no elements (n 0: the boundary alone):
  pdl      one launch a step, programmatic dependent launch (griddepcontrol wait first)
  plain    the same launches in plain stream order
  barrier  one persistent launch, the steps separated by a grid barrier (release / acquire atomics on one
           counter, bounded spin)
Each prints us a step = (replay us) / chain.
"""
import json
import sys

import numpy as np

SRC = r"""
typedef unsigned short bf16_t;
__device__ __forceinline__ float bf(bf16_t v) { return __uint_as_float((unsigned)v << 16); }
__device__ __forceinline__ bf16_t to_bf(float f) { unsigned u = __float_as_uint(f); return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }

// one step: y[r, c] = x[r, c] + 1 over rows x cols, the threads of the grid striding over it
__device__ __forceinline__ void step(const bf16_t* x, bf16_t* y, int n, int tid, int threads) {
    for (int i = tid; i < n; i += threads) y[i] = to_bf(bf(__ldcg(x + i)) + 1.f);
}

extern "C" __global__ void step_pdl(const bf16_t* x, bf16_t* y, int n) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    step(x, y, n, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

// steps in one launch; bar counts arrivals (monotonic: step s waits for (s + 1) * gridDim.x)
extern "C" __global__ void steps_barrier(bf16_t* a, bf16_t* b, int n, int steps, unsigned* bar, int* err) {
    const int tid = blockIdx.x * blockDim.x + threadIdx.x, threads = gridDim.x * blockDim.x;
    for (int s = 0; s < steps; ++s) {
        step(s & 1 ? b : a, s & 1 ? a : b, n, tid, threads);
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned target = (unsigned)(s + 1) * gridDim.x, v;
            asm volatile("atom.add.release.gpu.u32 %0, [%1], 1;" : "=r"(v) : "l"(bar) : "memory");
            long long spins = 0;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
            } while (v < target && ++spins < (1ll << 26));
            if (v < target) atomicExch(err, 1);
        }
        __syncthreads();
    }
}
"""


def main(argv):
    chain = int(argv[argv.index("--chain") + 1]) if "--chain" in argv else 200
    from cuda.core import LaunchConfig, Program, ProgramOptions, launch

    from ddtree.plugins.device import Gpu
    gpu = Gpu(0)
    mod = Program(SRC, "c++", ProgramOptions(arch=gpu.arch, std="c++17")).compile("cubin")
    k_pdl, k_bar = mod.get_kernel("step_pdl"), mod.get_kernel("steps_barrier")
    rows, cols = 17, 7168
    n = rows * cols
    a, b = gpu.alloc((n,), np.uint16), gpu.alloc((n,), np.uint16)
    bar, err = gpu.alloc((1,), np.uint32), gpu.alloc((1,), np.int32)
    gpu.memset(err, 0)
    out = {"device": gpu.name, "chain": chain, "rows": rows, "cols": cols}

    sms = gpu.sm_count

    def chain_of(pdl, elems):
        def body(s):
            for i in range(chain):
                src, dst = (a, b) if i % 2 == 0 else (b, a)
                launch(s, LaunchConfig(grid=sms, block=256, programmatic_stream_serialization=pdl), k_pdl,
                       np.uint64(src.ptr), np.uint64(dst.ptr), np.int32(elems))
        return gpu.capture(body)

    def persistent(elems):
        launch(gpu.stream, LaunchConfig(grid=sms, block=256), k_bar, np.uint64(a.ptr), np.uint64(b.ptr),
               np.int32(elems), np.int32(chain), np.uint64(bar.ptr), np.uint64(err.ptr))

    for elems, tag in ((n, ""), (0, "_empty")):
        for name, pdl in (("pdl", True), ("plain", False)):
            g = chain_of(pdl, elems)
            gpu.replay(g)
            t = gpu.timed_ms(lambda: gpu.replay(g), 7)
            out[f"{name}{tag}_us_per_step"] = 1e3 * float(np.median(t)) / chain
        times = []
        for _ in range(7):
            gpu.memset(bar, 0)
            times += gpu.timed_ms(lambda: persistent(elems), 1)
        out[f"barrier{tag}_us_per_step"] = 1e3 * float(np.median(times)) / chain
    out["barrier_errors"] = int(err.numpy()[0])
    print(json.dumps(out) if "--json" in argv else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
