"""`ddtree bench project --requests 1,2,4` (issue 51): the DDTree step of R requests at once, projected.

Per R the meter counts the step description/stack.py ddtree_step_requests runs (backends/meter_requests.py
meter_step_requests, every request at the same context and budget):

    each request on its own, R times    drafter (its own context and drafter cache), tree build, head (its own
                                        temperature and seed: lm_head read once a request), walk, compaction
    once, over the union rows           the target verify of R x (budget + 1) rows in ONE forward, its all-reduces
                                        (messages of the union rows); each request's append and attention on its
                                        own cache

and bench/project.py priced_row prices it as it prices one request's step. Every request commits accept_len a
step (the same tree, the same source), so

    per-request tokens/s = accept_len / step        aggregate tokens/s = R x accept_len / step

Routed experts of the union: `uniform` = the meter's expectation over R x (budget + 1) rows; `tree` = the routing
generator on R copies of the budget's stated tree, request i with seed + i, distinct over the union rows (as
bench/routing.py union_routing, as the measured union verify is routed). R = 1 is today's one-request row.
"""
from __future__ import annotations

import click
from rich.table import Table

from ddtree.backends.meter import expected_distinct
from ddtree.backends.meter_requests import meter_step_requests
from ddtree.bench.projection import AcceptSource, Projection, priced_row
from ddtree.bench.routing import distinct_per_layer, union_routing
from ddtree.cli_types import comma_list
from ddtree.description.opset import RankLayout
from ddtree.tree.build import Tree

ASSUMPTIONS = {
    "drafter": "R drafter forwards, one per request (its own new context and drafter cache): the meter counts "
               "description/stack.py ddtree_step_requests, which drafts each request on its own; a drafter batched "
               "over R blocks is not built",
    "tree_head_walk_compaction": "R times, each over its own request's budget + 1 rows (the head samples each "
                                 "request with its own temperature and seed, so lm_head is read R times)",
    "verify": "one target forward over the union's R x (budget + 1) rows; its collectives carry the union rows",
    "routing": "uniform: the meter's expectation over the union rows; tree: the routing generator on R copies of "
               "the stated tree, request i with --seed + i, distinct experts over the union rows",
    "accept": "every request accepts accept_len a step (the same stated tree and accept source)",
}


def parse_requests(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, duplicates dropped); anything else is a BadParameter naming --requests."""
    return sorted(set(comma_list(text, "--requests", int, 1)))


def check_rows(requests: list[int], budgets: list[int]) -> None:
    """Refuse a union past the rows one kernel call takes (the engine could not verify it in one forward)."""
    from ddtree.backends.cuda_backend import MAX_TOKENS  # lazy: the kernels' limit, without loading them up front
    rows = max(requests) * (max(budgets) + 1)
    if rows > MAX_TOKENS:
        raise click.BadParameter(f"{max(requests)} requests x (budget {max(budgets)} + 1) = {rows} union rows exceed "
                                 f"the kernels' {MAX_TOKENS} rows of one call: ask for fewer requests or smaller "
                                 "budgets", param_hint="--requests")


def requests_row(model, proj: Projection, accept: AcceptSource, context: int, budget: int, routing: str,
                 reuse: float | None, tree: Tree, seed: int, R: int) -> dict:
    """One row: the step of R requests (each `tree` after `context` cached tokens) priced, with "requests",
    "union_rows" and projection.aggregate_tokens_per_s; projection.tokens_per_s is each request's."""
    cfg, dcfg, plan, specs, rank = model
    lay = RankLayout.from_plan(plan, rank)
    rows, held = R * (budget + 1), (lay.expert_start, lay.expert_stop)
    union = "" if R == 1 else f", over the union's {R} x {budget + 1} rows"
    if routing == "tree":
        ids = union_routing(cfg, [tree.parents] * R, "tree", reuse, seed)                        # [L, rows, k]
        distinct = distinct_per_layer(ids, held)
        recs = meter_step_requests(cfg, dcfg, plan, specs, rank, [(context, budget)] * R, routing="given",
                                   distinct=distinct)
        experts = {"mean": float(distinct.mean()), "min": int(distinct.min()), "max": int(distinct.max()),
                   "source": f"routing generator, tree, reuse {reuse}, seed {seed}"
                             + ("" if R == 1 else " + i for request i") + union}
    else:
        recs = meter_step_requests(cfg, dcfg, plan, specs, rank, [(context, budget)] * R)
        d = expected_distinct(held[1] - held[0], cfg.n_routed_experts, cfg.num_experts_per_tok, rows)
        experts = {"mean": d, "min": d, "max": d, "source": "uniform expectation E (1 - (1 - k/E)^M)" + union}
    row = priced_row(proj, accept, context, budget, routing, reuse, tree, recs, experts)
    p = row["projection"]
    p["aggregate_tokens_per_s"] = R * p["accept_len"] / (p["step_ms"] * 1e-3)
    return {**row, "requests": R, "union_rows": rows}


def requests_rows(model, proj: Projection, accept: AcceptSource, contexts: list[int], budgets: list[int],
                  routings: list, trees: dict, seed: int, requests: list[int]) -> list[dict]:
    """Every (context, budget, routing, R) row, each with "ratio_to_1": its step, per-request and aggregate tokens/s
    over the R = 1 row of the same context, budget and routing (computed when 1 is not among `requests`)."""
    out = []
    for c in contexts:
        for b in budgets:
            for r, p in routings:
                by_r = {R: requests_row(model, proj, accept, c, b, r, p, trees[b], seed, R)
                        for R in sorted({1, *requests})}
                one = by_r[1]["projection"]
                for R in requests:
                    q = by_r[R]["projection"]
                    out.append({**by_r[R], "ratio_to_1": {
                        "step": q["step_ms"] / one["step_ms"],
                        "per_request_tokens_per_s": q["tokens_per_s"] / one["tokens_per_s"],
                        "aggregate_tokens_per_s": q["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"]}})
    return out


def requests_table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    names = ("budget", "context", "routing", "R", "rows", "experts/layer", "step ms", "tok/s a request",
             "aggregate tok/s", "x R=1", "dominant terms (ms)")
    for name in names:
        table.add_column(name, justify="left" if name.startswith(("routing", "dominant")) else "right")
    for r in rows:
        p, x = r["projection"], r["ratio_to_1"]
        routing = r["routing"] if r["reuse"] is None else f"tree p={r['reuse']:g}"
        dominant = ", ".join(f"{k} {p['split_ms'][k]:.2f}" for k in p["dominant"][:2])
        table.add_row(str(r["budget"]), str(r["context"]), routing, str(r["requests"]), str(r["union_rows"]),
                      f"{r['distinct_experts']['mean']:.1f}", f"{p['step_ms']:.2f}", f"{p['tokens_per_s']:.1f}", f"{p['aggregate_tokens_per_s']:.1f}",
                      f"{x['aggregate_tokens_per_s']:.2f}", dominant)
    return table
