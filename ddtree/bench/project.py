"""`ddtree bench project`: one DDTree step of rank 0 projected to 8x RTX PRO 6000 (issue 21; a PROJECTION).

Per (context, budget, routing): the meter backend counts the step (drafter, tree, target verify of
budget + 1 nodes after `context` cached tokens, acceptance walk, compaction; ddtree/backends/meter.py),
ddtree/bench/projection.py turns each op call and each counted collective into microseconds on the
target, and tokens/s = accept_len / step time. Routed experts touched per MoE layer: `uniform` = the
meter's expectation E (1 - (1 - k/E)^M); `tree` = the routing generator (ddtree/bench/routing.py) on
the budget's best-first tree, built by ddtree/tree/build.py from a stated draft profile: at every
depth the drafter's rank-r candidate has probability top1 (1 - top1)^r.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from ddtree.backends.meter import expected_distinct, meter_step
from ddtree.bench.projection import (
    ACCEPT_SOURCES,
    ALLREDUCE_CHOICES,
    HAND_SPLIT,
    PRO_6000,
    AcceptSource,
    Projection,
    depth_histogram,  # noqa: F401  (re-exported: bench/step*.py and bench/kernels.py import it from here)
    load_hidden,
    load_measured,
    priced_row,
)
from ddtree.bench.routing import ROUTINGS, distinct_per_layer, routing_ids
from ddtree.bench.step_correction import correction, load_measured_step
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_tensor_specs
from ddtree.cli_types import FiniteFloatRange, comma_list
from ddtree.description.opset import RankLayout
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.model.presets import get_preset
from ddtree.tree.build import MAX_BUDGET, Tree, build_tree


@dataclass(frozen=True)
class DraftProfile:
    """The drafter's per-depth candidates the tree shape is built from (the same at every depth)."""
    top1: float = 0.6          # ~ the first-position acceptance of an EAGLE3 chain on Kimi, 0.65
    source: str = ("stated: rank r has probability top1 (1 - top1)^r at every depth; top1 0.6 ~ the 0.65 "
                   "first-position acceptance of an EAGLE3 chain on Kimi (docs/hardware-and-kernels.md)")

    def tree(self, budget: int, depths: int) -> Tree:
        logp = np.log(self.top1 * (1.0 - self.top1) ** np.arange(budget))                # [k = budget]
        table = np.tile(logp.astype(np.float32), (depths, 1))                             # [D, k]
        return build_tree(0, table, np.tile(np.arange(budget, dtype=np.int32), (depths, 1)), budget)


def project_row(model, proj: Projection, accept: AcceptSource, context: int, budget: int, routing: str,
                reuse: float | None, tree: Tree, seed: int, measured_step: tuple | None = None) -> dict:
    """One row of the table: the meter's step under `routing`, projected (and corrected by a measured step:
    measured_step = (rows of bench/step_correction.load_measured_step, its path))."""
    cfg, dcfg, plan, specs, rank = model
    lay = RankLayout.from_plan(plan, rank)
    held, E, k, M = lay.expert_stop - lay.expert_start, cfg.n_routed_experts, cfg.num_experts_per_tok, budget + 1
    if routing == "tree":
        ids = routing_ids("tree", tree.parents, E, k, reuse, len(cfg.moe_layers), seed)      # [L, M, k]
        distinct = distinct_per_layer(ids, (lay.expert_start, lay.expert_stop))
        recs = meter_step(cfg, dcfg, plan, specs, rank, context, budget, routing="given", distinct=distinct)
        experts = {"mean": float(distinct.mean()), "min": int(distinct.min()), "max": int(distinct.max()),
                   "source": f"routing generator, tree, reuse {reuse}, seed {seed}"}
    else:
        recs = meter_step(cfg, dcfg, plan, specs, rank, context, budget)
        d = expected_distinct(held, E, k, M)
        experts = {"mean": d, "min": d, "max": d, "source": "uniform expectation E (1 - (1 - k/E)^M)"}
    row = priced_row(proj, accept, context, budget, routing, reuse, tree, recs, experts)
    if measured_step is not None:
        row["projection"]["measured_correction"] = correction(measured_step[0], proj.classes, proj.tp, recs, row,
                                                              measured_step[1])
    return row


def _ints(text: str, flag: str, lo: int, hi: int) -> list[int]:
    return comma_list(text, flag, int, lo, hi)


def _routings(routing: str, reuse: str | None) -> list[tuple[str, float | None]]:
    kinds = [r.strip() for r in routing.split(",") if r.strip()]
    bad = [r for r in kinds if r not in ROUTINGS]
    if not kinds or bad:
        raise click.BadParameter(f"unknown routing {', '.join(bad) or repr(routing)}; expected "
                                 f"{' or '.join(ROUTINGS)} (comma-separated)", param_hint="--routing")
    ps = comma_list(reuse or "0.5", "--reuse", float, 0.0, 1.0)
    if reuse is not None and "tree" not in kinds:
        raise click.BadParameter("applies to --routing tree only (uniform routing has no parent to reuse)",
                                 param_hint="--reuse")
    return [(r, None) for r in kinds if r == "uniform"] + [("tree", p) for p in ps if "tree" in kinds]


def _table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    corrected = any(r["projection"].get("measured_correction") for r in rows)
    names = ("budget", "context", "routing", "experts/layer", "step ms", "tokens/s",
             *(("x measured", "corr. ms", "corr. tok/s") if corrected else ()), "dominant terms (ms)")
    for name in names:
        table.add_column(name, justify="left" if name.startswith(("routing", "dominant")) else "right")
    for r in rows:
        p = r["projection"]
        routing = r["routing"] if r["reuse"] is None else f"tree p={r['reuse']:g}"
        dominant = ", ".join(f"{k} {p['split_ms'][k]:.2f}" for k in p["dominant"])
        below = p["accept_source_budget"] is not None and r["budget"] < p["accept_source_budget"]
        c = p.get("measured_correction")
        extra = ((f"{c['factor']:.2f}", f"{c['step_ms']:.2f}", f"{c['tokens_per_s']:.1f}") if c else ("-",) * 3) \
            if corrected else ()
        table.add_row(str(r["budget"]), str(r["context"]), routing, f"{r['distinct_experts']['mean']:.1f}",
                      f"{p['step_ms']:.2f}", f"{p['tokens_per_s']:.1f}" + ("*" if below else ""), *extra, dominant)
    return table


@click.command("project")
@click.option("--preset", default="kimi-k2.6", show_default=True, help="model dimensions (kimi-k2.6: all 61 layers)")
@click.option("--tp", type=int, default=8, show_default=True)
@click.option("--rank", type=click.IntRange(0), default=0, show_default=True)
@click.option("--budget", "budgets", default="4,8,16,32,64", show_default=True, help="comma-separated node budgets")
@click.option("--context", "contexts", default="4096,32768", show_default=True, help="comma-separated cached tokens")
@click.option("--routing", default="uniform,tree", show_default=True, help="uniform and/or tree, comma-separated")
@click.option("--reuse", default=None, help="tree routing: comma-separated probabilities p in [0, 1] [default: 0.5]")
@click.option("--accept", "accept_name", type=click.Choice(sorted(ACCEPT_SOURCES)), default="kimi-dflash-card",
              show_default=True, help="acceptance length source")
@click.option("--allreduce", type=click.Choice(sorted(ALLREDUCE_CHOICES)), default="auto", show_default=True,
              help="PCIe all-reduce model (auto: the cheapest per message of one-shot, two-shot, nccl; each row "
                   "names its choice)")
@click.option("--measured", type=click.Path(dir_okay=False), default=None,
              help="JSON {\"rows\": [{kernel_class, bytes, flops, us}]} measured on the H200: refits those classes")
@click.option("--measured-step", type=click.Path(dir_okay=False, exists=True), default=None,
              help="a `ddtree bench step --json` file from the H200: each matching row also gets the projection "
                   "corrected by the measured / modelled factor (bench/step_correction.py), and with --prune rows "
                   "the pruned step at the measured speedup")
@click.option("--hidden-collectives", type=click.Path(dir_okay=False, exists=True), default=None,
              help="bench step JSON measured with --collectives copy,pcie: the collectives cost (1 - its hidden "
                   "fraction) of their modelled time instead of all of it")
@click.option("--top1", type=FiniteFloatRange(0.0, 1.0, min_open=True, max_open=True), default=0.6,
              show_default=True, help="draft profile: top-1 probability at every depth (the tree's shape)")
@click.option("--seed", type=int, default=0, show_default=True, help="routing generator seed")
@click.option("--requests", "requests", default=None,
              help="R requests in ONE step, comma-separated (e.g. 1,2,4): rows per R with per-request and aggregate "
                   "tokens/s (bench/project_requests.py). Spelled as `bench step --requests`, which measures this "
                   "step's union verify, not as `bench e2e --concurrency` (requests in flight in the scheduler, "
                   "not one step)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
@reported()
def project_command(preset, tp, rank, budgets, contexts, routing, reuse, accept_name, allreduce, measured,
                    measured_step, hidden_collectives, top1, seed, requests, as_json):
    """Project one DDTree step to 8x RTX PRO 6000 (a projection from the meter's counts; no GPU)."""
    budget_list = _ints(budgets, "--budget", 1, MAX_BUDGET)
    request_list = None
    if requests is not None:
        from ddtree.bench import project_requests as pr  # lazy: it builds on this module's priced_row
        request_list = pr.parse_requests(requests)
        pr.check_rows(request_list, budget_list)
        if measured_step:
            raise click.BadParameter("--measured-step corrects one request's step; it is not applied to the step "
                                     "of R requests", param_hint="--requests")
    routing_list = _routings(routing, reuse)
    cfg, dcfg = get_preset(preset, 61 if preset == "kimi-k2.6" else None)
    context_list = _ints(contexts, "--context", 1, cfg.max_position_embeddings - max(budget_list) - 1)
    if rank >= tp:
        raise click.BadParameter(f"rank {rank} is not below --tp {tp}", param_hint="--rank")
    plan = make_plan(cfg, dcfg, tp)
    classes = {**HAND_SPLIT, **(load_measured(measured) if measured else {})}
    hidden = load_hidden(hidden_collectives) if hidden_collectives else (0.0, Projection.hidden_source)
    proj = Projection(PRO_6000, classes, ALLREDUCE_CHOICES[allreduce], tp, *hidden)
    accept = ACCEPT_SOURCES[accept_name]
    model = (cfg, dcfg, plan.to_dict(), rank_tensor_specs(plan), rank)
    profile = DraftProfile(top1)
    trees = {b: profile.tree(b, dcfg.block_size - 1) for b in budget_list}
    corrected = None
    if measured_step:
        corrected = (load_measured_step(measured_step), measured_step)
    if request_list:
        rows = pr.requests_rows(model, proj, accept, context_list, budget_list, routing_list, trees, seed, request_list)
    else:
        rows = [project_row(model, proj, accept, c, b, r, p, trees[b], seed, corrected)
                for c in context_list for b in budget_list for r, p in routing_list]
    assumptions = {**proj.assumptions(), "accept": asdict(accept), "draft_profile": asdict(profile),
                   "preset": preset, "layers": cfg.num_hidden_layers, "rank": rank, "measured": measured,
                   "drafter_new_context": dcfg.block_size, "routing_seed": seed,
                   **({"requests": {"requests": request_list, **pr.ASSUMPTIONS}} if request_list else {})}
    obj = {"bench": "project", "device": f"cpu (a projection to {tp}x {PRO_6000.name}; nothing measured)",
           "rows": rows, "ceiling": {"bandwidth_tbps": PRO_6000.bandwidth_tbps, "bf16_tflops": PRO_6000.bf16_tflops},
           "assumptions": assumptions}
    if as_json:
        emit_json(obj)
        return
    console = Console(width=150)
    what = "the DDTree step of R requests" if request_list else "one DDTree step"
    table = pr.requests_table if request_list else _table
    console.print(table(rows, f"PROJECTION of {what}, rank {rank} of {tp}x {PRO_6000.name} (accept: {accept.name})"))
    console.print(f"accept length {accept.name}: {accept.source}")
    if accept.source_budget is not None and min(budget_list) < accept.source_budget:
        console.print(f"* budget below the {accept.source_budget} drafted tokens the accept length was measured at: "
                      "optimistic")
