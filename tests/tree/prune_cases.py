"""Random and edge-case inputs of the tree pruning rule (tree/prune.py prune_nodes), shared by the CPU test of the
rule and the GPU test of its kernel (tests/plugins/test_tree_prune_gpu.py). Routed ids are distinct per row, as
noaux_tc routing gives them."""
import numpy as np


def random_case(rng, q: int, top_k: int, n_experts: int, chain: bool = False, dead: float = 0.2) -> dict:
    parents = np.array([-1] + [i - 1 if chain else int(rng.integers(0, i)) for i in range(1, q)], np.int32)
    live = (rng.random(q) >= dead).astype(np.int32)
    live[0] = 1
    for i in range(1, q):                                   # a pruned verify's mask: dead nodes' subtrees dead
        live[i] &= live[parents[i]]
    edge = rng.random(q).astype(np.float64)
    prob = np.ones(q)
    for i in range(1, q):
        prob[i] = prob[parents[i]] * edge[i]
    ids = np.stack([rng.choice(n_experts, top_k, replace=False) for _ in range(q)]).astype(np.int32)
    return {"live": live, "parents": parents, "path_prob": prob.astype(np.float32), "routed_ids": ids}


HORIZONS = (1, 3, 60, 1024)      # MoE layers left: the last layer, the tiny model's first, Kimi's first, the limit


def cases(seed: int = 0, n: int = 40, max_q: int = 40, max_experts: int = 24) -> list[tuple[dict, int, float, int]]:
    """(inputs, expert_bytes, rate, horizon): random trees and routings over rates and horizons that prune nothing,
    some, or most."""
    rng = np.random.default_rng(seed)
    out = []
    for c in range(n):
        q, top_k = int(rng.integers(1, max_q + 1)), int(rng.integers(1, 5))
        E = int(rng.integers(top_k, max_experts + 1))
        case = random_case(rng, q, top_k, E, chain=c % 5 == 0)
        bytes_ = int(rng.integers(1, 1 << 31))
        for rate in (0.0, 1e-12, 1e-10, 1e-9, 1e-7, 1e-3):
            out.append((case, bytes_, float(np.float32(rate)), HORIZONS[c % len(HORIZONS)]))
    return out
