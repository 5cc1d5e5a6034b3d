"""The meter backend: walks the layer functions with shapes only and counts, per op, the bytes a GPU
reads and writes (weights + activations + cache), the FLOPs, the kernels it launches and the
collectives with their message sizes. CPU only; nothing is allocated.

    recs = meter_step(cfg, dcfg, plan, specs, rank=0, context=4096, budget=16)   # one DDTree step
    totals(recs)  -> {"read", "written", "flops", "kernels", "all_reduces", "message_bytes"}

Byte model (the engine's dtypes: ACT bf16, ACC fp32; weights as stored): a linear reads its weight
once and its input, writes its output; views (reshape, slice, a cast to the same dtype) are free; the
MLA attention reads the cache rows [0, T + q); the MoE op is three records: `moe.router` (router
weight + input, as `ddtree bench moe`'s router row), `moe.experts` (the routed experts a batch
touches + the input in and the output out, as its experts row) and `moe.shared` (the shared expert's
slice). Routed experts touched: with `routing="uniform"` each token picks top-k of E uniformly, so a
rank holding E_r experts expects E_r (1 - (1 - k/E)^M) of them for M tokens; with `routing="given"`
the counts come from outside (`distinct=`: one number for every MoE layer, or one per MoE layer in call
order, each the experts of this rank's E_r touched: ddtree/bench/routing.py). Collectives move no
device-memory bytes here (the step benchmark models them apart); their message bytes are recorded.
Kernel counts are the CUDA backend's launches per op (KERNELS).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from ddtree.description import layers, stack
from ddtree.description.opset import ACC, ACT, F32, I32, Ops, RankLayout

STORED_BYTES = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8}
KERNELS = {"add": 1, "rms_norm": 1, "all_reduce_add_rms_norm": 1, "linear": 1, "swiglu_mlp": 2, "embed": 1, "cast": 1,
           "rope": 1, "kv_append": 1, "kv_append_normed": 1, "kv_compact": 1, "mla_absorb_q": 1,
           "mla_absorb_q_rope": 1, "mla_tree_attention": 2, "mla_absorb_out": 1,
           "kv_append_requests": 1, "mla_tree_attention_requests": 2,                    # per request (R launches)
           "moe.router": 1, "moe.experts": 2, "moe.shared": 2, "draft_attention": 1, "all_reduce": 1, "all_gather": 1,
           "vocab_winner": 1, "vocab_topk": 2, "tree_build": 1, "accept_walk": 1}


@dataclass(frozen=True)
class Meta:
    shape: tuple
    nbytes_each: int            # bytes per element
    weight: bool = False        # one of the rank's tensors (or the part of one an op reads)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.nbytes_each


@dataclass
class Record:
    op: str
    kind: str = ""
    read: int = 0               # bytes, weights included
    written: int = 0
    weight_read: int = 0        # of `read`, the bytes of weights
    flops: int = 0
    kernels: int = 0
    collective: str | None = None
    message_bytes: int = 0
    detail: dict = field(default_factory=dict)


def expected_distinct(experts_held: int, n_routed: int, topk: int, tokens: int) -> float:
    """Experts of a rank's `experts_held` that M tokens touch, each token picking top-k of E uniformly."""
    return experts_held * (1.0 - (1.0 - topk / n_routed) ** tokens)


class MeterOps(Ops):
    def __init__(self, lay: RankLayout, specs: dict, dims: dict[str, int], act_bytes: int = 2, acc_bytes: int = 4,
                 routing: str = "uniform", distinct=None):
        if routing not in ("uniform", "given"):
            raise ValueError(f"meter: routing {routing!r} is not modelled (uniform or given)")
        if (routing == "given") != (distinct is not None):
            raise ValueError("meter: distinct expert counts go with routing='given' (and only with it)")
        self.distinct = None if distinct is None else np.atleast_1d(np.asarray(distinct, dtype=np.float64))
        self.moe_calls = 0
        self.lay, self.specs, self.dims = lay, specs, dims
        self.sizes = {ACT: act_bytes, ACC: acc_bytes, I32: 4, F32: 4}
        self.records: list[Record] = []
        self.kind = ""

    def _rec(self, op: str, inputs=(), outputs=(), flops: int = 0, **kw) -> Record:
        r = Record(op, self.kind, sum(x.nbytes for x in inputs), sum(x.nbytes for x in outputs),
                   sum(x.nbytes for x in inputs if x.weight), int(flops), KERNELS[op], **kw)
        self.records.append(r)
        return r

    def _t(self, shape, dtype: str) -> Meta:
        return Meta(tuple(int(d) for d in shape), self.sizes[dtype])

    # graph boundary -------------------------------------------------------------------------------
    def input(self, name, shape, dtype):
        return self._t([self.dims[d] if isinstance(d, str) else d for d in shape], dtype)

    def weight(self, name):
        if name not in self.specs:
            raise KeyError(f"meter: tensor '{name}' is not among the rank's tensors")
        spec = self.specs[name]
        return Meta(tuple(spec.shape), STORED_BYTES[spec.dtype], weight=True)

    def output(self, name, x, shape, dtype):
        pass

    def shape(self, x):
        return x.shape

    # layout ---------------------------------------------------------------------------------------
    def reshape(self, x, shape):
        out = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        if -1 in out:
            out[out.index(-1)] = x.size // -int(np.prod(out))
        return Meta(tuple(out), x.nbytes_each)

    def slice(self, x, axis, start, stop):
        return Meta(x.shape[:axis] + (stop - start,) + x.shape[axis + 1:], x.nbytes_each)

    def cast(self, x, dtype):
        out = Meta(x.shape, self.sizes[dtype])
        if out.nbytes_each != x.nbytes_each:
            self._rec("cast", [x], [out])
        return out

    # dense math -----------------------------------------------------------------------------------
    def add(self, a, b):
        out = Meta(a.shape, self.sizes[ACT])
        self._rec("add", [a, b], [out], a.size)
        return out

    def rms_norm(self, x, w, eps):
        out = Meta(x.shape, self.sizes[ACT])
        self._rec("rms_norm", [x, w], [out], 4 * x.size)
        return out

    def all_reduce_add_rms_norm(self, partial, h, w, eps, tag):
        h1, x = Meta(h.shape, self.sizes[ACT]), Meta(h.shape, self.sizes[ACT])
        self._rec("all_reduce_add_rms_norm", [partial, h, w], [h1, x], 5 * h.size, collective="all_reduce",
                  message_bytes=partial.nbytes)
        return h1, x

    def linear(self, x, w, out=ACT):
        y = Meta((x.shape[0], w.shape[0]), self.sizes[out])
        self._rec("linear", [x, w], [y], 2 * x.shape[0] * w.shape[0] * w.shape[1])
        return y

    def linears(self, x, ws) -> tuple:
        """One GEMM over the weights side by side, as the cuda backend runs them (one record, one kernel)."""
        N, K = sum(w.shape[0] for w in ws), ws[0].shape[1]
        self.linear(x, Meta((N, K), ws[0].nbytes_each, weight=True))
        return tuple(Meta((x.shape[0], w.shape[0]), self.sizes[ACT]) for w in ws)

    def swiglu_mlp(self, x, gate, up, down):
        y = Meta((x.shape[0], down.shape[0]), self.sizes[ACT])
        self._rec("swiglu_mlp", [x, gate, up, down], [y], 2 * x.shape[0] * (gate.size + up.size + down.size))
        return y

    def embed(self, ids, table):
        rows = Meta((ids.shape[0], table.shape[1]), table.nbytes_each, weight=True)     # the rows looked up
        out = Meta(rows.shape, self.sizes[ACT])
        self._rec("embed", [ids, rows], [out])
        return out

    # MLA ------------------------------------------------------------------------------------------
    def rope(self, x, pos, rope):
        out = Meta(x.shape, self.sizes[ACT])
        self._rec("rope", [x, pos], [out], 6 * x.size)
        return out

    def kv_append(self, cache, cache_len, c_kv, k_pe):
        self._rec("kv_append", [c_kv, k_pe, cache_len], [Meta((c_kv.shape[0], cache.shape[1]), cache.nbytes_each)])
        return cache

    def kv_append_normed(self, cache, cache_len, latent, norm_w, eps, pos, rope):
        q, W = latent.shape                                     # one kernel (the cuda backend's): norm, rope, append
        self._rec("kv_append_normed", [latent, norm_w, pos, cache_len], [Meta((q, cache.shape[1]), cache.nbytes_each)],
                  4 * q * norm_w.shape[0] + 6 * q * (W - norm_w.shape[0]))
        return cache

    def kv_compact(self, cache, cache_len, accepted, accepted_count):
        layers = int(np.prod(cache.shape[:-2]))                                   # [S, W] or stacked [L, S, W]
        rows = Meta((layers * self.dims["accepted"], cache.shape[-1]), cache.nbytes_each)   # the kept rows, moved
        self._rec("kv_compact", [rows, cache_len, accepted, accepted_count], [rows])
        return cache

    def _w_half(self, kv_b, spec, dim: int) -> Meta:
        return Meta((spec.heads, dim, spec.kv_lora_rank), kv_b.nbytes_each, weight=True)   # W_UK or W_UV of kv_b

    def mla_absorb_q(self, q_nope, kv_b, spec):
        q = q_nope.shape[0]
        out = Meta((q, spec.heads, spec.kv_lora_rank), self.sizes[ACT])
        self._rec("mla_absorb_q", [q_nope, self._w_half(kv_b, spec, spec.nope_dim)], [out],
                  2 * q * spec.heads * spec.nope_dim * spec.kv_lora_rank)
        return out

    def mla_absorb_q_rope(self, q_all, kv_b, pos, rope, spec):
        q, N, Dn, Dr = q_all.shape[0], spec.heads, spec.nope_dim, spec.rope_dim     # one kernel (the cuda backend's)
        q_lat, q_rope = Meta((q, N, spec.kv_lora_rank), self.sizes[ACT]), Meta((q, N, Dr), self.sizes[ACT])
        self._rec("mla_absorb_q_rope", [q_all, self._w_half(kv_b, spec, Dn), pos], [q_lat, q_rope],
                  2 * q * N * Dn * spec.kv_lora_rank + 6 * q * N * Dr)
        return q_lat, q_rope

    def mla_tree_attention(self, q_lat, q_rope, cache, cache_len, tree_mask, spec):
        q, t = q_lat.shape[0], self.dims["T"] + q_lat.shape[0]
        rows = Meta((t, cache.shape[1]), cache.nbytes_each)                        # the cache rows read
        out = Meta((q, spec.heads, spec.kv_lora_rank), self.sizes[ACT])
        flops = 2 * q * spec.heads * t * (cache.shape[1] + spec.kv_lora_rank)     # scores + P V
        self._rec("mla_tree_attention", [q_lat, q_rope, rows, cache_len, tree_mask], [out], flops)
        return out

    def _requests(self, rows: int) -> list[tuple[int, int]]:
        """The union verify's requests from dims["requests"]: [(cache length T_i, rows q_i)], rows summing to the
        call's."""
        reqs = [(int(T), int(q)) for T, q in self.dims["requests"]]
        if sum(q for _, q in reqs) != rows:
            raise ValueError(f"meter: dims['requests'] {reqs} hold {sum(q for _, q in reqs)} rows, the call {rows}")
        return reqs

    def kv_append_requests(self, caches, cache_len, row_offsets, c_kv, k_pe):
        for i, (cache, (_, q)) in enumerate(zip(caches, self._requests(c_kv.shape[0]))):   # one append each
            self._rec("kv_append_requests", [Meta((q, c_kv.shape[1]), c_kv.nbytes_each),
                                             Meta((q, k_pe.shape[1]), k_pe.nbytes_each), Meta((1,), 4)],
                      [Meta((q, cache.shape[1]), cache.nbytes_each)], detail={"request": i})
        return caches

    def mla_tree_attention_requests(self, q_lat, q_rope, caches, cache_len, row_offsets, tree_masks, spec):
        """One record per request: its rows read its own cache prefix and new rows, nothing of the others'."""
        N, R = spec.heads, spec.kv_lora_rank
        for i, (cache, mask, (T, q)) in enumerate(zip(caches, tree_masks, self._requests(q_lat.shape[0]))):
            rows = Meta((T + q, cache.shape[1]), cache.nbytes_each)
            self._rec("mla_tree_attention_requests",
                      [Meta((q, N, R), q_lat.nbytes_each), Meta((q, N, spec.rope_dim), q_rope.nbytes_each), rows,
                       Meta((1,), 4), Meta((q, -(-q // 32)), mask.nbytes_each)],
                      [Meta((q, N, R), self.sizes[ACT])], 2 * q * N * (T + q) * (cache.shape[1] + R),
                      detail={"request": i})
        return Meta((q_lat.shape[0], N, R), self.sizes[ACT])

    def mla_absorb_out(self, o_lat, kv_b, spec):
        q = o_lat.shape[0]
        out = Meta((q, spec.heads * spec.v_dim), self.sizes[ACT])
        self._rec("mla_absorb_out", [o_lat, self._w_half(kv_b, spec, spec.v_dim)], [out],
                  2 * q * spec.heads * spec.v_dim * spec.kv_lora_rank)
        return out

    # MoE ------------------------------------------------------------------------------------------
    def moe(self, x, router, bias, experts, shared, spec):
        M, H = x.shape
        self._rec("moe.router", [x, router, bias], [], 2 * M * router.size)      # logits and routing stay on chip
        distinct = self._distinct(spec, M)
        per_expert = sum(w.nbytes for w in experts.values()) / spec.experts
        touched = Meta((round(distinct * per_expert),), 1, weight=True)
        y = Meta((M, H), self.sizes[ACT])
        share = spec.experts / spec.n_routed_experts                              # of each token's k (ep: < 1)
        self._rec("moe.experts", [x, touched], [y], 2 * M * spec.topk * share * 3 * spec.inter * H,
                  detail={"expected_distinct": distinct})
        self._rec("moe.shared", [x, *shared], [], 2 * M * sum(w.size for w in shared))   # added in down's epilogue
        return y

    def _distinct(self, spec, M: int) -> float:
        """Routed experts of this rank the M tokens of this MoE call touch."""
        call, self.moe_calls = self.moe_calls, self.moe_calls + 1
        if self.distinct is None:
            return expected_distinct(spec.experts, spec.n_routed_experts, spec.topk, M)
        if self.distinct.size > 1 and call >= self.distinct.size:
            raise ValueError(f"meter: MoE call {call + 1} but only {self.distinct.size} distinct counts given")
        d = float(self.distinct[call if self.distinct.size > 1 else 0])
        if not 0 <= d <= spec.experts:
            raise ValueError(f"meter: distinct experts {d} outside 0..{spec.experts} (the rank's experts)")
        return d

    # drafter --------------------------------------------------------------------------------------
    def draft_attention(self, q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, rope, spec):
        t = self.dims["T_draft"] + ctx_k.shape[0]
        rows = Meta((2 * t, spec.kv_heads, spec.head_dim), cache_k.nbytes_each)    # K and V rows read
        o = Meta((q.shape[0], spec.heads * spec.head_dim), self.sizes[ACT])
        self._rec("draft_attention", [q, k, v, ctx_k, ctx_v, rows], [o, ctx_k, ctx_v],
                  4 * q.shape[0] * spec.heads * (t + q.shape[0]) * spec.head_dim)
        return o, cache_k, cache_v

    # collectives ----------------------------------------------------------------------------------
    def all_reduce(self, x, tag):
        self._rec("all_reduce", collective="all_reduce", message_bytes=x.nbytes)
        return Meta(x.shape, x.nbytes_each)

    def all_gather(self, x, tag):
        self._rec("all_gather", collective="all_gather", message_bytes=x.nbytes)
        return Meta((self.lay.tp, *x.shape), x.nbytes_each)

    # vocab-parallel sampling and the tree ---------------------------------------------------------
    def vocab_winner(self, logits, sample_pos, temperature, seed):
        q = logits.shape[0]
        value, winner = Meta((q,), self.sizes[ACC]), Meta((q,), 4)
        self._rec("vocab_winner", [logits, sample_pos], [value, winner], 2 * logits.size)
        return value, winner

    def vocab_topk(self, logits, k):
        D = logits.shape[0]
        outs = (Meta((D, k), 4), Meta((D, k), 4), Meta((D,), 4), Meta((D,), 4))
        self._rec("vocab_topk", [logits], outs, 3 * logits.size)
        return outs

    def tree_build(self, root, values, ids, row_max, row_sumexp, budget):
        n = budget + 1
        outs = (Meta((n,), 4), Meta((n,), 4), Meta((n,), 4), Meta((n, -(-n // 32)), 4))
        self._rec("tree_build", [root, values, ids, row_max, row_sumexp], outs)
        return outs

    def accept_walk(self, tokens, parents, win_value, win_id):
        n = tokens.shape[0]
        outs = (Meta((n,), 4), Meta((n,), 4), Meta((1,), 4), Meta((1,), 4))
        self._rec("accept_walk", [tokens, parents, win_value, win_id], outs)
        return outs


def meter_call(ops: MeterOps, kind: str, fn, *args) -> list[Record]:
    """Records of one layer function call, labelled with `kind`."""
    ops.kind, first = kind, len(ops.records)
    fn(ops, *args)
    return ops.records[first:]


class MeterRun:
    """description/stack.py's `run` on the meter: each call's records labelled with its kind (the tree's kind
    without its budget), `q` the drafter's block or the verify's nodes. Outputs are not values: none is read."""

    def __init__(self, ops: MeterOps, block: int, nodes: int):
        self.ops, self.block, self.nodes = ops, block, nodes

    def __call__(self, kind: str, fn, args: tuple, feeds: dict, layer: int | None = None) -> dict:
        self.ops.dims["q"] = self.block if kind.startswith("draft") else self.nodes
        meter_call(self.ops, "tree" if kind.startswith("tree_b") else kind, fn, *args)
        return defaultdict(lambda: None)


NO_CACHES = stack.InPlace(lambda L: {})         # the meter's caches are shapes: its dims S, T
TARGET_CACHES = stack.InPlace(lambda L: {}, stacked=lambda: {})   # as the cuda executor's: compacted in one call


def meter_step(cfg, dcfg, plan: dict, specs: dict, rank: int = 0, context: int = 4096, budget: int = 16,
               new_context: int | None = None, **kw) -> list[Record]:
    """One DDTree step of rank `rank` (description/stack.py ddtree_step): drafter over the block (with
    `new_context` accepted tokens as its new context, default the block size), the tree, the target verifying
    budget + 1 nodes after `context` cached tokens, the acceptance walk, the compaction of every layer's cache to
    as many rows. `specs`: the rank's tensors (builder/weights.rank_tensor_specs)."""
    lay = RankLayout.from_plan(plan, rank)
    b, q, n = dcfg.block_size, budget + 1, dcfg.block_size if new_context is None else new_context
    k = layers.draft_topk([budget], lay.vocab_stop - lay.vocab_start)
    dims = {"q": b, "n": n, "T": context, "T_draft": context, "S": context + q, "W": -(-q // 32), "nodes": q,
            "accepted": n, "L": cfg.num_hidden_layers}
    ops = MeterOps(lay, specs, dims, **kw)
    feeds = stack.StepFeeds({"ctx_taps": None, "ids": None, "pos": None, "cache_len": None}, None,
                            verify=lambda tree: {"ids": None, "pos": None, "cache_len": None, "tree_mask": None},
                            head=lambda verify: {}, compact=lambda walk: {})
    stack.ddtree_step(MeterRun(ops, b, q), cfg, dcfg, plan["per_rank"]["moe_intermediate"], k, budget, feeds,
                      TARGET_CACHES, NO_CACHES)
    return ops.records


def totals(records: list[Record]) -> dict:
    return {"read": sum(r.read for r in records), "written": sum(r.written for r in records),
            "flops": sum(r.flops for r in records), "kernels": sum(r.kernels for r in records),
            "all_reduces": sum(r.collective == "all_reduce" for r in records),
            "message_bytes": sum(r.message_bytes for r in records)}



def meter_ar_step(cfg, plan: dict, specs: dict, rank: int = 0, context: int = 4096, **kw) -> list[Record]:
    """One autoregressive step of rank `rank` (description/stack.py ar_step): the target over one token after
    `context` cached tokens, and its head (the sampler reads the logits). No drafter, no tree, no compaction."""
    lay = RankLayout.from_plan(plan, rank)
    ops = MeterOps(lay, specs, {"q": 1, "T": context, "S": context + 1, "W": 1, "nodes": 1}, **kw)
    stack.ar_step(MeterRun(ops, 1, 1), cfg, plan["per_rank"]["moe_intermediate"],
                  {"ids": None, "pos": None, "cache_len": None, "tree_mask": None}, NO_CACHES, {})
    return ops.records
