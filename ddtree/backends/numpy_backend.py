"""The numpy backend: the op set on one rank's arrays, eagerly (math in backends/numpy_math.py).

    ops = NumpyOps(weights, RankLayout.from_plan(plan, r), collective)      # one per rank
    out = ops.call(layers.decoder_layer, cfg, L, inter, feeds={"h": h, "pos": pos, ...})   # {output name: array}
    ranks = NumpyRanks([ops_0, ops_1, ...])                                 # tp ranks as threads
    outs = ranks.call(layers.embed, cfg, feeds={"ids": ids})                # [rank] -> {name: array}

Runs tp 1 and any rank of tp N: the all-reduce is the rank's collective (parallel/collectives.py). Math is
float64; every op's output is rounded to `act` (float64 by default, so a rank computes what the
float64 oracle computes, up to summation order). Caches are the caller's arrays, updated in place
(the `cache_out` outputs are those same arrays). `weights` are a rank's tensors as
engine_dir.load_rank_tensors(..., dense=act) returns them: dense weights as floats, routed experts
in the kernel layout as stored.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ddtree.backends import numpy_math as m
from ddtree.backends.dense_experts import DenseExperts
from ddtree.description.opset import ACC, ACT, F32, I32, Ops, RankLayout
from ddtree.parallel.collectives import Identity
from ddtree.tree.prune import prune_nodes


class NumpyOps(Ops):
    def __init__(self, weights: dict[str, np.ndarray], lay: RankLayout, collective=None, act=np.float64):
        self.weights, self.lay = weights, lay
        self.collective = collective if collective is not None else Identity()
        self.dtypes = {ACT: np.dtype(act), ACC: np.dtype(act), I32: np.dtype(np.int32), F32: np.dtype(np.float32)}
        self.act = self.dtypes[ACT]
        self.feeds: dict = {}
        self.outputs: dict = {}
        self.where = f"rank {lay.rank}"
        self.dense_experts = DenseExperts()                 # the routed experts, dequantized on first use

    def call(self, fn, *args, feeds: dict) -> dict[str, np.ndarray]:
        """Run layer function fn(self, *args) on `feeds`; returns its outputs by name."""
        ints = ", ".join(str(a) for a in args if isinstance(a, int))       # the layer index, block size, ...
        self.feeds, self.outputs, self.where = feeds, {}, f"{fn.__name__}({ints}) (rank {self.lay.rank})"
        fn(self, *args)
        return self.outputs

    def _a(self, x) -> np.ndarray:
        return np.asarray(x).astype(self.act, copy=False)

    # graph boundary -------------------------------------------------------------------------------
    def input(self, name, shape, dtype):
        if name not in self.feeds:
            raise KeyError(f"{self.where}: input '{name}' {shape} was not fed")
        x = np.asarray(self.feeds[name])
        fixed = [(i, d) for i, d in enumerate(shape) if isinstance(d, int)]
        if x.ndim != len(shape) or any(x.shape[i] != d for i, d in fixed):
            raise ValueError(f"{self.where}: input '{name}' must be {shape}, got {list(x.shape)}")
        return x

    def weight(self, name):
        if name not in self.weights:
            raise KeyError(f"{self.where}: tensor '{name}' is not among the rank's weights")
        return self.weights[name]

    def output(self, name, x, shape, dtype):
        self.outputs[name] = x

    def shape(self, x):
        return np.shape(x)

    # layout ---------------------------------------------------------------------------------------
    def reshape(self, x, shape):
        return np.reshape(x, [x.shape[i] if d == 0 else d for i, d in enumerate(shape)])

    def slice(self, x, axis, start, stop):
        return np.take(x, np.arange(start, stop), axis=axis)

    def cast(self, x, dtype):
        return np.asarray(x).astype(self.dtypes[dtype], copy=False)

    # dense math -----------------------------------------------------------------------------------
    def add(self, a, b):
        return self._a(m.f64(a) + m.f64(b))

    def rms_norm(self, x, w, eps):
        return self._a(m.rms_norm(x, w, eps))

    def all_reduce_add_rms_norm(self, partial, h, w, eps, tag):
        h1 = self.add(h, self.all_reduce(partial, tag))
        return h1, self.rms_norm(h1, w, eps)

    def linear(self, x, w, out=ACT):
        return (m.f64(x) @ m.f64(w).T).astype(self.dtypes[out], copy=False)

    def swiglu_mlp(self, x, gate, up, down):
        return self._a(m.swiglu(x, gate, up, down))

    def embed(self, ids, table):
        return self._a(m.embed_rows(ids, table, self.lay.vocab_start))

    # MLA ------------------------------------------------------------------------------------------
    def rope(self, x, pos, rope):
        return self._a(m.rope_interleaved(x, pos, rope))

    def kv_append(self, cache, cache_len, c_kv, k_pe):
        return m.kv_append(cache, int(cache_len[0]), c_kv, k_pe)

    def kv_compact(self, cache, cache_len, accepted, accepted_count):
        return m.kv_compact(cache, int(cache_len[0]), accepted, int(accepted_count[0]))

    def mla_absorb_q(self, q_nope, kv_b, spec):
        return self._a(m.mla_absorb_q(q_nope, kv_b, spec))

    def mla_tree_attention(self, q_lat, q_rope, cache, cache_len, tree_mask, spec):
        return self._a(m.mla_tree_attention(q_lat, q_rope, cache, int(cache_len[0]), tree_mask, spec))

    def mla_absorb_out(self, o_lat, kv_b, spec):
        return self._a(m.mla_absorb_out(o_lat, kv_b, spec))

    def kv_append_requests(self, caches, cache_len, row_offsets, c_kv, k_pe):
        spans = m.request_spans(row_offsets, cache_len, len(caches), len(c_kv))
        return tuple(m.kv_append(c, T, c_kv[a:b], k_pe[a:b]) for c, (T, a, b) in zip(caches, spans))

    def mla_tree_attention_requests(self, q_lat, q_rope, caches, cache_len, row_offsets, tree_masks, spec):
        spans = m.request_spans(row_offsets, cache_len, len(caches), len(q_lat), tree_masks)
        return self._a(np.concatenate([m.mla_tree_attention(q_lat[a:b], q_rope[a:b], c, T, mask, spec)
                                       for c, mask, (T, a, b) in zip(caches, tree_masks, spans)]))

    # MoE ------------------------------------------------------------------------------------------
    def moe(self, x, router, bias, experts, shared, spec):
        router_logits = self.linear(x, router, out=ACC)                     # [q, E]
        return self._a(m.moe(x, router_logits, bias, experts, m.swiglu(x, *shared), spec, self.dense_experts))

    # drafter --------------------------------------------------------------------------------------
    def draft_attention(self, q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, rope, spec):
        o = m.draft_attention(q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, int(cache_len[0]), rope, spec)
        return self._a(o), cache_k, cache_v

    # collectives ----------------------------------------------------------------------------------
    def all_reduce(self, x, tag):
        return self.collective.all_reduce(self.lay.rank, x, f"{tag} in {self.where}")

    def all_gather(self, x, tag):
        return self.collective.all_gather(self.lay.rank, np.asarray(x), f"{tag} in {self.where}")

    # vocab-parallel sampling and the tree ---------------------------------------------------------
    def vocab_winner(self, logits, sample_pos, temperature, seed):
        value, winner = m.vocab_winner(logits, sample_pos, float(np.asarray(temperature).reshape(-1)[0]),
                                       m.seed_of(seed), self.lay.vocab_start)
        return value.astype(self.dtypes[ACC]), winner

    def vocab_topk(self, logits, k):
        return m.vocab_topk(logits, k, self.lay.vocab_start)

    def tree_build(self, root, values, ids, row_max, row_sumexp, budget):
        return m.tree_tensors(m.tree_build(int(np.asarray(root)[0]), values, ids, row_max, row_sumexp, budget))

    def accept_walk(self, tokens, parents, win_value, win_id):
        return m.accept_walk_winners(tokens, parents, win_value, win_id)

    # pruning a tree inside its verify -------------------------------------------------------------
    def moe_live(self, x, router, bias, experts, shared, spec, live):
        router_logits = self.linear(x, router, out=ACC)                     # [q, E]
        y, ids = m.moe_routed(x, router_logits, bias, experts, m.swiglu(x, *shared), spec, live, self.dense_experts)
        return self._a(y), ids.astype(np.int32)

    def accept_walk_live(self, tokens, parents, win_value, win_id, live):
        return m.accept_walk_winners(tokens, parents, win_value, win_id, live)

    def tree_prune(self, live, parents, path_prob, routed_ids, rate, expert_bytes, horizon):
        return prune_nodes(live, parents, path_prob, routed_ids, int(np.asarray(expert_bytes).reshape(-1)[0]),
                           float(np.asarray(rate, np.float32).reshape(-1)[0]), horizon=horizon)


class NumpyRanks:
    """Every rank of one engine in this process: a layer function runs on all ranks at once (threads
    when tp > 1, meeting in their collective), as the rank processes will."""

    def __init__(self, ranks: list[NumpyOps]):
        self.ranks = ranks
        self.tp = len(ranks)
        self.pool = ThreadPoolExecutor(self.tp) if self.tp > 1 else None

    def call(self, fn, *args, feeds) -> list[dict[str, np.ndarray]]:
        """feeds: one dict for every rank, or a list with one per rank."""
        per_rank = feeds if isinstance(feeds, list) else [feeds] * self.tp
        return run_on_ranks(self.pool, [r.collective for r in self.ranks],
                            [lambda r=r: self.ranks[r].call(fn, *args, feeds=per_rank[r]) for r in range(self.tp)])


def run_on_ranks(pool, collectives, jobs) -> list:
    """Run one job per rank (in `pool` when there is more than one) and return their results in rank
    order. A failing rank aborts the collectives (releasing the ranks waiting there), and its own
    error is raised, not the broken-barrier errors of the ranks it released."""
    def guarded(job, collective):
        try:
            return job()
        except BaseException:
            collective.abort()
            raise

    if pool is None:
        return [job() for job in jobs]
    futures = [pool.submit(guarded, job, c) for job, c in zip(jobs, collectives)]
    errors = [f.exception() for f in futures]
    if any(errors):
        for c in collectives:
            if hasattr(c, "reset"):
                c.reset()
        raise next((e for e in errors if e and not isinstance(e, threading.BrokenBarrierError)),
                   next(e for e in errors if e))
    return [f.result() for f in futures]
