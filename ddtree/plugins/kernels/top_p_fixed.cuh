// A token's top-p bin and fixed-point weight, in float32 (sample_top_p.cu; numpy twin, operation for
// operation: ddtree/plugins/top_p_bins.py token_fixed, which also derives the error bound).
//
//   d = (l - l_top) / T <= 0 as a float pair d_hi + d_lo (two-sum of l - l_top, two-product with the pair
//   1/T = ih + il); bin b = floor(-128 d_hi), clamped at 4095 (monotone in l: equal logits, equal bins);
//   b < 4095:  exp(d) = s_b exp(r), r = d + b/128 in (-1/128, 0]: F = 2^35 + round(r_hi 2^35)
//              + round((d_lo + q(x)) 2^35), q(x) = exp(x) - 1 - x to x^5, x = r_hi + d_lo
//   b = 4095:  F = round(expf(d + 4095/128) 2^35) (weights below e^-32 of the top)
// Every operation is an explicit round-to-nearest intrinsic (no fma contraction), so the twin's numpy
// float32 arithmetic gives the same bits. Compiles as host C++ too (tests/plugins/test_top_p_bins.py
// checks the bits against the twin with g++).
#pragma once

#define TP_BINS 4096
#define TP_CLAMP 4095
#define TP_FIXED_BITS 35

#ifdef __CUDACC__
#define TP_FN __device__ __forceinline__
#define TP_ADD __fadd_rn
#define TP_SUB __fsub_rn
#define TP_MUL __fmul_rn
#define TP_FMA __fmaf_rn
#define TP_AS_INT __float_as_int
#define TP_RINT __float2int_rn
#define TP_RINT64 __float2ll_rn
#define TP_EXP expf
#else                                   // host C++ (compile with -ffp-contract=off)
#include <cmath>
#include <cstring>
#define TP_FN static inline
TP_FN float TP_ADD(float a, float b) { return a + b; }
TP_FN float TP_SUB(float a, float b) { return a - b; }
TP_FN float TP_MUL(float a, float b) { return a * b; }
TP_FN float TP_FMA(float a, float b, float c) { return std::fma(a, b, c); }
TP_FN int TP_AS_INT(float f) { int i; std::memcpy(&i, &f, 4); return i; }
TP_FN int TP_RINT(float f) { return (int)std::nearbyint(f); }
TP_FN long long TP_RINT64(float f) { return (long long)std::nearbyint(f); }
TP_FN float TP_EXP(float f) { return std::exp(f); }
#endif

// floor(min(-128 d_hi, 4095)) (NaN -> 4095); kf the same as a float. Magic-number floor: no conversion unit.
TP_FN int tp_bin_of(float d_hi, float& kf) {
    const float t = TP_MUL(d_hi, -128.0f);
    const float tc = t < (float)TP_CLAMP ? t : (float)TP_CLAMP;
    const float tf = TP_ADD(tc, 8388608.0f);                  // 2^23: rounds tc to the nearest integer
    kf = TP_SUB(tf, 8388608.0f);
    int k = TP_AS_INT(tf) - 0x4B000000;
    if (kf > tc) { k -= 1; kf = TP_SUB(kf, 1.0f); }
    return k;
}

// The bin alone (sample_kept): the same d_hi as tp_token_fixed, so the same bin.
TP_FN int tp_token_bin(float l, float l_top, float ih) {
    float kf;
    return tp_bin_of(TP_MUL(TP_SUB(l, l_top), ih), kf);
}

// F = round(exp(r) 2^35) of a token (0 for -inf / NaN logits) and its bin.
TP_FN long long tp_token_fixed(float l, float l_top, float ih, float il, int& bin) {
    const float s = TP_SUB(l, l_top);                         // s + e = l - l_top exactly
    const float bb = TP_SUB(s, l);
    const float e = TP_ADD(TP_SUB(l, TP_SUB(s, bb)), TP_SUB(-l_top, bb));
    const float d_hi = TP_MUL(s, ih);
    const float p_err = TP_FMA(s, ih, -d_hi);                 // exact: d_hi + p_err = s ih
    const float d_lo = TP_ADD(p_err, TP_ADD(TP_MUL(e, ih), TP_MUL(s, il)));
    float kf;
    bin = tp_bin_of(d_hi, kf);
    if (bin < TP_CLAMP) {
        const float r_hi = TP_ADD(d_hi, TP_MUL(kf, 0.0078125f));        // exact (Sterbenz), in (-1/128, 0]
        const float x = TP_ADD(r_hi, d_lo);
        float h = TP_MUL(x, 1.0f / 120.0f);
        h = TP_ADD(1.0f / 24.0f, h);
        h = TP_MUL(x, h);
        h = TP_ADD(1.0f / 6.0f, h);
        h = TP_MUL(x, h);
        h = TP_ADD(0.5f, h);
        const float q = TP_MUL(TP_MUL(x, x), h);
        const int k1 = TP_RINT(TP_MUL(r_hi, 34359738368.0f));           // 2^35
        const float rest = TP_ADD(d_lo, q);                             // |rest 2^35| < 2^21
        const int k2 = TP_AS_INT(TP_ADD(TP_MUL(rest, 34359738368.0f), 12582912.0f)) - 0x4B400000;
        return (1ll << TP_FIXED_BITS) + (long long)(k1 + k2);
    }
    const float w = TP_EXP(TP_ADD(TP_ADD(d_hi, (float)TP_CLAMP / 128.0f), d_lo));
    return w > 0.0f ? TP_RINT64(TP_MUL(w, 34359738368.0f)) : 0ll;
}
