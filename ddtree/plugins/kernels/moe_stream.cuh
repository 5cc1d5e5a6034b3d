// moe_stream: gate_up -> down of the fused W4A16 MoE in ONE persistent launch (issue 22). Part of moe.cu, included
// after its work-item functions (gate_up_item, down_item); numpy twin of the schedule: ddtree/plugins/moe_stream.py
// (stream_items, simulate_stream), of the math: ddtree/plugins/reference.py moe_given_routing.
//
// Blocks take work items by ticket (one atomicAdd on queue[0], taken one item ahead unless the queue is within the
// grid): tickets
// [0, n_gu) are gate_up items (tile z, k-split by, n-block bx), z-major, then the down items (tile z, n-block bx),
// z-major, from n_pin (0 unless pinned: see stream_impl). The
// block that completes a (tile, n-block) of act (the last k-split to arrive) adds 1 to ready[z] (release); a
// down item of tile z first fills its weight ring, then waits for ready[z] == gu_NB (acquire), so its weights
// stream while gate_up finishes: no kernel boundary, no grid drain between the two GEMMs.
// No deadlock whatever the residency: every gate_up ticket is taken before any down ticket, by a block that
// is running and never waits, so the items a down item waits for always complete.
// With prefetch_tiles >= the tile count, each gate_up item first asks L2 for its share of its expert's down
// weights (one expert's tiles are consecutive: only the first tile of an expert does), so the down items
// read them from L2 (M = 1: the down part's latency after gate_up is the L2's, not DRAM's).
// queue [2] (tickets, blocks done) and ready [max_tiles] are zero before the first launch; the last block to
// leave sets them back to zero for the next launch (graph replays).

__device__ __forceinline__ u32 ld_acquire_u32(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void sleep_ns(u32 ns) { asm volatile("nanosleep.u32 %0;" :: "r"(ns)); }

// Every thread: until tile z's act rows are complete (ready[z] == need; acquire). Bounded: a broken hand-off
// traps instead of hanging.
__device__ __forceinline__ void wait_ready(const u32* ready, int z, u32 need) {
    if (threadIdx.x == 0)
        for (u32 spins = 0; ld_acquire_u32(&ready[z]) < need; ++spins) {
            if (spins == (1u << 25)) asm volatile("trap;");
            sleep_ns(64);
        }
    __syncthreads();
}

// A pinned down item's weights -> bk.pin, all at once: lane 0 of each warp issues its slots as bulk copies, one
// mbarrier a slot (phase 0, waited by w4_mainloop<PINNED>). Down item (expert e, n-block bx) of K = I at one k-split,
// so a warp's tile pairs' chunks are contiguous in memory and in its bk.pin_slots slots.
template <int CPSLOT>
__device__ __forceinline__ void w4_issue_pinned(const uint4* wq, const uint2* wscale, int e, int K, int NT, int tpw,
                                                int bx, const W4Bulk& bk) {
    typedef W4Slot<CPSLOT> Slot;
    const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if ((threadIdx.x & 31) != 0) return;
    const int KC = K >> 6, nt_begin = 2 * (bx * nwarps + warp) * tpw;
    const int slots = max(0, min(tpw, (NT - nt_begin) / 2)) * KC / CPSLOT;
    const size_t pair_base = (size_t)e * (NT / 2) + nt_begin / 2;
    const uint4* wp = wq + pair_base * KC * 64;
    const uint4* sp = (const uint4*)wscale + pair_base * KC * 8;
    Slot* ring = (Slot*)bk.pin + warp * bk.pin_slots;
    u64* bars = bk.pin_bars + warp * bk.pin_slots;
    for (int i = 0; i < bk.pin_slots; ++i) mbar_init(&bars[i], 1u);
    mbar_init_fence();
    const u64 policy = evict_first_policy();
    for (int i = 0; i < slots; ++i) {
        mbar_expect_tx(&bars[i], CPSLOT * (1024u + 128u));
        bulk_copy_g2s_hint(&ring[i].w[0][0][0], wp + (size_t)i * 64 * CPSLOT, CPSLOT * 1024u, &bars[i], policy);
        bulk_copy_g2s_hint(&ring[i].s[0][0][0], sp + (size_t)i * 8 * CPSLOT, CPSLOT * 128u, &bars[i], policy);
    }
}

// Grid: persistent blocks (the plan: SMs x blocks per SM), block nwarps * 32, dynamic smem (plugins/moe_stream.py
// plan_stream): x_max = the larger part's x rows + xcorr (16 (K + 32) + 2 K for K = H/S and I), the warps' rings
// (nwarps * STAGES * sizeof(W4Slot<CPSLOT>)); BULK: their mbarriers (nwarps * STAGES * 8); pin: the pinned down
// item's slots (nwarps * pin_slots * sizeof(W4Slot<CPSLOT>), pin_slots = dn_tpw * I / 64 / CPSLOT) and mbarriers.
// Tensors as in moe_gate_up (x, gu_wq, gu_ws, act, partial, gu_counters: K = H, NT = I/8, S k-splits) and
// moe_down (act, dn_wq, dn_ws, y, topk_w, shared_out, out, dn_counters: K = I, NT = H/16, one k-split).
// pin (BULK only): block b < min(grid, down items) owns down item b from its start (its weights issued before
// any gate_up work: every byte of a one-wave launch requested at once) and runs it once the gate_up tickets are
// gone; the queue then hands out gate_up items and the down items from the pinned count on. No deadlock: a block
// waits for its pinned item's act only after drawing a ticket past the gate_up items, all of which are then held
// by blocks that run them without waiting.
template <int STAGES, int CPSLOT, bool BULK>
__device__ __forceinline__ void stream_impl(
        const bf16_t* __restrict__ x, const uint4* __restrict__ gu_wq, const uint2* __restrict__ gu_ws,
        const uint4* __restrict__ dn_wq, const uint2* __restrict__ dn_ws, const int* tile_expert,
        const int* tile_pairs, const int* num_tiles, bf16_t* __restrict__ act, float4* __restrict__ partial,
        u32* __restrict__ gu_counters, float* __restrict__ y, const float* topk_w, const bf16_t* shared_out,
        bf16_t* __restrict__ out, u32* __restrict__ dn_counters, u32* __restrict__ queue, u32* __restrict__ ready,
        int H, int I, int topk, int S, int gu_tpw, int gu_NB, int dn_tpw, int dn_NB, int P, int prefetch_tiles,
        int pin) {
    typedef W4Slot<CPSLOT> Slot;
    extern __shared__ __align__(16) unsigned char smem[];
    const int nwarps = blockDim.x >> 5;
    const int x_max = max(16 * (H / S + 32) + 2 * (H / S), 16 * (I + 32) + 2 * I);
    W4Bulk bk;
    bk.bars = (u64*)(smem + x_max + nwarps * STAGES * sizeof(Slot));
    bk.pin = (unsigned char*)(bk.bars + nwarps * STAGES);
    bk.pin_slots = dn_tpw * (I / 64) / CPSLOT;
    bk.pin_bars = (u64*)(bk.pin + (size_t)nwarps * bk.pin_slots * sizeof(Slot));
    pdl_wait();                                          // tile lists (route) and x
    pdl_trigger();
    const int tiles = ld_cg_s32(num_tiles);
    const int gu_per_tile = gu_NB * S, n_gu = tiles * gu_per_tile, n_dn = tiles * dn_NB;
    const int n_pin = BULK && pin ? min((int)gridDim.x, n_dn) : 0;
    const int n_items = n_gu + n_dn - n_pin;             // tickets: gate_up items, then down items n_pin..
    int pinned = (int)blockIdx.x < n_pin ? (int)blockIdx.x : -1;
    if constexpr (BULK) {
        if (pinned >= 0) {
            const int z = pinned / dn_NB;
            w4_issue_pinned<CPSLOT>(dn_wq, dn_ws, ld_cg_s32(&tile_expert[z]), I, H / 16, dn_tpw, pinned - z * dn_NB,
                                    bk);
        }
    }
    __shared__ int s_item;
    if (threadIdx.x == 0) s_item = (int)atomicAdd(&queue[0], 1u);
    for (;;) {
        __syncthreads();                                 // s_item written; the previous item's smem is free
        const int item = s_item;
        if constexpr (BULK) {
            if (pinned >= 0 && item >= n_gu) {           // no gate_up ticket left: the pinned item's turn
                const int z = pinned / dn_NB;
                auto wait_pinned = [&] { wait_ready(ready, z, (u32)gu_NB); };
                down_item<STAGES, CPSLOT, BULK, true>(act, dn_wq, dn_ws, tile_expert, tile_pairs, y, topk_w,
                                                      shared_out, out, dn_counters, I, H / 16, topk, dn_tpw, P, z,
                                                      pinned - z * dn_NB, 0, dn_NB, 1, wait_pinned, bk);
                pinned = -1;
                __syncthreads();                         // its smem (pairs, x rows) is free for the next item
            }
        }
        if (item >= n_items) break;
        // The next ticket is taken now and used after this item: its atomic's round trip hides behind the work.
        // Not when the queue holds no more items than the grid has blocks (the pinned M = 1 plan: 112 gate_up
        // items on 132 blocks): there a look-ahead would give early blocks two items while later ones find the
        // queue empty. (Skipping it only in the first round of longer queues measured slower: H200, tp 8, M = 17
        // 166 vs 140 us, M = 1 32.5 vs 29.0.) Still no deadlock: a block holding a gate_up ticket behind its
        // current item is working on an earlier gate_up item (tickets are ordered), which never waits.
        const bool ahead = n_items > (int)gridDim.x;
        u32 next = 0;
        if (threadIdx.x == 0 && ahead) next = atomicAdd(&queue[0], 1u);
        if (item < n_gu) {
            const int z = item / gu_per_tile, r = item - z * gu_per_tile, by = r / gu_NB, bx = r - by * gu_NB;
            if (tiles <= prefetch_tiles) prefetch_down_share(dn_wq, dn_ws, tile_expert, z, H, I, r, gu_per_tile);
            if (gate_up_item<STAGES, CPSLOT, BULK>(x, gu_wq, gu_ws, load_tile(tile_expert, tile_pairs, z), act, partial,
                                                   gu_counters, H, I / 8, topk, S, gu_tpw, z, bx, by, gu_NB, bk)) {
                __syncthreads();                         // every thread's act rows of (z, bx) are written
                if (threadIdx.x == 0) {
                    __threadfence();
                    atomicAdd(&ready[z], 1u);
                }
            }
        } else {
            const int d = item - n_gu + n_pin, z = d / dn_NB, bx = d - z * dn_NB;
            auto wait_for_act = [&] { wait_ready(ready, z, (u32)gu_NB); };
            down_item<STAGES, CPSLOT, BULK>(act, dn_wq, dn_ws, tile_expert, tile_pairs, y, topk_w, shared_out, out,
                                            dn_counters, I, H / 16, topk, dn_tpw, P, z, bx, 0, dn_NB, 1, wait_for_act,
                                            bk);
        }
        __syncthreads();                                 // every thread has read s_item
        if (threadIdx.x == 0) s_item = (int)(ahead ? next : atomicAdd(&queue[0], 1u));
    }
    // The last block out resets the queue for the next launch (common.cuh take_last_ticket: the loop's last barrier
    // orders this block's reads of queue and ready before thread 0's acq_rel ticket; the last taker's acquire orders
    // every block's before its plain resets, which the next launch sees after this grid completes).
    if (threadIdx.x == 0 && take_last_ticket(&queue[1], gridDim.x)) {
        for (int z = 0; z < tiles; ++z) ready[z] = 0u;
        queue[0] = 0u;
    }
}
