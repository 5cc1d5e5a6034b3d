// tree_prune: one block prunes a DDTree inside its verify after an MoE layer's routing (issue 53).
// Its numpy twin, bit for bit, is ddtree/tree/prune.py prune_nodes (the rule is documented there):
//   use[e]      = (live node, top-k slot) pairs routed to expert e        (shared-memory counts, atomics)
//   marginal[i] = slots of node i whose expert has use == 1               (experts no other live node uses)
//   drop i      = i > 0, live, marginal > 0,
//                 (double)path_prob[i] < (double)rate * (double)(marginal * bytes * horizon)   (int64 product)
//   horizon     = the MoE layers after this one (0 at the last: nothing dropped): the bytes a dropped node would
//                 still cost (its marginal experts assumed marginal in every later layer; the rule's rationale)
//   live_out[i] = live[i] && !drop[i] && live_out[parents[i]]             (node order: parents precede children)
// Limits (the launcher checks them): q <= TP_MAX_NODES nodes, top_k <= 16, n_experts <= TP_MAX_EXPERTS; routed
// ids of live rows in 0..n_experts-1 (an id outside is not counted), 0 <= horizon <= 1024. Every value that changes
// from step to step is read on the device (rate, expert_bytes, the tree), so a captured graph serves every step;
// horizon is a scalar launch argument (the layer's, fixed when the description is written: the graph keeps it).
#include "common.cuh"

#define TP_MAX_NODES 1024
#define TP_MAX_EXPERTS 512
#define TP_THREADS 256

extern "C" __global__ void __launch_bounds__(TP_THREADS) tree_prune(
        const int* __restrict__ live, const int* __restrict__ parents, const float* __restrict__ path_prob,
        const int* __restrict__ ids, const float* __restrict__ rate, const int* __restrict__ expert_bytes,
        int* __restrict__ live_out, int q, int top_k, int n_experts, int horizon) {
    __shared__ int use[TP_MAX_EXPERTS];
    __shared__ unsigned char keep[TP_MAX_NODES];
    const int tid = threadIdx.x;
    for (int e = tid; e < n_experts; e += TP_THREADS) use[e] = 0;
    __syncthreads();
    for (int i = tid; i < q; i += TP_THREADS) {
        if (i != 0 && live[i] == 0) continue;                          // the root is always live
        for (int s = 0; s < top_k; ++s) {
            const int e = ids[i * top_k + s];
            if ((unsigned)e < (unsigned)n_experts) atomicAdd(&use[e], 1);
        }
    }
    __syncthreads();
    const double r = (double)rate[0];
    const long long bytes = (long long)expert_bytes[0] * (long long)horizon;     // one expert's, every layer left
    for (int i = tid; i < q; i += TP_THREADS) {
        const bool alive = i == 0 || live[i] != 0;
        int marginal = 0;
        if (alive) {
            for (int s = 0; s < top_k; ++s) {
                const int e = ids[i * top_k + s];
                marginal += (unsigned)e < (unsigned)n_experts && use[e] == 1;
            }
        }
        const double cost = r * (double)((long long)marginal * bytes);   // one rounding, as numpy's
        const bool drop = i > 0 && alive && marginal > 0 && (double)path_prob[i] < cost;
        keep[i] = alive && !drop;
    }
    __syncthreads();
    if (tid == 0) {                                                    // a dropped node's subtree goes with it
        for (int i = 1; i < q; ++i) keep[i] = keep[i] && keep[parents[i]];
    }
    __syncthreads();
    for (int i = tid; i < q; i += TP_THREADS) live_out[i] = keep[i];
}
