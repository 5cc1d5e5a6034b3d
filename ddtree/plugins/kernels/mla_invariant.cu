// Batch-invariant tree-masked MLA attention: the kernel of the batch-invariant plan (docs/interfaces.md
// section 6), under which a tree node's output is bitwise the one-token decode's at the same position.
// Launcher: ddtree/plugins/mla_invariant.py. Numpy twin (the contract, not the order): reference.py
// mla_tree_attention.
//
// Why another kernel: the fast forms (mla_attention.cu, mla_decode.cu) group keys by cache row and by a
// split plan that depends on q, so a node's ancestors (tree rows T + index) and the same tokens in the
// decode (rows T + depth) meet the softmax in different groupings. Here every (query row, head) walks its
// visible keys in *position* order -- the prefix rows 0 .. T-1, then its visible tree rows by increasing
// index, which is the ancestor chain by depth (a parent's index is below its child's), at positions
// T, T + 1, .. -- in chunks of 32 positions aligned to position 0 and splits of INV_SPLIT positions, and
// nothing in the arithmetic depends on q, H, T or the other rows:
//   score   lane i of a chunk owns position 32 c + i: q . k over the MLA_DK dims in 8 interleaved fp32 chains
//           (dim d in chain d % 8), summed in a fixed tree
//   chunk   m = max(m, chunk max); alpha = 2^(m_old - m); l = l alpha + (butterfly sum of the chunk's p);
//           o = o alpha, then o += p_i v_i key by key in position order (lane owns MLA_DL / 32 dims)
//   combine the splits of a row in order: M = max m_s, L = sum l_s 2^(m_s - M), out = sum o_s 2^(m_s - M) / L
// so the decode of position p and a tree node at position p run the same operations on the same values.
// One warp per (split, head, row): slow by design (a validation plan; ddtree bench e2e --kernel-plan
// batch-invariant measures the plan), not a fast path.
#include "mla_common.cuh"

#define INV_SPLIT 256                 // positions per split (a multiple of 32)
#define INV_MAX_Q 256                 // tree rows per call (plugins/mla_attention.py MAX_Q)
static_assert(MLA_DK % 8 == 0, "invariant attention: keys are read 8 dims (16 bytes) at a time");
#define INV_DIMS (MLA_DL / 32)

// The visible tree rows of query row r, in index order (= depth order), into list; returns their count.
__device__ __forceinline__ int inv_visible_rows(const u32* __restrict__ vis, int r, int q, int* list) {
    const int lane = threadIdx.x & 31, words = (q + 31) >> 5;
    const u32 w = lane < words ? vis[(size_t)r * words + lane] : 0u;
    int incl = __popc(w);
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
    }
    int at = incl - __popc(w);
    for (u32 bits = w; bits; bits &= bits - 1) list[at++] = lane * 32 + __ffs(bits) - 1;
    const int total = __shfl_sync(0xffffffffu, incl, 31);
    __syncwarp();
    return total;
}

// Grid (splits, H, q), block 32. q_lat [q, H, DL], q_rope [q, H, DR], cache [>= T + q, DK] bf16, vis
// [q, ceil(q / 32)] u32, lengths [1] = T. part_o [q, H, splits, DL] fp32 (unnormalised), part_ml [q, H, splits, 2]
// (running max in log2 units, sum). A split past the row's keys writes nothing (the combine stops before it).
extern "C" __global__ void __launch_bounds__(32)
mla_invariant_split(const bf16_t* __restrict__ q_lat, const bf16_t* __restrict__ q_rope,
                    const bf16_t* __restrict__ cache, const u32* __restrict__ vis, const int* __restrict__ lengths,
                    float* __restrict__ part_o, float* __restrict__ part_ml, int q, float scale_log2) {
    __shared__ __align__(16) float qs[MLA_DK];
    __shared__ int list[INV_MAX_Q];
    const int s = blockIdx.x, h = blockIdx.y, r = blockIdx.z, H = gridDim.y, S = gridDim.x;
    const int lane = threadIdx.x;
    pdl_wait();                                       // q and the tree's cache rows come from earlier kernels
    pdl_trigger();
    const int T = lengths[0];
    const int L = T + inv_visible_rows(vis, r, q, list);
    const int begin = s * INV_SPLIT, end = min(L, begin + INV_SPLIT);
    if (begin >= end) return;
    for (int d = lane; d < MLA_DK; d += 32)
        qs[d] = bf16_to_f32(d < MLA_DL ? q_lat[((size_t)r * H + h) * MLA_DL + d]
                                       : q_rope[((size_t)r * H + h) * MLA_DR + d - MLA_DL]);
    __syncwarp();

    float m = DD_NEG_INF, l = 0.f, o[INV_DIMS];
#pragma unroll
    for (int j = 0; j < INV_DIMS; ++j) o[j] = 0.f;
    for (int c0 = begin; c0 < end; c0 += 32) {
        const int pos = c0 + lane;
        const bool live = pos < end;
        const int row = !live ? 0 : pos < T ? pos : T + list[pos - T];
        const uint4* key = (const uint4*)(cache + (size_t)row * MLA_DK);
        float chain[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (live) {
#pragma unroll 4
            for (int v = 0; v < MLA_DK / 8; ++v) {
                float k8[8];
                unpack8(key[v], k8);
#pragma unroll
                for (int e = 0; e < 8; ++e) chain[e] = fmaf(qs[8 * v + e], k8[e], chain[e]);
            }
        }
        const float dot = ((chain[0] + chain[1]) + (chain[2] + chain[3])) + ((chain[4] + chain[5]) + (chain[6] + chain[7]));
        const float score = live ? dot * scale_log2 : DD_NEG_INF;
        float cmax = score;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, off));
        const float m_new = fmaxf(m, cmax);             // finite: every chunk holds at least one live key
        const float alpha = exp2f(m - m_new);
        const float p = live ? exp2f(score - m_new) : 0.f;
        float psum = p;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
        l = l * alpha + psum;
        m = m_new;
#pragma unroll
        for (int j = 0; j < INV_DIMS; ++j) o[j] *= alpha;
        const int n = min(32, end - c0);
        for (int i = 0; i < n; ++i) {                   // position order, one key at a time
            const float pi = __shfl_sync(0xffffffffu, p, i);
            const int ri = __shfl_sync(0xffffffffu, row, i);
            const bf16_t* v = cache + (size_t)ri * MLA_DK + lane * INV_DIMS;
#pragma unroll
            for (int j = 0; j < INV_DIMS; ++j) o[j] = fmaf(pi, bf16_to_f32(v[j]), o[j]);
        }
    }
    const size_t at = ((size_t)r * H + h) * S + s;
    float* dst = part_o + at * MLA_DL + lane * INV_DIMS;
#pragma unroll
    for (int j = 0; j < INV_DIMS; ++j) dst[j] = o[j];
    if (lane == 0) { part_ml[2 * at] = m; part_ml[2 * at + 1] = l; }
}

// Grid (q, H), block 128: the row's splits merged in split order. out [q, H, DL] bf16; lse [q, H] fp32
// natural log (null: not written).
extern "C" __global__ void __launch_bounds__(128)
mla_invariant_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                      const u32* __restrict__ vis, const int* __restrict__ lengths, bf16_t* __restrict__ out,
                      float* __restrict__ lse, int q, int S) {
    const int r = blockIdx.x, h = blockIdx.y, H = gridDim.y;
    pdl_wait();
    pdl_trigger();
    const int words = (q + 31) >> 5;
    int seen = 0;
    for (int w = 0; w < words; ++w) seen += __popc(vis[(size_t)r * words + w]);
    const int n = (lengths[0] + seen + INV_SPLIT - 1) / INV_SPLIT;
    const size_t base = ((size_t)r * H + h) * S;
    float M = DD_NEG_INF;
    for (int s = 0; s < n; ++s) M = fmaxf(M, part_ml[2 * (base + s)]);
    float L = 0.f;
    for (int s = 0; s < n; ++s) L += part_ml[2 * (base + s) + 1] * exp2f(part_ml[2 * (base + s)] - M);
    for (int d = threadIdx.x; d < MLA_DL; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < n; ++s) acc += part_o[(base + s) * MLA_DL + d] * exp2f(part_ml[2 * (base + s)] - M);
        out[((size_t)r * H + h) * MLA_DL + d] = f32_to_bf16(acc / L);
    }
    if (lse && threadIdx.x == 0) lse[(size_t)r * H + h] = (M + log2f(L)) * 0.69314718055994530942f;
}
