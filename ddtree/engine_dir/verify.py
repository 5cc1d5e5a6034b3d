"""The load-time check of an engine: structure (manifest, config.json against its plan, the rank
directories and the weights' headers) and hashes.

Part of ddtree/engine_dir (the package docstring has the layout).
"""
from __future__ import annotations

import re
from pathlib import Path

from ddtree.engine_dir.layout import (
    CONFIG,
    DRAFTER_PREFIX,
    EXPERT_STACKS,
    MANIFEST,
    WEIGHT_SUFFIX,
    EngineFormatError,
    config_path,
    engine_configs,
    is_engine_dir,
    not_an_engine,
    rank_name,
    read_engine_config,
)
from ddtree.engine_dir.manifest import (
    hash_problems,
    presence_problems,
    read_manifest,
    sha256_file,
    sized_files,
    verify_manifest,
)
from ddtree.model.config import ConfigError, DrafterConfig, KimiConfig
from ddtree.model.safetensors_io import CheckpointError, SafetensorsFile
from ddtree.model.tensors import drafter_tensor_specs, target_tensor_specs


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
    cfg, dcfg = engine_configs(root, meta)
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


EDIT_SLACK_BYTES = 64 << 10     # config.json may outgrow its manifest size by this and still be read, so
                                # that a hand edit is named by its field; past it, it is refused unread


def _config_size_first(root: Path, presence: list[str], listed: dict) -> None:
    """config.json's size against the manifest before a byte of it is read: far larger than listed (a 1 GB
    one) is refused unread; a small edit is read, so the error can name the edited field."""
    path, entry = config_path(root), listed.get(CONFIG)
    wrong = [p for p in presence if p.startswith(f"{CONFIG}: size ")]
    if wrong and entry is not None and path.stat().st_size > entry["size"] + EDIT_SLACK_BYTES:
        _raise(root, wrong, _edited_note(root, listed))


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
    presence = presence_problems(root, listed)
    _config_size_first(root, presence, listed)
    try:
        meta = read_engine_config(root)
    except EngineFormatError as e:
        raise EngineFormatError(f"{e}{_edited_note(root, listed)}") from e
    usable = set(sized_files(root, listed))
    try:
        bad_config = config_problems(root, meta, listed, usable)
    except ConfigError as e:                     # the model or drafter config itself is invalid
        raise type(e)(f"{e}{_edited_note(root, listed)}") from e
    if bad_config:
        damaged = sorted({q.split(": ", 1)[0] for q in bad_config} & set(listed) - {CONFIG})
        if verify and damaged:               # a weight file's unreadable header: say first whether it is damaged
            bad_config = hash_problems(root, listed, damaged) + bad_config
        edited = any(q.startswith(f"{CONFIG}: ") for q in bad_config)
        _raise(root, bad_config, _edited_note(root, listed) if edited else "")
    if presence:
        edited = any(p.startswith(f"{CONFIG}: ") for p in presence)
        _raise(root, presence, _edited_note(root, listed) if edited else "")
    if not verify:
        return meta, None
    weights = {f"{rank_name(r)}/{f}" for r in range(meta["tp"]) for f in meta["weight_files"]}
    others = sorted(set(listed) - weights)
    mismatched = hash_problems(root, listed, others)
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
    _config_size_first(root, presence_problems(root, listed), listed)
    meta = read_engine_config(root)
    usable = set(sized_files(root, listed))
    return meta, config_problems(root, meta, listed, usable) + verify_manifest(root)
