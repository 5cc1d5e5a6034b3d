"""The torch backend: the op set on torch tensors at tp 1, differentiable, so training runs description/layers.py too.

    ops = TorchOps(weights, tp1_layout(cfg, dcfg))           # weights: name -> tensor (a module's parameters)
    out = ops.call(layers.decoder_layer, cfg, L, inter, feeds={"h": h, "pos": pos, ...})    # {output name: tensor}
    logits, taps = target_forward(ops, cfg, ids, pos, caches, cache_len, tree_mask, taps)  # the target stack

A batch: every per-sequence tensor carries a leading batch dim B that the op set does not name (h [B, q, H],
ids [B, q], cache [B, S, R + Dr], ctx_taps [B, n, K H], logits [B, q, V], ...). The sequences of a batch are
aligned, so the step-wide inputs (STEP_INPUTS: pos [q], cache_len [1], tree_mask [q, W], ...) have no B.
`shape` reports the op set's shape (a weight's own, an activation's without B); `reshape` and `slice` act on
the dims after B.

Weights are the checkpoint's canonical names (at tp 1 the rank-file names; the drafter's prefixed `drafter.`),
e.g. a training model's parameters and buffers: gradients reach them through every op. The routed experts stay
float, one [I, H] / [H, I] triple per expert (`...mlp.experts.<e>.gate_proj.weight`, as the checkpoint names
them): asked for the kernel-layout names (`...mlp.experts.gate_up.words` and the other three), `weight` answers
with that layer's `RoutedExperts`, and `moe` runs them, through `fake_quant` (their INT4 grid, straight-through
gradient) when `expert_quant` is a group size: training's QAT. A checkpoint read by training/export.load_target
holds the stored INT4 experts dequantised, so inference here computes what the kernels' layout holds.

Training parts, off by default: `dropout`, on the branch outputs where they join the residual stream (the
all-reduces tagged "attn" and "mlp", identities at tp 1); `loads`, the tokens per routed expert of each MoE
layer in the last call (by router weight name), for the aux-loss-free bias balancing.

Dtypes: ACT is `act` (float32 by default); ACC, the router and lm_head logits, is float32 (float64 when act is)
with autocast off; other math follows torch (bf16 matmuls under training's autocast). The sampling, top-k, tree
and walk ops run backends/numpy_math.py's definitions one sequence at a time (no gradient flows through them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.backends import numpy_math as m
from ddtree.description import layers, stack
from ddtree.description.opset import ACC, ACT, F32, I32, Ops, RankLayout
from ddtree.model.rope import rope_frequencies, rope_magnitude
from ddtree.model.routing import NORM_EPS
from ddtree.tree.build import pack_visibility

STEP_INPUTS = frozenset({"pos", "cache_len", "tree_mask", "accepted", "accepted_count", "sample_pos",
                         "temperature", "seed"})           # shared by the aligned sequences of a batch: no B
RESIDUAL_BRANCHES = ("attn", "mlp")                         # all-reduce tags where a branch joins the residual
EXPERT_KERNEL_NAME = re.compile(r"(.*\.)experts\.(gate_up|down)\.(words|scales)")


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest bf16 (RNE), kept in x's dtype: what the checkpoint stores."""
    return x.to(torch.bfloat16).to(x.dtype)


def fake_quant(w: torch.Tensor, group: int) -> torch.Tensor:
    """W [N, K] -> its INT4 group-`group` dequantised value (as int4.quantize_int4: scale = bf16(amax/7),
    q = clip(rint(w / scale), -7, 7)); the gradient passes straight through to w."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    amax = g.detach().abs().amax(dim=2, keepdim=True)
    scale = bf16_round(torch.where(amax > 0, amax / 7.0, torch.ones_like(amax)))
    q = torch.clamp(torch.round(g / scale), -7, 7) * scale
    return (g + (q - g).detach()).reshape(n, k)


@dataclass(frozen=True)
class RoutedExperts:
    """One MoE layer's routed experts as float weights: gate, up [I, H] and down [H, I] per expert."""
    gate: tuple
    up: tuple
    down: tuple

    def of(self, e: int, quant_group: int = 0) -> tuple:
        """Expert e's (gate, up, down), on their INT4 grid when quant_group > 0 (fake_quant)."""
        w = (self.gate[e], self.up[e], self.down[e])
        return tuple(fake_quant(x, quant_group) for x in w) if quant_group else w


def tp1_layout(cfg, dcfg=None) -> RankLayout:
    """One rank holding everything: the whole vocab, every expert, every drafter fc column."""
    fc = dcfg.num_taps * dcfg.hidden_size if dcfg is not None else 0
    return RankLayout(0, 1, 0, cfg.vocab_size, 0, cfg.n_routed_experts, 0, fc)


@lru_cache(maxsize=16)
def _frequencies(rope, dim: int) -> torch.Tensor:
    return torch.from_numpy(rope_frequencies(rope, dim))                                # [dim/2] float64


def rope_table(pos: torch.Tensor, rope, dim: int, scale: float, dtype) -> tuple:
    """pos [..., q] -> cos, sin [..., q, 1, dim/2] (angles in float64 as the reference's), times `scale`."""
    angle = pos.to(torch.float64)[..., None] * _frequencies(rope, dim)
    return ((torch.cos(angle) * scale).to(dtype)[..., None, :], (torch.sin(angle) * scale).to(dtype)[..., None, :])


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The drafter's rope: halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def visibility(words: torch.Tensor, n: int) -> torch.Tensor:
    """tree_mask [q, W] int32 bit-words -> visible [q, n] bool (bit j of row i: words[i][j >> 5] >> (j & 31))."""
    j = torch.arange(n)
    return ((words.to(torch.int32)[:, j >> 5] >> (j & 31).to(torch.int32)) & 1).bool()


@lru_cache(maxsize=8)
def causal_mask(q: int) -> torch.Tensor:
    """[q, ceil(q / 32)] int32: each new token sees the new tokens up to and including itself."""
    return torch.from_numpy(pack_visibility(np.tril(np.ones((q, q), bool))).view(np.int32))


def top_lowest_id(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last axis, ties toward the lower index (model/routing.py's rule)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def select_experts(choice: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """Selection scores c [n, E] (sigmoid + correction bias) -> experts [n, k]: model/routing.route_logits's
    group-limited top-k (a group scores the sum of its top-2 c; the best topk_group groups stay selectable)."""
    n, E = choice.shape
    if n_group > 1:
        per = E // n_group
        group_score = choice.view(n, n_group, per).topk(2, dim=-1).values.sum(-1)      # [n, G]
        kept = torch.zeros(n, n_group, dtype=torch.bool).scatter_(1, top_lowest_id(group_score, topk_group), True)
        choice = choice.masked_fill(~kept.repeat_interleave(per, dim=1), float("-inf"))
    return top_lowest_id(choice, k)


def per_sequence(fn, *xs) -> tuple:
    """Run numpy fn on each sequence's slice of xs (tensors [B, ...], or step-wide values passed as they are)
    -> its outputs stacked over B, as tensors."""
    B = next(x.shape[0] for x in xs if isinstance(x, torch.Tensor))
    rows = [fn(*(x[b].detach().cpu().numpy() if isinstance(x, torch.Tensor) else x for x in xs)) for b in range(B)]
    return tuple(torch.from_numpy(np.stack([np.asarray(r[i]) for r in rows])) for i in range(len(rows[0])))


class TorchOps(Ops):
    def __init__(self, weights, lay: RankLayout, act=torch.float32, expert_quant: int = 0, dropout: float = 0.0):
        if lay.tp != 1:
            raise ValueError(f"TorchOps runs tp 1 (one rank holding everything), not rank {lay.rank} of tp {lay.tp}")
        self.weights, self.lay, self.act = weights, lay, act
        self.expert_quant, self.dropout = expert_quant, dropout
        acc = torch.promote_types(act, torch.float32)
        self.dtypes = {ACT: act, ACC: acc, F32: torch.float32, I32: torch.int32}
        self.names = {id(t): n for n, t in weights.items()}        # what `shape` treats as a weight; router names
        self.loads: dict[str, torch.Tensor] = {}
        self.routed: dict[str, RoutedExperts] = {}
        self.feeds: dict = {}
        self.outputs: dict = {}
        self.where = "torch"

    def run(self, kind: str, fn, args: tuple, feeds: dict, layer: int | None = None) -> dict[str, torch.Tensor]:
        """description/stack.py's run: one rank, every kind alike."""
        return self.call(fn, *args, feeds=feeds)

    def call(self, fn, *args, feeds: dict) -> dict[str, torch.Tensor]:
        """Run layer function fn(self, *args) on `feeds`; returns its outputs by name."""
        ints = ", ".join(str(a) for a in args if isinstance(a, int))
        self.feeds, self.outputs, self.where = feeds, {}, f"{fn.__name__}({ints}) (torch)"
        fn(self, *args)
        return self.outputs

    # graph boundary -------------------------------------------------------------------------------
    def input(self, name, shape, dtype):
        if name not in self.feeds:
            raise KeyError(f"{self.where}: input '{name}' {shape} was not fed")
        x = torch.as_tensor(self.feeds[name])
        step = name in STEP_INPUTS
        dims = list(x.shape) if step else list(x.shape[1:])
        if (not step and x.ndim == 0) or len(dims) != len(shape) or any(
                dims[i] != d for i, d in enumerate(shape) if isinstance(d, int)):
            want = shape if step else ["B", *shape]
            raise ValueError(f"{self.where}: input '{name}' must be {want}, got {list(x.shape)}")
        return x

    def weight(self, name):
        if name in self.weights:
            return self.weights[name]
        kernel = EXPERT_KERNEL_NAME.fullmatch(name)
        if kernel:
            return self._routed_experts(kernel.group(1))
        raise KeyError(f"{self.where}: tensor '{name}' is not among the weights")

    def _routed_experts(self, m_prefix: str) -> RoutedExperts:
        """`{m_prefix}experts.<e>.{gate,up,down}_proj.weight` for the layout's experts, as one RoutedExperts."""
        if m_prefix not in self.routed:
            lay = self.lay
            triples = [[self.weight(f"{m_prefix}experts.{e}.{p}_proj.weight") for e in range(lay.expert_start,
                                                                                          lay.expert_stop)]
                       for p in ("gate", "up", "down")]
            self.routed[m_prefix] = RoutedExperts(*(tuple(t) for t in triples))
        return self.routed[m_prefix]

    def output(self, name, x, shape, dtype):
        self.outputs[name] = x

    def shape(self, x):
        return tuple(x.shape) if id(x) in self.names else tuple(x.shape[1:])

    # layout ---------------------------------------------------------------------------------------
    def reshape(self, x, shape):
        return x.reshape(x.shape[0], *(x.shape[i + 1] if d == 0 else d for i, d in enumerate(shape)))

    def slice(self, x, axis, start, stop):
        return x.narrow(axis + 1, start, stop - start)

    def cast(self, x, dtype):
        return x.to(self.dtypes[dtype])

    # dense math -----------------------------------------------------------------------------------
    def add(self, a, b):
        return a + b

    def rms_norm(self, x, w, eps):
        x = x.to(self.dtypes[ACC])
        return (w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))).to(self.act)

    def all_reduce_add_rms_norm(self, partial, h, w, eps, tag):
        h1 = self.add(h, self.all_reduce(partial, tag))
        return h1, self.rms_norm(h1, w, eps)

    def linear(self, x, w, out=ACT):
        if out == ACT:
            return F.linear(x, w)
        acc = self.dtypes[out]
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.to(acc), w.to(acc))

    def swiglu_mlp(self, x, gate, up, down):
        return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)

    def embed(self, ids, table):
        return F.embedding(ids.long() - self.lay.vocab_start, table)

    # MLA ------------------------------------------------------------------------------------------
    def rope(self, x, pos, rope):
        """Interleaved pairs (2i, 2i+1) turned by pos * phi_i (YaRN table), x [B, q, n, Dr], pos [q] or [B, q]."""
        cos, sin = rope_table(pos, rope, x.shape[-1], rope_magnitude(rope), self.dtypes[ACC])
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

    def kv_append(self, cache, cache_len, c_kv, k_pe):
        T, q, R = int(cache_len[0]), c_kv.shape[1], c_kv.shape[-1]
        m.check_room("kv_append", cache.shape[1], T, q)
        cache[:, T: T + q, :R] = c_kv
        cache[:, T: T + q, R:] = k_pe
        return cache

    def kv_compact(self, cache, cache_len, accepted, accepted_count):
        T, count = int(cache_len[0]), int(accepted_count[0])
        keep = torch.as_tensor(accepted).long().reshape(-1)[:count]
        if count < 0 or len(keep) != count or bool((keep.diff() <= 0).any()) or (
                count and (keep[0] < 0 or T + keep[-1] >= cache.shape[1])):
            raise ValueError(f"kv_compact: accepted {keep.tolist()} (count {count}) must be increasing rows after "
                             f"{T} inside a cache of {cache.shape[1]}")
        cache[:, T: T + count] = cache[:, T + keep]                   # the gather copies before the write
        return cache

    def mla_absorb_q(self, q_nope, kv_b, spec):
        w_uk = kv_b.reshape(spec.heads, spec.nope_dim + spec.v_dim, -1)[:, :spec.nope_dim]      # [N, Dn, R]
        return torch.einsum("bqnd,ndr->bqnr", q_nope, w_uk)

    def mla_tree_attention(self, q_lat, q_rope, cache, cache_len, tree_mask, spec):
        """One key head shared by every query head (the latent): heads fold into the query rows [q N]."""
        T, (B, q, N, R) = int(cache_len[0]), q_lat.shape
        m.check_room("mla_tree_attention", cache.shape[1], T, q)     # the q new rows are already appended
        visible = torch.ones(q, T + q, dtype=torch.bool)
        visible[:, T:] = visibility(torch.as_tensor(tree_mask), q)
        query = torch.cat([q_lat, q_rope.to(q_lat.dtype)], dim=-1).reshape(B, 1, q * N, -1)   # [B, 1, q N, R + Dr]
        keys = cache[:, None, : T + q].to(q_lat.dtype)                                    # [B, 1, T + q, R + Dr]
        values = F.pad(keys[..., :R], (0, keys.shape[-1] - R))       # padded to the key width: the fused CPU kernel
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible.repeat_interleave(N, dim=0),
                                           scale=spec.softmax_scale)
        return o[..., :R].reshape(B, q, N, R)

    def mla_absorb_out(self, o_lat, kv_b, spec):
        w_uv = kv_b.reshape(spec.heads, spec.nope_dim + spec.v_dim, -1)[:, spec.nope_dim:]      # [N, Dv, R]
        return torch.einsum("bqnr,nvr->bqnv", o_lat, w_uv).flatten(-2)

    # MoE ------------------------------------------------------------------------------------------
    def moe(self, x, router, bias, experts, shared, spec):
        routed = experts["gate_up.words"]
        if not isinstance(routed, RoutedExperts) or any(v is not routed for v in experts.values()):
            raise TypeError(f"{self.where}: the torch backend runs float routed experts (RoutedExperts from "
                            f"TorchOps.weight), got {type(routed).__name__}")
        rows = x.reshape(-1, spec.hidden)                                                 # [B q, H]
        scores = torch.sigmoid(self.linear(rows, router, out=ACC))                        # [B q, E] unbiased g
        chosen = select_experts(scores.detach() + bias, spec.topk, spec.n_group, spec.topk_group)   # [B q, k]
        picked = scores.gather(1, chosen)
        gates = picked / (picked.sum(-1, keepdim=True) + NORM_EPS) * spec.routed_scaling_factor
        self.loads[self.names.get(id(router), "router")] = torch.bincount(chosen.flatten(),
                                                                         minlength=spec.n_routed_experts)
        out = self.swiglu_mlp(rows, *shared)
        local = chosen - spec.expert_start
        for e in range(spec.experts):
            r, slot = torch.nonzero(local == e, as_tuple=True)
            if r.numel():
                y = self.swiglu_mlp(rows[r], *routed.of(e, self.expert_quant)) * gates[r, slot, None]
                out = out.index_add(0, r, y.to(out.dtype))
        return out.reshape(x.shape)

    # drafter --------------------------------------------------------------------------------------
    def draft_attention(self, q, k, v, ctx_k, ctx_v, pos, cache_k, cache_v, cache_len, rope, spec):
        T, n = int(cache_len[0]), ctx_k.shape[1]
        m.check_room("draft_attention", cache_k.shape[1], T, n)
        pos = torch.as_tensor(pos).long()

        def turned(x, p):
            return rotate_half(x, *rope_table(p, rope, spec.head_dim, spec.attention_factor, self.dtypes[ACC]))
        cache_k[:, T: T + n] = turned(ctx_k, torch.arange(T, T + n))
        cache_v[:, T: T + n] = ctx_v
        group = spec.heads // spec.kv_heads                  # GQA: query head h reads kv head h / group
        q = turned(q, pos)
        keys = torch.cat([cache_k[:, : T + n], turned(k, pos).to(cache_k.dtype)], dim=1).to(q.dtype)
        values = torch.cat([cache_v[:, : T + n], v.to(cache_v.dtype)], dim=1).to(q.dtype)   # [B, T + n + b, Hk, d]
        k_pos = torch.cat([torch.arange(T + n), pos])
        mask = (pos[:, None] - k_pos[None, :] < spec.sliding_window) if spec.sliding_window else None
        o = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2).repeat_interleave(group, dim=1),
                                           values.transpose(1, 2).repeat_interleave(group, dim=1), attn_mask=mask,
                                           scale=spec.head_dim ** -0.5)                   # [B, Hq, b, d]
        return o.transpose(1, 2).flatten(-2), cache_k, cache_v

    # collectives (one rank) -----------------------------------------------------------------------
    def all_reduce(self, x, tag):
        """The identity at tp 1; training's residual dropout where a branch joins the residual stream."""
        return F.dropout(x, self.dropout) if self.dropout and tag in RESIDUAL_BRANCHES else x

    def all_gather(self, x, tag):
        return x[:, None]                                                                 # [B, tp = 1, ...]

    # sampling and the tree (numpy_math's definitions, one sequence at a time) ----------------------
    def vocab_winner(self, logits, sample_pos, temperature, seed):
        t = float(torch.as_tensor(temperature).reshape(-1)[0])
        if t == 0:                                                     # argmax: the first max, the lowest id
            return logits.amax(dim=-1), logits.argmax(dim=-1).to(torch.int32) + self.lay.vocab_start
        value, winner = per_sequence(lambda x: m.vocab_winner(x, sample_pos, t, m.seed_of(seed), self.lay.vocab_start),
                                     logits)
        return value.to(self.dtypes[ACC]), winner

    def vocab_topk(self, logits, k):
        return per_sequence(lambda x: m.vocab_topk(x, k, self.lay.vocab_start), logits.float())

    def tree_build(self, root, values, ids, row_max, row_sumexp, budget):
        return per_sequence(lambda r, *cand: m.tree_tensors(m.tree_build(int(r[0]), *cand, budget)),
                            root, values, ids, row_max, row_sumexp)

    def accept_walk(self, tokens, parents, win_value, win_id):
        return per_sequence(m.accept_walk_winners, tokens, parents, win_value, win_id)


# ----------------------------------------------------------------------------------------------
# the stacks at tp 1 on torch tensors

def new_target_caches(cfg, batch: int, rows: int, dtype=torch.float32) -> list[torch.Tensor]:
    """One latent cache [B, rows, R + Dr] per decoder layer."""
    return [torch.zeros(batch, rows, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=dtype)
            for _ in range(cfg.num_hidden_layers)]


def target_forward(ops: TorchOps, cfg, ids, pos, caches: list, cache_len, tree_mask, taps=()) -> tuple:
    """ids [B, q] at positions pos [q] after cache_len [1] cached rows, tree_mask [q, W] -> logits [B, q, V] (ACC),
    {L: h [B, q, H]} (layer L's output for L in taps); each layer's cache [B, S, R + Dr] gains the q rows
    (description/stack.py target_forward)."""
    tapped = {}
    feeds = {"ids": ids, "pos": pos, "cache_len": cache_len, "tree_mask": tree_mask}
    outs = stack.target_forward(ops.run, cfg, cfg.moe_intermediate_size, feeds,
                                stack.InPlace(lambda L: {"cache": caches[L]}), taps, tapped.__setitem__,
                                head=(layers.head_logits, ()))
    return outs["logits"], tapped


def drafter_forward(ops: TorchOps, cfg, dcfg, block_ids, pos, ctx_taps, caches_k: list, caches_v: list,
                    cache_len) -> torch.Tensor:
    """block_ids [B, b] at positions pos [b], the new context ctx_taps [B, n, K H] appended after cache_len [1]
    rows of the context caches [B, S, Hk, d] (one per drafter layer) -> draft logits [B, b - 1, V] (ACC)
    (description/stack.py drafter_forward)."""
    feeds = {"ctx_taps": ctx_taps, "ids": block_ids, "pos": pos, "cache_len": cache_len}
    caches = stack.InPlace(lambda L: {"cache_k": caches_k[L], "cache_v": caches_v[L]})
    return stack.drafter_forward(ops.run, cfg, dcfg, feeds, caches, block_ids.shape[1])["logits"]
