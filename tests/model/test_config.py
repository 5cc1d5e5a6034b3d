"""Config parsing of both Kimi layouts, rope keys, and the errors that name the offending field."""
import copy
import math

import pytest

from ddtree.model.config import ConfigError, DrafterConfig, KimiConfig
from ddtree.model.presets import get_preset


def kimi_k26_json(beta_fast=32.0, rope_key="rope_scaling"):
    """A K2.6-style config.json as the real file spells it (docs/kimi-k2.md 2.1-2.2, 4.1)."""
    rope = {"beta_fast": beta_fast, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}
    rope = {**rope, "type": "yarn"} if rope_key == "rope_scaling" else {**rope, "rope_type": "yarn",
                                                                        "rope_theta": 50000.0}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                 "dynamic": False, "actorder": None, "observer": "minmax"},
                 "input_activations": None, "output_activations": None}},
             "ignore": ["lm_head", "re:.*self_attn.*"]}
    text = {"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
            "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840, "rms_norm_eps": 1e-5,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "norm_topk_prob": True, "routed_scaling_factor": 2.827, "max_position_embeddings": 262144,
            "rope_theta": 50000.0, rope_key: rope, "quantization_config": quant}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
            "quantization_config": quant, "text_config": text}


def test_nested_k26_layout():
    cfg = KimiConfig.from_dict(kimi_k26_json())
    assert cfg.layout == "k2.6" and cfg.tensor_prefix == "language_model."
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts) == (7168, 61, 384)
    assert cfg.qk_head_dim == 192 and cfg.quant.group_size == 32
    assert cfg.rope.type == "yarn" and cfg.rope.beta_fast == 32.0 and cfg.rope.factor == 64.0
    assert cfg.moe_layers == list(range(1, 61))
    # sigma = 192^-1/2 * (0.1 ln 64 + 1)^2 (docs/kimi-k2.md 5.2)
    assert cfg.softmax_scale == pytest.approx(0.1446796, abs=5e-8)
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(64) + 1) ** 2, rel=1e-15)


# The MLA softmax scale sigma = qk_head_dim^-1/2 * m^2, m = 0.1 * mscale_all_dim * ln(factor) + 1 when
# rope scaling is yarn with mscale_all_dim != 0, else m = 1 (docs/kimi-k2.md 5.2). Worked by hand:
#   K2 heads, yarn factor 32:  qk = 128 + 64 = 192, 192^-1/2 = 0.0721687836487;
#                              m = 0.1 * 1.0 * ln 32 + 1 = 0.1 * 3.4657359028 + 1 = 1.34657359028,
#                              m^2 = 1.81326043404; sigma = 0.0721687836487 * 1.81326043404 = 0.130860799963
#   qk = 64 + 32 = 96, yarn factor 40, mscale_all_dim 0.707:
#                              m = 0.0707 * ln 40 + 1 = 0.0707 * 3.68887945411 + 1 = 1.26080377741,
#                              sigma = 96^-1/2 * m^2 = 0.102062072616 * 1.58962616513 = 0.162240541097
#   no yarn, or yarn without mscale_all_dim: sigma = 192^-1/2 = 0.0721687836487
@pytest.mark.parametrize("nope, rope_dim, scaling, sigma", [
    (128, 64, {"factor": 32.0, "mscale_all_dim": 1.0}, 0.130860799963),
    (64, 32, {"factor": 40.0, "mscale_all_dim": 0.707}, 0.162240541097),
    (128, 64, {"factor": 32.0}, 0.0721687836487),                     # mscale_all_dim absent: no boost
    (128, 64, None, 0.0721687836487),                                 # no rope scaling at all
])
def test_softmax_scale_hand_computed(nope, rope_dim, scaling, sigma):
    d = kimi_k26_json()["text_config"]
    d.update(qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim)
    del d["rope_scaling"]
    if scaling is not None:
        d["rope_scaling"] = {"type": "yarn", "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                             "original_max_position_embeddings": 4096, **scaling}
    cfg = KimiConfig.from_dict(d)
    assert cfg.qk_head_dim == nope + rope_dim
    assert cfg.softmax_scale == pytest.approx(sigma, rel=1e-11)


def test_flat_k2_thinking_layout_with_beta_fast_1():
    d = kimi_k26_json(beta_fast=1.0)["text_config"]
    d["eos_token_id"] = 163586
    cfg = KimiConfig.from_dict(d)
    assert cfg.layout == "k2-thinking" and cfg.tensor_prefix == ""
    assert cfg.rope.beta_fast == 1.0 and cfg.eos_token_id == 163586


@pytest.mark.parametrize("beta_fast", [1.0, 32.0])
def test_rope_parameters_key_equals_rope_scaling(beta_fast):
    a = KimiConfig.from_dict(kimi_k26_json(beta_fast, "rope_scaling"))
    b = KimiConfig.from_dict(kimi_k26_json(beta_fast, "rope_parameters"))
    assert a.rope == b.rope and a.rope.beta_fast == beta_fast and b.rope.theta == 50000.0


@pytest.mark.parametrize("layout", ["k2.6", "k2-thinking"])
@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_to_dict_round_trip(layout, rope_key):
    for preset in ("tiny", "tiny-grouped", "small-mla"):
        cfg, dcfg = get_preset(preset)
        back = KimiConfig.from_dict(cfg.to_dict(layout, rope_key))
        assert back == KimiConfig(**{**cfg.__dict__, "layout": layout})
        assert DrafterConfig.from_dict(dcfg.to_dict(rope_key)) == dcfg


def _break(path, value):
    d = kimi_k26_json()
    node = d
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    # the text_config copy is the one that counts; keep the top-level copy consistent
    d["quantization_config"] = copy.deepcopy(d["text_config"]["quantization_config"])
    return d


W = ("text_config", "quantization_config", "config_groups", "group_0", "weights")


@pytest.mark.parametrize("path,value,match", [
    ((*W, "symmetric"), False, "symmetric"),
    ((*W, "group_size"), 12, "group_size"),
    ((*W, "num_bits"), 8, "num_bits"),
    (("text_config", "scoring_func"), "softmax", "scoring_func"),
    (("text_config", "rope_scaling", "type"), "longrope", "rope_scaling.type"),
    (("text_config", "hidden_size"), KeyError, "hidden_size"),
    (("text_config", "n_group"), 5, "n_group"),
])
def test_unsupported_values_name_the_field(path, value, match):
    with pytest.raises(ConfigError, match=match):
        KimiConfig.from_dict(_break(path, value))


def test_group_size_that_does_not_divide():
    d = _break((*W, "group_size"), 48)      # a multiple of 8 that does not divide 2048 / 7168
    with pytest.raises(ConfigError, match="group_size 48 does not divide"):
        KimiConfig.from_dict(d)


def test_drafter_config_and_taps():
    d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168,
         "intermediate_size": 18432, "num_hidden_layers": 6, "num_attention_heads": 64, "num_key_value_heads": 8,
         "head_dim": 128, "vocab_size": 163840, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
         "rope_parameters": {"rope_type": "deepseek_yarn", "rope_theta": 50000.0, "factor": 64.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                             "mscale_all_dim": 1.0},
         "block_size": 8, "num_target_layers": 61,
         "dflash_config": {"mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]}}
    dc = DrafterConfig.from_dict(d)
    assert dc.block_size == 8 and dc.mask_token_id == 163838 and dc.num_taps == 6
    assert dc.rope.type == "yarn" and dc.rope.factor == 64.0 and dc.attention_factor == 1.0
    target = KimiConfig.from_dict(kimi_k26_json())
    dc.check_target(target)
    bad = DrafterConfig.from_dict({**d, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1, 60]}})
    with pytest.raises(ConfigError, match="target_layer_ids contains 60"):
        bad.check_target(target)
    with pytest.raises(ConfigError, match="dflash_config.mask_token_id"):
        DrafterConfig.from_dict({**d, "dflash_config": {"target_layer_ids": [1]}})
