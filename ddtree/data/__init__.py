"""Package data: the embedded tiny model and the files it was trained and measured with.

    tiny/target/               HF checkpoint dir, K2.6 layout (text_config, language_model.),
                               byte tokenizer ("ddtree_tokenizer": "bytes"), INT4 routed experts
    tiny/drafter/              DFlash drafter dir (config.json + model.safetensors)
    tiny/training_log.json     the training command, settings and loss curves
    corpus.json                the pinned stdlib training corpus (path, sha256, split)
    heldout_prompts.jsonl      bench prompts cut from the held-out files

Rebuilt by `python -m ddtree.training.train --out ddtree/data/tiny --seed 0` (docs/tiny-model.md).
"""
from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
TINY_DIR = DATA_DIR / "tiny"
HELDOUT_PROMPTS = DATA_DIR / "heldout_prompts.jsonl"


def tiny_model_dirs() -> tuple[Path, Path]:
    """(target_dir, drafter_dir) of the embedded tiny model; a clear error if they are missing."""
    target, drafter = TINY_DIR / "target", TINY_DIR / "drafter"
    for d in (target, drafter):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"{d}: the embedded tiny model is missing (no config.json); rebuild it "
                                    "with `python -m ddtree.training.train --out ddtree/data/tiny --seed 0`")
    return target, drafter
