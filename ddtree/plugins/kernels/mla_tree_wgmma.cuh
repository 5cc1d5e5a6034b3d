// Tree form on sm_90a's warpgroup MMA (form "tree_wgmma", issue 23; mla_attention.cu compiles it only with
// -D MLA_TREE_WGMMA for sm_90a, into a cubin of its own, so the measured tree / combine cubins stay byte-identical).
// Launcher: ddtree/plugins/mla_attention.py (the default where wgmma_default says). The contract, key ranges,
// partials and combine are mla_attention_split's; the math is the same online softmax in log2 units.
//
// What differs is who multiplies. A block holds 64 query rows (the wgmma M) and two warpgroups. Per block of NK
// keys: warpgroup w scores the 64 rows against keys [w NK / 2, (w + 1) NK / 2) of the block with wgmma
// m64n(NK/2)k16 over the 576 key dims, both operands read from shared memory by descriptor (no ldmatrix, no
// register fragments of Q or K); the two warpgroups swap their row maxima through shared memory, write their bf16
// probabilities into one [64 x NK] tile, and each then runs P.V for its half of the latent (m64n256k16, P and V by
// descriptor; V is the key tile itself, read MN-major). The mma.sync forms re-read Q's fragments from shared
// memory for every 32-key step per warp and top out near 170-200 TFLOP/s on the H200 (NOTES.md "Tree attention at
// short context").
//
// Shared-memory tiles use the 128-byte swizzle of the descriptors: a [ROWS][MLA_DK] bf16 tile is stored as
// atom columns of 64 dims (128 B a row, ROWS x 128 B a column, 1024-byte aligned), 16-byte chunk j of row r at
// chunk j ^ (r % 8) of its 128 B. The same bytes serve Q.K^T (K-major: N = keys, K = dims) and P.V (V
// MN-major: N = dims, K = keys). The first version used the no-swizzle core-matrix layout: correct, but each
// wgmma read its 8 row groups from the same banks (H200: ~70 cycles a m64n32k16, ~128 a m64n16k16).
#define WG_ROWS 64                           // query rows a block: the wgmma M
#define WG_CHUNKS (MLA_DK / 8)               // 16-byte chunks of a key or query row (Kimi: 72)
#define WG_DW (MLA_DL / 2)                   // latent dims a warpgroup owns in P.V (Kimi: 256)
static_assert(WG_CHUNKS % 4 == 0, "a warp copies 8 rows x 4 chunks a step");
static_assert(WG_DW == 256, "P.V is one m64n256k16 wgmma per 16-key step: latent 512 only");
#ifndef WG_V_SWAP
#define WG_V_SWAP 0                          // 1: V's descriptor offsets swapped (a layout probe, never the default)
#endif
#define WG_ALIGN 1024                        // swizzle atoms start on 1024-byte boundaries (the block adds the slack)

template <int NK, int STAGES>
struct WgSmem {
    bf16_t q[WG_ROWS * MLA_DK];              // the block's query rows [q_lat | q_rope], core layout
    bf16_t kv[STAGES][NK * MLA_DK];          // key blocks [c_kv | k_pe], core layout
    bf16_t p[WG_ROWS * NK];                  // the block's probabilities of the current key block, core layout
    float swap[2][WG_ROWS];                  // a warpgroup's row maxima, then its row sums
};

// Byte offset of 16-byte chunk c of row r in a swizzled [ROWS][..] tile.
template <int ROWS>
__device__ __forceinline__ u32 wg_core(int r, int c) {
    return (u32)((c >> 3) * (ROWS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Matrix descriptor, 128-byte swizzle: start address, leading and stride byte offsets (K-major: the 8-row
// group stride in sbo, lbo unused; MN-major: the 64-element atom stride along N in lbo, 8-row groups in sbo).
__device__ __forceinline__ u64 wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// After the wait: the accumulators' reads may not move above it (the asm outputs look ready at issue).
template <int N>
__device__ __forceinline__ void wg_fence_regs(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// D[64 x 32] (+)= A[64 x 16] . B[16 x 32], A and B in shared memory by descriptor (tnsp_b: B is MN-major)
template <int TNSP_B>
__device__ __forceinline__ void wgmma_m64n32k16_ss(float (&d)[16], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, %19;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TNSP_B));
}
// D[64 x 256] (+)= A[64 x 16] . B[16 x 256], A and B in shared memory by descriptor (tnsp_b: B is MN-major)
template <int TNSP_B>
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, %131;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TNSP_B));
}

// Issue (no commit) cp.async copies of ROWS rows into a core-layout tile: a warp copies WG_LOAD_ROWS rows x
// 32 / WG_LOAD_ROWS chunks a step (8 x 4: 64 contiguous bytes of each global row, 4 whole core matrices, the fewest
// shared-memory wavefronts; 4 x 8: whole 128-byte lines, twice the wavefronts). src(r, c, ok) is row r's chunk c
// in global memory and whether it exists (else zero-filled).
#ifndef WG_LOAD_ROWS
#define WG_LOAD_ROWS 8
#endif
static_assert(WG_LOAD_ROWS == 8 || WG_LOAD_ROWS == 4, "a warp's copy step: 8 x 4 or 4 x 8 chunks");
template <int ROWS, class Src>
__device__ __forceinline__ void wg_load_tile(bf16_t* dst, Src src) {
    constexpr int RW = WG_LOAD_ROWS, CW = 32 / RW;
    static_assert(WG_CHUNKS % CW == 0 && ROWS % RW == 0, "whole copy steps");
    constexpr int UNITS = (ROWS / RW) * (WG_CHUNKS / CW);
    const int lane = threadIdx.x & 31;
    for (int u = threadIdx.x >> 5; u < UNITS; u += blockDim.x >> 5) {
        const int rb = u % (ROWS / RW), cq = u / (ROWS / RW);
        const int r = rb * RW + lane % RW, c = cq * CW + lane / RW;
        bool ok;
        const bf16_t* s = src(r, c, ok);
        cp_async16_zfill((unsigned char*)dst + wg_core<ROWS>(r, c), s, ok ? 16 : 0);
    }
}

template <int NK, int STAGES>
__device__ __forceinline__ void mla_attention_split_wgmma(
        const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_rope, const bf16_t* __restrict__ cache,
        const u32* __restrict__ vis, const int* __restrict__ lengths, bf16_t* __restrict__ out,
        float* __restrict__ lse_out, float* __restrict__ part_o, float* __restrict__ part_lse,
        int R, int H, int q, int P, int tree_own, float scale_log2) {
    constexpr int KW = NK / 2, NS = KW / 8;      // keys a warpgroup scores, their 8-key n-tiles
    constexpr int NO = WG_DW / 8;                // 8-dim n-tiles of a warpgroup's output (32: 128 fp32 a thread)
    static_assert(STAGES >= 2, "one key block in use, one in flight");
    static_assert(NK == 64, "the probability tile is one 128-byte swizzle atom column: 64 keys");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 pad = (WG_ALIGN - (smem_addr(smem_raw) & (WG_ALIGN - 1))) & (WG_ALIGN - 1);
    WgSmem<NK, STAGES>& sm = *reinterpret_cast<WgSmem<NK, STAGES>*>(smem_raw + pad);
    const int wg = threadIdx.x >> 7, wi = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * WG_ROWS, split = blockIdx.y, n_splits = P + tree_own;

    PROF_NS
    PROF_T(0)
    pdl_wait();                                      // queries, lengths and new cache entries come from earlier kernels
    pdl_trigger();
    PROF_T(1)
    wg_load_tile<WG_ROWS>(sm.q, [&](int r, int c, bool& ok) {
        const int rr = min(row0 + r, R - 1);
        ok = row0 + r < R;
        return c < MLA_DL / 8 ? q_lat + (size_t)rr * MLA_DL + c * 8 : q_rope + (size_t)rr * MLA_DR + (c * 8 - MLA_DL);
    });
    cp_async_commit();
    const int T = ld_cg_s32(lengths);
    const MlaKeyRange range = mla_split_range(split, T, P, tree_own, q, H, R, row0, WG_ROWS, NK);
    const int begin = range.begin, end = range.end;
    const int nblk = end > begin ? (end - begin + NK - 1) / NK : 0;
    auto load_block = [&](int b) {                   // always a commit group: the waits count uniformly
        if (b < nblk)
            wg_load_tile<NK>(sm.kv[b % STAGES], [&](int r, int c, bool& ok) {
                const int key = begin + b * NK + r;
                ok = key < end;
                return cache + (size_t)min(key, end - 1) * MLA_DK + c * 8;
            });
        cp_async_commit();
    };
#pragma unroll 1
    for (int b = 0; b < STAGES - 1; ++b) load_block(b);

    // ---- running state: rows 16 wi + g and + 8 of the block, this warpgroup's latent half ----------------
    float o[4 * NO];                                 // o[4 n + e]: row (e >> 1 ? hi : lo), dim WG_DW wg + 8 n + 2t + (e & 1)
#pragma unroll
    for (int i = 0; i < 4 * NO; ++i) o[i] = 0.f;
    float m_run[2] = {DD_NEG_INF, DD_NEG_INF}, l_run[2] = {0.f, 0.f};
    const int rl_lo = 16 * wi + g, rl_hi = rl_lo + 8;
    const int r_lo = row0 + rl_lo, r_hi = row0 + rl_hi;
    const int W = (q + 31) >> 5;
    const u32* vis_lo = vis + (size_t)min(r_lo / H, q - 1) * W;
    const u32* vis_hi = vis + (size_t)min(r_hi / H, q - 1) * W;
    const bool rows_valid[2] = {r_lo < R, r_hi < R};
    const u32 q_addr = smem_addr(sm.q), p_addr = smem_addr(sm.p);
    constexpr u32 Q_COL = WG_ROWS * 128, KV_COL = NK * 128;       // bytes of an atom column (64 dims)
    constexpr u32 V_LBO = WG_V_SWAP ? 1024 : KV_COL, V_SBO = WG_V_SWAP ? KV_COL : 1024;

    PROF_INIT
    PROF_T(2)
#pragma unroll 1
    for (int b = 0; b < nblk; ++b) {
        cp_async_wait<STAGES - 2>();                 // the query rows and key block b (this thread's copies)
        fence_proxy_async();                         // ... visible to the wgmma (async proxy)
        __syncthreads();                             // every thread's copies landed; block b - 1's slot is free
        PROF_MARK(0)
        const u32 kv_addr = smem_addr(sm.kv[b % STAGES]);
        const int tile0 = begin + b * NK, key0 = tile0 + wg * KW;

        // scores S[64 rows, KW keys] over MLA_DK dims, 16 dims a wgmma
        float s[4 * NS];
#pragma unroll
        for (int i = 0; i < 4 * NS; ++i) s[i] = 0.f;
        wg_fence();
#pragma unroll
        for (int j = 0; j < MLA_DK / 16; ++j) {
            const u32 k_off = (j & 3) * 32;          // 16 dims = 32 B into the atom's rows
            const u64 da = wg_desc(q_addr + (j >> 2) * Q_COL + k_off, 16, 1024);
            const u64 db = wg_desc(kv_addr + (j >> 2) * KV_COL + wg * KW * 128 + k_off, 16, 1024);
            wgmma_m64n32k16_ss<0>(s, da, db, j > 0);
        }
        wg_commit();
        PROF_MARK(1)
        // the next key block's copies while the tensor cores score this one (the slot of block b - 1 is free:
        // the barrier above; issued before the scores they stalled the scores ~2500 cycles a 64-key block)
        load_block(b + STAGES - 1);
        wg_wait0();
        wg_fence_regs(s);
        PROF_MARK(2)

        // scale to log2 units, mask keys past the split and tree keys off the ancestor chain
        const bool masked = tile0 + NK > T;
        float mx[2] = {DD_NEG_INF, DD_NEG_INF};
#pragma unroll
        for (int n = 0; n < NS; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = key0 + 8 * n + 2 * t + (e & 1), hi = e >> 1;
                float v = s[4 * n + e] * scale_log2;
                if (masked) {
                    bool ok = key < end;
                    if (ok && key >= T && rows_valid[hi]) {
                        const int j = key - T;
                        ok = ((hi ? vis_hi : vis_lo)[j >> 5] >> (j & 31)) & 1u;
                    }
                    if (!ok) v = DD_NEG_INF;
                }
                s[4 * n + e] = v;
                mx[hi] = fmaxf(mx[hi], v);
            }
        }
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 1));
            mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 2));
        }
        if (t == 0) { sm.swap[wg][rl_lo] = mx[0]; sm.swap[wg][rl_hi] = mx[1]; }
        __syncthreads();
        float alpha[2], m_use[2];
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {             // both warpgroups: the same max of the same three values
            const float m_new = fmaxf(m_run[hi], fmaxf(mx[hi], sm.swap[wg ^ 1][hi ? rl_hi : rl_lo]));
            m_use[hi] = m_new == DD_NEG_INF ? 0.f : m_new;       // a row with nothing visible yet stays at 0
            alpha[hi] = exp2f(m_run[hi] - m_use[hi]);
            m_run[hi] = m_new;
        }
        // probabilities (bf16) into the block's [64 x NK] tile; this warpgroup's share of the row sums
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            const float p0 = exp2f(s[4 * n] - m_use[0]), p1 = exp2f(s[4 * n + 1] - m_use[0]);
            const float p2 = exp2f(s[4 * n + 2] - m_use[1]), p3 = exp2f(s[4 * n + 3] - m_use[1]);
            sum[0] += p0 + p1;
            sum[1] += p2 + p3;
            const int k = wg * KW + 8 * n + 2 * t;
            *(u32*)((unsigned char*)sm.p + wg_core<WG_ROWS>(rl_lo, k >> 3) + (k & 7) * 2) = pack_bf16x2(p0, p1);
            *(u32*)((unsigned char*)sm.p + wg_core<WG_ROWS>(rl_hi, k >> 3) + (k & 7) * 2) = pack_bf16x2(p2, p3);
        }
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) l_run[hi] = l_run[hi] * alpha[hi] + sum[hi];
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            o[4 * n] *= alpha[0]; o[4 * n + 1] *= alpha[0];
            o[4 * n + 2] *= alpha[1]; o[4 * n + 3] *= alpha[1];
        }
        PROF_MARK(3)
        fence_proxy_async();                         // the probabilities (generic stores) before the wgmma reads
        __syncthreads();                             // both halves of P written, both maxima read
        PROF_MARK(4)

        // o[64 rows, this warpgroup's WG_DW dims] += P[64, NK keys] . c_kv[NK keys, dims], 16 keys a wgmma
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < NK / 16; ++kk) {
            const u64 da = wg_desc(p_addr + kk * 32, 16, 1024);                   // P: one atom column
            const u64 db = wg_desc(kv_addr + wg * (WG_DW / 64) * KV_COL + kk * 16 * 128, V_LBO, V_SBO);
            wgmma_m64n256k16_ss<1>(o, da, db, 1);
        }
        wg_commit();
        wg_wait0();
        wg_fence_regs(o);
        PROF_MARK(5)
    }
    cp_async_wait<0>();
    PROF_T(3)
    PROF_PRINT("wgmma", nblk)

    // ---- finish: row sums of both warpgroups, normalise, write --------------------------------------
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], 1);
        l_run[hi] += __shfl_xor_sync(0xffffffffu, l_run[hi], 2);
    }
    __syncthreads();                                 // the maxima of the last block are read
    if (t == 0) { sm.swap[wg][rl_lo] = l_run[0]; sm.swap[wg][rl_hi] = l_run[1]; }
    __syncthreads();
    float inv[2], lse2[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        const float l = l_run[hi] + sm.swap[wg ^ 1][hi ? rl_hi : rl_lo];
        inv[hi] = l > 0.f ? 1.f / l : 0.f;
        lse2[hi] = l > 0.f ? m_run[hi] + log2f(l) : DD_NEG_INF;
    }
    const int rr[2] = {r_lo, r_hi};
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
        if (!rows_valid[hi]) continue;
        if (n_splits == 1) {
            u32* dst = (u32*)(out + (size_t)rr[hi] * MLA_DL + wg * WG_DW + 2 * t);
#pragma unroll
            for (int n = 0; n < NO; ++n)
                dst[n * 4] = pack_bf16x2(o[4 * n + 2 * hi] * inv[hi], o[4 * n + 2 * hi + 1] * inv[hi]);
            if (lse_out && wg == 0 && t == 0) lse_out[rr[hi]] = lse2[hi] * 0.69314718055994531f;
        } else {
            float2* dst = (float2*)(part_o + ((size_t)split * R + rr[hi]) * MLA_DL + wg * WG_DW + 2 * t);
#pragma unroll
            for (int n = 0; n < NO; ++n)
                dst[n * 4] = make_float2(o[4 * n + 2 * hi] * inv[hi], o[4 * n + 2 * hi + 1] * inv[hi]);
            if (wg == 0 && t == 0) part_lse[(size_t)split * R + rr[hi]] = lse2[hi];
        }
    }
    PROF_TIMELINE("wgmma")
}

#define DD_DEFINE_MLA_WGMMA(NK, STAGES)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                 \
    mla_attention_wgmma_k##NK##_s##STAGES(const bf16_t* q_lat, const bf16_t* q_rope, const bf16_t* cache, \
                                          const u32* vis, const int* lengths, bf16_t* out, float* lse_out, \
                                          float* part_o, float* part_lse, int R, int H, int q, int P,      \
                                          int tree_own, float scale_log2) {                                \
        mla_attention_split_wgmma<NK, STAGES>(q_lat, q_rope, cache, vis, lengths, out, lse_out, part_o,   \
                                              part_lse, R, H, q, P, tree_own, scale_log2);                \
    }
// (keys a block, stages) compiled; ddtree/plugins/mla_attention.py WGMMA_VARIANTS lists the same set
DD_DEFINE_MLA_WGMMA(64, 2)

// sizeof(WgSmem) + the alignment slack of each variant above, in that order (the launcher's smem_bytes must
// agree: GPU test).
extern "C" __global__ void mla_attention_wgmma_smem_sizes(int* out) {
    out[0] = sizeof(WgSmem<64, 2>) + WG_ALIGN;
}
