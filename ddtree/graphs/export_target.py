"""Per-rank ONNX graphs of the Kimi target: embedding, decoder layer (dense MLP or MoE), final norm + head.

Each graph is one rank's share (the TP plan: builder/plan.py); an `AllReduce` node sums the rank
partials wherever the plan all-reduces. A decoder-layer graph serves every layer of its kind: its
weight inputs carry the names of the first such layer (e.g. model.layers.1.self_attn.q_a_proj.weight)
and the runtime binds layer L's tensors by swapping that prefix (graphs/export.py: layer_weight_name).

    embed        ids [q] -> rows of the ids this rank owns, zeros elsewhere -> AllReduce -> h [q, H]
    layer        h [q, H], pos [q], cache [S, R + Dr], cache_len [1], tree_mask [q, W]
                 x = RMSNorm_in(h)
                 c_q = RMSNorm(x q_a^T);  q = c_q q_b^T -> [q, N_r, Dn + Dr] = (q_nope | q_pe)
                 kv = x kv_a^T -> (RMSNorm(c_kv) | k_pe) = kv_new [q, R + Dr]
                 MlaTreeAttention(q_nope, q_pe, kv_new, kv_b, pos, cache, cache_len, tree_mask)
                     -> o [q, N_r Dv], cache_out (rope, cache append, tree-masked absorbed MLA)
                 h1 = h + AllReduce(o o_proj^T)
                 x2 = RMSNorm_post(h1)
                 dense: h_out = h1 + AllReduce(SwiGLU slice(x2))
                 MoE:   h_out = h1 + AllReduce(MarlinMoE(x2, x2 router^T (acc), bias, experts, shared(x2)))
    head         h [q, H] -> RMSNorm -> logits [q, V_r] (acc) -> VocabWinner -> (value, id) per row

Letters as in ops/nodes.py.
"""
from __future__ import annotations

import numpy as np

from ddtree.ops.nodes import rope_attrs
from ddtree.graphs.onnx_graph import FLOAT, INT32, GraphBuilder


def export_embed(g: GraphBuilder, cfg, specs: dict, lay) -> None:
    rank, tp, vocab_start = lay.rank, lay.tp, lay.vocab_start
    table_name = "model.embed_tokens.weight"
    V_r, H = specs[table_name].shape
    ids = g.input("ids", INT32, ["q"])
    table = g.weight(table_name, specs[table_name])
    local = g.op("Sub", [ids, g.const([vocab_start], np.int32)])                         # [q]
    mine = g.op("And", [g.op("GreaterOrEqual", [local, g.const([0], np.int32)]),
                        g.op("Less", [local, g.const([V_r], np.int32)])])                # [q] bool
    rows = g.op("Gather", [table, g.op("Where", [mine, local, g.const([0], np.int32)])], {"axis": 0})
    keep = g.cast(g.op("Unsqueeze", [mine, g.const([1], np.int64)]), g.act)             # [q, 1]
    partial = g.op("Mul", [g.cast(rows, g.act), keep], dtype=g.act)                      # [q, H]
    h = g.node("AllReduce", [partial], {"rank": rank, "world_size": tp},
               [("h_sum", g.act, ["q", H])], "embed.all_reduce")[0]
    g.output(h, "h", g.act, ["q", H])


def _attention(g: GraphBuilder, cfg, specs: dict, p: str, h, rank: int, tp: int):
    """The MLA half of a decoder layer -> (h1 [q, H], cache_out)."""
    a = f"{p}self_attn."
    H, R, Dn, Dr, Dv = cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    eps = cfg.rms_norm_eps
    heads = specs[a + "q_b_proj.weight"].shape[0] // (Dn + Dr)                           # N_r
    pos = g.input("pos", INT32, ["q"])
    cache = g.input("cache", g.act, ["S", R + Dr])
    cache_len = g.input("cache_len", INT32, [1])
    tree_mask = g.input("tree_mask", INT32, ["q", "W"])
    w = {n: g.weight(n, specs[n]) for n in (
        f"{p}input_layernorm.weight", a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight",
        a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight", a + "o_proj.weight")}
    x = g.rms_norm(h, w[f"{p}input_layernorm.weight"], eps)                              # [q, H]
    c_q = g.rms_norm(g.linear(x, w[a + "q_a_proj.weight"]), w[a + "q_a_layernorm.weight"], eps)   # [q, Q]
    q_all = g.reshape(g.linear(c_q, w[a + "q_b_proj.weight"]), [0, heads, Dn + Dr])     # [q, N_r, Dn + Dr]
    q_nope, q_pe = g.slice(q_all, 2, 0, Dn), g.slice(q_all, 2, Dn, Dn + Dr)
    latent = g.linear(x, w[a + "kv_a_proj_with_mqa.weight"])                             # [q, R + Dr]
    c_kv = g.rms_norm(g.slice(latent, 1, 0, R), w[a + "kv_a_layernorm.weight"], eps)     # [q, R]
    kv_new = g.op("Concat", [c_kv, g.slice(latent, 1, R, R + Dr)], {"axis": 1}, dtype=g.act)
    attrs = {"rank": rank, "world_size": tp, "heads": heads, "kv_lora_rank": R, "qk_nope_head_dim": Dn,
             "qk_rope_head_dim": Dr, "v_head_dim": Dv, "softmax_scale": float(cfg.softmax_scale),
             **rope_attrs(cfg.rope)}
    o, cache_out = g.node("MlaTreeAttention", [q_nope, q_pe, kv_new, w[a + "kv_b_proj.weight"], pos, cache,
                                               cache_len, tree_mask], attrs,
                          [("attn_o", g.act, ["q", heads * Dv]), ("cache_new", g.act, ["S", R + Dr])], "attn.mla")
    partial = g.linear(o, w[a + "o_proj.weight"])                                        # [q, H]
    attn = g.node("AllReduce", [partial], {"rank": rank, "world_size": tp},
                  [("attn_sum", g.act, ["q", H])], "attn.all_reduce")[0]
    return g.add(h, attn), cache_out


def _moe(g: GraphBuilder, cfg, specs: dict, p: str, x, lay, inter: int):
    m = f"{p}mlp."
    H, E = cfg.hidden_size, cfg.n_routed_experts
    names = [m + s for s in ("gate.weight", "gate.e_score_correction_bias", "experts.gate_up.words",
                             "experts.gate_up.scales", "experts.down.words", "experts.down.scales",
                             "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                             "shared_experts.down_proj.weight")]
    w = {n: g.weight(n, specs[n]) for n in names}
    router_logits = g.linear_acc(x, w[m + "gate.weight"])                                # [q, E] acc
    shared = g.swiglu(x, *(w[m + f"shared_experts.{k}_proj.weight"] for k in ("gate", "up", "down")))
    attrs = {"rank": lay.rank, "world_size": lay.tp, "hidden": H, "inter": inter,
             "experts": lay.expert_stop - lay.expert_start, "n_routed_experts": E,
             "expert_start": lay.expert_start, "topk": cfg.num_experts_per_tok,
             "n_group": cfg.n_group, "topk_group": cfg.topk_group,
             "routed_scaling_factor": float(cfg.routed_scaling_factor), "group_size": cfg.quant.group_size}
    return g.node("MarlinMoE", [x, router_logits, w[m + "gate.e_score_correction_bias"],
                                *(w[m + f"experts.{s}"] for s in ("gate_up.words", "gate_up.scales", "down.words",
                                                                   "down.scales")), shared], attrs,
                  [("moe_y", g.act, ["q", H])], "mlp.moe")[0]


def export_layer(g: GraphBuilder, cfg, specs: dict, layer: int, lay, moe_inter: int) -> None:
    """Decoder layer `layer` (and every layer of its kind, by weight-prefix substitution)."""
    rank, tp = lay.rank, lay.tp
    p = f"model.layers.{layer}."
    H = cfg.hidden_size
    h = g.input("h", g.act, ["q", H])
    h1, cache_out = _attention(g, cfg, specs, p, h, rank, tp)
    post = g.weight(f"{p}post_attention_layernorm.weight", specs[f"{p}post_attention_layernorm.weight"])
    x2 = g.rms_norm(h1, post, cfg.rms_norm_eps)                                          # [q, H]
    if cfg.is_moe_layer(layer):
        partial = _moe(g, cfg, specs, p, x2, lay, moe_inter)
    else:
        m = f"{p}mlp."
        partial = g.swiglu(x2, *(g.weight(m + f"{k}_proj.weight", specs[m + f"{k}_proj.weight"])
                                 for k in ("gate", "up", "down")))
    mlp = g.node("AllReduce", [partial], {"rank": rank, "world_size": tp},
                 [("mlp_sum", g.act, ["q", H])], "mlp.all_reduce")[0]
    g.output(g.add(h1, mlp), "h_out", g.act, ["q", H])
    g.output(cache_out, "cache_out", g.act, ["S", cfg.kv_lora_rank + cfg.qk_rope_head_dim])


def export_head(g: GraphBuilder, cfg, specs: dict, lay) -> None:
    rank, tp, vocab_start = lay.rank, lay.tp, lay.vocab_start
    H = cfg.hidden_size
    V_r = specs["lm_head.weight"].shape[0]
    h = g.input("h", g.act, ["q", H])
    sample_pos = g.input("sample_pos", INT32, ["q"])
    temperature = g.input("temperature", FLOAT, [1])
    seed = g.input("seed", INT32, [2])
    norm = g.weight("model.norm.weight", specs["model.norm.weight"])
    lm_head = g.weight("lm_head.weight", specs["lm_head.weight"])
    logits = g.linear_acc(g.rms_norm(h, norm, cfg.rms_norm_eps), lm_head)                # [q, V_r] acc
    value, winner = g.node("VocabWinner", [logits, sample_pos, temperature, seed],
                           {"rank": rank, "world_size": tp, "vocab_start": vocab_start, "vocab_size": cfg.vocab_size},
                           [("win_value", g.acc, ["q"]), ("win_id", INT32, ["q"])], "head.winner")
    g.output(logits, "logits", g.acc, ["q", V_r])
    g.outputs([value, winner])
