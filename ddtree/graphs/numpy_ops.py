"""numpy implementations of the `ddtree` nodes, as onnx.reference OpRun classes.

Each op computes in float64 and returns its outputs in the dtype of its activation inputs, so a
float64 graph reproduces the float64 reference and a bfloat16 graph rounds where a GPU would. The
math is not re-derived here: the ops call the reference (MLA absorbed attention, rope, the drafter's
rotate-half rope, masked softmax, the routing rule model.routing.route_logits), the per-rank
functions of graphs/ranks.py (experts in the kernel layout, the all-reduce sum) and tree/ (tree
build, visibility bits, acceptance walk, Gumbel noise); what is left is the plumbing between the
node's tensors and those functions.

`AllReduce` is a real cross-rank collective: ranks run their graphs in threads (graphs/runner.py)
and meet in a `RankGroup`; world_size 1 needs no group. `ops_for(group)` returns the op classes
with the group bound, for ReferenceEvaluator(model, new_ops=...).
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
from onnx.reference.op_run import OpRun

from ddtree.ops.nodes import DOMAIN, NODES, rope_config
from ddtree.model.routing import route_logits
from ddtree.plugins import layout
from ddtree.reference.drafter import rotate_half_rope
from ddtree.reference.layers import swiglu
from ddtree.reference.mla import MLA, MLAWeights, masked_softmax
from ddtree.reference.rope import rope_frequencies
from ddtree.graphs import ranks
from ddtree.tree.build import Tree, build_tree, pack_visibility, unpack_visibility
from ddtree.tree.sampling import gumbel
from ddtree.tree.walk import accept_walk

NO_ID = np.iinfo(np.int64).max


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def bits_u16(a) -> np.ndarray:
    """bf16 tensor (ml_dtypes bfloat16 from onnx, or uint16 bits) -> uint16 bit patterns."""
    a = np.asarray(a)
    return a if a.dtype == np.uint16 else a.view(np.uint16)


def seed_of(words) -> int:
    """seed [2] int32 (low word, high word) -> the 64-bit sampling seed."""
    lo, hi = (int(w) & 0xFFFFFFFF for w in np.asarray(words).reshape(-1)[:2])
    return lo | hi << 32


class RankGroup:
    """Where the simulated ranks' AllReduce nodes meet: each deposits its partial, waits for all,
    and every rank sums them in rank order (ranks.all_reduce: what a one-shot all-reduce computes)."""

    def __init__(self, size: int, timeout_s: float = 300.0):
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout_s)

    def all_reduce(self, rank: int, x: np.ndarray) -> np.ndarray:
        self.slots[rank] = x
        self.barrier.wait()
        out = ranks.all_reduce(self.slots)
        self.barrier.wait()                      # nobody reuses its slot before every rank has summed
        return out

    def abort(self) -> None:
        """A rank failed: release the others (they raise BrokenBarrierError)."""
        self.barrier.abort()


class DdtreeOp(OpRun):
    op_domain = DOMAIN


class AllReduce(DdtreeOp):
    group: RankGroup | None = None

    def _run(self, x, **a):
        if a["world_size"] == 1:
            return (np.array(x, copy=True),)
        g = self.group
        if g is None or g.size != a["world_size"]:
            raise RuntimeError(f"ddtree::AllReduce rank {a['rank']} of {a['world_size']}: no rank group of that "
                               "size is bound (run the ranks' graphs with graphs.runner.GraphRanks)")
        return (g.all_reduce(a["rank"], x),)


class MlaTreeAttention(DdtreeOp):
    def _run(self, q_nope, q_pe, kv_new, kv_b, pos, cache, cache_len, tree_mask, **a):
        R, Dr = a["kv_lora_rank"], a["qk_rope_head_dim"]
        q, T = len(q_nope), int(cache_len[0])
        if T + q > cache.shape[0]:
            raise ValueError(f"ddtree::MlaTreeAttention: cache of {cache.shape[0]} entries cannot take "
                             f"{q} tokens after {T}")
        dims = SimpleNamespace(num_attention_heads=a["heads"], qk_nope_head_dim=a["qk_nope_head_dim"],
                               v_head_dim=a["v_head_dim"], kv_lora_rank=R, qk_rope_head_dim=Dr,
                               rope=rope_config(a), softmax_scale=float(a["softmax_scale"]), rms_norm_eps=0.0)
        mla = MLA(dims)                                                       # rope tables, scale, absorbed attention
        pos = np.asarray(pos, dtype=np.int64)
        cache_out = np.array(cache, copy=True)                                # [S, R + Dr] (in place on a GPU)
        cache_out[T: T + q, :R] = kv_new[:, :R]
        cache_out[T: T + q, R:] = mla.rope.apply(f64(kv_new[:, R:]), pos).astype(cache.dtype)
        entries = f64(cache_out[: T + q])                                     # [t, R + Dr] as stored
        visible = np.concatenate([np.ones((q, T), bool),
                                  unpack_visibility(np.asarray(tree_mask).view(np.uint32), q)], axis=1)
        weights = MLAWeights(*(None,) * 5, kv_b=f64(kv_b), o=None)
        o = mla.attend_absorbed(f64(q_nope), mla.rope.apply(f64(q_pe), pos), entries[:, :R], entries[:, R:],
                                visible, weights)                             # [q, N_r, Dv]
        return o.reshape(q, -1).astype(q_nope.dtype), cache_out


class MarlinMoE(DdtreeOp):
    def _run(self, x, router_logits, bias, gu_words, gu_scales, down_words, down_scales, shared, **a):
        if a["group_size"] != layout.GROUP:
            raise ValueError(f"ddtree::MarlinMoE: group_size {a['group_size']} (the kernel layout uses {layout.GROUP})")
        start, stop = a["expert_start"], a["expert_start"] + a["experts"]
        ids, gates, _ = route_logits(f64(router_logits), f64(bias), a["topk"], a["n_group"], a["topk_group"],
                                     float(a["routed_scaling_factor"]))           # [q, k] each
        p = "model.layers.0.mlp.experts."                                     # ranks.expert_weights reads a rank's
        w = {p + "gate_up.words": np.asarray(gu_words), p + "gate_up.scales": bits_u16(gu_scales),
             p + "down.words": np.asarray(down_words), p + "down.scales": bits_u16(down_scales)}   # dict by name
        xf = f64(x)
        routed = np.zeros_like(xf)                                            # [q, H]
        for e in np.unique(ids):
            if not start <= e < stop:                                         # another rank's expert (ep)
                continue
            gate, up, down = ranks.expert_weights(w, 0, int(e) - start)
            rows, slot = np.nonzero(ids == e)
            routed[rows] += gates[rows, slot][:, None] * swiglu(xf[rows], gate, up, down)
        return ((routed + f64(shared)).astype(x.dtype),)


class DraftAttention(DdtreeOp):
    def _run(self, q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, **a):
        d, b, n, T = a["head_dim"], len(q), len(ctx_k), int(cache_len[0])
        if T + n > cache_k.shape[0]:
            raise ValueError(f"ddtree::DraftAttention: cache of {cache_k.shape[0]} entries cannot take {n} "
                             f"context tokens after {T}")
        freqs, factor = rope_frequencies(rope_config(a), d), float(a["attention_factor"])
        pos = np.asarray(pos, dtype=np.int64)
        ctx_pos = np.arange(T, T + n)
        k_out, v_out = np.array(cache_k, copy=True), np.array(cache_v, copy=True)
        k_out[T: T + n] = rotate_half_rope(f64(ctx_k), ctx_pos, freqs, factor).astype(cache_k.dtype)
        v_out[T: T + n] = ctx_v
        group = a["heads"] // a["kv_heads"]
        keys = np.repeat(np.concatenate([f64(k_out[: T + n]), rotate_half_rope(f64(k), pos, freqs, factor)]),
                         group, axis=1)                                       # [T + n + b, Hq_r, d]
        values = np.repeat(np.concatenate([f64(v_out[: T + n]), f64(v)]), group, axis=1)
        k_pos = np.concatenate([np.arange(T + n), pos])
        window = a["sliding_window"]
        visible = (pos[:, None] - k_pos[None, :] < window) if window else np.ones((b, len(k_pos)), bool)
        scores = np.einsum("qhd,khd->qhk", rotate_half_rope(f64(q), pos, freqs, factor), keys) * d ** -0.5
        o = np.einsum("qhk,khd->qhd", masked_softmax(scores, visible), values)   # [b, Hq_r, d]
        return o.reshape(b, -1).astype(q.dtype), k_out, v_out


class VocabWinner(DdtreeOp):
    def _run(self, logits, sample_pos, temperature, seed, **a):
        """This rank's (value, global id) winner per row: the sampling definition's argmax over its slice."""
        x, off, t = f64(logits), a["vocab_start"], float(np.asarray(temperature).reshape(-1)[0])
        if t > 0:
            ids = off + np.arange(x.shape[1])
            x = x / t + gumbel(seed_of(seed), np.asarray(sample_pos, np.int64)[:, None], ids[None, :])
        best = x.argmax(axis=1)                                               # first max: the lowest id
        return x.max(axis=1).astype(logits.dtype), (off + best).astype(np.int32)


class VocabTopK(DdtreeOp):
    def _run(self, logits, **a):
        """This rank's k largest logits per row (ties -> lower id) and its log-sum-exp parts, in fp32 as
        runtime/vocab_parallel.topk_logprobs computes them."""
        x, k = np.asarray(logits, dtype=np.float32), a["k"]
        if k > x.shape[1]:
            raise ValueError(f"ddtree::VocabTopK: k {k} exceeds the rank's {x.shape[1]} vocab ids")
        row_max = x.max(axis=1, keepdims=True)                                # [D, 1]
        row_sum = np.exp(x - row_max).sum(axis=1, keepdims=True, dtype=np.float32)
        local = np.broadcast_to(np.arange(x.shape[1]), x.shape)
        order = np.lexsort((local, -x), axis=1)[:, :k]
        return (np.take_along_axis(x, order, axis=1), (a["vocab_start"] + order).astype(np.int32),
                row_max[:, 0], row_sum[:, 0])


class TreeBuild(DdtreeOp):
    def _run(self, root, values, ids, row_max, row_sumexp, **a):
        """Gathered candidates [tp, D, k] -> the per-depth top-B log-probability table (the merge of
        vocab_parallel.topk_logprobs) -> tree.build_tree -> tensors and visibility bits."""
        B, tp = a["budget"], values.shape[0]
        top = row_max.max(axis=0)                                             # [D]
        total = row_sumexp[0] * np.exp(row_max[0] - top)
        for r in range(1, tp):
            total = total + row_sumexp[r] * np.exp(row_max[r] - top)
        lse = top + np.log(total)                                             # [D] fp32
        logp = np.concatenate([(values[r] - lse[:, None]).astype(np.float32) for r in range(tp)], axis=1)
        cand = np.concatenate(list(ids), axis=1).astype(np.int64)             # [D, tp k]
        order = np.lexsort((cand, -logp), axis=1)[:, : min(B, logp.shape[1])]
        tree = build_tree(int(root[0]), np.take_along_axis(logp, order, axis=1),
                          np.take_along_axis(cand, order, axis=1), B)
        if tree.size != B + 1:
            raise ValueError(f"ddtree::TreeBuild: only {tree.size - 1} candidates for a budget of {B}")
        return (tree.tokens, tree.parents, tree.depth, pack_visibility(tree.visible()).view(np.int32))


class AcceptWalk(DdtreeOp):
    def _run(self, tokens, parents, win_value, win_id, **a):
        """Merge the ranks' sampling winners (largest value, ties -> lower id, as vocab_parallel.gather_argmax)
        into the target's token at every node, then tree.walk.accept_walk."""
        top = win_value.max(axis=0)                                           # [n]
        target = np.where(win_value == top, win_id.astype(np.int64), NO_ID).min(axis=0)
        n = len(tokens)
        depth = np.zeros(n, np.int32)
        for i in range(1, n):
            depth[i] = depth[parents[i]] + 1
        walk = accept_walk(Tree(np.asarray(tokens), np.asarray(parents), depth, [()] * n, np.zeros(n, np.float32)),
                           target)
        accepted = np.full(n, -1, np.int32)
        accepted[: len(walk.accepted)] = walk.accepted
        return (target.astype(np.int32), accepted, np.array([len(walk.accepted)], np.int32),
                np.array([walk.bonus], np.int32))


OPS = (AllReduce, MlaTreeAttention, MarlinMoE, DraftAttention, VocabWinner, VocabTopK, TreeBuild, AcceptWalk)
if {op.__name__ for op in OPS} != set(NODES):
    raise ImportError(f"graphs/numpy_ops.py: numpy implementations {sorted(op.__name__ for op in OPS)} do not match "
                      f"the ddtree nodes {sorted(NODES)}")


def ops_for(group: RankGroup | None) -> list[type[OpRun]]:
    """The op classes for one rank's evaluators, with `group` bound for AllReduce."""
    bound = type("AllReduce", (AllReduce,), {"group": group})
    return [bound, *(op for op in OPS if op is not AllReduce)]
