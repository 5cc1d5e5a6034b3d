"""manifest.json: the size and sha256 of every other file, written and verified.

Part of ddtree/engine_dir (the package docstring has the layout).
"""
from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from ddtree.engine_dir.layout import (
    ENGINE_FORMAT,
    HASH_THREADS,
    MANIFEST,
    READ_BYTES,
    TUNING,
    EngineFormatError,
    json_object,
    manifest_path,
)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            h.update(chunk)
    return h.hexdigest()


def engine_files(root) -> list[str]:
    """Every regular file under root except the manifest and the tuning file (machine-specific, written after
    the build, checked by its own checksum: engine_dir/tuning.py), as sorted relative paths."""
    root = Path(root)
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    return sorted(rel for rel in rels if rel not in (MANIFEST, TUNING))


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

    manifest = json_object(path, bad)
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


def presence_problems(root: Path, listed: dict) -> list[str]:
    """Every listed file present with its size, nothing unlisted (no hashing)."""
    present = set(engine_files(root))
    problems = [f"{rel}: listed in {MANIFEST} but missing" for rel in sorted(set(listed) - present)]
    problems += [f"{rel}: present but not listed in {MANIFEST}" for rel in sorted(present - set(listed))]
    for rel in sorted(set(listed) & present):
        size = (root / rel).stat().st_size
        if size != listed[rel]["size"]:
            problems.append(f"{rel}: size {size} bytes, the manifest says {listed[rel]['size']}")
    return problems


def mismatch(rel: str, actual: str, listed: dict) -> str:
    return (f"{rel}: sha256 mismatch (file {actual[:16]}..., manifest {str(listed[rel]['sha256'])[:16]}...): "
            "damaged or edited after the build")


def hash_problems(root: Path, listed: dict, rels: list[str]) -> list[str]:
    actual = _digests(root, rels)
    return [mismatch(rel, actual[rel]["sha256"], listed) for rel in rels
            if actual[rel]["sha256"] != listed[rel]["sha256"]]


def sized_files(root: Path, listed: dict) -> list[str]:
    """The listed files present with the listed size (the ones worth hashing)."""
    return sorted(rel for rel in listed
                  if (root / rel).is_file() and (root / rel).stat().st_size == listed[rel]["size"])


def verify_manifest(root) -> list[str]:
    """Problems found, one line per file (empty: every file matches its size and sha256)."""
    root = Path(root)
    listed = read_manifest(root)["files"]
    return sorted(presence_problems(root, listed) + hash_problems(root, listed, sized_files(root, listed)))
