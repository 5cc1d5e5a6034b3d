// Benchmark/test data on the device: fill a buffer with hashed random words (no host round trip).
#include "common.cuh"

// p[i] = (splitmix64(seed, i) & mask) | bits_or, for i < n (u32 words).
extern "C" __global__ void fill_hash_u32(u32* __restrict__ p, u64 n, u32 seed, u32 mask, u32 bits_or) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 z = (i + 1) * 0x9E3779B97F4A7C15ull + ((u64)seed << 32);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        p[i] = ((u32)(z >> 32) & mask) | bits_or;
    }
}
