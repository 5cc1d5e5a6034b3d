"""Kimi K2.x target and DFlash drafter configs, parsed from the checkpoints' own `config.json`.

Two target layouts exist (docs/kimi-k2.md section 2.1):
  k2-thinking  flat DeepSeek-V3 config, tensors prefixed `model.`
  k2.6         K2.5/K2.6: text model nested in `text_config`, tensors prefixed `language_model.model.`
RoPE parameters come as `rope_scaling` (original files) or `rope_parameters` (transformers 5).
Anything we do not implement fails with a `ConfigError` that names the field.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ddtree.errors import InputError


class ConfigError(InputError):
    """A config.json field is missing or holds a value we do not support."""


def _req(d: dict, key: str, where: str):
    if key not in d:
        raise ConfigError(f"{where}: missing required field '{key}'")
    return d[key]


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
    def from_hf(cfg: dict, where: str) -> "RopeConfig":
        theta = float(_req(cfg, "rope_theta", where) if "rope_parameters" not in cfg
                      else cfg["rope_parameters"].get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
        if not scaling:
            return RopeConfig(theta=theta)
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        if rtype not in ROPE_TYPES:
            raise ConfigError(f"{where}: {key}.type '{rtype}' is not supported (expected one of "
                              f"{', '.join(ROPE_TYPES)})")
        if rtype == "default":
            return RopeConfig(theta=theta)
        return RopeConfig(
            theta=theta, type="yarn",
            factor=float(_req(scaling, "factor", f"{where} {key}")),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
            beta_fast=float(scaling.get("beta_fast", 32.0)),
            beta_slow=float(scaling.get("beta_slow", 1.0)),
            mscale=float(scaling.get("mscale", 1.0)),
            mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
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
    def from_hf(q: dict, where: str) -> "QuantConfig":
        where = f"{where} quantization_config"
        if q.get("quant_method") != "compressed-tensors":
            raise ConfigError(f"{where}.quant_method '{q.get('quant_method')}' is not supported "
                              "(expected 'compressed-tensors')")
        if q.get("format") != "pack-quantized":
            raise ConfigError(f"{where}.format '{q.get('format')}' is not supported (expected 'pack-quantized')")
        groups = _req(q, "config_groups", where)
        if len(groups) != 1:
            raise ConfigError(f"{where}.config_groups: expected exactly one group, got {len(groups)}")
        gname, group = next(iter(groups.items()))
        w = _req(group, "weights", f"{where}.config_groups.{gname}")
        wh = f"{where}.config_groups.{gname}.weights"
        checks = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        for k, want in checks.items():
            if w.get(k) != want:
                raise ConfigError(f"{wh}.{k} = {w.get(k)!r} is not supported (expected {want!r})")
        if w.get("dynamic"):
            raise ConfigError(f"{wh}.dynamic = true is not supported (expected false)")
        if w.get("actorder") not in (None, False):
            raise ConfigError(f"{wh}.actorder = {w.get('actorder')!r} is not supported (expected null)")
        gs = w.get("group_size")
        if not isinstance(gs, int) or gs <= 0 or gs % 8:
            raise ConfigError(f"{wh}.group_size = {gs!r} is not supported (expected a positive multiple of 8)")
        for k in ("input_activations", "output_activations"):
            if group.get(k) is not None:
                raise ConfigError(f"{where}.config_groups.{gname}.{k} must be null (W4A16 only)")
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
    pad_token_id: int = 163839
    tokenizer: str = "tiktoken"           # "tiktoken" (real Kimi) | "bytes" (tiny models)
    layout: str = "k2.6"

    def __post_init__(self):
        w = "config.json"
        if self.layout not in LAYOUTS:
            raise ConfigError(f"layout '{self.layout}' is not one of {LAYOUTS}")
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"{w}: scoring_func '{self.scoring_func}' is not supported (expected 'sigmoid')")
        if self.topk_method != "noaux_tc":
            raise ConfigError(f"{w}: topk_method '{self.topk_method}' is not supported (expected 'noaux_tc')")
        if self.moe_layer_freq != 1:
            raise ConfigError(f"{w}: moe_layer_freq {self.moe_layer_freq} is not supported (expected 1)")
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"{w}: n_routed_experts {self.n_routed_experts} is not divisible by "
                              f"n_group {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"{w}: topk_group {self.topk_group} must be in 1..n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(f"{w}: num_experts_per_tok {self.num_experts_per_tok} exceeds the experts "
                              "in topk_group groups")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{w}: qk_rope_head_dim {self.qk_rope_head_dim} must be even")
        if self.tokenizer not in ("tiktoken", "bytes"):
            raise ConfigError(f"{w}: ddtree_tokenizer '{self.tokenizer}' is not supported "
                              "(expected 'bytes' or absent)")
        if self.quant is not None:
            g = self.quant.group_size
            for name, k in (("hidden_size", self.hidden_size), ("moe_intermediate_size", self.moe_intermediate_size)):
                if k % g:
                    raise ConfigError(f"{w}: quantization_config group_size {g} does not divide {name} {k}")

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
    def from_dict(d: dict, where: str = "config.json") -> "KimiConfig":
        layout = "k2.6" if "text_config" in d else "k2-thinking"
        t = d["text_config"] if layout == "k2.6" else d
        tw = f"{where} text_config" if layout == "k2.6" else where
        q = t.get("quantization_config", d.get("quantization_config"))
        eos = d.get("eos_token_id", t.get("eos_token_id", 163585))
        ints = ("hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "intermediate_size",
                "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                "first_k_dense_replace")
        vals = {}
        for k in ints:
            v = _req(t, k, tw)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 and k != "first_k_dense_replace":
                raise ConfigError(f"{tw}: field '{k}' = {v!r} must be a positive integer")
            vals[k] = v
        opt = {k: t[k] for k in ("rms_norm_eps", "moe_layer_freq", "n_group", "topk_group", "topk_method",
                                 "scoring_func", "norm_topk_prob", "routed_scaling_factor",
                                 "max_position_embeddings") if t.get(k) is not None}
        if opt.get("norm_topk_prob") is False:
            raise ConfigError(f"{tw}: norm_topk_prob false is not supported (Kimi renormalises)")
        return KimiConfig(
            **vals, **opt,
            rope=RopeConfig.from_hf(t, tw),
            quant=QuantConfig.from_hf(q, tw) if q else None,
            bos_token_id=d.get("bos_token_id", t.get("bos_token_id", 163584)),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,),
            pad_token_id=d.get("pad_token_id", t.get("pad_token_id", 163839)),
            tokenizer=t.get("ddtree_tokenizer", d.get("ddtree_tokenizer", "tiktoken")),
            layout=layout,
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

    def __post_init__(self):
        w = "drafter config.json"
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{w}: num_attention_heads {self.num_attention_heads} is not divisible by "
                              f"num_key_value_heads {self.num_key_value_heads}")
        if self.block_size < 2:
            raise ConfigError(f"{w}: block_size {self.block_size} must be >= 2")
        if not self.target_layer_ids:
            raise ConfigError(f"{w}: dflash_config.target_layer_ids is empty")
        if self.head_dim % 2:
            raise ConfigError(f"{w}: head_dim {self.head_dim} must be even")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int:
        """Sliding-window size of draft layer `layer` in tokens, 0 for full attention."""
        sliding = self.sliding_window is not None and (
            self.layer_types is None or self.layer_types[layer] == "sliding_attention")
        return int(self.sliding_window) if sliding else 0

    def check_target(self, target: KimiConfig) -> None:
        """The drafter must tap layers the target has, below its last (docs/interfaces.md 2)."""
        n = target.num_hidden_layers
        for L in self.target_layer_ids:
            if not 0 <= L < n - 1:
                raise ConfigError(f"drafter config.json: dflash_config.target_layer_ids contains {L}; "
                                  f"it must be in 0..{n - 2} for a {n}-layer target (the last layer's "
                                  "output is replaced by the final-normed state)")
        if self.hidden_size != target.hidden_size:
            raise ConfigError(f"drafter config.json: hidden_size {self.hidden_size} != target hidden_size "
                              f"{target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter config.json: vocab_size {self.vocab_size} != target vocab_size "
                              f"{target.vocab_size}")

    @staticmethod
    def from_dict(d: dict, where: str = "drafter config.json") -> "DrafterConfig":
        dc = d.get("dflash_config", {})

        def pick(key, default=None, required=True):
            if key in dc:
                return dc[key]
            if key in d:
                return d[key]
            if required and default is None:
                raise ConfigError(f"{where}: missing required field 'dflash_config.{key}'")
            return default

        ints = {k: _req(d, k, where) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads", "vocab_size")}
        head_dim = d.get("head_dim", ints["hidden_size"] // ints["num_attention_heads"])
        taps = pick("target_layer_ids")
        if not isinstance(taps, list) or not all(isinstance(x, int) for x in taps):
            raise ConfigError(f"{where}: dflash_config.target_layer_ids must be a list of ints, got {taps!r}")
        lt = d.get("layer_types")
        return DrafterConfig(
            **ints, head_dim=head_dim,
            block_size=int(pick("block_size")),
            target_layer_ids=tuple(taps),
            mask_token_id=int(pick("mask_token_id")),
            rope=RopeConfig.from_hf(d, where),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            num_target_layers=pick("num_target_layers", required=False),
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
            layer_types=tuple(lt) if lt else None,
            attention_factor=float(d.get("ddtree_attention_factor", 1.0)),
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


def _read_json(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"{path}: config.json not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e


def load_model_config(path) -> KimiConfig:
    """Target config from a checkpoint dir or its config.json."""
    return KimiConfig.from_dict(_read_json(path), where=str(path))


def load_drafter_config(path) -> DrafterConfig:
    return DrafterConfig.from_dict(_read_json(path), where=str(path))


def write_json(path: Path, d: dict) -> None:
    Path(path).write_text(json.dumps(d, indent=2) + "\n")


__all__ = ["ConfigError", "RopeConfig", "QuantConfig", "KimiConfig", "DrafterConfig", "yarn_mscale",
           "load_model_config", "load_drafter_config", "write_json"]
