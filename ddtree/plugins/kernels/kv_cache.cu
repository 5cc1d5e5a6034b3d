// The latent KV cache on the device (docs/interfaces.md section 3): per layer [capacity, DK] bf16, c_kv (DL)
// then k_pe (DR) per token, layers `layer_stride` elements apart. Numpy twin: ddtree/reference/cache.py.
// DL = MLA_DL, DR = MLA_DR: NVRTC defines (ddtree/plugins/compile.py latent_defines; Kimi 512 / 64 / 576).
#include "common.cuh"

#if !defined(MLA_DL) || !defined(MLA_DR)
#error "compile with -D MLA_DL=<kv_lora_rank> -D MLA_DR=<qk_rope_head_dim> (ddtree/plugins/compile.py latent_defines)"
#endif
static_assert(MLA_DL % 8 == 0 && MLA_DR % 8 == 0, "entries move in 16-byte vectors");
#define KV_DK (MLA_DL + MLA_DR)
#define KV_VECS (KV_DK / 8)                 // 16-byte vectors per entry (Kimi: 72)
#define KV_LAT_VECS (MLA_DL / 8)            // of which c_kv (Kimi: 64)

// Append q new entries of one layer at slots start .. start + q - 1 (start = lengths[0], on the device,
// so a captured graph appends wherever the cache ends). c_kv [q, c_stride >= DL], k_pe [q, k_stride >= DR]
// bf16 rows (strides let them be column slices of one [q, DK] projection output).
// Grid q, block KV_VECS rounded up to a warp (Kimi: 96, 72 active: one 16-byte vector each).
extern "C" __global__ void kv_append(bf16_t* __restrict__ cache, const int* __restrict__ lengths,
                                     const bf16_t* __restrict__ c_kv, int c_stride,
                                     const bf16_t* __restrict__ k_pe, int k_stride) {
    pdl_wait();
    pdl_trigger();
    const int i = blockIdx.x, v = threadIdx.x;
    if (v >= KV_VECS) return;
    const int start = ld_cg_s32(lengths);
    const uint4* src = v < KV_LAT_VECS ? (const uint4*)(c_kv + (size_t)i * c_stride) + v
                                       : (const uint4*)(k_pe + (size_t)i * k_stride) + (v - KV_LAT_VECS);
    ((uint4*)(cache + (size_t)(start + i) * KV_DK))[v] = *src;
}

// After acceptance: entry start + keep[i] moves to start + i for i < n (keep strictly increasing, so
// keep[i] >= i), in every layer. Sources and destinations overlap (keep = [1, 2] moves 1 -> 0 and 2 -> 1),
// so one block owns one 16-byte column of one layer for all n entries: it reads the whole column into
// registers, synchronises, then writes. Nothing is read after any write to it and no two blocks touch
// the same bytes, so the result never depends on scheduling. Grid (KV_VECS, layers), block >= n (n <= 1024).
// start = lengths[0] (the committed prefix before the tree); the new length is start + n (set by the host
// or the next step's length update, not here). count: null, or a device int (the acceptance walk's output
// inside a captured graph): then min(n, *count) entries move, n being the block size the host launched.
extern "C" __global__ void kv_compact(bf16_t* __restrict__ cache, size_t layer_stride, const int* __restrict__ lengths,
                                      const int* __restrict__ keep, int n, const int* __restrict__ count) {
    pdl_wait();
    pdl_trigger();
    const int v = blockIdx.x, i = threadIdx.x;
    const int n_used = count ? min(n, ld_cg_s32(count)) : n;
    uint4* base = (uint4*)(cache + (size_t)blockIdx.y * layer_stride + (size_t)ld_cg_s32(lengths) * KV_DK) + v;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    int src = -1;
    if (i < n_used) {
        src = ld_cg_s32(&keep[i]);
        value = base[(size_t)src * KV_VECS];
    }
    __syncthreads();
    if (i < n_used && src != i) base[(size_t)i * KV_VECS] = value;
}

// The MLA's kv_a output appended as the op set composes it (description/opset.py Ops.kv_append_normed): entry
// start + i = (rms_norm(latent[i, :DL]) * w | rope_interleaved(latent[i, DL:], pos[i])), one launch instead of
// rms_norm_rows + rope_interleaved + kv_append. latent [q, l_stride >= DK] bf16 (the projection output), w [DL],
// pos [q] int32, table [max_pos, DR/2] float2 (layer_ops.RopeTable). The same arithmetic as those kernels, so the
// same bits: threads [0, DL/8) hold one 16-byte vector of c_kv each (rms_norm_rows' one vector a thread at
// DL/8 <= its 256 threads; the rope warps add zeros to the block sum, which leaves every partial as it was),
// threads [NORM_THREADS, NORM_THREADS + DR/2) turn one pair each (rope<true>'s formula; a position outside
// [0, max_pos) writes NaN). Grid q, block NORM_THREADS + DR/2 rounded up to a warp (Kimi: 64 + 32 = 96).
#define NORM_THREADS (32 * ((KV_LAT_VECS + 31) / 32))
static_assert(KV_LAT_VECS <= 256, "one c_kv vector a thread, as rms_norm_rows at <= 256 threads");

__device__ __forceinline__ float kv_block_sum(float v) {     // layer_ops.cu block_sum: the same shuffle order
    __shared__ float part[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void kv_append_normed(bf16_t* __restrict__ cache, const int* __restrict__ lengths,
                                            const bf16_t* __restrict__ latent, int l_stride,
                                            const bf16_t* __restrict__ w, float eps, const int* __restrict__ pos,
                                            const float2* __restrict__ table, int max_pos) {
    pdl_wait();
    pdl_trigger();
    const int i = blockIdx.x, t = threadIdx.x;
    const bf16_t* row = latent + (size_t)i * l_stride;
    bf16_t* entry = cache + (size_t)(ld_cg_s32(lengths) + i) * KV_DK;
    float f[8];
    float ss = 0.f;
    if (t < KV_LAT_VECS) {
        unpack8(((const uint4*)row)[t], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) ss += f[j] * f[j];
    }
    const float inv = rsqrtf(kv_block_sum(ss) / (float)MLA_DL + eps);
    if (t < KV_LAT_VECS) {
        float g[8];
        unpack8(((const uint4*)w)[t], g);
#pragma unroll
        for (int j = 0; j < 8; ++j) f[j] = g[j] * (f[j] * inv);
        ((uint4*)entry)[t] = pack8(f);
    }
    const int pair = t - NORM_THREADS;
    if (pair >= 0 && pair < MLA_DR / 2) {
        const int p = pos[i];
        float ya, yb;
        if (p < 0 || p >= max_pos) {
            ya = yb = __int_as_float(0x7fc00000);
        } else {
            const float2 cs = table[(size_t)p * (MLA_DR / 2) + pair];
            const float a = bf16_to_f32(row[MLA_DL + 2 * pair]), b = bf16_to_f32(row[MLA_DL + 2 * pair + 1]);
            ya = a * cs.x - b * cs.y;
            yb = a * cs.y + b * cs.x;
        }
        entry[MLA_DL + 2 * pair] = f32_to_bf16(ya);
        entry[MLA_DL + 2 * pair + 1] = f32_to_bf16(yb);
    }
}
