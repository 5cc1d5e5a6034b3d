"""`ddtree bench tree`: GPU tree build + acceptance walk latency per budget B, vocab V and sampling mode.

One DDTree step's tree work: drafter logits [D, V] -> tree (DraftTreeBuilder: 3 launches) and target
logits [B + 1, V] -> the target's token at every node + walk (TreeSampler: 2 launches). Method: logits
written once per buffer, enough buffers that together they are >= 4x the L2 (so they come from HBM, as
after a real lm_head of this size they would mostly have to); R steps captured in one CUDA graph, each on
the next buffer, replayed between CUDA events; latency = median replay / R. Reported: build alone, walk
alone, and build + walk together (the issue's target: greedy <= 30 us, top-p <= 100 us at B 64, V 163840).
Logits are LM-like ("peaked": a normal floor plus ~20 strong tokens per row) unless --flat (standard
normal: top-p then keeps most of the row); `full_row_rows` counts the rows of one step that kept more than
256 tokens (the rows the candidate path could not decide before issue 23), `inexact_rows` the top-p rows
flagged as not certified (kernels/sample_top_p.cu).
The time to read the step's logits once at the copy ceiling is given per row (`read_once_us`).
"""
from __future__ import annotations

import math

import click
import numpy as np

from ddtree.bench.kernels import _ints, _say, open_gpu, time_graph
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.plugins.tree_build import DraftTreeBuilder
from ddtree.plugins.tree_sample import TreeSampler
from ddtree.tree.sampling import SamplingParams

MODES = {"greedy": SamplingParams(),
         "t1": SamplingParams(temperature=1.0, seed=1),
         "top_p0.95": SamplingParams(temperature=1.0, top_p=0.95, seed=1),
         "top_k50_top_p0.9": SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=1)}


def lm_logits(rng, rows: int, V: int, flat: bool) -> np.ndarray:
    x = rng.standard_normal((rows, V), dtype=np.float32)
    if flat:
        return x
    x *= 2
    strong = rng.integers(0, V, size=(rows, 20))
    np.put_along_axis(x, strong, np.take_along_axis(x, strong, axis=1)
                      + rng.uniform(6, 14, size=(rows, 20)).astype(np.float32), axis=1)
    return x


def bench_case(gpu, V: int, B: int, D: int, modes: list[str], launches: int, flat: bool, ceiling_gbps: float,
               candidates: bool | None = None) -> list:
    rng = np.random.default_rng(V + B)
    n = B + 1
    step_bytes = (D + n) * V * 4
    copies = max(1, math.ceil(4 * gpu.l2_bytes / step_bytes))
    draft_host, target_host = lm_logits(rng, D, V, flat), lm_logits(rng, n, V, flat)
    drafts = [gpu.upload(draft_host) for _ in range(copies)]
    targets = [gpu.upload(target_host) for _ in range(copies)]
    root, start = gpu.upload(np.array([1], np.int32)), gpu.upload(np.array([4096], np.int32))
    builder = DraftTreeBuilder(gpu, vocab=V, depth=D, max_budget=B, candidates=candidates)
    sampler = TreeSampler(gpu, vocab=V, max_rows=n)
    steps = max(launches, copies)
    tree = builder.outputs(B)

    def build_all(stream):
        for r in range(steps):
            builder.run(drafts[r % copies], root, start, B, stream=stream)

    build_us = time_graph(gpu, build_all) * 1e3 / steps
    rows = []
    for mode in modes:
        params = MODES[mode]
        plan = sampler.set_params(params)           # the graphs read the parameters from the device record

        def walk_all(stream):
            for r in range(steps):
                sampler.launch(plan, targets[r % copies], tree.positions, n, tree=tree, stream=stream)

        def step_all(stream):
            for r in range(steps):
                t = builder.run(drafts[r % copies], root, start, B, stream=stream)
                sampler.launch(plan, targets[r % copies], t.positions, n, tree=t, stream=stream)

        before = int(sampler.full_row_rows.numpy()[0])
        flagged = int(sampler.inexact_rows.numpy()[0])
        sampler.run(targets[0], tree.positions, params, n, tree=tree)
        full_rows = int(sampler.full_row_rows.numpy()[0]) - before
        flagged = int(sampler.inexact_rows.numpy()[0]) - flagged
        walk_us = time_graph(gpu, walk_all) * 1e3 / steps
        total_us = time_graph(gpu, step_all) * 1e3 / steps
        rows.append({"vocab": V, "budget": B, "depth": D, "mode": mode, "logits": "flat" if flat else "peaked",
                     "tree_build": "candidates" if builder.candidates.entries(B) else "pops",
                     "build_us": round(build_us, 2), "walk_us": round(walk_us, 2), "total_us": round(total_us, 2),
                     "read_once_us": round(step_bytes / ceiling_gbps / 1e3, 2), "full_row_rows": full_rows, "inexact_rows": flagged,
                     "buffers": copies, "steps": steps})
    builder.check_status()
    sampler.check_status(allow_inexact=True)        # reported per row above
    gpu.free_all()
    return rows


@click.command("tree")
@click.option("--vocab", "vocabs", default="163840", show_default=True, help="vocabulary sizes V (comma-separated)")
@click.option("--budget", "budgets", default="16,64,255", show_default=True, help="tree budgets B")
@click.option("--depth", default=7, show_default=True, help="tree depth D (drafter block size - 1)")
@click.option("--mode", "modes", default=",".join(MODES), show_default=True,
              help=f"sampling modes, comma-separated, from {', '.join(MODES)}")
@click.option("--launches", default=8, show_default=True, help="steps per captured graph (at least one per buffer)")
@click.option("--flat", is_flag=True, help="standard-normal logits (top-p keeps most of the vocab: full-row path)")
@click.option("--build", "builds", default="auto", show_default=True,
              help="tree build, comma-separated: auto (the builder's choice), candidates (the candidate table's "
                   "top-B wherever it fits), pops (always the best-first pops on one warp)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
@reported()
def tree_command(vocabs, budgets, depth, modes, launches, flat, builds, as_json):
    """DDTree tree build (top-k + best-first) and acceptance walk (sampling at every node) on the GPU."""
    modes = [m for m in modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise click.BadParameter(f"unknown mode(s) {unknown}; choose from {list(MODES)}", param_hint="--mode")
    builds = [b for b in builds.split(",") if b]
    if not builds or set(builds) - {"auto", "candidates", "pops"}:
        raise click.BadParameter(f"got {builds}; choose from auto, candidates, pops", param_hint="--build")
    gpu, ceiling = open_gpu()
    rows = []
    for V in _ints(vocabs):
        for B, build in ((B, b) for B in _ints(budgets) for b in builds):
            for row in bench_case(gpu, V, B, depth, modes, launches, flat, ceiling["gbps"],
                                  {"auto": None, "candidates": True, "pops": False}[build]):
                rows.append(row)
                _say(f"V {V:6d} B {B:3d} {row['mode']:>17s} {row['tree_build']:>10s}: build {row['build_us']:7.2f} us  walk "
                     f"{row['walk_us']:7.2f} us  together {row['total_us']:7.2f} us  (logits once: "
                     f"{row['read_once_us']:.2f} us)")
    result = {"bench": "tree", "device": gpu.name, "rows": rows, "ceiling": ceiling}
    if as_json:
        emit_json(result)
