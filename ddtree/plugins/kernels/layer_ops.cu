// The small per-layer kernels of the op set (ddtree/description/opset.py): embedding gather, RMSNorm, add + RMSNorm, add,
// interleaved (YaRN) and rotate-half rope, per-head RMSNorm, SiLU * up, row gather, fp32 -> bf16 cast.
// Launchers: ddtree/plugins/layer_ops.py (LayerOps, RopeTable). Numpy twins: ddtree/plugins/reference.py
// (embed, rms_norm, add_rms_norm, rope_interleaved, rope_rotate_half, head_rms_norm, silu_mul, gather_rows,
// ddtree/model/bf16.py f32_to_bf16 for the cast; add_rows is add_rms_norm's residual).
//
// bf16 storage, fp32 math, one round to bf16 per output (cvt.rn: nearest even). Per-step values (positions,
// gathered rows, ids) are read from device buffers, so one captured graph serves every step. Every kernel
// waits for the previous one in the stream (griddepcontrol.wait) before reading anything, then lets the next
// one start (programmatic dependent launch; no-ops without the launch attribute).
// Reductions run in a fixed order (warp shuffles, then warp 0 over the warps' sums): same bits every run.
#include "common.cuh"
#include "rope.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the total. Call once per kernel.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    v = warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
    return warp_sum(v);
}

// ---- embedding -----------------------------------------------------------------------------------------
// out[t, :] = table[ids[t] - vocab_start, :] when that row is this rank's ([0, vocab_rows)), zeros otherwise
// (another rank holds it; the all-reduce adds it). table [vocab_rows, H], out [q, H] bf16, H % 8 == 0.
// Grid q, block <= 256 threads over the H / 8 16-byte vectors of a row.
extern "C" __global__ void embed_rows(const int* __restrict__ ids, const bf16_t* __restrict__ table,
                                      int vocab_start, int vocab_rows, bf16_t* __restrict__ out, int H) {
    pdl_wait();
    pdl_trigger();
    const int t = blockIdx.x, nv = H >> 3;
    const int row = ids[t] - vocab_start;                       // int: ids and vocab_start < 2^31
    const bool mine = row >= 0 && row < vocab_rows;
    const uint4* src = (const uint4*)(table + (size_t)(mine ? row : 0) * H);
    uint4* dst = (uint4*)(out + (size_t)t * H);
    for (int v = threadIdx.x; v < nv; v += blockDim.x) dst[v] = mine ? src[v] : make_uint4(0u, 0u, 0u, 0u);
}

// ---- RMSNorm over rows ---------------------------------------------------------------------------------
// out[r, :] = w * x[r, :] / sqrt(mean(x[r, :]^2) + eps). x rows x_stride elements apart (a column slice of
// a wider projection output), out rows out_stride apart; out may be x (each thread rereads only the vectors
// it writes). D, strides % 8 == 0. Grid m, block <= 256 threads over the D / 8 vectors (two passes).
// A thread's first ROW_VECS 16-byte vectors of a row stay in registers across the two passes, and their norm
// weights load before griddepcontrol.wait (weights are never written by an earlier kernel), so the weight read
// overlaps the previous kernel's tail instead of following the reduction. Vectors past ROW_VECS * blockDim
// (D > 8192 at 256 threads) take the loop of before. Same sums in the same order: the same bits.
#define ROW_VECS 4

__device__ __forceinline__ uint4 normed8(uint4 x, uint4 w, float inv) {      // bf16(w * (x * inv)), 8 at a time
    float f[8], g[8];
    unpack8(x, f);
    unpack8(w, g);
#pragma unroll
    for (int q = 0; q < 8; ++q) f[q] = g[q] * (f[q] * inv);
    return pack8(f);
}

// Row r of x sits at (r / x_group) x_group_stride + (r % x_group) x_stride: x_group 1 is rows x_stride apart;
// x_group n is the heads of a column slice (heads n of d, rows of tokens x_group_stride apart: the drafter's q of
// its q | k | v GEMM output). out rows are out_stride apart.
extern "C" __global__ void rms_norm_rows(const bf16_t* x, int x_stride, int x_group, int x_group_stride,
                                         const bf16_t* __restrict__ w, bf16_t* out, int out_stride, int D, float eps) {
    const int nv = D >> 3, B = blockDim.x;
    const uint4* wr = (const uint4*)w;
    uint4 wv[ROW_VECS], xv[ROW_VECS];
#pragma unroll
    for (int j = 0; j < ROW_VECS; ++j)
        if (threadIdx.x + j * B < nv) wv[j] = wr[threadIdx.x + j * B];
    pdl_wait();
    pdl_trigger();
    const int group = blockIdx.x / x_group, within = blockIdx.x - group * x_group;
    const uint4* xr = (const uint4*)(x + (size_t)group * x_group_stride + (size_t)within * x_stride);
    uint4* orow = (uint4*)(out + (size_t)blockIdx.x * out_stride);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < ROW_VECS; ++j) {
        if (threadIdx.x + j * B >= nv) break;
        float f[8];
        xv[j] = xr[threadIdx.x + j * B];
        unpack8(xv[j], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) ss += f[q] * f[q];
    }
    for (int v = threadIdx.x + ROW_VECS * B; v < nv; v += B) {
        float f[8];
        unpack8(xr[v], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) ss += f[j] * f[j];
    }
    const float inv = rsqrtf(block_sum(ss) / (float)D + eps);
#pragma unroll
    for (int j = 0; j < ROW_VECS; ++j) {
        if (threadIdx.x + j * B >= nv) break;
        orow[threadIdx.x + j * B] = normed8(xv[j], wv[j], inv);
    }
    for (int v = threadIdx.x + ROW_VECS * B; v < nv; v += B) orow[v] = normed8(xr[v], wr[v], inv);
}

// h[r, :] <- bf16(h_in + delta) (the residual stream; h_in may be h: in place), out[r, :] = RMSNorm(that rounded
// h) (the norm reads the bf16 h every later layer and every rank sees). h_in, h, delta, out [m, D] dense, D % 8 == 0.
// Grid m, block <= 256 threads over the D / 8 vectors.
extern "C" __global__ void add_rms_norm_rows(const bf16_t* h_in, bf16_t* h, const bf16_t* __restrict__ delta,
                                             const bf16_t* __restrict__ w, bf16_t* __restrict__ out, int D,
                                             float eps) {
    const int nv = D >> 3, B = blockDim.x;
    const uint4* wr = (const uint4*)w;
    uint4 wv[ROW_VECS], hv[ROW_VECS];                           // weights (before the wait), rounded h rows
#pragma unroll
    for (int j = 0; j < ROW_VECS; ++j)
        if (threadIdx.x + j * B < nv) wv[j] = wr[threadIdx.x + j * B];
    pdl_wait();
    pdl_trigger();
    const uint4* hi = (const uint4*)(h_in + (size_t)blockIdx.x * D);     // may be h itself (in place)
    uint4* hr = (uint4*)(h + (size_t)blockIdx.x * D);
    const uint4* dr = (const uint4*)(delta + (size_t)blockIdx.x * D);
    uint4* orow = (uint4*)(out + (size_t)blockIdx.x * D);
    float ss = 0.f;
    auto add_row = [&](int v) {                                 // h[v] = bf16(h_in[v] + delta[v]); ss of the rounded
        float a[8], b[8];
        unpack8(hi[v], a);
        unpack8(dr[v], b);
#pragma unroll
        for (int q = 0; q < 8; ++q) a[q] += b[q];
        const uint4 r = pack8(a);
        hr[v] = r;
        unpack8(r, a);                                          // the rounded values, as stored
#pragma unroll
        for (int q = 0; q < 8; ++q) ss += a[q] * a[q];
        return r;
    };
#pragma unroll
    for (int j = 0; j < ROW_VECS; ++j) {
        if (threadIdx.x + j * B >= nv) break;
        hv[j] = add_row(threadIdx.x + j * B);
    }
    for (int v = threadIdx.x + ROW_VECS * B; v < nv; v += B) add_row(v);
    const float inv = rsqrtf(block_sum(ss) / (float)D + eps);
#pragma unroll
    for (int j = 0; j < ROW_VECS; ++j) {
        if (threadIdx.x + j * B >= nv) break;
        orow[threadIdx.x + j * B] = normed8(hv[j], wv[j], inv);
    }
    for (int v = threadIdx.x + ROW_VECS * B; v < nv; v += B)     // this thread's own writes: no barrier needed
        orow[v] = normed8(hr[v], wr[v], inv);
}

// out = bf16(a + b) element-wise (fp32 add, one rounding: add_rms_norm_rows' residual bits); n8 16-byte vectors
// of 8 bf16, grid-stride; out may be a or b.
extern "C" __global__ void add_rows(const uint4* a, const uint4* b, uint4* out, long long n8) {
    pdl_wait();
    pdl_trigger();
    for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v < n8; v += (long long)gridDim.x * blockDim.x) {
        float x[8], y[8];
        unpack8(a[v], x);
        unpack8(b[v], y);
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] += y[j];
        out[v] = pack8(x);
    }
}

// ---- rope ----------------------------------------------------------------------------------------------
// x [q, n, d] bf16 = rope(src [q, n, d]) (src may be x: in place), one thread per (token, head, pair i) turning it
// with rope.cuh's rope_pair (strides, table, the NaN of a position outside the table: there); grid-stride over
// q * n * d/2, so a strided view is roped into a dense copy in one pass.
template <bool INTERLEAVED>
__device__ __forceinline__ void rope(const bf16_t* src, int src_token_stride, int src_head_stride, bf16_t* x,
                                     int token_stride, int head_stride, const int* __restrict__ pos,
                                     const float2* __restrict__ table, int max_pos, int q, int n, int half) {
    pdl_wait();
    pdl_trigger();
    const size_t total = (size_t)q * n * half;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x)
        rope_pair<INTERLEAVED>(k, src, src_token_stride, src_head_stride, x, token_stride, head_stride, pos, table,
                               max_pos, n, half);
}

extern "C" __global__ void rope_interleaved(const bf16_t* src, int src_token_stride, int src_head_stride, bf16_t* x,
                                            int token_stride, int head_stride, const int* pos,
                                            const float2* table, int max_pos, int q, int n, int half) {
    rope<true>(src, src_token_stride, src_head_stride, x, token_stride, head_stride, pos, table, max_pos, q, n, half);
}

extern "C" __global__ void rope_rotate_half(const bf16_t* src, int src_token_stride, int src_head_stride, bf16_t* x,
                                            int token_stride, int head_stride, const int* pos,
                                            const float2* table, int max_pos, int q, int n, int half) {
    rope<false>(src, src_token_stride, src_head_stride, x, token_stride, head_stride, pos, table, max_pos, q, n, half);
}

// ---- per-head RMSNorm (the drafter's q_norm / k_norm) ----------------------------------------------------
// x [m, n, d] bf16 in place (strided as the rope's), each (token, head) row of d normed with w [d].
// d even; one warp per row, lanes over the d/2 bf16 pairs (two passes over the row, as rms_norm_rows).
// Grid ceil(m n / warps), block warps * 32.
extern "C" __global__ void head_rms_norm(bf16_t* x, int token_stride, int head_stride, const bf16_t* __restrict__ w,
                                         int rows, int n, int d, float eps) {
    pdl_wait();
    pdl_trigger();
    const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    const int r = blockIdx.x * warps + (threadIdx.x >> 5);
    if (r >= rows) return;                                      // whole warps: no block barrier below
    u32* row = (u32*)(x + (size_t)(r / n) * token_stride + (size_t)(r % n) * head_stride);
    const u32* wp = (const u32*)w;
    const int pairs = d >> 1;
    float ss = 0.f;
    for (int j = lane; j < pairs; j += 32) {
        const u32 v = row[j];
        const float a = bf16lo_to_f32(v), b = bf16hi_to_f32(v);
        ss += a * a + b * b;
    }
    const float inv = rsqrtf(warp_sum(ss) / (float)d + eps);
    for (int j = lane; j < pairs; j += 32) {
        const u32 v = row[j], g = wp[j];
        row[j] = pack_bf16x2(bf16lo_to_f32(g) * (bf16lo_to_f32(v) * inv), bf16hi_to_f32(g) * (bf16hi_to_f32(v) * inv));
    }
}

// ---- SiLU(gate) * up ------------------------------------------------------------------------------------
// gu [m, 2I] bf16 is SkinnyGemm's output for the stacked weight [gate; up] ([2I, H]): row r holds gate
// (columns 0 .. I-1) then up (columns I .. 2I-1). out [m, I] = silu(gate) * up. I even; one thread per bf16
// pair, grid-stride over m * I/2.
extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gu, bf16_t* __restrict__ out, int m, int I) {
    pdl_wait();
    pdl_trigger();
    const int pairs = I >> 1;
    const size_t total = (size_t)m * pairs;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        const size_t r = k / pairs;
        const int j = (int)(k % pairs);
        const u32* row = (const u32*)(gu + r * 2 * I);
        const u32 g = row[j], u = row[pairs + j];
        ((u32*)(out + r * I))[j] = pack_bf16x2(silu(bf16lo_to_f32(g)) * bf16lo_to_f32(u),
                                               silu(bf16hi_to_f32(g)) * bf16hi_to_f32(u));
    }
}

// ---- row gather (taps at given rows) ---------------------------------------------------------------------
// out[i, :] = src[rows[i], :] for i < k, rows int32 on the device. Moved as 16-byte vectors: row_vecs per row,
// strides in vectors (any element type whose row is a multiple of 16 bytes). A negative row (the -1 padding
// after an accepted path) gives zeros; a row >= src_rows gives all-ones bytes (NaN in bf16 and fp32, -1 in
// int32): out of range shows instead of reading another buffer. Grid k, block <= 256 threads over the vectors.
extern "C" __global__ void gather_rows(const uint4* __restrict__ src, int src_stride, int src_rows,
                                       const int* __restrict__ rows, uint4* __restrict__ out, int out_stride,
                                       int row_vecs) {
    pdl_wait();
    pdl_trigger();
    const int r = rows[blockIdx.x];
    const uint4 fill = r < 0 ? make_uint4(0u, 0u, 0u, 0u) : make_uint4(~0u, ~0u, ~0u, ~0u);
    const bool inside = r >= 0 && r < src_rows;
    const uint4* s = src + (size_t)(inside ? r : 0) * src_stride;
    uint4* o = out + (size_t)blockIdx.x * out_stride;
    for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) o[v] = inside ? s[v] : fill;
}

// ---- cast ---------------------------------------------------------------------------------------------
// out[i] = bf16(x[i]) (nearest even; NaN stays NaN), i < n. Grid-stride, one element per thread.
extern "C" __global__ void cast_f32_bf16(const float* __restrict__ x, bf16_t* __restrict__ out, long long n) {
    pdl_wait();
    pdl_trigger();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

// out[i] = base[0] + i for i < n (positions of rows appended at a device-held length).
extern "C" __global__ void positions_from(const int* __restrict__ base, int* __restrict__ out, int n) {
    pdl_wait();
    pdl_trigger();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = base[0] + i;
}

// dst row (row0[0] + i) = src row i for the n rows of one block each (grid n); rows past dst_rows are not
// written (the launcher's caller checks capacity on the host; this only keeps a bad length inside the buffer).
extern "C" __global__ void rows_at(uint4* __restrict__ dst, int dst_stride, int dst_rows, const int* __restrict__ row0,
                                   const uint4* __restrict__ src, int src_stride, int row_vecs) {
    pdl_wait();
    pdl_trigger();
    const int r = row0[0] + blockIdx.x;
    if (r < 0 || r >= dst_rows) return;
    const uint4* s = src + (size_t)blockIdx.x * src_stride;
    uint4* o = dst + (size_t)r * dst_stride;
    for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) o[v] = s[v];
}
