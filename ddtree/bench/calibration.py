"""Measured acceptance vs the calibrated prediction of `--budget auto` (issue 28; tree/budget.py).

Runs DDTree at one (largest) budget B through the real loop with an executor wrapper that records,
per step, the tree, the drafter's top-k table it was built from and the target's token at every node.
From one recorded step, every smaller budget b is known too, without running it: the tree of budget b
is the first b pops, and the target's token at a node depends only on that node's context (its path),
so walking the prefix tree with the same tokens gives exactly what a verify of budget b would accept
at that step. Per step and budget:
    measured  = tokens the walk commits (accepted drafts + the bonus), uncut by EOS or max_new_tokens
    predicted = expected_accept_prefix(tree, table, calibration)[b]
The calibration is fitted on the edges that were tried (a node whose parent was accepted: its draft
probability, depth, and whether it was accepted) of one half of the prompts and checked on the other.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.runtime.loop import ddtree_steps, run_to_end
from ddtree.tree.budget import Calibration, edge_draft_probs, expected_accept_prefix, fit_calibration
from ddtree.tree.build import Tree, topk_logprobs
from ddtree.tree.sampling import SamplingParams
from ddtree.tree.walk import WalkResult, accept_walk


@dataclass
class StepRecord:
    tree: Tree
    logp: np.ndarray             # [D, k] the drafter's top-k log-probabilities the tree was built from
    target_tokens: np.ndarray    # [n] the target's token at every node
    accepted: np.ndarray         # [a] accepted node indices, root first


class RecordingExecutor:
    """An executor that records every DDTree step (StepRecord) and otherwise is the one it wraps."""
    ddtree_step = None          # no fused step: the loop composes the primitives, so each step passes here
    drafter_prefill = None      # nor the fused step's drafter window (the composition keeps the context)

    def __init__(self, ex):
        self.ex, self.steps, self._built = ex, [], None

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def tree_build(self, root_token: int, draft_logits: np.ndarray, budget: int) -> Tree:
        tree = self.ex.tree_build(root_token, draft_logits, budget)
        self._built = (tree, topk_logprobs(draft_logits, budget)[0])
        return tree

    def accept_walk(self, tree: Tree, target_tokens) -> WalkResult:
        walk = self.ex.accept_walk(tree, target_tokens)
        built, logp = self._built
        assert built is tree, "accept_walk of a tree this wrapper did not build"
        self.steps.append(StepRecord(tree, logp, np.asarray(target_tokens).copy(), walk.accepted.copy()))
        return walk


def record_steps(ex, prompt_ids: list[list[int]], budget: int, max_new_tokens: int, eos_ids=(),
                 block_size: int | None = None, params: SamplingParams | None = None) -> list[list[StepRecord]]:
    """Per prompt, the records of every DDTree step of a run at `budget` (greedy by default)."""
    out = []
    for ids in prompt_ids:
        rec = RecordingExecutor(ex)
        run_to_end(ddtree_steps(rec, ids, max_new_tokens, params or SamplingParams(), budget, eos_ids, block_size))
        out.append(rec.steps)
    return out


def edge_samples(steps: list[StepRecord]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(draft prob, accepted 0/1, depth) of every tried edge: each drafted node whose parent was accepted."""
    p, acc, depth = [], [], []
    for s in steps:
        on_path = np.zeros(s.tree.size, bool)
        on_path[s.accepted] = True
        tried = [i for i in range(1, s.tree.size) if on_path[s.tree.parents[i]]]
        probs = edge_draft_probs(s.tree, s.logp)
        p += [probs[i] for i in tried]
        acc += [float(on_path[i]) for i in tried]
        depth += [int(s.tree.depth[i]) for i in tried]
    return np.array(p), np.array(acc), np.array(depth, dtype=np.int64)


def prefix_tree(tree: Tree, b: int) -> Tree:
    """The tree of budget b: the first b pops (nodes 0..b)."""
    n = min(b, tree.size - 1) + 1
    return Tree(tree.tokens[:n], tree.parents[:n], tree.depth[:n], tree.ranks[:n], tree.scores[:n])


def accept_by_budget(steps: list[StepRecord], budgets, calibration: Calibration | None) -> dict[int, tuple]:
    """{b: (mean predicted, mean measured)} committed tokens per step over the steps, for each budget b."""
    pred, meas = {b: [] for b in budgets}, {b: [] for b in budgets}
    for s in steps:
        e = expected_accept_prefix(s.tree, s.logp, calibration)            # [n]
        for b in budgets:
            pred[b].append(e[min(b, len(e) - 1)])
            sub = prefix_tree(s.tree, b)
            meas[b].append(accept_walk(sub, s.target_tokens[: sub.size]).committed_tree_tokens)
    return {b: (float(np.mean(pred[b])), float(np.mean(meas[b]))) for b in budgets}


def held_out_check(ex, prompt_ids: list[list[int]], budget: int, budgets, max_new_tokens: int, eos_ids=(),
                   block_size: int | None = None) -> dict:
    """Fit on the even-indexed prompts, predict the odd-indexed ones. {"calibration", "fit_edges", "rows":
    [{"budget", "predicted", "measured", "rel_error", "raw_predicted"}]}; raw = uncalibrated draft
    probabilities, for comparison."""
    per_prompt = record_steps(ex, prompt_ids, budget, max_new_tokens, eos_ids, block_size)
    fit_steps = [s for steps in per_prompt[0::2] for s in steps]
    test_steps = [s for steps in per_prompt[1::2] for s in steps]
    p, acc, depth = edge_samples(fit_steps)
    cal = fit_calibration(p, acc, depth)
    calibrated = accept_by_budget(test_steps, budgets, cal)
    raw = accept_by_budget(test_steps, budgets, None)
    rows = [{"budget": b, "predicted": pred, "measured": meas, "rel_error": (pred - meas) / meas,
             "raw_predicted": raw[b][0]} for b, (pred, meas) in calibrated.items()]
    return {"calibration": cal, "fit_edges": len(p), "test_steps": len(test_steps), "rows": rows}
