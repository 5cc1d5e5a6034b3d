"""Offline model of the pruned verify (issue 53), CPU: which nodes a pruning rule drops at a rate, on the tree and
routing `ddtree bench step --prune` measures (bench/project.py DraftProfile's stated tree at budget 16, bench/routing.py
ids for Kimi's 60 MoE layers, seed 0, pruned at description/stack.py prune_layers with layers.moe_horizon), and
what tokens/s that earns under the H100's measured costs:

    step_pruned = step + fixed - c x removed        removed = the distinct expert-layers the live rows no longer read
    tokens/s ratio = step / step_pruned x expected acceptance after / before

step and c (us saved per removed expert-layer) from the `--prune-rate measured` rows of
docs/measured/bench_step_prune_kimi_k26_tp8_rank0_h100_4k_b16_calibrated.json, fixed (the pruned verify with nothing
pruned) from ..._rate0_live_mask.json. Two rules: tree/prune.py prune_nodes (a node judged by its own path probability
and the experts only it uses) and `subtree` below (the subtree it drops judged by its summed path probabilities and
the experts only the subtree uses). Run: PYTHONPATH=. python3 tests/bench/model_prune_rates.py [--json]
"""
import json
import sys

import numpy as np

from ddtree.bench.project import DraftProfile
from ddtree.bench.routing import routing_ids
from ddtree.description.layers import moe_horizon
from ddtree.description.stack import prune_layers
from ddtree.model.presets import get_preset
from ddtree.tree.prune import KIMI_EXPERT_BYTES, PRUNE_EVERY, prune_nodes

MEASURED = "docs/measured/bench_step_prune_kimi_k26_tp8_rank0_h100_4k_b16_{}.json"
RATES = (0.0, 2e-11, 4e-11, 6e-11, 7.6e-11, 8.4e-11, 8.8e-11, 1.24e-10, 2e-10, 4e-10)
REUSE = {"uniform": 0.0, "tree": 0.5}


def subtree(live, parents, path_prob, routed_ids, expert_bytes, rate, n_experts, horizon):
    """The subtree variant: drop i if sum(path_prob over subtree(i)'s live nodes) < rate x (experts only subtree(i)
    uses) x bytes x horizon; subtrees close in node order."""
    q = len(parents)
    alive = np.asarray(live) != 0
    alive[0] = True
    inside = [[j for j in range(q) if alive[j] and _under(parents, j, i)] for i in range(q)]
    out = alive.copy()
    for i in range(1, q):
        if not alive[i]:
            continue
        others = set(routed_ids[[j for j in range(q) if alive[j] and j not in inside[i]]].ravel())
        marginal = len(set(routed_ids[inside[i]].ravel()) - others)
        value = float(np.asarray(path_prob, np.float64)[inside[i]].sum())
        out[i] = not (marginal and value < float(np.float32(rate)) * marginal * expert_bytes * horizon)
    for i in range(1, q):
        out[i] = out[i] and out[parents[i]]
    return out.astype(np.int32)


def _under(parents, j, i) -> bool:
    while j >= 0:
        if j == i:
            return True
        j = int(parents[j])
    return False


def costs() -> dict:
    """Per routing: the unpruned step, c and fixed, from the measured files."""
    calib = json.load(open(MEASURED.format("calibrated")))["rows"]
    zero = json.load(open(MEASURED.format("rate0_live_mask")))["rows"]
    out = {}
    for routing in REUSE:
        rows = [r for r in calib if r["routing"].startswith(routing)]
        base, meas = rows[0], next(r for r in rows if r.get("pruned", {}).get("rate_basis") == "measured")
        z = [r for r in zero if r["routing"].startswith(routing)]
        out[routing] = {"step": base["step_us"], "fixed": z[1]["step_us"] - z[0]["step_us"],
                        "c": (base["step_us"] - meas["step_us"]) / meas["pruned"]["removed_expert_layers"],
                        "measured": (meas["pruned"]["rate"], meas["pruned"]["tokens_per_s_ratio"])}
    return out


def model(rule, routing: str, rate: float, cost: dict, tree, prob, cfg) -> dict:
    parents, E = tree.parents.astype(np.int32), cfg.n_routed_experts
    k, n_moe = cfg.num_experts_per_tok, len(cfg.moe_layers)
    ids = routing_ids(routing, parents, E, k, REUSE[routing], n_moe, 0)                  # [L, n, k]
    live, removed, at = np.ones(len(parents), np.int32), 0, prune_layers(cfg, PRUNE_EVERY)
    for j, L in enumerate(cfg.moe_layers):
        removed += len(np.unique(ids[j])) - len(np.unique(ids[j][live != 0]))
        if L in at:                                      # the Pruner's layers and horizons
            live = rule(live, parents, prob, ids[j], KIMI_EXPERT_BYTES, float(np.float32(rate)), E,
                        horizon=moe_horizon(cfg, L))
    before, after = float(prob.astype(np.float64).sum()), float(prob[live != 0].astype(np.float64).sum())
    step = cost["step"] + cost["fixed"] - cost["c"] * removed
    return {"pruned_nodes": int((live == 0).sum()), "removed_expert_layers": removed, "accept_after": after,
            "tokens_per_s_ratio": cost["step"] / step * after / before}


def main() -> None:
    cfg, dcfg = get_preset("kimi-k2.6", 61)
    tree = DraftProfile().tree(16, dcfg.block_size - 1)
    prob = np.exp(tree.scores.astype(np.float64)).astype(np.float32)
    rows = []
    for routing, cost in costs().items():
        rate, ratio = cost["measured"]
        check = model(prune_nodes, routing, rate, cost, tree, prob, cfg)["tokens_per_s_ratio"]
        print(f"{routing}: c {cost['c']:.3f} us, fixed {cost['fixed']:.0f} us; at the measured rate {rate:.3g} the model "
              f"gives x{check:.3f}, the H100 x{ratio:.3f}", file=sys.stderr)
        for rate in RATES:
            for name, rule in (("node", prune_nodes), ("subtree", subtree)):
                rows.append({"routing": routing, "rate": rate, "rule": name,
                             **model(rule, routing, rate, cost, tree, prob, cfg)})
    if "--json" in sys.argv:
        print(json.dumps({"model": "tests/bench/model_prune_rates.py", "rows": rows}))
        return
    for r in rows:
        print(f"{r['routing']:8s} {r['rate']:9.3g} {r['rule']:8s} {r['pruned_nodes']:3d} nodes "
              f"{r['removed_expert_layers']:5d} expert-layers acc {r['accept_after']:.2f} x{r['tokens_per_s_ratio']:.3f}")


if __name__ == "__main__":
    main()
