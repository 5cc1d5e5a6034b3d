"""`ddtree bench step --requests 1,2,4` (issue 51): the target verify of R requests' trees in ONE forward, captured.

    verify = UnionVerify(rank, caches[:R], context, budget)   # R stated trees, each after its own `context` rows
    logits = verify.eager()                                    # union_layers + head_logits, launched one by one
    graph = verify.capture()                                   # the same launches as one CUDA graph
    row = request_row(...)                                     # us, rows, distinct experts, % of roofline

What is timed: runtime/cuda_model.py union_layers (embed + every decoder layer over the union rows; each request's
append and tree attention on its own GpuTargetCache, backends/cuda_requests.py) then head_logits over the union
rows (lm_head read once), for the rank's generated weights (bench/synthetic_rank.py). No drafter, tree, sampling,
walk or compaction: "verify_us" is that forward alone. R = 1 is today's one-request verify (the fused append).
Each request's tree is the budget's stated tree (bench/project.py DraftProfile: budget + 1 nodes), its tokens
random, its positions context + depth; the routing is given over the union rows (each request's ids from
bench/routing.py with its own seed) or the router's own (`router`).

Capture: the union verify launches one append and one attention per request on that request's rows, so the row
offsets must be on the host when the launches are recorded. They are fixed per graph (R and the budget fix
them), so the feeds are device buffers that carry their host copies (cuda_tensor.Tensor.host): the capture binds
them without an upload and the spans come from the host copy. Nothing in the backend changes; the device data
(tokens, positions, cache rows, lengths, routing ids) may change between replays.
"""
from __future__ import annotations

import statistics

import click
import numpy as np

from ddtree.backends import numpy_math
from ddtree.backends.cuda_tensor import Tensor
from ddtree.backends.meter import totals
from ddtree.backends.meter_requests import meter_union_verify
from ddtree.bench.project import DraftProfile, depth_histogram
from ddtree.bench.project_requests import check_rows
from ddtree.bench.routing import distinct_per_layer, union_routing
from ddtree.bench.step_rows import write_routing
from ddtree.bench.synthetic_rank import SyntheticRank
from ddtree.description import layers
from ddtree.plugins import randfill as rf
from ddtree.plugins.device import DeviceArray, _driver, check
from ddtree.plugins.prefetch import chunks
from ddtree.runtime.cuda_executor import WORKSPACE_BYTES
from ddtree.runtime.cuda_model import cache_bytes, new_target_cache, target_layers, union_layers
from ddtree.tree.build import Tree, pack_visibility


def check_requests(requests: list[int], contexts: list[int], budgets: list[int], cfg, with_ar: bool, ranks: str,
                   modes: list[str]) -> None:
    """The refusals of --requests that need no GPU: what it does not measure, and rows or positions past limits."""
    for flag, given in (("--ar", with_ar), ("--ranks all", ranks == "all"), ("--collectives", modes != ["copy"])):
        if given:
            raise click.BadParameter(f"--requests times the union verify alone on one rank with copy stand-ins; "
                                     f"{flag} is not measured with it", param_hint="--requests")
    check_rows(requests, budgets)
    end = max(contexts) + max(budgets) + 1
    if end > cfg.max_position_embeddings:
        raise click.BadParameter(f"context {max(contexts)} + budget {max(budgets)} + 1 = {end} positions exceed the "
                                 f"model's {cfg.max_position_embeddings}", param_hint="--context")


def cache_rows(contexts: list[int], budgets: list[int]) -> int:
    """Rows of each request's target cache: the longest context and the largest tree after it."""
    return max(contexts) + max(budgets) + 1


def memory_plan(cfg, dcfg, plan, weights: int, requests: int, rows: int) -> dict:
    """Device bytes by part for `requests` target caches of `rows` rows (the rank's own among them), the rank's
    drafter cache (SyntheticRank allocates one) and the generated weights."""
    caches = cache_bytes(cfg, dcfg, plan.tp, rows)
    return {"weights": weights, "target caches": requests * caches["target"], "drafter cache": caches["drafter"],
            "workspaces": WORKSPACE_BYTES + rows * (cfg.qk_rope_head_dim + dcfg.head_dim) * 4}


def check_memory(plan: dict, free: int, device: str, requests: int, rows: int) -> None:
    """Refuse before anything is allocated when the plan does not fit the device's free bytes."""
    need = sum(plan.values())
    if need > free:
        parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in plan.items())
        raise click.ClickException(f"--requests {requests}: {requests} target caches of {rows} rows (--context + "
                                   f"--budget + 1) and the rank need {need / 2**30:.2f} GiB ({parts}) but {device} "
                                   f"has {free / 2**30:.2f} GiB free: ask for fewer requests or a shorter context")


def stated_tree(budget: int, block: int):
    return DraftProfile().tree(budget, block - 1)


def union_feeds(parents_list: list, context: int, vocab: int, seed: int = 0) -> dict:
    """The union verify's host feeds for trees parents_list (each [q_i], root first) each after `context` cached
    rows: ids [q] random tokens (request i's drawn with seed + i), pos [q] context + depth, cache_len [R], and with
    R > 1 row_offsets [R + 1] and tree_mask.<i> [q_i, ceil(q_i / 32)] (one request: tree_mask, today's verify)."""
    trees = [Tree.from_parents(p) for p in parents_list]
    ids = [np.random.default_rng(seed + i).integers(0, vocab, t.size) for i, t in enumerate(trees)]   # seed + i
    return numpy_math.union_feeds(ids, [t.positions(context) for t in trees], [context] * len(trees),
                                  [pack_visibility(t.visible()).view(np.int32) for t in trees])


class UnionVerify:
    """R requests' trees verified in one forward on `rank` (a SyntheticRank): device feeds with host copies."""

    def __init__(self, rank, caches: list, context: int, budget: int, seed: int = 0):
        self.rank, self.caches, self.context, self.budget = rank, caches, context, budget
        self.tree = stated_tree(budget, rank.drafter_config.block_size)
        vocab = rank.config.vocab_size
        host = union_feeds([self.tree.parents] * len(caches), context, vocab, seed)
        self.feeds = {k: Tensor.of(rank.gpu.upload(v), host=v) for k, v in host.items()}
        self.rows = len(host["ids"])
        self.logits = None                               # [rows, V] float32 on the device, after a run

    def body(self) -> None:
        if len(self.caches) == 1:                        # one request: today's verify (target_forward's own layers)
            h = target_layers(self.rank, self.feeds, self.caches[0])
        else:
            h = union_layers(self.rank, self.feeds, self.caches)
        self.logits = self.rank.ops.call(layers.head_logits, self.rank.config, feeds={"h": h})["logits"]

    def eager(self) -> np.ndarray:
        """The forward launched op by op (uncaptured), with the plans a graph uses -> logits [rows, V] on the host."""
        ops = self.rank.ops
        ops.graph_plans = True
        try:
            self.body()
            self.rank.gpu.sync()
        finally:
            ops.graph_plans = False
        return self.read_logits()

    def capture(self):
        """The same launches recorded into an executable graph (run eager() once first: arenas and launchers)."""
        return self.rank.ops.capture_graph(self.body)

    def read_logits(self) -> np.ndarray:
        t = self.logits
        return DeviceArray(self.rank.gpu, t.ptr, t.shape, t.dtype).numpy()


UNION_MARGIN = 512 << 20       # what the union's larger row counts may add to the workspaces the first forward took


def check_extra_caches(rank, context: int, budget: int, requests: int, cache_bytes: int) -> None:
    """The launchers allocate their workspaces at their first call (one set per layer: more than memory_plan's
    stated allowance; an H100 ran out at 4 requests with the plan's 5.5 GiB to spare): run one request's verify
    eagerly first, then refuse, before allocating them, the other requests' caches if they do not fit what is free."""
    rank.fill_caches(context)
    rank.ops.attention_context = context
    UnionVerify(rank, [rank.target_cache], context, budget).eager()
    free, _ = check(_driver().cuMemGetInfo(), "cuMemGetInfo")
    need = (requests - 1) * cache_bytes + UNION_MARGIN
    if need > free:
        raise click.ClickException(f"--requests {requests}: after the rank and its workspaces {rank.gpu.name} has "
                                   f"{free / 2**30:.2f} GiB free; {requests - 1} more target caches of "
                                   f"{cache_bytes / 2**30:.2f} GiB and {UNION_MARGIN >> 20} MiB for the union's rows "
                                   f"need {need / 2**30:.2f} GiB: ask for fewer requests or a shorter context")


def request_caches(rank, requests: int, seed: int = 1) -> list:
    """The rank's target cache and requests - 1 more of its capacity, each filled with its own random rows."""
    cfg, gpu = rank.config, rank.gpu
    caches = [rank.target_cache]
    for i in range(1, requests):
        c = new_target_cache(gpu, cfg, rank.target_cache.capacity)
        rf.fill_device(gpu, c.dev.buf, seed + 7919 * i, rf.ACT_BF16)
        caches.append(c)
    return caches


def set_routing(rank, verify: UnionVerify, routing: str, reuse: float | None) -> dict | None:
    """The given routing over the union rows (None: the router's own) -> the distinct experts of the rank's that
    each MoE layer's union rows touch ({"mean", "min", "max", "per_layer", "source"}), or None."""
    if routing == "router":
        rank.ops.routing = None
        return None
    ids = union_routing(rank.config, [verify.tree.parents] * len(verify.caches), routing, reuse)
    write_routing(rank, ids)
    d = distinct_per_layer(ids, (rank.lay.expert_start, rank.lay.expert_stop))
    return {"mean": float(d.mean()), "min": int(d.min()), "max": int(d.max()), "per_layer": d.tolist(),
            "source": f"{routing} ids for each request's stated tree (depths {depth_histogram(verify.tree)}), "
                      f"reuse {reuse}, request i seed i, over the union rows"}


def time_verify(rank, caches: list, context: int, budget: int, routing: str, reuse: float | None,
                repeats: int) -> tuple[float, dict | None]:
    """One row on the GPU: the union verify of len(caches) requests run eagerly, captured, replayed `repeats` times
    -> (median us of the replays, distinct experts or None)."""
    rank.ops.attention_context = context                 # every request's cache holds `context` rows
    verify = UnionVerify(rank, caches, context, budget)
    distinct = set_routing(rank, verify, routing, reuse)
    if not np.isfinite(verify.eager()).all():
        raise click.ClickException(f"context {context}, budget {budget}, {len(caches)} requests: the union verify's "
                                   "logits are not finite (the synthetic weights' scales let activations overflow)")
    graph = verify.capture()
    gpu = rank.gpu
    gpu.replay(graph)                                    # a warm replay, then the timed ones
    return 1e3 * statistics.median(gpu.timed_ms(lambda: gpu.replay(graph), repeats)), distinct


def request_row(cfg, plan: dict, specs: dict, rank_id: int, context: int, budget: int, block: int, requests: int,
                routing: str, reuse: float | None, verify_us: float, distinct: dict | None,
                ceiling_gbps: float) -> dict:
    """One JSON row from a measured verify (verify_us) and the meter's union verify over the same rows (its bytes
    over the copy ceiling: the roofline; the given routing's distinct experts per layer, else the uniform
    expectation over the union rows)."""
    n = stated_tree(budget, block).size
    kw = {} if distinct is None else {"routing": "given", "distinct": distinct["per_layer"]}
    recs = meter_union_verify(cfg, plan, specs, rank_id, [(context, n)] * requests, **kw)
    t = totals(recs)
    nbytes = t["read"] + t["written"]
    ideal_us = nbytes / (ceiling_gbps * 1e3)
    return {"context": context, "budget": budget, "requests": requests, "rows": requests * n,
            "routing": "router (random weights)" if routing == "router" else routing, "reuse": reuse,
            "verify_us": verify_us, "bytes": nbytes, "weight_bytes": sum(r.weight_read for r in recs),
            "ideal_us": ideal_us, "pct_roofline": 100 * ideal_us / verify_us, "kernels": t["kernels"],
            "distinct_experts": distinct}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's verify_us over the R = 1 row of its context, budget and routing (None without one)."""
    def key(r):
        return r["context"], r["budget"], r["routing"], r["reuse"]
    one = {key(r): r["verify_us"] for r in rows if r["requests"] == 1}
    return [{**r, "ratio_to_1": r["verify_us"] / one[key(r)] if key(r) in one else None} for r in rows]


def run_requests(rank, caches: list, requests: list[int], contexts: list[int], budgets: list[int], cases: list,
                 repeats: int, ceiling_gbps: float, timer=time_verify) -> list[dict]:
    """Every (context, budget, routing, R) row: the first R of `caches` at the context, the union verify timed by
    timer(rank, caches[:R], context, budget, routing, reuse, repeats) -> (us, distinct)."""
    rows = []
    for context in contexts:
        rank.fill_caches(context)
        for budget in budgets:
            for routing, reuse in cases:
                for R in requests:
                    us, distinct = timer(rank, caches[:R], context, budget, routing, reuse, repeats)
                    row = request_row(rank.config, rank.plan_dict, rank.specs, rank.lay.rank, context, budget,
                                      rank.drafter_config.block_size, R, routing, reuse, us, distinct, ceiling_gbps)
                    rows.append(row)
                    click.echo(f"context {context}, budget {budget}, {routing}, {R} request(s): verify {us:.0f} us, "
                               f"{row['rows']} rows, {row['pct_roofline']:.0f} % of the copy roofline", err=True)
    return with_ratios(rows)


def bench_requests(gpu, preset: str, cfg, dcfg, plan, rank_id: int, requests: list[int], contexts: list[int],
                   budgets: list[int], cases: list, repeats: int, ceiling_gbps: float, weights: int,
                   ops_options) -> dict:
    """The --requests run: the memory plan checked against the GPU's free bytes before anything is allocated, the
    rank and max(requests) caches, every row; -> the JSON object. ops_options(ops): bench step's backend flags."""
    rows = cache_rows(contexts, budgets)
    mem = memory_plan(cfg, dcfg, plan, weights, max(requests), rows)
    free, _ = check(_driver().cuMemGetInfo(), "cuMemGetInfo")
    check_memory(mem, int(free), gpu.name, max(requests), rows)
    rank = SyntheticRank(gpu, cfg, dcfg, plan, rank_id, rows)
    ops_options(rank.ops)
    check_extra_caches(rank, contexts[0], budgets[0], max(requests), mem["target caches"] // max(requests))
    caches = request_caches(rank, max(requests))
    out = run_requests(rank, caches, requests, contexts, budgets, cases, repeats, ceiling_gbps)
    return {"bench": "step_requests", "device": gpu.name, "preset": preset, "layers": cfg.num_hidden_layers,
            "tp": plan.tp, "rank": rank_id, "requests": requests, "copy_ceiling_gbps": ceiling_gbps,
            "weights_bytes": weights, "memory_plan": mem, "free_bytes_before": int(free), "cache_rows": rows,
            "branches": rank.ops.branches, "prefetch_bytes": rank.ops.prefetch_bytes,
            "prefetch_chunk": chunks(rank.ops.prefetch_chunk),
            "shared_join": rank.ops.shared_join, "shared_fork": rank.ops.shared_fork,
            "prefetch_next": rank.ops.prefetch_next,
            "prefetch_next_beside": rank.ops.prefetch_next_beside, "chain_norms": rank.ops.chain_norms,
            "rows": out,
            "notes": {
                "verify_us": "the target forward of the union rows only (embed, every decoder layer, head_logits "
                             "over the union rows): no drafter, tree, sampling, walk or compaction; one CUDA graph "
                             "per (R, budget), median of --repeats replays after a warm one",
                "requests": "R requests, each its own target cache of --context random rows and the budget's stated "
                            "tree (DraftProfile, budget + 1 nodes, random tokens); R = 1 is the one-request verify",
                "routing": "uniform/tree: bench/routing.py ids per request (seed i) over the union rows, used after "
                           "the router ran; router: the router's own choice (distinct experts unknown)",
                "bytes": "backends/meter_requests.py meter_union_verify over the same rows (the given routing's "
                         "distinct experts per layer, else the uniform expectation); ideal_us = bytes / copy ceiling",
                "ratio_to_1": "verify_us / the R = 1 row's at the same context, budget and routing",
                "accept": "--accept does not apply: a verify commits nothing"}}
