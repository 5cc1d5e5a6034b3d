"""`ddtree bench step --baseline DIR`: every row measured by another source tree first, then by this one, on the
same GPU in one run (issue 48: a change's before and after, part by part, from one call on one card).

DIR holds a `ddtree` package, e.g. `git archive REV ddtree | tar -x -C DIR`. The baseline runs as a subprocess
(`python -m ddtree bench step` from DIR, with the options this run was given that differ from their defaults) before
this run opens the GPU, so the two never hold the device's memory at once; each row of this run then carries the
baseline's step, roofline share and per-part time and overhead (`baseline`), and `speedup_vs_baseline`.

    args = baseline_args(click.get_current_context())        # ["--budget", "16", ...] (no --baseline, no --json)
    base = run_baseline(DIR, args)                           # the baseline's JSON result
    pair_rows(rows, base)                                    # rows gain "baseline" and "speedup_vs_baseline"
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

SKIP = ("baseline", "as_json", "timeline")   # this run's own: the baseline always answers in JSON, traces nothing


def check_baseline(path: str) -> Path:
    """DIR of --baseline: a directory holding a ddtree package."""
    d = Path(path)
    if not (d / "ddtree" / "__init__.py").is_file():
        raise click.BadParameter(f"{path}: expected a directory holding a ddtree package (e.g. `git archive REV "
                                 f"ddtree | tar -x -C {path}`), found no {d / 'ddtree' / '__init__.py'}",
                                 param_hint="--baseline")
    return d.resolve()


def baseline_args(ctx: click.Context) -> list[str]:
    """The command line of ctx's options that differ from their defaults (a baseline tree may lack newer options;
    left at their defaults they are not passed)."""
    args = []
    for p in ctx.command.params:
        if not isinstance(p, click.Option) or p.name in SKIP:
            continue
        value = ctx.params.get(p.name)
        if value is None or value == p.default:
            continue
        if p.is_flag:
            opts = p.opts if value else p.secondary_opts
            if not opts:
                continue
            args.append(opts[0])
        else:
            args += [p.opts[0], str(value)]
    return args


def run_baseline(tree: Path, args: list[str]) -> dict:
    """`python -m ddtree bench step ARGS --json` run from `tree` (its ddtree first on the path) -> its result."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    click.echo(f"baseline: {tree}: ddtree bench step {' '.join(args)}", err=True)
    done = subprocess.run([sys.executable, "-m", "ddtree", "bench", "step", *args, "--json"], cwd=tree, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"--baseline {tree}: its bench step exited {done.returncode}: "
                                   f"{done.stderr.strip()[-1500:]}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError as e:
        raise click.ClickException(f"--baseline {tree}: its bench step printed no JSON result ({e})") from e


def row_key(row: dict) -> tuple:
    return (row["context"], row["budget"], row["routing"], row.get("reuse"), row.get("collectives"),
            row.get("pruned") is not None)


def pair_rows(rows: list[dict], base: dict, device: str) -> None:
    """Each row of this run with the baseline's row of the same case: its step and per-part us / overhead beside
    this row's (and its target terms where the baseline's bench wrote them), and speedup_vs_baseline = the
    baseline's step / this one's. Refuses another device's baseline."""
    if base.get("device") != device:
        raise click.ClickException(f"--baseline ran on {base.get('device')!r}, this run on {device!r}: a before and "
                                   "after compare on one card")
    by_key = {row_key(r): r for r in base.get("rows", [])}
    for row in rows:
        b = by_key.get(row_key(row))
        if b is None:
            continue
        row["baseline"] = {"step_us": b["step_us"], "pct_roofline": b["pct_roofline"], "kernels": b["kernels"],
                           "parts": {k: {"us": v["us"], "overhead_us": v["overhead_us"]}
                                     for k, v in b["parts"].items()},
                           **{k: b[k] for k in ("overhead_us_per_layer", "dense_x_ideal") if k in b}}
        row["speedup_vs_baseline"] = b["step_us"] / row["step_us"]
        click.echo(f"context {row['context']}, budget {row['budget']}, {row['routing']}"
                   f"{' pruned' if row.get('pruned') else ''}: {b['step_us']:.0f} -> {row['step_us']:.0f} us "
                   f"({row['speedup_vs_baseline']:.3f}x the baseline)", err=True)
