"""Pruning a DDTree inside its verify by expert cost (issue 53): the rule, its inputs and its default rate.

On an MoE target a verify's cost is the experts its rows touch. After the routing of a chosen MoE layer every
node's experts are known; a node whose path is unlikely to be accepted but whose experts no other node shares
is dropped there, with its subtree: dead rows route to no expert in every later layer, and the walk sees them as
absent. The committed tokens stay the target's samples (the walk never accepts a node that is not there), so
pruning is lossless by construction; it only removes candidates.

The rule (prune_nodes; the numpy twin of kernels/tree_prune.cu, bit for bit), at one MoE layer:
    live     [q] the nodes alive when the layer routes (root always live; a dead node's subtree is dead)
    use[e]   = the number of (live node, top-k slot) pairs routed to expert e (the GLOBAL expert ids, identical
               on every rank, so every rank prunes the same nodes)
    marginal[i] = the slots s of node i with use[ids[i, s]] == 1: the experts no other live node uses
    horizon  = the MoE layers after this one (description/layers.py moe_horizon; a python int fixed when the
               layer's description is written: the kernel's scalar argument, not a feed)
    drop i   if i is live, not the root, marginal[i] > 0 and
                 path_prob[i] < rate * (marginal[i] * expert_bytes * horizon)
             (the product exact in int64, then one float64 multiply) i.e. its expected committed tokens per
             expert byte it would still cost fall below the exchange rate
    live_out[i] = live[i] and not drop[i] and live_out[parents[i]]            (index order: parents first)
Why horizon: a node dropped at this layer routes to no expert in every later MoE layer, so dropping it saves its
experts there too, not at one layer. What it would keep costing is estimated by assuming its marginal experts at
this layer stay marginal in every later layer (the routing of later layers is not known yet). Without the factor
the rule undervalued the saving by ~the number of remaining MoE layers (on Kimi the threshold was ~4e-4 x
marginal at the default rate and nothing was ever pruned). This layer is not counted: its experts are already read
when the rule runs (its MoE ran with the input mask), so at the last MoE layer (horizon 0) nothing is dropped:
there is nothing left to save, and a dropped node would only be a candidate less for the walk.
Every node is judged against the same live set (the decisions do not depend on one another), then the subtrees
close in node order, so the result is a function of the inputs only. A node with no marginal expert costs
nothing extra and is never dropped. path_prob is the product of calibrated drafter confidences along the path
(root 1; node_path_probs): the expected tokens the node adds (tree/budget.py, the module docstring).

The rate: expected committed tokens per expert byte the step earns (the bytes of one expert at one layer; the
horizon above multiplies the bytes, not the rate). `--prune auto` takes it from the engine's
tuning file where that measures an expert's cost (exchange_rate), else DEFAULT_RATE_PER_TOKEN below times the
tree's own expected committed tokens (both scale with what this tree is expected to earn).
"""
from __future__ import annotations

import numpy as np

from ddtree.errors import InputError
from ddtree.tree.budget import path_probs
from ddtree.tree.build import Tree

PRUNE_EVERY = 4                 # tree_prune runs at MoE layers 0, k, 2k, ... (k = 4: 15 of Kimi's 60 MoE layers;
                                # the routing moves from layer to layer, a node is judged again k layers on)



def tokens_per_expert_byte(committed: float, step_us: float, expert_us: float, expert_bytes: int) -> float:
    """The exchange rate: the tokens a step commits per us of it, times the us one expert costs at one layer, per
    byte of that expert. DEFAULT_RATE below, the tuning file's (exchange_rate) and `bench step --prune-rate
    measured`'s are this formula over different measurements."""
    return committed / step_us * expert_us / expert_bytes


# DEFAULT_RATE: what one expert byte is worth in committed tokens on the step we ship (Kimi K2.6, rank 0 of tp 8 on
# an H200, budget 16, 4K, uniform routing; docs/performance.md section 1 and its 2026-12-04 entry):
KIMI_STEP_US = 14920.0          # the step
KIMI_ROUTED_US = 8600.0         # of which the routed experts ...
KIMI_EXPERTS_READ = 116 * 60    # ... reading 116 distinct experts in each of the 60 MoE layers
KIMI_EXPERT_BYTES = 3_096_576   # one expert's INT4 slice on a tp-8 rank: gate_up 2 x 256 x 7168 / 2 + down
                                # 7168 x 256 / 2 bytes + bf16 scales (group 32) 3 x 256 x 7168 / 32 x 2
ASSUMED_COMMITTED = 5.0         # committed tokens per step at budget 16 (an assumption: the Kimi-K2.5-DFlash card's
                                # 5.3 at GSM8K, rounded down for a tree whose later nodes are rarely taken)
# tokens the step earns per us x the us one expert byte costs: ~1.34e-10 tokens per byte (an expert slice ~4.1e-4)
DEFAULT_RATE = tokens_per_expert_byte(ASSUMED_COMMITTED, KIMI_STEP_US, KIMI_ROUTED_US / KIMI_EXPERTS_READ,
                                      KIMI_EXPERT_BYTES)
# the same per expected committed token: --prune auto without a measured rate multiplies it by the tree's own
# expected committed tokens (the sum of its path probabilities), as the tuning file's measured rate is
DEFAULT_RATE_PER_TOKEN = DEFAULT_RATE / ASSUMED_COMMITTED

MAX_NODES, MAX_TOPK, MAX_EXPERTS = 1024, 16, 512      # the kernel's limits (one block, shared-memory counts)
MAX_HORIZON = 1024              # MoE layers left (Kimi has 60); keeps marginal x bytes x horizon < 2^63 for int32 bytes


class PruneError(InputError):
    """Pruning inputs that cannot be used as given (shapes, ids, rate), naming the field."""


def prune_nodes(live, parents, path_prob, routed_ids, expert_bytes: int, rate: float,
                n_experts: int = MAX_EXPERTS, horizon: int = 1) -> np.ndarray:
    """The rule of the module docstring -> live_out [q] int32 (1 live, 0 dead). live [q] (nonzero = live),
    parents [q] (parents[i] < i, root -1), path_prob [q] float32, routed_ids [q, top_k] global expert ids in
    0..n_experts-1 (rows of dead nodes are not read), expert_bytes one expert's bytes, rate tokens per byte
    (float32, as the kernel takes it), horizon the MoE layers after this one (>= 0)."""
    if not (isinstance(horizon, (int, np.integer)) and 0 <= horizon <= MAX_HORIZON):
        raise PruneError(f"prune_nodes: horizon {horizon!r} must be an int in 0..{MAX_HORIZON} (MoE layers left)")
    live = np.asarray(live).reshape(-1) != 0
    parents = np.asarray(parents, np.int64).reshape(-1)
    prob = np.asarray(path_prob, np.float32).reshape(-1).astype(np.float64)
    ids = np.asarray(routed_ids, np.int64)
    q = len(live)
    if parents.shape != (q,) or prob.shape != (q,) or ids.ndim != 2 or ids.shape[0] != q:
        raise PruneError(f"prune_nodes: live, parents, path_prob must be [q] and routed_ids [q, top_k]; got "
                         f"{q}, {parents.shape}, {prob.shape}, {ids.shape}")
    if q == 0 or parents[0] != -1 or np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, q)):
        raise PruneError("prune_nodes: parents must be -1 at the root and parents[i] in 0..i-1 after it")
    if np.any((ids[live] < 0) | (ids[live] >= n_experts)):
        raise PruneError(f"prune_nodes: routed_ids of live nodes must be expert ids in 0..{n_experts - 1}")
    live[0] = True                                                       # the root is always live
    use = np.bincount(ids[live].reshape(-1), minlength=n_experts)        # [E] (live node, slot) pairs per expert
    marginal = (use[ids] == 1).sum(axis=1)                               # [q] (meaningful on live rows)
    bytes_left = marginal.astype(np.int64) * int(expert_bytes) * int(horizon)          # [q] exact in int64
    cost = float(np.float32(rate)) * bytes_left.astype(np.float64)
    drop = live & (marginal > 0) & (prob < cost)
    drop[0] = False
    out = live & ~drop
    for i in range(1, q):                                                # parents precede children
        out[i] = out[i] and out[parents[i]]
    return out.astype(np.int32)


def expected_saving(routed, lives, final, horizons: dict) -> int:
    """The expert-layers the rule expects a step's pruning to save, on its own terms: at each pruning MoE layer j
    (horizons: {j, an index into the MoE layers: its horizon, description/layers.py moe_horizon}), the experts that
    only the nodes dropped there used (routed [m, q, k] ids, lives [m, q] the mask each MoE layer routed with, final
    [q] the verify's last mask: the mask after j is lives[j + 1], or final after the last), each charged for its
    horizon. What the rule assumes (a dropped node's marginal experts stay marginal); `bench step --prune-rate
    calibrated` prices an expert-layer at the us the step actually saved over this count."""
    routed, lives = np.asarray(routed), np.asarray(lives) != 0
    total = 0
    for j, horizon in sorted(horizons.items()):
        after = lives[j + 1] if j + 1 < len(lives) else np.asarray(final).reshape(-1) != 0
        gone = set(np.unique(routed[j][lives[j]]).tolist()) - set(np.unique(routed[j][after & lives[j]]).tolist())
        total += len(gone) * horizon
    return total


def node_path_probs(parents, depth, tokens, draft_logits, calibration=None) -> np.ndarray:
    """[n] float32: P(the path root -> i is accepted), estimated as the product along the path of the calibrated
    drafter probability of each node's token at its depth (draft_logits [D, V]: softmax row depth - 1); root 1.
    calibration: a tree/budget.Calibration (the tuning file's), None = the raw drafter probabilities."""
    x = np.asarray(draft_logits, np.float64)
    logz = x.max(axis=1) + np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1))     # [D]
    depth, tokens = np.asarray(depth), np.asarray(tokens)
    p = np.ones(len(depth))
    rows = np.arange(1, len(depth))
    p[rows] = np.exp(x[depth[rows] - 1, tokens[rows]] - logz[depth[rows] - 1])
    a = p if calibration is None else calibration.calibrate(p, np.maximum(depth, 1))
    a[0] = 1.0
    return path_probs(parents, a).astype(np.float32)


def exchange_rate(tuning, budget: int, context: int, expected_committed: float, moe_layers: int,
                  expert_bytes: int) -> float | None:
    """The step's rate from an engine's tuning file: the tokens it is expected to commit per us of its measured time
    at (budget, context), times the us one expert byte costs there; an expert's cost is the slope of the measured
    step time over the distinct experts a verify reads (expected_distinct_experts x MoE layers) between the
    smallest and the largest budget (an upper bound: the slope also carries the rows' other work). None when the
    file measures no such slope (one budget, or no growth of experts or time)."""
    b = list(tuning.budgets)
    times = tuning.step_times_at(context)
    d = list(tuning.expected_distinct_experts)
    if len(b) < 2 or moe_layers < 1 or expert_bytes < 1:
        return None
    dt, dx = times[b[-1]] - times[b[0]], (d[-1] - d[0]) * moe_layers
    if not (dt > 0 and dx > 0):
        return None
    step_us = times[budget] if budget in times else times[b[-1]]
    return tokens_per_expert_byte(expected_committed, step_us, dt / dx, expert_bytes)


def absent_tree(tree, live):
    """The tree as the walk of a pruned verify sees it: a dead node's token is -1, which no target token equals,
    so the walk never enters it (nor, its ancestors being its only way in, its subtree)."""
    live = np.asarray(live).reshape(-1)
    if live.shape != (tree.size,) or live[0] == 0:
        raise PruneError(f"absent_tree: live must be [{tree.size}] with the root live, got {live.tolist()}")
    tokens = np.where(live != 0, tree.tokens, -1).astype(np.int32)
    return Tree(tokens, tree.parents, tree.depth, tree.ranks, tree.scores)
