"""`ddtree-build` (also `ddtree build`): checkpoint + DFlash drafter -> engine directory.

    ddtree-build --model DIR --drafter DIR --tp N --arch sm_120 [--arch sm_90] --out engines/NAME
                 [--budget 16,32,64] [--experts tp|ep] [--jobs N] [--trt | --no-graphs] [--force] [--json]
Progress (one line per stage with its elapsed time) goes to stderr; --json prints one summary
object on stdout: {"engine", "tp", "experts", "archs", "budgets", "files", "bytes", "weights_bytes",
"stages": {stage: seconds}, "peak_rss_mb", "plans"}. --trt adds SM120 TensorRT-RTX plans
(rank<r>/<kind>.plan, plans.json); without the 'trt' extra it fails naming what to install.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from ddtree.builder.build import DEFAULT_BUDGETS, build_engine
from ddtree.builder.plan import EXPERT_MODES
from ddtree.cli_types import QuietCommand, comma_list
from ddtree.errors import reported
from ddtree.jsonout import emit_json


class RichStages:
    """One progress row per stage: description, bar, percent, elapsed; '(x.x s)' when done."""

    def __init__(self, console: Console):
        self.progress = Progress(TextColumn("{task.description:<24}"), BarColumn(), TaskProgressColumn(),
                                 TimeElapsedColumn(), console=console)

    @contextmanager
    def stage(self, name: str, total: int | None = None):
        task = self.progress.add_task(name, total=total or None)
        t0 = time.perf_counter()
        ok = False
        try:
            yield lambda n=1: self.progress.advance(task, n)
            ok = True
        finally:
            mark = "done" if ok else "FAILED"
            self.progress.update(task, total=total or 1, completed=total or 1,
                                 description=f"{name} {mark} ({time.perf_counter() - t0:.1f} s)")
            self.progress.stop_task(task)


def parse_budgets(text: str) -> list[int]:
    return comma_list(text, "--budget", int)


@click.command("build", cls=QuietCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Kimi K2.x checkpoint directory (HF layout, INT4 experts).")
@click.option("--drafter", "drafter_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path), help="DFlash drafter directory.")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel ranks (1, 2, 4 or 8).")
@click.option("--arch", "archs", multiple=True,
              help="GPU architecture to compile kernels for (repeatable), e.g. sm_120, sm_90 (needs the 'cuda' "
                   "extra's NVRTC).")
@click.option("--no-kernels", is_flag=True,
              help="No kernels (no --arch, no NVRTC: the base install): an engine the CPU executors run; "
                   "--device cuda refuses it.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Engine directory to write.")
@click.option("--budget", "budgets", default=",".join(map(str, DEFAULT_BUDGETS)), show_default=True,
              help="Tree budgets the engine is built for (comma-separated).")
@click.option("--experts", type=click.Choice(EXPERT_MODES), default="tp", show_default=True,
              help="Routed experts: tp = split each expert's intermediate dim; ep = whole experts per rank.")
@click.option("--jobs", type=int, default=1, show_default=True,
              help="Worker processes for repacking the INT4 experts (each holds a few experts in memory).")
@click.option("--trt", is_flag=True,
              help="Also build SM120 TensorRT-RTX plans per rank and layer kind (needs the 'trt' extra).")
@click.option("--no-graphs", is_flag=True, help="Skip the per-rank ONNX graphs (graphs/); not with --trt.")
@click.option("--force", is_flag=True, help="Replace an existing engine directory at --out.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@reported()
def build_command(model_dir, drafter_dir, tp, archs, no_kernels, out, budgets, experts, jobs, trt, no_graphs, force,
                  as_json):
    """Build an engine directory from a Kimi K2.x checkpoint and a DFlash drafter."""
    console = Console(stderr=True)
    ui = RichStages(console)
    console.print(f"ddtree-build: {model_dir} + {drafter_dir} -> {out} (tp {tp}, experts {experts}, "
                  f"archs {', '.join(archs) or 'none (--no-kernels)'})")
    if trt and no_graphs:
        raise click.UsageError("--trt builds its plans from the graphs; drop --no-graphs")
    with ui.progress:
        summary = build_engine(model_dir, drafter_dir, tp, archs, out, parse_budgets(budgets), force, experts,
                               ui=ui, jobs=jobs, graphs=not no_graphs, trt=trt, kernels=not no_kernels)
    console.print(f"engine {summary['engine']}: {summary['files']} files, {summary['bytes'] / 2**20:.1f} MiB, "
                  f"peak RSS {summary['peak_rss_mb']:.0f} MiB")
    if as_json:
        emit_json(summary)
