// The decode step's own state on the device: what a captured step graph reads and advances between replays,
// so that no per-step value is ever a captured kernel argument (docs/interfaces.md section 8).
//
//   state [STATE_WORDS] int32: start (the bonus token's position = the committed length = the target cache's
//   length), bonus (the token at `start`, not yet in the target cache), steps (replays so far).
//
//   step_prologue   state -> the drafter block's ids [bonus, MASK...] and positions start + i, the drafter
//                   cache length start - window (the window of context rows re-appended, see below) and the
//                   target cache length start (the verify appends the tree after it)
//   ctx_window      the drafter's context window: the taps of the last b committed positions. After a step
//                   that committed c tokens, row i is the old row i + c (i < b - c) or the tap of accepted node
//                   i - (b - c). Re-appending rows the drafter cache already holds writes the same keys at the
//                   same positions, so the window needs no device-side row count in the drafter's attention.
//   step_force_accept  benchmarks only (ddtree bench step --accept): the walk's accepted path replaced by the
//                   tree's first-child chain from the root, `a` nodes long (fewer when the tree is shallower),
//                   so compaction, the window and the record cost what a step committing `a` tokens costs
//   step_commit     the step's committed tokens (accepted drafts in depth order, then the new bonus; or one
//                   token in the autoregressive step) into a host-mapped record ring, then the state advanced
//
// Record (RECORD_WORDS int32 per slot, slot = steps % slots): [0] steps after this one (written last, after a
// system fence: the host trusts a slot only once it reads the step number it expects), [1] count, [2] status
// flags (the sampler's and tree builder's sticky flags OR-ed), [3] start after the step, [4 ..] the tokens.
// Numpy twins: ddtree/plugins/step_state.py (prologue_ref, ctx_window_ref, commit_ref).
#include "common.cuh"

#define ST_START 0
#define ST_BONUS 1
#define ST_STEPS 2
#define REC_SEQ 0
#define REC_COUNT 1
#define REC_STATUS 2
#define REC_START 3
#define REC_TOKENS 4

extern "C" __global__ void step_prologue(const int* __restrict__ state, int b, int mask_token, int window,
                                         int* __restrict__ block_ids, int* __restrict__ block_pos,
                                         int* __restrict__ draft_len, int* __restrict__ target_len) {
    pdl_wait();
    pdl_trigger();
    const int start = state[ST_START], i = threadIdx.x;
    if (i < b) {
        block_ids[i] = i == 0 ? state[ST_BONUS] : mask_token;
        block_pos[i] = start + i;
    }
    if (i == 0) {
        if (draft_len) draft_len[0] = start - window;
        if (target_len) target_len[0] = start;
    }
}

// Grid b blocks (one per window row), row_vecs 16-byte vectors per row. window_out must not alias window_in.
extern "C" __global__ void ctx_window(const uint4* __restrict__ window_in, const uint4* __restrict__ taps,
                                      const int* __restrict__ accepted, const int* __restrict__ count,
                                      uint4* __restrict__ window_out, int row_vecs) {
    pdl_wait();
    pdl_trigger();
    const int i = blockIdx.x, b = gridDim.x, c = min(count[0], b);
    const uint4* src = i < b - c ? window_in + (size_t)(i + c) * row_vecs
                                 : taps + (size_t)accepted[i - (b - c)] * row_vecs;
    uint4* dst = window_out + (size_t)i * row_vecs;
    for (int v = threadIdx.x; v < row_vecs; v += blockDim.x) dst[v] = src[v];
}

// One block. tree_tokens / accepted / count null: the autoregressive step (one token, `token`[0]).
// token: the sampler's bonus (with a tree) or its target token (without). status_a / status_b: sticky flag
// words (null: none). record: host-mapped ring of `slots` records of RECORD_WORDS words.
extern "C" __global__ void step_commit(int* __restrict__ state, const int* __restrict__ tree_tokens,
                                       const int* __restrict__ accepted, const int* __restrict__ count,
                                       const int* __restrict__ token, const int* __restrict__ status_a,
                                       const int* __restrict__ status_b, volatile int* record, int slots,
                                       int record_words) {
    pdl_wait();
    pdl_trigger();
    const int c = count ? count[0] : 1;
    const int steps = state[ST_STEPS] + 1;
    volatile int* rec = record + (size_t)((steps - 1) % slots) * record_words;
    for (int i = threadIdx.x; i < c; i += blockDim.x)
        rec[REC_TOKENS + i] = i == c - 1 ? token[0] : tree_tokens[accepted[i + 1]];
    __syncthreads();
    if (threadIdx.x == 0) {
        const int start = state[ST_START] + c;
        rec[REC_COUNT] = c;
        rec[REC_STATUS] = (status_a ? status_a[0] : 0) | (status_b ? status_b[0] : 0);
        rec[REC_START] = start;
        __threadfence_system();
        rec[REC_SEQ] = steps;
        state[ST_START] = start;
        state[ST_BONUS] = token[0];
        state[ST_STEPS] = steps;
    }
}

// One thread. parents [n] (node 0 the root, parents[i] < i); accepted [>= a], count [1] overwritten.
extern "C" __global__ void step_force_accept(const int* __restrict__ parents, int n, int a, int* __restrict__ accepted,
                                             int* __restrict__ count) {
    pdl_wait();
    pdl_trigger();
    if (threadIdx.x != 0) return;
    int node = 0, c = 1;
    accepted[0] = 0;
    for (int j = 1; j < n && c < a; ++j)
        if (parents[j] == node) {
            accepted[c++] = j;
            node = j;
        }
    count[0] = c;
}
