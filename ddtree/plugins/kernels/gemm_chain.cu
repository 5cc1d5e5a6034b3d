// A chain of skinny BF16 GEMMs in ONE persistent launch whose weight stream never waits (issue 48):
// op i computes out_i[M, N_i] = x_i[M, K_i] @ w_i[N_i, K_i]^T (bf16 out), where x_i is an earlier op's output (or
// an input ready before the launch). Every warp streams its weight tiles through a private cp.async ring that
// runs ahead ACROSS op boundaries: while a block waits for the op its next x comes from (a counter, not a kernel
// boundary), its rings are already filling with that op's weights, so HBM never idles on a dependency.
// Numpy twin: ddtree/plugins/gemm_chain.py reference_chain. Launcher and plan: ddtree/plugins/gemm_chain.py.
//
// Work: op i's output tiles (16 rows of w) form groups of GC_WARPS tiles (one a warp); a block item is (group,
// k-split s of S_i): the block's warps stream their tile's CPS = K_i / 64 / S_i chunks of 64 k each and the
// block holds x_i's rows for that k-span in shared memory. Block item j of op i runs on block (j + off_i) % grid,
// in op order on every block, so a block's wait for op d only ever needs items every block schedules before its
// own wait: no cycle (every block is resident: grid <= SMs, one block a SM).
// Split-K partials go to global memory; the last block of a group (arrive_last) sums them in split order
// (deterministic) and publishes the group's tiles on done[i] (release); a consumer's thread 0 spins on done[d]
// with ld.acquire until all of op d's tiles are out (bounded: err = 1 + d, then it goes on with stale x).
// The block that exits last resets done[] and its own exit count, so a captured graph replays as is.
// Weight layout: plugins/layout.py tile_bf16 ([ceil(N/16), K/64, 4, 32] uint4, the skinny GEMM's).
#include "common.cuh"

#ifndef GC_WARPS
#define GC_WARPS 8
#endif
#ifndef GC_STAGES
#define GC_STAGES 4                // ring depth a warp (2 KB a stage); plugins/compile.py sets it per arch
#endif
#define GC_MAX_OPS 16

struct ChainOp {                   // 64 bytes; plugins/gemm_chain.py OP_DTYPE is the same record
    const uint4* w;                // tiled weight
    const bf16_t* x;               // x_i rows, row stride ldx (elements)
    bf16_t* out;                   // [M, N] bf16
    float4* partial;               // [NT, S, MT, 32] float4 (S > 1)
    int N, K, ldx, S;
    int wait;                      // op whose output x is, -1: ready before the launch
    int off;                       // block item j runs on block (j + off) % gridDim.x
    int group_off;                 // this op's groups' arrival counters start here
    int pad;
};

struct ItemPos {                   // block item j of op `op` for this block; op == n_ops: past the end
    int op, j;
};

__device__ __forceinline__ int block_items(const ChainOp& o) {
    return ((o.N + 15) / 16 + GC_WARPS - 1) / GC_WARPS * o.S;
}

__device__ __forceinline__ ItemPos first_item(const ChainOp* ops, int n_ops, int op) {
    for (; op < n_ops; ++op) {
        const int G = gridDim.x, j = ((int)blockIdx.x - ops[op].off % G + G) % G;
        if (j < block_items(ops[op])) return {op, j};
    }
    return {n_ops, 0};
}

__device__ __forceinline__ ItemPos next_item(const ChainOp* ops, int n_ops, ItemPos p) {
    p.j += gridDim.x;
    return p.j < block_items(ops[p.op]) ? p : first_item(ops, n_ops, p.op + 1);
}

template <int MT>
__device__ __forceinline__ void gemm_chain(const ChainOp* __restrict__ gops, int n_ops, int M, u32* done, u32* groups,
                                           u32* exits, u32* err, int max_spins) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ ChainOp ops[GC_MAX_OPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int i = threadIdx.x; i < n_ops * (int)(sizeof(ChainOp) / 4); i += blockDim.x)
        ((u32*)ops)[i] = ((const u32*)gops)[i];
    __syncthreads();
    uint4 (*ring)[4][32] = (uint4 (*)[4][32])(smem + warp * GC_STAGES * 2048);
    bf16_t* xs = (bf16_t*)(smem + GC_WARPS * GC_STAGES * 2048);
    int xstride = 0;                                     // the widest k-span of the chain + 32 (conflict-free)
    for (int i = 0; i < n_ops; ++i) xstride = max(xstride, ops[i].K / 64 / ops[i].S * 64 + 32);

    // the issue cursor walks the consumer's (item, chunk) sequence up to GC_STAGES - 1 stages ahead
    const u64 policy = evict_first_policy();
    ItemPos ip = first_item(ops, n_ops, 0);
    int ic = 0, ist = 0;
    auto issue = [&]() {
        if (ip.op < n_ops) {
            const ChainOp& o = ops[ip.op];
            const int KC = o.K >> 6, CPS = KC / o.S, tile = ip.j / o.S * GC_WARPS + warp;
            if (tile < (o.N + 15) / 16) {
                const uint4* wp = o.w + ((size_t)tile * KC + (ip.j % o.S) * CPS + ic) * 128 + lane;
#pragma unroll
                for (int q = 0; q < 4; ++q) cp_async16_stream(&ring[ist][q][lane], wp + 32 * q, policy);
            }
            if (++ic == CPS) { ic = 0; ip = next_item(ops, n_ops, ip); }
        }
        cp_async_commit();
        if (++ist == GC_STAGES) ist = 0;
    };
#pragma unroll 1
    for (int s = 0; s < GC_STAGES - 1; ++s) issue();

    int st = 0;
    for (ItemPos p = first_item(ops, n_ops, 0); p.op < n_ops; p = next_item(ops, n_ops, p)) {
        const ChainOp& o = ops[p.op];
        const int NT = (o.N + 15) / 16, KC = o.K >> 6, CPS = KC / o.S;
        const int group = p.j / o.S, split = p.j % o.S, tile = group * GC_WARPS + warp;
        if (threadIdx.x == 0 && o.wait >= 0) {           // x_i comes from op `wait`: all its tiles out
            const u32 need = (u32)((ops[o.wait].N + 15) / 16);
            u32 v;
            int spins = 0;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(done + o.wait) : "memory");
            } while (v < need && ++spins < max_spins);
            if (v < need) atomicCAS(err, 0u, (u32)(1 + o.wait));
        }
        __syncthreads();                                 // x visible; every warp done with the previous xs
        const int k0 = split * CPS * 64, vec_per_row = CPS * 8;
        for (int i = threadIdx.x; i < 8 * MT * vec_per_row; i += blockDim.x) {
            const int row = i / vec_per_row, v = i - row * vec_per_row;
            *(uint4*)(xs + row * xstride + v * 8) =
                row < M ? ld_cg_u4((const uint4*)(o.x + (size_t)row * o.ldx + k0 + v * 8)) : make_uint4(0, 0, 0, 0);
        }
        __syncthreads();

        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
        for (int c = 0; c < CPS; ++c) {
            cp_async_wait<GC_STAGES - 2>();              // this chunk's stage landed
            issue();
            if (tile < NT) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const uint4 rg = ring[st][2 * h][lane], rg8 = ring[st][2 * h + 1][lane];
                    const u32 a0[4] = {rg.x, rg8.x, rg.y, rg8.y}, a1[4] = {rg.z, rg8.z, rg.w, rg8.w};
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const uint4 xb = *(const uint4*)(xs + (mt * 8 + g) * xstride + c * 64 + 32 * h + 8 * t);
                        mma_bf16_16816(acc[mt], a0, xb.x, xb.y);
                        mma_bf16_16816(acc[mt], a1, xb.z, xb.w);
                    }
                }
            }
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
            if (tile < NT) finish(acc);
        } else {
            if (tile < NT)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    o.partial[(((size_t)tile * o.S + split) * MT + mt) * 32 + lane] =
                        make_float4(acc[mt][0], acc[mt][1], acc[mt][2], acc[mt][3]);
            publish = arrive_last(groups + o.group_off + group, (u32)o.S);
            if (publish && tile < NT) {
                float sum[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    sum[mt][0] = sum[mt][1] = sum[mt][2] = sum[mt][3] = 0.f;
                    for (int s = 0; s < o.S; ++s) {      // split order: deterministic
                        const float4 v = ld_cg_f4(&o.partial[(((size_t)tile * o.S + s) * MT + mt) * 32 + lane]);
                        sum[mt][0] += v.x; sum[mt][1] += v.y; sum[mt][2] += v.z; sum[mt][3] += v.w;
                    }
                }
                finish(sum);
            }
        }
        if (publish) {                                   // this group's tiles are out: count them on done[op]
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                const u32 tiles = (u32)min(GC_WARPS, NT - group * GC_WARPS);
                asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(done + p.op), "r"(tiles) : "memory");
            }
        }
    }
    cp_async_wait<0>();
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
    NAME(const ChainOp* ops, int n_ops, int M, u32* done, u32* groups, u32* exits, u32* err, int max_spins) { \
        gemm_chain<MT>(ops, n_ops, M, done, groups, exits, err, max_spins);                                \
    }
DD_DEFINE_CHAIN(gemm_chain_mt1, 1)
DD_DEFINE_CHAIN(gemm_chain_mt2, 2)
DD_DEFINE_CHAIN(gemm_chain_mt3, 3)
