// One rotary-embedding pair, shared by layer_ops.cu's rope kernels and mla_absorb.cu's fused absorb + rope (so both
// write the same bits). Element (t, h, c) of x at t * token_stride + h * head_stride + c (src: its own strides);
// pair k of the q * n * half pairs is (token t, head h, pair i) with i fastest. pos [q] int32 on the device; table
// [max_pos, half] float2 (m cos(p phi_i), m sin(p phi_i)) built on the host in float64 (layer_ops.RopeTable: an fp32
// angle p * phi_i at p ~ 2.6e5 is off by up to ~1e-2 rad). A position outside [0, max_pos) writes NaN into that
// token's pairs (visible, never a silent wrong rotation).
//   interleaved (the target's MLA rope, GPT-J pairs): (x[2i], x[2i+1])
//   rotate_half (the drafter's NeoX halves):          (x[i], x[i + d/2])
// both turned as (a, b) -> (a c - b s, a s + b c) = (fma(a, c, -(b s)), fma(b, c, a s)).
#pragma once
#include "common.cuh"

// A pair's inputs, loaded ahead of its arithmetic (rope_fetch, then rope_finish), so a kernel can issue the loads
// early and use them late; rope_pair is the two back to back.
struct RopeHeld {
    bf16_t *pa, *pb;
    float a, b;
    float2 cs;
    bool live;           // the position is inside the table
};

template <bool INTERLEAVED>
__device__ __forceinline__ RopeHeld rope_fetch(size_t k, const bf16_t* src, int src_token_stride, int src_head_stride,
                                               bf16_t* x, int token_stride, int head_stride,
                                               const int* __restrict__ pos, const float2* __restrict__ table,
                                               int max_pos, int n, int half) {
    const int i = (int)(k % half);
    const size_t th = k / half;
    const int hd = (int)(th % n), t = (int)(th / n);
    bf16_t* row = x + (size_t)t * token_stride + (size_t)hd * head_stride;
    const bf16_t* srow = src + (size_t)t * src_token_stride + (size_t)hd * src_head_stride;
    RopeHeld h;
    h.pa = row + (INTERLEAVED ? 2 * i : i);
    h.pb = row + (INTERLEAVED ? 2 * i + 1 : i + half);
    const int p = pos[t];
    h.live = p >= 0 && p < max_pos;
    h.cs = h.live ? table[(size_t)p * half + i] : make_float2(0.f, 0.f);
    h.a = bf16_to_f32(srow[INTERLEAVED ? 2 * i : i]);
    h.b = bf16_to_f32(srow[INTERLEAVED ? 2 * i + 1 : i + half]);
    return h;
}

__device__ __forceinline__ void rope_finish(const RopeHeld& h) {
    float ya, yb;
    if (!h.live) {
        ya = yb = __int_as_float(0x7fc00000);
    } else {
        // the contraction spelled out (the form NVRTC chose for the original expressions in every rope kernel), so
        // that no call site's inlining can fuse the products otherwise and move a bf16 result by one ulp
        ya = __fmaf_rn(h.a, h.cs.x, -__fmul_rn(h.b, h.cs.y));
        yb = __fmaf_rn(h.b, h.cs.x, __fmul_rn(h.a, h.cs.y));
    }
    *h.pa = f32_to_bf16(ya);
    *h.pb = f32_to_bf16(yb);
}

template <bool INTERLEAVED>
__device__ __forceinline__ void rope_pair(size_t k, const bf16_t* src, int src_token_stride, int src_head_stride,
                                          bf16_t* x, int token_stride, int head_stride, const int* __restrict__ pos,
                                          const float2* __restrict__ table, int max_pos, int n, int half) {
    rope_finish(rope_fetch<INTERLEAVED>(k, src, src_token_stride, src_head_stride, x, token_stride, head_stride, pos,
                                        table, max_pos, n, half));
}
