"""`--prune auto` (issue 53): the decode loop's side of pruning a DDTree inside its verify.

    pruner = Pruner.for_executor(ex, tuning)               # refuses an executor that cannot prune, by name
    ddtree_steps(ex, prompt, n, params, budget, prune=pruner, stats=stats)   # stats.prune: the counts below

Per step (runtime/loop.py ddtree_step; the GPU step graph does the same on the device: runtime/cuda_step_prune.py):
every node's path probability (tree/prune.py node_path_probs: the
calibrated drafter confidences `--budget auto` fits, from the tuning file; without one the raw drafter
probabilities), the step's exchange rate, then the executor's prune_forward: the verify over the op set with
tree_prune at every `every`-th MoE layer (description/stack.py Pruning). The walk then sees dead nodes as absent
(tree/prune.py absent_tree), so the committed tokens are the target's samples: DDTree == AR with pruning on.

The rate (expected committed tokens per expert byte): with a tuning file that measures an expert's cost, the
step's own (tree/prune.py exchange_rate: this tree's expected committed tokens over the measured step time at
its budget and context, times the measured us per expert byte); otherwise the same with the Kimi step we ship
standing in for the measurement (tree/prune.py DEFAULT_RATE_PER_TOKEN x this tree's expected committed tokens). `rate` given: that, every step (tests, a stated experiment). The source is
reported with the stats (prune_rate_source).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ddtree.description.layers import moe_horizon
from ddtree.description.stack import Pruning, prune_layers
from ddtree.runtime.loop import RequestError
from ddtree.tree.prune import DEFAULT_RATE_PER_TOKEN, PRUNE_EVERY, exchange_rate, expected_saving, node_path_probs

PRUNE_MODES = ("off", "auto")


class PruneRefused(RequestError):
    """--prune auto where the executor (or the way it is run) cannot prune inside its verify."""


WHY_NOT = {"numpy": "it is the float64 reference of a checkpoint dir, which runs no op set (build an engine: "
                    "ddtree-build, then --model ENGINE_DIR)",
           "engine-graphs": "its ONNX graphs are fixed (no tree_prune node)",
           "tensorrt": "its TensorRT-RTX plans are fixed (no tree_prune node)",
           "cuda": "its tp > 1 step graphs (runtime/cuda_step_tp.py) have no tree_prune yet (tp 1 prunes)"}


EXPERT_TENSORS = ("gate_up.words", "gate_up.scales", "down.words", "down.scales")   # a routed expert's, stacked


def expert_bytes(nbytes_of, cfg, experts: int) -> int:
    """One routed expert's bytes on a rank (tree_prune's cost unit): its stacked kernel-layout tensors at the first
    MoE layer (nbytes_of(name) -> bytes) over the rank's `experts`."""
    L = cfg.moe_layers[0]
    return sum(int(nbytes_of(f"model.layers.{L}.mlp.experts.{k}")) for k in EXPERT_TENSORS) // experts


def check_prune(prune: str) -> str:
    if prune not in PRUNE_MODES:
        raise PruneRefused(f"prune (--prune) {prune!r}: expected one of {', '.join(PRUNE_MODES)}")
    return prune


@dataclass
class PruneStats:
    rate_source: str = ""
    per_step: list = field(default_factory=list)         # nodes pruned in each DDTree step
    experts_before: list = field(default_factory=list)   # per (step, MoE layer): distinct experts of every node
    experts_after: list = field(default_factory=list)    # ... of the live nodes (the experts the verify read)

    horizons: dict = field(default_factory=dict)         # {a pruning layer's index among the MoE layers: horizon}
    n_moe: int = 0                                       # the MoE layers (a step's add_layer calls, in order)
    expected_saved: list = field(default_factory=list)   # per step with its layers: expert-layers the rule expects
    _layers: list = field(default_factory=list, repr=False)   # this step's (ids, live) so far

    def add_layer(self, ids, live) -> None:
        """One MoE layer's routing ids [q, k] (every node's) and the live mask [q] it routed with."""
        live = np.asarray(live).reshape(-1) != 0
        self.experts_before.append(len(np.unique(ids)))
        self.experts_after.append(len(np.unique(np.asarray(ids)[live])))
        self._layers.append((np.asarray(ids), live))      # read by add_step, before the step's buffers are reused

    def add_step(self, live) -> None:
        """One step's final live mask [n]: its pruned nodes; after a step whose MoE layers were all added, the
        expert-layers the rule expected it to save (tree/prune.py expected_saving)."""
        live = np.asarray(live).reshape(-1)
        self.per_step.append(int(len(live) - int(live.sum())))
        if self.n_moe and len(self._layers) == self.n_moe:
            self.expected_saved.append(expected_saving([ids for ids, _ in self._layers],
                                                        [m for _, m in self._layers], live, self.horizons))
        self._layers = []

    def to_dict(self) -> dict:
        """The --json stats. distinct_experts_before counts every node's routing at each MoE layer (what an
        unpruned verify of this tree would read there; a dead row past its pruning layer is routed from its own
        hidden state, which then lacks its routed part: an estimate); _after the live rows' (what was read). The
        GPU step graph counts them on its stats steps only (runtime/cuda_step_prune.py STATS_EVERY), the host's
        composition on every step; pruned_per_step is every step's."""
        def mean(v):
            return float(np.mean(v)) if v else 0.0
        return {"prune": "auto", "prune_rate_source": self.rate_source, "pruned_nodes": int(sum(self.per_step)),
                "pruned_per_step": list(self.per_step), "distinct_experts_before": mean(self.experts_before),
                "distinct_experts_after": mean(self.experts_after),
                "expected_saving_expert_layers": mean(self.expected_saved)}


class Pruner:
    def __init__(self, cfg, expert_bytes: int, tuning=None, rate: float | None = None, every: int = PRUNE_EVERY,
                 rate_per_token: float | None = None):
        if rate is not None and rate_per_token is not None:
            raise ValueError("Pruner: a fixed rate or a rate per expected token, not both")
        self.cfg, self.expert_bytes, self.tuning, self.fixed_rate = cfg, int(expert_bytes), tuning, rate
        self.rate_per_token = rate_per_token
        self.at = prune_layers(cfg, every)
        self.calibration = tuning.calibration if tuning is not None else None
        measured = tuning is not None and exchange_rate(tuning, tuning.budgets[-1], 0, 1.0, len(cfg.moe_layers),
                                                        self.expert_bytes) is not None
        why = "tuning.json measures no expert cost" if tuning is not None else "no tuning.json"
        self.stats = PruneStats("given" if rate is not None else "given per expected token" if rate_per_token is not
                                None else "tuning.json" if measured else
                                f"default (tree/prune.py DEFAULT_RATE_PER_TOKEN: {why})",
                                horizons={j: moe_horizon(cfg, L) for j, L in enumerate(cfg.moe_layers) if L in self.at},
                                n_moe=len(cfg.moe_layers))

    @classmethod
    def for_executor(cls, ex, tuning=None, rate: float | None = None, every: int = PRUNE_EVERY) -> "Pruner":
        if ex.prune_forward is None:
            raise PruneRefused(f"--prune auto prunes the tree inside the verify over the op set (an engine directory on "
                               f"--device cpu, or --device cuda at tp 1); the {ex.name} executor cannot: "
                               f"{WHY_NOT.get(ex.name, 'it has no prune_forward')}. Use --prune off")
        return cls(ex.config, ex.expert_bytes, tuning, rate, every)

    def rate(self, budget: int, context: int, expected_committed: float) -> float:
        base, per_token = self.rate_terms(budget, context)
        return base + per_token * expected_committed

    def rate_terms(self, budget: int, context: int) -> tuple[float, float]:
        """The rate as base + per_token x the tree's expected committed tokens (the GPU step computes that sum on
        the device, runtime/cuda_step_prune.py): (given, 0), or (0, the tuning file's rate per expected token:
        exchange_rate is linear in it), or (0, the given rate per token), or without either (0,
        DEFAULT_RATE_PER_TOKEN)."""
        if self.fixed_rate is not None:
            return float(self.fixed_rate), 0.0
        if self.rate_per_token is not None:
            return 0.0, float(self.rate_per_token)
        measured = None if self.tuning is None else exchange_rate(
            self.tuning, budget, context, 1.0, len(self.cfg.moe_layers), self.expert_bytes)
        return (0.0, DEFAULT_RATE_PER_TOKEN if measured is None else measured)

    def verify(self, ex, tree, draft_logits, node_pos, visible, cache, taps, budget: int) -> tuple:
        """The step's verify with pruning -> (logits [n, V], taps {L: h}, live [n] int32)."""
        path = node_path_probs(tree.parents, tree.depth, tree.tokens, draft_logits, self.calibration)     # [n]
        rate = self.rate(budget, int(node_pos[0]), float(path.astype(np.float64).sum()))
        n = tree.size
        live0 = np.ones(n, np.int32)
        feeds = {"live": live0, "parents": tree.parents.astype(np.int32), "path_prob": path,
                 "prune_rate": np.array([rate], np.float32), "expert_bytes": np.array([self.expert_bytes], np.int32)}

        def on_route(L, ids, live):
            self.stats.add_layer(_first(ids), _first(live))

        pruning = Pruning(self.at, feeds, on_route)
        logits, tapped = ex.prune_forward(tree.tokens, node_pos, visible, cache, taps, pruning)
        live = np.asarray(_first(pruning.feeds["live"]), np.int32).reshape(-1)
        self.stats.add_step(live)
        return logits, tapped, live


def _first(v):
    """One rank's value of a per-rank list (every rank holds the same: the global routing), or the value."""
    return v[0] if isinstance(v, list) else v
