"""`ddtree bench attention`: tree-masked MLA attention latency, bandwidth and TFLOP/s per
(context, q, heads) (docs/interfaces.md section 7).

Method: caches filled on the device (ddtree.plugins.randfill), enough distinct caches that together they
are >= 4x the L2 (one, when a single cache already is); R = max(--launches, caches) launches, each on the
next cache (so every cache is read once per replay), captured in one CUDA graph and replayed between CUDA
events; latency = median replay time / R. The tree is a random
recursive tree of q nodes. Bytes = the keys read once ((T + q) x 1152 B) plus queries in and outputs out;
FLOPs = 2 x q x heads x (T + q) x (576 + 512) (every key of every row, as dense attention would).
The bandwidth ceiling is a plain device-to-device copy (read + write) outside graph capture; the compute
peak is the device's dense bf16 tensor rate from a table (null for devices not in it).
Sweeps: --form / --warps / --stages / --splits / --row-groups force the plan (comma lists: every
combination that compiles and fits is run, the others are named on stderr); --form tree_qreg forces the
tree form that holds the query fragments in registers (the default only where plan_attention's
qreg_default says). --parts adds the split kernel alone and the combine alone, each timed the same way
(where the time of a launch goes).
PDL: every launch of the graph (split kernel, combine, the next call's split kernel, ..) is a programmatic
dependent launch, as in the step's graphs (each kernel's blocks start while the one before drains and wait
at griddepcontrol.wait), so a call is measured behind another kernel; --no-pdl times plain stream order
(each launch waits for the previous kernel's end: the launch gap is paid).
"""
from __future__ import annotations

import itertools
import math

import click
import numpy as np

from ddtree.bench.kernels import _ints, _say, open_gpu, time_graph
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.model.presets import get_preset
from ddtree.plugins import randfill
from ddtree.plugins.mla_attention import MlaTreeAttention
from ddtree.tree.build import pack_visibility

DENSE_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "RTX PRO 6000": 503.8}


def kimi_softmax_scale() -> float:
    """The real model's softmax scale (192^-1/2 with the YaRN mscale), from the kimi-k2.6 preset config."""
    return get_preset("kimi-k2.6", layers=2)[0].softmax_scale


def dense_peak(device_name: str) -> float | None:
    return next((v for k, v in DENSE_BF16_TFLOPS.items() if k in device_name), None)


def tree_visibility(q: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    vis = np.zeros((q, q), dtype=bool)
    for i in range(q):
        if i:
            vis[i] = vis[rng.integers(0, i)]
        vis[i, i] = True
    return pack_visibility(vis)


def bench_case(gpu, T: int, q: int, heads: int, launches: int, ceiling_gbps: float, forced: dict,
               l2_resident: bool = False, parts: bool = False, pdl: bool = True) -> dict:
    entry_bytes = 576 * 2
    cache_bytes = (T + q) * entry_bytes
    copies = 1 if l2_resident else max(1, math.ceil(4 * gpu.l2_bytes / cache_bytes))
    caches = [gpu.alloc((T + q, 576), np.uint16) for _ in range(copies)]
    for i, c in enumerate(caches):
        randfill.fill_device(gpu, c, 100 + i, randfill.ACT_BF16)
    q_lat = gpu.alloc((q, heads, 512), np.uint16)
    q_rope = gpu.alloc((q, heads, 64), np.uint16)
    randfill.fill_device(gpu, q_lat, 1, randfill.WEIGHT_BF16)
    randfill.fill_device(gpu, q_rope, 2, randfill.WEIGHT_BF16)
    vis = gpu.upload(tree_visibility(q, T + q))
    lengths = gpu.upload(np.array([T], np.int32))
    out = gpu.alloc((q, heads, 512), np.uint16)
    attn = MlaTreeAttention(gpu, heads, kimi_softmax_scale(), latent=512, rope=64, max_q=q, max_context=max(T, 1),
                            pdl=pdl)
    plan = attn.override(q, T, **forced) if forced else attn.plan(q, T)
    launches = max(launches, copies)

    def launch_all(stream):
        for r in range(launches):
            attn.run(q_lat, q_rope, caches[r % copies], vis, lengths, q, out, context_hint=T, stream=stream)

    us = time_graph(gpu, launch_all) * 1e3 / launches
    split_us = combine_us = None
    if parts:
        p = attn.checked_plan(q, T)

        def splits_only(stream):
            for r in range(launches):
                attn.launch_splits(p, q_lat, q_rope, caches[r % copies], vis, lengths, q, out, stream=stream)

        def combine_only(stream):
            for _ in range(launches):
                attn.launch_combine(p, q, out, stream=stream)

        split_us = round(time_graph(gpu, splits_only) * 1e3 / launches, 2)
        combine_us = round(time_graph(gpu, combine_only) * 1e3 / launches, 2) if p.splits > 1 else 0.0
    nbytes = cache_bytes + q * heads * (576 + 512) * 2
    flops = 2.0 * q * heads * (T + q) * (576 + 512)
    gbps = nbytes / us / 1e3
    row = {"context": T, "q": q, "heads": heads, "latency_us": round(us, 2), "touched_mb": round(nbytes / 1e6, 3),
           "ideal_us": round(nbytes / ceiling_gbps / 1e3, 2), "gbps": round(gbps, 1),
           "pct_of_ceiling": round(100 * gbps / ceiling_gbps, 1), "tflops": round(flops / us / 1e6, 1),
           "plan": {"form": plan.form, "warps": plan.warps, "stages": plan.stages, "row_groups": plan.row_groups,
                    "row_tiles": plan.row_tiles,
                    "prefix_splits": plan.prefix_splits, "tree_own": plan.tree_own},
           "caches": copies, "launches": launches, "pdl": attn.pdl}
    if parts:
        row["split_us"], row["combine_us"] = split_us, combine_us
    peak = dense_peak(gpu.name)
    row["pct_of_dense_bf16"] = round(100 * row["tflops"] / peak, 1) if peak else None
    gpu.free_all()
    return row


@click.command("attention")
@click.option("--context", "contexts", default="4096,32768,131072", show_default=True,
              help="committed prefix lengths T (comma-separated)")
@click.option("--q", "qs", default="1,8,16,64,256", show_default=True, help="new tokens per call (tree nodes)")
@click.option("--heads", "heads_list", default="8,64", show_default=True, help="query heads (8 = one TP8 rank)")
@click.option("--launches", default=8, show_default=True,
              help="launches per captured graph (at least one per distinct cache)")
@click.option("--form", type=click.Choice(["tree", "decode", "tree_qreg", "tree_wgmma"]), default=None,
              help="force the kernel form (sweeps; tree_qreg: the tree form with the query fragments in registers; "
                   "tree_wgmma: sm_90 only, warpgroup MMA)")
@click.option("--warps", default=None, help="force warps per block (sweeps; a comma list runs each)")
@click.option("--stages", default=None, help="force the key-ring depth (sweeps; a comma list runs each)")
@click.option("--splits", default=None, help="force the number of prefix splits (sweeps; a comma list runs each)")
@click.option("--row-groups", default=None, help="force 8-row groups per block (sweeps; a comma list runs each)")
@click.option("--parts", is_flag=True, help="also time the split kernel alone and the combine alone")
@click.option("--pdl/--no-pdl", default=True, show_default=True,
              help="programmatic dependent launches, as the step's graphs run them (--no-pdl: plain stream order)")
@click.option("--l2-resident", is_flag=True,
              help="diagnosis: one cache, re-read by every launch (served from L2 when it fits): the kernel's "
                   "compute-side rate, not a bandwidth result")
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
@reported()
def attention_command(contexts, qs, heads_list, launches, form, warps, stages, splits, row_groups, parts, pdl,
                      l2_resident, as_json):
    """Tree-masked MLA attention (absorbed, 576-d keys, 512-d values) vs the copy ceiling and bf16 peak."""
    contexts, qs, heads_list = _ints(contexts), _ints(qs), _ints(heads_list)
    knobs = {k: _ints(v) if v is not None else [None] for k, v in
             (("warps", warps), ("stages", stages), ("splits", splits), ("row_groups", row_groups))}
    sweeps = [{"form": form, **dict(zip(knobs, combo))} for combo in itertools.product(*knobs.values())]
    sweeps = [{k: v for k, v in f.items() if v is not None} for f in sweeps]
    gpu, ceiling = open_gpu()
    _say(f"{gpu.name}: dense bf16 peak {dense_peak(gpu.name)} TFLOP/s")
    rows = []
    for heads in heads_list:
        for T in contexts:
            for q in qs:
                for forced in sweeps:
                    try:
                        row = bench_case(gpu, T, q, heads, launches, ceiling["gbps"], forced, l2_resident, parts, pdl)
                    except ValueError as e:                   # a forced combination not compiled or too big
                        gpu.free_all()
                        _say(f"H {heads:3d} T {T:6d} q {q:3d} {forced}: skipped: {e}")
                        continue
                    rows.append(row)
                    extra = f"  split {row['split_us']} + combine {row['combine_us']} us" if parts else ""
                    _say(f"H {heads:3d} T {T:6d} q {q:3d}: {row['latency_us']:9.2f} us  {row['gbps']:7.1f} GB/s "
                         f"({row['pct_of_ceiling']:5.1f} %)  {row['tflops']:6.1f} TFLOP/s  plan {row['plan']}{extra}")
    result = {"bench": "attention", "device": gpu.name, "l2_resident": l2_resident, "rows": rows,
              "ceiling": {**ceiling, "dense_bf16_tflops": dense_peak(gpu.name)}}
    if as_json:
        emit_json(result)
