// One rotary-embedding pair, shared by layer_ops.cu's rope kernels and mla_absorb.cu's fused absorb + rope (so both
// write the same bits). Element (t, h, c) of x at t * token_stride + h * head_stride + c (src: its own strides);
// pair k of the q * n * half pairs is (token t, head h, pair i) with i fastest. pos [q] int32 on the device; table
// [max_pos, half] float2 (m cos(p phi_i), m sin(p phi_i)) built on the host in float64 (layer_ops.RopeTable: an fp32
// angle p * phi_i at p ~ 2.6e5 is off by up to ~1e-2 rad). A position outside [0, max_pos) writes NaN into that
// token's pairs (visible, never a silent wrong rotation).
//   interleaved (the target's MLA rope, GPT-J pairs): (x[2i], x[2i+1])
//   rotate_half (the drafter's NeoX halves):          (x[i], x[i + d/2])
// both turned as (a, b) -> (a c - b s, a s + b c).
#pragma once
#include "common.cuh"

template <bool INTERLEAVED>
__device__ __forceinline__ void rope_pair(size_t k, const bf16_t* src, int src_token_stride, int src_head_stride,
                                          bf16_t* x, int token_stride, int head_stride, const int* __restrict__ pos,
                                          const float2* __restrict__ table, int max_pos, int n, int half) {
    const int i = (int)(k % half);
    const size_t th = k / half;
    const int hd = (int)(th % n), t = (int)(th / n);
    bf16_t* row = x + (size_t)t * token_stride + (size_t)hd * head_stride;
    const bf16_t* srow = src + (size_t)t * src_token_stride + (size_t)hd * src_head_stride;
    bf16_t* pa = row + (INTERLEAVED ? 2 * i : i);
    bf16_t* pb = row + (INTERLEAVED ? 2 * i + 1 : i + half);
    const bf16_t* sa = srow + (INTERLEAVED ? 2 * i : i);
    const bf16_t* sb = srow + (INTERLEAVED ? 2 * i + 1 : i + half);
    const int p = pos[t];
    float ya, yb;
    if (p < 0 || p >= max_pos) {
        ya = yb = __int_as_float(0x7fc00000);
    } else {
        const float2 cs = table[(size_t)p * half + i];
        const float a = bf16_to_f32(*sa), b = bf16_to_f32(*sb);
        ya = a * cs.x - b * cs.y;
        yb = a * cs.y + b * cs.x;
    }
    *pa = f32_to_bf16(ya);
    *pb = f32_to_bf16(yb);
}
