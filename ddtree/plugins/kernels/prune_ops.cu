// The pruned verify's small kernels on the GPU (issue 53), beside tree_prune.cu. Numpy twins: plugins/prune_ops.py.
// (A dead row's routing is applied by the routing kernels before their alignment: route_common.cuh live_rows.)
//   mask_dead         tokens_out[i] = tokens[i] where node i is live (or the root), else -1: the tree as the walk of
//                     a pruned verify sees it (tree/prune.py absent_tree: -1 equals no target token)
//   prune_path_probs  path_prob[i] = prod over the path root -> i of calibrate(exp(score[i] - score[parent]), depth)
//                     (tree/prune.py node_path_probs from the tree build's fp32 path log-probabilities), and the
//                     step's rate = base + per_token * sum_i path_prob[i] (runtime/pruning.py Pruner.rate_terms)
// One block each; everything is read on the device, so a captured graph serves every step.
#include "common.cuh"

#define PO_THREADS 256
#define PO_MAX_NODES 1024

extern "C" __global__ void __launch_bounds__(PO_THREADS) mask_dead(
        const int* __restrict__ tokens, const int* __restrict__ live, int* __restrict__ tokens_out, int n) {
    for (int i = threadIdx.x; i < n; i += PO_THREADS) tokens_out[i] = (i == 0 || live[i] != 0) ? tokens[i] : -1;
}

// np.interp(p, x, y) over one map of `points` increasing x (clamped at both ends), in float64 with numpy's formula
// slope (p - x_j) + y_j, rounded as numpy rounds it (no fused multiply-add)
__device__ double interp_map(double p, const float* x, const float* y, int points) {
    if (p <= (double)x[0]) return (double)y[0];
    if (p >= (double)x[points - 1]) return (double)y[points - 1];
    int j = 0;
    while (j + 1 < points - 1 && (double)x[j + 1] <= p) ++j;       // x[j] <= p < x[j + 1]
    const double x0 = x[j], x1 = x[j + 1], y0 = y[j], y1 = y[j + 1];
    const double slope = (y1 - y0) / (x1 - x0);
    return __dadd_rn(__dmul_rn(slope, p - x0), y0);
}

// cal_x / cal_y [depths, points] (depth d's map in row d - 1, padded past cal_n[d - 1] points), rate_terms [2]
// (base, per_token) -> path_prob [n] float32, rate [1] float32
extern "C" __global__ void __launch_bounds__(PO_THREADS) prune_path_probs(
        const float* __restrict__ scores, const int* __restrict__ parents, const int* __restrict__ depth, int n,
        const float* __restrict__ cal_x, const float* __restrict__ cal_y, const int* __restrict__ cal_n, int depths,
        int points, const float* __restrict__ rate_terms, float* __restrict__ path_prob, float* __restrict__ rate) {
    __shared__ double edge[PO_MAX_NODES];
    for (int i = threadIdx.x; i < n; i += PO_THREADS) {
        if (i == 0) { edge[0] = 1.0; continue; }
        const double p = exp((double)scores[i] - (double)scores[parents[i]]);    // the node's drafter probability
        const int d = min(max(depth[i], 1), depths) - 1;
        edge[i] = interp_map(p, cal_x + d * points, cal_y + d * points, cal_n[d]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {                                          // parents precede children: one pass
        double sum = 1.0;
        path_prob[0] = 1.0f;
        for (int i = 1; i < n; ++i) {
            edge[i] *= edge[parents[i]];
            const float f = (float)edge[i];
            path_prob[i] = f;
            sum += (double)f;
        }
        rate[0] = (float)__dadd_rn((double)rate_terms[0], __dmul_rn((double)rate_terms[1], sum));
    }
}
