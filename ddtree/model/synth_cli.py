"""`ddtree synth`: write a synthetic target + drafter checkpoint in the real formats."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import click
from rich.console import Console

from ddtree.cli_types import FiniteFloatRange
from ddtree.errors import ResourceError, available_memory, reported
from ddtree.jsonout import emit_json
from ddtree.model.presets import PRESETS, PresetError
from ddtree.model.synthetic import estimate
from ddtree.model.synthetic import synth as synth_checkpoint


def check_resources(out_dir: Path, disk: int, memory: int) -> None:
    """Before anything is built or written: the free disk under OUT (its nearest existing folder) and the
    available memory, each against synth's estimate; a ResourceError naming both numbers if short."""
    existing = out_dir.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if disk * 1.05 > free:
        raise ResourceError(f"--out {out_dir}: the checkpoint needs {disk / 2**30:.2f} GiB of disk, "
                            f"{existing} has {free / 2**30:.2f} GiB free")
    avail = available_memory()
    if avail is not None and memory > avail:
        raise ResourceError(f"synth's table of tensors needs {memory / 2**30:.2f} GiB of memory, "
                            f"{avail / 2**30:.2f} GiB is available (fewer --layers)")
    out_dir.mkdir(parents=True, exist_ok=True)


@click.command("synth")
@click.option("--preset", required=True, type=click.Choice(PRESETS), help="Model shape.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Writes OUT/target (HF checkpoint) and OUT/drafter (DFlash).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the random weights.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Target decoder layers (required for kimi-k2.6).")
@click.option("--layout", type=click.Choice(["k2.6", "k2-thinking"]), default="k2.6", show_default=True,
              help="k2.6: text_config + language_model. prefix; k2-thinking: flat, model. prefix.")
@click.option("--shard-mb", type=FiniteFloatRange(min=0.001), default=4096, show_default=True,
              help="Maximum shard size in MiB (a larger single tensor gets its own shard).")
@click.option("--force", is_flag=True, help="Overwrite OUT/target and OUT/drafter if they exist.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
@reported()
def synth(preset, out_dir, seed, layers, layout, shard_mb, force, as_json):
    """Write a synthetic Kimi K2.x checkpoint and DFlash drafter with seeded random weights."""
    err = Console(stderr=True)
    try:
        need, memory = estimate(preset, layers)
    except PresetError as e:
        raise click.BadParameter(str(e), param_hint="--layers" if "layers" in str(e) else "--preset")
    check_resources(out_dir, need, memory)
    err.print(f"synth {preset} -> {out_dir} ({need / 2**20:.1f} MiB, layout {layout})")
    t0 = time.perf_counter()
    with err.status("writing shards...") as status:
        def progress(i, n, fname):
            status.update(f"wrote {fname} ({i}/{n}) after {time.perf_counter() - t0:.1f}s")
        try:
            target, drafter = synth_checkpoint(out_dir, preset, seed=seed, layers=layers, layout=layout,
                                               shard_mb=shard_mb, force=force, progress=progress)
        except FileExistsError as e:
            raise click.ClickException(str(e))
    wall = time.perf_counter() - t0
    result = {"preset": preset, "layout": layout, "seed": seed, "target": str(target),
              "drafter": str(drafter), "bytes": need, "wall_s": round(wall, 3)}
    err.print(f"done in {wall:.1f}s: {target}, {drafter}")
    if as_json:
        emit_json(result)
