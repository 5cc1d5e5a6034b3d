"""The engine directory as the runtime reads it (written by ddtree/builder; architecture.md).

    engines/<name>/
      config.json      {"format": "ddtree-engine/1", "model": <target config.json>, "drafter": <drafter
                       config.json>, "tp", "experts", "archs", "budgets", "block_size", "dtypes",
                       "plan" (per-rank sizes, builder/plan.py), "weight_files", "kernels", ...}
      rank<r>/         that rank's weights (builder/weights.py documents every name and shape)
      kernels/<arch>/  cubins, one per kernel source
      tokenizer/       the checkpoint's tokenizer files (absent for byte-tokenizer models)
      manifest.json    size and sha256 of every other file (checked by `ddtree inspect`)
"""
from __future__ import annotations

import json
from pathlib import Path

ENGINE_FORMAT = "ddtree-engine/1"
FORMAT_FAMILY = "ddtree-engine/"
REQUIRED = ("model", "drafter", "tp", "experts", "archs", "budgets", "block_size", "plan", "weight_files")


class EngineFormatError(ValueError):
    """An engine directory is missing a file or holds a config this runtime cannot read."""


def _config_json(path) -> dict | None:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    try:
        d = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) else None


def is_engine_dir(path) -> bool:
    """True iff path/config.json declares a ddtree engine format (any version)."""
    d = _config_json(path) if path is not None else None
    return bool(d) and str(d.get("format", "")).startswith(FORMAT_FAMILY)


def read_engine_config(path) -> dict:
    """The engine's config.json, checked for the format version and the required fields."""
    path = Path(path)
    d = _config_json(path)
    if d is None:
        raise EngineFormatError(f"{path / 'config.json'}: missing or not a JSON object")
    if d.get("format") != ENGINE_FORMAT:
        raise EngineFormatError(f"{path / 'config.json'}: format {d.get('format')!r} is not supported "
                                f"(this runtime reads {ENGINE_FORMAT!r})")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise EngineFormatError(f"{path / 'config.json'}: missing required fields {missing}")
    return d


def rank_dir(path, rank: int) -> Path:
    return Path(path) / f"rank{rank}"
