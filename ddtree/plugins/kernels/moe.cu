// Fused W4A16 MoE for 1 <= M <= 256 tokens (docs/kimi-k2.md section 5.4; docs/hardware-and-kernels.md section 5).
// Numpy twins: ddtree/plugins/reference.py moe_given_routing (moe_gate_up + moe_down, given the routing)
// and ddtree/model/routing.py route_logits (moe_route). Launcher and split plan: ddtree/plugins/moe.py
// (FusedMoE, plan_moe).
//
//   moe_route    router top-k (sigmoid, +bias for selection, grouped top-k, lowest id wins ties,
//                normalise, x routed_scaling_factor) and token->expert alignment, one block, no host sync
//                (a pruned verify's live mask, when given, applied before the alignment: route_common.cuh live_rows)
//   moe_gate_up  act[pair, I] = silu(x W_gate^T) * (x W_up^T), INT4 weights, split-K with a ticket
//   moe_down     y[split, pair, H] = act W_down^T (split-K partials); the last expert block to finish a
//                token's rows writes out[token] = sum_k w_k sum_s y[s, pair_k] (+ shared expert)
//   moe_stream   both in one persistent launch: the same work items taken by ticket, a down item waiting for
//                its tile's act rows (moe_stream.cuh; launcher FusedMoE.stream_experts, plan plugins/moe_stream.py)
//   moe_down_cols  moe_down + combine by output columns for few rows: a block owns columns of every tile, y never
//                leaves shared memory (moe_down_cols.cuh; launcher FusedMoE.down_cols, plan plugins/moe_down_cols.py)
// With programmatic dependent launch the three kernels overlap their launch and prologue with the
// previous kernel's tail; moe_down fills its weight ring before waiting for moe_gate_up.
//
// A "pair" is (token m, choice k) = m * topk + k. Pairs are grouped by expert into tiles of 8 slots
// (the n = 8 side of mma.m16n8k16); tile_pairs[tile][slot] = pair or -1 for padding.
// Weights use the repacked layout of ddtree/plugins/layout.py: per (16-row tile, 64-k chunk) one
// uint4 per lane (4 mma steps) and one uint2 of bf16 scales per row group g; tiles interleaved in
// pairs per chunk, so a warp streams one contiguous 1 KB block per step.
#include "route_common.cuh"
#include "stamps.cuh"     // STAMP / STAMP_COMMIT: empty unless -D DD_STEP_STAMPS (tests/plugins/profile_step_stamps.py)

#ifndef DD_MAX_E
#define DD_MAX_E 1024
#endif
#define DD_MAX_PAIRS 4096

// --------------------------------------------------------------------------------------------
// routing
// --------------------------------------------------------------------------------------------

// One warp routes one token: the lane holds experts lane + 32 j.
__device__ void route_token(const float* logits, const float* bias, int m, int E, int topk, int n_group,
                            int topk_group, float scaling, int* topk_ids, float* topk_w, int lane) {
    float score[ROUTE_EPL], choice[ROUTE_EPL];
#pragma unroll
    for (int j = 0; j < ROUTE_EPL; ++j) {
        int e = lane + 32 * j;
        if (e < E) {
            float l = logits[(size_t)m * E + e];
            score[j] = 1.0f / (1.0f + expf(-l));                     // g = sigmoid(logit), fp32
            choice[j] = score[j] + (bias ? bias[e] : 0.0f);         // selection only
        } else {
            score[j] = 0.0f;
            choice[j] = DD_NEG_INF;
        }
    }
    if (n_group > 1) keep_best_groups(choice, E, n_group, topk_group, lane);   // keep the best topk_group groups
    float my_w = 0.0f, sum = 0.0f;
    int my_id = 0;
    for (int k = 0; k < topk; ++k) {
        float v = DD_NEG_INF; int i = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < ROUTE_EPL; ++j)                      // e grows with j: strict > keeps the lowest id
            if (choice[j] > v) { v = choice[j]; i = lane + 32 * j; }
        warp_argmax(v, i);
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < ROUTE_EPL; ++j)
            if (lane + 32 * j == i) { s = score[j]; choice[j] = DD_NEG_INF; }
        s = __shfl_sync(0xffffffffu, s, i & 31);
        sum += s;
        if (lane == k) { my_w = s; my_id = i; }
    }
    if (lane < topk) {
        topk_ids[m * topk + lane] = my_id;
        topk_w[m * topk + lane] = my_w / (sum + 1e-20f) * scaling;
    }
}

// Launch: grid 1, block 1024. logits == nullptr: topk_ids/topk_w are inputs (given routing).
// Outputs tile_expert [max_tiles], tile_pairs [max_tiles, 8], num_tiles [1].
// live [M] int32 or null (a pruned verify, issue 53): before the alignment, live_rows (route_common.cuh) writes
// routed_ids [M, topk] (the ids as routed) and live_ids / live_w [M, topk] (dead rows on the root's experts at
// weight 0; topk_ids / topk_w themselves, or other buffers that leave a given routing as given), and the
// alignment reads live_ids. null: as before, routed_ids / live_ids / live_w unused.
extern "C" __global__ void __launch_bounds__(1024)
moe_route(const float* __restrict__ logits, const float* __restrict__ bias, int M, int E, int topk,
          int n_group, int topk_group, float scaling, int* topk_ids, float* topk_w,
          int* __restrict__ tile_expert, int* __restrict__ tile_pairs, int* __restrict__ num_tiles,
          const int* live, int* routed_ids, int* live_ids, float* live_w) {
    __shared__ __align__(16) unsigned char align_smem[(2 * DD_MAX_E + 1) * 4 + DD_MAX_PAIRS * 2];   // align_tiles
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int P = M * topk;
    STAMP(0);
    pdl_wait();                                      // logits / ids written, last readers of the lists done
    pdl_trigger();
    STAMP(1);

    if (logits) {
        for (int m = warp; m < M; m += nwarps)
            route_token(logits, bias, m, E, topk, n_group, topk_group, scaling, topk_ids, topk_w, lane);
    }
    __syncthreads();                                 // topk_ids (global) written by the block's warps
    if (live) {                                      // dead rows onto the root's experts at weight 0
        live_rows(topk_ids, topk_w, nullptr, live, P, topk, routed_ids, live_ids, live_w);
        __syncthreads();
    }
    align_tiles(live ? live_ids : topk_ids, P, E, align_smem, tile_expert, tile_pairs, num_tiles);
    STAMP(5);
    STAMP_COMMIT(4);
}

// --------------------------------------------------------------------------------------------
// W4A16 expert GEMMs
// --------------------------------------------------------------------------------------------
#include "moe_mainloop.cuh"   // W4Slot, W4Bulk, w4_mainloop (and the bulk-copy helpers)

// Tile z's expert and, in threads 0..7, its slot pairs: loaded together (with the tile count, in moe_gate_up), so
// the weights' first request waits one L2 round trip after the routing instead of three (count, pairs, expert:
// about 1 us from the wait to the pairs in the H100 step's stamps). z < max tiles: inside the lists' buffers even past
// the tile count (read, then not used).
struct TileOf {
    int e, pair;
};
__device__ __forceinline__ TileOf load_tile(const int* tile_expert, const int* tile_pairs, int z) {
    return {ld_cg_s32(&tile_expert[z]), threadIdx.x < 8 ? ld_cg_s32(&tile_pairs[z * 8 + threadIdx.x]) : -1};
}

// One gate_up work item: tile z (8 slots of one expert, `tile` = load_tile's), n-block bx of NB, k-split by of S
// (blockIdx in moe_gate_up, a ticket's item in moe_stream). Each warp owns 2 tpw consecutive n-tiles (NT even).
// Fused tile f holds gate rows 8f..8f+7 (A rows 0-7) and up rows 8f..8f+7 (A rows 8-15), so a lane's
// acc = {gate(slot 2t), gate(slot 2t+1), up(slot 2t), up(slot 2t+1)} for intermediate j = 8f + g.
//   x        [M, K] bf16        wq [E, NT, K/64, 32] uint4     wscale [E, NT, K/64, 8] uint2
//   act      [M * topk, I] bf16 (I = 8 NT)
//   partial  [max_tiles, NB, S, nwarps * 2 tpw, 32] float4, counters [max_tiles * NB] (zeroed once)
// Returns true in the block that wrote act for (z, bx): every block when S == 1, else the last split to arrive.
// Outputs of earlier kernels are read with ld.global.cg or cp.async (L2), never through the non-coherent
// path that `const __restrict__` allows: with PDL (and in moe_stream) they are written during our lifetime.
template <int STAGES, int CPSLOT, bool BULK = false>
__device__ __forceinline__ bool gate_up_item(const bf16_t* __restrict__ x, const uint4* __restrict__ wq,
                                             const uint2* __restrict__ wscale, TileOf tile, bf16_t* __restrict__ act,
                                             float4* __restrict__ partial, u32* __restrict__ counters, int K,
                                             int NT, int topk, int S, int tpw, int z, int bx, int by, int NB,
                                             const W4Bulk& bk = W4Bulk{}) {
    __shared__ int pairs[8];
    if (threadIdx.x < 8) pairs[threadIdx.x] = tile.pair;
    __syncthreads();
    STAMP(2);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles_pw = 2 * tpw, ntb = (blockDim.x >> 5) * tiles_pw;
    const int I = NT * 8, nt_begin = (bx * (blockDim.x >> 5) + warp) * tiles_pw;
    const size_t part_base = ((size_t)z * NB + bx) * S;   // [.., S, ntb, 32]

    auto finish = [&](int r, const float* v) {           // v = {gate 2t, gate 2t+1, up 2t, up 2t+1}
        const int j = (nt_begin + r) * 8 + g;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            int p = pairs[2 * t + q];
            if (p >= 0) act[(size_t)p * I + j] = f32_to_bf16(silu(v[q]) * v[2 + q]);
        }
    };
    auto epi = [&](int r, const float (&acc)[4]) {
        if (S == 1) {
            finish(r, acc);
        } else {
            size_t idx = ((part_base + by) * ntb + warp * tiles_pw + r) * 32 + lane;
            partial[idx] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        }
    };
    w4_mainloop<0, false, STAGES, CPSLOT, BULK, false>(x, wq, wscale, pairs, tile.e, K, NT, topk, S, tpw, bx, by, bk,
                                                       [] {}, epi);
    STAMP(3);
    if (S == 1) return true;
    if (!arrive_last(&counters[(size_t)z * NB + bx], (u32)S)) return false;
    STAMP(4);
    const int my_tiles = 2 * max(0, min(tpw, (NT - nt_begin) / 2));
    for (int r = 0; r < my_tiles; ++r) {
        float sum[4] = {0.f, 0.f, 0.f, 0.f};
        sum_partials<8>(sum, S, [&](int s) {             // fixed order: deterministic
            return ld_cg_f4(&partial[((part_base + s) * ntb + warp * tiles_pw + r) * 32 + lane]);
        });
        finish(r, sum);
    }
    return true;
}

// Share `part` of `parts` of [base, base + bytes) (bytes a multiple of 128) -> L2, one line a thread.
__device__ __forceinline__ void prefetch_l2_share(const void* base, size_t bytes, int part, int parts) {
    const size_t lines = bytes >> 7, l0 = lines * part / parts, l1 = lines * (part + 1) / parts;
    for (size_t l = l0 + threadIdx.x; l < l1; l += blockDim.x)
        asm volatile("prefetch.global.L2 [%0];" :: "l"((const char*)base + (l << 7)));
}

// Block `part` of the `parts` gate_up blocks of tile z asks L2 for its share of tile z's expert's down weights
// (words [E, H, I] / 2 and scales / 16 bytes, expert-major), once an expert: one expert's tiles are consecutive.
__device__ __forceinline__ void prefetch_down_share(const void* dn_wq, const void* dn_ws, const int* tile_expert,
                                                    int z, int H, int I, int part, int parts) {
    const int e = ld_cg_s32(&tile_expert[z]);
    if (z > 0 && ld_cg_s32(&tile_expert[z - 1]) == e) return;
    const size_t wbytes = (size_t)H * I / 2, sbytes = (size_t)H * I / 16;
    prefetch_l2_share((const char*)dn_wq + e * wbytes, wbytes, part, parts);
    prefetch_l2_share((const char*)dn_ws + e * sbytes, sbytes, part, parts);
}

// Grid (NB, S, max_tiles), block nwarps * 32, dynamic smem = 16 * (K/S + 32) + 2 * K/S
// + nwarps * STAGES * sizeof(W4Slot<CPSLOT>) (x rows, xcorr, rings). Blocks past the tile count exit.
// With a launch of at most prefetch_tiles tiles, the NB x S blocks of an expert's first tile first ask L2 for a
// share each of that expert's down weights (dn_wq / dn_ws, prefetch_down_share), so the down launch reads them from
// L2: at few rows gate_up is latency-bound and leaves DRAM idle, and the down weights would otherwise start
// streaming only after gate_up completes (0: no prefetch).
template <int STAGES, int CPSLOT>
__device__ __forceinline__ void gate_up_impl(const bf16_t* __restrict__ x, const uint4* __restrict__ wq,
                                             const uint2* __restrict__ wscale, const int* tile_expert,
                                             const int* tile_pairs, const int* num_tiles, bf16_t* __restrict__ act,
                                             float4* __restrict__ partial, u32* __restrict__ counters, int K,
                                             int NT, int topk, int S, int tpw, const uint4* dn_wq,
                                             const uint2* dn_ws, int prefetch_tiles) {
    STAMP(0);
    pdl_wait();                                          // tile lists (route) and x; the weights need the lists
    pdl_trigger();                                       // the down kernel may start prefetching its weights
    STAMP(1);
    const int tiles = ld_cg_s32(num_tiles), z = blockIdx.z;
    const TileOf tile = load_tile(tile_expert, tile_pairs, z);   // in flight with the count
    if (z >= tiles) return;
    if (tiles <= prefetch_tiles)                         // K = H, NT = I / 8
        prefetch_down_share(dn_wq, dn_ws, tile_expert, z, K, NT * 8, blockIdx.y * gridDim.x + blockIdx.x,
                            gridDim.x * gridDim.y);
    gate_up_item<STAGES, CPSLOT>(x, wq, wscale, tile, act, partial, counters, K, NT, topk, S, tpw, blockIdx.z,
                                 blockIdx.x, blockIdx.y, gridDim.x);
    STAMP(5);
    STAMP_COMMIT(2);
}

// One down work item: tile z, n-block bx of NB, k-split by of S. Split s covers k = I/S * [s, s + 1) and writes
// its own partial rows y[s]; the combine adds the S partials of each expert (fixed order: deterministic).
//   act [P, I] bf16 (P = M * topk)   wq [E, H/16, I/64, 32] uint4   wscale [E, H/16, I/64, 8] uint2
//   y   [S, P, H] fp32   topk_w [M, topk]   shared_out [M, H] bf16 or null   out [M, H] bf16
//   counters [M_max * NB] (zeroed once; each (token, n-block) counts its topk * S expert blocks)
// The weight ring is filled first, then wait_for_act() (every thread calls it), then the act rows load.
template <int STAGES, int CPSLOT, bool BULK = false, bool PINNED = false, class WaitAct>
__device__ __forceinline__ void down_item(const bf16_t* __restrict__ act, const uint4* __restrict__ wq,
                                          const uint2* __restrict__ wscale, const int* tile_expert,
                                          const int* tile_pairs, float* __restrict__ y, const float* topk_w,
                                          const bf16_t* shared_out, bf16_t* __restrict__ out,
                                          u32* __restrict__ counters, int K, int NT, int topk, int tpw, int P, int z,
                                          int bx, int by, int NB, int S, WaitAct wait_for_act,
                                          const W4Bulk& bk = W4Bulk{}) {
    __shared__ int pairs[8];
    __shared__ int finished_token[8];
    if (threadIdx.x < 8) pairs[threadIdx.x] = ld_cg_s32(&tile_pairs[z * 8 + threadIdx.x]);
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles_pb = (blockDim.x >> 5) * 2 * tpw;
    const int H = NT * 16, nt_begin = (bx * (blockDim.x >> 5) + warp) * 2 * tpw;
    float* ys = y + (size_t)by * P * H;                  // this split's partial rows

    auto epi = [&](int r, const float (&acc)[4]) {      // acc = {(n, 2t), (n, 2t+1), (n+8, 2t), (n+8, 2t+1)}
        const int n = (nt_begin + r) * 16 + g;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            int p = pairs[2 * t + q];
            if (p >= 0) {
                ys[(size_t)p * H + n] = acc[q];
                ys[(size_t)p * H + n + 8] = acc[2 + q];
            }
        }
    };
    w4_mainloop<1, true, STAGES, CPSLOT, BULK, PINNED>(act, wq, wscale, pairs, ld_cg_s32(&tile_expert[z]), K, NT,
                                                       topk, S, tpw, bx, by, bk, wait_for_act, epi);

    // combine: the last of a token's topk * S expert blocks to finish this n-block writes its rows. The 8
    // ticket threads (one warp) each take their token's ticket after the barrier, as arrive_last (common.cuh)
    // does: one acq_rel atomic publishes the block's y rows and, on the last ticket, acquires the other blocks'.
#if DD_FENCE_ALL_THREADS
    __threadfence();
#endif
    __syncthreads();
    if (threadIdx.x < 8) {
        int p = pairs[threadIdx.x], tok = -1;
        if (p >= 0 && take_last_ticket(&counters[(size_t)(p / topk) * NB + bx], (u32)(topk * S))) tok = p / topk;
        finished_token[threadIdx.x] = tok;
    }
    __syncthreads();
#if DD_FENCE_ALL_THREADS
    __threadfence();
#endif
    const int n0 = bx * tiles_pb * 16, n1 = min(H, n0 + tiles_pb * 16);
    for (int slot = 0; slot < 8; ++slot) {
        const int tok = finished_token[slot];
        if (tok < 0) continue;
        for (int n = n0 + threadIdx.x; n < n1; n += blockDim.x) {
            float v = 0.f;
            // fixed order (split, then expert): deterministic. One flat inner loop over k so that ptxas
            // batches its L2 loads (a nested runtime loop serialised them: +8 us at TP8, M = 1)
            for (int s = 0; s < S; ++s) {
                const float* ys_tok = y + ((size_t)s * P + tok * topk) * H + n;
                for (int k = 0; k < topk; ++k)
                    v += __ldcg(&topk_w[tok * topk + k]) * ld_cg_f32(ys_tok + (size_t)k * H);
            }
            if (shared_out) v += bf16_to_f32(__ldcg(&shared_out[(size_t)tok * H + n]));
            out[(size_t)tok * H + n] = f32_to_bf16(v);
        }
    }
}

// Grid (NB, S, max_tiles), block nwarps * 32, dynamic smem = 16 * (I/S + 32) + 2 * I/S
// + nwarps * STAGES * sizeof(W4Slot<CPSLOT>). The tile lists come from the route kernel two launches back,
// complete before gate_up triggered this launch: they are read (ld.global.cg) and the weight ring is filled
// before waiting for gate_up (programmatic launch).
template <int STAGES, int CPSLOT>
__device__ __forceinline__ void down_impl(const bf16_t* __restrict__ act, const uint4* __restrict__ wq,
                                          const uint2* __restrict__ wscale, const int* tile_expert,
                                          const int* tile_pairs, const int* num_tiles, float* __restrict__ y,
                                          const float* topk_w, const bf16_t* shared_out, bf16_t* __restrict__ out,
                                          u32* __restrict__ counters, int K, int NT, int topk, int tpw, int P) {
    // at least one tile is real (M >= 1), so some blocks of this grid always wait for gate_up: the grid
    // never completes before gate_up does, which the next programmatic launch relies on
    if ((int)blockIdx.z >= ld_cg_s32(num_tiles)) return;
    auto wait_for_act = [] { pdl_wait(); pdl_trigger(); };
    down_item<STAGES, CPSLOT>(act, wq, wscale, tile_expert, tile_pairs, y, topk_w, shared_out, out, counters, K,
                              NT, topk, tpw, P, blockIdx.z, blockIdx.x, blockIdx.y, gridDim.x, gridDim.y,
                              wait_for_act);
}

#include "moe_stream.cuh"
#include "moe_down_cols.cuh"   // the down projection + combine by output columns, for few rows

// Ring variants (kernel names moe_{gate_up,down,stream}_r<STAGES>c<CPSLOT>, moe_stream_r<STAGES>c<CPSLOT>_bulk with
// the slots as bulk copies), chosen per launch by the plan (ddtree/plugins/moe.py RINGS). __launch_bounds__(512, 1): up to 128 registers; at the default 64 ptxas
// re-materialised the dequant mask before every lop3 (one extra MOV each, seen in the SASS).
#define DD_MOE_STREAM(ST, CP, BULK, NAME)                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME(                                            \
        const bf16_t* __restrict__ x, const uint4* __restrict__ gu_wq, const uint2* __restrict__ gu_ws, \
        const uint4* __restrict__ dn_wq, const uint2* __restrict__ dn_ws, const int* tile_expert,       \
        const int* tile_pairs, const int* num_tiles, bf16_t* __restrict__ act, float4* __restrict__ partial, \
        u32* __restrict__ gu_counters, float* __restrict__ y, const float* topk_w, const bf16_t* shared_out, \
        bf16_t* __restrict__ out, u32* __restrict__ dn_counters, u32* __restrict__ queue,                 \
        u32* __restrict__ ready, int H, int I, int topk, int S, int gu_tpw, int gu_NB, int dn_tpw, int dn_NB, \
        int P, int prefetch_tiles, int pin) {                                                             \
        stream_impl<ST, CP, BULK>(x, gu_wq, gu_ws, dn_wq, dn_ws, tile_expert, tile_pairs, num_tiles, act, \
                                  partial, gu_counters, y, topk_w, shared_out, out, dn_counters, queue, ready, H, \
                                  I, topk, S, gu_tpw, gu_NB, dn_tpw, dn_NB, P, prefetch_tiles, pin);        \
    }
#define DD_MOE_RING(ST, CP)                                                                               \
    extern "C" __global__ void __launch_bounds__(512, 1) moe_gate_up_r##ST##c##CP(                      \
        const bf16_t* __restrict__ x, const uint4* __restrict__ wq, const uint2* __restrict__ wscale,   \
        const int* tile_expert, const int* tile_pairs, const int* num_tiles, bf16_t* __restrict__ act,   \
        float4* __restrict__ partial, u32* __restrict__ counters, int K, int NT, int topk, int S, int tpw,  \
        const uint4* dn_wq, const uint2* dn_ws, int prefetch_tiles) {                                      \
        gate_up_impl<ST, CP>(x, wq, wscale, tile_expert, tile_pairs, num_tiles, act, partial, counters, K, \
                             NT, topk, S, tpw, dn_wq, dn_ws, prefetch_tiles);                             \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(512, 1) moe_down_r##ST##c##CP(                         \
        const bf16_t* __restrict__ act, const uint4* __restrict__ wq, const uint2* __restrict__ wscale, \
        const int* tile_expert, const int* tile_pairs, const int* num_tiles, float* __restrict__ y,       \
        const float* topk_w, const bf16_t* shared_out, bf16_t* __restrict__ out, u32* __restrict__ counters, \
        int K, int NT, int topk, int tpw, int P) {                                                        \
        down_impl<ST, CP>(act, wq, wscale, tile_expert, tile_pairs, num_tiles, y, topk_w, shared_out, out, \
                          counters, K, NT, topk, tpw, P);                                                 \
    }                                                                                                     \
    DD_MOE_STREAM(ST, CP, false, moe_stream_r##ST##c##CP)                                                 \
    DD_MOE_STREAM(ST, CP, true, moe_stream_r##ST##c##CP##_bulk)
// Occupancy variants of the two launches (plan knobs gu_occ / dn_occ, plugins/moe.py OCC_KERNELS): the same bodies at
// W warps a block under __launch_bounds__(32 W, B), B blocks an SM: at most 65536 / (32 W B) registers (80 for
// 24 warps an SM; sm_90 and sm_120 compile them without spills), so 24 warps an SM instead of the 16 of one 512-thread
// gate_up block or the 5 four-warp down blocks that 86 registers allow. Names moe_{gate_up,down}_r<S>c<C>_w<W>o<B>.
#define DD_MOE_GATE_UP_OCC(ST, CP, W, B)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * W, B) moe_gate_up_r##ST##c##CP##_w##W##o##B(        \
        const bf16_t* __restrict__ x, const uint4* __restrict__ wq, const uint2* __restrict__ wscale,   \
        const int* tile_expert, const int* tile_pairs, const int* num_tiles, bf16_t* __restrict__ act,   \
        float4* __restrict__ partial, u32* __restrict__ counters, int K, int NT, int topk, int S, int tpw,  \
        const uint4* dn_wq, const uint2* dn_ws, int prefetch_tiles) {                                      \
        gate_up_impl<ST, CP>(x, wq, wscale, tile_expert, tile_pairs, num_tiles, act, partial, counters, K, \
                             NT, topk, S, tpw, dn_wq, dn_ws, prefetch_tiles);                             \
    }
#define DD_MOE_DOWN_OCC(ST, CP, W, B)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * W, B) moe_down_r##ST##c##CP##_w##W##o##B(           \
        const bf16_t* __restrict__ act, const uint4* __restrict__ wq, const uint2* __restrict__ wscale, \
        const int* tile_expert, const int* tile_pairs, const int* num_tiles, float* __restrict__ y,       \
        const float* topk_w, const bf16_t* shared_out, bf16_t* __restrict__ out, u32* __restrict__ counters, \
        int K, int NT, int topk, int tpw, int P) {                                                        \
        down_impl<ST, CP>(act, wq, wscale, tile_expert, tile_pairs, num_tiles, y, topk_w, shared_out, out, \
                          counters, K, NT, topk, tpw, P);                                                 \
    }
DD_MOE_GATE_UP_OCC(3, 2, 8, 3)
DD_MOE_GATE_UP_OCC(3, 2, 4, 6)
DD_MOE_DOWN_OCC(6, 1, 4, 6)
DD_MOE_DOWN_OCC(6, 1, 8, 3)
DD_MOE_RING(6, 1)
DD_MOE_RING(3, 2)
DD_MOE_RING(4, 2)
DD_MOE_RING(5, 2)
DD_MOE_RING(2, 4)
