"""The Kimi K2.x target in numpy: the oracle every executor and kernel is tested against.

    h = embed[ids]
    for each layer:  h += MLA(RMSNorm_in(h));  h += FFN(RMSNorm_post(h))     (dense SwiGLU on layers
                     < first_k_dense_replace, MoE after)
    logits = lm_head(RMSNorm_final(h))

`Target.forward` follows interfaces.md section 3: new tokens with their absolute positions and a
visibility mask over the cache plus themselves; it appends their latent entries to the cache and
returns the logits and the requested taps (the output of decoder layer L = HF hidden_states[L+1]).
Computation is float64 by default (bf16 weights convert exactly), so a token's logits depend on
which other tokens share the call only at the 1e-15 level.

Letters: q new tokens, T cache length before the call, H hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from ddtree.model.config import KimiConfig
from ddtree.model.tensors import EXPERT_PROJS, expert_name
from ddtree.reference.cache import LatentCache
from ddtree.reference.layers import rms_norm, swiglu
from ddtree.reference.mla import MLA, MLAWeights
from ddtree.reference.moe import ExpertWeights, MoEWeights, moe


@dataclass
class LayerWeights:
    input_norm: np.ndarray                 # [H]
    attn: MLAWeights
    post_norm: np.ndarray                  # [H]
    mlp: ExpertWeights | MoEWeights        # dense SwiGLU (layer < first_k_dense_replace) or MoE


def dense_weight_names(cfg: KimiConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every dense float weight the reference needs; routed experts
    appear as `...experts.E.{gate,up,down}_proj.weight` (dequantised when the file holds INT4)."""
    H, V, N = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for L in range(cfg.num_hidden_layers):
        a = f"model.layers.{L}.self_attn"
        shapes.update({
            f"model.layers.{L}.input_layernorm.weight": (H,),
            f"{a}.q_a_proj.weight": (cfg.q_lora_rank, H),
            f"{a}.q_a_layernorm.weight": (cfg.q_lora_rank,),
            f"{a}.q_b_proj.weight": (N * cfg.qk_head_dim, cfg.q_lora_rank),
            f"{a}.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
            f"{a}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            f"{a}.kv_b_proj.weight": (N * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            f"{a}.o_proj.weight": (H, N * cfg.v_head_dim),
            f"model.layers.{L}.post_attention_layernorm.weight": (H,),
        })
        m = f"model.layers.{L}.mlp"
        if not cfg.is_moe_layer(L):
            I = cfg.intermediate_size
            shapes.update({f"{m}.gate_proj.weight": (I, H), f"{m}.up_proj.weight": (I, H),
                           f"{m}.down_proj.weight": (H, I)})
            continue
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        Is = I * cfg.n_shared_experts
        shapes.update({f"{m}.gate.weight": (E, H), f"{m}.gate.e_score_correction_bias": (E,)})
        for e in range(E):
            for proj in EXPERT_PROJS:
                shapes[f"{expert_name(L, e, proj)}.weight"] = (H, I) if proj == "down_proj" else (I, H)
        shapes.update({f"{m}.shared_experts.gate_proj.weight": (Is, H),
                       f"{m}.shared_experts.up_proj.weight": (Is, H),
                       f"{m}.shared_experts.down_proj.weight": (H, Is)})
    shapes["model.norm.weight"] = (H,)
    shapes["lm_head.weight"] = (V, H)
    return shapes


def load_dense_weights(ckpt, dtype=np.float64) -> dict[str, np.ndarray]:
    """Every weight of `dense_weight_names` from a Checkpoint, as `dtype` (INT4 experts dequantised)."""
    out = {}
    for name, shape in dense_weight_names(ckpt.config).items():
        if name.endswith(".weight") and len(shape) == 2:
            out[name] = ckpt.dense_weight(name[: -len(".weight")], dtype)
        else:
            out[name] = ckpt.get_f32(name).astype(dtype)
    return out


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
        self.embed = w["model.embed_tokens.weight"]                      # [V, H]
        self.final_norm = w["model.norm.weight"]                         # [H]
        self.lm_head = w["lm_head.weight"]                               # [V, H]
        self.layers = [self._layer(w, L) for L in range(cfg.num_hidden_layers)]

    @classmethod
    def from_checkpoint(cls, ckpt_or_path, dtype=np.float64, **kwargs) -> "Target":
        """A Checkpoint (or its directory) -> Target; INT4 experts are dequantised to `dtype`."""
        from ddtree.model.checkpoint import Checkpoint
        ckpt = Checkpoint(ckpt_or_path) if isinstance(ckpt_or_path, (str, Path)) else ckpt_or_path
        return cls(ckpt.config, load_dense_weights(ckpt, dtype), dtype=dtype, **kwargs)

    def _checked(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for name, shape in dense_weight_names(self.config).items():
            if name not in weights:
                raise KeyError(f"Target: weight '{name}' {list(shape)} is missing")
            a = np.asarray(weights[name])
            if a.shape != shape:
                raise ValueError(f"Target: weight '{name}' has shape {list(a.shape)}, the config expects {list(shape)}")
            if a.dtype.kind != "f":
                raise TypeError(f"Target: weight '{name}' is {a.dtype}; expected dense floats "
                                "(bf16 bits and INT4 must be converted, e.g. by Checkpoint.dense_weight)")
            out[name] = a.astype(self.dtype, copy=False)
        return out

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
                             experts=[swiglu_weights(f"{m}.experts.{e}") for e in range(cfg.n_routed_experts)],
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
            raise ValueError(f"Target.forward: rows {np.nonzero(~visible.any(axis=1))[0].tolist()} of visible see nothing")
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
