"""The build side of an engine directory (layout, config.json and manifest: ddtree/engine_dir/): the
checks before a build (archs, NVRTC, output folder, disk), the kernels/<arch>/ cubins, tokenizer/,
config.json's content, and the output folder's life cycle (built aside, moved into place when complete).

Kernels are compiled ahead of time with NVRTC through plugins/compile.py, which needs the `cuda`
extra (cuda-core, cuda-bindings, nvidia-cuda-nvrtc; no GPU and no driver). `require_nvrtc` checks
for it before anything is written, so a build without it fails at once with the install command.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from ddtree import engine_dir as ed
from ddtree.errors import InputError
from ddtree.model.config import DrafterConfig, KimiConfig
from ddtree.plugins import compile as kc
from ddtree.plugins.compile import nvrtc_version
from ddtree.version import __version__

# Archs the kernels target (mma.sync bf16 + cp.async: sm_80 and later; 'a' = arch-specific features)
KNOWN_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_100a", "sm_103", "sm_120",
               "sm_120a", "sm_121")
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
KERNEL_BYTES_ESTIMATE = 4 << 20          # per arch, for the free-disk check (cubins are ~1.4 MB today)
DTYPES = {"dense": "bf16", "router_bias": "f32",
          "routed_experts": "int4 (symmetric, group 32, bf16 scales) in the plugins/layout.py kernel layout",
          "activations": "bf16", "kv_cache": "bf16"}


class BuildError(InputError):
    """A build cannot start or finish; the message names the flag, file or field."""


def check_archs(archs) -> list[str]:
    archs = list(dict.fromkeys(archs))
    if not archs:
        raise BuildError("--arch: give at least one target architecture, e.g. --arch sm_120 (or --no-kernels for an "
                         "engine the CPU executors run, without NVRTC)")
    for a in archs:
        if a not in KNOWN_ARCHS:
            raise BuildError(f"--arch {a}: unknown architecture (known: {', '.join(KNOWN_ARCHS)})")
    return archs


def require_nvrtc() -> str:
    """The NVRTC version as 'major.minor', or BuildError naming the missing extra."""
    try:
        major, minor = nvrtc_version()
    except Exception as e:  # noqa: BLE001 - ImportError or NVRTC failing to load: same remedy
        raise BuildError("--arch: compiling the kernels needs NVRTC from the 'cuda' extra (or build with --no-kernels "
                         "for the CPU executors) "
                         f"(pip install -e '.[cuda]': cuda-core, cuda-bindings, nvidia-cuda-nvrtc); {e}") from e
    return f"{major}.{minor}"


def compile_kernels(archs, out_dir: Path, cache=None, on_done=None, *, latent: int, rope: int) -> dict:
    """Every kernel source for every arch -> out_dir/kernels/<arch>/<source stem>.cubin, the MLA attention
    and KV cache at the model's latent dims (kv_lora_rank, qk_rope_head_dim).
    Returns the config.json "kernels" entry: {arch: {source: {"file", "source_sha256"}}}."""
    cubins = kc.compile_all(tuple(archs), cache=cache, latent=latent, rope=rope)    # in parallel
    entry = {}
    for arch in archs:
        folder = ed.kernels_dir(out_dir, arch)
        folder.mkdir(parents=True, exist_ok=True)
        entry[arch] = {}
        for source in kc.SOURCES:
            cubin = cubins[(source, arch)]
            dest = folder / f"{Path(source).stem}.cubin"
            shutil.copyfile(cubin, dest)
            entry[arch][source] = {"file": dest.relative_to(out_dir).as_posix(), "source_sha256": kc.source_hash(source)}
            if on_done:
                on_done(arch, source)
    return entry


def tokenizer_files(model_dir: Path, cfg: KimiConfig) -> list[Path]:
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    if cfg.tokenizer == "tiktoken" and not (model_dir / "tiktoken.model").is_file():
        raise BuildError(f"{model_dir / 'tiktoken.model'}: missing; the engine carries the checkpoint's tokenizer")
    return files


def copy_tokenizer(files: list[Path], out_dir: Path) -> str | None:
    if not files:
        return None
    folder = ed.tokenizer_dir(out_dir)
    folder.mkdir(exist_ok=True)
    for f in files:
        shutil.copyfile(f, folder / f.name)
    return ed.TOKENIZER


def config_fields(cfg: KimiConfig, dcfg: DrafterConfig, plan: dict, archs, budgets, weight_files: list[str],
                  kernels: dict, tokenizer: str | None, sources: dict) -> dict:
    """What config.json holds besides "format" (ddtree/engine_dir/ writes it and checks every field)."""
    return {"ddtree_version": __version__, "model": cfg.to_dict(), "drafter": dcfg.to_dict(),
            "tp": plan["tp"], "experts": plan["experts"], "archs": list(archs), "budgets": list(budgets),
            "block_size": dcfg.block_size, "dtypes": DTYPES, "plan": plan,
            "ranks": [ed.rank_name(r) for r in range(plan["tp"])], "weight_files": weight_files,
            "kernels": kernels, "tokenizer": tokenizer, "source": sources}


# ----------------------------------------------------------------------------------------------
# the output folder

def check_out(out: Path, force: bool) -> None:
    """Refuse to replace an existing output without --force, and never replace a non-engine folder."""
    if not out.exists():
        return
    if not force:
        raise BuildError(f"--out {out}: already exists (use --force to replace it)")
    if out.is_dir() and (ed.is_engine_dir(out) or not any(out.iterdir())):
        return
    raise BuildError(f"--out {out}: exists and is not a ddtree engine directory; not replacing it, even with --force")


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def check_disk(out: Path, need: int) -> int:
    """BuildError unless the filesystem of `out` has `need` bytes free; returns the free bytes."""
    where = existing_ancestor(out)
    free = shutil.disk_usage(where).free
    if need > free:
        raise BuildError(f"--out {out}: not enough disk space at {where}: the engine needs {need / 1e9:.2f} GB, "
                         f"{free / 1e9:.2f} GB free")
    return free


def staging_dir(out: Path) -> Path:
    """Where the engine is built before it is moved to `out` (same filesystem, so the move is a rename)."""
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.building-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    return stage


def move_into_place(stage: Path, out: Path) -> None:
    out = out.absolute()
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        out.rename(old)
    stage.rename(out)
    if old is not None:
        shutil.rmtree(old)
