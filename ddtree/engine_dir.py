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
manifest.json: {"format": "ddtree-engine/1", "files": {"config.json": {"size": 1234, "sha256": "..."}, ...},
"files_sha256": sha256 of the "files" object as canonical JSON (so a damaged manifest is named as such; engines
written before it have none)} with relative paths (forward slashes), sorted; files are hashed in 1 MiB reads on a
few threads (hashlib releases the GIL on large buffers).

Loading an engine (runtime/engine_executor.py, ops/onnx_runner.py) and `ddtree inspect` share one check
(`check_engine`, `engine_problems`), run before the first token:
  structural, always: the manifest well formed; every file it lists present with its size, nothing unlisted;
    config.json consistent with itself, its plan, the rank directories, the manifest and the weights' headers
    (tp == plan tp == rank directories, weight_files in every rank, the plan's per-rank sizes and every
    tensor's shape recomputed from the model and drafter configs): an edited config is named, field and value.
  hashes (skipped by `ddtree run --skip-verify`): every file's sha256; the rank weight files are hashed while
    load_rank_tensors reads them (one read), the others (cubins, graphs, plans, tokenizer, config) up front.
"""
from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import numpy as np

from ddtree.errors import InputError
from ddtree.model.bf16 import as_float
from ddtree.model.config import ConfigError, DrafterConfig, KimiConfig, write_json
from ddtree.model.safetensors_io import NUMPY_DTYPE, CheckpointError, SafetensorsFile
from ddtree.model.tensors import drafter_tensor_specs, target_tensor_specs

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
        if path.is_file():
            try:
                json.loads(path.read_bytes())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                why = f" ({e})"
        raise EngineFormatError(f"{path}: missing or not a JSON object{why}")
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


SHA256_HEX = re.compile(r"[0-9a-f]{64}")
MANIFEST_FIELDS = ("format", "files", "files_sha256")


def files_checksum(files: dict) -> str:
    """sha256 of a manifest's "files" object as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(root) -> dict:
    root = Path(root)
    files = _digests(root, engine_files(root))
    manifest = {"format": ENGINE_FORMAT, "files": files, "files_sha256": files_checksum(files)}
    manifest_path(root).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _safe_rel(rel: str) -> bool:
    """A relative path inside the engine, forward slashes, normalised, not the manifest itself."""
    pp = PurePosixPath(rel)
    return (rel != "" and "\\" not in rel and not pp.is_absolute() and pp.as_posix() == rel
            and ".." not in pp.parts and rel != MANIFEST)


def read_manifest(root) -> dict:
    """manifest.json, checked: an object with format, files {path: {"size", "sha256"}} and (when present) the
    files' checksum. EngineFormatError names manifest.json, the field or entry, and what was expected."""
    path = manifest_path(root)
    if not path.is_file():
        raise EngineFormatError(f"{path}: missing (every engine directory has a manifest)")

    def bad(why: str) -> EngineFormatError:
        return EngineFormatError(f"{path}: not a valid manifest: {why}")

    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"not JSON ({e}); damaged or edited") from e
    if not isinstance(manifest, dict):
        raise bad(f"expected a JSON object, got {type(manifest).__name__}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise bad(f"field 'files' must be an object {{path: {{\"size\", \"sha256\"}}}}, got {files!r:.80}")
    if manifest.get("format") != ENGINE_FORMAT:
        raise bad(f"field 'format' is {manifest.get('format')!r:.80}, expected {ENGINE_FORMAT!r}")
    unknown = [k for k in manifest if k not in MANIFEST_FIELDS]
    if unknown:
        raise bad(f"unknown field {unknown[0]!r:.80} (a manifest has {', '.join(MANIFEST_FIELDS)})")
    if "files_sha256" in manifest:
        want = files_checksum(files)
        if manifest["files_sha256"] != want:
            raise bad(f"its file table does not match its checksum files_sha256 "
                      f"({str(manifest['files_sha256'])[:16]}..., the table hashes to {want[:16]}...): "
                      "manifest.json was damaged or edited after the build")
    for rel, entry in files.items():
        if not _safe_rel(rel):
            raise bad(f"entry {rel!r:.80} is not a relative path inside the engine (forward slashes, no '..')")
        ok = (isinstance(entry, dict) and set(entry) == {"size", "sha256"}
              and isinstance(entry["size"], int) and not isinstance(entry["size"], bool) and entry["size"] >= 0
              and isinstance(entry["sha256"], str) and SHA256_HEX.fullmatch(entry["sha256"]))
        if not ok:
            raise bad(f"entry {rel!r} must be an object {{\"size\": bytes >= 0, \"sha256\": 64 lowercase hex "
                      f"digits}}, got {entry!r:.80}")
    return manifest


def _presence_problems(root: Path, listed: dict) -> list[str]:
    """Every listed file present with its size, nothing unlisted (no hashing)."""
    present = set(engine_files(root))
    problems = [f"{rel}: listed in {MANIFEST} but missing" for rel in sorted(set(listed) - present)]
    problems += [f"{rel}: present but not listed in {MANIFEST}" for rel in sorted(present - set(listed))]
    for rel in sorted(set(listed) & present):
        size = (root / rel).stat().st_size
        if size != listed[rel]["size"]:
            problems.append(f"{rel}: size {size} bytes, the manifest says {listed[rel]['size']}")
    return problems


def _mismatch(rel: str, actual: str, listed: dict) -> str:
    return (f"{rel}: sha256 mismatch (file {actual[:16]}..., manifest {str(listed[rel]['sha256'])[:16]}...): "
            "damaged or edited after the build")


def _hash_problems(root: Path, listed: dict, rels: list[str]) -> list[str]:
    actual = _digests(root, rels)
    return [_mismatch(rel, actual[rel]["sha256"], listed) for rel in rels
            if actual[rel]["sha256"] != listed[rel]["sha256"]]


def _sized(root: Path, listed: dict) -> list[str]:
    """The listed files present with the listed size (the ones worth hashing)."""
    return sorted(rel for rel in listed
                  if (root / rel).is_file() and (root / rel).stat().st_size == listed[rel]["size"])


def verify_manifest(root) -> list[str]:
    """Problems found, one line per file (empty: every file matches its size and sha256)."""
    root = Path(root)
    listed = read_manifest(root)["files"]
    return sorted(_presence_problems(root, listed) + _hash_problems(root, listed, _sized(root, listed)))


# ----------------------------------------------------------------------------------------------
# the plan's recorded numbers (builder/plan.py TPPlan.to_dict), recomputed here from the configs so the
# runtime can check an engine's config.json against its plan without importing the builder

def plan_per_rank(cfg: KimiConfig, dcfg: DrafterConfig, tp: int, experts: str) -> dict:
    """config.json plan.per_rank: each rank's share of every split dimension."""
    return {
        "heads": cfg.num_attention_heads // tp, "vocab": cfg.vocab_size // tp,
        "dense_intermediate": cfg.intermediate_size // tp,
        "moe_intermediate": cfg.moe_intermediate_size // tp if experts == "tp" else cfg.moe_intermediate_size,
        "routed_experts": cfg.n_routed_experts if experts == "tp" else cfg.n_routed_experts // tp,
        "shared_intermediate": cfg.moe_intermediate_size * cfg.n_shared_experts // tp,
        "drafter_heads": dcfg.num_attention_heads // tp,
        "drafter_kv_heads": dcfg.num_key_value_heads // tp,
        "drafter_intermediate": dcfg.intermediate_size // tp,
        "drafter_fc_in": dcfg.num_taps * dcfg.hidden_size // tp,
    }


def plan_all_reduce_counts(cfg: KimiConfig, dcfg: DrafterConfig) -> dict:
    """config.json plan.all_reduce_count: the target's (embedding + attention and MLP of every layer) and
    the drafter's (the borrowed embedding, fc, then attention and MLP of every drafter layer)."""
    return {"target": 1 + 2 * cfg.num_hidden_layers, "drafter": 2 + 2 * dcfg.num_hidden_layers}


# the config fields each recorded plan number derives from (to name them, with their values, when they disagree)
PLAN_SOURCES = {
    "per_rank.heads": ("model", "num_attention_heads"), "per_rank.vocab": ("model", "vocab_size"),
    "per_rank.dense_intermediate": ("model", "intermediate_size"),
    "per_rank.moe_intermediate": ("model", "moe_intermediate_size"),
    "per_rank.routed_experts": ("model", "n_routed_experts"),
    "per_rank.shared_intermediate": ("model", "moe_intermediate_size", "n_shared_experts"),
    "per_rank.drafter_heads": ("drafter", "num_attention_heads"),
    "per_rank.drafter_kv_heads": ("drafter", "num_key_value_heads"),
    "per_rank.drafter_intermediate": ("drafter", "intermediate_size"),
    "per_rank.drafter_fc_in": ("drafter", "hidden_size", "target_layer_ids"),
    "all_reduce_count.target": ("model", "num_hidden_layers"),
    "all_reduce_count.drafter": ("drafter", "num_hidden_layers"),
}


def _plan_source(key: str, cfg: KimiConfig, dcfg: DrafterConfig) -> str:
    """'model num_attention_heads 8' for a plan number's key."""
    side, *fields = PLAN_SOURCES[key]
    c = cfg if side == "model" else dcfg
    return f"{side} " + ", ".join(f"{f} {getattr(c, f)!r:.40}" for f in fields)


# ----------------------------------------------------------------------------------------------
# config.json against its plan, the rank directories, the manifest and the weights

def _split_ok(full: tuple, got: tuple, tp: int) -> bool:
    """A rank's shape: the full shape, or one axis divided by tp (builder/plan.py: equal contiguous chunks)."""
    if len(full) != len(got):
        return False
    diff = [i for i, (f, g) in enumerate(zip(full, got)) if f != g]
    return not diff or (len(diff) == 1 and full[diff[0]] % tp == 0 and got[diff[0]] == full[diff[0]] // tp)


def _rank_headers(root: Path, rank: int, files: list[str], usable: set) -> tuple[dict, list[str]]:
    """{tensor name: (TensorSpec, rel)} over a rank's weight files (headers only), and problems."""
    found, problems = {}, []
    for fname in files:
        rel = f"{rank_name(rank)}/{fname}"
        if rel not in usable:
            continue                        # missing or resized: named by the manifest check
        try:
            f = SafetensorsFile(root / rel)
        except CheckpointError as e:
            problems.append(f"{rel}: unreadable safetensors header ({e})")
            continue
        found.update({name: (spec, rel) for name, spec in f.entries.items()})
        f.close()
    return found, problems


def _fmt(spec) -> str:
    return f"{spec.dtype} {list(spec.shape)}"


def _weight_problems(root: Path, meta: dict, cfg: KimiConfig, dcfg: DrafterConfig, usable: set) -> list[str]:
    """Every rank's tensors (names, dtypes, shapes in the headers) against the model and drafter configs."""
    tp, experts = meta["tp"], meta["experts"]
    if any(f"{rank_name(r)}/{f}" not in usable for r in range(tp) for f in meta["weight_files"]):
        return []                           # a weight file missing or resized: the manifest check names it
    expected = {n: s for n, s in target_tensor_specs(cfg).items() if ".mlp.experts." not in n}
    expected.update({DRAFTER_PREFIX + n: s for n, s in drafter_tensor_specs(dcfg).items()})
    stacks = {f"model.layers.{L}.{s}" for L in cfg.moe_layers for s in EXPERT_STACKS}
    E_r = plan_per_rank(cfg, dcfg, tp, experts)["routed_experts"]
    H, layers, dlayers = cfg.hidden_size, cfg.num_hidden_layers, dcfg.num_hidden_layers
    for r in range(tp):
        found, problems = _rank_headers(root, r, meta["weight_files"], usable)
        if problems:
            return problems
        if not found:
            continue
        emb = found.get("model.embed_tokens.weight")
        if emb and len(emb[0].shape) == 2 and emb[0].shape[1] != H:
            return [f"{CONFIG}: model hidden_size is {H} but {emb[1]} holds model.embed_tokens.weight "
                    f"{_fmt(emb[0])} (hidden {emb[0].shape[1]})"]
        for prefix, n, field in (("model.layers.", layers, "model num_hidden_layers"),
                                 (DRAFTER_PREFIX + "layers.", dlayers, "drafter num_hidden_layers")):
            held = sorted({int(m.group(1)) for name in found
                           if (m := re.match(re.escape(prefix) + r"(\d+)\.", name))})
            if held != list(range(n)):
                return [f"{CONFIG}: {field} is {n} but the {rank_name(r)} weights hold layers "
                        f"{held[:3]}{'...' if len(held) > 3 else ''} ({len(held)} layers)"]
        for L in range(layers):
            dense = f"model.layers.{L}.mlp.gate_proj.weight" in found
            if dense == cfg.is_moe_layer(L):
                k = cfg.first_k_dense_replace
                return [f"{CONFIG}: model first_k_dense_replace is {k} ("
                        f"{f'dense layers 0..{k - 1}' if k else 'no dense layer'}) but layer {L} of the "
                        f"{rank_name(r)} weights is {'dense' if dense else 'MoE'}"]
        out = []
        for name, spec in expected.items():
            if name not in found:
                out.append(f"{CONFIG}: the model it describes has tensor {name} {_fmt(spec)}, which no "
                           f"{rank_name(r)} weight file holds")
                continue
            got, rel = found[name]
            if got.dtype != spec.dtype or not _split_ok(spec.shape, got.shape, tp):
                out.append(f"{CONFIG}: the model it describes has {name} {_fmt(spec)} (whole, or one axis / tp "
                           f"{tp} on a rank), but {rel} holds {_fmt(got)}")
        for name in stacks:
            if name not in found:
                out.append(f"{CONFIG}: the model it describes has routed experts {name}, which no "
                           f"{rank_name(r)} weight file holds")
            elif not found[name][0].shape or found[name][0].shape[0] != E_r:
                out.append(f"{CONFIG}: {rank_name(r)} should hold {E_r} routed experts per layer (model "
                           f"n_routed_experts, experts {experts!r}), but {found[name][1]} holds {name} "
                           f"{_fmt(found[name][0])}")
        out += [f"{rel}: tensor {name} {_fmt(spec)} is not part of the model {CONFIG} describes"
                for name, (spec, rel) in found.items() if name not in expected and name not in stacks]
        if out:
            return out
    return []


def config_problems(root, meta: dict, listed: dict, usable: set | None = None) -> list[str]:
    """config.json (already type-checked) against itself, its plan, the rank directories, the manifest's
    listing and the weights' headers. Each problem names config.json, the field, its value and what the
    rest of the engine says. usable: the files whose headers may be read (default: every listed file)."""
    root = Path(root)
    usable = set(listed) if usable is None else usable
    where = config_path(root)
    cfg = KimiConfig.from_dict(meta["model"], where=f"{where} model")
    dcfg = DrafterConfig.from_dict(meta["drafter"], where=f"{where} drafter")
    tp, experts, plan = meta["tp"], meta["experts"], meta["plan"]
    names = [rank_name(r) for r in range(tp)]
    on_disk = sorted({rel.split("/")[0] for rel in listed if re.fullmatch(r"rank\d+", rel.split("/")[0])},
                     key=lambda n: int(n[4:]))
    if plan.get("tp") != tp:
        return [f"{CONFIG}: field 'tp' is {tp} but its plan.tp is {plan.get('tp')!r:.40}"]
    if on_disk != names:
        return [f"{CONFIG}: field 'tp' is {tp} but the engine holds {len(on_disk)} rank directories "
                f"({', '.join(on_disk) or 'none'})"]
    if "ranks" in meta and meta["ranks"] != names:
        return [f"{CONFIG}: field 'ranks' is {meta['ranks']!r:.80}, expected {names} for tp {tp}"]
    if plan.get("experts") != experts:
        return [f"{CONFIG}: field 'experts' is {experts!r} but its plan.experts is {plan.get('experts')!r:.40}"]
    if meta["block_size"] != dcfg.block_size:
        return [f"{CONFIG}: field 'block_size' is {meta['block_size']} but drafter block_size is {dcfg.block_size}"]
    recorded = {"per_rank": plan.get("per_rank"), "all_reduce_count": plan.get("all_reduce_count")}
    recomputed = {"per_rank": plan_per_rank(cfg, dcfg, tp, experts),
                  "all_reduce_count": plan_all_reduce_counts(cfg, dcfg)}
    for part, want in recomputed.items():
        got = recorded[part]
        if not isinstance(got, dict):
            return [f"{CONFIG}: field 'plan.{part}' must be an object, got {got!r:.80}"]
        for k, v in want.items():
            if got.get(k) != v:
                split = f" with tp {tp} and experts {experts!r}" if part == "per_rank" else ""
                return [f"{CONFIG}: field 'plan.{part}.{k}' is {got.get(k)!r:.40} (as built) but "
                        f"{_plan_source(f'{part}.{k}', cfg, dcfg)}{split} gives {v}"]
    problems = []
    files = meta["weight_files"]
    for r, name in enumerate(names):
        held = sorted(rel.split("/", 1)[1] for rel in listed
                      if rel.startswith(name + "/") and rel.count("/") == 1 and rel.endswith(WEIGHT_SUFFIX))
        problems += [f"{CONFIG}: field 'weight_files' lists {f} but {name}/{f} is not in {MANIFEST}"
                     for f in files if f not in held]
        problems += [f"{name}/{f}: a weight file not in {CONFIG} field 'weight_files' ({files[:3]}...)"
                     for f in held if f not in files]
    kernels = meta.get("kernels")
    if isinstance(kernels, dict):
        for arch, entries in kernels.items():
            if arch not in meta["archs"]:
                problems.append(f"{CONFIG}: field 'kernels' has arch {arch!r:.40}, not in field 'archs' "
                                f"{meta['archs']}")
            for source, e in (entries.items() if isinstance(entries, dict) else []):
                rel = e.get("file") if isinstance(e, dict) else None
                if rel not in listed:
                    problems.append(f"{CONFIG}: field 'kernels' {arch} {source} names file {rel!r:.80}, "
                                    f"not in {MANIFEST}")
    if problems:
        return problems
    return _weight_problems(root, meta, cfg, dcfg, usable)


def _edited_note(root: Path, listed: dict) -> str:
    """Whether config.json still matches its manifest entry (size and sha256; for messages only)."""
    path = config_path(root)
    entry = listed.get(CONFIG)
    if entry is None or not path.is_file():
        return ""
    if path.stat().st_size == entry["size"] and sha256_file(path) == entry["sha256"]:
        return (f" ({CONFIG} matches {MANIFEST}: the engine was built this way, or edited and re-manifested; "
                "rebuild it with ddtree build)")
    return f" ({CONFIG} was edited after the build: it no longer matches {MANIFEST}; rebuild the engine)"


def _raise(root: Path, problems: list[str], note: str = "") -> None:
    """EngineFormatError naming each file by its path (root/rel: ...), the first three problems."""
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    raise EngineFormatError("; ".join(f"{root}/{p}" for p in problems[:3]) + more + note)


def check_engine(root, verify: bool = True) -> tuple[dict, dict | None]:
    """Everything about an engine directory short of hashing its weights, before anything is loaded.
    Structural (always): the manifest, every listed file present with its size and nothing unlisted,
    config.json consistent (config_problems). verify: also every non-weight file's sha256 (cubins, graphs,
    plans, tokenizer, config.json). Returns (config.json, {rel: {"size", "sha256"}} of the weight files for
    load_rank_tensors to hash as it reads them, or None when not verifying). EngineFormatError names the
    file(s), an edited config.json its field and value."""
    root = Path(root)
    if not is_engine_dir(root):
        raise not_an_engine(root)
    listed = read_manifest(root)["files"]
    presence = _presence_problems(root, listed)
    try:
        meta = read_engine_config(root)
    except EngineFormatError as e:
        raise EngineFormatError(f"{e}{_edited_note(root, listed)}") from e
    usable = set(_sized(root, listed))
    try:
        bad_config = config_problems(root, meta, listed, usable)
    except ConfigError as e:                     # the model or drafter config itself is invalid
        raise type(e)(f"{e}{_edited_note(root, listed)}") from e
    if bad_config:
        damaged = sorted({q.split(": ", 1)[0] for q in bad_config} & set(listed) - {CONFIG})
        if verify and damaged:               # a weight file's unreadable header: say first whether it is damaged
            bad_config = _hash_problems(root, listed, damaged) + bad_config
        edited = any(q.startswith(f"{CONFIG}: ") for q in bad_config)
        _raise(root, bad_config, _edited_note(root, listed) if edited else "")
    if presence:
        edited = any(p.startswith(f"{CONFIG}: ") for p in presence)
        _raise(root, presence, _edited_note(root, listed) if edited else "")
    if not verify:
        return meta, None
    weights = {f"{rank_name(r)}/{f}" for r in range(meta["tp"]) for f in meta["weight_files"]}
    others = sorted(set(listed) - weights)
    mismatched = _hash_problems(root, listed, others)
    if mismatched:
        _raise(root, mismatched)
    return meta, {rel: listed[rel] for rel in weights}


def engine_problems(root) -> tuple[dict, list[str]]:
    """`ddtree inspect`: (config.json, every problem as one line) after the same structural checks as
    check_engine and every file's sha256, weights included. Raises only when the manifest or config.json
    cannot be read at all."""
    root = Path(root)
    if not is_engine_dir(root):
        raise not_an_engine(root)
    listed = read_manifest(root)["files"]
    meta = read_engine_config(root)
    usable = set(_sized(root, listed))
    return meta, config_problems(root, meta, listed, usable) + verify_manifest(root)


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


def _read_hashed(path: Path, size: int) -> tuple[bytearray, str]:
    """The whole file in READ_BYTES reads, hashed as it is read: (its bytes, sha256)."""
    buf, h = bytearray(size), hashlib.sha256()
    view = memoryview(buf)
    with open(path, "rb") as f:
        pos = 0
        while pos < size:
            n = f.readinto(view[pos: pos + READ_BYTES])
            if not n:
                break
            h.update(view[pos: pos + n])
            pos += n
        if pos != size or f.read(1):
            raise EngineFormatError(f"{path}: changed size while being read ({size} bytes expected)")
    return buf, h.hexdigest()


def load_rank_tensors(root, rank: int, files, convert=STORED, digests: dict | None = None) -> dict[str, np.ndarray]:
    """rank<r>/<files> -> {name: array}. convert: STORED (BF16 as uint16 bits), BFLOAT16 (BF16 as
    ml_dtypes.bfloat16, the graphs' inputs) or a float dtype (every tensor but the routed experts'
    .words/.scales converted, exactly for bf16). digests: {"rank<r>/<file>": {"size", "sha256"}} (from
    check_engine): each file is hashed while it is read (one read) and EngineFormatError names a file whose
    sha256 differs from its manifest entry."""
    fn = _converter(convert)
    out = {}
    for fname in files:
        path = rank_dir(root, rank) / fname
        if not path.is_file():
            raise EngineFormatError(f"{path}: weight file listed in {CONFIG} is missing")
        f = SafetensorsFile(path)
        try:
            rel = f"{rank_name(rank)}/{fname}"
            if digests is None:
                for name, spec in f.entries.items():
                    out[name] = fn(name, spec.dtype, f.read(name))
                continue
            if rel not in digests:
                raise EngineFormatError(f"{path}: weight file not listed in {MANIFEST}")
            buf, actual = _read_hashed(path, digests[rel]["size"])
            if actual != digests[rel]["sha256"]:
                raise EngineFormatError(f"{Path(root)}/{_mismatch(rel, actual, {rel: digests[rel]})}")
            for name, spec in f.entries.items():
                begin, _ = f.offsets[name]
                count = int(np.prod(spec.shape, dtype=np.int64))
                a = np.frombuffer(buf, dtype=NUMPY_DTYPE[spec.dtype], count=count, offset=f.data_start + begin)
                out[name] = fn(name, spec.dtype, a.reshape(spec.shape).copy())
        finally:
            f.close()
    return out
