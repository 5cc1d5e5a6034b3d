"""Config validation in one place (ddtree/model/config.py): mutations of the embedded tiny target and
drafter configs, each refused with a ConfigError that names the config.json, the dotted field, the value
found and what was expected; every field of both configs given hostile values is accepted or refused
that way, never a traceback; the real Kimi K2-Thinking and K2.6 config.json files are accepted; a
checkpoint index whose weight_map is not an object of shard file names is a CheckpointError. A few cases
run as a user would (`ddtree run` in a subprocess, tests/cli/bad_input.py).

The fixtures tests/fixtures/kimi/{k2-thinking,k2.6}_config.json hold the field values of
docs/kimi-k2.md sections 2.1, 2.2 and 4.1 (K2.6: the original-file spelling, `text_config.model_type`
kimi_k2 and `rope_scaling`; the vision_config values as in the public K2.5 inspection report, which
K2.6 shares). Reconstructed, not read from a byte-exact file: in K2-Thinking every value (no byte-exact
file was at hand, docs 2.2: its eos 163586 and beta_fast 1.0 are the K2 line's); in both, the
bookkeeping fields the engine does not read (auto_map, aux_loss_alpha, ep_size, initializer_range,
pretraining_tp, seq_aux, torch_dtype, ignore_index, use_unified_vision_chunk, video_placeholder) and
the field order. Every dimension equals the kimi-k2.6 preset's (ddtree/model/presets.py).
"""
import copy
import json
import math
import shutil
from pathlib import Path

import pytest

from ddtree.data import tiny_model_dirs
from ddtree.model.checkpoint import Checkpoint
from ddtree.model.config import ConfigError, DrafterConfig, KimiConfig, load_drafter_config, load_model_config
from ddtree.model.fields import Fields
from ddtree.model.presets import get_preset
from ddtree.model.safetensors_io import CheckpointError
from tests.cli.bad_input import refuses

FIXTURES = Path(__file__).parent.parent / "fixtures" / "kimi"
TINY_TARGET, TINY_DRAFTER = (Path(p) for p in tiny_model_dirs())
NAN, INF = float("nan"), float("inf")
class _Delete:
    """The case that deletes the field; its repr is stable so test ids match across pytest-xdist workers."""
    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()
W = "text_config.quantization_config.config_groups.group_0.weights"


def tiny(which: str) -> dict:
    return json.loads(((TINY_TARGET if which == "target" else TINY_DRAFTER) / "config.json").read_text())


def mutate(d: dict, path: str, value) -> dict:
    d = copy.deepcopy(d)
    *parents, last = path.split(".")
    node = d
    for k in parents:
        node = node[k]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return d


def write_config(folder: Path, d: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(d))      # NaN / Infinity as JSON's literals
    return folder


# (field path, bad value, fragments the message must hold besides the file: the field, the value as shown,
#  what was expected), written by hand
TARGET_CASES = [
    ("text_config", None, ["'text_config' = null", "expected a JSON object"]),
    ("text_config", [1], ["'text_config' = [1] (a list)", "expected a JSON object"]),
    ("text_config.rms_norm_eps", None, ["'text_config.rms_norm_eps' = null", "a finite number > 0"]),
    ("text_config.rms_norm_eps", "x", ["'text_config.rms_norm_eps' = \"x\" (a string)", "a finite number > 0"]),
    ("text_config.rms_norm_eps", 0, ["'text_config.rms_norm_eps' = 0:", "a finite number > 0"]),
    ("text_config.rms_norm_eps", NAN, ["'text_config.rms_norm_eps' = nan", "a finite number > 0"]),
    ("text_config.routed_scaling_factor", [2.827], ["'text_config.routed_scaling_factor' = [2.827] (a list)",
                                                    "a finite number > 0"]),
    ("text_config.routed_scaling_factor", NAN, ["'text_config.routed_scaling_factor' = nan", "> 0"]),
    ("text_config.routed_scaling_factor", 0, ["'text_config.routed_scaling_factor' = 0:", "> 0"]),
    ("text_config.num_hidden_layers", 0, ["'text_config.num_hidden_layers' = 0:", "an integer >= 1"]),
    ("text_config.num_hidden_layers", -1, ["'text_config.num_hidden_layers' = -1", "an integer >= 1"]),
    ("text_config.hidden_size", 128.0, ["'text_config.hidden_size' = 128.0", "an integer >= 1"]),
    ("text_config.hidden_size", True, ["'text_config.hidden_size' = true (a boolean)", "an integer"]),
    ("text_config.hidden_size", DELETE, ["missing required field 'text_config.hidden_size'"]),
    ("text_config.vocab_size", "512", ["'text_config.vocab_size' = \"512\" (a string)", "an integer >= 1"]),
    ("text_config.rope_theta", 0, ["'text_config.rope_theta' = 0:", "a finite number > 1"]),
    ("text_config.rope_theta", 1.0, ["'text_config.rope_theta' = 1.0", "a finite number > 1"]),
    ("text_config.rope_scaling.factor", -4, ["'text_config.rope_scaling.factor' = -4", ">= 1"]),
    ("text_config.rope_scaling.factor", None, ["'text_config.rope_scaling.factor' = null", ">= 1"]),
    ("text_config.rope_scaling.beta_fast", 0, ["'text_config.rope_scaling.beta_fast' = 0:", "> 0"]),
    ("text_config.rope_scaling.mscale_all_dim", INF, ["'text_config.rope_scaling.mscale_all_dim' = inf", ">= 0"]),
    ("text_config.rope_scaling.original_max_position_embeddings", 0,
     ["'text_config.rope_scaling.original_max_position_embeddings' = 0:", "an integer >= 1"]),
    ("text_config.rope_scaling.type", "longrope", ["'text_config.rope_scaling.type' = \"longrope\"", "yarn"]),
    ("text_config.rope_scaling", "yarn", ["'text_config.rope_scaling' = \"yarn\" (a string)", "a JSON object"]),
    ("text_config.n_group", 3, ["'text_config.n_group' = 3", "not divisible by n_group 3"]),
    ("text_config.topk_group", 2, ["'text_config.topk_group' = 2", "1..n_group (1)"]),
    ("text_config.num_experts_per_tok", 9, ["'text_config.num_experts_per_tok' = 9", "an integer in 1..8"]),
    ("text_config.first_k_dense_replace", 5, ["'text_config.first_k_dense_replace' = 5", "an integer in 0..4"]),
    ("text_config.qk_rope_head_dim", 15, ["'text_config.qk_rope_head_dim' = 15", "even"]),
    ("text_config.max_position_embeddings", 0, ["'text_config.max_position_embeddings' = 0:", ">= 1"]),
    ("text_config.norm_topk_prob", "yes", ["'text_config.norm_topk_prob' = \"yes\" (a string)", "true or false"]),
    ("text_config.scoring_func", "softmax", ["'text_config.scoring_func' = \"softmax\"", "sigmoid"]),
    ("text_config.ddtree_tokenizer", 7, ["'text_config.ddtree_tokenizer' = 7", "\"bytes\""]),
    (f"{W}.group_size", "32", [f"'{W}.group_size' = \"32\" (a string)", "a positive multiple of 8"]),
    (f"{W}.group_size", 48, ["group_size' = 48", "group_size 48 does not divide hidden_size 128"]),
    (f"{W}.symmetric", 1, [f"'{W}.symmetric' = 1", "true"]),
    ("text_config.quantization_config.config_groups", [], ["config_groups' = [] (a list)", "a JSON object"]),
    ("bos_token_id", 512, ["'bos_token_id' = 512", "an integer in 0..511"]),
    ("eos_token_id", -1, ["'eos_token_id' = -1", "0..511"]),
    ("eos_token_id", [], ["'eos_token_id' = [] (a list)", "a non-empty list of integers in 0..511"]),
    ("eos_token_id", [257, 600], ["'eos_token_id' = [257, 600] (a list)", "integers in 0..511"]),
    ("pad_token_id", "258", ["'pad_token_id' = \"258\" (a string)", "0..511"]),
]

DRAFTER_CASES = [
    ("num_key_value_heads", 0, ["'num_key_value_heads' = 0:", "an integer in 1..8"]),
    ("num_key_value_heads", 3, ["'num_key_value_heads' = 3", "not divisible by num_key_value_heads 3"]),
    ("num_hidden_layers", 0, ["'num_hidden_layers' = 0:", "an integer >= 1"]),
    ("num_hidden_layers", -1, ["'num_hidden_layers' = -1", "an integer >= 1"]),
    ("head_dim", "64", ["'head_dim' = \"64\" (a string)", "an integer >= 2"]),
    ("head_dim", 31, ["'head_dim' = 31", "even"]),
    ("intermediate_size", None, ["'intermediate_size' = null", "an integer >= 1"]),
    ("dflash_config.mask_token_id", 512, ["'dflash_config.mask_token_id' = 512", "an integer in 0..511"]),
    ("dflash_config.mask_token_id", -1, ["'dflash_config.mask_token_id' = -1", "an integer in 0..511"]),
    ("dflash_config.mask_token_id", DELETE, ["missing required field 'dflash_config.mask_token_id'"]),
    ("dflash_config.target_layer_ids", [], ["'dflash_config.target_layer_ids' = [] (a list)", "non-empty list"]),
    ("dflash_config.target_layer_ids", [0, -1], ["'dflash_config.target_layer_ids' = [0, -1]", "integers >= 0"]),
    ("dflash_config.target_layer_ids", "0,1,2", ["'dflash_config.target_layer_ids' = \"0,1,2\" (a string)", "list"]),
    ("dflash_config", None, ["'dflash_config' = null", "a JSON object"]),
    ("block_size", "four", ["'block_size' = \"four\" (a string)", "an integer >= 2"]),
    ("block_size", 1, ["'block_size' = 1:", "an integer >= 2"]),
    ("rms_norm_eps", None, ["'rms_norm_eps' = null", "a finite number > 0"]),
    ("rope_theta", 0, ["'rope_theta' = 0:", "a finite number > 1"]),
    ("rope_scaling.factor", -4, ["'rope_scaling.factor' = -4", ">= 1"]),
    ("ddtree_attention_factor", NAN, ["'ddtree_attention_factor' = nan", "a finite number > 0"]),
    ("ddtree_attention_factor", 0, ["'ddtree_attention_factor' = 0:", "a finite number > 0"]),
    ("sliding_window", -1, ["'sliding_window' = -1", "an integer >= 0"]),
    ("sliding_window", 4.5, ["'sliding_window' = 4.5", "an integer >= 0"]),
    ("use_sliding_window", "yes", ["'use_sliding_window' = \"yes\" (a string)", "true or false"]),
    ("layer_types", ["full_attention"], ["'layer_types' = [\"full_attention\"] (a list)", "one entry per layer"]),
    ("layer_types", ["local"], ["'layer_types' = [\"local\"] (a list)", "sliding_attention"]),
    ("num_target_layers", "4", ["'num_target_layers' = \"4\" (a string)", "an integer >= 1"]),
]


def assert_refused(tmp_path, kind: str, load, path, value, fragments) -> None:
    """The tiny `kind` config with `path` set to `value` is a ConfigError naming the file and every fragment."""
    folder = write_config(tmp_path, mutate(tiny(kind), path, value))
    with pytest.raises(ConfigError) as e:
        load(folder)
    msg = str(e.value)
    assert msg.startswith(f"{folder / 'config.json'}: "), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


@pytest.mark.parametrize("path, value, fragments", TARGET_CASES, ids=[f"{c[0]}={c[1]!r}" for c in TARGET_CASES])
def test_target_config_refused(tmp_path, path, value, fragments):
    assert_refused(tmp_path, "target", load_model_config, path, value, fragments)


@pytest.mark.parametrize("path, value, fragments", DRAFTER_CASES, ids=[f"{c[0]}={c[1]!r}" for c in DRAFTER_CASES])
def test_drafter_config_refused(tmp_path, path, value, fragments):
    assert_refused(tmp_path, "drafter", load_drafter_config, path, value, fragments)


@pytest.mark.parametrize("path, value, fragments", [
    ("hidden_size", 256, ["'hidden_size' = 256", "the target's hidden_size 128"]),
    ("vocab_size", 1024, ["'vocab_size' = 1024", "the target's vocab_size 512"]),
    ("dflash_config.target_layer_ids", [0, 3], ["'dflash_config.target_layer_ids' = [0, 3]", "contains 3",
                                                "0..2 for a 4-layer target"]),
])
def test_drafter_against_target_refused(tmp_path, path, value, fragments):
    """Each config valid alone; the pair disagrees (drafter hidden and vocab are the target's)."""
    folder = write_config(tmp_path, mutate(tiny("drafter"), path, value))
    dcfg = load_drafter_config(folder)
    with pytest.raises(ConfigError) as e:
        dcfg.check_target(load_model_config(TINY_TARGET))
    msg = str(e.value)
    assert msg.startswith(f"{folder / 'config.json'}: "), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


# every field of both configs, each hostile value: accepted, or a ConfigError naming the file and the field
HOSTILE = [None, True, "x", [], {}, [1], -1, 0, 2 ** 70, 1.5, NAN, INF, -INF]


def _leaves(d, prefix=""):
    for k, v in d.items():
        path = f"{prefix}{k}"
        yield path
        if isinstance(v, dict):
            yield from _leaves(v, path + ".")


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_every_field_hostile_values(tmp_path, which):
    base = tiny(which)
    load = KimiConfig.from_dict if which == "target" else DrafterConfig.from_dict
    refused = 0
    for path in _leaves(base):
        for value in HOSTILE:
            try:
                load(mutate(base, path, value), where="c.json")
            except ConfigError as e:
                refused += 1
                msg = str(e)
                assert msg.startswith("c.json: "), msg
                # the field named: itself, or (a cross-field check) a field it constrains
                assert "'" in msg and ("=" in msg or "missing" in msg or "groups" in msg), msg
    assert refused > 200                  # not a test that cannot fail: most of these values are refused


def test_real_kimi_configs_accepted():
    """The real files (reconstructed where said above) load with the documented values (docs/kimi-k2.md 2.2)."""
    k2t = load_model_config(FIXTURES / "k2-thinking_config.json")
    k26 = load_model_config(FIXTURES / "k2.6_config.json")
    assert (k2t.layout, k26.layout) == ("k2-thinking", "k2.6")
    for c in (k2t, k26):
        assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == \
            (7168, 61, 64, 1536, 512)
        assert (c.qk_head_dim, c.v_head_dim, c.vocab_size, c.n_routed_experts, c.num_experts_per_tok) == \
            (192, 128, 163840, 384, 8)
        assert (c.moe_intermediate_size, c.intermediate_size, c.first_k_dense_replace) == (2048, 18432, 1)
        assert (c.rms_norm_eps, c.routed_scaling_factor, c.max_position_embeddings) == (1e-5, 2.827, 262144)
        assert (c.rope.theta, c.rope.factor, c.rope.original_max_position_embeddings) == (50000.0, 64.0, 4096)
        assert c.quant is not None and c.quant.group_size == 32
        assert (c.bos_token_id, c.pad_token_id) == (163584, 163839)
    assert (k2t.eos_token_ids, k2t.rope.beta_fast) == ((163586,), 1.0)
    assert (k26.eos_token_ids, k26.rope.beta_fast) == ((163585,), 32.0)
    # the dimensions are the kimi-k2.6 preset's, and its drafter fits the real K2.6 target
    preset, drafter = get_preset("kimi-k2.6", 61)
    assert KimiConfig(**{**k26.__dict__, "layout": "k2.6"}) == preset
    DrafterConfig.from_dict(drafter.to_dict("rope_parameters")).check_target(k26)


def test_real_k26_resaved_by_transformers5_accepted():
    """transformers 5 re-saves text_config with model_type deepseek_v3 and rope_parameters holding
    rope_type, type and rope_theta (docs/kimi-k2.md 2.1): the same config."""
    d = json.loads((FIXTURES / "k2.6_config.json").read_text())
    t = d["text_config"]
    t["model_type"] = "deepseek_v3"
    t["rope_parameters"] = {**t.pop("rope_scaling"), "rope_type": "yarn", "rope_theta": 50000.0}
    assert KimiConfig.from_dict(d) == load_model_config(FIXTURES / "k2.6_config.json")


def test_fields_reader_takes_the_error_class():
    """Other JSON readers (the engine directory's config.json) can share the typed reads."""
    f = Fields({"tp": "8", "model": {"x": 1}}, "engine/config.json", error=CheckpointError)
    with pytest.raises(CheckpointError, match=r"engine/config.json: field 'tp' = \"8\" \(a string\): "
                                              r"expected an integer >= 1"):
        f.integer("tp", lo=1)
    with pytest.raises(CheckpointError, match="missing required field 'model.y'"):
        f.obj("model").number("y", gt=0)
    assert f.obj("model").integer("x", lo=1) == 1 and f.integer("world", 4, lo=1) == 4


# ----------------------------------------------------------------------------------------------
# the checkpoint index

@pytest.fixture
def ckpt_dir(tmp_path):
    """The tiny target's config and index (the shards are opened lazily, never here)."""
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(TINY_TARGET / name, tmp_path / name)
    return tmp_path


def _index(folder: Path, edit):
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    path.write_text(json.dumps(edit(index)))
    return path


@pytest.mark.parametrize("edit, fragments", [
    (lambda ix: {**ix, "weight_map": list(ix["weight_map"].items())}, ["'weight_map' = [[", "(a list)",
                                                                        "expected a JSON object"]),
    (lambda ix: {**ix, "weight_map": None}, ["'weight_map' = null", "expected a JSON object"]),
    (lambda ix: {"metadata": ix["metadata"]}, ["missing required field 'weight_map'"]),
    (lambda ix: [ix], ["the file = [", "(a list)", "expected a JSON object"]),
    (lambda ix: {**ix, "weight_map": {**ix["weight_map"], "model.norm.weight": 3}},
     ["'weight_map' entry 'model.norm.weight' = 3", "the file name of a shard"]),
    (lambda ix: {**ix, "weight_map": {**ix["weight_map"], "model.norm.weight": ["a.safetensors"]}},
     ["entry 'model.norm.weight' = [\"a.safetensors\"] (a list)"]),
    (lambda ix: {**ix, "weight_map": {**ix["weight_map"], "model.norm.weight": "../x.safetensors"}},
     ["entry 'model.norm.weight' = \"../x.safetensors\" (a string)", "in the checkpoint directory"]),
])
def test_index_refused(ckpt_dir, edit, fragments):
    path = _index(ckpt_dir, edit)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(ckpt_dir)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


def test_index_not_json_refused(ckpt_dir):
    (ckpt_dir / "model.safetensors.index.json").write_bytes(b"\xff{")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a valid safetensors index"):
        Checkpoint(ckpt_dir)


def test_config_not_utf8_or_not_json_refused(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match="config.json: not UTF-8"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json: the file = \[1, 2\] \(a list\): expected a JSON object"):
        load_model_config(tmp_path)


# ----------------------------------------------------------------------------------------------
# as a user would: `ddtree run` in a subprocess (~1 s each)

def _linked_copy(src: Path, dst: Path, config: dict | None = None, index=None) -> Path:
    """dst with src's files linked, config.json (and the index) replaced when given."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    if config is not None:
        (dst / "config.json").unlink()
        write_config(dst, config)
    if index is not None:
        (dst / "model.safetensors.index.json").unlink()
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


CLI_CASES = [   # (which, path, value, error type, fragments)
    ("target", "text_config", None, "ConfigError", ["text_config", "null", "a JSON object"]),
    ("target", "text_config.rms_norm_eps", NAN, "ConfigError", ["text_config.rms_norm_eps", "nan", "> 0"]),
    ("target", "text_config.rope_theta", 0, "ConfigError", ["text_config.rope_theta", "= 0", "> 1"]),
    ("drafter", "num_key_value_heads", 0, "ConfigError", ["num_key_value_heads", "= 0", "1..8"]),
    ("drafter", "dflash_config.mask_token_id", -1, "ConfigError", ["dflash_config.mask_token_id", "-1", "0..511"]),
    ("drafter", "block_size", "four", "ConfigError", ["block_size", "\"four\"", ">= 2"]),
    ("index", "weight_map", [], "CheckpointError", ["model.safetensors.index.json", "weight_map", "(a list)"]),
]


@pytest.mark.parametrize("which, path, value, error, fragments", CLI_CASES,
                         ids=[f"{c[0]}:{c[1]}={c[2]!r}" for c in CLI_CASES])
def test_cli_refuses(tmp_path, which, path, value, error, fragments):
    target, drafter = TINY_TARGET, TINY_DRAFTER
    if which == "target":
        target = _linked_copy(TINY_TARGET, tmp_path / "target", mutate(tiny("target"), path, value))
    elif which == "drafter":
        drafter = _linked_copy(TINY_DRAFTER, tmp_path / "drafter", mutate(tiny("drafter"), path, value))
    else:
        index = json.loads((TINY_TARGET / "model.safetensors.index.json").read_text())
        target = _linked_copy(TINY_TARGET, tmp_path / "target", index={**index, path: value})
    named = target / "model.safetensors.index.json" if which == "index" else \
        (target if which == "target" else drafter) / "config.json"
    refuses(["run", "--model", str(target), "--drafter", str(drafter), "--max-new-tokens", "1", "hi"],
            error, str(named), *fragments)
