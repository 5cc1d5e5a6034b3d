// The W4A16 expert GEMMs' shared main loop (kernels/moe.cu: moe_gate_up, moe_down; moe_stream.cuh): a warp's
// ring of INT4 weight slots (cp.async or bulk copies) against 8 activation rows, two 16-row tiles a chunk.
#pragma once
#include "common.cuh"

// A bulk copy (copy engine) global -> shared completing on `bar`, with an L2 cache policy (weights: evict first).
__device__ __forceinline__ void bulk_copy_g2s_hint(void* dst, const void* src, u32 bytes, u64* bar, u64 policy) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy) : "memory");
}
__device__ __forceinline__ void mbar_inval(u64* bar) {   // before an mbarrier's memory is initialised again
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" :: "r"(smem_addr(bar)) : "memory");
}

// Where the bulk rings' mbarriers are (BULK) and a pinned item's slots (PINNED; moe_stream.cuh); empty otherwise.
struct W4Bulk {
    u64* bars;               // [nwarps][STAGES] the ring slots' mbarriers
    unsigned char* pin;      // [nwarps][pin_slots] W4Slot: the pinned down item's weights, issued at the block's start
    u64* pin_bars;           // [nwarps][pin_slots]
    int pin_slots;
};

// The sum of one activation row's 32 bf16 values of a k32 group (4 uint4 in shared memory), in the order whose
// -136 x is the bias correction of w4_mainloop's xcorr and moe_down_cols' xc_s (the two must agree bit for bit).
__device__ __forceinline__ float k32_sum(const uint4* src) {
    float sum = 0.f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const uint4 v = src[u];
        sum += (bf16lo_to_f32(v.x) + bf16hi_to_f32(v.x)) + (bf16lo_to_f32(v.y) + bf16hi_to_f32(v.y))
             + (bf16lo_to_f32(v.z) + bf16hi_to_f32(v.z)) + (bf16lo_to_f32(v.w) + bf16hi_to_f32(v.w));
    }
    return sum;
}

// One k32 scale group of a 16-row INT4 tile against 8 activation columns (w4_mainloop, moe_down_cols: the same ops
// in the same order): the unscaled group sum (integer weights +136 are exact in bf16; `start`, -136 x the group's
// activation sums, removes the bias), then acc += the rows' scales (row g, row g + 8) x it.
__device__ __forceinline__ void w4_group(float (&acc)[4], float4 start, u32 w_lo, u32 w_hi, u32 scales, uint4 xb,
                                         u32 nibble_mask) {
    float part[4] = {start.x, start.y, start.z, start.w};
    u32 a[4];
    int4_word_biased(w_lo, a, nibble_mask);
    mma_bf16_16816(part, a, xb.x, xb.y);
    int4_word_biased(w_hi, a, nibble_mask);
    mma_bf16_16816(part, a, xb.z, xb.w);
    const float s_row_g = bf16lo_to_f32(scales), s_row_g8 = bf16hi_to_f32(scales);
    acc[0] += s_row_g * part[0];
    acc[1] += s_row_g * part[1];
    acc[2] += s_row_g8 * part[2];
    acc[3] += s_row_g8 * part[3];
}

// One ring slot's CPSLOT chunks of a warp's two 16-row tiles (w4_mainloop, moe_down_cols): x_at(q, h) is the B
// fragment and corr_at(q, h) the bias correction of chunk q's k32 group h.
template <int CPSLOT, class XAt, class CorrAt>
__device__ __forceinline__ void w4_slot(float (&acc)[2][4], const uint4* slot_w, const uint2* slot_s, u32 nibble_mask,
                                        XAt x_at, CorrAt corr_at) {
#pragma unroll
    for (int q = 0; q < CPSLOT; ++q) {
        const uint4 w0 = slot_w[64 * q], w1 = slot_w[64 * q + 32];
        const uint2 s0 = slot_s[16 * q], s1 = slot_s[16 * q + 8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {                    // two k32 scale groups per chunk
            const uint4 xb = x_at(q, h);
            const float4 corr = corr_at(q, h);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const uint4 w = j == 0 ? w0 : w1;
                const uint2 sc = j == 0 ? s0 : s1;
                w4_group(acc[j], corr, h == 0 ? w.x : w.z, h == 0 ? w.y : w.w, h == 0 ? sc.x : sc.y, xb, nibble_mask);
            }
        }
    }
}

template <int CPSLOT>
struct W4Slot {                     // one warp's ring slot
    uint4 w[CPSLOT][2][32];         // CPSLOT chunks x two 16-row tiles x 64 k of INT4 (lane-private uint4s)
    uint2 s[CPSLOT][2][8];          // per chunk and tile, row group g's 4 bf16 scales (rows g, g+8 x two k32
                                    // groups): 128 B per chunk copied once by 8 lanes, read by broadcast
};

// Shared main loop. The block owns one tile (8 slots of one expert), n-block bx and k-split by of S; warp w streams `tpw` pairs of 16-row n-tiles, tiles [nt_begin, nt_begin + 2 tpw), over the
// split's chunks (two tiles per chunk share the activation fragments and the loop overhead) and hands
// each finished 16x8 accumulator to `epi(local tile, acc)`.
//   STAGES, CPSLOT  ring of STAGES slots per warp, each CPSLOT consecutive chunks (one contiguous request
//             of CPSLOT KB per warp); K/64/S must be a multiple of CPSLOT
//   x_rows  activation rows [*, K] bf16: MODE 0 reads row pair / topk (the token), MODE 1 row pair
//   PREFETCH  false: x rows first, then the weight ring (the caller has already waited for its inputs).
//             true: the weight ring first (weights do not depend on earlier kernels), then
//             `before_x()` (the programmatic-launch wait), then the x rows.
// Weights arrive biased by +136 (int4_word_biased); each k32 group's mma pair starts from
// -136 * sum(x over the group) per slot (xcorr, computed once per block), which cancels the bias.
//   BULK    false: every lane copies its 16 B pieces of a slot (cp.async, counted in commit groups).
//           true: lane 0 copies a slot as two bulk copies (the copy engine: CPSLOT KB of weights, CPSLOT x 128 B
//           of scales, contiguous in both memories) completing on the slot's mbarrier (bk.bars: one per warp
//           and slot); the lanes wait on its phase. The same bytes in the same places: the same sums.
//   PINNED  (BULK) the item's slots were all issued at the block's start by w4_issue_pinned into bk.pin (S = 1):
//           no ring, nothing issued here, slot i waits on bk.pin_bars[i] (phase 0).
// Shared memory: x [8][kspan + 32] bf16, xcorr [2 CPS][4 t] float4, then the warps' rings.
template <int MODE, bool PREFETCH, int STAGES, int CPSLOT, bool BULK, bool PINNED, class BeforeX, class Epi>
__device__ __forceinline__ void w4_mainloop(const bf16_t* __restrict__ x_rows, const uint4* __restrict__ wq,
                                            const uint2* __restrict__ wscale, const int* pairs, int e, int K,
                                            int NT, int topk, int S, int tpw, int bx, int by, const W4Bulk& bk,
                                            BeforeX before_x, Epi epi) {
    static_assert(BULK || !PINNED, "pinned slots are bulk copies");
    extern __shared__ __align__(16) unsigned char smem[];
    typedef W4Slot<CPSLOT> Slot;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nwarps = blockDim.x >> 5;
    const int KC = K >> 6, CPS = KC / S, c0 = by * CPS;
    const int kspan = CPS * 64, xstride = kspan + 32;   // +64 B per row: conflict-free uint4 reads
    bf16_t* xs = (bf16_t*)smem;                          // [8][xstride]
    float4* xcorr = (float4*)(smem + 16 * xstride);      // [2 CPS][4]: slots (2t, 2t+1, 2t, 2t+1)
    Slot* ring = PINNED ? (Slot*)bk.pin + warp * bk.pin_slots : (Slot*)(smem + 16 * xstride + 128 * CPS) + warp * STAGES;
    u64* bars = PINNED ? bk.pin_bars + warp * bk.pin_slots : bk.bars + warp * STAGES;
    if (BULK && !PINNED) {                               // fresh barriers for this item (the last item's invalidated)
        if (lane == 0) {
            for (int st = 0; st < STAGES; ++st) mbar_init(&bars[st], 1u);
            mbar_init_fence();
        }
        __syncwarp();
    }

    // the 8 slots' activation rows for this k-split -> smem (zeros for padding slots)
    auto load_x = [&]() {
        const int vec_per_row = kspan >> 3;
        for (int i = threadIdx.x; i < 8 * vec_per_row; i += blockDim.x) {
            int slot = i / vec_per_row, v = i - slot * vec_per_row;
            bf16_t* dst = xs + slot * xstride + v * 8;
            int p = pairs[slot];
            if (p < 0) {
                *(uint4*)dst = make_uint4(0u, 0u, 0u, 0u);
            } else {
                size_t row = MODE == 0 ? (size_t)(p / topk) : (size_t)p;
                cp_async16(dst, x_rows + row * K + c0 * 64 + v * 8);
            }
        }
        cp_async_commit();
    };

    // this warp's items = (tile pair r, chunk c), streamed through the ring; counters, no divisions
    const int nt_begin = 2 * (bx * nwarps + warp) * tpw;
    const int my_pairs = max(0, min(tpw, (NT - nt_begin) / 2));
    const int slots = my_pairs * (CPS / CPSLOT);
    // a tile pair's chunk is 1 KB of weights (64 uint4) + 128 B of scales (16 uint2), pairs contiguous
    const size_t pair_base = (size_t)e * (NT / 2) + nt_begin / 2;
    const uint4* wp = wq + (pair_base * KC + c0) * 64 + lane;
    const uint4* sp = (const uint4*)wscale + (pair_base * KC + c0) * 8 + lane;   // 128 B = 8 uint4 per chunk
    const bool copies_scales = lane < 8 * CPSLOT;        // a slot's scales are 8 CPSLOT contiguous uint4
    const size_t skip_w = (size_t)(KC - CPS) * 64, skip_s = (size_t)(KC - CPS) * 8;
    const u64 policy = evict_first_policy();
    // lane-private slot pointers, advanced instead of recomputed
    uint4* issue_w = &ring[0].w[0][0][lane];
    uint4* issue_s = (uint4*)&ring[0].s[0][0][0] + lane;
    int issue_r = 0, issue_c = 0, issue_st = 0;
    constexpr int SLOT_W = sizeof(Slot) / sizeof(uint4), SLOT_S = sizeof(Slot) / sizeof(uint2);
    auto issue = [&]() {
        if (PINNED) return;                              // issued at the block's start
        if (issue_r < my_pairs) {
            if (BULK) {                                  // lane 0's pointers are the slot's and the chunk's bases
                if (lane == 0) {
                    u64* bar = &bars[issue_st];
                    fence_proxy_async();                 // the lanes' reads of this slot (last round) come first
                    mbar_expect_tx(bar, CPSLOT * (1024u + 128u));
                    bulk_copy_g2s_hint(issue_w, wp, CPSLOT * 1024u, bar, policy);
                    bulk_copy_g2s_hint(issue_s, sp, CPSLOT * 128u, bar, policy);
                }
            } else {
#pragma unroll
                for (int q = 0; q < CPSLOT; ++q) {       // chunk q: w[q][tile][lane], s[q][tile][lane]
                    cp_async16_stream(issue_w + 64 * q, wp + 64 * q, policy);
                    cp_async16_stream(issue_w + 64 * q + 32, wp + 64 * q + 32, policy);
                }
                if (copies_scales) cp_async16_stream(issue_s, sp, policy);
            }
            wp += 64 * CPSLOT;
            sp += 8 * CPSLOT;
            issue_c += CPSLOT;
            if (issue_c == CPS) {                        // next tile pair, back to chunk c0
                issue_c = 0;
                ++issue_r;
                wp += skip_w;
                sp += skip_s;
            }
        }
        if (!BULK) cp_async_commit();                    // empty groups keep the counting uniform
        issue_w += SLOT_W;
        issue_s += SLOT_W;
        if (++issue_st == STAGES) {
            issue_st = 0;
            issue_w -= STAGES * SLOT_W;
            issue_s -= STAGES * SLOT_W;
        }
    };
    __shared__ u32 s_mask;
    if (threadIdx.x == 0) s_mask = 0x000F000Fu;
    if (PREFETCH) {
#pragma unroll 1
        for (int st = 0; st < STAGES - 1; ++st) issue();
        before_x();
        load_x();
        cp_async_wait<0>();                              // x is the newest group: everything landed
    } else {
        load_x();
#pragma unroll 1
        for (int st = 0; st < STAGES - 1; ++st) issue();
        if (BULK) cp_async_wait<0>();                    // activation rows landed (the slots: their mbarriers)
        else cp_async_wait<STAGES - 2>();                // activation rows + slot 0 landed
    }
    __syncthreads();
    // xcorr[group][t] = -136 * (sum of slot 2t's, slot 2t+1's 32 x values in k32 group `group`), laid out
    // as the mma's C fragment {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)} so one LDS.128 is the start value
    for (int i = threadIdx.x; i < 8 * CPS; i += blockDim.x) {
        float sum[2];
#pragma unroll
        for (int q = 0; q < 2; ++q)
            sum[q] = k32_sum((const uint4*)(xs + (2 * (i & 3) + q) * xstride + (i >> 2) * 32));
        xcorr[i] = make_float4(-136.0f * sum[0], -136.0f * sum[1], -136.0f * sum[0], -136.0f * sum[1]);
    }
    __syncthreads();

    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    int c = 0, st = 0, r = 0;
    u32 phase = 0;                                       // BULK: parity of the slots' current use
    const uint4* slot_w = &ring[0].w[0][0][lane];
    const uint2* slot_s = &ring[0].s[0][0][g];
    // The dequant mask goes through shared memory so that ptxas cannot see the constant: otherwise it
    // re-materialises it with a MOV before every lop3 (seen in the SASS).
    const u32 nibble_mask = *(volatile u32*)&s_mask;
    const bf16_t* xp = xs + g * xstride + 8 * t;         // chunk c, group h: xp + 64 c + 32 h
    const float4* cp = xcorr + t;                        // chunk c, group h: cp + 8 c + 4 h
    for (int it = 0; it < slots; ++it) {
        if (BULK) mbar_wait(&bars[st], phase);           // slot `it` landed (both bulk copies)
        else cp_async_wait<STAGES - 2>();                // slot `it` landed (this lane's copies)
        __syncwarp();                                    // ... and the other lanes' (scales); all lanes are done
        issue();                                         // reading the slot of the last iteration: refill it
        w4_slot<CPSLOT>(acc, slot_w, slot_s, nibble_mask,
                        [&](int q, int h) { return *(const uint4*)(xp + 64 * q + 32 * h); },
                        [&](int q, int h) { return cp[8 * q + 4 * h]; });
        xp += 64 * CPSLOT;
        cp += 8 * CPSLOT;
        slot_w += SLOT_W;
        slot_s += SLOT_S;
        if (++st == STAGES) {
            st = 0;
            phase ^= 1u;
            slot_w -= STAGES * SLOT_W;
            slot_s -= STAGES * SLOT_S;
        }
        c += CPSLOT;
        if (c == CPS) {
            epi(2 * r, acc[0]);
            epi(2 * r + 1, acc[1]);
#pragma unroll
            for (int j = 0; j < 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            c = 0;
            ++r;
            xp -= 64 * CPS;
            cp -= 8 * CPS;
        }
    }
    cp_async_wait<0>();
    if (BULK && !PINNED) {                               // every slot waited for: the barriers are free again
        __syncwarp();
        if (lane == 0)
            for (int st = 0; st < STAGES; ++st) mbar_inval(&bars[st]);
    }
}
