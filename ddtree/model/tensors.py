"""The tensor table: every tensor a Kimi K2.x target / DFlash drafter checkpoint holds, with its
dtype and shape, derived from the config (docs/kimi-k2.md section 3, docs/ddtree.md section 1.6).

Names are canonical: the target's `language_model.` prefix is stripped (K2.6 layout), so body
tensors start with `model.` and the head is `lm_head.weight`; drafter names carry no prefix.
The synthetic writer writes exactly this table and the checkpoint reader checks against it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.model.config import DrafterConfig, KimiConfig

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorSpec:
    dtype: str              # safetensors dtype: "BF16", "F32", "I32", "I64"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "U16": 2,
              "I32": 4, "U32": 4, "I64": 8, "U64": 8, "BOOL": 1}


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}"


def int4_specs(module: str, out_dim: int, in_dim: int, group: int, shape_dtype: str = "I32") -> dict:
    """The three compressed-tensors tensors of one INT4 linear W [out, in]."""
    return {
        f"{module}.weight_packed": TensorSpec("I32", (out_dim, -(-in_dim // 8))),
        f"{module}.weight_scale": TensorSpec("BF16", (out_dim, in_dim // group)),
        f"{module}.weight_shape": TensorSpec(shape_dtype, (2,)),
    }


def target_tensor_specs(cfg: KimiConfig, shape_dtype: str = "I32") -> dict[str, TensorSpec]:
    """name -> spec for the whole text model, in checkpoint order (layer by layer)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    specs: dict[str, TensorSpec] = {"model.embed_tokens.weight": TensorSpec("BF16", (V, H))}
    for L in range(cfg.num_hidden_layers):
        specs.update(layer_specs(cfg, L, shape_dtype))
    specs["model.norm.weight"] = TensorSpec("BF16", (H,))
    specs["lm_head.weight"] = TensorSpec("BF16", (V, H))
    return specs


def target_size(cfg: KimiConfig) -> tuple[int, int]:
    """(bytes, tensor count) of target_tensor_specs(cfg) without building it: one layer of each kind
    (dense, MoE) is built and counted for all of its kind, so a 100000-layer request costs nothing."""
    H, V = cfg.hidden_size, cfg.vocab_size
    n_bytes, n_tensors, per_kind = 2 * (2 * V * H) + 2 * H, 3, {}
    for L in range(cfg.num_hidden_layers):
        kind = cfg.is_moe_layer(L)
        if kind not in per_kind:
            layer = layer_specs(cfg, L)
            per_kind[kind] = (sum(s.nbytes for s in layer.values()), len(layer))
        n_bytes, n_tensors = n_bytes + per_kind[kind][0], n_tensors + per_kind[kind][1]
    return n_bytes, n_tensors


def layer_specs(cfg: KimiConfig, L: int, shape_dtype: str = "I32") -> dict[str, TensorSpec]:
    """name -> spec for decoder layer L (attention, then its dense MLP or its MoE)."""
    H = cfg.hidden_size
    nh, dq, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    p = f"model.layers.{L}"
    bf = lambda *shape: TensorSpec("BF16", shape)  # noqa: E731
    specs = {
        f"{p}.input_layernorm.weight": bf(H),
        f"{p}.self_attn.q_a_proj.weight": bf(cfg.q_lora_rank, H),
        f"{p}.self_attn.q_a_layernorm.weight": bf(cfg.q_lora_rank),
        f"{p}.self_attn.q_b_proj.weight": bf(nh * dq, cfg.q_lora_rank),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": bf(cfg.kv_lora_rank + cfg.qk_rope_head_dim, H),
        f"{p}.self_attn.kv_a_layernorm.weight": bf(cfg.kv_lora_rank),
        f"{p}.self_attn.kv_b_proj.weight": bf(nh * (cfg.qk_nope_head_dim + dv), cfg.kv_lora_rank),
        f"{p}.self_attn.o_proj.weight": bf(H, nh * dv),
        f"{p}.post_attention_layernorm.weight": bf(H),
    }
    if not cfg.is_moe_layer(L):
        I = cfg.intermediate_size
        specs.update({f"{p}.mlp.gate_proj.weight": bf(I, H), f"{p}.mlp.up_proj.weight": bf(I, H),
                      f"{p}.mlp.down_proj.weight": bf(H, I)})
        return specs
    E, I, Is = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    g = cfg.quant.group_size if cfg.quant else None
    specs[f"{p}.mlp.gate.weight"] = bf(E, H)
    specs[f"{p}.mlp.gate.e_score_correction_bias"] = TensorSpec("F32", (E,))
    for e in range(E):
        for proj in EXPERT_PROJS:
            out_dim, in_dim = (H, I) if proj == "down_proj" else (I, H)
            m = expert_name(L, e, proj)
            if g is None:
                specs[f"{m}.weight"] = bf(out_dim, in_dim)
            else:
                specs.update(int4_specs(m, out_dim, in_dim, g, shape_dtype))
    specs.update({f"{p}.mlp.shared_experts.gate_proj.weight": bf(Is, H),
                  f"{p}.mlp.shared_experts.up_proj.weight": bf(Is, H),
                  f"{p}.mlp.shared_experts.down_proj.weight": bf(H, Is)})
    return specs


def drafter_tensor_specs(d: DrafterConfig) -> dict[str, TensorSpec]:
    """name -> spec for a DFlash drafter (no embedding, no lm_head: it borrows the target's)."""
    H, hd = d.hidden_size, d.head_dim
    bf = lambda *shape: TensorSpec("BF16", shape)  # noqa: E731
    specs = {"fc.weight": bf(H, d.num_taps * H), "hidden_norm.weight": bf(H)}
    for i in range(d.num_hidden_layers):
        p = f"layers.{i}"
        specs.update({
            f"{p}.input_layernorm.weight": bf(H),
            f"{p}.self_attn.q_proj.weight": bf(d.num_attention_heads * hd, H),
            f"{p}.self_attn.k_proj.weight": bf(d.num_key_value_heads * hd, H),
            f"{p}.self_attn.v_proj.weight": bf(d.num_key_value_heads * hd, H),
            f"{p}.self_attn.o_proj.weight": bf(H, d.num_attention_heads * hd),
            f"{p}.self_attn.q_norm.weight": bf(hd),
            f"{p}.self_attn.k_norm.weight": bf(hd),
            f"{p}.post_attention_layernorm.weight": bf(H),
            f"{p}.mlp.gate_proj.weight": bf(d.intermediate_size, H),
            f"{p}.mlp.up_proj.weight": bf(d.intermediate_size, H),
            f"{p}.mlp.down_proj.weight": bf(H, d.intermediate_size),
        })
    specs["norm.weight"] = bf(H)
    return specs
