"""manifest.json of an engine directory: the size and sha256 of every other file in it.

    {"format": "ddtree-engine/1", "files": {"config.json": {"size": 1234, "sha256": "..."}, ...}}
Paths are relative, with forward slashes, sorted. `verify_manifest` re-hashes every file and
reports, by file name, each one that is missing, has another size or checksum, or is not listed.
Files are hashed in 1 MiB reads on a few threads (hashlib releases the GIL on large buffers).
"""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ddtree.runtime.engine_format import ENGINE_FORMAT

MANIFEST = "manifest.json"
READ_BYTES = 1 << 20
HASH_THREADS = 4


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def engine_files(engine_dir) -> list[str]:
    """Every regular file under engine_dir except the manifest, as sorted relative paths."""
    root = Path(engine_dir)
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(rel for rel in rels if rel != MANIFEST)


def _digests(root: Path, rels: list[str]) -> dict[str, dict]:
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        sums = list(pool.map(lambda rel: sha256_file(root / rel), rels))
    return {rel: {"size": (root / rel).stat().st_size, "sha256": s} for rel, s in zip(rels, sums)}


def write_manifest(engine_dir) -> dict:
    root = Path(engine_dir)
    manifest = {"format": ENGINE_FORMAT, "files": _digests(root, engine_files(root))}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(engine_dir) -> dict:
    path = Path(engine_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (every engine directory has a manifest)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a valid manifest ({e})") from e
    return manifest


def verify_manifest(engine_dir) -> list[str]:
    """Problems found, one line per file (empty: every file matches its size and sha256)."""
    root = Path(engine_dir)
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
