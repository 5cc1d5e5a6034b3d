// A chain of skinny BF16 GEMMs in ONE persistent launch whose weight stream never waits (issue 48):
// op i computes out_i[M, N_i] = x_i[M, K_i] @ w_i[N_i, K_i]^T (bf16 out), where x_i is an earlier op's output (or
// an input ready before the launch). Every warp streams its weight tiles through a private cp.async ring that
// runs ahead ACROSS op boundaries: while a warp waits for the op its next x comes from (a counter, not a kernel
// boundary), its ring is already filling with that op's weights, so HBM does not idle on a dependency.
// Numpy twin: ddtree/plugins/gemm_chain.py reference_chain. Launcher and plan: ddtree/plugins/gemm_chain.py.
//
// Work: a warp item of op i is (16-row output tile, k-split s of S_i): CPS = K_i / 64 / S_i chunks of 64 k. Item j
// runs on global warp (j + off_i) % (grid x GC_WARPS), every warp taking its items in op order, and nothing a warp
// does waits for another warp of its block (no block barrier in the loop): one warp's hand-off stalls do not stop
// the other warps' streams (the first form, block items with x rows in shared memory and block barriers, streamed
// at 40 % of the copy ceiling against the launches' 45 %: docs/performance.md section 5). A warp's x fragments come
// straight from L2 (__ldcg) one chunk ahead. A warp's wait for op d only needs items that every warp schedules
// before its own wait: no cycle (every block is resident: grid <= SMs, one block a SM).
// Split-K partials go to global memory; the warp that arrives last on a tile sums them in split order
// (deterministic) and publishes the tile on done[i] (release); a waiting warp's lane 0 spins on done[d] with
// ld.acquire until all of op d's tiles are out (bounded: err = 1 + d, then it goes on with stale x).
// The block that exits last resets done[] and its own exit count, so a captured graph replays as is.
// Weight layout: plugins/layout.py tile_bf16 ([ceil(N/16), K/64, 4, 32] uint4, the skinny GEMM's).
#include "common.cuh"

#ifndef GC_WARPS
#define GC_WARPS 8
#endif
#ifndef GC_STAGES
#define GC_STAGES 4                // ring depth a warp (2 KB a stage); plugins/compile.py sets it per arch
#endif
#ifndef GC_BULK
#define GC_BULK 0                  // 1: lane 0 fills a stage with one 2 KB bulk copy on its mbarrier (the copy engine)
#endif
#define GC_MAX_OPS 16

struct ChainOp {                   // 64 bytes; plugins/gemm_chain.py OP_DTYPE is the same record
    const uint4* w;                // tiled weight
    const bf16_t* x;               // x_i rows, row stride ldx (elements)
    bf16_t* out;                   // [M, N] bf16
    float4* partial;               // [NT, S, MT, 32] float4 (S > 1)
    int N, K, ldx, S;
    int wait;                      // op whose output x is, -1: ready before the launch
    int off;                       // warp item j runs on global warp (j + off) % (gridDim.x GC_WARPS)
    int group_off;                 // this op's tiles' split-K arrival counters start here
    int pad;
};

struct ItemPos {                   // warp item j of op `op` for this warp; op == n_ops: past the end
    int op, j;
};

__device__ __forceinline__ int warp_items(const ChainOp& o) { return (o.N + 15) / 16 * o.S; }

__device__ __forceinline__ ItemPos first_item(const ChainOp* ops, int n_ops, int op, int gw, int GW) {
    for (; op < n_ops; ++op) {
        const int j = (gw - ops[op].off % GW + GW) % GW;
        if (j < warp_items(ops[op])) return {op, j};
    }
    return {n_ops, 0};
}

__device__ __forceinline__ ItemPos next_item(const ChainOp* ops, int n_ops, ItemPos p, int gw, int GW) {
    p.j += GW;
    return p.j < warp_items(ops[p.op]) ? p : first_item(ops, n_ops, p.op + 1, gw, GW);
}

// x fragments of one 64-k chunk for this lane: rows 8 mt + g, k 32 h + 8 t .. +8 (zero past M)
template <int MT>
__device__ __forceinline__ void load_x(uint4 (&xr)[MT][2], const ChainOp& o, int M, int kc, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = mt * 8 + g;
            xr[mt][h] = row < M ? __ldcg((const uint4*)(o.x + (size_t)row * o.ldx + kc * 64 + 32 * h + 8 * t))
                                : make_uint4(0, 0, 0, 0);
        }
}

template <int MT>
__device__ __forceinline__ void gemm_chain(const ChainOp* __restrict__ gops, int n_ops, int M, u32* done, u32* tiles,
                                           u32* exits, u32* err, int max_spins) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ ChainOp ops[GC_MAX_OPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int gw = blockIdx.x * GC_WARPS + warp, GW = gridDim.x * GC_WARPS;
    for (int i = threadIdx.x; i < n_ops * (int)(sizeof(ChainOp) / 4); i += blockDim.x)
        ((u32*)ops)[i] = ((const u32*)gops)[i];
    __syncthreads();
    uint4 (*ring)[4][32] = (uint4 (*)[4][32])(smem + warp * GC_STAGES * 2048);
#if GC_BULK
    u64* bars = (u64*)(smem + GC_WARPS * GC_STAGES * 2048) + warp * GC_STAGES;
    if (lane == 0) {
        for (int s = 0; s < GC_STAGES; ++s) mbar_init(&bars[s], 1u);
        mbar_init_fence();
    }
    __syncwarp();
    u32 phases = 0;                                      // bit s: the parity stage s's next fill completes
#endif

    // the issue cursor walks the consumer's (item, chunk) sequence up to GC_STAGES - 1 stages ahead
    const u64 policy = evict_first_policy();
    ItemPos ip = first_item(ops, n_ops, 0, gw, GW);
    int ic = 0, ist = 0;
    auto issue = [&]() {
        if (ip.op < n_ops) {
            const ChainOp& o = ops[ip.op];
            const int KC = o.K >> 6, CPS = KC / o.S;
            const uint4* wp = o.w + ((size_t)(ip.j / o.S) * KC + (ip.j % o.S) * CPS + ic) * 128;
#if GC_BULK
            if (lane == 0) {
                fence_proxy_async();                     // the lanes' reads of this stage (last round) come first
                mbar_expect_tx(&bars[ist], 2048u);
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
                             "[%0], [%1], 2048, [%2], %3;"
                             :: "r"(smem_addr(&ring[ist][0][0])), "l"(wp), "r"(smem_addr(&bars[ist])), "l"(policy)
                             : "memory");
            }
#else
#pragma unroll
            for (int q = 0; q < 4; ++q) cp_async16_stream(&ring[ist][q][lane], wp + 32 * q + lane, policy);
#endif
            if (++ic == CPS) { ic = 0; ip = next_item(ops, n_ops, ip, gw, GW); }
        }
#if !GC_BULK
        cp_async_commit();
#endif
        if (++ist == GC_STAGES) ist = 0;
    };
#pragma unroll 1
    for (int s = 0; s < GC_STAGES - 1; ++s) issue();

    int st = 0;
    u32 known = 0;                                       // ops this warp has seen complete (bit i: op i)
    for (ItemPos p = first_item(ops, n_ops, 0, gw, GW); p.op < n_ops; p = next_item(ops, n_ops, p, gw, GW)) {
        const ChainOp& o = ops[p.op];
        const int KC = o.K >> 6, CPS = KC / o.S, tile = p.j / o.S, split = p.j % o.S;
        if (o.wait >= 0 && !(known >> o.wait & 1u)) {     // x_i comes from op `wait`: all its tiles out
            if (lane == 0) {
                const u32 need = (u32)((ops[o.wait].N + 15) / 16);
                u32 v;
                int spins = 0;
                do {
                    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(done + o.wait) : "memory");
                } while (v < need && ++spins < max_spins);
                if (v < need) atomicCAS(err, 0u, (u32)(1 + o.wait));
            }
            __syncwarp();
            known |= 1u << o.wait;
        }
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
        uint4 xn[MT][2];
        load_x<MT>(xn, o, M, split * CPS, g, t);
        for (int c = 0; c < CPS; ++c) {
            uint4 xr[MT][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) { xr[mt][0] = xn[mt][0]; xr[mt][1] = xn[mt][1]; }
            if (c + 1 < CPS) load_x<MT>(xn, o, M, split * CPS + c + 1, g, t);     // one chunk ahead
#if GC_BULK
            mbar_wait(&bars[st], phases >> st & 1u);     // this chunk's stage landed
            phases ^= 1u << st;
#else
            cp_async_wait<GC_STAGES - 2>();              // this chunk's stage landed
#endif
            issue();
            __syncwarp();
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint4 rg = ring[st][2 * h][lane], rg8 = ring[st][2 * h + 1][lane];
                const u32 a0[4] = {rg.x, rg8.x, rg.y, rg8.y}, a1[4] = {rg.z, rg8.z, rg.w, rg8.w};
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16_16816(acc[mt], a0, xr[mt][h].x, xr[mt][h].y);
                    mma_bf16_16816(acc[mt], a1, xr[mt][h].z, xr[mt][h].w);
                }
            }
            __syncwarp();                                // every lane read the stage before it is refilled
            if (++st == GC_STAGES) st = 0;
        }

        // acc[mt] = {(n, m), (n, m+1), (n+8, m), (n+8, m+1)}, n = 16 tile + g, m = 8 mt + 2 t
        auto finish = [&](const float (&v)[MT][4]) {
            const int n = tile * 16 + g;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int q = 0; q < 2; ++q) {
                    const int m = mt * 8 + 2 * t + q;
                    if (m >= M) continue;
                    if (n < o.N) o.out[(size_t)m * o.N + n] = f32_to_bf16(v[mt][q]);
                    if (n + 8 < o.N) o.out[(size_t)m * o.N + n + 8] = f32_to_bf16(v[mt][2 + q]);
                }
        };
        bool publish = true;
        if (o.S == 1) {
            finish(acc);
        } else {                                         // split-K: the warp that arrives last sums in split order
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                o.partial[(((size_t)tile * o.S + split) * MT + mt) * 32 + lane] =
                    make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
            __syncwarp();
            u32 last = 0;
            if (lane == 0) {
                __threadfence();
                last = atomicAdd(tiles + o.group_off + tile, 1u) == (u32)o.S - 1;
                if (last) {
                    atomicExch(tiles + o.group_off + tile, 0u);
                    __threadfence();
                }
            }
            publish = __shfl_sync(0xffffffffu, last, 0);
            if (publish) {
                float sum[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    sum[mt][0] = sum[mt][1] = sum[mt][2] = sum[mt][3] = 0.f;
                    for (int s0 = 0; s0 < o.S; s0 += 8) {   // eight partials in flight, summed in split order
                        float4 v[8];
#pragma unroll
                        for (int u = 0; u < 8; ++u)
                            if (s0 + u < o.S) v[u] = __ldcg(&o.partial[(((size_t)tile * o.S + s0 + u) * MT + mt) * 32 + lane]);
#pragma unroll
                        for (int u = 0; u < 8; ++u)
                            if (s0 + u < o.S) {
                                sum[mt][0] += v[u].x; sum[mt][1] += v[u].y; sum[mt][2] += v[u].z; sum[mt][3] += v[u].w;
                            }
                    }
                }
                finish(sum);
            }
        }
        if (publish) {                                   // this tile is out: count it on done[op]
            __syncwarp();
            if (lane == 0) {
                __threadfence();
                asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(done + p.op), "r"(1u) : "memory");
            }
        }
    }
#if !GC_BULK
    cp_async_wait<0>();
#endif
    __syncthreads();
    if (threadIdx.x == 0) {                              // the last block out resets the counters for the next replay
        __threadfence();
        if (atomicAdd(exits, 1u) == gridDim.x - 1) {
            for (int i = 0; i < n_ops; ++i) atomicExch(done + i, 0u);
            atomicExch(exits, 0u);
            __threadfence();
        }
    }
}

#define DD_DEFINE_CHAIN(NAME, MT)                                                                          \
    extern "C" __global__ void __launch_bounds__(GC_WARPS * 32, 1)                                         \
    NAME(const ChainOp* ops, int n_ops, int M, u32* done, u32* tiles, u32* exits, u32* err, int max_spins) { \
        gemm_chain<MT>(ops, n_ops, M, done, tiles, exits, err, max_spins);                                 \
    }
DD_DEFINE_CHAIN(gemm_chain_mt1, 1)
DD_DEFINE_CHAIN(gemm_chain_mt2, 2)
DD_DEFINE_CHAIN(gemm_chain_mt3, 3)
