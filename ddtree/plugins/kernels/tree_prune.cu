// tree_prune: one block prunes a DDTree inside its verify after an MoE layer's routing (issue 53).
// Its numpy twin, bit for bit, is ddtree/tree/prune.py prune_nodes (the rule is documented there). Dropping a node
// drops its subtree, so both sides of the exchange are the subtree's:
//   lca[e]      = the deepest ancestor-or-self of every live node routed to expert e   (one thread an expert;
//                 LCA is order-free, so the result is the twin's whatever the thread order)
//   marginal[i] = the experts whose lca lies in subtree(i) (walks up from each lca, integer atomics)
//   value[i]    = sum of path_prob over subtree(i)'s live nodes (double; one thread, last node down, the twin's order)
//   drop i      = i > 0, live, marginal > 0,
//                 value[i] < (double)rate * (double)(marginal * bytes * horizon)   (int64 product)
//   horizon     = the MoE layers after this one (0 at the last: nothing dropped)
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
    __shared__ int lca[TP_MAX_EXPERTS];
    __shared__ int depth[TP_MAX_NODES], marginal[TP_MAX_NODES];
    __shared__ double value[TP_MAX_NODES];
    __shared__ unsigned char keep[TP_MAX_NODES];
    const int tid = threadIdx.x;
    auto alive = [&](int i) { return i == 0 || live[i] != 0; };          // the root is always live
    for (int i = tid; i < q; i += TP_THREADS) {
        marginal[i] = 0;
        value[i] = alive(i) ? (double)path_prob[i] : 0.0;
    }
    if (tid == 0) {
        depth[0] = 0;
        for (int i = 1; i < q; ++i) depth[i] = depth[parents[i]] + 1;
    }
    __syncthreads();
    for (int e = tid; e < n_experts; e += TP_THREADS) {                // the lowest common ancestor of e's users
        int a = -1;
        for (int i = 0; i < q; ++i) {
            if (!alive(i)) continue;
            bool uses = false;
            for (int s = 0; s < top_k; ++s) uses |= ids[i * top_k + s] == e;
            if (!uses) continue;
            if (a < 0) { a = i; continue; }
            int b = i;
            while (depth[a] > depth[b]) a = parents[a];
            while (depth[b] > depth[a]) b = parents[b];
            while (a != b) { a = parents[a]; b = parents[b]; }
        }
        lca[e] = a;
    }
    __syncthreads();
    for (int e = tid; e < n_experts; e += TP_THREADS)                   // e is marginal to every subtree holding lca
        for (int j = lca[e]; j >= 0; j = parents[j]) atomicAdd(&marginal[j], 1);
    if (tid == 0)                                                      // subtree values, the twin's order
        for (int i = q - 1; i > 0; --i) value[parents[i]] += value[i];
    __syncthreads();
    const double r = (double)rate[0];
    const long long bytes = (long long)expert_bytes[0] * (long long)horizon;     // one expert's, every layer left
    for (int i = tid; i < q; i += TP_THREADS) {
        const bool on = alive(i);
        const int m = on ? marginal[i] : 0;
        const double cost = r * (double)((long long)m * bytes);         // one rounding, as numpy's
        const bool drop = i > 0 && on && m > 0 && value[i] < cost;
        keep[i] = on && !drop;
    }
    __syncthreads();
    if (tid == 0) {                                                    // a dropped node's subtree goes with it
        for (int i = 1; i < q; ++i) keep[i] = keep[i] && keep[parents[i]];
    }
    __syncthreads();
    for (int i = tid; i < q; i += TP_THREADS) live_out[i] = keep[i];
}
