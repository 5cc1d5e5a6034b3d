"""Ahead-of-time compilation of ddtree/plugins/kernels/*.cu to cubins with NVRTC (cuda.core).

Cubins are cached on disk by (source hash, arch, options, NVRTC version): the hash covers the .cu file
and every header in the kernels directory, so editing common.cuh recompiles everything. Compiling
needs no GPU and no driver (cuda.core + the pip NVRTC); loading and launching happen in device.py.
The kernels include no CUDA headers, so no toolkit include directory is needed either.

    ddtree.plugins.compile.compile_all(("sm_90", "sm_120"))   # -> {(source, arch): Path to .cubin}

The MLA attention and the latent KV cache (LATENT_SOURCES) compile per model: latent_defines(kv_lora_rank,
qk_rope_head_dim) gives their -D MLA_DL / MLA_DR after checking the dims against what the kernels need
(LatentDimsError names the broken constraint); one cubin per (source, arch, defines), cached like the rest.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ddtree.errors import InputError

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
DEFAULT_ARCHS = ("sm_90", "sm_120")

# Per-source, per-arch compile-time constants ("default" for archs not listed). The launchers read the
# same numbers (defines_for) for grid and shared-memory sizes, so this table is the single source of
# truth. (Measured on the H200: a 12-deep ring with fewer resident warps was slower than 6-deep rings
# with more warps per SM; the MoE loop needs warps to hide its dequant/mma dependency chains.)
SOURCES: dict[str, dict[str, dict[str, int]]] = {
    "moe.cu": {"default": {}},                 # ring depths are template parameters (plugins/moe.py)
    "gemm.cu": {"default": {"DD_WARPS": 4, "DD_STAGES": 6}},
    "fill.cu": {"default": {}},
    "mla_attention.cu": {"default": {}},       # (warps, stages) variants are templates (plugins/mla_attention.py);
    "mla_decode.cu": {"default": {}},          # these four also take the model's latent_defines
    "mla_invariant.cu": {"default": {}},       # the batch-invariant plan's attention (plugins/mla_invariant.py)
    "kv_cache.cu": {"default": {}},
    "tree_build.cu": {"default": {}},
    "sample.cu": {"default": {}},
    "sample_top_p.cu": {"default": {}},
    "sample_top_p_ranks.cu": {"default": {}},  # top-p over tp ranks' vocab slices (plugins/top_p_ranks_gpu.py)
    "mla_absorb.cu": {"default": {}},
    "draft_attention.cu": {"default": {}},
    "layer_ops.cu": {"default": {}},           # embed, norms, rope, silu_mul, gather, cast
    "step_state.cu": {"default": {}},          # the decode step's device state and record ring
    "allreduce.cu": {"default": {"AR_MAX_RANKS": 8, "AR_MAX_BLOCKS": 32}},   # one-shot all-reduce (plugins/allreduce.py)
    "router.cu": {"default": {}},              # the fused MoE router (plugins/router.py)
    "prefetch.cu": {"default": {}},            # L2 prefetch of the next kernels' weights (plugins/prefetch.py)
    "pcie_standin.cu": {"default": {}},        # a PCIe collective's stand-in on one GPU (plugins/pcie_standin.py)
    # the persistent GEMM chain (plugins/gemm_chain.py): 8 warps a block of 2 KB ring stages, 12 in sm_90's 227 KB
    # (25 MB in flight on 132 SMs), 6 in sm_120's 99 KB
    "gemm_chain.cu": {"default": {"GC_WARPS": 8, "GC_STAGES": 6}, "sm_90": {"GC_WARPS": 8, "GC_STAGES": 12}},
    "tree_prune.cu": {"default": {}},          # pruning a tree inside the verify (plugins/tree_prune.py, issue 53)
    "prune_ops.cu": {"default": {}},           # the pruned verify's routing, walk mask, path probs (plugins/prune_ops.py)
}
CXX_STD = "c++17"
# Sources whose cubins depend on the model's latent geometry (compiled with latent_defines)
LATENT_SOURCES = ("mla_attention.cu", "mla_decode.cu", "mla_invariant.cu", "kv_cache.cu")
KIMI_LATENT, KIMI_ROPE = 512, 64                   # Kimi K2.6: kv_lora_rank, qk_rope_head_dim
MAX_LATENT = 512


class LatentDimsError(InputError):
    """A model's latent dims the MLA attention / KV cache kernels cannot be compiled for (the constraint is
    named); an InputError: a checkpoint's config.json can carry them."""


def latent_defines(latent: int, rope: int) -> dict[str, int]:
    """The NVRTC defines of LATENT_SOURCES for kv_lora_rank `latent` and qk_rope_head_dim `rope`, after the
    kernels' constraints (restated as static_asserts in kernels/mla_common.cuh):
    latent a multiple of 32 in [32, MAX_LATENT]: the tree form's two warps of a pair each own latent / 2
      output dims in 16-dim ldmatrix.trans steps, and every thread holds latent / 4 fp32 accumulators
      (128 at 512; more would spill);
    rope a positive multiple of 16: the key dims latent + rope step through the mma's k = 16 (and the
      16-byte copies of the cache entries need multiples of 8)."""
    for name, value in (("latent (kv_lora_rank)", latent), ("rope (qk_rope_head_dim)", rope)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise LatentDimsError(f"MLA kernels: {name} must be an int, got {value!r}")
    if latent % 32 or not 32 <= latent <= MAX_LATENT:
        raise LatentDimsError(f"MLA kernels: latent (kv_lora_rank) = {latent} must be a multiple of 32 in "
                              f"[32, {MAX_LATENT}] (a warp owns latent / 2 output dims in 16-dim mma tiles, "
                              f"latent / 4 fp32 accumulators per thread)")
    if rope % 16 or rope < 16:
        raise LatentDimsError(f"MLA kernels: rope (qk_rope_head_dim) = {rope} must be a positive multiple of 16 "
                              f"(the key dims latent + rope step through the mma's k = 16)")
    return {"MLA_DL": int(latent), "MLA_DR": int(rope)}


def defines_for(source: str, arch: str) -> dict[str, int]:
    """The compile-time constants of `source` for `arch` (sm_90a uses sm_90's)."""
    _check(source, arch)
    table = SOURCES[source]
    return dict(table.get(arch.rstrip("a"), table["default"]))


def cache_dir() -> Path:
    """$DDTREE_KERNEL_CACHE, else $XDG_CACHE_HOME/ddtree/cubins, else ~/.cache/ddtree/cubins."""
    if os.environ.get("DDTREE_KERNEL_CACHE"):
        return Path(os.environ["DDTREE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddtree" / "cubins"


def _check(source: str, arch: str) -> None:
    if source not in SOURCES:
        raise ValueError(f"unknown kernel source {source!r}; known: {sorted(SOURCES)}")
    if not arch.startswith("sm_") or not arch[3:].rstrip("a").isdigit():
        raise ValueError(f"arch must look like 'sm_90' or 'sm_120a', got {arch!r}")


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc  # cuda: the cuda extra
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return int(major), int(minor)


def source_hash(source: str) -> str:
    """sha256 over the source file and every header next to it (sorted by name)."""
    h = hashlib.sha256()
    for path in [KERNEL_DIR / source] + sorted(KERNEL_DIR.glob("*.cuh")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _options(source: str, arch: str, defines: dict[str, int] | None):
    from cuda.core import ProgramOptions  # cuda: the cuda extra
    macros = {**defines_for(source, arch), **(defines or {})}
    return ProgramOptions(name=source, arch=arch, std=CXX_STD, include_path=[str(KERNEL_DIR)],
                          define_macro=[(k, str(v)) for k, v in sorted(macros.items())] or None)


def cubin_key(source: str, arch: str, defines: dict[str, int] | None = None) -> str:
    macros = {**defines_for(source, arch), **(defines or {})}
    ident = f"{source_hash(source)}|{arch}|{CXX_STD}|{sorted(macros.items())}|nvrtc{nvrtc_version()}"
    return hashlib.sha256(ident.encode()).hexdigest()[:24]


def cubin_path(source: str, arch: str, defines: dict[str, int] | None = None, cache: Path | None = None) -> Path:
    """Where the cubin of (source, arch, defines) is cached (it may not exist yet)."""
    cache = Path(cache) if cache is not None else cache_dir()
    return cache / f"{Path(source).stem}-{arch}-{cubin_key(source, arch, defines)}.cubin"


def kernel_jobs(archs=DEFAULT_ARCHS, latent: int = KIMI_LATENT,
                rope: int = KIMI_ROPE) -> list[tuple[str, str, dict[str, int] | None]]:
    """(source, arch, defines) of every cubin compile_all builds: LATENT_SOURCES at (latent, rope), the rest none."""
    dims = latent_defines(latent, rope)
    return [(src, arch, dims if src in LATENT_SOURCES else None) for src in SOURCES for arch in archs]


def compile_cubin(source: str, arch: str, defines: dict[str, int] | None = None,
                  cache: Path | None = None) -> Path:
    """Compile one kernel source for one arch (or reuse the cached cubin); returns the .cubin path.
    LATENT_SOURCES need latent_defines(...) among `defines` (checked here, before NVRTC)."""
    _check(source, arch)
    if source in LATENT_SOURCES:
        given = defines or {}
        if "MLA_DL" not in given or "MLA_DR" not in given:
            raise LatentDimsError(f"{source} compiles per model: pass defines=latent_defines(kv_lora_rank, "
                                  f"qk_rope_head_dim), got {given}")
        latent_defines(given["MLA_DL"], given["MLA_DR"])
    path = cubin_path(source, arch, defines, cache)
    if path.exists():
        return path
    with _compiling(path):          # a second thread asking for this cubin waits for the first's, not a 2nd NVRTC run
        if path.exists():
            return path
        _nvrtc_to(path, source, arch, defines)
    return path


_IN_FLIGHT: dict[Path, threading.Lock] = {}
_IN_FLIGHT_GUARD = threading.Lock()


def _compiling(path: Path) -> threading.Lock:
    """The lock of one cubin path in this process (gemm.cu alone is ~55 s of NVRTC on one core)."""
    with _IN_FLIGHT_GUARD:
        return _IN_FLIGHT.setdefault(path, threading.Lock())


def _nvrtc_to(path: Path, source: str, arch: str, defines: dict[str, int] | None) -> None:
    from cuda.core import Program  # cuda: the cuda extra
    log = []

    class _Log:
        def write(self, s):
            log.append(s)

    program = Program((KERNEL_DIR / source).read_text(), "c++", options=_options(source, arch, defines))
    try:
        code = program.compile("cubin", logs=_Log())
    except Exception as exc:   # NVRTC errors: show the log with the file name
        raise RuntimeError(f"NVRTC failed on {KERNEL_DIR / source} for {arch}:\n{''.join(log)}\n{exc}") from exc
    finally:
        program.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(bytes(code.code))
    tmp.replace(path)                       # atomic: concurrent compilers never see half a file


def compile_all(archs=DEFAULT_ARCHS, cache: Path | None = None, latent: int = KIMI_LATENT,
                rope: int = KIMI_ROPE) -> dict[tuple[str, str], Path]:
    """Every kernel source for every arch -> {(source, arch): cubin path}; LATENT_SOURCES at (latent, rope).
    One thread a compile, up to the CPU count (NVRTC runs outside the GIL: ddtree-build and the tests' first
    compile of everything take the longest source's time, not the sum)."""
    # cuda.core's __init__ copies its cu13 submodule's globals (__spec__ included) into itself, so a second
    # thread's `from cuda.core import Program` does not wait for a first thread's import to finish and sees a
    # half-built module (CI: "cannot import name 'Program' from 'cuda.core.cu13'"). Import once, here.
    import cuda.bindings.nvrtc  # noqa: F401
    import cuda.core  # noqa: F401
    jobs = kernel_jobs(archs, latent, rope)
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    notice = compile_notice(jobs, cache, workers)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        paths = pool.map(lambda job: compile_cubin(*job, cache=cache), jobs)
        return {(src, arch): path for (src, arch, _), path in zip(jobs, paths)}


COLD_COMPILE_S = 126        # every source for sm_90 + sm_120 from an empty cache, 2 CPU cores (issue 50's run)


def compile_notice(jobs, cache, workers: int) -> str | None:
    """The line a compile of `jobs` (kernel_jobs' triples) prints before it starts: how many miss the cache, where
    the cache is, and about how long the misses take (scaled from COLD_COMPILE_S; NVRTC threads run in parallel,
    the longest source bounds the time on many cores). None when every cubin is cached (nothing to wait for)."""
    cache = Path(cache) if cache is not None else cache_dir()
    missing = [job for job in jobs if not cubin_path(*job, cache=cache).exists()]
    if not missing:
        return None
    estimate = COLD_COMPILE_S * len(missing) / (2 * len(SOURCES))      # linear in the misses, same machine
    return (f"compiling {len(missing)} of {len(jobs)} kernels with NVRTC in {workers} threads: about "
            f"{max(5, round(estimate, -1)):.0f} s on 2 CPU cores ({COLD_COMPILE_S} s measured for all kernels of two "
            f"archs; more cores take less); cached in {cache} (DDTREE_KERNEL_CACHE) for the next build or load")
