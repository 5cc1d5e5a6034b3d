"""The rows of `ddtree bench step` (bench/step.py; every rank of bench/step_ranks.py runs the same): a synthetic rank
and its step graphs, one row's setup (given routing, stated tree, fixed accepted length) and its eager run + capture.
"""
from __future__ import annotations

import click
import numpy as np

from ddtree.bench.bench_ops import BenchSteps
from ddtree.bench.project import DraftProfile, depth_histogram
from ddtree.bench.routing import distinct_per_layer, routing_ids
from ddtree.bench.synthetic_rank import SyntheticRank
from ddtree.cli_types import FiniteFloatRange
from ddtree.description.layers import router_weight
from ddtree.plugins import randfill as rf
from ddtree.runtime.cuda_step_prune import StepPruning
from ddtree.runtime.pruning import Pruner, expert_bytes
from ddtree.tree.prune import tokens_per_expert_byte
from ddtree.tree.sampling import SamplingParams


def given_routing(rank, budget: int, routing: str, reuse: float | None, seed: int = 0) -> dict | None:
    """routing 'router': None (the router's own choice). 'uniform' / 'tree': ids for the budget's stated tree
    (bench/project.py DraftProfile) from bench/routing.py, written into the rank's routing buffers (one per MoE
    layer, the rows past the tree unused) that CudaOps.moe uses after its router ran; -> the distinct experts
    per layer, from those ids."""
    if routing == "router":
        rank.ops.routing = None
        return None
    cfg = rank.config
    k, layers = cfg.num_experts_per_tok, cfg.moe_layers
    tree = DraftProfile().tree(budget, rank.drafter_config.block_size - 1)
    ids = routing_ids(routing, tree.parents, cfg.n_routed_experts, k, reuse or 0.0, len(layers), seed)   # [L, n, k]
    d = write_routing(rank, ids)
    return {"mean": float(d.mean()), "min": int(d.min()), "max": int(d.max()),
            "source": f"{routing} ids for the stated tree (depths {depth_histogram(tree)}), reuse {reuse}, seed {seed}"}


def write_routing(rank, ids: np.ndarray) -> np.ndarray:
    """ids [L MoE layers, n rows, k] -> the rank's routing buffers (one per MoE layer, rows past n unused), weights
    routed_scaling_factor / k, used by CudaOps.moe after its router ran; -> the distinct experts per layer [L]."""
    cfg, gpu = rank.config, rank.gpu
    k, layers = cfg.num_experts_per_tok, cfg.moe_layers
    if ids.shape[0] != len(layers) or ids.shape[1] > rank.ops.max_tokens or ids.shape[2] != k:
        raise ValueError(f"given routing: ids {ids.shape} for {len(layers)} MoE layers of at most "
                         f"{rank.ops.max_tokens} rows of top-{k}")
    if rank.routing_buffers is None:
        rows = rank.ops.max_tokens
        rank.routing_buffers = {L: (gpu.zeros((rows, k), np.int32), gpu.alloc((rows, k), np.float32)) for L in layers}
    weight = np.full((ids.shape[1], k), cfg.routed_scaling_factor / k, np.float32)
    for i, L in enumerate(layers):
        gpu.copy_in(rank.routing_buffers[L][0], ids[i].astype(np.int32))
        gpu.copy_in(rank.routing_buffers[L][1], weight)
    rank.ops.routing = {router_weight(L): rank.routing_buffers[L] for L in layers}
    return distinct_per_layer(ids)


def stated_draft_logits(budget: int, depths: int, vocab: int) -> np.ndarray:
    """[depths, vocab] float32 logits whose log-softmax is DraftProfile's stated table (token r: log top1 (1-top1)^r
    for r < budget, the rest of the mass on token `budget`, nothing elsewhere): the tree builder then builds
    DraftProfile.tree(budget, depths), the shape the routing generator and the projection use."""
    top1 = DraftProfile().top1
    logp = np.log(top1) + np.arange(budget) * np.log(1.0 - top1)          # a geometric series, whose rest is
    if vocab <= budget:
        raise click.ClickException(f"a rank's vocab slice of {vocab} cannot hold a budget {budget} tree's candidates")
    row = np.full(vocab, -1e30, np.float64)
    row[:budget], row[budget] = logp, budget * np.log(1.0 - top1)          # (1 - top1)^budget
    return np.tile(row.astype(np.float32), (depths, 1))


def stated_depths(budget: int, depths: int) -> list[int]:
    return depth_histogram(DraftProfile().tree(budget, depths))


def context_room(repeats: int, accept: int, b: int) -> int:
    """Cache rows past the context a row's replays use: each replay commits `accept` tokens (the AR step one)."""
    return (repeats + 3) * max(accept, 1) + 2 * b + 64


def row_cases(contexts: list[int], budgets: list[int], cases: list, with_ar: bool) -> list[tuple]:
    """The rows a run measures, in order: per context the AR step (budget None, with --ar), then every budget x
    (routing, reuse)."""
    rows = []
    for context in contexts:
        rows += [(context, None, "router", None)] if with_ar else []
        rows += [(context, budget, routing, reuse) for budget in budgets for routing, reuse in cases]
    return rows


def synthetic_steps(gpu, cfg, dcfg, plan, rank_id: int, contexts, budgets, repeats: int, accept: int):
    """Rank rank_id of `plan` on `gpu` with generated weights and caches for the run's longest row, and its step
    graphs (greedy) -> (rank, steps, max_context)."""
    max_context = max(contexts) + max(budgets) + context_room(repeats, accept, dcfg.block_size)
    rank = SyntheticRank(gpu, cfg, dcfg, plan, rank_id, max_context)
    steps = BenchSteps(rank)
    steps.set_params(SamplingParams())
    return rank, steps, max_context


def rank_expert_bytes(rank) -> int:
    """One routed expert's bytes on the synthetic rank (its tensor specs)."""
    return expert_bytes(lambda name: rank.specs[name].nbytes, rank.config, rank.lay.expert_stop - rank.lay.expert_start)


def bench_pruner(rank, rate: float | None, unpruned: dict | None = None, rate_per_token: float | None = None) -> Pruner:
    """--prune's runtime/pruning.py Pruner for the synthetic rank: its expert bytes from the rank's tensor specs, no
    tuning file (the stated drafter table's own probabilities, uncalibrated), the rate given or DEFAULT_RATE; with
    `unpruned` (--prune-rate measured: that row measured on this card) the rate per expected token it measures;
    rate_per_token: that rate given (--prune-rate calibrated's second row)."""
    nbytes = rank_expert_bytes(rank)
    if unpruned is not None:
        rate_per_token = measured_rate_per_token(unpruned, len(rank.config.moe_layers), nbytes)
    if rate_per_token is None:
        return Pruner(rank.config, nbytes, rate=rate)
    return Pruner(rank.config, nbytes, rate_per_token=rate_per_token)


def saved_expert_us(unpruned: dict, pruned: dict) -> float | None:
    """--prune-rate calibrated: the step us a pruned row saved per expert-layer the rule expected it to save,
    (unpruned step - pruned step) / expected_saving_expert_layers (tree/prune.py expected_saving: the experts only
    the dropped nodes used at each pruning layer, times the MoE layers after it): an expert-layer priced in the rule's
    own currency. measured_rate_per_token's average (the routed part over every expert read) also carries the part's
    fixed costs, and the rule's count assumes a dropped node's experts stay unshared; this price absorbs both. None
    where the row expected or saved nothing."""
    expected = pruned["pruned"]["expected_saving_expert_layers"]
    saved = unpruned["step_us"] - pruned["step_us"]
    return saved / expected if expected > 0 and saved > 0 else None


def with_earnings(unpruned: dict, pruned: dict) -> dict:
    """The pruned row's speedup over the unpruned one and what it earns at the profile's acceptance: tokens/s ratio =
    speedup x the expected acceptance after / before."""
    p = pruned["pruned"]
    p["speedup"] = unpruned["step_us"] / pruned["step_us"]
    p["tokens_per_s_ratio"] = p["speedup"] * p["expected_accept_after"] / p["expected_accept_before"]
    return pruned


def measured_rate_per_token(row: dict, moe_layers: int, nbytes: int) -> float:
    """tree/prune.py tokens_per_expert_byte per expected token (one committed token) over a row measured here: the
    us an expert costs at one layer is the routed experts' part over the distinct experts its layers read. The part is its kernels timed alone, so the expert's cost is the kernels', not the step's."""
    experts = row.get("distinct_experts")
    if not experts or experts["mean"] <= 0 or row["parts"]["moe"]["us"] <= 0:
        raise click.ClickException(f"--prune-rate measured: the unpruned row (budget {row.get('budget')}) measured "
                                   "no routed experts to price an expert by")
    return tokens_per_expert_byte(1.0, row["step_us"], row["parts"]["moe"]["us"] / (experts["mean"] * moe_layers),
                                  nbytes)


def prepare_row(rank, steps, context: int, budget: int | None, repeats: int, routing: str = "router",
                reuse: float | None = None, accept: int = 1, pruner: Pruner | None = None):
    """Set the rank up for one row and run its step once eagerly, then once more into its graph: -> (graph key, the
    step's body, the distinct experts per layer or None). budget None: the AR step. pruner: the DDTree step with
    the verify pruned inside (--prune: runtime/cuda_step_prune.py, the rate's terms written for this row)."""
    gpu, b = rank.gpu, rank.drafter_config.block_size
    if budget:
        distinct = given_routing(rank, budget, routing, reuse)
    else:                                                     # the AR step: the router's own choice
        rank.ops.routing, distinct = None, None
    rank.ops.attention_context = context + context_room(repeats, accept, b)          # attention planned per context
    steps.state.set(start=context, bonus=1)
    if budget is None:
        key, body = ("ar", steps.plan.mode, context), steps._ar_body
    else:
        rf.fill_device(gpu, steps.window, 7, rf.ACT_BF16)
        key = ("ddtree", budget, b, steps.plan.mode, context, routing != "router", accept, pruner is not None)
        body = lambda: steps._ddtree_body(budget, b)         # noqa: E731
        if pruner is not None:
            steps.pruning = steps.pruning or StepPruning(steps, pruner)
            steps.pruning.prepare(pruner, budget, context)
            body = lambda: steps._ddtree_body(budget, b, prune=True, stats=False)    # noqa: E731 (timed: no copies)
        vocab = rank.lay.vocab_stop - rank.lay.vocab_start
        steps.stated_draft = gpu.upload(stated_draft_logits(budget, b - 1, vocab))
    steps.forced_accept = accept if budget else None
    steps._run(key, body)                                     # the first step eagerly, then its capture
    gpu.sync()
    return key, body, distinct


PRUNE_RATE_WORDS = ("measured", "calibrated")


def parse_prune_rate(text: str | None, with_prune: bool):
    """--prune-rate: None, 'measured', 'calibrated', or tokens per expert byte (a finite float >= 0); only with
    --prune."""
    if text is None:
        return None
    if not with_prune:
        raise click.BadParameter("prices the pruned rows: it needs --prune", param_hint="--prune-rate")
    if text in PRUNE_RATE_WORDS:
        return text
    try:
        return FiniteFloatRange(min=0).convert(text, None, None)
    except click.BadParameter as e:
        raise click.BadParameter(f"{text!r}: expected 'measured', 'calibrated' or a finite number >= 0 ({e.message})",
                                 param_hint="--prune-rate") from e
