// moe_down_cols: the routed experts' down projection and their combine by output columns, for few rows (issue 48).
// Launcher and plan: ddtree/plugins/moe_down_cols.py (plan_down_cols; numpy twin of the schedule and the combine:
// simulate_down_cols; of the math: reference.py moe_given_routing). Included by kernels/moe.cu.
//
// moe_down gives each block one tile (an expert's 8 pairs) and an n-block, writes fp32 partial rows y to global
// memory, and the last of a token's topk blocks to finish an n-block sums them (a fence, a counter, a second
// read of y): at 9..17 rows that chain, not the weights, is most of its time (NOTES.md, "MoE streaming"). Here
// block b owns `upb` tile pairs of output columns (32 upb of H) for EVERY tile of the launch:
//   - the launch's act rows [P, I] all sit in shared memory (P = M topk <= ~140 rows: few rows only),
//   - its warps take the (tile, pair) items in turn, each over the whole K = I, through one ring a warp that runs
//     on across items (the next item's weights are in flight while this one computes),
//   - y for the block's columns stays in shared memory, and the block writes out[token, its columns] itself:
//     no y in global memory, no counters, no fences, no second pass.
// Every y value is moe_down's at one k-split, op for op (the same chunks, scale groups, bias correction and
// order), and the combine is moe_down's expression, so the output is bitwise moe_down's (the GPU test asserts it).
//
// Launch: grid ceil(NP / upb) (NP = H / 32 tile pairs), block nwarps * 32, dynamic shared memory (in this order;
// plugins/moe_down_cols.py cols_smem): rings [nwarps][STAGES] W4Slot<CPSLOT> | act_s [P + 1][I + 32] bf16 (row P:
// zeros, the padding slots') | xc_s [P][I / 32] f32 (-136 x each k32 group's sum: the bias correction) |
// y_s [P][32 upb] f32 | tile_e [max_tiles] int | tile_p [max_tiles][8] int.
//   act [P, I] bf16 (moe_gate_up's)   wq [E, NP, I/64, 2, 32] uint4   wscale [E, NP, I/64, 2, 8] uint2
//   topk_w [M, topk] f32   shared_out [M, H] bf16 or null   out [M, H] bf16
// The tile lists come from the route kernel two launches back, complete before gate_up triggered this launch:
// they are read and the weight ring is filled before waiting for gate_up (programmatic launch).
#pragma once

template <int STAGES, int CPSLOT>
__device__ __forceinline__ void down_cols_impl(const bf16_t* act, const uint4* __restrict__ wq,
                                               const uint2* __restrict__ wscale, const int* tile_expert,
                                               const int* tile_pairs, const int* num_tiles, const float* topk_w,
                                               const bf16_t* shared_out, bf16_t* __restrict__ out, int K, int NP,
                                               int topk, int P, int upb, int max_tiles) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ u32 s_mask;
    typedef W4Slot<CPSLOT> Slot;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nwarps = blockDim.x >> 5;
    const int KC = K >> 6, KG = K >> 5, xstride = K + 32, ycols = 32 * upb, H = NP * 32;
    const int pair0 = blockIdx.x * upb, my_upb = min(upb, NP - pair0);
    Slot* ring = (Slot*)smem + warp * STAGES;
    bf16_t* act_s = (bf16_t*)(smem + (size_t)nwarps * STAGES * sizeof(Slot));
    float* xc_s = (float*)(act_s + (size_t)(P + 1) * xstride);
    float* y_s = xc_s + (size_t)P * KG;
    int* tile_e = (int*)(y_s + (size_t)P * ycols);
    int* tile_p = tile_e + max_tiles;

    STAMP(0);
    const int T = ld_cg_s32(num_tiles);
    if (T > max_tiles) __trap();                         // the plan sized tile_e / tile_p for max_tiles(M)
    for (int i = threadIdx.x; i < T; i += blockDim.x) tile_e[i] = ld_cg_s32(&tile_expert[i]);
    for (int i = threadIdx.x; i < 8 * T; i += blockDim.x) tile_p[i] = ld_cg_s32(&tile_pairs[i]);
    if (threadIdx.x == 0) s_mask = 0x000F000Fu;
    __syncthreads();

    // this warp's items: i = warp, warp + nwarps, .. < T my_upb; item i = (tile i / my_upb, pair i % my_upb),
    // KC / CPSLOT ring slots each
    const int items = T * my_upb;
    const int my_items = warp < items ? (items - warp + nwarps - 1) / nwarps : 0;
    const int slots = my_items * (KC / CPSLOT);
    const u64 policy = evict_first_policy();
    int issue_i = warp, issue_c = 0, issue_st = 0;
    auto issue = [&]() {
        if (issue_i < items) {
            const int z = issue_i / my_upb, u = issue_i - z * my_upb;
            const size_t chunk0 = ((size_t)tile_e[z] * NP + pair0 + u) * KC + issue_c;   // [E, NP, KC] chunks
            const uint4* wp = wq + chunk0 * 64 + lane;
            Slot& s = ring[issue_st];
#pragma unroll
            for (int q = 0; q < CPSLOT; ++q) {           // chunk q: w[q][tile][lane]
                cp_async16_stream(&s.w[q][0][lane], wp + 64 * q, policy);
                cp_async16_stream(&s.w[q][1][lane], wp + 64 * q + 32, policy);
            }
            if (lane < 8 * CPSLOT)                       // the slot's scales: 8 CPSLOT contiguous uint4
                cp_async16_stream((uint4*)&s.s[0][0][0] + lane, (const uint4*)wscale + chunk0 * 8 + lane, policy);
            issue_c += CPSLOT;
            if (issue_c == KC) {
                issue_c = 0;
                issue_i += nwarps;
            }
        }
        cp_async_commit();                               // empty groups keep the counting uniform
        if (++issue_st == STAGES) issue_st = 0;
    };
#pragma unroll 1
    for (int st = 0; st < STAGES - 1; ++st) issue();
    STAMP(1);
    pdl_wait();                                          // moe_gate_up's act rows
    pdl_trigger();
    STAMP(2);
    const int vpr = K >> 3;                              // uint4 pieces of a row
    for (int i = threadIdx.x; i < P * vpr; i += blockDim.x) {
        const int p = i / vpr, v = i - p * vpr;
        cp_async16(act_s + (size_t)p * xstride + v * 8, act + (size_t)p * K + v * 8);
    }
    for (int v = threadIdx.x; v < vpr; v += blockDim.x)
        *(uint4*)(act_s + (size_t)P * xstride + v * 8) = make_uint4(0u, 0u, 0u, 0u);
    cp_async_commit();
    cp_async_wait<0>();                                  // act is the newest group: everything landed
    __syncthreads();
    // xc_s[p][k32 group] = -136 x the group's sum, as w4_mainloop's xcorr (k32_sum: the same adds in the same order)
    for (int i = threadIdx.x; i < P * KG; i += blockDim.x) {
        const int p = i / KG, grp = i - p * KG;
        xc_s[i] = -136.0f * k32_sum((const uint4*)(act_s + (size_t)p * xstride + grp * 32));
    }
    __syncthreads();

    const u32 nibble_mask = *(volatile u32*)&s_mask;     // through shared memory: see w4_mainloop
    constexpr int SLOT_W = sizeof(Slot) / sizeof(uint4), SLOT_S = sizeof(Slot) / sizeof(uint2);
    const uint4* slot_w = &ring[0].w[0][0][lane];
    const uint2* slot_s = &ring[0].s[0][0][g];
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    int item = warp, c = 0, st = 0, u = 0, slot_p[2] = {-1, -1};
    const bf16_t* xr = act_s;                            // this lane's B row: slot g's pair (or the zero row)
    const float* corr_p[2] = {xc_s, xc_s};               // slots 2t, 2t+1's corrections (padding: any row)
    auto begin_item = [&]() {
        const int z = item / my_upb;
        u = item - z * my_upb;
        const int* tp = tile_p + 8 * z;
        const int pg = tp[g];
        xr = act_s + (size_t)(pg >= 0 ? pg : P) * xstride + 8 * t;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            slot_p[q] = tp[2 * t + q];
            corr_p[q] = xc_s + (size_t)max(slot_p[q], 0) * KG;
        }
    };
    if (slots > 0) begin_item();
    for (int it = 0; it < slots; ++it) {
        cp_async_wait<STAGES - 2>();                     // slot `it` landed (this lane's copies)
        __syncwarp();                                    // ... and the other lanes'; all are done reading the last
        issue();
        w4_slot<CPSLOT>(acc, slot_w, slot_s, nibble_mask,
                        [&](int q, int h) { return *(const uint4*)(xr + 64 * (c + q) + 32 * h); },
                        [&](int q, int h) {
                            const int grp = 2 * (c + q) + h;
                            return make_float4(corr_p[0][grp], corr_p[1][grp], corr_p[0][grp], corr_p[1][grp]);
                        });
        slot_w += SLOT_W;
        slot_s += SLOT_S;
        if (++st == STAGES) {
            st = 0;
            slot_w -= STAGES * SLOT_W;
            slot_s -= STAGES * SLOT_S;
        }
        c += CPSLOT;
        if (c == KC) {                                   // the item's two 16-column tiles -> y_s
#pragma unroll
            for (int j = 0; j < 2; ++j) {                // acc = {(n, 2t), (n, 2t+1), (n+8, 2t), (n+8, 2t+1)}
                const int n = 32 * u + 16 * j + g;
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    if (slot_p[q] >= 0) {
                        y_s[(size_t)slot_p[q] * ycols + n] = acc[j][q];
                        y_s[(size_t)slot_p[q] * ycols + n + 8] = acc[j][2 + q];
                    }
                }
                acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
            }
            c = 0;
            item += nwarps;
            if (it + 1 < slots) begin_item();
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    STAMP(3);

    // out[m, cols] = sum_k w_k y[pair m topk + k] (+ shared): moe_down's combine expression at one k-split
    const int M = P / topk, cols = 32 * my_upb;
    for (int i = threadIdx.x; i < M * cols; i += blockDim.x) {
        const int m = i / cols, col = i - m * cols, n = 32 * pair0 + col;
        float v = 0.f;
        for (int k = 0; k < topk; ++k)
            v += __ldcg(&topk_w[m * topk + k]) * y_s[(size_t)(m * topk + k) * ycols + col];
        if (shared_out) v += bf16_to_f32(__ldcg(&shared_out[(size_t)m * H + n]));
        out[(size_t)m * H + n] = f32_to_bf16(v);
    }
    STAMP(5);
    STAMP_COMMIT(3);
}

// Ring variants (kernel names moe_down_cols_r<STAGES>c<CPSLOT>), chosen by the plan (plugins/moe_down_cols.py).
#define DD_MOE_DOWN_COLS(ST, CP)                                                                          \
    extern "C" __global__ void __launch_bounds__(512, 1) moe_down_cols_r##ST##c##CP(                    \
        const bf16_t* act, const uint4* __restrict__ wq, const uint2* __restrict__ wscale,              \
        const int* tile_expert, const int* tile_pairs, const int* num_tiles, const float* topk_w,        \
        const bf16_t* shared_out, bf16_t* __restrict__ out, int K, int NP, int topk, int P, int upb,     \
        int max_tiles) {                                                                                  \
        down_cols_impl<ST, CP>(act, wq, wscale, tile_expert, tile_pairs, num_tiles, topk_w, shared_out,  \
                               out, K, NP, topk, P, upb, max_tiles);                                      \
    }
DD_MOE_DOWN_COLS(2, 2)
DD_MOE_DOWN_COLS(3, 2)
DD_MOE_DOWN_COLS(4, 2)
DD_MOE_DOWN_COLS(2, 4)
