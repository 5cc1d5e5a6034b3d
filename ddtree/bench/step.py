"""`ddtree bench step`: one rank's whole DDTree step at real size on one GPU (docs/interfaces.md section 10).

    ddtree bench step --preset kimi-k2.6 --tp 8 --rank 0 --context 4096,32768 --budget 4,8,16,32,64 --json

The measured object is the real step graph of runtime/cuda_step.py (draft, tree, verify, sampling + walk,
compaction, context window, record) for rank `--rank` of a tp `--tp` plan, weights generated on the device in
the kernels' layouts (bench/synthetic_rank.py) and the KV caches filled to the context. Each collective is a
stand-in moving its bytes once on this GPU (left out of the roofline; the projection models the real ones).
Per row: the step's latency (median of graph replays), its split by kernel family (every launch of the step
timed alone in a graph of its own, the same kernel shape timed once; `gaps` = step - the kernels' sum), the
bytes the meter counts for the step (ops/meter.py, uniform routing expectation), ideal = bytes / the measured
copy ceiling, and % of that roofline.

Routing: the router runs on its random weights (close to uniform: no `--routing` override yet, said in the
JSON). The accepted length is whatever random weights give (about 1 a step), so compaction and the context
window cost their minimum; both are small against the verify.
"""
from __future__ import annotations

import statistics

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from ddtree.bench.e2e import parse_budgets
from ddtree.errors import reported
from ddtree.jsonout import emit_json

SPLIT = ("attention", "moe", "router", "dense", "lm_head", "drafter", "tree", "allreduce_standin", "other")


def kernel_family(rec: dict, vocab_per_rank: int, experts: int) -> str:
    """The split's bucket of one recorded launch (runtime/step_profile.record_launches)."""
    k, fn = rec["kernel"], rec["fn"]
    if rec["tag"]:
        return "allreduce_standin"
    if k.startswith("gemm_bf16"):
        n = int(rec["launch"][4][7])                            # the GEMM's N (SkinnyGemm.run's argument order)
        if n == vocab_per_rank:
            return "lm_head"
        if n == experts:
            return "router"
    if k.startswith(("draft_lse", "draft_topk", "draft_merge", "sample_", "step_", "ctx_window", "kv_compact")):
        return "tree"
    if k == "moe_route":
        return "router"
    if fn.startswith("draft"):
        return "drafter"
    if k.startswith(("mla_attention", "mla_decode")) or k == "kv_append":
        return "attention"
    if k.startswith(("moe_gate_up", "moe_down")):
        return "moe"
    if k.startswith(("gemm_bf16", "mla_absorb")):
        return "dense"
    return "other"


def parse_contexts(text: str) -> list[int]:
    try:
        values = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise click.BadParameter(f"'{text}' is not a comma-separated list of integers", param_hint="--context")
    if not values or min(values) < 16:
        raise click.BadParameter(f"contexts must be integers >= 16, got '{text}'", param_hint="--context")
    return sorted(set(values))


def measure_row(rank, steps, context: int, budget: int, ceiling_gbps: float, repeats: int) -> dict:
    from ddtree.ops.meter import meter_step, totals
    from ddtree.plugins import randfill as rf
    from ddtree.runtime.step_profile import record_launches, time_launches
    cfg, dcfg, gpu = rank.config, rank.drafter_config, rank.gpu
    b = dcfg.block_size
    key = ("ddtree", budget, b, steps.plan.mode, context)    # a graph per context: attention planned for it
    rank.ops.attention_context = context + 2 * b + repeats + 64
    steps.state.set(start=context, bonus=1)
    rf.fill_device(gpu, steps.window, 7, rf.ACT_BF16)
    body = lambda: steps._ddtree_body(budget, b)             # noqa: E731
    steps._run(key, body)                                     # the first step eagerly, then its capture
    gpu.sync()
    logits = steps.last["logits"].numpy()
    if not np.isfinite(logits).all():
        raise click.ClickException(f"context {context}, budget {budget}: the verify logits are not finite "
                                   "(the synthetic weights' scales let activations overflow)")
    steps.state.set(start=context, bonus=1)
    step_ms = statistics.median(gpu.timed_ms(lambda: steps._replay(key), repeats))
    launches = record_launches(steps, body)
    times = time_launches(steps, launches)
    split = dict.fromkeys(SPLIT, 0.0)
    for rec, us in zip(launches, times):
        split[kernel_family(rec, rank.lay.vocab_stop - rank.lay.vocab_start, cfg.n_routed_experts)] += us
    step_us = 1e3 * step_ms
    split["gaps"] = step_us - sum(split.values())
    t = totals(meter_step(cfg, dcfg, rank.plan_dict, rank.specs, rank.lay.rank, context, budget))
    nbytes = t["read"] + t["written"]
    ideal_us = nbytes / (ceiling_gbps * 1e3)
    return {"context": context, "budget": budget, "routing": "router (random weights)", "reuse": None,
            "step_us": step_us, "split_us": split, "kernels": len(launches), "bytes": nbytes,
            "ideal_us": ideal_us, "pct_roofline": 100 * ideal_us / step_us,
            "distinct_experts": None, "accepted_per_step": None}


@click.command("step")
@click.option("--preset", default="kimi-k2.6", show_default=True, help="model dimensions (ddtree synth presets)")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="target layers (default: the preset's; kimi-k2.6: all 61)")
@click.option("--tp", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--rank", "rank_id", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--context", "contexts", default="4096,32768", show_default=True)
@click.option("--budget", "budgets", default="4,8,16,32,64", show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--gpu", "gpu_id", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@reported()
def step_command(preset, layers, tp, rank_id, contexts, budgets, repeats, gpu_id, as_json):
    """Rank RANK's DDTree step of a tp TP plan at real size: latency, split, % of the copy roofline."""
    from ddtree.bench.kernels import measure_ceiling
    from ddtree.builder.plan import make_plan
    from ddtree.model.presets import get_preset
    contexts, budgets = parse_contexts(contexts), parse_budgets(budgets)
    if rank_id >= tp:
        raise click.BadParameter(f"rank {rank_id} is not below tp {tp}", param_hint="--rank")
    cfg, dcfg = get_preset(preset, layers or (61 if preset == "kimi-k2.6" else None))
    plan = make_plan(cfg, dcfg, tp)
    from ddtree.runtime.cuda_executor import gpu_unavailable
    why = gpu_unavailable(gpu_id)
    if why:
        raise click.ClickException(f"ddtree bench step runs on a GPU: {why}")
    from ddtree.bench.synthetic_rank import SyntheticRank, SyntheticWeights
    from ddtree.builder.weights import rank_tensor_specs
    from ddtree.plugins.device import Gpu
    from ddtree.runtime.cuda_step import GpuSteps
    from ddtree.tree.sampling import SamplingParams
    gpu = Gpu(gpu_id)
    ceiling = measure_ceiling(gpu)
    gpu.free_all()
    max_context = max(contexts) + max(budgets) + 2 * dcfg.block_size + repeats + 64
    weights = SyntheticWeights.plan_bytes(rank_tensor_specs(plan))
    click.echo(f"{gpu.name}: copy ceiling {ceiling['gbps']:.0f} GB/s; rank {rank_id} of tp {tp} {preset} "
               f"({cfg.num_hidden_layers} layers): weights {weights / 2**30:.1f} GiB, caches for {max_context} rows",
               err=True)
    rank = SyntheticRank(gpu, cfg, dcfg, plan, rank_id, max_context)
    steps = GpuSteps(rank)
    steps.set_params(SamplingParams())
    rows = []
    for context in contexts:
        rank.fill_caches(context)
        for budget in budgets:
            row = measure_row(rank, steps, context, budget, ceiling["gbps"], repeats)
            rows.append(row)
            click.echo(f"context {context}, budget {budget}: step {row['step_us']:.0f} us, "
                       f"{row['pct_roofline']:.0f} % of the copy roofline", err=True)
    result = {"bench": "step", "device": gpu.name, "preset": preset, "layers": cfg.num_hidden_layers, "tp": tp,
              "rank": rank_id, "copy_ceiling_gbps": ceiling["gbps"], "weights_bytes": weights, "rows": rows,
              "notes": {"collectives": "stand-ins moving their bytes once on this GPU; not in the roofline",
                        "routing": "the router on random weights (near uniform); no override yet",
                        "split": "each launch timed alone in a graph of 10 back-to-back copies, one per kernel shape; "
                                 "gaps = step - the kernels' sum",
                        "bytes": "ops/meter.py meter_step (uniform routing expectation, the block as new context)"}}
    if as_json:
        emit_json(result)
        return
    table = Table(title=f"ddtree bench step: {gpu.name}, rank {rank_id} of tp {tp}, {preset}")
    short = {"attention": "attn", "router": "route", "lm_head": "lm", "drafter": "draft",
             "allreduce_standin": "ar*", "other": "other"}
    for name in ("ctx", "B", "step us", "ideal", "%", *(short.get(k, k) for k in SPLIT), "gaps"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["context"]), str(r["budget"]), f"{r['step_us']:.0f}", f"{r['ideal_us']:.0f}",
                      f"{r['pct_roofline']:.0f}", *(f"{r['split_us'][k]:.0f}" for k in (*SPLIT, "gaps")))
    Console(stderr=False, width=160).print(table)
    click.echo("split columns: us of each kernel family alone (ar* = the collectives' stand-ins); gaps = step - sum")
