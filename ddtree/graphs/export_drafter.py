"""Per-rank ONNX graphs of the DFlash drafter, and the replicated tree graphs (build and accept walk).

    draft_fc     ctx_taps [n, K H] (the all-reduced taps, same on every rank) -> this rank's fc input
                 columns -> AllReduce -> hidden_norm -> ctx [n, H]
    draft_layer  h [b, H], ctx [n, H], pos [b], cache_k/v [S, Hk_r, d], cache_len [1]
                 x = RMSNorm_in(h); q = q_norm(x q^T), k = k_norm(x k^T), v = x v^T   (block, per head)
                 ctx_k = k_norm(ctx k^T), ctx_v = ctx v^T                              (new context)
                 DraftAttention(q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len)
                     -> o [b, Hq_r d], caches with the roped context K/V appended at T..T+n-1
                 h1 = h + AllReduce(o o_proj^T);  h_out = h1 + AllReduce(SwiGLU slice(RMSNorm_post(h1)))
    draft_head   h [b, H] -> drafter.norm -> rows 1..b-1 -> target lm_head slice -> logits [D, V_r]
                 -> VocabTopK -> this rank's k candidates per depth + (row max, row sum of exp)
    tree_b<B>    the ranks' candidates, gathered [tp, D, k] -> TreeBuild -> tokens, parents, depth,
                 visibility bits of the best-first tree of B drafted nodes (same on every rank)
    accept       tree tokens/parents + the ranks' sampling winners, gathered [tp, n] -> AcceptWalk
The block embedding reuses the target's `embed` graph (the drafter has no embedding of its own).
The gathers between draft_head -> tree_b<B> and head -> accept are the runtime's (a few values
per rank); every all-reduce is an AllReduce node inside the graphs.
"""
from __future__ import annotations

from ddtree.ops.nodes import rope_attrs
from ddtree.graphs.onnx_graph import FLOAT, INT32, GraphBuilder


def export_draft_fc(g: GraphBuilder, dcfg, specs: dict, lay) -> None:
    H, K = dcfg.hidden_size, dcfg.num_taps
    ctx_taps = g.input("ctx_taps", g.act, ["n", K * H])
    fc = g.weight("drafter.fc.weight", specs["drafter.fc.weight"])                      # [H, K H / tp]
    norm = g.weight("drafter.hidden_norm.weight", specs["drafter.hidden_norm.weight"])
    partial = g.linear(g.slice(ctx_taps, 1, lay.fc_start, lay.fc_stop), fc)               # [n, H]
    fc_out = g.node("AllReduce", [partial], {"rank": lay.rank, "world_size": lay.tp},
                    [("fc_sum", g.act, ["n", H])], "fc.all_reduce")[0]
    g.output(g.rms_norm(fc_out, norm, dcfg.rms_norm_eps), "ctx", g.act, ["n", H])


def export_draft_layer(g: GraphBuilder, dcfg, specs: dict, layer: int, lay) -> None:
    p, a = f"drafter.layers.{layer}.", f"drafter.layers.{layer}.self_attn."
    H, d, b, eps = dcfg.hidden_size, dcfg.head_dim, dcfg.block_size, dcfg.rms_norm_eps
    heads, kv_heads = specs[a + "q_proj.weight"].shape[0] // d, specs[a + "k_proj.weight"].shape[0] // d
    h = g.input("h", g.act, [b, H])
    ctx = g.input("ctx", g.act, ["n", H])
    pos = g.input("pos", INT32, [b])
    cache_k = g.input("cache_k", g.act, ["S", kv_heads, d])
    cache_v = g.input("cache_v", g.act, ["S", kv_heads, d])
    cache_len = g.input("cache_len", INT32, [1])
    names = [p + "input_layernorm.weight", *(a + f"{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "q_norm", "k_norm")),
             p + "post_attention_layernorm.weight", *(p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down"))]
    w = {n: g.weight(n, specs[n]) for n in names}

    def heads_of(x, proj: str, n_heads: int, norm: str | None):
        y = g.reshape(g.linear(x, w[a + f"{proj}.weight"]), [0, n_heads, d])             # [m, heads, d]
        return g.rms_norm(y, w[a + f"{norm}.weight"], eps) if norm else y

    x = g.rms_norm(h, w[p + "input_layernorm.weight"], eps)                              # [b, H]
    q = heads_of(x, "q_proj", heads, "q_norm")
    k, v = heads_of(x, "k_proj", kv_heads, "k_norm"), heads_of(x, "v_proj", kv_heads, None)
    ctx_k, ctx_v = heads_of(ctx, "k_proj", kv_heads, "k_norm"), heads_of(ctx, "v_proj", kv_heads, None)
    attrs = {"rank": lay.rank, "world_size": lay.tp, "heads": heads, "kv_heads": kv_heads, "head_dim": d,
             "sliding_window": dcfg.window(layer), "attention_factor": float(dcfg.attention_factor),
             **rope_attrs(dcfg.rope)}
    o, k_out, v_out = g.node("DraftAttention", [q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len], attrs,
                             [("attn_o", g.act, [b, heads * d]), ("cache_k_new", g.act, ["S", kv_heads, d]),
                              ("cache_v_new", g.act, ["S", kv_heads, d])], "draft.attention")
    attn = g.node("AllReduce", [g.linear(o, w[a + "o_proj.weight"])], {"rank": lay.rank, "world_size": lay.tp},
                  [("attn_sum", g.act, [b, H])], "attn.all_reduce")[0]
    h1 = g.add(h, attn)
    x2 = g.rms_norm(h1, w[p + "post_attention_layernorm.weight"], eps)
    mlp = g.node("AllReduce", [g.swiglu(x2, *(w[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up", "down")))],
                 {"rank": lay.rank, "world_size": lay.tp}, [("mlp_sum", g.act, [b, H])], "mlp.all_reduce")[0]
    g.output(g.add(h1, mlp), "h_out", g.act, [b, H])
    g.output(k_out, "cache_k_out", g.act, ["S", kv_heads, d])
    g.output(v_out, "cache_v_out", g.act, ["S", kv_heads, d])


def export_draft_head(g: GraphBuilder, dcfg, specs: dict, lay, k: int) -> None:
    H, b = dcfg.hidden_size, dcfg.block_size
    D, V_r = b - 1, specs["lm_head.weight"].shape[0]
    h = g.input("h", g.act, [b, H])
    norm = g.weight("drafter.norm.weight", specs["drafter.norm.weight"])
    lm_head = g.weight("lm_head.weight", specs["lm_head.weight"])
    x = g.slice(g.rms_norm(h, norm, dcfg.rms_norm_eps), 0, 1, b)                          # [D, H]
    logits = g.linear_acc(x, lm_head)                                                    # [D, V_r] acc
    attrs = {"rank": lay.rank, "world_size": lay.tp, "vocab_start": lay.vocab_start, "vocab_size": dcfg.vocab_size,
             "k": k}
    outs = g.node("VocabTopK", [g.cast(logits, FLOAT)], attrs,
                  [("topk_values", FLOAT, [D, k]), ("topk_ids", INT32, [D, k]), ("row_max", FLOAT, [D]),
                   ("row_sumexp", FLOAT, [D])], "draft.topk")
    g.output(logits, "logits", g.acc, [D, V_r])
    g.outputs(outs)


def export_tree(g: GraphBuilder, dcfg, lay, k: int, budget: int) -> None:
    tp, D = lay.tp, dcfg.block_size - 1
    n, words = budget + 1, -(-(budget + 1) // 32)
    root = g.input("root", INT32, [1])
    cands = [g.input("topk_values", FLOAT, [tp, D, k]), g.input("topk_ids", INT32, [tp, D, k]),
             g.input("row_max", FLOAT, [tp, D]), g.input("row_sumexp", FLOAT, [tp, D])]
    outs = g.node("TreeBuild", [root, *cands], {"rank": lay.rank, "world_size": tp, "budget": budget},
                  [("tokens", INT32, [n]), ("parents", INT32, [n]), ("depth", INT32, [n]),
                   ("visibility", INT32, [n, words])], "tree.build")
    g.outputs(outs)


def export_accept(g: GraphBuilder, lay) -> None:
    tp = lay.tp
    tokens, parents = g.input("tokens", INT32, ["nodes"]), g.input("parents", INT32, ["nodes"])
    win_value, win_id = g.input("win_value", g.acc, [tp, "nodes"]), g.input("win_id", INT32, [tp, "nodes"])
    outs = g.node("AcceptWalk", [tokens, parents, win_value, win_id], {"rank": lay.rank, "world_size": tp},
                  [("target_tokens", INT32, ["nodes"]), ("accepted", INT32, ["nodes"]),
                   ("accepted_count", INT32, [1]), ("bonus", INT32, [1])], "tree.accept")
    g.outputs(outs)
