"""The onnx backend: the op set emitted as one rank's ONNX graph of a layer kind.

Standard ONNX ops where they exist (Gemm, the norm as ReduceMean/Sqrt/Div, the absorbed-MLA batched
MatMuls, Slice/Reshape/Cast) and a `ddtree` custom-domain node where a kernel does the work (the node
table: description/nodes.py). TensorRT-RTX maps each custom node to a plugin of the same name
(backends/tensorrt/); onnx.reference runs them with their numpy implementations (backends/onnx_nodes.py).
Weights are graph inputs named like the rank's safetensors tensors, in their stored dtype, cast to ACT
inside the graph (bf16 -> float64 is exact), so one description serves the engine's bf16 graphs and
the float64 graphs the CPU tests compare with the oracle.

    ops = OnnxOps(GraphBuilder("moe_layer.rank0", "bfloat16"), lay, specs)
    layers.decoder_layer(ops, cfg, 1, inter);  model = ops.g.export()
"""
from __future__ import annotations

import numpy as np

from ddtree.backends.onnx_graph import FLOAT, INT32, GraphBuilder
from ddtree.description.nodes import rope_attrs
from ddtree.description.opset import ACC, ACT, F32, I32, Ops, RankLayout

# the `ddtree` node of each op and the node name it gets (tests and plan builders look nodes up by name)
NODE_NAMES = {"MlaTreeAttention": "attn.mla", "KvAppend": "attn.kv_append", "Rope": "attn.rope",
              "KvCompact": "cache.compact",
              "MarlinMoE": "mlp.moe", "DraftAttention": "draft.attention", "VocabWinner": "head.winner",
              "VocabTopK": "draft.topk", "TreeBuild": "tree.build", "AcceptWalk": "tree.accept"}


class OnnxOps(Ops):
    def __init__(self, g: GraphBuilder, lay: RankLayout, specs: dict):
        self.g, self.lay, self.specs = g, lay, specs
        self._weights: dict = {}
        self._names: dict[str, int] = {}
        self.dtypes = {ACT: g.act, ACC: g.acc, I32: INT32, F32: FLOAT}

    def _ranks(self) -> dict:
        return {"rank": self.lay.rank, "world_size": self.lay.tp}

    def _node(self, op: str, inputs, attrs: dict, outputs: list[tuple[str, int, list]]) -> list:
        """A `ddtree` node named after its op (numbered from the second one of a kind in a graph)."""
        base = NODE_NAMES[op]
        n = self._names[base] = self._names.get(base, 0) + 1
        name = base if n == 1 else f"{base}_{n}"
        return self.g.node(op, inputs, {**self._ranks(), **attrs},
                           [(o if n == 1 else f"{o}_{n}", dt, s) for o, dt, s in outputs], name)

    # graph boundary -------------------------------------------------------------------------------
    def input(self, name, shape, dtype):
        return self.g.input(name, self.dtypes[dtype], shape)

    def weight(self, name):
        if name not in self._weights:
            if name not in self.specs:
                raise KeyError(f"graph {self.g.name}: tensor '{name}' is not among the rank's tensors")
            self._weights[name] = self.g.weight(name, self.specs[name])
        return self._weights[name]

    def output(self, name, x, shape, dtype):
        self.g.output(x, name, self.dtypes[dtype], shape)

    def shape(self, x):
        return tuple(x.shape)

    # layout ---------------------------------------------------------------------------------------
    def reshape(self, x, shape):
        return self.g.reshape(x, shape)

    def slice(self, x, axis, start, stop):
        return self.g.slice(x, axis, start, stop)

    def cast(self, x, dtype):
        return self.g.cast(x, self.dtypes[dtype])

    # dense math -----------------------------------------------------------------------------------
    def add(self, a, b):
        return self.g.add(*(self._act(x) for x in (a, b)))

    def _act(self, x):
        """x in ACT: a weight input (stored dtype) is cast; node outputs are ACT already."""
        return self.g.cast(x, self.g.act) if x in self._weights.values() else x

    def rms_norm(self, x, w, eps):
        return self.g.rms_norm(x, w, eps)

    def all_reduce_add_rms_norm(self, partial, h, w, eps, tag):
        h1 = self.g.add(h, self.all_reduce(partial, tag))
        return h1, self.g.rms_norm(h1, w, eps)

    def linear(self, x, w, out=ACT):
        return self.g.linear(x, w) if out == ACT else self.g.linear_acc(x, w)

    def swiglu_mlp(self, x, gate, up, down):
        return self.g.swiglu(x, gate, up, down)

    def embed(self, ids, table):
        g, V_r = self.g, self.shape(table)[0]
        local = g.op("Sub", [ids, g.const([self.lay.vocab_start], np.int32)])                      # [q]
        mine = g.op("And", [g.op("GreaterOrEqual", [local, g.const([0], np.int32)]),
                            g.op("Less", [local, g.const([V_r], np.int32)])])                      # [q] bool
        rows = g.op("Gather", [table, g.op("Where", [mine, local, g.const([0], np.int32)])], {"axis": 0})
        keep = g.cast(g.op("Unsqueeze", [mine, g.const([1], np.int64)]), g.act)                   # [q, 1]
        return g.op("Mul", [g.cast(rows, g.act), keep], dtype=g.act)                               # [q, H]

    # MLA ------------------------------------------------------------------------------------------
    def rope(self, x, pos, rope):
        return self._node("Rope", [x, pos], {"style": "interleaved", **rope_attrs(rope)},
                          [("roped", self.g.act, None)])[0]

    def kv_append(self, cache, cache_len, c_kv, k_pe):
        return self._node("KvAppend", [c_kv, k_pe, cache, cache_len], {},
                          [("cache_new", self.g.act, list(cache.shape))])[0]

    def kv_compact(self, cache, cache_len, accepted, accepted_count):
        return self._node("KvCompact", [cache, cache_len, accepted, accepted_count], {},
                          [("cache_compacted", self.g.act, list(cache.shape))])[0]

    def _per_head(self, kv_b, spec, first: bool):
        """W_UK [N_r, Dn, R] (first) or W_UV^T [N_r, R, Dv] from kv_b [N_r (Dn + Dv), R]."""
        g, Dn, Dv = self.g, spec.nope_dim, spec.v_dim
        w = g.reshape(g.cast(kv_b, g.act), [spec.heads, Dn + Dv, spec.kv_lora_rank])
        if first:
            return g.slice(w, 1, 0, Dn)
        return g.op("Transpose", [g.slice(w, 1, Dn, Dn + Dv)], {"perm": [0, 2, 1]})

    def mla_absorb_q(self, q_nope, kv_b, spec):
        g = self.g                                                      # [q, N, Dn] -> [N, q, Dn] @ [N, Dn, R]
        q_lat = g.op("MatMul", [g.op("Transpose", [q_nope], {"perm": [1, 0, 2]}), self._per_head(kv_b, spec, True)])
        return g.op("Transpose", [q_lat], {"perm": [1, 0, 2]}, dtype=g.act)                       # [q, N, R]

    def mla_tree_attention(self, q_lat, q_rope, cache, cache_len, tree_mask, spec):
        attrs = {"heads": spec.heads, "kv_lora_rank": spec.kv_lora_rank, "qk_rope_head_dim": spec.rope_dim,
                 "softmax_scale": float(spec.softmax_scale)}
        return self._node("MlaTreeAttention", [q_lat, q_rope, cache, cache_len, tree_mask], attrs,
                          [("attn_o", self.g.act, ["q", spec.heads, spec.kv_lora_rank])])[0]

    def mla_absorb_out(self, o_lat, kv_b, spec):
        g = self.g                                                      # [N, q, R] @ [N, R, Dv] -> [q, N Dv]
        o = g.op("MatMul", [g.op("Transpose", [o_lat], {"perm": [1, 0, 2]}), self._per_head(kv_b, spec, False)])
        return g.reshape(g.op("Transpose", [o], {"perm": [1, 0, 2]}), [0, spec.heads * spec.v_dim])

    # MoE ------------------------------------------------------------------------------------------
    def moe(self, x, router, bias, experts, shared, spec):
        attrs = {"hidden": spec.hidden, "inter": spec.inter, "experts": spec.experts,
                 "n_routed_experts": spec.n_routed_experts, "expert_start": spec.expert_start, "topk": spec.topk,
                 "n_group": spec.n_group, "topk_group": spec.topk_group,
                 "routed_scaling_factor": float(spec.routed_scaling_factor), "group_size": spec.group_size}
        router_logits = self.g.linear_acc(x, router)                                               # [q, E] ACC
        inputs = [x, router_logits, bias, *(experts[k] for k in ("gate_up.words", "gate_up.scales", "down.words",
                                                                  "down.scales")), self.g.swiglu(x, *shared)]
        return self._node("MarlinMoE", inputs, attrs, [("moe_y", self.g.act, ["q", spec.hidden])])[0]

    # drafter --------------------------------------------------------------------------------------
    def draft_attention(self, q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, rope, spec):
        attrs = {"heads": spec.heads, "kv_heads": spec.kv_heads, "head_dim": spec.head_dim,
                 "sliding_window": spec.sliding_window, "attention_factor": float(spec.attention_factor),
                 **rope_attrs(rope)}
        cache_shape = ["S", spec.kv_heads, spec.head_dim]
        return tuple(self._node("DraftAttention", [q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len], attrs,
                                [("attn_o", self.g.act, None),
                                 ("cache_k_new", self.g.act, cache_shape), ("cache_v_new", self.g.act, cache_shape)]))

    # collectives ----------------------------------------------------------------------------------
    def all_reduce(self, x, tag):
        return self.g.node("AllReduce", [x], self._ranks(), [(f"{tag}_sum", self.g.act, None)],
                           f"{tag}.all_reduce")[0]

    def all_gather(self, x, tag):
        return self.g.node("AllGather", [x], self._ranks(), [(f"{tag}_all", getattr(x, "dtype", None), None)],
                           f"{tag}.all_gather")[0]

    # vocab-parallel sampling and the tree ---------------------------------------------------------
    def vocab_winner(self, logits, sample_pos, temperature, seed):
        attrs = {"vocab_start": self.lay.vocab_start, "vocab_size": self.lay.vocab_stop - self.lay.vocab_start}
        return tuple(self._node("VocabWinner", [logits, sample_pos, temperature, seed], attrs,
                                [("win_value", self.g.acc, ["q"]), ("win_id", INT32, ["q"])]))

    def vocab_topk(self, logits, k):
        D = "D"
        attrs = {"vocab_start": self.lay.vocab_start, "vocab_size": self.lay.vocab_stop - self.lay.vocab_start, "k": k}
        return tuple(self._node("VocabTopK", [logits], attrs,
                                [("topk_values", FLOAT, [D, k]), ("topk_ids", INT32, [D, k]), ("row_max", FLOAT, [D]),
                                 ("row_sumexp", FLOAT, [D])]))

    def tree_build(self, root, values, ids, row_max, row_sumexp, budget):
        n = budget + 1
        return tuple(self._node("TreeBuild", [root, values, ids, row_max, row_sumexp], {"budget": budget},
                                [("tokens", INT32, [n]), ("parents", INT32, [n]), ("depth", INT32, [n]),
                                 ("visibility", INT32, [n, -(-n // 32)])]))

    def accept_walk(self, tokens, parents, win_value, win_id):
        return tuple(self._node("AcceptWalk", [tokens, parents, win_value, win_id], {},
                                [("target_tokens", INT32, ["nodes"]), ("accepted", INT32, ["nodes"]),
                                 ("accepted_count", INT32, [1]), ("bonus", INT32, [1])]))
