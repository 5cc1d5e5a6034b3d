"""Kimi K2.x target and DFlash drafter configs, parsed from the checkpoints' own `config.json`.

Two target layouts exist (docs/kimi-k2.md section 2.1):
  k2-thinking  flat DeepSeek-V3 config, tensors prefixed `model.`
  k2.6         K2.5/K2.6: text model nested in `text_config`, tensors prefixed `language_model.model.`
RoPE parameters come as `rope_scaling` (original files) or `rope_parameters` (transformers 5).

Validation happens here, in one place, for every config that reaches the model: each field is read
through `Fields` (model/fields.py), which checks its type (an integer is not a bool, a string, a float or null; a number
is finite), its range (sizes and counts >= 1, eps and scales > 0, ids in [0, vocab)) and names the
file, the dotted field (`text_config.rms_norm_eps`), the value found and what was expected in a
`ConfigError`. The dataclasses' `__post_init__` then checks the fields against each other (heads
against kv heads, experts against groups, the quantisation group against the dimensions). Anything
we do not implement fails the same way. `Fields` takes the error class, so other readers of JSON
(the engine directory's config) can share it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.model.fields import ConfigError, Fields, check_field, show

# ----------------------------------------------------------------------------------------------
# RoPE

ROPE_TYPES = ("default", "yarn", "deepseek_yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"                 # "default" | "yarn" ("deepseek_yarn" is read as yarn)
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0           # HF/vLLM default when absent: no softmax boost

    @staticmethod
    def from_hf(cfg, where: str = "config.json") -> "RopeConfig":
        """From the object holding `rope_theta` and `rope_scaling` / `rope_parameters` (Fields, or a
        dict read as the file `where`). theta > 1 (YaRN divides by ln theta); a YaRN factor >= 1 (as
        transformers requires); betas > 0; mscales >= 0 (yarn_m must stay positive)."""
        f = cfg if isinstance(cfg, Fields) else Fields(cfg, where)
        params = f.obj("rope_parameters", None, null_ok=True)
        if params is not None:
            theta = (params.number("rope_theta", gt=1) if "rope_theta" in params
                     else f.number("rope_theta", 10000.0, gt=1))
        else:
            theta = f.number("rope_theta", gt=1)
        scaling = params if params is not None and params.d else f.obj("rope_scaling", None, null_ok=True)
        if scaling is None or not scaling.d:
            return RopeConfig(theta=theta)
        type_key = "rope_type" if "rope_type" in scaling else "type"
        rtype = scaling.string(type_key, "default", choices=ROPE_TYPES)
        if rtype == "default":
            return RopeConfig(theta=theta)
        return RopeConfig(
            theta=theta, type="yarn",
            factor=scaling.number("factor", ge=1),
            original_max_position_embeddings=scaling.integer("original_max_position_embeddings", 4096, lo=1),
            beta_fast=scaling.number("beta_fast", 32.0, gt=0),
            beta_slow=scaling.number("beta_slow", 1.0, gt=0),
            mscale=scaling.number("mscale", 1.0, ge=0),
            mscale_all_dim=scaling.number("mscale_all_dim", 0.0, ge=0),
        )

    def to_hf(self, key: str = "rope_scaling") -> dict:
        if self.type == "default":
            return {}
        d = {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "factor": self.factor,
             "mscale": self.mscale, "mscale_all_dim": self.mscale_all_dim,
             "original_max_position_embeddings": self.original_max_position_embeddings}
        if key == "rope_parameters":
            return {**d, "rope_type": "yarn", "rope_theta": self.theta}
        return {**d, "type": "yarn"}


def yarn_mscale(factor: float, mscale: float) -> float:
    """yarn_m(s, a) = 0.1 a ln s + 1 for s > 1 (docs/kimi-k2.md 5.3)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


# ----------------------------------------------------------------------------------------------
# compressed-tensors INT4

@dataclass(frozen=True)
class QuantConfig:
    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True
    strategy: str = "group"
    format: str = "pack-quantized"

    @staticmethod
    def from_hf(q, where: str = "config.json") -> "QuantConfig":
        """From a `quantization_config` object (Fields, or a dict read as the file `where`): W4A16
        compressed-tensors pack-quantized, symmetric int4 groups (docs/kimi-k2.md 4.1), nothing else."""
        q = q if isinstance(q, Fields) else Fields(q, where, "quantization_config")
        q.string("quant_method", choices=("compressed-tensors",))
        q.string("format", choices=("pack-quantized",))
        groups = q.obj("config_groups", what="exactly one quantisation group")
        if len(groups.d) != 1:
            raise groups.error(f"{groups.file}: field '{groups.path}' has {len(groups.d)} groups "
                               f"({', '.join(groups.d) or 'none'}): expected exactly one")
        gname = next(iter(groups.d))
        group = groups.obj(gname)
        w = group.obj("weights")
        w.integer("num_bits", lo=4, hi=4, expected="4 (INT4 only)")
        w.string("type", choices=("int",))
        if w.raw("symmetric") is not True:
            raise w.bad("symmetric", w.raw("symmetric"), "true (symmetric INT4 only)")
        w.string("strategy", choices=("group",))
        if w.raw("dynamic", False) is not False:
            raise w.bad("dynamic", w.raw("dynamic"), "false (static scales only)")
        if w.raw("actorder", None) not in (None, False):
            raise w.bad("actorder", w.raw("actorder"), "null (no activation ordering)")
        gs = w.integer("group_size", lo=8, expected="a positive multiple of 8")
        if gs % 8:
            raise w.bad("group_size", gs, "a positive multiple of 8")
        for k in ("input_activations", "output_activations"):
            if group.raw(k, None) is not None:
                raise group.bad(k, group.raw(k), "null (W4A16 only)")
        return QuantConfig(group_size=gs)

    def to_hf(self) -> dict:
        return {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": self.num_bits, "type": "int", "symmetric": self.symmetric,
                            "strategy": self.strategy, "group_size": self.group_size,
                            "dynamic": False, "actorder": None, "observer": "minmax"},
                "input_activations": None, "output_activations": None}},
            "kv_cache_scheme": None,
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        }


# ----------------------------------------------------------------------------------------------
# Kimi K2.x target

LAYOUTS = ("k2.6", "k2-thinking")
TENSOR_PREFIX = {"k2.6": "language_model.", "k2-thinking": ""}
TOKENIZERS = ("tiktoken", "bytes")
# the text model's required integer fields (>= 1; first_k_dense_replace >= 0)
_KIMI_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "intermediate_size",
              "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
              "first_k_dense_replace")


@dataclass(frozen=True)
class KimiConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-5
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.827
    max_position_embeddings: int = 262144
    quant: QuantConfig | None = None
    bos_token_id: int = 163584
    eos_token_ids: tuple[int, ...] = (163585,)
    pad_token_id: int | None = 163839     # None: the file says null or nothing (ddtree never pads)
    tokenizer: str = "tiktoken"           # "tiktoken" (real Kimi) | "bytes" (tiny models)
    layout: str = "k2.6"
    # (file, dotted path of the text model's fields) for error messages; not part of the config
    source: tuple[str, str] = field(default=("config.json", ""), compare=False, repr=False)

    def __post_init__(self):
        """The fields against each other (each field's own type and range: from_dict)."""
        s = self.source
        check_field(self.layout in LAYOUTS, s, "layout", self.layout, f"one of {', '.join(LAYOUTS)}")
        check_field(self.scoring_func == "sigmoid", s, "scoring_func", self.scoring_func,
               '"sigmoid" (the only scoring implemented)')
        check_field(self.topk_method == "noaux_tc", s, "topk_method", self.topk_method,
               '"noaux_tc" (the only routing implemented)')
        check_field(self.moe_layer_freq == 1, s, "moe_layer_freq", self.moe_layer_freq,
               "1 (every layer after the dense ones is MoE)")
        check_field(self.n_routed_experts % self.n_group == 0, s, "n_group", self.n_group,
               f"a divisor of n_routed_experts {self.n_routed_experts} (not divisible by n_group {self.n_group})")
        check_field(1 <= self.topk_group <= self.n_group, s, "topk_group", self.topk_group,
               f"an integer in 1..n_group ({self.n_group})")
        most = self.topk_group * (self.n_routed_experts // self.n_group)
        check_field(self.num_experts_per_tok <= most, s, "num_experts_per_tok", self.num_experts_per_tok,
               f"at most the {most} experts in topk_group {self.topk_group} of n_group {self.n_group} groups "
               f"of n_routed_experts {self.n_routed_experts}")
        check_field(self.qk_rope_head_dim % 2 == 0, s, "qk_rope_head_dim", self.qk_rope_head_dim,
               "an even integer (RoPE rotates pairs)")
        check_field(self.first_k_dense_replace <= self.num_hidden_layers, s, "first_k_dense_replace",
               self.first_k_dense_replace, f"an integer in 0..num_hidden_layers ({self.num_hidden_layers})")
        check_field(self.tokenizer in TOKENIZERS, s, "ddtree_tokenizer", self.tokenizer, '"bytes" or absent')
        if self.quant is not None:
            g = self.quant.group_size
            for name, k in (("hidden_size", self.hidden_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                check_field(k % g == 0, s, "quantization_config.config_groups.*.weights.group_size", g,
                       f"a divisor of {name} {k} (group_size {g} does not divide {name} {k})")

    # derived -------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """sigma = qk_head_dim^-1/2 * m^2, m = yarn_m(factor, mscale_all_dim) when mscale_all_dim != 0."""
        s = self.qk_head_dim ** -0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            s *= m * m
        return s

    @property
    def tensor_prefix(self) -> str:
        return TENSOR_PREFIX[self.layout]

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def eos_token_id(self) -> int:
        return self.eos_token_ids[0]

    # IO ------------------------------------------------------------------------------------
    @staticmethod
    def from_dict(d: dict, where: str = "config.json", prefix: str = "") -> "KimiConfig":
        """A config.json as a dict; errors name `where` (the file) and each field's dotted path, under
        `prefix` when the config is itself a field of a bigger file (an engine's config.json: "model")."""
        top = Fields(d, where, prefix)
        layout = "k2.6" if "text_config" in top else "k2-thinking"
        t = top.obj("text_config", what="the text model's fields") if layout == "k2.6" else top
        vals = {k: t.integer(k, lo=0 if k == "first_k_dense_replace" else 1) for k in _KIMI_INTS}
        vals["num_experts_per_tok"] = t.integer("num_experts_per_tok", lo=1, hi=vals["n_routed_experts"])
        vals["first_k_dense_replace"] = t.integer("first_k_dense_replace", lo=0, hi=vals["num_hidden_layers"])
        opt = dict(
            rms_norm_eps=t.number("rms_norm_eps", 1e-5, gt=0),
            moe_layer_freq=t.integer("moe_layer_freq", 1, lo=1, hi=1,
                                     expected="1 (every layer after the dense ones is MoE)"),
            n_group=t.integer("n_group", 1, lo=1),
            topk_group=t.integer("topk_group", 1, lo=1),
            topk_method=t.string("topk_method", "noaux_tc", choices=("noaux_tc",)),
            scoring_func=t.string("scoring_func", "sigmoid", choices=("sigmoid",)),
            routed_scaling_factor=t.number("routed_scaling_factor", 2.827, gt=0),
            max_position_embeddings=t.integer("max_position_embeddings", 262144, lo=1),
        )
        if t.boolean("norm_topk_prob", True) is not True:
            raise t.bad("norm_topk_prob", False, "true (Kimi renormalises the top-k weights)")
        holder = t if "quantization_config" in t else top
        q = holder.obj("quantization_config", None, null_ok=True)      # absent, null or {}: not quantised
        vocab = vals["vocab_size"]

        def token_id(key, default, null_ok=False):
            """K2.6 keeps the ids at the top level, with a copy in text_config; an absent id takes
            Kimi's, which a smaller vocabulary must not lack."""
            at = top if key in top else t
            if key not in at and default is not None and default >= vocab:
                raise ConfigError(f"{t.file}: missing field '{t.name(key)}': Kimi's default {default} is "
                                  f"not below vocab_size {vocab}")
            return at.integer(key, default, lo=0, hi=vocab - 1, null_ok=null_ok)
        bos = token_id("bos_token_id", 163584)
        eos_at = top if "eos_token_id" in top else t
        if isinstance(eos_at.raw("eos_token_id", None), list):
            eos = tuple(eos_at.int_list("eos_token_id", lo=0, hi=vocab - 1))
        else:
            eos = (token_id("eos_token_id", 163585),)
        pad = token_id("pad_token_id", None, null_ok=True)
        tokenizer = (t if "ddtree_tokenizer" in t else top).string("ddtree_tokenizer", "tiktoken", choices=TOKENIZERS)
        return KimiConfig(
            **vals, **opt,
            rope=RopeConfig.from_hf(t),
            quant=QuantConfig.from_hf(q) if q is not None and q.d else None,
            bos_token_id=bos, eos_token_ids=eos, pad_token_id=pad,
            tokenizer=tokenizer, layout=layout, source=(t.file, t.path),
        )

    def to_dict(self, layout: str | None = None, rope_key: str = "rope_scaling") -> dict:
        """config.json with the real field names, in `layout` (default: this config's own)."""
        layout = layout or self.layout
        t = {
            "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
            **{k: getattr(self, k) for k in (
                "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "intermediate_size",
                "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "first_k_dense_replace", "rms_norm_eps", "moe_layer_freq", "n_group", "topk_group",
                "topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
                "max_position_embeddings")},
            "num_key_value_heads": self.num_attention_heads,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "use_cache": True,
            "rope_theta": self.rope.theta,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "torch_dtype": "bfloat16",
        }
        if self.rope.type != "default":
            t[rope_key] = self.rope.to_hf(rope_key)
        if self.tokenizer != "tiktoken":
            t["ddtree_tokenizer"] = self.tokenizer
        if self.quant is not None:
            t["quantization_config"] = self.quant.to_hf()
        if layout == "k2-thinking":
            return t
        t["model_type"] = "kimi_k2"
        top = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
               "pad_token_id": self.pad_token_id, "media_placeholder_token_id": 163605,
               "tie_word_embeddings": False, "text_config": t}
        if self.tokenizer != "tiktoken":
            top["ddtree_tokenizer"] = self.tokenizer
        if self.quant is not None:
            top["quantization_config"] = self.quant.to_hf()
        return top


# ----------------------------------------------------------------------------------------------
# DFlash drafter

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope: RopeConfig
    rms_norm_eps: float = 1e-6
    num_target_layers: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    attention_factor: float = 1.0          # `ddtree_attention_factor` (docs/ddtree.md 1.7)
    # (file, dotted path of the drafter's fields) for error messages; not part of the config
    source: tuple[str, str] = field(default=("drafter config.json", ""), compare=False, repr=False)

    def __post_init__(self):
        """The fields against each other (each field's own type and range: from_dict)."""
        s = self.source
        check_field(self.num_key_value_heads >= 1 and self.num_attention_heads % self.num_key_value_heads == 0, s,
               "num_key_value_heads", self.num_key_value_heads,
               f"a divisor of num_attention_heads {self.num_attention_heads} (not divisible by "
               f"num_key_value_heads {self.num_key_value_heads})")
        check_field(self.block_size >= 2, s, "block_size", self.block_size, "an integer >= 2")
        check_field(len(self.target_layer_ids) > 0, s, "dflash_config.target_layer_ids", list(self.target_layer_ids),
               "a non-empty list of target layers (dflash_config.target_layer_ids is empty)")
        check_field(self.head_dim % 2 == 0, s, "head_dim", self.head_dim, "an even integer (RoPE rotates pairs)")
        check_field(0 <= self.mask_token_id < self.vocab_size, s, "dflash_config.mask_token_id", self.mask_token_id,
               f"an integer in 0..{self.vocab_size - 1} (vocab_size {self.vocab_size})")
        if self.layer_types is not None:
            check_field(len(self.layer_types) == self.num_hidden_layers, s, "layer_types", list(self.layer_types),
                   f"one entry per layer (num_hidden_layers {self.num_hidden_layers})")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int:
        """Sliding-window size of draft layer `layer` in tokens, 0 for full attention."""
        sliding = self.sliding_window is not None and (
            self.layer_types is None or self.layer_types[layer] == "sliding_attention")
        return int(self.sliding_window) if sliding else 0

    def check_target(self, target: KimiConfig) -> None:
        """The drafter must tap layers the target has, below its last (docs/interfaces.md 2), and share
        its hidden size and vocabulary."""
        n = target.num_hidden_layers
        for L in self.target_layer_ids:
            check_field(0 <= L < n - 1, self.source, "dflash_config.target_layer_ids", list(self.target_layer_ids),
                   f"layers in 0..{n - 2} for a {n}-layer target (target_layer_ids contains {L}; the last "
                   "layer's output is replaced by the final-normed state)")
        check_field(self.hidden_size == target.hidden_size, self.source, "hidden_size", self.hidden_size,
               f"the target's hidden_size {target.hidden_size}")
        check_field(self.vocab_size == target.vocab_size, self.source, "vocab_size", self.vocab_size,
               f"the target's vocab_size {target.vocab_size}")

    @staticmethod
    def from_dict(d: dict, where: str = "drafter config.json", prefix: str = "") -> "DrafterConfig":
        """A drafter config.json as a dict; errors name `where` (the file) and the dotted field, under
        `prefix` when the config is itself a field of a bigger file (an engine's config.json: "drafter").
        DFlash fields are read from `dflash_config` first, then the top level."""
        top = Fields(d, where, prefix)
        dc = top.obj("dflash_config", None, what="DFlash's mask_token_id and target_layer_ids")

        def dflash(key):                  # dflash_config first, then the top level
            if dc is not None and key in dc:
                return dc
            if key in top:
                return top
            return dc if dc is not None else Fields({}, top.file, top.name("dflash_config"))
        ints = {k: top.integer(k, lo=1) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "vocab_size")}
        heads = ints["num_attention_heads"]
        kv_heads = top.integer("num_key_value_heads", lo=1, hi=heads)
        if "head_dim" in top:
            head_dim = top.integer("head_dim", lo=2)
        elif ints["hidden_size"] % heads:
            raise ConfigError(f"{top.file}: missing field '{top.name('head_dim')}', and hidden_size "
                              f"{ints['hidden_size']} is not divisible by num_attention_heads {heads}")
        else:
            head_dim = ints["hidden_size"] // heads
        vocab = ints["vocab_size"]
        use_sliding = top.boolean("use_sliding_window", True)
        sliding = top.integer("sliding_window", None, lo=0, null_ok=True)
        lt = top.raw("layer_types", None)
        if lt is not None and (not isinstance(lt, list) or not all(x in LAYER_TYPES for x in lt)):
            raise top.bad("layer_types", lt, f"null or a list of {' / '.join(map(json.dumps, LAYER_TYPES))}")
        return DrafterConfig(
            **ints, num_key_value_heads=kv_heads, head_dim=head_dim,
            block_size=dflash("block_size").integer("block_size", lo=2),
            target_layer_ids=tuple(dflash("target_layer_ids").int_list("target_layer_ids", lo=0)),
            mask_token_id=dflash("mask_token_id").integer("mask_token_id", lo=0, hi=vocab - 1),
            rope=RopeConfig.from_hf(top),
            rms_norm_eps=top.number("rms_norm_eps", 1e-6, gt=0),
            num_target_layers=dflash("num_target_layers").integer("num_target_layers", None, lo=1, null_ok=True),
            sliding_window=sliding if use_sliding else None,
            layer_types=tuple(lt) if lt else None,
            attention_factor=top.number("ddtree_attention_factor", 1.0, gt=0),
            source=(top.file, top.path),
        )

    def to_dict(self, rope_key: str = "rope_scaling") -> dict:
        d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
             "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
             **{k: getattr(self, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "num_key_value_heads", "head_dim",
                                              "vocab_size", "rms_norm_eps", "block_size")},
             "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
             "rope_theta": self.rope.theta,
             "num_target_layers": self.num_target_layers,
             "dflash_config": {"mask_token_id": self.mask_token_id,
                               "target_layer_ids": list(self.target_layer_ids)},
             "ddtree_attention_factor": self.attention_factor,
             "torch_dtype": "bfloat16"}
        if self.rope.type != "default":
            d[rope_key] = self.rope.to_hf(rope_key)
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = True
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        return d


def _read_json(path) -> tuple[Path, dict]:
    """(the config.json path, its JSON) from a checkpoint dir or the file itself."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config.json not found")
    try:
        return path, json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e


def load_model_config(path) -> KimiConfig:
    """Target config from a checkpoint dir or its config.json."""
    file, d = _read_json(path)
    return KimiConfig.from_dict(d, where=str(file))


def load_drafter_config(path) -> DrafterConfig:
    file, d = _read_json(path)
    return DrafterConfig.from_dict(d, where=str(file))


def write_json(path: Path, d: dict) -> None:
    Path(path).write_text(json.dumps(d, indent=2) + "\n")


__all__ = ["ConfigError", "Fields", "show", "RopeConfig", "QuantConfig", "KimiConfig", "DrafterConfig",
           "yarn_mscale", "load_model_config", "load_drafter_config", "write_json"]
