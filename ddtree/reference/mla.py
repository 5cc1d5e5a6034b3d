"""Multi-head latent attention (docs/kimi-k2.md section 5.2), in two mathematically equal forms.

absorbed  what every engine runs at decode and verify: W_UK is folded into the query, the value
          projection W_UV is applied after attention, so attention is MQA with one 576-d key
          [c_kv | k_pe] and one 512-d value c_kv per token, read straight from the latent cache.
naive     what HF and vLLM prefill do: expand every cached c_kv through kv_b into per-head keys
          (nope part) and values, then plain multi-head attention over 192/128 dims.
Tests check naive == absorbed; the model uses absorbed unless asked otherwise.

Letters: q new tokens, t = T + q cache entries after the append, H hidden, N heads,
Q q_lora_rank, R kv_lora_rank, Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.model.config import KimiConfig
from ddtree.reference.cache import LatentCache
from ddtree.reference.layers import rms_norm
from ddtree.reference.rope import Rope


@dataclass
class MLAWeights:
    q_a: np.ndarray          # [Q, H]                 q_a_proj
    q_a_norm: np.ndarray     # [Q]                    q_a_layernorm
    q_b: np.ndarray          # [N * (Dn + Dr), Q]     q_b_proj
    kv_a: np.ndarray         # [R + Dr, H]            kv_a_proj_with_mqa: rows 0..R-1 c_kv, R.. k_pe
    kv_a_norm: np.ndarray    # [R]                    kv_a_layernorm
    kv_b: np.ndarray         # [N * (Dn + Dv), R]     kv_b_proj: per head Dn rows of W_UK then Dv rows of W_UV
    o: np.ndarray            # [H, N * Dv]            o_proj


def einsum(spec: str, *operands: np.ndarray) -> np.ndarray:
    """np.einsum routed through BLAS (tensordot) rather than its plain C loop."""
    return np.einsum(spec, *operands, optimize=True)


def masked_softmax(scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """scores [q, N, t], visible [q, t] bool -> probabilities over the visible entries of each row."""
    scores = np.where(visible[:, None, :], scores, -np.inf)            # [q, N, t]
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return weights / weights.sum(axis=-1, keepdims=True)


class MLA:
    """One model's attention math; the per-layer weights are passed to each call."""

    def __init__(self, cfg: KimiConfig, latent_norm_eps: float | None = None):
        self.cfg = cfg
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim)
        self.scale = cfg.softmax_scale          # 192^-1/2 * mscale^2: the full q/k head dim, also when absorbed
        # q_a/kv_a norms: config rms_norm_eps like vLLM (HF's module default is 1e-6; docs/kimi-k2.md 5.1)
        self.latent_norm_eps = cfg.rms_norm_eps if latent_norm_eps is None else latent_norm_eps

    # -- projections of the new tokens --------------------------------------------------------
    def queries(self, x: np.ndarray, pos: np.ndarray, w: MLAWeights) -> tuple[np.ndarray, np.ndarray]:
        """x [q, H] -> q_nope [q, N, Dn], q_pe [q, N, Dr] (roped)."""
        c = self.cfg
        c_q = rms_norm(x @ w.q_a.T, w.q_a_norm, self.latent_norm_eps)    # [q, Q]
        q = (c_q @ w.q_b.T).reshape(len(x), c.num_attention_heads, c.qk_head_dim)   # [q, N, Dn + Dr]
        q_nope = q[:, :, : c.qk_nope_head_dim]                             # [q, N, Dn]
        q_pe = self.rope.apply(q[:, :, c.qk_nope_head_dim:], pos)          # [q, N, Dr]
        return q_nope, q_pe

    def latent_kv(self, x: np.ndarray, pos: np.ndarray, w: MLAWeights) -> tuple[np.ndarray, np.ndarray]:
        """x [q, H] -> the cache entries of the new tokens: c_kv [q, R] (normalised), k_pe [q, Dr] (roped)."""
        R = self.cfg.kv_lora_rank
        a = x @ w.kv_a.T                                                   # [q, R + Dr]
        c_kv = rms_norm(a[:, :R], w.kv_a_norm, self.latent_norm_eps)       # [q, R]
        k_pe = self.rope.apply(a[:, R:], pos)                              # [q, Dr] one key shared by all heads
        return c_kv, k_pe

    def split_kv_b(self, w: MLAWeights) -> tuple[np.ndarray, np.ndarray]:
        """kv_b [N (Dn + Dv), R] -> W_UK [N, Dn, R], W_UV [N, Dv, R]."""
        c = self.cfg
        kv_b = w.kv_b.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return kv_b[:, : c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim:]

    # -- the two attention forms ----------------------------------------------------------------
    def attend_absorbed(self, q_nope, q_pe, c_kv, k_pe, visible, w: MLAWeights) -> np.ndarray:
        """q_nope [q, N, Dn], q_pe [q, N, Dr], cache c_kv [t, R], k_pe [t, Dr], visible [q, t] -> o [q, N, Dv]."""
        w_uk, w_uv = self.split_kv_b(w)                                    # [N, Dn, R], [N, Dv, R]
        q_lat = einsum("qnd,ndr->qnr", q_nope, w_uk)                    # [q, N, R] W_UK^T q_nope
        scores = (einsum("qnr,tr->qnt", q_lat, c_kv)
                  + einsum("qnd,td->qnt", q_pe, k_pe)) * self.scale     # [q, N, t]
        probs = masked_softmax(scores, visible)                            # [q, N, t]
        o_lat = einsum("qnt,tr->qnr", probs, c_kv)                      # [q, N, R] value = c_kv
        return einsum("qnr,nvr->qnv", o_lat, w_uv)                      # [q, N, Dv]

    def attend_naive(self, q_nope, q_pe, c_kv, k_pe, visible, w: MLAWeights) -> np.ndarray:
        """Same contract as attend_absorbed, by expanding the cache through kv_b."""
        c = self.cfg
        w_uk, w_uv = self.split_kv_b(w)
        k_nope = einsum("tr,ndr->tnd", c_kv, w_uk)                      # [t, N, Dn]
        value = einsum("tr,nvr->tnv", c_kv, w_uv)                       # [t, N, Dv]
        k_pe_heads = np.broadcast_to(k_pe[:, None, :], (len(k_pe), c.num_attention_heads, c.qk_rope_head_dim))
        key = np.concatenate([k_nope, k_pe_heads], axis=-1)                # [t, N, Dn + Dr]
        query = np.concatenate([q_nope, q_pe], axis=-1)                    # [q, N, Dn + Dr]
        scores = einsum("qnd,tnd->qnt", query, key) * self.scale        # [q, N, t]
        probs = masked_softmax(scores, visible)
        return einsum("qnt,tnv->qnv", probs, value)                     # [q, N, Dv]

    # -- one layer --------------------------------------------------------------------------------
    def __call__(self, x: np.ndarray, pos: np.ndarray, visible: np.ndarray, cache: LatentCache,
                 layer: int, w: MLAWeights, naive: bool = False) -> np.ndarray:
        """x [q, H] (normed) -> attention output [q, H]; writes the q new entries at cache.length.."""
        T = cache.length
        q_nope, q_pe = self.queries(x, pos, w)
        c_kv_new, k_pe_new = self.latent_kv(x, pos, w)
        cache.write(layer, T, c_kv_new, k_pe_new)
        c_kv = cache.c_kv(layer, T + len(x))                               # [t, R]
        k_pe = cache.k_pe(layer, T + len(x))                               # [t, Dr]
        attend = self.attend_naive if naive else self.attend_absorbed
        o = attend(q_nope, q_pe, c_kv, k_pe, visible, w)                   # [q, N, Dv]
        return o.reshape(len(x), -1) @ w.o.T                               # [q, H]
