"""The DFlash block-diffusion drafter in numpy (docs/ddtree.md section 1).

One call drafts a block = [anchor, MASK x (b-1)] at positions start .. start+b-1:
    ctx     = hidden_norm(fc(concat(taps of the newly committed tokens)))     [n, H]
    h       = target.embed[block]                                              [b, H]
    per layer:
        K/V of ctx through this layer's k_proj -> k_norm -> rope and v_proj,   appended to the cache
        x = RMSNorm_in(h); q, k, v of the block (q/k per-head norms, rope)
        attention of the b queries over [cached ctx K/V ; block K/V], non-causal, GQA
        h += o_proj(attn);  h += SwiGLU(RMSNorm_post(h))
    logits  = target.lm_head(norm(h))[1:]                                      [b-1, V]
Block position k >= 1 predicts the token at start + k. The cache keeps only committed context
K/V: block K/V are never stored. RoPE is rotate-half over the whole head dim (Qwen3 style) with
YaRN frequencies; cos/sin are scaled by `ddtree_attention_factor` (docs/ddtree.md 1.7, default 1.0).

Letters: b block size, n new context tokens, T cached context tokens, Hq/Hk query/kv heads, d head dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddtree.model.checkpoint import DrafterCheckpoint
from ddtree.model.config import DrafterConfig
from ddtree.reference.layers import rms_norm, swiglu
from ddtree.reference.rope import rope_frequencies


@dataclass
class DraftLayerWeights:
    input_norm: np.ndarray      # [H]
    q: np.ndarray               # [Hq*d, H]
    k: np.ndarray               # [Hk*d, H]
    v: np.ndarray               # [Hk*d, H]
    o: np.ndarray               # [H, Hq*d]
    q_norm: np.ndarray          # [d]
    k_norm: np.ndarray          # [d]
    post_norm: np.ndarray       # [H]
    gate: np.ndarray            # [I, H]
    up: np.ndarray              # [I, H]
    down: np.ndarray            # [H, I]


class DraftCache:
    """Per draft layer, the committed context's roped keys and values: [T, Hk, d] each."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype=np.float64):
        self.k = [np.zeros((0, kv_heads, head_dim), dtype) for _ in range(num_layers)]
        self.v = [np.zeros((0, kv_heads, head_dim), dtype) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.k[0].shape[0]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[layer] = np.concatenate([self.k[layer], k])
        self.v[layer] = np.concatenate([self.v[layer], v])

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"DraftCache.truncate: n = {n} must be in 0..{self.length}")
        self.k = [k[:n] for k in self.k]
        self.v = [v[:n] for v in self.v]


def rotate_half_rope(x: np.ndarray, pos: np.ndarray, freqs: np.ndarray, factor: float) -> np.ndarray:
    """x [n, heads, d], pos [n] -> NeoX/Qwen3 rope: halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    angle = pos.astype(np.float64)[:, None] * freqs[None, :]            # [n, d/2]
    cos = (np.cos(angle) * factor)[:, None, :]                           # [n, 1, d/2]
    sin = (np.sin(angle) * factor)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def window_bias(c: DrafterConfig, layer: int, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """[q, k]: 0 where visible, -inf outside a sliding window (only layers typed 'sliding_attention')."""
    window = c.window(layer)
    if not window:
        return np.zeros((len(q_pos), len(k_pos)))
    return np.where((q_pos[:, None] - k_pos[None, :]) >= window, -np.inf, 0.0)


def block_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                    c: DrafterConfig, layer: int) -> np.ndarray:
    """Non-causal GQA attention of the block: q [b, Hq, d] over k, v [T+b, Hk, d] -> [b, Hq*d]."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k, group, axis=1)                                              # [T+b, Hq, d]
    v = np.repeat(v, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * q.shape[-1] ** -0.5               # [Hq, b, T+b]
    scores = scores + window_bias(c, layer, q_pos, k_pos)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(len(q), -1)


class Drafter:
    """DFlash drafter over a target's embedding and lm_head (it has neither of its own)."""

    def __init__(self, config: DrafterConfig, weights: dict[str, np.ndarray], embed: np.ndarray,
                 lm_head: np.ndarray, dtype=np.float64):
        self.config = c = config
        self.dtype = np.dtype(dtype)
        w = {k: np.asarray(v, dtype=self.dtype) for k, v in weights.items()}
        self.fc = w["fc.weight"]                                          # [H, K*H]
        self.hidden_norm = w["hidden_norm.weight"]                        # [H]
        self.final_norm = w["norm.weight"]                                # [H]
        self.embed, self.lm_head = embed, lm_head                         # [V, H] each, the target's
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}"
            a = f"{p}.self_attn"
            self.layers.append(DraftLayerWeights(
                w[f"{p}.input_layernorm.weight"], w[f"{a}.q_proj.weight"], w[f"{a}.k_proj.weight"],
                w[f"{a}.v_proj.weight"], w[f"{a}.o_proj.weight"], w[f"{a}.q_norm.weight"],
                w[f"{a}.k_norm.weight"], w[f"{p}.post_attention_layernorm.weight"],
                w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"], w[f"{p}.mlp.down_proj.weight"]))
        self.freqs = rope_frequencies(c.rope, c.head_dim)                 # [d/2]

    @classmethod
    def from_checkpoint(cls, path_or_ckpt, target, dtype=np.float64) -> "Drafter":
        ck = DrafterCheckpoint(path_or_ckpt) if isinstance(path_or_ckpt, (str, Path)) else path_or_ckpt
        ck.config.check_target(target.config)
        weights = {name: ck.get_f32(name) for name in ck.specs}
        return cls(ck.config, weights, target.embed, target.lm_head, dtype)

    def new_cache(self) -> DraftCache:
        c = self.config
        return DraftCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype)

    def _kv(self, lw: DraftLayerWeights, x: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [n, H] -> roped, k-normed keys and values [n, Hk, d] through this layer's projections."""
        c = self.config
        k = (x @ lw.k.T).reshape(len(x), c.num_key_value_heads, c.head_dim)
        k = rotate_half_rope(rms_norm(k, lw.k_norm, c.rms_norm_eps), pos, self.freqs, c.attention_factor)
        v = (x @ lw.v.T).reshape(len(x), c.num_key_value_heads, c.head_dim)
        return k, v

    def forward(self, block_ids, pos, ctx_taps: np.ndarray, cache: DraftCache) -> np.ndarray:
        """block_ids [b], pos [b] (start..start+b-1), ctx_taps [n, K*H] of the n tokens committed since
        the last call (positions cache.length ..) -> logits [b-1, V] for block positions 1..b-1."""
        c = self.config
        block_ids = np.asarray(block_ids, dtype=np.int64)
        pos = np.asarray(pos, dtype=np.int64)
        ctx_taps = np.asarray(ctx_taps, dtype=self.dtype)
        b, T0 = len(block_ids), cache.length
        if ctx_taps.ndim != 2 or ctx_taps.shape[1] != self.fc.shape[1]:
            raise ValueError(f"Drafter.forward: ctx_taps must be [n, {self.fc.shape[1]}] (K taps x hidden), "
                             f"got {list(ctx_taps.shape)}")
        if pos.shape != (b,):
            raise ValueError(f"Drafter.forward: pos must be [{b}], got {list(pos.shape)}")
        n = len(ctx_taps)
        ctx_pos = np.arange(T0, T0 + n)
        ctx = rms_norm(ctx_taps @ self.fc.T, self.hidden_norm, c.rms_norm_eps)     # [n, H]
        h = self.embed[block_ids].astype(self.dtype)                                 # [b, H]
        for L, lw in enumerate(self.layers):
            if n:
                cache.append(L, *self._kv(lw, ctx, ctx_pos))                         # committed context only
            x = rms_norm(h, lw.input_norm, c.rms_norm_eps)                           # [b, H]
            q = (x @ lw.q.T).reshape(b, c.num_attention_heads, c.head_dim)           # [b, Hq, d]
            q = rotate_half_rope(rms_norm(q, lw.q_norm, c.rms_norm_eps), pos, self.freqs, c.attention_factor)
            k_blk, v_blk = self._kv(lw, x, pos)                                      # [b, Hk, d]
            k = np.concatenate([cache.k[L], k_blk])                                  # [T+b, Hk, d]
            v = np.concatenate([cache.v[L], v_blk])
            k_pos = np.concatenate([np.arange(cache.length), pos])                   # [T+b]
            attn = block_attention(q, k, v, pos, k_pos, c, L)                        # [b, Hq*d]
            h = h + attn @ lw.o.T
            h = h + swiglu(rms_norm(h, lw.post_norm, c.rms_norm_eps), lw.gate, lw.up, lw.down)
        out = rms_norm(h, self.final_norm, c.rms_norm_eps)                            # [b, H]
        return out[1:] @ self.lm_head.T                                               # [b-1, V]
