"""Weights of the reference target: the dense float tensors it needs, by canonical checkpoint name.

`Target(config, weights)` takes any name -> array mapping with the names of `dense_weight_names`
(routed experts as `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, dense). Two sources:
  load_dense_weights(ckpt)    everything read once (INT4 experts dequantised): small checkpoints
  CheckpointWeights(ckpt)     read on access, nothing kept: real-dimension checkpoints, where the
                              routed experts are fetched only when the router picks them (LazyExperts)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ddtree.model.config import KimiConfig
from ddtree.model.tensors import EXPERT_PROJS, expert_name
from ddtree.reference.moe import ExpertWeights


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
    lazy = CheckpointWeights(ckpt, dtype)
    return {name: lazy[name] for name in lazy}


class CheckpointWeights(Mapping):
    """Read-on-access view of a Checkpoint with the names of `dense_weight_names`: a tensor is read
    (and INT4 dequantised) each time it is looked up, nothing is kept. With it the routed experts
    of a real-dimension checkpoint never sit in memory all at once."""

    def __init__(self, ckpt, dtype=np.float64):
        self.ckpt, self.dtype = ckpt, np.dtype(dtype)
        self.shapes = dense_weight_names(ckpt.config)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shapes:
            raise KeyError(f"{self.ckpt.path}: '{name}' is not a weight of the reference")
        if name.endswith(".weight") and len(self.shapes[name]) == 2:
            return self.ckpt.dense_weight(name[: -len(".weight")], self.dtype)
        return self.ckpt.get_f32(name).astype(self.dtype)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


class LazyExperts(Sequence):
    """The routed experts of one layer, fetched from the weights mapping when the router picks them."""

    def __init__(self, weights: Mapping, layer: int, cfg: KimiConfig, dtype):
        self.weights, self.layer, self.dtype = weights, layer, dtype
        self.count = cfg.n_routed_experts
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, e: int) -> ExpertWeights:
        if not 0 <= e < self.count:
            raise IndexError(f"expert {e} of layer {self.layer}: only {self.count} experts")
        w = {}
        for proj, shape in self.shapes.items():
            name = f"{expert_name(self.layer, e, proj)}.weight"
            w[proj] = checked_array(self.weights, name, shape).astype(self.dtype, copy=False)
        return ExpertWeights(w["gate_proj"], w["up_proj"], w["down_proj"])


def checked_array(weights: Mapping, name: str, shape: tuple) -> np.ndarray:
    if name not in weights:
        raise KeyError(f"Target: weight '{name}' {list(shape)} is missing")
    a = np.asarray(weights[name])
    if a.shape != shape:
        raise ValueError(f"Target: weight '{name}' has shape {list(a.shape)}, the config expects {list(shape)}")
    if a.dtype.kind != "f":
        raise TypeError(f"Target: weight '{name}' is {a.dtype}; expected dense floats "
                        "(bf16 bits and INT4 must be converted, e.g. by Checkpoint.dense_weight)")
    return a
