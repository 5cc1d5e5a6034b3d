"""The training corpus: Python standard-library source files every machine has offline.

`ddtree/data/corpus.json` pins each file by its path under the stdlib directory and its sha256;
the pinned files were chosen byte-identical in CPython 3.10.13, 3.11.7 and 3.12.1 (checked with
`pin_corpus` below against those three installs). A file whose bytes differ on this machine is
skipped with a warning, so every machine trains on the same bytes or on a named subset. The split
is by file: `heldout` files never reach training; the bench prompts come from them.

A document is BOS + the file's bytes + EOS (byte tokenizer ids, docs/interfaces.md section 2).
numpy only: the bench and tests import this without torch.
"""
from __future__ import annotations

import hashlib
import json
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddtree.model.presets import BYTE_BOS, BYTE_EOS

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CORPUS_JSON = DATA_DIR / "corpus.json"
PROMPTS_JSONL = DATA_DIR / "heldout_prompts.jsonl"

# Held out by file (about 9% of the bytes): ordinary library code, none of it generated tables.
HELDOUT_FILES = ("queue.py", "sched.py", "hmac.py", "shelve.py", "getpass.py", "linecache.py", "bz2.py",
                 "urllib/robotparser.py", "json/decoder.py", "_threading_local.py")
# Excluded although identical across versions: codec tables, generated tables, rot13 text, stubs,
# and tkinter/tix.py (77 KB of near-identical Tk wrappers that a tiny model memorises and parrots).
EXCLUDED_PREFIXES = ("encodings/",)
EXCLUDED_FILES = ("stringprep.py", "this.py", "antigravity.py", "tkinter/tix.py")
MIN_BYTES = 1500


@dataclass
class Corpus:
    train: np.ndarray          # [n] int64 token ids: documents BOS + bytes + EOS, concatenated
    heldout: np.ndarray        # [m] int64, same layout
    heldout_docs: dict         # path -> bytes of each held-out file
    skipped: list              # paths whose sha256 did not match on this machine (or missing)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_pins(path: Path = CORPUS_JSON) -> list[dict]:
    try:
        pins = json.loads(Path(path).read_text())["files"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"{path}: not a corpus pin file with a 'files' list ({e})") from e
    for p in pins:
        if not {"path", "sha256", "split"} <= set(p) or p["split"] not in ("train", "heldout"):
            raise ValueError(f"{path}: entry {p!r} needs path, sha256 and split 'train' or 'heldout'")
    return pins


def document(data: bytes) -> np.ndarray:
    return np.array([BYTE_BOS, *data, BYTE_EOS], dtype=np.int64)


def load_corpus(pins_path: Path = CORPUS_JSON, root: Path | None = None) -> Corpus:
    """Read the pinned files from the stdlib (or `root`), skip mismatches, split train / heldout."""
    root = Path(root) if root is not None else stdlib_dir()
    train, heldout, docs, skipped = [], [], {}, []
    pins = load_pins(pins_path)
    for pin in pins:
        f = root / pin["path"]
        data = f.read_bytes() if f.is_file() else None
        if data is None or sha256(data) != pin["sha256"]:
            skipped.append(pin["path"])
            continue
        (heldout if pin["split"] == "heldout" else train).append(document(data))
        if pin["split"] == "heldout":
            docs[pin["path"]] = data
    if skipped:
        warnings.warn(f"corpus: {len(skipped)} pinned files differ on this Python ({root}) and were "
                      f"skipped: {', '.join(skipped[:8])}{' ...' if len(skipped) > 8 else ''}", stacklevel=2)
    if not train or not heldout:
        raise ValueError(f"corpus: no usable {'training' if not train else 'held-out'} file under {root} "
                         f"matches {pins_path}")
    return Corpus(np.concatenate(train), np.concatenate(heldout), docs, skipped)


def pin_corpus(stdlib_dirs: list[Path]) -> list[dict]:
    """The pin list: .py files identical in every given stdlib dir, minus exclusions (run by hand)."""
    first, rest = Path(stdlib_dirs[0]), [Path(d) for d in stdlib_dirs[1:]]
    skip_dirs = {"site-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo"}
    pins = []
    for f in sorted(first.rglob("*.py")):
        rel = f.relative_to(first).as_posix()
        if set(f.relative_to(first).parts[:-1]) & skip_dirs or rel.startswith(EXCLUDED_PREFIXES):
            continue
        data = f.read_bytes()
        if rel in EXCLUDED_FILES or len(data) < MIN_BYTES or rel.startswith("config-"):
            continue
        digest = sha256(data)
        if all((d / rel).is_file() and sha256((d / rel).read_bytes()) == digest for d in rest):
            pins.append({"path": rel, "sha256": digest, "bytes": len(data),
                         "split": "heldout" if rel in HELDOUT_FILES else "train"})
    return pins


def make_prompts(heldout_docs: dict, per_file: int = 2, context: int = 320) -> list[dict]:
    """Bench prompts from the held-out files: up to `context` bytes of whole lines ending with a
    `def` line, for the first `per_file` functions at least `context` bytes into each file."""
    prompts = []
    for path in sorted(heldout_docs):
        lines = heldout_docs[path].decode("utf-8").splitlines(keepends=True)
        offsets = np.cumsum([0] + [len(s.encode()) for s in lines])
        taken = 0
        for i, line in enumerate(lines):
            if taken == per_file:
                break
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and offsets[i] >= context:
                first = i
                while offsets[i + 1] - offsets[first] > context:
                    first += 1
                while first > 0 and offsets[i + 1] - offsets[first - 1] <= context:
                    first -= 1
                prompts.append({"source": path, "line": i + 1, "text": "".join(lines[first: i + 1])})
                taken += 1
    return prompts


def load_prompts(path: Path = PROMPTS_JSONL) -> list[dict]:
    """The committed held-out prompts: one JSON object per line with 'source', 'line' and 'text'."""
    try:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON-lines prompt file ({e})") from e
    for r in rows:
        if not isinstance(r.get("text"), str) or not r["text"]:
            raise ValueError(f"{path}: every line needs a non-empty 'text', got {r!r}")
    return rows


if __name__ == "__main__":     # python -m ddtree.training.corpus DIR310 DIR311 DIR312: rewrite the pins
    import sys

    dirs = [Path(d) for d in sys.argv[1:]] or [stdlib_dir()]
    pins = pin_corpus(dirs)
    doc = {"about": "Python stdlib files identical in CPython " + ", ".join(d.name for d in dirs) +
           " (by sha256); paths are relative to sysconfig's stdlib dir", "files": pins}
    CORPUS_JSON.write_text(json.dumps(doc, indent=1) + "\n")
    corpus = load_corpus()
    with open(PROMPTS_JSONL, "w") as f:
        for p in make_prompts(corpus.heldout_docs):
            f.write(json.dumps(p) + "\n")
    n_held = sum(p["bytes"] for p in pins if p["split"] == "heldout")
    print(f"{len(pins)} files, {sum(p['bytes'] for p in pins)} bytes ({n_held} held out)")
