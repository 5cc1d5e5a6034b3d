"""`ddtree bench step`: one rank's whole DDTree step at real size on one GPU (docs/interfaces.md section 10).

    ddtree bench step --preset kimi-k2.6 --tp 8 --rank 0 --context 4096,32768 --budget 4,8,16,32,64 --json

The measured object is the real step graph of runtime/cuda_step.py (draft, tree, verify, sampling + walk,
compaction, context window, record) for rank `--rank` of a tp `--tp` plan, weights generated on the device in
the kernels' layouts (bench/synthetic_rank.py) and the KV caches filled to the context. Each collective is a
stand-in moving its bytes once on this GPU (left out of the roofline; the projection models the real ones).
Per row: the step's latency (median of graph replays), its split by kernel family (every launch of the step
timed alone in a graph of its own, the same kernel shape timed once; `gaps` = step - the kernels' sum), the
bytes the meter counts for the step (backends/meter.py, uniform routing expectation), ideal = bytes / the measured
copy ceiling, and % of that roofline.

Routing (`--routing`): `router` = the router's own choice on random weights (near uniform); `uniform` / `tree`
= the router runs, then the MoE uses generated ids for the budget's stated best-first tree (bench/routing.py:
tree = each of a node's experts one of its parent's with probability --reuse), so the distinct experts per layer
are known (reported). The tree has the stated shape: the drafter's logits (computed, their cost kept) are
overwritten by the stated profile's table (stated_draft_logits), so the device builds DraftProfile's tree (its
depths reported next to the stated ones). The accepted length is fixed (`--accept`, default 4 committed tokens
a step): after the sampler, the walk's path is replaced by the tree's first-child chain of that many nodes
(plugins/step_state.py force_accept), so compaction, the context window and the record cost what such a step
costs (random weights alone accept ~1). `--ar` adds the autoregressive step (its own graph: one token through the target and the
sampler) at each context: tokens/s = 1 / its latency.
"""
from __future__ import annotations

import statistics

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from ddtree.backends.meter import meter_ar_step, meter_step, totals
from ddtree.bench.attention import dense_peak
from ddtree.bench.e2e import parse_budgets
from ddtree.bench.kernels import measure_ceiling
from ddtree.bench.project import depth_histogram
from ddtree.bench.project_requests import parse_requests
from ddtree.bench.projection import ALLREDUCE_CHOICES
from ddtree.bench.step_baseline import (
    baseline_args,
    baseline_field,
    check_baseline,
    measure_around,
    pair_rows,
    run_baseline,
)
from ddtree.bench.step_collectives import MODES as COLLECTIVE_MODES
from ddtree.bench.step_collectives import hidden_rows, modelled_us, use_collectives
from ddtree.bench.step_parts import (  # noqa: F401  (kernel_family: tests)
    SPLIT,
    kernel_family,
    part_ideals,
    part_times,
    target_terms,
    top_kernels,
)
from ddtree.bench.step_ranks import run_all_ranks
from ddtree.bench.step_requests import bench_requests, check_requests
from ddtree.bench.step_rows import (
    PRUNE_RATE_WORDS,
    bench_pruner,
    parse_prune_rate,
    prepare_row,
    rank_expert_bytes,
    row_cases,
    saved_expert_us,
    stated_depths,
    synthetic_steps,
    with_earnings,
)
from ddtree.bench.step_timeline import summarise, trace_kernels, write_timeline
from ddtree.bench.synthetic_rank import SyntheticWeights
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.cli_types import comma_list
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.model.presets import get_preset
from ddtree.plugins.device import Gpu
from ddtree.plugins.prefetch import SITES, SITES_HELP, chunks, parse_budget_mb, parse_chunk_kb
from ddtree.runtime.cuda_executor import gpu_unavailable
from ddtree.runtime.step_profile import record_launches, time_launches
from ddtree.tree.build import Tree
from ddtree.tree.prune import tokens_per_expert_byte


def parse_routing(routings: str, reuses: str) -> list[tuple[str, float | None]]:
    """--routing / --reuse -> [(routing, reuse)]: tree once per reuse, the others once."""
    names = [r.strip() for r in routings.split(",") if r.strip()]
    bad = [r for r in names if r not in ("router", "uniform", "tree")]
    if not names or bad:
        raise click.BadParameter(f"expected router, uniform or tree, got {routings!r}", param_hint="--routing")
    ps = comma_list(reuses, "--reuse", float, 0.0, 1.0)
    return [(r, p) for r in names for p in (ps if r == "tree" else [None])]


def parse_rank_gpus(text: str | None, tp: int, rank_id: int) -> list[int]:
    """--gpu for --ranks all: one index per rank (default 0..tp-1), as ddtree-run's --gpu for a tp N engine."""
    if rank_id:
        raise click.BadParameter(f"--ranks all runs every rank; --rank {rank_id} names one", param_hint="--rank")
    if text is None:
        return list(range(tp))
    gpus = comma_list(text, "--gpu", int, 0)
    if len(gpus) != tp:
        raise click.BadParameter(f"{len(gpus)} GPU index(es) for tp {tp}: one per rank", param_hint="--gpu")
    return gpus


def parse_one_gpu(text: str | None) -> int:
    """--gpu for --ranks one: one index (default 0)."""
    if text is None:
        return 0
    gpus = comma_list(text, "--gpu", int, 0)
    if len(gpus) != 1:
        raise click.BadParameter(f"'{text}': --ranks one runs on one GPU; a GPU per rank is for --ranks all",
                                 param_hint="--gpu")
    return gpus[0]


def parse_contexts(text: str) -> list[int]:
    return sorted(set(comma_list(text, "--context", int, 16)))


def measure_row(rank, steps, context: int, budget: int | None, ceiling_gbps: float, repeats: int,
                routing: str = "router", reuse: float | None = None, accept: int = 1, pruner=None,
                timeline: str | None = None) -> dict:
    """One row: budget None = the autoregressive step (one token, its own graph), else the DDTree step whose tree
    has the stated shape (steps.stated_draft) and whose walk is replaced by an `accept`-node path (steps.forced_accept).
    pruner: that step with the verify pruned inside (--prune; the row's `prune` fields). timeline: a directory for
    one replay's CUPTI trace (bench/step_timeline.py; the row's `timeline` summary)."""
    cfg, dcfg, gpu = rank.config, rank.drafter_config, rank.gpu
    b = dcfg.block_size
    key, body, distinct = prepare_row(rank, steps, context, budget, repeats, routing, reuse, accept, pruner)
    accepted = depths = None
    if budget:
        logits = steps.last["logits"].numpy()
        if not np.isfinite(logits).all():
            raise click.ClickException(f"context {context}, budget {budget}: the verify logits are not finite "
                                       "(the synthetic weights' scales let activations overflow)")
        accepted = int(steps.last["sampled"].count.numpy()[0])
        depths = depth_histogram(Tree.from_parents(steps.last["tree"].parents.numpy()))
    steps.state.set(start=context, bonus=1)
    step_ms = statistics.median(gpu.timed_ms(lambda: steps._replay(key), repeats))
    traced = None
    if timeline is not None:
        steps.state.set(start=context, bonus=1)
        kernels = trace_kernels(gpu, lambda: steps._replay(key))
        name = f"{'ar' if budget is None else f'b{budget}'}_{context}_{routing}{'' if reuse is None else reuse}"
        traced = {**summarise(kernels), "file": write_timeline(timeline, name, kernels)}
    pruned = None
    if pruner is not None:                      # one stats step, eagerly: its routing and live masks (host-mapped)
        steps.state.set(start=context, bonus=1)
        steps.eager(lambda: steps._ddtree_body(budget, b, prune=True, stats=True))
        steps.pruning.record(budget + 1)
        d = pruner.stats.to_dict()
        n = budget + 1                          # the stated drafter's path probabilities: its expected acceptance
        path = steps.pruning.path_prob.numpy()[:n].astype(np.float64)
        live = steps.pruning.final_host[:n] != 0
        expected = float(path.sum())            # the root's 1 included
        base, per_token = pruner.rate_terms(budget, context)      # the step's rate: base + per_token x E[tokens]
        pruned = {"rate": base + per_token * expected, "rate_per_token": per_token,
                  "rate_source": d["prune_rate_source"],
                  "pruned_nodes": d["pruned_nodes"], "distinct_experts_before": d["distinct_experts_before"],
                  "distinct_experts_after": d["distinct_experts_after"],
                  "expected_saving_expert_layers": d["expected_saving_expert_layers"],
                  "removed_expert_layers": (d["distinct_experts_before"] - d["distinct_experts_after"])
                  * len(cfg.moe_layers),
                  "expected_accept_before": expected, "expected_accept_after": float(path[live].sum())}
    launches = record_launches(steps, body)
    times = time_launches(steps, launches)
    steps.forced_accept = steps.stated_draft = None
    meter_kw = {} if distinct is None else {"routing": "given", "distinct": distinct["mean"]}
    if budget is None:
        recs = meter_ar_step(cfg, rank.plan_dict, rank.specs, rank.lay.rank, context)
    else:
        recs = meter_step(cfg, dcfg, rank.plan_dict, rank.specs, rank.lay.rank, context, budget,
                          new_context=accepted, **meter_kw)
    parts = part_ideals(recs, ceiling_gbps, dense_peak(gpu.name))
    split = part_times(launches, times, rank.lay.vocab_stop - rank.lay.vocab_start, cfg.n_routed_experts, parts)
    for name, p in parts.items():
        p["us"], p["overhead_us"] = split[name], split[name] - p["ideal_us"]
    step_us = 1e3 * step_ms
    split["gaps"] = step_us - sum(split.values())
    t = totals(recs)
    nbytes = t["read"] + t["written"]
    ideal_us = nbytes / (ceiling_gbps * 1e3)
    return {"context": context, "mode": "ar" if budget is None else "ddtree", "budget": budget,
            "routing": "router (random weights)" if routing == "router" else routing, "reuse": reuse,
            "step_us": step_us, "split_us": split, "parts": parts, "kernels": len(launches), "bytes": nbytes,
            "ideal_us": ideal_us, "pct_roofline": 100 * ideal_us / step_us,
            **target_terms(step_us, ideal_us, parts, cfg.num_hidden_layers),
            "distinct_experts": distinct, "accepted_per_step": 1 if budget is None else accepted,
            "top_kernels": top_kernels(launches, times, rank.lay.vocab_stop - rank.lay.vocab_start,
                                       cfg.n_routed_experts),
            "tree_depths": depths, "stated_depths": stated_depths(budget, b - 1) if budget else None,
            "collectives_modelled_us": modelled_us(rank.ops.collective, recs, rank.lay.tp),
            **({} if budget is None else {"prune": "off" if pruned is None else "auto"}),
            **({} if pruned is None else {"pruned": pruned}), **({} if traced is None else {"timeline": traced})}


def echo_row(row: dict) -> None:
    where = f"context {row['context']}, {row['collectives']} collectives"
    dense = "" if row.get("dense_x_ideal") is None else f", dense {row['dense_x_ideal']:.2f}x its ideal"
    terms = f" ({row['overhead_us_per_layer']:.0f} us a layer past the ideal{dense})" \
        if "overhead_us_per_layer" in row else ""
    if row["budget"] is None:
        click.echo(f"{where}, AR: step {row['step_us']:.0f} us, {1e6 / row['step_us']:.0f} tok/s, "
                   f"{row['pct_roofline']:.0f} % of the copy roofline{terms}", err=True)
    else:
        reuse = "" if row["reuse"] is None else f" {row['reuse']}"
        p = row.get("pruned")
        pruned = "" if p is None else (f", pruned ({p['pruned_nodes']} nodes, experts {p['distinct_experts_before']:.1f}"
                                       f" -> {p['distinct_experts_after']:.1f} a layer, expected acceptance "
                                       f"{p['expected_accept_before']:.2f} -> {p['expected_accept_after']:.2f}"
                                       f", tokens/s x{p['tokens_per_s_ratio']:.3f})")
        click.echo(f"{where}, budget {row['budget']}, {row['routing']}{reuse}{pruned}: step {row['step_us']:.0f} us, "
                   f"{row['pct_roofline']:.0f} % of the copy roofline{terms}", err=True)


def parse_option(text, parse, flag: str):
    """An option's text through parse (a ValueError becomes a click error naming the flag); None stays None."""
    try:
        return None if text is None else parse(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=flag) from None


@click.command("step")
@click.option("--preset", default="kimi-k2.6", show_default=True, help="model dimensions (ddtree synth presets)")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="target layers (default: the preset's; kimi-k2.6: all 61)")
@click.option("--tp", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--rank", "rank_id", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--context", "contexts", default="4096,32768", show_default=True)
@click.option("--budget", "budgets", default="4,8,16,32,64", show_default=True)
@click.option("--routing", "routings", default="router", show_default=True,
              help="router (the router's own choice on random weights), uniform (random top-k per token), tree "
                   "(a node's experts reuse its parent's with probability --reuse); comma-separated")
@click.option("--reuse", "reuses", default="0.5", show_default=True, help="--routing tree: reuse probabilities")
@click.option("--accept", type=click.IntRange(min=1), default=4, show_default=True,
              help="tokens each DDTree step commits (the walk's path replaced by the tree's first-child chain of "
                   "this many nodes: compaction and the context window cost what they would; fewer if the tree is "
                   "shallower, reported per row); 4 ~ SGLang DDTree's reported 4.5")
@click.option("--ar", "with_ar", is_flag=True, help="also the autoregressive step (one token) at each context")
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--gpu", "gpu_text", default=None,
              help="--ranks one: the GPU index (default 0); --ranks all: one index per rank, comma-separated (default "
                   "0..tp-1; indices may repeat for a rehearsal on fewer GPUs)")
@click.option("--ranks", type=click.Choice(["one", "all"]), default="one", show_default=True,
              help="one: rank --rank alone, the collectives as stand-ins; all: every rank as a process on its GPU "
                   "(--gpu) with the real collectives (bench/step_ranks.py), each next to its single-rank figure")
@click.option("--no-branches", is_flag=True,
              help="launch every op in order (A/B of the cuda backend's parallel branches: backends/cuda_branch.py)")
@click.option("--prefetch-mb", default=None, metavar="MIB|SITE:MIB,...",
              help=f"L2 budget of a weight prefetch, MiB (0: none): one value for every site, or per site "
                   f"({SITES_HELP}), e.g. next:36; default a third of the GPU's L2 at each (backends/cuda_branch.py "
                   "BranchOps.prefetch)")
@click.option("--prefetch-chunk-kb", default=None, metavar="KIB|SITE:KIB,...",
              help=f"bytes one thread of the L2 prefetch asks for, KiB: one value for every call, or per site "
                   f"({SITES_HELP}), e.g. attention:4,next:16 (default by the call's rows: 16 at one row, 4 past one, "
                   "plugins/prefetch.py chunk_for); a smaller chunk spreads a fill over more SMs, whose copy units "
                   "issue it")
@click.option("--shared-join", type=click.Choice(["experts", "down"]), default=None,
              help="where the MoE's shared-expert branch joins: before the down launch (default) or before the routed "
                   "experts' launch (implies --shared-fork router; backends/cuda_moe.py)")
@click.option("--shared-fork", type=click.Choice(["router", "routed"]), default=None,
              help="where that branch forks: after the routing, beside the routed gate_up (default), or beside the "
                   "router (A/B: backends/cuda_moe.py)")
@click.option("--collectives", "collective_modes", default="copy", show_default=True,
              help="--ranks one: copy (each collective's bytes moved once) and/or pcie (the same, then held for the "
                   "PCIe model's time: bench/step_collectives.py); both: each row under each, and the fraction of "
                   "the modelled time the step hides")
@click.option("--allreduce", type=click.Choice(sorted(ALLREDUCE_CHOICES)), default="auto", show_default=True,
              help="--collectives pcie: the PCIe model(s) a collective is priced by (auto: the cheapest per message "
                   "of one-shot, two-shot, nccl)")
@click.option("--prefetch-next/--no-prefetch-next", default=None,
              help="the next layer's attention weights staged in L2 beside each layer's MLP all-reduce (default on: "
                   "backends/cuda_branch.py)")
@click.option("--prefetch-next-beside", type=click.Choice(["collective", "experts"]), default=None,
              help="where that prefetch runs: beside the MLP all-reduce (default) or beside the routed experts, once "
                   "routed (at few rows they leave the HBM mostly idle; backends/cuda_branch.py release_held)")
@click.option("--moe-down-prefetch", type=click.IntRange(min=0), default=None, metavar="TILES",
              help="the routed gate_up asks L2 for its experts' down weights when its launch has at most TILES tiles "
                   "(0: never; default the backend's: plugins/moe.py FusedMoE down_prefetch)")
@click.option("--main-first/--no-main-first", default=None,
              help="the step graph's main-chain kernels at the GPU's greatest stream priority and its parallel "
                   "branches' (the shared expert, the prefetches, the cache append) at the lowest, so that waiting "
                   "blocks of the chain are placed first (default off: backends/cuda_backend.py main_first)")
@click.option("--chain-norms/--no-chain-norms", default=None,
              help="each layer's closing residual add and the next layer's input norm as one launch (default on: "
                   "description/layers.py chained_norms); off: an add and a norm, as the ONNX graphs run them")
@click.option("--prune", "with_prune", is_flag=True,
              help="each DDTree row again with the verify pruned inside (--prune auto's step, issue 53): distinct "
                   "experts a layer before / after, pruned nodes, the step time beside the unpruned row's")
@click.option("--prune-rate", default=None,
              help="--prune: tokens per expert byte, or 'measured': DEFAULT_RATE's formula per expected token over the "
                   "unpruned row measured just before (this card's step and expert costs), or 'calibrated': that "
                   "row, then again with an expert-layer priced at the step us the first pruned row saved per "
                   "expert-layer the rule expected it to save (default: tree/prune.py DEFAULT_RATE_PER_TOKEN x the "
                   "tree's expected committed tokens, the H200 Kimi step's)")
@click.option("--requests", "requests_text", default=None,
              help="instead of the step: the target verify of R requests' trees in one forward, per R of this comma "
                   "list (e.g. 1,2,4): its captured graph's time, distinct experts, % of roofline, ratio to R = 1 "
                   "(bench/step_requests.py)")
@click.option("--baseline", default=None, metavar="DIR",
              help="every row first measured by the ddtree package in DIR (e.g. `git archive REV ddtree | tar -x -C "
                   "DIR`) on the same GPU, each row then carrying its step and parts beside this tree's "
                   "(bench/step_baseline.py)")
@click.option("--baseline-around", is_flag=True,
              help="--baseline: the baseline measured again after this tree's rows, each row paired with the mean of "
                   "its two runs, both kept: the baseline's drift between them sizes the order effect; all three "
                   "runs are subprocesses (bench/step_baseline.py measure_around)")
@click.option("--variant", "variants", multiple=True, metavar="DIR",
              help="--baseline-around: another tree holding a ddtree package, measured after the first baseline run "
                   "and before this tree, its rows paired with the same baseline under `variants` (repeatable)")
@click.option("--timeline", default=None, metavar="DIR",
              help="each row's step graph replayed once more under CUPTI (torch.profiler): every kernel's start and "
                   "end into DIR/<row>.json, and the row's `timeline`: wall, idle and each kernel family's exposed "
                   "time (bench/step_timeline.py)")
@click.option("--json", "as_json", is_flag=True)
@reported()
def step_command(preset, layers, tp, rank_id, contexts, budgets, routings, reuses, accept, with_ar, repeats, gpu_text,
                 ranks, no_branches, prefetch_mb, prefetch_chunk_kb, shared_join, shared_fork, collective_modes,
                 allreduce, prefetch_next, prefetch_next_beside, moe_down_prefetch, main_first, chain_norms, with_prune,
                 prune_rate, requests_text,
                 baseline, baseline_around, variants, timeline, as_json):
    """Rank RANK's DDTree step of a tp TP plan at real size: latency, split, % of the copy roofline."""
    contexts, budgets = parse_contexts(contexts), parse_budgets(budgets)
    prune_rate = parse_prune_rate(prune_rate, with_prune)
    if shared_join == "experts":                 # a branch joined before the experts forked before the routing
        if shared_fork == "routed":
            raise click.BadParameter("a branch forked after the routing joins before the down launch: --shared-join "
                                     "down (or leave it out)", param_hint="--shared-fork routed")
        shared_fork = "router"
    prefetch_budget = parse_option(prefetch_mb, parse_budget_mb, "--prefetch-mb")
    prefetch_chunk = parse_option(prefetch_chunk_kb, parse_chunk_kb, "--prefetch-chunk-kb")
    cases = parse_routing(routings, reuses)
    if rank_id >= tp:
        raise click.BadParameter(f"rank {rank_id} is not below tp {tp}", param_hint="--rank")
    layers = layers or (61 if preset == "kimi-k2.6" else None)
    cfg, dcfg = get_preset(preset, layers)
    plan = make_plan(cfg, dcfg, tp)
    modes = comma_list(collective_modes, "--collectives", str)
    if any(m not in COLLECTIVE_MODES for m in modes) or len(set(modes)) != len(modes):
        raise click.BadParameter(f"{collective_modes!r}: a comma list of {', '.join(COLLECTIVE_MODES)}",
                                 param_hint="--collectives")
    if modes != ["copy"] and tp == 1:
        raise click.BadParameter("a tp 1 rank has no collectives to stand in for", param_hint="--collectives")
    requests = None if requests_text is None else parse_requests(requests_text)
    if requests is not None:
        check_requests(requests, contexts, budgets, cfg, with_ar, ranks, modes)
        if with_prune:
            raise click.BadParameter("applies to the step's rows, not --requests' union verify", param_hint="--prune")
    if timeline is not None and (ranks == "all" or requests is not None):
        raise click.BadParameter("traces the step's rows of --ranks one", param_hint="--timeline")
    if baseline is not None:
        if ranks == "all" or requests is not None:
            raise click.BadParameter("compares the step's rows of --ranks one", param_hint="--baseline")
        baseline = check_baseline(baseline)
        if baseline_around and timeline is not None:
            raise click.BadParameter("measures this tree in a subprocess, which traces nothing",
                                     param_hint="--timeline")
    elif baseline_around:
        raise click.BadParameter("runs the --baseline tree again: give --baseline DIR", param_hint="--baseline-around")
    if variants and not baseline_around:
        raise click.BadParameter("is measured between the two baseline runs: give --baseline DIR --baseline-around",
                                 param_hint="--variant")
    variants = tuple(check_baseline(v, "--variant") for v in variants)
    if ranks == "all":
        for flag, given in (("--no-branches", no_branches), ("--prefetch-mb", prefetch_mb is not None),
                            ("--prefetch-chunk-kb", prefetch_chunk_kb is not None),
                            ("--shared-join", shared_join is not None), ("--shared-fork", shared_fork is not None),
                            ("--collectives", modes != ["copy"]),
                            ("--prefetch-next", prefetch_next is not None),
                            ("--prefetch-next-beside", prefetch_next_beside is not None),
                            ("--moe-down-prefetch", moe_down_prefetch is not None),
                            ("--main-first", main_first is not None),
                            ("--chain-norms", chain_norms is not None), ("--prune", with_prune)):
            if given:
                raise click.BadParameter("applies to --ranks one (the rank processes keep the backend's defaults)",
                                         param_hint=flag)
        gpus = parse_rank_gpus(gpu_text, tp, rank_id)
        for g in sorted(set(gpus)):
            why = gpu_unavailable(g)
            if why:
                raise click.ClickException(f"ddtree bench step --ranks all runs on GPUs: {why}")
        result = run_all_ranks(gpus, preset, layers, tp, contexts, budgets, cases, accept, repeats, with_ar)
        if as_json:
            emit_json(result)
        else:
            for row in result["rows"]:
                what = "AR" if row["budget"] is None else f"budget {row['budget']}"
                click.echo(f"context {row['context']}, {what}, {row['routing']}: step {row['step_us']:.0f} us (skew "
                           f"{row['skew_us']:.0f}), rank 0 single-rank {row['single_rank_us'][0]:.0f}, collectives "
                           f"{row['collectives_us_rank0']:.0f}")
        return
    gpu_id = parse_one_gpu(gpu_text)
    why = gpu_unavailable(gpu_id)
    if why:
        raise click.ClickException(f"ddtree bench step runs on a GPU: {why}")
    base_args = None if baseline is None else baseline_args(click.get_current_context())
    if baseline_around:                                  # three subprocesses: this one never opens the device
        result = measure_around(baseline, base_args, variants)
        if as_json:
            emit_json(result)
        else:
            for row in result["rows"]:
                echo_row(row)
        return
    base = None if baseline is None else run_baseline(baseline, base_args)
    gpu = Gpu(gpu_id)
    ceiling = measure_ceiling(gpu)
    gpu.free_all()
    def ops_options(ops):
        ops.branches = not no_branches
        if isinstance(prefetch_budget, dict):            # the sites it does not name keep the default
            ops.prefetch_bytes = {site: prefetch_budget.get(site, ops.prefetch_bytes) for site in SITES}
        elif prefetch_budget is not None:
            ops.prefetch_bytes = prefetch_budget
        if prefetch_chunk is not None:
            ops.prefetch_chunk = prefetch_chunk
        if shared_join is not None:
            ops.shared_join = shared_join
        if shared_fork is not None:
            ops.shared_fork = shared_fork
        if prefetch_next is not None:
            ops.prefetch_next = prefetch_next
        if prefetch_next_beside is not None:
            ops.prefetch_next_beside = prefetch_next_beside
        if chain_norms is not None:
            ops.chain_norms = chain_norms
        if moe_down_prefetch is not None:
            ops.moe_down_prefetch = moe_down_prefetch
        if main_first is not None:
            ops.main_first = main_first
    weights = SyntheticWeights.plan_bytes(rank_tensor_specs(plan))
    if requests is not None:
        result = bench_requests(gpu, preset, cfg, dcfg, plan, rank_id, requests, contexts, budgets, cases, repeats,
                                ceiling["gbps"], weights, ops_options)
        if as_json:
            emit_json(result)
        else:
            for r in result["rows"]:
                ratio = "" if r["ratio_to_1"] is None else f", {r['ratio_to_1']:.2f}x R = 1"
                experts = "" if r["distinct_experts"] is None else f", {r['distinct_experts']['mean']:.0f} experts"
                click.echo(f"context {r['context']}, budget {r['budget']}, {r['routing']}, R {r['requests']} "
                           f"({r['rows']} rows): verify {r['verify_us']:.0f} us{experts}, {r['pct_roofline']:.0f} % "
                           f"of the copy roofline{ratio}")
        return
    rank, steps, max_context = synthetic_steps(gpu, cfg, dcfg, plan, rank_id, contexts, budgets, repeats, accept)
    ops_options(rank.ops)
    click.echo(f"{gpu.name}: copy ceiling {ceiling['gbps']:.0f} GB/s; rank {rank_id} of tp {tp} {preset} "
               f"({cfg.num_hidden_layers} layers): weights {weights / 2**30:.1f} GiB, caches for {max_context} rows",
               err=True)
    rows, filled = [], None
    for mode in modes:
        if tp > 1:
            use_collectives(rank, steps, mode, allreduce)
        for context, budget, routing, reuse in row_cases(contexts, budgets, cases, with_ar):
            if context != filled:
                rank.fill_caches(context)
                filled = context
            row = {**measure_row(rank, steps, context, budget, ceiling["gbps"], repeats, routing, reuse, accept,
                                 timeline=timeline), "collectives": mode}
            rows.append(row)
            echo_row(row)
            if with_prune and budget is not None:        # the same row pruned (a fresh Pruner: the row's own stats)
                def pruned_row(pruner, basis: str, expert_us: float | None = None) -> dict:
                    r = with_earnings(row, {**measure_row(rank, steps, context, budget, ceiling["gbps"], repeats,
                                                          routing, reuse, accept, pruner), "collectives": mode})
                    r["pruned"].update(rate_basis=basis, **({} if expert_us is None else {"expert_us": expert_us}))
                    rows.append(r)
                    echo_row(r)
                    return r
                words = prune_rate in PRUNE_RATE_WORDS
                first = pruned_row(bench_pruner(rank, None, row) if words else bench_pruner(rank, prune_rate),
                                   "measured" if words else "given" if prune_rate is not None else "default")
                saved = saved_expert_us(row, first) if prune_rate == "calibrated" else None
                if saved is not None:                    # again, an expert priced at what its absence saved
                    per_token = tokens_per_expert_byte(1.0, row["step_us"], saved, rank_expert_bytes(rank))
                    pruned_row(bench_pruner(rank, None, rate_per_token=per_token), "calibrated", saved)
                elif prune_rate == "calibrated":
                    first["pruned"]["calibration"] = "none: the measured-rate row saved no time or expected no saving"
    if base is not None:
        pair_rows(rows, base, gpu.name)
    result = {"bench": "step", "device": gpu.name, "preset": preset, "layers": cfg.num_hidden_layers, "tp": tp,
              "rank": rank_id, "copy_ceiling_gbps": ceiling["gbps"], "weights_bytes": weights, "accept": accept,
              "branches": not no_branches, "prefetch_bytes": rank.ops.prefetch_bytes,
              "prefetch_chunk": chunks(rank.ops.prefetch_chunk),
              "shared_join": rank.ops.shared_join, "shared_fork": rank.ops.shared_fork,
              "prefetch_next": rank.ops.prefetch_next,
              "prefetch_next_beside": rank.ops.prefetch_next_beside, "chain_norms": rank.ops.chain_norms,
              "moe_down_prefetch": rank.ops.moe_down_prefetch, "main_first": rank.ops.main_first,
              "main_first_node_priorities": {str(p): n for p, n in sorted(rank.ops.gpu.capture_priorities.items())},
              "rows": rows,
              "baseline": None if base is None else baseline_field(baseline, base),
              "collectives": {"modes": modes, **(rank.ops.collective.describe() if "pcie" in modes else {})},
              "hidden": hidden_rows(rows),
              "notes": {"collectives": "copy: stand-ins moving their bytes once on this GPU; pcie: the same, held for "
                                       "the PCIe model's time (bench/step_collectives.py); neither in the roofline",
                        "hidden": "per row under both: hidden_fraction = 1 - (step pcie - step copy) / modelled_us",
                        "accept": "each DDTree step commits accepted_per_step tokens: the walk's path replaced by "
                                  "the tree's first-child chain (random weights accept ~1 on their own)",
                        "prune": "--prune: each DDTree row again with the verify pruned inside (prune auto; its "
                                 "pruned fields: the last replay's pruned nodes and distinct experts a MoE layer "
                                 "before / after, speedup = the unpruned row's step / this one's, "
                                 "expected_accept_before / _after = 1 + the stated drafter's path probabilities "
                                 "of every node / of the live ones: the acceptance the profile predicts; "
                                 "tokens_per_s_ratio = speedup x expected_accept_after / _before, what pruning "
                                 "earns at that acceptance; rate_basis: default, given, measured (an expert at the "
                                 "routed part's us over the experts read) or calibrated (at expert_us, the step us "
                                 "the measured row saved per expert-layer the rule expected it to save: "
                                 "expected_saving_expert_layers; removed_expert_layers = the distinct experts a "
                                 "layer that went, x the MoE layers)); its accepted "
                                 "length is still the forced --accept (the pruned tree's real acceptance is not "
                                 "measured here) and its bytes are the meter's unpruned ones",
                        "routing": "router: the router's choice on random weights; uniform/tree: generated ids "
                                   "used after the router ran (bench/routing.py on the stated tree)",
                        "split": "each launch timed alone in a graph of 10 back-to-back copies, one per kernel shape; "
                                 "gaps = step - the kernels' sum (negative where kernels overlap: the parallel "
                                 "branches, the L2 prefetch beside each attention)",
                        "bytes": "backends/meter.py meter_step (the generated ids' distinct experts for uniform/tree, the "
                                 "uniform expectation for router; the accepted tokens as the drafter's new "
                                 "context); meter_ar_step for the AR rows",
                        "parts": "per part of the split: ideal_us = max(bytes / copy ceiling, FLOPs / dense bf16 "
                                 "peak) over the meter's records of that part (bench/step_parts.py meter_family), us "
                                 "= its kernels' times, overhead_us = us - ideal_us; every kernel does one part's "
                                 "work today (a kernel of several would be split in proportion to their ideals)"}}
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"ddtree bench step: {gpu.name}, rank {rank_id} of tp {tp}, {preset}")
    short = {"attention": "attn", "router": "route", "lm_head": "lm", "drafter": "draft",
             "allreduce_standin": "ar*", "prefetch": "pf", "other": "other"}
    for name in ("ctx", "B", "acc", "routing", "experts", "step us", "ideal", "%", *(short.get(k, k) for k in SPLIT),
                 "gaps"):
        table.add_column(name, justify="right")
    for r in rows:
        label = r["routing"].split(" ")[0] + ("" if r["reuse"] is None else f" {r['reuse']}")
        experts = "-" if r["distinct_experts"] is None else f"{r['distinct_experts']['mean']:.0f}"
        table.add_row(str(r["context"]), "AR" if r["budget"] is None else str(r["budget"]), str(r["accepted_per_step"]),
                      label, experts, f"{r['step_us']:.0f}", f"{r['ideal_us']:.0f}",
                      f"{r['pct_roofline']:.0f}", *(f"{r['split_us'][k]:.0f}" for k in (*SPLIT, "gaps")))
    Console(stderr=False, width=160).print(table)
    click.echo("split columns: us of each kernel family alone (ar* = the collectives' stand-ins); gaps = step - sum")
