"""Named model shapes for synthetic checkpoints (`ddtree synth --preset NAME`).

Test presets keep every structural feature of Kimi K2.x (dense layer 0 then MoE layers, >= 8
experts, top-k > 1, shared expert, MLA with a nope/rope split, YaRN, explicit drafter taps) and the
divisibility rules of docs/interfaces.md section 2: heads divisible by 4, expert and dense intermediate
sizes multiples of 512, vocab a multiple of 256, so tp = 4 still splits evenly.
"""
from __future__ import annotations

from dataclasses import replace

from ddtree.errors import InputError
from ddtree.model.config import DrafterConfig, KimiConfig, QuantConfig, RopeConfig

# Byte tokenizer of the tiny models (docs/interfaces.md section 2): ids 0..255 are bytes, then these.
BYTE_BOS, BYTE_EOS, BYTE_PAD, BYTE_MASK = 256, 257, 258, 259

_TINY_ROPE = RopeConfig(theta=10000.0, type="yarn", factor=4.0, original_max_position_embeddings=64,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
_REAL_ROPE = RopeConfig(theta=50000.0, type="yarn", factor=64.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


def _byte_ids() -> dict:
    return dict(bos_token_id=BYTE_BOS, eos_token_ids=(BYTE_EOS,), pad_token_id=BYTE_PAD, tokenizer="bytes")


def _tiny() -> tuple[KimiConfig, DrafterConfig]:
    t = KimiConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=64,
                   kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                   vocab_size=512, intermediate_size=512, moe_intermediate_size=512,
                   n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                   first_k_dense_replace=1, rope=_TINY_ROPE, quant=QuantConfig(group_size=32),
                   max_position_embeddings=4096, **_byte_ids())
    d = DrafterConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=512,
                      block_size=4, target_layer_ids=(1, 2), mask_token_id=BYTE_MASK,
                      rope=_TINY_ROPE, rms_norm_eps=1e-5, num_target_layers=4)
    return t, d


def _tiny_grouped() -> tuple[KimiConfig, DrafterConfig]:
    """n_group > 1: 16 experts in 4 groups, 2 groups kept, top-4."""
    t, d = _tiny()
    return replace(t, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2), d


def _small_mla() -> tuple[KimiConfig, DrafterConfig]:
    """The real MLA head geometry (latent 512 + rope 64, nope 128, v 128) and the real YaRN."""
    t = KimiConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, q_lora_rank=256,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   vocab_size=1024, intermediate_size=1024, moe_intermediate_size=512,
                   n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                   first_k_dense_replace=1, rope=_REAL_ROPE, quant=QuantConfig(group_size=32),
                   **_byte_ids())
    d = DrafterConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=1024,
                      block_size=8, target_layer_ids=(1, 2), mask_token_id=BYTE_MASK,
                      rope=_REAL_ROPE, rms_norm_eps=1e-5, num_target_layers=4)
    return t, d


def _kimi_k26(layers: int) -> tuple[KimiConfig, DrafterConfig]:
    """Kimi K2.6 dimensions (docs/kimi-k2.md section 2.2) with `layers` decoder layers."""
    t = KimiConfig(hidden_size=7168, num_hidden_layers=layers, num_attention_heads=64, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   vocab_size=163840, intermediate_size=18432, moe_intermediate_size=2048,
                   n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1,
                   first_k_dense_replace=1, rope=_REAL_ROPE, quant=QuantConfig(group_size=32),
                   bos_token_id=163584, eos_token_ids=(163585,), pad_token_id=163839)
    real_taps = (1, 12, 24, 35, 47, 58)
    taps = tuple(x for x in real_taps if x < layers - 1) or (max(layers - 2, 0),)
    d = DrafterConfig(hidden_size=7168, intermediate_size=18432, num_hidden_layers=6,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=163840,
                      block_size=8, target_layer_ids=taps, mask_token_id=163838,
                      rope=_REAL_ROPE, rms_norm_eps=1e-5, num_target_layers=layers)
    return t, d


TEST_PRESETS = {"tiny": _tiny, "tiny-grouped": _tiny_grouped, "small-mla": _small_mla}
PRESETS = (*TEST_PRESETS, "kimi-k2.6")


class PresetError(InputError):
    """A preset asked for with a depth it cannot have, or an unknown preset (names the flag and the value)."""


def get_preset(name: str, layers: int | None = None) -> tuple[KimiConfig, DrafterConfig]:
    """(target config, drafter config) for a preset; `layers` overrides the target depth."""
    if name == "kimi-k2.6":
        if layers is None:
            raise PresetError("preset 'kimi-k2.6' requires --layers (the full model is 61 layers, ~595 GB)")
        if layers < 2:
            raise PresetError(f"--layers {layers}: kimi-k2.6 needs at least 2 layers (dense layer 0 + one MoE)")
        return _kimi_k26(layers)
    if name not in TEST_PRESETS:
        raise PresetError(f"--preset {name!r}: unknown preset (known: {', '.join(PRESETS)})")
    t, d = TEST_PRESETS[name]()
    if layers is not None:
        if layers < 3:
            raise PresetError(f"--layers {layers}: test presets need at least 3 layers (drafter taps)")
        taps = tuple(x for x in d.target_layer_ids if x < layers - 1)
        t = replace(t, num_hidden_layers=layers)
        d = replace(d, target_layer_ids=taps, num_target_layers=layers)
    return t, d
