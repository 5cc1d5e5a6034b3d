// What both forms of the tree-masked MLA attention share (mla_attention.cu: tree form, mla_decode.cu:
// decode form): the cache geometry, one split's key range, the query-row load, and the DD_PROFILE
// diagnosis macros. One definition each, so the two forms cannot drift apart on the contract.
#pragma once
#include "common.cuh"

// The model's latent geometry comes from the launcher as NVRTC defines (ddtree/plugins/compile.py
// latent_defines: one cubin set per model, Kimi K2.6: 512 / 64). The Python side refuses other dims by
// name before compiling; the static_asserts restate why each constraint exists.
#if !defined(MLA_DL) || !defined(MLA_DR)
#error "compile with -D MLA_DL=<kv_lora_rank> -D MLA_DR=<qk_rope_head_dim> (ddtree/plugins/compile.py latent_defines)"
#endif
static_assert(MLA_DL % 32 == 0 && MLA_DL >= 32 && MLA_DL <= 512,
              "latent: the tree form's two warps of a pair own MLA_DL / 2 output dims in 16-dim ldmatrix steps; "
              "MLA_DL / 4 fp32 accumulators per thread (128 at 512)");
static_assert(MLA_DR % 16 == 0 && MLA_DR >= 16, "rope: the key dims MLA_DL + MLA_DR step through the mma's k = 16");
#define MLA_DK (MLA_DL + MLA_DR)   // key dims = latent + rope (Kimi: 576)
#define MLA_ROW (MLA_DK + 8)       // smem row stride in bf16: MLA_DK / 8 + 1 (odd) x 16 B, conflict-free ldmatrix
                                   // (Kimi: 584 = 1168 B = 73 x 16 B)

// Keys [begin, end) of split `split` for the block whose query rows start at row0 (rows_per_block rows of R).
// Splits 0 .. P-1 cover the prefix [0, T) in chunks of ceil(T / P) rounded up to `align` keys (empty when T
// is small for the planned P); the tree keys [T, tree_end) get split P (tree_own) or end the last prefix
// split. tree_end stops at the last tree node any row of this block may see (row r is node r / H).
struct MlaKeyRange { int begin, end; };
__device__ __forceinline__ MlaKeyRange mla_split_range(int split, int T, int P, int tree_own, int q, int H, int R,
                                                       int row0, int rows_per_block, int align) {
    const int last_row = min(row0 + rows_per_block, R) - 1;
    const int tree_end = T + min(q, last_row / H + 1);
    const int chunk = ((((T + P - 1) / max(P, 1)) + align - 1) / align) * align;
    if (split >= P) return {T, tree_end};
    const int begin = split * chunk;
    if (split == P - 1 && !tree_own) return {min(begin, T), tree_end};
    return {begin, max(begin, min(T, begin + chunk))};
}

// Issue (no commit) cp.async copies of query rows row0 .. row0 + ROWS - 1 as [q_lat | q_rope] into
// dst[ROWS][MLA_ROW]; rows >= R are zero-filled. All threads of the block take part.
template <int ROWS>
__device__ __forceinline__ void mla_load_queries(bf16_t (*dst)[MLA_ROW], const bf16_t* __restrict__ q_lat,
                                                 const bf16_t* __restrict__ q_rope, int row0, int R) {
    for (int i = threadIdx.x; i < ROWS * (MLA_DK / 8); i += blockDim.x) {
        const int row = i / (MLA_DK / 8), c = (i - row * (MLA_DK / 8)) * 8, r = row0 + row;
        const bf16_t* src = c < MLA_DL ? q_lat + (size_t)min(r, R - 1) * MLA_DL + c
                                       : q_rope + (size_t)min(r, R - 1) * MLA_DR + (c - MLA_DL);
        cp_async16_zfill(&dst[row][c], src, r < R ? 16 : 0);
    }
}

// Diagnosis (compile with DD_PROFILE=1, see tests/plugins/profile_attention.py): PROF_T / PROF_TIMELINE print
// per-block timelines (block x 0, some splits); with DD_PROFILE=2 thread 0 of block (0, 0) also adds the
// cycles of each phase of the main loop (PROF_MARK) and prints the sums.
#ifdef DD_PROFILE
#define PROF_INIT long long prof_t = clock64(), prof[6] = {0, 0, 0, 0, 0, 0}; \
                  const bool prof_on = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
#define PROF_MARK(i) { long long prof_now = clock64(); prof[i] += prof_now - prof_t; prof_t = prof_now; }
#define PROF_PRINT(name, n) if (prof_on && DD_PROFILE > 1) printf("%s iters %d: wait %lld issue %lld qk %lld softmax %lld rescale %lld pv %lld\n", \
                  name, n, prof[0], prof[1], prof[2], prof[3], prof[4], prof[5]);
#define PROF_NS u64 prof_ns[4];
#define PROF_T(i) if (threadIdx.x == 0 && blockIdx.x == 0) prof_ns[i] = global_ns();
#define PROF_TIMELINE(name) if (threadIdx.x == 0 && blockIdx.x == 0 && (blockIdx.y % 33 == 0 || blockIdx.y == gridDim.y - 1)) \
    printf("%s block y %d: entry %llu pdl %llu loop %llu end-loop %llu exit %llu\n", name, blockIdx.y, prof_ns[0], \
           prof_ns[1], prof_ns[2], prof_ns[3], global_ns());
#else
#define PROF_INIT
#define PROF_MARK(i)
#define PROF_PRINT(name, n)
#define PROF_NS
#define PROF_T(i)
#define PROF_TIMELINE(name)
#endif
