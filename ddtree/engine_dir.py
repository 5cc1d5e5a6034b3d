"""The engine directory: its layout, config.json, manifest.json and the loader of one rank's tensors.

Written by ddtree/builder, read by ddtree/runtime and ddtree/ops (docs/architecture.md). Every path in
an engine is made here, so no other module spells "rank<r>" or "kernels/<arch>" itself.

    engines/<name>/
      config.json                  {"format": "ddtree-engine/1", "model": <target config.json>,
                                    "drafter": <drafter config.json>, "tp", "experts", "archs", "budgets",
                                    "block_size", "dtypes", "plan" (per-rank sizes, builder/plan.py),
                                    "ranks", "weight_files", "kernels", "tokenizer", "source", ...}
      rank<r>/*.safetensors        that rank's weights (builder/weights.py documents every name and shape)
      rank<r>/<kind>.plan          TensorRT-RTX plans (ddtree-build --trt), listed in plans.json
      graphs/index.json            the graphs of every rank (ops/onnx_export.py)
      graphs/rank<r>/<kind>.onnx   each rank's share of each layer kind
      kernels/<arch>/              cubins, one per kernel source
      tokenizer/                   the checkpoint's tokenizer files (absent for byte-tokenizer models)
      plans.json                   the plans with their inputs and outputs (builder/trt_build.py)
      manifest.json                size and sha256 of every other file (checked by `ddtree inspect`)

config.json is checked field by field on both sides: the builder cannot write, and the runtime will
not read, one that misses a required field or holds one of the wrong type.
manifest.json: {"format": "ddtree-engine/1", "files": {"config.json": {"size": 1234, "sha256": "..."}, ...}}
with relative paths (forward slashes), sorted; files are hashed in 1 MiB reads on a few threads
(hashlib releases the GIL on large buffers).
"""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ddtree.errors import InputError
from ddtree.model.bf16 import as_float
from ddtree.model.config import write_json
from ddtree.model.safetensors_io import SafetensorsFile

ENGINE_FORMAT = "ddtree-engine/1"
FORMAT_FAMILY = "ddtree-engine/"
CONFIG = "config.json"
MANIFEST = "manifest.json"
PLANS = "plans.json"
GRAPHS = "graphs"
KERNELS = "kernels"
TOKENIZER = "tokenizer"
READ_BYTES = 1 << 20
HASH_THREADS = 4
EXPERT_MODES = ("tp", "ep")                   # config "experts": routed experts split or placed (builder/plan.py)
PACKED_SUFFIXES = (".words", ".scales")       # routed experts in the kernel layout (plugins/layout.py)


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
    "archs": ("a non-empty list of str", _list_of(_is_str)),
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
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) else None


def is_engine_dir(root) -> bool:
    """True iff root/config.json declares a ddtree engine format (any version)."""
    d = _config_json(root) if root is not None else None
    return bool(d) and str(d.get("format", "")).startswith(FORMAT_FAMILY)


def read_engine_config(root) -> dict:
    """The engine's config.json, checked for the format version and every required field's type."""
    path = config_path(root)
    d = _config_json(root)
    if d is None:
        raise EngineFormatError(f"{path}: missing or not a JSON object")
    check_engine_config(d, path)
    return d


# ----------------------------------------------------------------------------------------------
# manifest.json

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def engine_files(root) -> list[str]:
    """Every regular file under root except the manifest, as sorted relative paths."""
    root = Path(root)
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(rel for rel in rels if rel != MANIFEST)


def _digests(root: Path, rels: list[str]) -> dict[str, dict]:
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        sums = list(pool.map(lambda rel: sha256_file(root / rel), rels))
    return {rel: {"size": (root / rel).stat().st_size, "sha256": s} for rel, s in zip(rels, sums)}


def write_manifest(root) -> dict:
    root = Path(root)
    manifest = {"format": ENGINE_FORMAT, "files": _digests(root, engine_files(root))}
    manifest_path(root).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(root) -> dict:
    path = manifest_path(root)
    if not path.is_file():
        raise EngineFormatError(f"{path}: missing (every engine directory has a manifest)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise EngineFormatError(f"{path}: not a valid manifest ({e})") from e
    return manifest


def verify_manifest(root) -> list[str]:
    """Problems found, one line per file (empty: every file matches its size and sha256)."""
    root = Path(root)
    listed = read_manifest(root)["files"]
    present = set(engine_files(root))
    problems = [f"{rel}: listed in {MANIFEST} but missing" for rel in sorted(set(listed) - present)]
    problems += [f"{rel}: present but not listed in {MANIFEST}" for rel in sorted(present - set(listed))]
    common = sorted(set(listed) & present)
    sized = [rel for rel in common if (root / rel).stat().st_size == listed[rel].get("size")]
    problems += [f"{rel}: size {(root / rel).stat().st_size} bytes, the manifest says {listed[rel].get('size')}"
                 for rel in common if rel not in sized]
    actual = _digests(root, sized)
    problems += [f"{rel}: sha256 mismatch (file {actual[rel]['sha256'][:16]}..., manifest "
                 f"{str(listed[rel].get('sha256'))[:16]}...)" for rel in sized
                 if actual[rel]["sha256"] != listed[rel].get("sha256")]
    return sorted(problems)


# ----------------------------------------------------------------------------------------------
# one rank's tensors

STORED, BFLOAT16 = "stored", "bfloat16"


def _converter(convert):
    """convert -> fn(name, safetensors dtype, array as stored) -> array."""
    choice = convert if isinstance(convert, str) else None    # (a numpy dtype == "stored" may raise)
    if choice == STORED:
        return lambda name, dtype, a: a
    if choice == BFLOAT16:                      # for the graphs; ml_dtypes is the `graphs` extra
        import ml_dtypes
        return lambda name, dtype, a: a.view(ml_dtypes.bfloat16) if dtype == "BF16" else a
    try:
        target = np.dtype(convert) if convert is not None else None      # np.dtype(None) is float64
    except TypeError:
        target = None
    if target is None or target.kind != "f":
        raise ValueError(f"load_rank_tensors: convert={convert!r}: expected {STORED!r}, {BFLOAT16!r} "
                         "or a numpy float dtype")

    def to_float(name, dtype, a):             # dense weights as floats; routed experts stay packed
        if name.endswith(PACKED_SUFFIXES):
            return a
        return as_float(a, target)             # bf16 bits (uint16) exactly, the rest cast
    return to_float


def load_rank_tensors(root, rank: int, files, convert=STORED) -> dict[str, np.ndarray]:
    """rank<r>/<files> -> {name: array}. convert: STORED (BF16 as uint16 bits), BFLOAT16 (BF16 as
    ml_dtypes.bfloat16, the graphs' inputs) or a float dtype (every tensor but the routed experts'
    .words/.scales converted, exactly for bf16)."""
    fn = _converter(convert)
    out = {}
    for fname in files:
        path = rank_dir(root, rank) / fname
        if not path.is_file():
            raise EngineFormatError(f"{path}: weight file listed in {CONFIG} is missing")
        f = SafetensorsFile(path)
        try:
            for name, spec in f.entries.items():
                out[name] = fn(name, spec.dtype, f.read(name))
        finally:
            f.close()
    return out
