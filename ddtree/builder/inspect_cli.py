"""`ddtree inspect DIR`: what an engine directory holds, and whether every file matches its manifest.

Prints the layout (model, drafter, tp, expert placement, archs and kernels, budgets, dtypes), the
size of each rank and of the kernels, then runs the checks of an engine's load (engine_dir.engine_problems:
config.json against its plan, the rank directories and the weights' headers) and re-hashes every file
against manifest.json. Any missing, unlisted, resized or altered file, or an edited config field, is named
and the command exits 1; a folder that is not an engine (a checkpoint) is refused, saying what an engine
directory holds. --json prints one object:
{"engine", "format", "ok", "problems", "tp", "experts", "archs", "budgets", "block_size", "model",
 "drafter", "ranks": [{"name", "files", "bytes"}], "kernels": {arch: {file: bytes}}, "files", "bytes",
 "plans": plans.json (TensorRT-RTX plans with every input and output) or null,
 "tuning": tuning.json's fields (engine_dir/tuning.py; machine-specific, for --budget auto) or null}.
An edited or invalid tuning.json is a problem; a missing one is not (the engine runs fixed budgets).
"""
from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

from ddtree.builder.trt_build import describe_plans, plan_lines
from ddtree.engine_dir import (
    PLANS,
    describe_tuning,
    engine_configs,
    engine_files,
    engine_problems,
    kernels_rel,
    rank_name,
    tuning_problems,
)
from ddtree.errors import reported
from ddtree.jsonout import emit_json


def describe(engine: Path, meta: dict) -> dict:
    cfg, dcfg = engine_configs(engine, meta)
    files = engine_files(engine)
    size = {rel: (engine / rel).stat().st_size for rel in files}
    ranks = []
    for r in range(int(meta["tp"])):
        mine = [rel for rel in files if rel.startswith(rank_name(r) + "/")]
        ranks.append({"name": rank_name(r), "files": len(mine), "bytes": sum(size[f] for f in mine)})
    kernels = {arch: {rel: size[rel] for rel in files if rel.startswith(kernels_rel(arch) + "/")}
               for arch in meta["archs"]}
    return {"engine": str(engine), "format": meta["format"], "tp": meta["tp"], "experts": meta["experts"],
            "archs": meta["archs"], "budgets": meta["budgets"], "block_size": meta["block_size"],
            "dtypes": meta.get("dtypes", {}),
            "model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
                      "routed_experts": cfg.n_routed_experts, "experts_per_token": cfg.num_experts_per_tok,
                      "vocab": cfg.vocab_size},
            "drafter": {"layers": dcfg.num_hidden_layers, "heads": dcfg.num_attention_heads,
                        "kv_heads": dcfg.num_key_value_heads, "block_size": dcfg.block_size,
                        "target_layer_ids": list(dcfg.target_layer_ids)},
            "plan": per_rank if isinstance(per_rank := meta["plan"].get("per_rank"), dict) else {},
            "ranks": ranks, "kernels": kernels,
            "files": len(files) + 1, "bytes": sum(size.values())}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@click.command("inspect", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("engine", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def inspect_command(engine, as_json):
    """Show an engine directory's layout and verify every file's sha256 against its manifest."""
    err = Console(stderr=True, highlight=False)
    with reported():
        meta, problems = engine_problems(engine)
        info = describe(engine, meta)
        damaged = {p.split(": ", 1)[0] for p in problems}
        info["plans"] = None if PLANS in damaged else describe_plans(engine)     # (named among the problems)
        tuning, bad_tuning = tuning_problems(engine)
        problems = problems + bad_tuning
    info["tuning"] = tuning.fields() if tuning else None
    info["ok"], info["problems"] = not problems, problems
    m, d = info["model"], info["drafter"]
    err.print(f"{engine}  ({info['format']}, {info['files']} files, {_mib(info['bytes'])})")
    err.print(f"  model    {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads, "
              f"{m['routed_experts']} experts (top {m['experts_per_token']}), vocab {m['vocab']}")
    err.print(f"  drafter  {d['layers']} layers, {d['heads']}/{d['kv_heads']} heads, block {d['block_size']}, "
              f"taps {d['target_layer_ids']}")
    err.print(f"  tp {info['tp']} (experts: {info['experts']}), budgets {info['budgets']}, block {info['block_size']}")
    err.print("  per rank " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in info["plan"].items()))
    for r in info["ranks"]:
        err.print(f"  {r['name']:<8} {r['files']} files, {_mib(r['bytes'])}")
    for arch, cubins in info["kernels"].items():
        err.print(f"  kernels/{arch}: {', '.join(Path(f).name for f in cubins) or 'none'} "
                  f"({_mib(sum(cubins.values()))})")
    for line in plan_lines(info["plans"]):
        err.print(line, markup=False)
    for line in describe_tuning(tuning) if tuning else ["  tuning   none (`ddtree tune` writes it for --budget auto)"]:
        err.print(line, markup=False)
    if problems:
        for p in problems:
            err.print(f"  [red]BAD[/red] {p}")
    else:
        err.print(f"  checksums: all {info['files'] - 1} files match manifest.json")
    if as_json:
        emit_json(info)
    if problems:
        raise click.ClickException(f"EngineFormatError: {engine}: {len(problems)} problem(s), the engine does not "
                                   "match its manifest or config.json: " + "; ".join(problems[:5]))
