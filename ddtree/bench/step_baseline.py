"""`ddtree bench step --baseline DIR`: every row measured by another source tree first, then by this one, on the
same GPU in one run (issue 48: a change's before and after, part by part, from one call on one card).

DIR holds a `ddtree` package, e.g. `git archive REV ddtree | tar -x -C DIR`. The baseline runs as a subprocess
(`python -m ddtree bench step` from DIR, with the options this run was given that differ from their defaults) before
this run opens the GPU, so the two never hold the device's memory at once; each row of this run then carries the
baseline's step, roofline share and per-part time and overhead (`baseline`), and `speedup_vs_baseline`.

    args = baseline_args(click.get_current_context())        # ["--budget", "16", ...] (no --baseline, no --json)
    base = run_baseline(DIR, args)                           # the baseline's JSON result
    pair_rows(rows, base, device)                            # rows gain "baseline" and "speedup_vs_baseline"
    result = measure_around(DIR, args, variants)             # --baseline-around: baseline, --variant trees, this
                                                             # tree, baseline, each a subprocess, paired as above

Order: the baseline runs first, so a drift of the card over the call (clocks, temperature, what the first process
left in caches) counts against it. In the sixteenth session every A/B at AR came out 0.4-0.6 % in favour of the
second tree, changes large or small. --baseline-around runs the baseline again once this tree's rows are measured
and pairs each row with the mean of the baseline's two runs, keeping both (step_us_runs): the baseline's own drift
between them sizes the order effect in the same call. This tree's rows are then measured by a subprocess too
(measure_around), so no process holds device memory while another measures: the first H100 run, with this process
measuring its rows itself and freeing its allocations before the second baseline, left the baseline out of memory
(the 72 GiB rank fits an 80 GB card once; a context that has run the step keeps more than its allocations).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

# this run's own options: a baseline answers in JSON, traces nothing and runs once a call
SKIP = ("baseline", "baseline_around", "variants", "as_json", "timeline")


def check_baseline(path: str, flag: str = "--baseline") -> Path:
    """DIR of --baseline (or --variant): a directory holding a ddtree package."""
    d = Path(path)
    if not (d / "ddtree" / "__init__.py").is_file():
        raise click.BadParameter(f"{path}: expected a directory holding a ddtree package (e.g. `git archive REV "
                                 f"ddtree | tar -x -C {path}`), found no {d / 'ddtree' / '__init__.py'}",
                                 param_hint=flag)
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


THIS_TREE = Path(__file__).resolve().parents[2]     # the directory holding this ddtree package


def run_baseline(tree: Path, args: list[str], what: str = "baseline") -> dict:
    """`python -m ddtree bench step ARGS --json` run from `tree` (its ddtree first on the path) -> its result."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    click.echo(f"{what}: {tree}: ddtree bench step {' '.join(args)}", err=True)
    done = subprocess.run([sys.executable, "-m", "ddtree", "bench", "step", *args, "--json"], cwd=tree, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise click.ClickException(f"{what} {tree}: its bench step exited {done.returncode}: "
                                   f"{done.stderr.strip()[-1500:]}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError as e:
        raise click.ClickException(f"{what} {tree}: its bench step printed no JSON result ({e})") from e


def row_key(row: dict) -> tuple:
    return (row["context"], row["budget"], row["routing"], row.get("reuse"), row.get("collectives"),
            row.get("pruned") is not None)


def around(before: dict, after: dict) -> dict:
    """The baseline measured before and after this tree (--baseline-around) as one result: each case both runs
    measured, its step, parts and per-layer terms the mean of the two, both steps kept (step_us_runs, in run order);
    the roofline share recomputed from the mean step (the ideal is the same bytes). Refuses two devices."""
    if before.get("device") != after.get("device"):
        raise click.ClickException(f"--baseline-around: the baseline ran on {before.get('device')!r}, then on "
                                   f"{after.get('device')!r}")
    later = {row_key(r): r for r in after.get("rows", [])}
    rows = []
    for b in before.get("rows", []):
        a = later.get(row_key(b))
        if a is None:
            continue
        step = (b["step_us"] + a["step_us"]) / 2
        parts = {k: {q: (v[q] + a["parts"][k][q]) / 2 for q in ("us", "overhead_us")}
                 for k, v in b["parts"].items() if k in a["parts"]}
        terms = {k: (b[k] + a[k]) / 2 for k in ("overhead_us_per_layer", "dense_x_ideal") if k in b and k in a}
        rows.append({**b, **terms, "step_us": step, "pct_roofline": b["pct_roofline"] * b["step_us"] / step,
                     "parts": parts, "step_us_runs": [b["step_us"], a["step_us"]]})
    return {**before, "rows": rows, "around": True}


def measure_around(baseline: Path, args: list[str], variants: tuple[Path, ...] = (), run=run_baseline) -> dict:
    """--baseline-around: the baseline, each --variant tree, this tree, the baseline again, each a subprocess given
    ARGS -> this tree's result with every row paired (pair_rows) with the mean of the baseline's two runs, and its
    `baseline` field; with variants, `variants`: per tree its dir and rows, paired the same way (one call compares
    several candidates against one baseline: a candidate costs one run, where a call each would cost three)."""
    first = run(baseline, args)
    others = [(tree, run(tree, args, "variant")) for tree in variants]
    result = run(THIS_TREE, args, "this tree")
    base = around(first, run(baseline, args))
    for tree, other in others:
        click.echo(f"variant {tree}:", err=True)
        pair_rows(other["rows"], base, other["device"])
    click.echo("this tree:", err=True)
    pair_rows(result["rows"], base, result["device"])
    result["baseline"] = baseline_field(baseline, base)
    if others:
        result["variants"] = [{"dir": str(tree), "rows": other["rows"]} for tree, other in others]
    return result


def baseline_field(tree: Path, base: dict) -> dict:
    """The result's top-level `baseline`: where it came from and on what, and whether it ran around this tree."""
    return {"dir": str(tree), "device": base["device"], "copy_ceiling_gbps": base["copy_ceiling_gbps"],
            "around": bool(base.get("around"))}


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
                           **{k: b[k] for k in ("overhead_us_per_layer", "dense_x_ideal", "step_us_runs") if k in b}}
        row["speedup_vs_baseline"] = b["step_us"] / row["step_us"]
        runs = b.get("step_us_runs")
        drift = "" if runs is None else (f"; the baseline {runs[0]:.0f} before, {runs[1]:.0f} after "
                                         f"({runs[0] / runs[1]:.3f}x its first run)")
        click.echo(f"context {row['context']}, budget {row['budget']}, {row['routing']}"
                   f"{' pruned' if row.get('pruned') else ''}: {b['step_us']:.0f} -> {row['step_us']:.0f} us "
                   f"({row['speedup_vs_baseline']:.3f}x the baseline{drift})", err=True)
