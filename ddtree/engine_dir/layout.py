"""The engine directory's layout: names and paths, config.json written and read with the same checks.

Part of ddtree/engine_dir (the package docstring has the layout).
"""
from __future__ import annotations

import json
from pathlib import Path

from ddtree.errors import InputError
from ddtree.model.config import DrafterConfig, KimiConfig, write_json

ENGINE_FORMAT = "ddtree-engine/1"
FORMAT_FAMILY = "ddtree-engine/"
CONFIG = "config.json"
MANIFEST = "manifest.json"
MAX_JSON_BYTES = 64 << 20                      # the most any JSON file of an engine may be (a real one: KBs to MBs);
                                               # checked on the file's size before a byte of it is read
TUNING = "tuning.json"                        # machine-specific, outside the manifest (engine_dir/tuning.py)
PLANS = "plans.json"
GRAPHS = "graphs"
KERNELS = "kernels"
TOKENIZER = "tokenizer"
READ_BYTES = 1 << 20
HASH_THREADS = 4
EXPERT_MODES = ("tp", "ep")                   # config "experts": routed experts split or placed (builder/plan.py)
PACKED_SUFFIXES = (".words", ".scales")       # routed experts in the kernel layout (plugins/layout.py)
DRAFTER_PREFIX = "drafter."                   # drafter tensors in the rank files (builder/weights.py)
EXPERT_STACKS = tuple(f"mlp.experts.{w}{s}" for w in ("gate_up", "down") for s in PACKED_SUFFIXES)
WEIGHT_SUFFIX = ".safetensors"


class EngineFormatError(InputError):
    """An engine directory is missing a file or holds a config this runtime cannot read."""


# ----------------------------------------------------------------------------------------------
# the layout: relative names (as listed in manifest.json, graphs/index.json, plans.json) and paths

def rank_name(rank: int) -> str:
    return f"rank{rank}"


def rank_dir(root, rank: int) -> Path:
    return Path(root) / rank_name(rank)


def config_path(root) -> Path:
    return Path(root) / CONFIG


def manifest_path(root) -> Path:
    return Path(root) / MANIFEST


def plans_path(root) -> Path:
    return Path(root) / PLANS


def plan_rel(rank: int, kind: str) -> str:
    """rank<r>/<kind>.plan"""
    return f"{rank_name(rank)}/{kind}.plan"


def graphs_dir(root) -> Path:
    return Path(root) / GRAPHS


def graphs_index_path(root) -> Path:
    return graphs_dir(root) / "index.json"


def graphs_rank_dir(root, rank: int) -> Path:
    return graphs_dir(root) / rank_name(rank)


def graph_rel(rank: int, kind: str) -> str:
    """graphs/rank<r>/<kind>.onnx"""
    return f"{GRAPHS}/{rank_name(rank)}/{kind}.onnx"


def kernels_rel(arch: str) -> str:
    """kernels/<arch>"""
    return f"{KERNELS}/{arch}"


def kernels_dir(root, arch: str) -> Path:
    return Path(root) / kernels_rel(arch)


def tokenizer_dir(root) -> Path:
    return Path(root) / TOKENIZER


# ----------------------------------------------------------------------------------------------
# config.json

def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _list_of(check):
    return lambda v: isinstance(v, list) and len(v) > 0 and all(check(x) for x in v)


def _is_str(v) -> bool:
    return isinstance(v, str) and v != ""


# field -> (what it must be, check)
REQUIRED = {
    "model": ("an object (the target's config.json)", lambda v: isinstance(v, dict)),
    "drafter": ("an object (the drafter's config.json)", lambda v: isinstance(v, dict)),
    "tp": ("a positive int", _positive_int),
    "experts": (" or ".join(map(repr, EXPERT_MODES)), lambda v: isinstance(v, str) and v in EXPERT_MODES),
    "archs": ("a list of str (empty: built with --no-kernels)",
              lambda v: isinstance(v, list) and all(_is_str(x) for x in v)),
    "budgets": ("a non-empty list of positive int", _list_of(_positive_int)),
    "block_size": ("a positive int", _positive_int),
    "plan": ("an object (builder/plan.py)", lambda v: isinstance(v, dict)),
    "weight_files": ("a non-empty list of str", _list_of(_is_str)),
}


def check_engine_config(d, where) -> None:
    """EngineFormatError naming `where` (the config.json) and the field, unless every required field
    is present with the right type."""
    if not isinstance(d, dict):
        raise EngineFormatError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if d.get("format") != ENGINE_FORMAT:
        raise EngineFormatError(f"{where}: format {d.get('format')!r} is not supported "
                                f"(this runtime reads {ENGINE_FORMAT!r})")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise EngineFormatError(f"{where}: missing required field{'s' * (len(missing) > 1)} "
                                f"{', '.join(repr(k) for k in missing)}")
    for k, (expected, ok) in REQUIRED.items():
        if not ok(d[k]):
            raise EngineFormatError(f"{where}: field {k!r} must be {expected}, got {d[k]!r:.80}")


def write_engine_config(root, fields: dict) -> dict:
    """config.json = {"format": ENGINE_FORMAT, **fields}, checked before anything is written."""
    path = config_path(root)
    config = {"format": ENGINE_FORMAT, **fields}
    check_engine_config(config, path)
    write_json(path, config)
    return config


def _config_json(root) -> dict | None:
    path = config_path(root)
    if not path.is_file() or path.stat().st_size > MAX_JSON_BYTES:
        return None
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) else None


def json_object(path: Path, bad) -> dict:
    """path's JSON object; not JSON, or JSON but not an object, is bad(why) raised (the caller's error type,
    naming the file and what to do)."""
    size = Path(path).stat().st_size
    if size > MAX_JSON_BYTES:
        raise bad(f"{size} bytes, more than any engine JSON file may be ({MAX_JSON_BYTES}); damaged or replaced")
    try:
        d = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"not JSON ({e}); damaged or edited") from e
    if not isinstance(d, dict):
        raise bad(f"expected a JSON object, got {type(d).__name__}")
    return d


def is_engine_dir(root) -> bool:
    """True iff root/config.json declares a ddtree engine format (any version), or root holds a
    manifest.json (only engines have one: a damaged engine config.json is still an engine's, and named)."""
    if root is None:
        return False
    d = _config_json(root)
    return (bool(d) and str(d.get("format", "")).startswith(FORMAT_FAMILY)) or manifest_path(root).is_file()


def not_an_engine(root) -> EngineFormatError:
    """The error for a folder given as an engine that is not one (e.g. a checkpoint), saying what it is."""
    root = Path(root)
    d = _config_json(root)
    if d is None:
        what = f"it has no {MANIFEST} and no readable {CONFIG}"
    else:
        text = d.get("text_config")
        kind = d.get("model_type") or (text.get("model_type") if isinstance(text, dict) else None)
        what = (f"it has no {MANIFEST} and its {CONFIG} has no engine format (model_type {kind!r}): "
                "a checkpoint directory, not an engine")
    return EngineFormatError(
        f"{root}: not an engine directory: {what}. An engine directory (written by `ddtree build --out DIR`) "
        f"holds {CONFIG} with format {ENGINE_FORMAT!r}, {MANIFEST}, rank<r>/*{WEIGHT_SUFFIX}, {KERNELS}/<arch>/; "
        "run a checkpoint directly with `ddtree run --model TARGET_DIR --drafter DRAFTER_DIR`, or build an "
        "engine from it with `ddtree build`")


def read_engine_config(root) -> dict:
    """The engine's config.json, checked for the format version and every required field's type."""
    path = config_path(root)
    d = _config_json(root)
    if d is None:
        why = ""
        if path.is_file() and path.stat().st_size > MAX_JSON_BYTES:
            why = f" ({path.stat().st_size} bytes, more than any engine JSON file may be: {MAX_JSON_BYTES})"
        elif path.is_file():
            try:
                json.loads(path.read_bytes())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                why = f" ({e})"
        raise EngineFormatError(f"{path}: missing or not a JSON object{why}")
    check_engine_config(d, path)
    return d


def engine_configs(root, meta: dict) -> tuple[KimiConfig, DrafterConfig]:
    """The target and drafter configs inside an engine's config.json; errors name that file and the field
    under "model." / "drafter." (e.g. model.text_config.rms_norm_eps)."""
    where = str(config_path(root))
    return (KimiConfig.from_dict(meta["model"], where=where, prefix="model"),
            DrafterConfig.from_dict(meta["drafter"], where=where, prefix="drafter"))
