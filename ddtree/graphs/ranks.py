"""One rank's share of each layer, as plain numpy functions over that rank's weight dict.

A tensor-parallel engine (plan: ddtree/builder/plan.py, files: ddtree/builder/weights.py) runs one
process per rank; these are the per-rank computations, used by the CPU engine executor to simulate
the ranks in one process and by the graphs as the numpy implementations of their nodes.

`w` is a rank's weight dict: the tensors of rank<r>/*.safetensors by name, BF16 either as uint16
bits (as stored) or already converted to floats, routed experts in the MoE kernel layout. A function
that ends at an all-reduce point returns the rank's partial [q, H]; the caller sums the partials of
all ranks with `all_reduce` (a plain sum in rank order: what a one-shot all-reduce computes on every
rank). Replicated work (norms, q_a/kv_a, the router, the latent cache) is done by every rank.

Letters: q tokens, T cached tokens, t = T + q, H hidden, N_r heads on this rank, R kv_lora_rank,
Dn/Dr/Dv nope/rope/value head dims, V_r vocab ids on this rank, E_r experts, I_r intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.model.bf16 import as_float
from ddtree.model.config import DrafterConfig, KimiConfig
from ddtree.model.int4 import dequantize_int4
from ddtree.model.routing import route
from ddtree.plugins import layout
from ddtree.reference.drafter import block_attention, rotate_half_rope
from ddtree.reference.layers import rms_norm, swiglu
from ddtree.reference.mla import masked_softmax
from ddtree.reference.rope import Rope


@dataclass(frozen=True)
class RankLayout:
    """Which slice of each split dimension rank `rank` holds (equal contiguous chunks)."""
    rank: int
    tp: int
    vocab_start: int
    vocab_stop: int
    expert_start: int       # global id of the rank's first routed expert (0 unless experts="ep")
    expert_stop: int
    fc_start: int           # the drafter fc's input columns (over the concatenated taps)
    fc_stop: int

    @staticmethod
    def from_plan(plan: dict, rank: int) -> "RankLayout":
        """From the "plan" entry of an engine's config.json (builder/plan.py TPPlan.to_dict)."""
        per = plan["per_rank"]
        v, e, f = per["vocab"], per["routed_experts"], per["drafter_fc_in"]
        e0 = rank * e if plan["experts"] == "ep" else 0
        return RankLayout(rank, plan["tp"], rank * v, (rank + 1) * v, e0, e0 + e, rank * f, (rank + 1) * f)


def all_reduce(partials: list[np.ndarray]) -> np.ndarray:
    """The sum of the ranks' partials, in rank order (every rank receives this same array)."""
    out = partials[0].copy()
    for p in partials[1:]:
        out += p
    return out


def weight(w: dict, name: str, dtype=np.float64) -> np.ndarray:
    """A dense weight as floats of `dtype` (bf16 bits converted exactly)."""
    if name not in w:
        raise KeyError(f"rank weights: tensor '{name}' is missing")
    return as_float(w[name], dtype)


# ----------------------------------------------------------------------------------------------
# target

def rank_embed(ids: np.ndarray, w: dict, lay: RankLayout, dtype=np.float64) -> np.ndarray:
    """ids [q] -> partial [q, H]: rows of the ids this rank owns, zeros elsewhere (all-reduce -> embedding)."""
    table = w["model.embed_tokens.weight"]                                # [V_r, H]
    local = np.asarray(ids, dtype=np.int64) - lay.vocab_start
    mine = (local >= 0) & (local < table.shape[0])                        # [q]
    out = np.zeros((len(local), table.shape[1]), dtype=dtype)
    if mine.any():
        rows = table[local[mine]]
        out[mine] = as_float(rows, dtype)
    return out


def rank_attention(h: np.ndarray, pos: np.ndarray, visible: np.ndarray, cache, layer: int, w: dict,
                   cfg: KimiConfig, rope: Rope, dtype=np.float64) -> np.ndarray:
    """Residual h [q, H] -> this rank's partial attention output [q, H] (absorbed MLA over N_r heads).
    Writes the q new latent entries (replicated on every rank) at cache.length.."""
    p, a = f"model.layers.{layer}", f"model.layers.{layer}.self_attn"
    Dn, Dr, Dv, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    eps, q, T = cfg.rms_norm_eps, len(h), cache.length
    x = rms_norm(h, weight(w, f"{p}.input_layernorm.weight", dtype), eps)            # [q, H]
    c_q = rms_norm(x @ weight(w, f"{a}.q_a_proj.weight", dtype).T,
                   weight(w, f"{a}.q_a_layernorm.weight", dtype), eps)                # [q, Q] replicated
    q_b = weight(w, f"{a}.q_b_proj.weight", dtype)                                    # [N_r (Dn + Dr), Q]
    heads = q_b.shape[0] // (Dn + Dr)
    q_all = (c_q @ q_b.T).reshape(q, heads, Dn + Dr)                                  # [q, N_r, Dn + Dr]
    q_nope, q_pe = q_all[:, :, :Dn], rope.apply(q_all[:, :, Dn:], pos)
    latent = x @ weight(w, f"{a}.kv_a_proj_with_mqa.weight", dtype).T                 # [q, R + Dr] replicated
    c_kv_new = rms_norm(latent[:, :R], weight(w, f"{a}.kv_a_layernorm.weight", dtype), eps)
    cache.write(layer, T, c_kv_new, rope.apply(latent[:, R:], pos))
    c_kv, k_pe = cache.c_kv(layer, T + q), cache.k_pe(layer, T + q)                   # [t, R], [t, Dr]
    kv_b = weight(w, f"{a}.kv_b_proj.weight", dtype).reshape(heads, Dn + Dv, R)
    w_uk, w_uv = kv_b[:, :Dn], kv_b[:, Dn:]                                           # [N_r, Dn, R], [N_r, Dv, R]
    q_lat = np.einsum("qnd,ndr->qnr", q_nope, w_uk, optimize=True)                    # [q, N_r, R]
    scores = (np.einsum("qnr,tr->qnt", q_lat, c_kv, optimize=True)
              + np.einsum("qnd,td->qnt", q_pe, k_pe, optimize=True)) * cfg.softmax_scale
    probs = masked_softmax(scores, visible)                                           # [q, N_r, t]
    o_lat = np.einsum("qnt,tr->qnr", probs, c_kv, optimize=True)                      # [q, N_r, R]
    o = np.einsum("qnr,nvr->qnv", o_lat, w_uv, optimize=True).reshape(q, heads * Dv)  # [q, N_r Dv]
    return o @ weight(w, f"{a}.o_proj.weight", dtype).T                               # [q, H] partial


def expert_weights(w: dict, layer: int, local: int, dtype=np.float64, cache: dict | None = None):
    """Expert `local` of this rank from the kernel layout -> dense (gate [I_r, H], up [I_r, H], down [H, I_r])."""
    key = (layer, local)
    if cache is not None and key in cache:
        return cache[key]
    p = f"model.layers.{layer}.mlp.experts."
    gate_up = dequantize_int4(*layout.unpack_q(w[p + "gate_up.words"][local], w[p + "gate_up.scales"][local]),
                              layout.GROUP, dtype)                        # [2 I_r, H], gate/up fused by 8 rows
    gate, up = layout.split_gate_up(gate_up)
    down = dequantize_int4(*layout.unpack_q(w[p + "down.words"][local], w[p + "down.scales"][local]),
                           layout.GROUP, dtype)
    if cache is not None:
        cache[key] = (gate, up, down)
    return gate, up, down


def rank_moe(x: np.ndarray, layer: int, w: dict, cfg: KimiConfig, lay: RankLayout, dtype=np.float64,
             expert_cache: dict | None = None) -> np.ndarray:
    """Normed x [n, H] -> partial [n, H]: this rank's slice (or share of experts) of the routed experts,
    plus its slice of the shared expert."""
    m = f"model.layers.{layer}.mlp"
    ids, gates = route(x, weight(w, f"{m}.gate.weight", dtype), weight(w, f"{m}.gate.e_score_correction_bias", dtype),
                       cfg)                                               # replicated on every rank
    out = np.zeros_like(x)                                                # [n, H]
    for e in np.unique(ids):
        if not lay.expert_start <= e < lay.expert_stop:                   # experts="ep": another rank's
            continue
        gate, up, down = expert_weights(w, layer, int(e) - lay.expert_start, dtype, expert_cache)
        rows, slot = np.nonzero(ids == e)                                 # tokens routed to e
        out[rows] += gates[rows, slot][:, None].astype(x.dtype) * swiglu(x[rows], gate, up, down)
    s = f"{m}.shared_experts"
    return out + swiglu(x, weight(w, f"{s}.gate_proj.weight", dtype), weight(w, f"{s}.up_proj.weight", dtype),
                        weight(w, f"{s}.down_proj.weight", dtype))


def rank_mlp(h: np.ndarray, layer: int, w: dict, cfg: KimiConfig, lay: RankLayout, dtype=np.float64,
             expert_cache: dict | None = None) -> np.ndarray:
    """Residual h [q, H] -> partial FFN output [q, H] (dense SwiGLU slice, or MoE)."""
    x = rms_norm(h, weight(w, f"model.layers.{layer}.post_attention_layernorm.weight", dtype), cfg.rms_norm_eps)
    if cfg.is_moe_layer(layer):
        return rank_moe(x, layer, w, cfg, lay, dtype, expert_cache)
    m = f"model.layers.{layer}.mlp"
    return swiglu(x, weight(w, f"{m}.gate_proj.weight", dtype), weight(w, f"{m}.up_proj.weight", dtype),
                  weight(w, f"{m}.down_proj.weight", dtype))


def rank_logits(h: np.ndarray, w: dict, cfg: KimiConfig, dtype=np.float64) -> np.ndarray:
    """Residual h [q, H] -> this rank's vocab slice of the logits [q, V_r] (never all-gathered on a GPU)."""
    x = rms_norm(h, weight(w, "model.norm.weight", dtype), cfg.rms_norm_eps)
    return x @ weight(w, "lm_head.weight", dtype).T


# ----------------------------------------------------------------------------------------------
# drafter (DFlash; names prefixed "drafter.")

def rank_draft_fc(ctx_taps: np.ndarray, w: dict, lay: RankLayout, dtype=np.float64) -> np.ndarray:
    """ctx_taps [n, K H] -> partial fc output [n, H] over this rank's input columns."""
    return ctx_taps[:, lay.fc_start: lay.fc_stop] @ weight(w, "drafter.fc.weight", dtype).T


def rank_draft_context(fc_out: np.ndarray, w: dict, dcfg: DrafterConfig, dtype=np.float64) -> np.ndarray:
    """All-reduced fc output [n, H] -> context features [n, H] (hidden_norm, replicated)."""
    return rms_norm(fc_out, weight(w, "drafter.hidden_norm.weight", dtype), dcfg.rms_norm_eps)


def _draft_kv(x, pos, a, w, dcfg, freqs, dtype):
    """x [n, H] -> this rank's roped, k-normed keys and values [n, Hk_r, d]."""
    d = dcfg.head_dim
    k = (x @ weight(w, f"{a}.k_proj.weight", dtype).T).reshape(len(x), -1, d)
    k = rotate_half_rope(rms_norm(k, weight(w, f"{a}.k_norm.weight", dtype), dcfg.rms_norm_eps), pos, freqs,
                         dcfg.attention_factor)
    v = (x @ weight(w, f"{a}.v_proj.weight", dtype).T).reshape(len(x), -1, d)
    return k, v


def rank_draft_attention(h: np.ndarray, ctx: np.ndarray, pos: np.ndarray, ctx_pos: np.ndarray, cache, layer: int,
                         w: dict, dcfg: DrafterConfig, freqs: np.ndarray, dtype=np.float64) -> np.ndarray:
    """Block residual h [b, H], new context ctx [n, H] -> partial attention output [b, H] over this
    rank's heads. Appends the context K/V of this rank's kv heads to its cache (block K/V are never kept)."""
    p, a, d = f"drafter.layers.{layer}", f"drafter.layers.{layer}.self_attn", dcfg.head_dim
    if len(ctx):
        cache.append(layer, *_draft_kv(ctx, ctx_pos, a, w, dcfg, freqs, dtype))
    b = len(h)
    x = rms_norm(h, weight(w, f"{p}.input_layernorm.weight", dtype), dcfg.rms_norm_eps)   # [b, H]
    q = (x @ weight(w, f"{a}.q_proj.weight", dtype).T).reshape(b, -1, d)                  # [b, Hq_r, d]
    q = rotate_half_rope(rms_norm(q, weight(w, f"{a}.q_norm.weight", dtype), dcfg.rms_norm_eps), pos, freqs,
                         dcfg.attention_factor)
    k_blk, v_blk = _draft_kv(x, pos, a, w, dcfg, freqs, dtype)                            # [b, Hk_r, d]
    k = np.concatenate([cache.k[layer], k_blk])                                           # [T + b, Hk_r, d]
    v = np.concatenate([cache.v[layer], v_blk])                                           # (GQA groups whole on a rank)
    k_pos = np.concatenate([np.arange(cache.length), pos])
    attn = block_attention(q, k, v, pos, k_pos, dcfg, layer)                              # [b, Hq_r d]
    return attn @ weight(w, f"{a}.o_proj.weight", dtype).T                                # [b, H] partial


def rank_draft_mlp(h: np.ndarray, layer: int, w: dict, dcfg: DrafterConfig, dtype=np.float64) -> np.ndarray:
    p = f"drafter.layers.{layer}"
    x = rms_norm(h, weight(w, f"{p}.post_attention_layernorm.weight", dtype), dcfg.rms_norm_eps)
    return swiglu(x, weight(w, f"{p}.mlp.gate_proj.weight", dtype), weight(w, f"{p}.mlp.up_proj.weight", dtype),
                  weight(w, f"{p}.mlp.down_proj.weight", dtype))


def rank_draft_logits(h: np.ndarray, w: dict, dcfg: DrafterConfig, dtype=np.float64) -> np.ndarray:
    """Block residual h [b, H] -> this rank's vocab slice of the draft logits [b - 1, V_r] (target lm_head)."""
    x = rms_norm(h, weight(w, "drafter.norm.weight", dtype), dcfg.rms_norm_eps)
    return x[1:] @ weight(w, "lm_head.weight", dtype).T
