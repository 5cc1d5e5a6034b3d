"""The Kimi K2.x target in numpy: the oracle every executor and kernel is tested against.

    h = embed[ids]
    for each layer:  h += MLA(RMSNorm_in(h));  h += FFN(RMSNorm_post(h))     (dense SwiGLU on layers
                     < first_k_dense_replace, MoE after)
    logits = lm_head(RMSNorm_final(h))

`Target.forward` follows docs/interfaces.md section 3: new tokens with their absolute positions and a
visibility mask over the cache plus themselves; it appends their latent entries to the cache and
returns the logits and the requested taps (the output of decoder layer L = HF hidden_states[L+1]).
Computation is float64 by default (bf16 weights convert exactly), so a token's logits depend on
which other tokens share the call only at the 1e-15 level.

Letters: q new tokens, T cache length before the call, H hidden, V vocab.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddtree.model.checkpoint import Checkpoint
from ddtree.model.config import KimiConfig
from ddtree.reference.cache import LatentCache
from ddtree.reference.layers import rms_norm, swiglu
from ddtree.reference.mla import MLA, MLAWeights
from ddtree.reference.moe import ExpertWeights, MoEWeights, moe
from ddtree.reference.weights import (
    CheckpointWeights,
    LazyExperts,
    checked_array,
    dense_weight_names,
    load_dense_weights,
)


@dataclass
class LayerWeights:
    input_norm: np.ndarray                 # [H]
    attn: MLAWeights
    post_norm: np.ndarray                  # [H]
    mlp: ExpertWeights | MoEWeights        # dense SwiGLU (layer < first_k_dense_replace) or MoE


def causal_visible(T: int, q: int) -> np.ndarray:
    """[q, T + q] bool: every cached entry plus the new tokens up to and including oneself."""
    visible = np.ones((q, T + q), dtype=bool)
    visible[:, T:] = np.tril(np.ones((q, q), dtype=bool))
    return visible


class Target:
    """Kimi K2.x target forward over a LatentCache. `naive_mla=True` expands kv_b (tests: naive == absorbed)."""

    def __init__(self, config: KimiConfig, weights: Mapping[str, np.ndarray], dtype=np.float64,
                 naive_mla: bool = False, latent_norm_eps: float | None = None):
        self.config = cfg = config
        self.dtype = np.dtype(dtype)
        self.naive_mla = naive_mla
        self.mla = MLA(cfg, latent_norm_eps)
        w = self._checked(weights)
        self._weights = weights
        self.embed = w["model.embed_tokens.weight"]                      # [V, H]
        self.final_norm = w["model.norm.weight"]                         # [H]
        self.lm_head = w["lm_head.weight"]                               # [V, H]
        self.layers = [self._layer(w, L) for L in range(cfg.num_hidden_layers)]

    @classmethod
    def from_checkpoint(cls, ckpt_or_path, dtype=np.float64, lazy_experts: bool = False, **kwargs) -> "Target":
        """A Checkpoint (or its directory) -> Target; INT4 experts are dequantised to `dtype`, once at
        load, or (lazy_experts) each time the router picks them: for real-dimension checkpoints."""
        ckpt = Checkpoint(ckpt_or_path) if isinstance(ckpt_or_path, (str, Path)) else ckpt_or_path
        weights = CheckpointWeights(ckpt, dtype) if lazy_experts else load_dense_weights(ckpt, dtype)
        return cls(ckpt.config, weights, dtype=dtype, **kwargs)

    def _checked(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every weight except the routed experts (those are fetched per use, see LazyExperts)."""
        return {name: checked_array(weights, name, shape).astype(self.dtype, copy=False)
                for name, shape in dense_weight_names(self.config).items() if ".mlp.experts." not in name}

    def _experts(self, L: int):
        """A list of the layer's experts for in-memory weights, a LazyExperts view otherwise."""
        lazy = LazyExperts(self._weights, L, self.config, self.dtype)
        if isinstance(self._weights, CheckpointWeights):
            return lazy
        return [lazy[e] for e in range(len(lazy))]       # checks every expert's shape now

    def _layer(self, w: dict, L: int) -> LayerWeights:
        cfg, a, m = self.config, f"model.layers.{L}.self_attn", f"model.layers.{L}.mlp"
        attn = MLAWeights(q_a=w[f"{a}.q_a_proj.weight"], q_a_norm=w[f"{a}.q_a_layernorm.weight"],
                          q_b=w[f"{a}.q_b_proj.weight"], kv_a=w[f"{a}.kv_a_proj_with_mqa.weight"],
                          kv_a_norm=w[f"{a}.kv_a_layernorm.weight"], kv_b=w[f"{a}.kv_b_proj.weight"],
                          o=w[f"{a}.o_proj.weight"])

        def swiglu_weights(prefix: str) -> ExpertWeights:
            return ExpertWeights(w[f"{prefix}.gate_proj.weight"], w[f"{prefix}.up_proj.weight"],
                                 w[f"{prefix}.down_proj.weight"])

        if cfg.is_moe_layer(L):
            mlp = MoEWeights(router=w[f"{m}.gate.weight"], bias=w[f"{m}.gate.e_score_correction_bias"],
                             experts=self._experts(L),
                             shared=swiglu_weights(f"{m}.shared_experts"))
        else:
            mlp = swiglu_weights(m)
        return LayerWeights(input_norm=w[f"model.layers.{L}.input_layernorm.weight"], attn=attn,
                            post_norm=w[f"model.layers.{L}.post_attention_layernorm.weight"], mlp=mlp)

    def new_cache(self, capacity: int = 256) -> LatentCache:
        c = self.config
        return LatentCache(c.num_hidden_layers, c.kv_lora_rank, c.qk_rope_head_dim, self.dtype, capacity)

    def _check_inputs(self, ids, pos, visible, cache, taps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.config
        ids = np.asarray(ids).reshape(-1).astype(np.int64)
        q, T = len(ids), cache.length
        pos = np.asarray(pos).reshape(-1).astype(np.int64)
        visible = np.asarray(visible, dtype=bool)
        if q == 0:
            raise ValueError("Target.forward: no tokens given (ids is empty)")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"Target.forward: token ids must be in 0..{c.vocab_size - 1}, got "
                             f"[{ids.min()}, {ids.max()}]")
        if pos.shape != (q,) or pos.min() < 0:
            raise ValueError(f"Target.forward: pos must be [{q}] non-negative ints, got shape {list(pos.shape)}")
        if visible.shape != (q, T + q):
            raise ValueError(f"Target.forward: visible must be [q, T + q] = [{q}, {T + q}] for a cache of "
                             f"length {T}, got {list(visible.shape)}")
        if not visible.any(axis=1).all():
            blind = np.nonzero(~visible.any(axis=1))[0].tolist()
            raise ValueError(f"Target.forward: rows {blind} of visible see nothing")
        if (cache.num_layers, cache.kv_lora_rank, cache.rope_dim) != (c.num_hidden_layers, c.kv_lora_rank,
                                                                      c.qk_rope_head_dim):
            raise ValueError("Target.forward: the cache was not made for this model (use target.new_cache())")
        bad = [L for L in taps if not 0 <= L < c.num_hidden_layers]
        if bad:
            raise ValueError(f"Target.forward: taps {bad} are not layers 0..{c.num_hidden_layers - 1}")
        return ids, pos, visible

    def forward(self, ids, pos, visible, cache: LatentCache, taps=(), naive_mla: bool | None = None
                ) -> tuple[np.ndarray, dict[int, np.ndarray]]:
        """ids [q], pos [q], visible [q, T+q] bool -> logits [q, V] float64, {L: h [q, H]} for L in taps."""
        cfg = self.config
        ids, pos, visible = self._check_inputs(ids, pos, visible, cache, taps)
        naive = self.naive_mla if naive_mla is None else naive_mla
        T, eps = cache.length, cfg.rms_norm_eps
        h = self.embed[ids]                                              # [q, H] residual stream
        tapped = {}
        for L, lw in enumerate(self.layers):
            x = rms_norm(h, lw.input_norm, eps)                          # [q, H]
            h = h + self.mla(x, pos, visible, cache, L, lw.attn, naive)
            x = rms_norm(h, lw.post_norm, eps)                           # [q, H]
            if cfg.is_moe_layer(L):
                h = h + moe(x, lw.mlp, cfg)
            else:
                h = h + swiglu(x, lw.mlp.gate, lw.mlp.up, lw.mlp.down)
            if L in taps:
                tapped[L] = h.copy()
        cache.set_length(T + len(ids))
        logits = rms_norm(h, self.final_norm, eps) @ self.lm_head.T      # [q, V]
        return logits.astype(np.float64, copy=False), tapped
