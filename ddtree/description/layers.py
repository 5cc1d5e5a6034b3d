"""The per-rank model, written once: each layer kind is one function over the op set (description/opset.py).

Every executor runs these functions through a backend: numpy (CPU ranks), onnx (the engine's graphs
and TensorRT-RTX plans), meter (bytes, FLOPs, collectives), cuda (one GPU), torch (training's target
forward and its greedy generation, backends/torch_backend.py). The float64 oracle in
ddtree/reference/ is the only other copy of the target, written independently on purpose; the drafter has
one more, training/drafter_model.py, for its many-blocks-per-sequence objective (its docstring says why).

    embed        ids [q] -> this rank's rows, zeros elsewhere -> all-reduce -> h [q, H]
    decoder      h [q, H], pos [q], cache [S, R + Dr], cache_len [1], tree_mask [q, W]
                 x = RMSNorm_in(h)
                 latent, q_a = x kv_a^T, x q_a^T   (ops.linears: one GEMM where the weights sit side by side)
                 c_q = RMSNorm(q_a);  q = c_q q_b^T -> (q_nope | q_pe) [q, N_r, Dn | Dr]
                 c_kv = RMSNorm(latent[:R]), k_pe = rope(latent[R:])
                 cache <- (c_kv | k_pe) at cache_len..;  q_lat = q_nope W_UK;  q_pe = rope(q_pe)
                 o = MLA(q_lat, q_pe, cache, tree_mask) W_UV -> o_proj -> all-reduce
                 h1, x2 = h + attn, RMSNorm_post(h + attn)
                 h_out = h1 + all-reduce(dense SwiGLU slice(x2) | MoE(x2))
                 chain_norms: x [q, H] in (layer > 0), x_out = layer + 1's RMSNorm_in(h_out) out (fused with the add)
                 requests=Rq: the union verify, Rq requests' rows with caches cache.<i>, tree masks tree_mask.<i>,
                 cache_len [Rq], row_offsets [Rq + 1]: the append and the attention per request, all else on the
                 union rows
    head         h -> RMSNorm -> logits [q, V_r] (ACC) -> this rank's sampling winner per row
    draft_fc     ctx_taps [n, K H] -> this rank's fc input columns -> all-reduce -> hidden_norm -> ctx
    draft_layer  h [b, H], ctx [n, H]: q/k/v of the block and k/v of the new context (per-head norms),
                 DFlash attention (context appended to the cache), o_proj, all-reduce, SwiGLU, all-reduce
    draft_head   h [b, H] -> drafter.norm -> rows 1.. -> target lm_head slice -> logits [D, V_r] ->
                 this rank's top-k candidates and log-sum-exp parts
    compact      one layer's cache after a verify: rows T + accepted[i] -> T + i (the accepted path)
    tree         this rank's candidates -> all-gather [tp, D, k] -> best-first tree of B drafted nodes
    accept       the tree and this rank's sampling winners -> all-gather [tp, n] -> the acceptance walk
    head_logits, draft_logits   the two heads without their sampler / top-k (a backend that fuses sampling
                 with the walk and top-k with the tree build at tp 1: the GPU step, runtime/cuda_step.py)
The drafter's block embedding is the target's `embed` (the drafter has none of its own).
Tensor names are the rank files' (builder/weights.py) and the graphs' I/O names.
"""
from __future__ import annotations

from ddtree.description.opset import ACC, ACT, F32, I32, DraftAttentionSpec, MlaSpec, MoESpec, Ops

# ----------------------------------------------------------------------------------------------
# target

def embed(ops: Ops, cfg) -> None:
    ids = ops.input("ids", ["q"], I32)
    h = ops.all_reduce(ops.embed(ids, ops.weight("model.embed_tokens.weight")), "embed")
    ops.output("h", h, ["q", cfg.hidden_size], ACT)


def mla_attention(ops: Ops, cfg, a: str, x, pos, cache, cache_len, tree_mask, ahead=(), row_offsets=None) -> tuple:
    """Normed x [q, H] -> (this rank's o_proj partial [q, H], cache with the q new latent rows). ahead: the
    names of the weights read after this block (the MLP's), prefetched with o_proj's beside the attention.
    row_offsets [Rq + 1]: the rows are Rq requests' (the union verify): cache and tree_mask are then tuples of
    their caches and masks, cache_len [Rq], and only the append and the attention run per request (opset.py
    REQUEST_OPS)."""
    R, Dn, Dr, Dv, eps = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.rms_norm_eps
    q_b = ops.weight(a + "q_b_proj.weight")                                             # [N_r (Dn + Dr), Q]
    spec = MlaSpec(ops.shape(q_b)[0] // (Dn + Dr), R, Dn, Dr, Dv, float(cfg.softmax_scale))
    latent, q_a = ops.linears(x, (ops.weight(a + "kv_a_proj_with_mqa.weight"),           # [q, R + Dr] replicated
                                  ops.weight(a + "q_a_proj.weight")))                   # [q, Q]; one GEMM over x
    with ops.branch() as kv_path:                # the cache rows need only the latent: beside the query path
        if row_offsets is None:
            cache = ops.kv_append_normed(cache, cache_len, latent, ops.weight(a + "kv_a_layernorm.weight"), eps, pos,
                                         cfg.rope)                               # (c_kv normed | k_pe roped)
        else:                                                                    # the same ops, appended per request
            c_kv = ops.rms_norm(ops.slice(latent, 1, 0, R), ops.weight(a + "kv_a_layernorm.weight"), eps)
            k_pe = ops.rope(ops.reshape(ops.slice(latent, 1, R, R + Dr), [0, 1, Dr]), pos, cfg.rope)
            cache = ops.kv_append_requests(cache, cache_len, row_offsets, c_kv, ops.reshape(k_pe, [0, Dr]))
    c_q = ops.rms_norm(q_a, ops.weight(a + "q_a_layernorm.weight"), eps)
    q_all = ops.reshape(ops.linear(c_q, q_b), [0, spec.heads, Dn + Dr])                 # [q, N_r, Dn + Dr]
    kv_b = ops.weight(a + "kv_b_proj.weight")                                           # [N_r (Dn + Dv), R]
    q_lat, q_rope = ops.mla_absorb_q_rope(q_all, kv_b, pos, cfg.rope, spec)             # [q, N_r, R], [q, N_r, Dr]
    ops.join(kv_path)
    ops.prefetch(a + "o_proj.weight", *ahead)    # the attention is latency-bound: DRAM idles unless we fill L2
    if row_offsets is None:
        o_lat = ops.mla_tree_attention(q_lat, q_rope, cache, cache_len, tree_mask, spec)
    else:
        o_lat = ops.mla_tree_attention_requests(q_lat, q_rope, cache, cache_len, row_offsets, tree_mask, spec)
    o = ops.mla_absorb_out(o_lat, kv_b, spec)                                           # [q, N_r Dv]
    return ops.linear(o, ops.weight(a + "o_proj.weight")), cache                        # [q, H] partial


def moe(ops: Ops, cfg, m: str, x, inter: int, live=None):
    """Normed x [q, H] -> this rank's partial [q, H] of routed + shared experts. live [q] I32 (pruning): dead rows
    route to no expert, and the result is (partial, routed ids [q, topk] I32)."""
    lay = ops.lay
    spec = MoESpec(cfg.hidden_size, inter, lay.expert_stop - lay.expert_start, cfg.n_routed_experts,
                   lay.expert_start, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                   float(cfg.routed_scaling_factor), cfg.quant.group_size)
    experts = {k: ops.weight(f"{m}experts.{k}") for k in ("gate_up.words", "gate_up.scales", "down.words",
                                                           "down.scales")}
    args = (x, ops.weight(m + ROUTER), ops.weight(m + "gate.e_score_correction_bias"), experts,
            tuple(ops.weight(n) for n in mlp_names(m + "shared_experts.")), spec)
    return ops.moe(*args) if live is None else ops.moe_live(*args, live)


ROUTER = "gate.weight"                   # the MoE router's weight, under a layer's "mlp." prefix


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def router_weight(layer: int) -> str:
    """Decoder layer `layer`'s router weight name: what a backend's given routing is keyed by (ops.moe's
    router.name; ddtree bench step)."""
    return f"{layer_prefix(layer)}mlp.{ROUTER}"


def mlp_names(m: str) -> tuple:
    """A SwiGLU MLP's (gate, up, down) weight names under prefix m."""
    return tuple(f"{m}{k}_proj.weight" for k in ("gate", "up", "down"))


def dense_mlp(ops: Ops, m: str, x):
    return ops.swiglu_mlp(x, *(ops.weight(n) for n in mlp_names(m)))


def mlp_front(cfg, layer: int) -> tuple:
    """The names of the weights decoder layer `layer`'s MLP reads first, in order: an MoE's router and shared
    expert (its routed experts wait for the routing), or a dense MLP's."""
    m = layer_prefix(layer) + "mlp."
    if cfg.is_moe_layer(layer):
        return (m + ROUTER, *mlp_names(m + "shared_experts."))
    return mlp_names(m)


def attention_front(cfg, layer: int) -> tuple:
    """The names of the weights decoder layer `layer`'s attention reads, smallest first (a prefetch takes them in
    order while they fit its budget); none past the last layer."""
    if layer >= cfg.num_hidden_layers:
        return ()
    a = layer_prefix(layer) + "self_attn."
    return tuple(a + n for n in ("kv_b_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                                 "q_a_proj.weight"))


PRUNE_MODES = (None, "route", "prune")
INPUT_NORM = "input_layernorm.weight"     # a decoder (or drafter) layer's input norm, under its prefix


def chained_norms(cfg, layer: int) -> tuple[bool, bool]:
    """Decoder layer `layer` with chain_norms: (reads x from the layer before, outputs x_out for the next). The first
    layer norms the embedding itself, the last leaves its h to the head's norm. Off where one graph serves several
    layers (the ONNX kinds bind a layer's weights by its prefix; x_out's weight is the next layer's)."""
    return layer > 0, layer + 1 < cfg.num_hidden_layers


def decoder_layer(ops: Ops, cfg, layer: int, moe_inter: int, requests: int = 1, prune: str | None = None,
                  chain_norms: bool = False) -> None:
    """Decoder layer `layer` (dense MLP or MoE by the config). requests Rq > 1: the union verify, the rows of Rq
    requests at once (row_offsets [Rq + 1]), each with its own cache (cache.<i> in, cache_out.<i> out), tree mask
    (tree_mask.<i> [q_i, ceil(q_i / 32)]) and cache_len [Rq]. Everything but the append and the attention runs on
    the union rows (row-wise ops: each row is what it is alone). prune (an MoE layer of a pruned verify, issue 53):
    "route" reads the live mask [q] and routes live rows only (outputs routed_ids); "prune" also runs tree_prune
    after the routing (outputs live_out, the mask later layers read). chain_norms (see chained_norms): the residual
    add at the layer's end and the next layer's input norm are one op, the MLP all-reduce's fused add + norm: a
    layer after the first reads x [q, H] (its own input norm of h, made by the layer before) and a layer before the
    last outputs x_out (the next layer's); the values are the unchained layer's. Rq 1, prune None and chain_norms
    off: today's layer, op for op."""
    p, H, W = layer_prefix(layer), cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    x_in, x_out = chained_norms(cfg, layer) if chain_norms else (False, False)
    h = ops.input("h", ["q", H], ACT)
    pos = ops.input("pos", ["q"], I32)
    if requests == 1:
        cache = ops.input("cache", ["S", W], ACT)
        cache_len, row_offsets = ops.input("cache_len", [1], I32), None
        tree_mask = ops.input("tree_mask", ["q", "W"], I32)
    else:                                                                  # the union verify: per-request tuples
        cache = tuple(ops.input(f"cache.{i}", ["S", W], ACT) for i in range(requests))
        cache_len = ops.input("cache_len", [requests], I32)
        row_offsets = ops.input("row_offsets", [requests + 1], I32)
        tree_mask = tuple(ops.input(f"tree_mask.{i}", [f"q.{i}", f"W.{i}"], I32) for i in range(requests))
    if x_in:                                                               # normed by the layer before
        x = ops.input("x", ["q", H], ACT)
    else:
        x = ops.rms_norm(h, ops.weight(p + INPUT_NORM), cfg.rms_norm_eps)  # [q, H]
    attn, cache = mla_attention(ops, cfg, p + "self_attn.", x, pos, cache, cache_len, tree_mask,
                                ahead=mlp_front(cfg, layer), row_offsets=row_offsets)
    h1, x2 = ops.all_reduce_add_rms_norm(attn, h, ops.weight(p + "post_attention_layernorm.weight"),
                                         cfg.rms_norm_eps, "attn")
    if prune not in PRUNE_MODES or (prune and not cfg.is_moe_layer(layer)):
        raise ValueError(f"decoder_layer {layer}: prune {prune!r} (expected one of {PRUNE_MODES}, on an MoE layer)")
    ops.prefetch(*attention_front(cfg, layer + 1), beside="experts")     # the next front: here (once routed) or
                                                                          # beside the all-reduce below (cuda: one)
    if prune:
        mlp = _pruned_moe(ops, cfg, layer, x2, moe_inter, prune)
    elif cfg.is_moe_layer(layer):
        mlp = moe(ops, cfg, p + "mlp.", x2, moe_inter)
    else:
        mlp = dense_mlp(ops, p + "mlp.", x2)
    ops.prefetch(*attention_front(cfg, layer + 1), beside="collective")   # the all-reduce leaves the HBM idle
    if x_out:                                     # h_out and the next layer's x in one op after the all-reduce
        h_out, x_next = ops.all_reduce_add_rms_norm(mlp, h1, ops.weight(layer_prefix(layer + 1) + INPUT_NORM),
                                                    cfg.rms_norm_eps, "mlp")
    else:
        h_out, x_next = ops.add(h1, ops.all_reduce(mlp, "mlp")), None
    ops.output("h_out", h_out, ["q", H], ACT)
    if x_next is not None:
        ops.output("x_out", x_next, ["q", H], ACT)
    if requests == 1:
        ops.output("cache_out", cache, ["S", W], ACT)
    else:
        for i, c in enumerate(cache):
            ops.output(f"cache_out.{i}", c, ["S", W], ACT)


def moe_horizon(cfg, layer: int) -> int:
    """tree_prune's horizon at MoE layer `layer`: the MoE layers after this one (what a node dropped here is charged
    for: its marginal experts in every layer left; this layer's are read already; tree/prune.py, the rule)."""
    moe_layers = cfg.moe_layers
    if layer not in moe_layers:
        raise ValueError(f"moe_horizon: layer {layer} is not an MoE layer (the MoE layers are {moe_layers})")
    return len(moe_layers) - moe_layers.index(layer) - 1


def _pruned_moe(ops: Ops, cfg, layer: int, x2, moe_inter: int, prune: str):
    """The MoE of a pruned verify: live rows only; at a "prune" layer, tree_prune on this layer's routing, its
    horizon (moe_horizon) the MoE layers after this one."""
    live = ops.input("live", ["q"], I32)
    mlp, ids = moe(ops, cfg, layer_prefix(layer) + "mlp.", x2, moe_inter, live=live)
    ops.output("routed_ids", ids, ["q", cfg.num_experts_per_tok], I32)
    if prune == "prune":
        live = ops.tree_prune(live, ops.input("parents", ["q"], I32), ops.input("path_prob", ["q"], F32), ids,
                              ops.input("prune_rate", [1], F32), ops.input("expert_bytes", [1], I32),
                              moe_horizon(cfg, layer))
        ops.output("live_out", live, ["q"], I32)
    return mlp


def compact(ops: Ops, cfg, stacked: bool = False) -> None:
    """One layer's cache [S, W] to the accepted path, or (stacked) every layer's at once: [L, S, W] in one buffer."""
    W = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    dims = ["L", "S", W] if stacked else ["S", W]
    cache = ops.input("cache", dims, ACT)
    cache_len = ops.input("cache_len", [1], I32)                                        # T before the verify
    accepted = ops.input("accepted", ["nodes"], I32)                                    # the walk's outputs
    count = ops.input("accepted_count", [1], I32)
    ops.output("cache_out", ops.kv_compact(cache, cache_len, accepted, count), dims, ACT)


def _target_logits(ops: Ops, cfg):
    h = ops.input("h", ["q", cfg.hidden_size], ACT)
    x = ops.rms_norm(h, ops.weight("model.norm.weight"), cfg.rms_norm_eps)
    return ops.linear(x, ops.weight("lm_head.weight"), out=ACC)                         # [q, V_r]


def head_logits(ops: Ops, cfg) -> None:
    """The head without its sampler: the logits alone, for a backend that samples them itself (the GPU step's
    fused sampler + acceptance walk, runtime/cuda_step.py) or a host loop that downloads them."""
    ops.output("logits", _target_logits(ops, cfg), ["q", ops.lay.vocab_stop - ops.lay.vocab_start], ACC)


def head(ops: Ops, cfg) -> None:
    logits = _target_logits(ops, cfg)
    sample_pos = ops.input("sample_pos", ["q"], I32)
    temperature = ops.input("temperature", [1], F32)
    seed = ops.input("seed", [2], I32)                                                  # (low word, high word)
    value, winner = ops.vocab_winner(logits, sample_pos, temperature, seed)
    ops.output("logits", logits, ["q", ops.lay.vocab_stop - ops.lay.vocab_start], ACC)
    ops.output("win_value", value, ["q"], ACC)
    ops.output("win_id", winner, ["q"], I32)


# ----------------------------------------------------------------------------------------------
# drafter (DFlash; rank tensors prefixed "drafter.")

def draft_fc(ops: Ops, dcfg) -> None:
    H, lay = dcfg.hidden_size, ops.lay
    ctx_taps = ops.input("ctx_taps", ["n", dcfg.num_taps * H], ACT)
    partial = ops.linear(ops.slice(ctx_taps, 1, lay.fc_start, lay.fc_stop), ops.weight("drafter.fc.weight"))
    ctx = ops.rms_norm(ops.all_reduce(partial, "fc"), ops.weight("drafter.hidden_norm.weight"), dcfg.rms_norm_eps)
    ops.output("ctx", ctx, ["n", H], ACT)


def draft_layer(ops: Ops, dcfg, layer: int, block: int | None = None) -> None:
    """`block`: the block size b of this call (static per graph, as the budget is; default the drafter's)."""
    p, a = f"drafter.layers.{layer}.", f"drafter.layers.{layer}.self_attn."
    H, d, b, eps = dcfg.hidden_size, dcfg.head_dim, block or dcfg.block_size, dcfg.rms_norm_eps
    heads = ops.shape(ops.weight(a + "q_proj.weight"))[0] // d
    kv_heads = ops.shape(ops.weight(a + "k_proj.weight"))[0] // d
    h = ops.input("h", [b, H], ACT)
    ctx = ops.input("ctx", ["n", H], ACT)
    pos = ops.input("pos", [b], I32)
    cache_k = ops.input("cache_k", ["S", kv_heads, d], ACT)
    cache_v = ops.input("cache_v", ["S", kv_heads, d], ACT)
    cache_len = ops.input("cache_len", [1], I32)

    def heads_of(y, n: int, norm: str | None):
        y = ops.reshape(y, [0, n, d])                                                     # [m, n, d]
        return ops.rms_norm(y, ops.weight(f"{a}{norm}.weight"), eps) if norm else y

    w_q, w_k, w_v = (ops.weight(f"{a}{proj}.weight") for proj in ("q_proj", "k_proj", "v_proj"))
    x = ops.rms_norm(h, ops.weight(p + INPUT_NORM), eps)                   # [b, H]
    y_q, y_k, y_v = ops.linears(x, (w_q, w_k, w_v))                  # one GEMM over x where stored side by side
    q, k, v = heads_of(y_q, heads, "q_norm"), heads_of(y_k, kv_heads, "k_norm"), heads_of(y_v, kv_heads, None)
    y_k, y_v = ops.linears(ctx, (w_k, w_v))                          # the same k | v tiles over the new context
    ctx_k, ctx_v = heads_of(y_k, kv_heads, "k_norm"), heads_of(y_v, kv_heads, None)
    spec = DraftAttentionSpec(heads, kv_heads, d, dcfg.window(layer), float(dcfg.attention_factor))
    ops.prefetch(a + "o_proj.weight", *mlp_names(p + "mlp."))     # staged in L2 during the attention
    o, cache_k, cache_v = ops.draft_attention(q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, dcfg.rope,
                                              spec)
    h1, x2 = ops.all_reduce_add_rms_norm(ops.linear(o, ops.weight(a + "o_proj.weight")), h,
                                         ops.weight(p + "post_attention_layernorm.weight"), eps, "attn")
    ops.output("h_out", ops.add(h1, ops.all_reduce(dense_mlp(ops, p + "mlp.", x2), "mlp")), [b, H], ACT)
    ops.output("cache_k_out", cache_k, ["S", kv_heads, d], ACT)
    ops.output("cache_v_out", cache_v, ["S", kv_heads, d], ACT)


def _draft_logits(ops: Ops, dcfg, b: int):
    h = ops.input("h", [b, dcfg.hidden_size], ACT)
    x = ops.slice(ops.rms_norm(h, ops.weight("drafter.norm.weight"), dcfg.rms_norm_eps), 0, 1, b)   # [D, H]
    return ops.linear(x, ops.weight("lm_head.weight"), out=ACC)                         # [D, V_r]


def draft_logits(ops: Ops, dcfg, block: int | None = None) -> None:
    """The drafter head without its top-k: logits [b-1, V_r] (the GPU step builds the tree from them in
    its fused top-k + build kernels, plugins/tree_build.py)."""
    b, lay = block or dcfg.block_size, ops.lay
    ops.output("logits", _draft_logits(ops, dcfg, b), [b - 1, lay.vocab_stop - lay.vocab_start], ACC)


def draft_head(ops: Ops, dcfg, k: int, block: int | None = None) -> None:
    b, lay = block or dcfg.block_size, ops.lay
    D, V_r = b - 1, lay.vocab_stop - lay.vocab_start
    logits = _draft_logits(ops, dcfg, b)
    values, ids, row_max, row_sumexp = ops.vocab_topk(ops.cast(logits, F32), k)
    ops.output("logits", logits, [D, V_r], ACC)
    ops.output("topk_values", values, [D, k], F32)
    ops.output("topk_ids", ids, [D, k], I32)
    ops.output("row_max", row_max, [D], F32)
    ops.output("row_sumexp", row_sumexp, [D], F32)


def tree(ops: Ops, dcfg, k: int, budget: int) -> None:
    D, n = dcfg.block_size - 1, budget + 1
    root = ops.input("root", [1], I32)
    mine = {"topk_values": ([D, k], F32), "topk_ids": ([D, k], I32), "row_max": ([D], F32), "row_sumexp": ([D], F32)}
    cands = [ops.all_gather(ops.input(name, shape, dt), name) for name, (shape, dt) in mine.items()]   # [tp, ...]
    tokens, parents, depth, visibility = ops.tree_build(root, *cands, budget)
    for name, x, shape in (("tokens", tokens, [n]), ("parents", parents, [n]), ("depth", depth, [n]),
                           ("visibility", visibility, [n, -(-n // 32)])):
        ops.output(name, x, shape, I32)


def accept(ops: Ops, pruned: bool = False) -> None:
    """pruned: the verify pruned the tree; the walk reads its live mask [nodes] and treats dead nodes as absent."""
    tokens, parents = ops.input("tokens", ["nodes"], I32), ops.input("parents", ["nodes"], I32)
    win_value = ops.all_gather(ops.input("win_value", ["nodes"], ACC), "win_value")    # [tp, nodes]
    win_id = ops.all_gather(ops.input("win_id", ["nodes"], I32), "win_id")
    if pruned:
        walk = ops.accept_walk_live(tokens, parents, win_value, win_id, ops.input("live", ["nodes"], I32))
    else:
        walk = ops.accept_walk(tokens, parents, win_value, win_id)
    target, accepted, count, bonus = walk
    ops.output("target_tokens", target, ["nodes"], I32)
    ops.output("accepted", accepted, ["nodes"], I32)
    ops.output("accepted_count", count, [1], I32)
    ops.output("bonus", bonus, [1], I32)


# ----------------------------------------------------------------------------------------------
# the kinds of one rank: kind -> (function, args, layers it serves, weight prefix)

def drafter_groups(dcfg) -> dict[str, list[int]]:
    """Drafter layers by attention kind: one graph kind, or full / sliding when the drafter mixes both."""
    groups: dict[int, list[int]] = {}
    for L in range(dcfg.num_hidden_layers):
        groups.setdefault(dcfg.window(L), []).append(L)
    if len(groups) == 1:
        return {"draft_layer": next(iter(groups.values()))}
    return {("draft_layer_sliding" if w else "draft_layer_full"): layers for w, layers in groups.items()}


def draft_topk(budgets, vocab_per_rank: int) -> int:
    """Candidates per rank and depth: enough for the largest budget (a tree of B nodes uses ranks < B)."""
    return min(max(budgets), vocab_per_rank)


def rank_kinds(cfg, dcfg, plan: dict, lay, budgets) -> dict[str, tuple]:
    """kind -> (layer function, its arguments after ops, layers served, weight prefix of the first)."""
    inter = plan["per_rank"]["moe_intermediate"]
    k = draft_topk(budgets, lay.vocab_stop - lay.vocab_start)
    kinds: dict[str, tuple] = {"embed": (embed, (cfg,), [], None)}
    dense = [L for L in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(L)]
    for kind, layers in (("dense_layer", dense), ("moe_layer", cfg.moe_layers)):
        if layers:
            kinds[kind] = (decoder_layer, (cfg, layers[0], inter), layers, f"model.layers.{layers[0]}.")
    kinds["head"] = (head, (cfg,), [], None)
    kinds["compact"] = (compact, (cfg,), [], None)
    kinds["draft_fc"] = (draft_fc, (dcfg,), [], None)
    for kind, layers in drafter_groups(dcfg).items():
        kinds[kind] = (draft_layer, (dcfg, layers[0]), layers, f"drafter.layers.{layers[0]}.")
    kinds["draft_head"] = (draft_head, (dcfg, k), [], None)
    for B in sorted(set(budgets)):
        kinds[f"tree_b{B}"] = (tree, (dcfg, k, B), [], None)
    kinds["accept"] = (accept, (), [], None)
    return kinds


def layer_weight_name(name: str, prefix: str | None, layer: int) -> str:
    """The rank tensor that serves `name` (written for the kind's first layer) at `layer`."""
    if prefix is None or not name.startswith(prefix):
        return name
    family = prefix[: prefix.rstrip(".").rfind(".") + 1]                 # "model.layers."
    return f"{family}{layer}.{name[len(prefix):]}"
