"""The `ddtree` nodes for onnx.reference: OpRun classes over the op set's numpy math (backends/numpy_math.py).

Each computes in float64 and returns its outputs in the dtype of its activation inputs, so a float64
graph reproduces the numpy backend (and through it the float64 oracle) and a bfloat16 graph rounds where
a GPU would. In-place outputs (caches) are copies here; TensorRT aliases them to their inputs.

`AllReduce` is a real cross-rank collective: ranks run their graphs in threads (runtime/graph_ranks.py)
and meet in a RankGroup (parallel/collectives.py); world_size 1 needs none. `ops_for(group)` returns the
classes with the group bound, for ReferenceEvaluator(model, new_ops=...).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from onnx.reference.op_run import OpRun

from ddtree.backends import numpy_math as m
from ddtree.description.nodes import DOMAIN, NODES, rope_config
from ddtree.description.opset import DraftAttentionSpec, MoESpec
from ddtree.plugins import layout


class DdtreeOp(OpRun):
    op_domain = DOMAIN


class AllReduce(DdtreeOp):
    group = None

    def _run(self, x, **a):
        if a["world_size"] == 1:
            return (np.array(x, copy=True),)
        g = self.group
        if g is None or g.size != a["world_size"]:
            raise RuntimeError(f"ddtree::AllReduce rank {a['rank']} of {a['world_size']}: no rank group of that "
                               "size is bound (run the ranks' graphs with ops.onnx_runner.GraphRanks)")
        return (g.all_reduce(a["rank"], x),)


class AllGather(AllReduce):
    def _run(self, x, **a):
        if a["world_size"] == 1:
            return (np.array(x, copy=True)[None],)
        g = self.group
        if g is None or g.size != a["world_size"]:
            raise RuntimeError(f"ddtree::AllGather rank {a['rank']} of {a['world_size']}: no rank group of that "
                               "size is bound (run the ranks' graphs with ops.onnx_runner.GraphRanks)")
        return (g.all_gather(a["rank"], np.asarray(x)),)


class Rope(DdtreeOp):
    def _run(self, x, pos, **a):
        if a["style"] != "interleaved":
            raise ValueError(f"ddtree::Rope: style {a['style']!r} (the MLA rope is 'interleaved')")
        return (m.rope_interleaved(x, pos, rope_config(a)).astype(x.dtype),)


class KvAppend(DdtreeOp):
    def _run(self, c_kv, k_pe, cache, cache_len, **a):
        return (m.kv_append(np.array(cache, copy=True), int(cache_len[0]), c_kv, k_pe),)


class KvCompact(DdtreeOp):
    def _run(self, cache, cache_len, accepted, accepted_count, **a):
        return (m.kv_compact(np.array(cache, copy=True), int(cache_len[0]), accepted, int(accepted_count[0])),)


class MlaTreeAttention(DdtreeOp):
    def _run(self, q_lat, q_rope, cache, cache_len, tree_mask, **a):
        spec = SimpleNamespace(softmax_scale=float(a["softmax_scale"]))
        return (m.mla_tree_attention(q_lat, q_rope, cache, int(cache_len[0]), tree_mask, spec).astype(q_lat.dtype),)


class MarlinMoE(DdtreeOp):
    def _run(self, x, router_logits, bias, gu_words, gu_scales, down_words, down_scales, shared, **a):
        if a["group_size"] != layout.GROUP:
            raise ValueError(f"ddtree::MarlinMoE: group_size {a['group_size']} (the kernel layout uses {layout.GROUP})")
        spec = MoESpec(**{k: a[k] for k in MoESpec.__dataclass_fields__})
        experts = {"gate_up.words": np.asarray(gu_words), "gate_up.scales": np.asarray(gu_scales).view(np.uint16),
                   "down.words": np.asarray(down_words), "down.scales": np.asarray(down_scales).view(np.uint16)}
        return (m.moe(x, router_logits, bias, experts, shared, spec).astype(x.dtype),)


class DraftAttention(DdtreeOp):
    def _run(self, q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, **a):
        spec = DraftAttentionSpec(a["heads"], a["kv_heads"], a["head_dim"], a["sliding_window"],
                                  float(a["attention_factor"]))
        k_out, v_out = np.array(cache_k, copy=True), np.array(cache_v, copy=True)
        o = m.draft_attention(q, k, v, ctx_k, ctx_v, pos, k_out, v_out, int(cache_len[0]), rope_config(a), spec)
        return o.astype(q.dtype), k_out, v_out


class VocabWinner(DdtreeOp):
    def _run(self, logits, sample_pos, temperature, seed, **a):
        value, winner = m.vocab_winner(logits, sample_pos, float(np.asarray(temperature).reshape(-1)[0]),
                                       m.seed_of(seed), a["vocab_start"])
        return value.astype(logits.dtype), winner


class VocabTopK(DdtreeOp):
    def _run(self, logits, **a):
        return m.vocab_topk(logits, a["k"], a["vocab_start"])


class TreeBuild(DdtreeOp):
    def _run(self, root, values, ids, row_max, row_sumexp, **a):
        return m.tree_tensors(m.tree_build(int(root[0]), values, ids, row_max, row_sumexp, a["budget"]))


class AcceptWalk(DdtreeOp):
    def _run(self, tokens, parents, win_value, win_id, **a):
        return m.accept_walk_winners(tokens, parents, win_value, win_id)


OPS = (AllReduce, AllGather, Rope, KvAppend, KvCompact, MlaTreeAttention, MarlinMoE, DraftAttention, VocabWinner,
       VocabTopK, TreeBuild, AcceptWalk)
if {op.__name__ for op in OPS} != set(NODES):
    raise ImportError(f"backends/onnx_nodes.py: implementations {sorted(op.__name__ for op in OPS)} do not match the "
                      f"ddtree nodes {sorted(NODES)}")


def ops_for(group) -> list[type[OpRun]]:
    """The op classes for one rank's evaluators, with `group` bound for AllReduce."""
    return [type(op.__name__, (op,), {"group": group}) if op in (AllReduce, AllGather) else op for op in OPS]
