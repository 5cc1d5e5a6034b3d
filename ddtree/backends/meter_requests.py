"""The meter (backends/meter.py) over several requests at once: the union verify's dims and the DDTree step of Rq
requests (description/stack.py ddtree_step_requests).

    recs = meter_step_requests(cfg, dcfg, plan, specs, rank=0, requests=[(4096, 8), (1024, 16)])   # (T_i, B_i)
    recs = meter_union_verify(cfg, plan, specs, rank=0, requests=[(4096, 9), (4096, 9)])          # (T_i, nodes q_i)
"""
from __future__ import annotations

from ddtree.backends.meter import NO_CACHES, MeterOps, MeterRun, Record
from ddtree.description import layers, stack
from ddtree.description.opset import RankLayout


def request_dims(requests) -> dict:
    """The dims of a union verify over requests [(cache length T_i, rows q_i)]: "requests", and each request's
    tree mask's "q.<i>" / "W.<i>" (description/layers.py decoder_layer(requests=Rq))."""
    dims = {"requests": [(int(T), int(q)) for T, q in requests]}
    for i, (_, q) in enumerate(requests):
        dims.update({f"q.{i}": q, f"W.{i}": -(-q // 32)})
    return dims


class MeterRequestsRun(MeterRun):
    """MeterRun for description/stack.py ddtree_step_requests: `requests` [(context T_i, budget B_i)]; the request
    a per-request call belongs to comes in its feeds (meter_step_requests feeds the request's index as the
    drafter's ctx_taps and as the head's h), so the drafter reads its own context and the head, walk and
    compaction see its own nodes; the union calls (embed, decoder layers) see every request's nodes."""

    def __init__(self, ops: MeterOps, block: int, requests: list):
        super().__init__(ops, block, sum(B + 1 for _, B in requests))
        self.requests, self.union = requests, self.nodes

    def __call__(self, kind: str, fn, args: tuple, feeds: dict, layer: int | None = None) -> dict:
        if kind in ("draft_fc", "head"):
            T, B = self.requests[feeds["ctx_taps" if kind == "draft_fc" else "h"]]
            self.ops.dims.update({"T_draft": T, "nodes": B + 1})
            self.nodes = B + 1
        elif kind == "embed":
            self.nodes = self.union
        return super().__call__(kind, fn, args, feeds, layer)


def meter_step_requests(cfg, dcfg, plan: dict, specs: dict, rank: int = 0, requests=((4096, 16),),
                        new_context: int | None = None, **kw) -> list[Record]:
    """One DDTree step of len(requests) requests on rank `rank` (description/stack.py ddtree_step_requests):
    requests [(context T_i, budget B_i)]; each request's drafter (new_context accepted tokens as its new context,
    default the block size), tree, head, walk and compaction (as many rows) are its own, the target verifies the
    union of the trees in one forward whose attention reads each request's own prefix."""
    lay = RankLayout.from_plan(plan, rank)
    b, n = dcfg.block_size, dcfg.block_size if new_context is None else new_context
    k = layers.draft_topk([B for _, B in requests], lay.vocab_stop - lay.vocab_start)
    dims = {"q": b, "n": n, "T": max(T for T, _ in requests), "S": max(T + B + 1 for T, B in requests), "W": max(-(-(B + 1) // 32) for _, B in requests),
            "accepted": n, "L": cfg.num_hidden_layers, **request_dims([(T, B + 1) for T, B in requests])}
    ops = MeterOps(lay, specs, dims, **kw)
    per = [stack.StepFeeds({"ctx_taps": i, "ids": None, "pos": None, "cache_len": None}, None,
                           verify=lambda tree: {}, head=lambda verify: {}, compact=lambda walk: {})
           for i in range(len(requests))]
    union = ("ids", "pos", "cache_len", *stack.mask_feeds(len(requests)))
    feeds = stack.RequestStepFeeds(per, union=lambda verifies: dict.fromkeys(union), rows=lambda h, i: i)
    run = MeterRequestsRun(ops, b, list(requests))
    stack.ddtree_step_requests(run, cfg, dcfg, plan["per_rank"]["moe_intermediate"], k, [B for _, B in requests],
                               feeds, [stack.InPlace(lambda L: {"cache": None}, stacked=lambda: {"cache": None})]
                               * len(requests),                   # each request's layers compacted in one call
                               [NO_CACHES] * len(requests))
    return ops.records


def meter_union_verify(cfg, plan: dict, specs: dict, rank: int = 0, requests=((4096, 9),), **kw) -> list[Record]:
    """The target verify of len(requests) requests' trees in one forward on rank `rank`, with the logits over the
    union rows (description/stack.py target_forward(requests=Rq), head layers.head_logits: lm_head read once):
    requests [(cache length T_i, tree nodes q_i)]. One request: today's verify (target_forward's one-request
    layers). kw: MeterOps' (routing="given", distinct=[...] per MoE layer over the union rows)."""
    lay, Rq = RankLayout.from_plan(plan, rank), len(requests)
    q = sum(n for _, n in requests)
    dims = {"q": q, "nodes": q, "T": max(T for T, _ in requests), "S": max(T + n for T, n in requests),
            "W": max(-(-n // 32) for _, n in requests), **(request_dims(requests) if Rq > 1 else {})}
    ops = MeterOps(lay, specs, dims, **kw)
    caches = NO_CACHES if Rq == 1 else stack.RequestCaches([stack.InPlace(lambda L: {"cache": None})] * Rq)
    stack.target_forward(MeterRun(ops, q, q), cfg, plan["per_rank"]["moe_intermediate"],
                         dict.fromkeys(("ids", "pos", "cache_len", *stack.mask_feeds(Rq))), caches,
                         head=(layers.head_logits, ()), requests=Rq)
    return ops.records
