"""`build_engine`: a Kimi K2.x checkpoint + DFlash drafter -> an engine directory, in stages.

    check     read both configs, verify every tensor's dtype/shape, make the TP plan, check --arch,
              NVRTC, the output folder and the free disk, all before writing anything
    kernels   cubins for every --arch (plugins/compile.py, cached across builds)
    weights   rank<r>/*.safetensors streamed tensor by tensor (builder/weights.py)
    config    config.json and the tokenizer files
    graphs    per-rank ONNX graphs of every layer kind (graphs/; skipped with graphs=False)
    plans     with trt=True: SM120 TensorRT-RTX plans rank<r>/<kind>.plan + plans.json (builder/trt_build.py)
    manifest  size + sha256 of every file
The engine is built in a hidden folder next to --out and renamed into place only when complete.
With jobs > 1 the expert repacking runs in worker processes (builder/experts.py).
Progress goes to a `ui` object: `ui.stage(name, total)` is a context manager yielding `advance(n)`;
the default `Quiet` ui shows nothing. Memory: a few tensors (at most ~32 MB row blocks) at a time.
"""
from __future__ import annotations

import resource
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from ddtree import engine_dir
from ddtree.builder import output_dir as od
from ddtree.builder import trt_build
from ddtree.builder.plan import make_plan
from ddtree.builder.weights import rank_bytes, source_bytes, write_rank_weights
from ddtree.model.checkpoint import Checkpoint, DrafterCheckpoint
from ddtree.model.config import ConfigError
from ddtree.model.safetensors_io import CheckpointError
from ddtree.plugins import compile as kernel_compile
from ddtree.tree.build import MAX_BUDGET

DEFAULT_BUDGETS = (16, 32, 64)


class Quiet:
    @contextmanager
    def stage(self, name: str, total: int | None = None):
        yield lambda n=1: None


def check_budgets(budgets) -> list[int]:
    budgets = sorted(set(int(b) for b in budgets))
    bad = [b for b in budgets if not 1 <= b <= MAX_BUDGET]
    if not budgets or bad:
        raise od.BuildError(f"--budget: each budget must be in 1..{MAX_BUDGET}, got {bad or 'none'}")
    return budgets


def _open(reader, path, flag: str):
    """Open and verify a checkpoint (every tensor's dtype and shape against its config)."""
    try:
        ckpt = reader(path)
        ckpt.verify()
    except (ConfigError, CheckpointError) as e:
        raise od.BuildError(f"{flag} {path}: {e}") from e
    return ckpt


KERNELS_SKIPPED = "built with --no-kernels: no cubins; --device cpu runs it, --device cuda needs a build with --arch"


def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM where /proc exists (ru_maxrss would include the RSS of the
    process that spawned us, carried across exec), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # Linux reports KiB


def build_engine(model_dir, drafter_dir, tp: int, archs, out, budgets=DEFAULT_BUDGETS, force: bool = False,
                 experts: str = "tp", kernel_cache=None, ui=None, jobs: int = 1, graphs: bool = True,
                 trt: bool = False, kernels: bool = True) -> dict:
    """Build the engine at `out`; returns a summary (engine path, sizes, per-stage seconds).
    kernels=False (--no-kernels): no cubins and no NVRTC (the base install): "archs" is [] and config.json
    says "kernels_skipped", so the CPU executors run the engine and --device cuda refuses it by name.
    `jobs` worker processes repack the routed experts (1: all in this process). `graphs` exports the
    per-rank ONNX graphs (graphs/); `trt` also builds the SM120 TensorRT-RTX plans (builder/trt_build.py)."""
    ui = ui or Quiet()
    if jobs < 1:
        raise od.BuildError(f"--jobs {jobs}: must be >= 1")
    out = Path(out)
    stages: dict[str, float] = {}

    @contextmanager
    def stage(name, total=None):
        t0 = time.perf_counter()
        with ui.stage(name, total) as advance:
            yield advance
        stages[name] = round(time.perf_counter() - t0, 3)

    with stage("check"):
        if not kernels and archs:
            raise od.BuildError(f"--no-kernels: give no --arch (got {', '.join(archs)}); the engine gets no cubins")
        archs = od.check_archs(archs) if kernels else []
        budgets = check_budgets(budgets)
        od.check_out(out, force)
        ckpt = _open(Checkpoint, model_dir, "--model")
        dckpt = _open(DrafterCheckpoint, drafter_dir, "--drafter")
        dckpt.config.check_target(ckpt.config)
        plan = make_plan(ckpt.config, dckpt.config, tp, experts)
        tok_files = od.tokenizer_files(Path(model_dir), ckpt.config)
        nvrtc = od.require_nvrtc() if kernels else None
        kernel_compile.latent_defines(ckpt.config.kv_lora_rank, ckpt.config.qk_rope_head_dim)   # LatentDimsError
        if graphs or trt:
            trt_build.require_graphs()
        if trt:
            trt_build.require_trt()
        weights_bytes = tp * rank_bytes(plan)
        need = (weights_bytes + len(archs) * od.KERNEL_BYTES_ESTIMATE
                + sum(f.stat().st_size for f in tok_files) + (1 << 20))
        od.check_disk(out, need)
    stage_dir = od.staging_dir(out)
    try:
        cubins = {}
        if kernels:
            with stage("kernels", len(archs) * len(kernel_compile.SOURCES)) as advance:
                cubins = od.compile_kernels(archs, stage_dir, kernel_cache, on_done=lambda a, s: advance(1),
                                            latent=ckpt.config.kv_lora_rank, rope=ckpt.config.qk_rope_head_dim)
        with stage("weights", source_bytes(plan)) as advance:
            files = write_rank_weights(plan, ckpt, dckpt, stage_dir, progress=advance, jobs=jobs)
        with stage("config"):
            tok = od.copy_tokenizer(tok_files, stage_dir)
            sources = {"model": str(Path(model_dir).absolute()), "drafter": str(Path(drafter_dir).absolute()),
                       "nvrtc": nvrtc}
            fields = od.config_fields(ckpt.config, dckpt.config, plan.to_dict(), archs, budgets, files, cubins, tok,
                                      sources)
            if not kernels:
                fields["kernels_skipped"] = KERNELS_SKIPPED
            engine_dir.write_engine_config(stage_dir, fields)
        if graphs or trt:
            with stage("graphs", tp) as advance:
                trt_build.export_graphs(stage_dir, ckpt.config, dckpt.config, plan.to_dict(), files, budgets, advance)
        if trt:
            with stage("plans") as advance:
                plans = trt_build.build_plans(stage_dir, on_plan=lambda name: advance(1))
        with stage("manifest", None):
            manifest = engine_dir.write_manifest(stage_dir)
        od.move_into_place(stage_dir, out)
    except BaseException:
        shutil.rmtree(stage_dir, ignore_errors=True)
        raise
    finally:
        ckpt.close()
        dckpt.close()
    total = sum(f["size"] for f in manifest["files"].values())
    return {"engine": str(out), "kernels": "skipped" if not kernels else len(archs) * len(kernel_compile.SOURCES),
            "tp": tp, "experts": experts, "archs": archs, "budgets": budgets,
            "files": len(manifest["files"]) + 1, "bytes": total, "weights_bytes": weights_bytes,
            "stages": stages, "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
            "plans": len(plans["plans"]) if trt else 0}
