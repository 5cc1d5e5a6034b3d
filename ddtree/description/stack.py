"""The whole model, written once over the layer functions (description/layers.py): every executor runs these.

    outs = target_forward(run, cfg, inter, feeds, caches, taps=(1, 2), on_tap=keep_tap)   # embed, layers, head
    outs = drafter_forward(run, cfg, dcfg, feeds, caches, block=b)                        # fc, embed, layers, head
    compact(run, cfg, feeds, caches)                                                       # every layer's cache
    records = ddtree_step(run, cfg, dcfg, inter, k, budget, StepFeeds(...))                # the step, op set only
    walks = ddtree_step_requests(run, cfg, dcfg, inter, k, budgets, RequestStepFeeds(...))   # Rq requests' step

`run(kind, fn, args, feeds, layer)` is how an executor runs one layer function: the numpy ranks call
fn(ops, *args) on every rank (runtime/engine_executor.py), the ONNX runner runs the exported graph `kind` with
layer `layer`'s weights (runtime/graph_ranks.py), the meter counts bytes (backends/meter.py), the cuda backend
launches the kernels with arena `layer % 2` (runtime/cuda_executor.py, cuda_step.py, cuda_step_tp.py). The values
that flow between calls are the executor's own (arrays, per-rank lists, device tensors): this module only wires
outputs to inputs. `caches` says where layer L's cache tensors are (`feeds(L)`) and takes a layer's outputs back
(`keep(L, outs)`: a no-op where the backend updates caches in place).

Kinds (the engine's graph kinds, and the meter's labels): embed / draft_embed, dense_layer / moe_layer,
draft_layer (or draft_layer_full / draft_layer_sliding), head, draft_fc, draft_head, tree_b<B>, accept, compact.

The DDTree step over the op set (docs/ddtree.md 2.6), the order every executor follows:
    draft        drafter_forward over the block [bonus, MASK x (b-1)] and the new context taps -> candidates
    tree         the candidates (all-gathered) -> best-first tree of `budget` nodes
    verify       target_forward over the tree's nodes (ancestor mask), taps at the drafter's tap layers -> the
                 ranks' sampling winners at every node
    sample_walk  accept: the winners (all-gathered) -> the target token at every node, the walk
    update       compact every layer's cache to the accepted path (the context window and the commit are the
                 executor's: host arrays, or device buffers inside a CUDA graph)
The GPU step at tp 1 fuses tree + top-k and sampling + walk into kernels of their own (plugins/tree_build.py,
tree_sample.py) and runs draft / verify / update through the functions here; the loop's composition over
executor primitives (runtime/loop.py) is the same phases with the sampling and the walk on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from ddtree.description import layers

PHASES = ("draft", "tree", "verify", "sample_walk", "update")


class Run(Protocol):
    def __call__(self, kind: str, fn: Callable, args: tuple, feeds: dict, layer: int | None = None) -> dict: ...


class LayerCaches(Protocol):
    def feeds(self, layer: int) -> dict: ...                     # {"cache": c} or {"cache_k": k, "cache_v": v}
    def keep(self, layer: int, outs: dict) -> None: ...          # the layer's *_out caches (or nothing: in place)


class RequestCaches:
    """The union verify's caches: request i's LayerCaches fed as cache.<i> and kept from cache_out.<i>
    (layers.decoder_layer with requests=len(caches))."""

    def __init__(self, caches: list):
        self.caches = caches

    def feeds(self, layer: int) -> dict:
        return {f"cache.{i}": c.feeds(layer)["cache"] for i, c in enumerate(self.caches)}

    def keep(self, layer: int, outs: dict) -> None:
        for i, c in enumerate(self.caches):
            c.keep(layer, {"cache_out": outs[f"cache_out.{i}"]})


class InPlace:
    """Caches a backend updates in place: layer L's feeds from `feeds_of(L)`, nothing to keep. stacked: where every
    layer's cache is one buffer, the feeds of all of them as one [L, S, W] tensor (compact then runs once), or None."""

    def __init__(self, feeds_of: Callable[[int], dict], stacked: Callable[[], dict] | None = None):
        self.feeds, self.stacked = feeds_of, stacked

    def keep(self, layer: int, outs: dict) -> None:
        pass


def decoder_kind(cfg, layer: int) -> str:
    return "moe_layer" if cfg.is_moe_layer(layer) else "dense_layer"


def draft_kinds(dcfg) -> dict[int, str]:
    """drafter layer -> its kind (one kind, or full / sliding when the drafter mixes both)."""
    return {L: kind for kind, group in layers.drafter_groups(dcfg).items() for L in group}


@dataclass
class Pruning:
    """A pruned verify (issue 53, tree/prune.py): every MoE layer routes the live rows only, and the decoder layers
    `at` (MoE layers) run tree_prune after their routing; later layers read the mask it leaves in feeds["live"]."""
    at: frozenset                                # decoder layers that prune
    feeds: dict                                  # live [q] I32 (root live), parents [q] I32, path_prob [q] F32,
                                                 # prune_rate [1] F32, expert_bytes [1] I32 (the executor's values)
    on_route: Callable | None = None             # on_route(L, routed_ids, live it routed with) after MoE layer L

    def layer(self, cfg, L: int) -> tuple[str | None, dict]:
        """Decoder layer L's prune mode (layers.decoder_layer) and the feeds it reads."""
        if not cfg.is_moe_layer(L):
            return None, {}
        if L in self.at:
            return "prune", self.feeds
        return "route", {"live": self.feeds["live"]}

    def routed(self, L: int, outs: dict) -> None:
        if self.on_route is not None:
            self.on_route(L, outs["routed_ids"], self.feeds["live"])
        if "live_out" in outs:
            self.feeds = {**self.feeds, "live": outs["live_out"]}


def prune_layers(cfg, every: int) -> frozenset:
    """The decoder layers that prune: MoE layers 0, every, 2 every, ... (counted among the MoE layers)."""
    if every < 1:
        raise ValueError(f"prune_layers: every must be >= 1, got {every}")
    return frozenset(L for j, L in enumerate(cfg.moe_layers) if j % every == 0)


def mask_feeds(requests: int = 1) -> tuple:
    """The feeds that say which rows a verify row sees: tree_mask for one request; for Rq > 1 the union's
    row_offsets [Rq + 1] and each request's tree_mask.<i> (layers.decoder_layer's inputs)."""
    return ("tree_mask",) if requests == 1 else ("row_offsets", *(f"tree_mask.{i}" for i in range(requests)))


def target_forward(run: Run, cfg, moe_inter: int, feeds: dict, caches: LayerCaches, taps=(), on_tap=None,
                   head=(layers.head, ()), head_feeds: dict | None = None, requests: int = 1,
                   prune: Pruning | None = None, chain_norms: bool = False) -> dict:
    """feeds: ids [q], pos [q], cache_len [1], tree_mask [q, W] -> the head's outputs ({"h": h [q, H]} with
    head None). on_tap(L, h) after each layer L in taps. head: (layer function, its arguments after cfg).
    requests Rq > 1: the union verify, one forward over Rq requests' rows: feeds hold row_offsets [Rq + 1] and
    each request's tree_mask.<i> [q_i, W_i] instead of tree_mask, cache_len is [Rq], caches a RequestCaches (the
    head and the taps are row-wise: the union's rows). prune: a pruned verify of one request (its final mask in
    prune.feeds["live"]); None runs today's layers, op for op. chain_norms: each layer's residual add fused with the
    next layer's input norm (layers.decoder_layer; x_out fed on as x): an executor that runs one call per layer with
    that layer's own names (not the ONNX kinds, whose one graph serves several layers)."""
    if prune is not None and requests > 1:
        raise ValueError("target_forward: a pruned verify is one request's (requests = 1)")
    h = run("embed", layers.embed, (cfg,), {"ids": feeds["ids"]})["h"]
    step = {k: feeds[k] for k in ("pos", "cache_len", *mask_feeds(requests))}
    layer_args = (moe_inter, requests) if requests > 1 else (moe_inter,)          # one request: today's layer call
    x = {}                                                                         # chain_norms: {"x": x} past 0
    for L in range(cfg.num_hidden_layers):
        mode, extra = prune.layer(cfg, L) if prune is not None else (None, {})
        if chain_norms:
            args = (cfg, L, moe_inter, requests, mode, True)
        else:
            args = (cfg, L, *layer_args) if mode is None else (cfg, L, moe_inter, 1, mode)
        outs = run(decoder_kind(cfg, L), layers.decoder_layer, args,
                   {**step, **extra, "h": h, **x, **caches.feeds(L)}, L)
        if mode is not None:
            prune.routed(L, outs)
        caches.keep(L, outs)
        h, x = outs["h_out"], ({"x": outs["x_out"]} if "x_out" in outs else {})
        if on_tap is not None and L in taps:
            on_tap(L, h)
    if head is None:
        return {"h": h}
    fn, args = head
    return run("head", fn, (cfg, *args), {"h": h, **(head_feeds or {})})


def drafter_forward(run: Run, cfg, dcfg, feeds: dict, caches: LayerCaches, block: int | None = None,
                    head=(layers.draft_logits, ())) -> dict:
    """feeds: ctx_taps [n, K H], ids [b], pos [b], cache_len [1] -> the drafter head's outputs ({"h": h [b, H]}
    with head None). The block's embedding is the target's. head: (layer function, its arguments between dcfg
    and the block size)."""
    ctx = run("draft_fc", layers.draft_fc, (dcfg,), {"ctx_taps": feeds["ctx_taps"]})["ctx"]
    h = run("draft_embed", layers.embed, (cfg,), {"ids": feeds["ids"]})["h"]
    step = {"pos": feeds["pos"], "cache_len": feeds["cache_len"]}
    for L, kind in sorted(draft_kinds(dcfg).items()):
        outs = run(kind, layers.draft_layer, (dcfg, L, block), {**step, "h": h, "ctx": ctx, **caches.feeds(L)}, L)
        caches.keep(L, outs)
        h = outs["h_out"]
    if head is None:
        return {"h": h}
    fn, args = head
    return run("draft_head", fn, (dcfg, *args, block), {"h": h})


def compact(run: Run, cfg, feeds: dict, caches: LayerCaches) -> None:
    """feeds: cache_len [1] (the rows before the verify), accepted [nodes], accepted_count [1] -> every layer's
    cache holds the accepted rows at cache_len... Caches stacked in one buffer are compacted by one call (one
    launch instead of a layer's each: issue 48), others layer by layer."""
    stacked = getattr(caches, "stacked", None)
    if stacked is not None:
        run("compact", layers.compact, (cfg, True), {**feeds, **stacked()})
        return
    for L in range(cfg.num_hidden_layers):
        caches.keep(L, run("compact", layers.compact, (cfg,), {**feeds, **caches.feeds(L)}))


@dataclass
class StepFeeds:
    """What a DDTree step over the op set reads besides the caches; `verify(tree)` and `head` wire the tree's
    outputs into the verify (positions start + depth, the ancestor mask) as the executor computes them."""
    draft: dict                                  # ctx_taps, ids (the block), pos, cache_len (the drafter's)
    root: object                                 # [1] the bonus token
    verify: Callable[[dict], dict]               # tree outputs -> ids, pos, cache_len, tree_mask
    head: Callable[[dict], dict]                 # verify feeds -> sample_pos, temperature, seed
    compact: Callable[[dict], dict]              # accept outputs -> cache_len, accepted, accepted_count


def ddtree_step(run: Run, cfg, dcfg, moe_inter: int, k: int, budget: int, feeds: StepFeeds,
                target_caches: LayerCaches, draft_caches: LayerCaches, taps=(), on_tap=None) -> dict:
    """One DDTree step of one rank, every phase over the op set (PHASES) -> the accept outputs (target_tokens,
    accepted, accepted_count, bonus)."""
    cands = drafter_forward(run, cfg, dcfg, feeds.draft, draft_caches, head=(layers.draft_head, (k,)))
    tree = run(f"tree_b{budget}", layers.tree, (dcfg, k, budget),
               {"root": feeds.root, **{n: cands[n] for n in ("topk_values", "topk_ids", "row_max", "row_sumexp")}})
    verify = feeds.verify(tree)
    win = target_forward(run, cfg, moe_inter, verify, target_caches, taps, on_tap, head_feeds=feeds.head(verify))
    walk = run("accept", layers.accept, (), {"tokens": tree["tokens"], "parents": tree["parents"],
                                            "win_value": win["win_value"], "win_id": win["win_id"]})
    compact(run, cfg, feeds.compact(walk), target_caches)
    return walk


@dataclass
class RequestStepFeeds:
    """What a DDTree step over Rq requests reads besides the caches: each request's StepFeeds (its draft, root,
    head and compact feeds, its verify(tree) as alone), and how the executor joins and splits the union rows."""
    requests: list                               # [StepFeeds] one per request
    union: Callable[[list], dict]                # the requests' verify feeds -> the union's: ids, pos, cache_len [Rq],
                                                 # row_offsets [Rq + 1], tree_mask.<i> (request i's tree_mask)
    rows: Callable[[object, int], object]        # a union value [q, ...] -> request i's rows


def ddtree_step_requests(run: Run, cfg, dcfg, moe_inter: int, k: int, budgets: list, feeds: RequestStepFeeds,
                         target_caches: list, draft_caches: list, taps=(), on_tap=None) -> list:
    """One DDTree step of Rq requests on one rank -> each request's accept outputs (ddtree_step's). Each request
    drafts and builds its tree on its own (its own drafter call, budget and drafter cache), the target verifies
    the Rq trees in ONE forward over the union rows (each request's rows see only its own cache: target_forward
    with requests=Rq), then each request samples (its own temperature and seed: the head runs per request on its
    rows, so lm_head is read Rq times), walks and compacts its own cache. on_tap(L, h) gets the union rows."""
    trees, verifies = [], []
    for f, B, dcache in zip(feeds.requests, budgets, draft_caches):
        cands = drafter_forward(run, cfg, dcfg, f.draft, dcache, head=(layers.draft_head, (k,)))
        trees.append(run(f"tree_b{B}", layers.tree, (dcfg, k, B), {"root": f.root, **{
            n: cands[n] for n in ("topk_values", "topk_ids", "row_max", "row_sumexp")}}))
        verifies.append(f.verify(trees[-1]))
    h = target_forward(run, cfg, moe_inter, feeds.union(verifies), RequestCaches(target_caches), taps, on_tap,
                       head=None, requests=len(target_caches))["h"]
    walks = []
    for i, (f, tree, verify, cache) in enumerate(zip(feeds.requests, trees, verifies, target_caches)):
        win = run("head", layers.head, (cfg,), {"h": feeds.rows(h, i), **f.head(verify)})
        walks.append(run("accept", layers.accept, (), {"tokens": tree["tokens"], "parents": tree["parents"],
                                                       "win_value": win["win_value"], "win_id": win["win_id"]}))
        compact(run, cfg, f.compact(walks[-1]), cache)
    return walks


def ar_step(run: Run, cfg, moe_inter: int, feeds: dict, caches: LayerCaches, head_feeds: dict) -> dict:
    """One autoregressive step of one rank over the op set: the target over the bonus token, and the head's
    sampling winner at the next position (the executor's walk over one node turns winners into the token)."""
    return target_forward(run, cfg, moe_inter, feeds, caches, head_feeds=head_feeds)
