"""`ddtree bench chain`: a layer's dense GEMMs as today's launches against one persistent launch whose weight
stream never waits (plugins/gemm_chain.py; issue 48, docs/performance.md section 5), on the same weights.

The chain is rank 0 of Kimi K2.6 at tp 8, one layer's dense weights (60.7 MB): q_a and kv_a over the layer input,
q_b over q_a's output, o_proj's 1024 inputs, the shared expert's gate_up and down (its first 256 channels: the
SwiGLU's arithmetic is not what is timed). `launches`: one skinny-GEMM launch an op (plugins/gemm.py, the plans
the step uses, programmatic dependent launch), in op order; `chain`: one gemm_chain launch, each op waiting only
for its own source. Method as `ddtree bench gemm`: weight copies together >= 4x the L2, launches captured in one
graph, median replay / launches; ideal = weight bytes / the copy ceiling measured first.
"""
from __future__ import annotations

import itertools

import click
import numpy as np

from ddtree.bench.kernels import _say, device_bf16_weight, open_gpu, time_graph
from ddtree.cli_types import comma_list
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.plugins import randfill
from ddtree.plugins.gemm import SkinnyGemm
from ddtree.plugins.gemm_chain import INPUT, ITEM_CHUNKS, MAX_MT, ChainGemm, GemmChain, weight_bytes

# name -> ChainGemm(N, K, src): one tp-8 rank's dense weights of a layer (bench/kernels.py GEMM_SHAPES[8])
KIMI_TP8_LAYER = {"q_a": ChainGemm(1536, 7168, INPUT), "kv_a": ChainGemm(576, 7168, INPUT),
                  "q_b": ChainGemm(1536, 1536, 0), "o_proj": ChainGemm(7168, 1024, 2),
                  "shared_gate_up": ChainGemm(512, 7168, 3), "shared_down": ChainGemm(7168, 256, 4)}


def chain_weights(gpu, ops: list[ChainGemm], copies: int, seed: int) -> list[list]:
    """copies x per-op tiled bf16 weights (tile_bf16 shape), filled on the device."""
    return [[device_bf16_weight(gpu, o.N, o.K, seed + 100 * c + i) for i, o in enumerate(ops)] for c in range(copies)]


def time_launches(gpu, ops: list[ChainGemm], weights: list[list], x, M: int) -> float:
    """us a chain as one skinny-GEMM launch an op; each op reads its own [M, K] rows (the launches run in
    stream order, so the sources add nothing to what is timed)."""
    gemms = [SkinnyGemm(gpu, o.N, o.K, 8 * MAX_MT) for o in ops]
    xs = [x if o.src == INPUT else gpu.zeros((8 * MAX_MT, o.K), np.uint16) for o in ops]
    outs = [gpu.zeros((8 * MAX_MT, o.N), np.uint16) for o in ops]

    def launches(s):
        for ws in weights:
            for g, xi, w, out in zip(gemms, xs, ws, outs):
                g.run(xi, w, out, M, stream=s)
    launches(None)
    gpu.sync()
    return time_graph(gpu, launches) * 1e3 / len(weights)


def time_chain(gpu, ops: list[ChainGemm], weights: list[list], x, M: int, item_chunks: float = ITEM_CHUNKS,
               stages: int | None = None, bulk: bool = False, warps: int | None = None) -> float:
    chains = [GemmChain(gpu, ops, item_chunks=item_chunks, stages=stages, bulk=bulk, warps=warps) for _ in weights]
    for ch, ws in zip(chains, weights):
        ch.bind(x, ws)

    def launches(s):
        for ch in chains:
            ch.run(M, stream=s)
    launches(None)
    gpu.sync()
    us = time_graph(gpu, launches) * 1e3 / len(weights)
    for ch in chains:
        ch.check()
    return us


@click.command("chain")
@click.option("--m", "m_list", default="1,9,17", show_default=True, help=f"token rows (1..{8 * MAX_MT})")
@click.option("--item-chunks", "item_chunks", default=str(ITEM_CHUNKS), show_default=True,
              help="the plan's fixed cost of an item in chunks (plugins/gemm_chain.py item_cost), a list to sweep")
@click.option("--stages", "stage_list", default="", help="ring stages a warp to sweep (default: the compiled depth)")
@click.option("--warps", "warp_list", default="", help="warps a block to sweep (default: the compiled count)")
@click.option("--copy", "copies_", default="cp.async", show_default=True,
              help="how a warp fills its ring: cp.async, bulk (one 2 KB bulk copy a stage), or both")
@click.option("--independent", is_flag=True, help="also time the chain with every op reading the input (no waits): "
              "what the kernel streams with no dependency")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
@reported()
def chain_command(m_list, item_chunks, stage_list, warp_list, copies_, independent, seed, as_json):
    """A layer's dense GEMMs: one launch an op against one persistent launch (Kimi K2.6, rank 0 of tp 8)."""
    ms = comma_list(m_list, "--m", int, 1, 8 * MAX_MT)
    costs = comma_list(item_chunks, "--item-chunks", float, 0.0, 64.0)
    stages = comma_list(stage_list, "--stages", int, 2, 64) if stage_list else [None]
    warps = comma_list(warp_list, "--warps", int, 1, 32) if warp_list else [None]
    fills = [c.strip() for c in copies_.split(",") if c.strip()]
    if not fills or set(fills) - {"cp.async", "bulk"}:
        raise click.BadParameter(f"{copies_!r}: expected cp.async, bulk or both", param_hint="--copy")
    gpu, ceiling = open_gpu()
    ops = list(KIMI_TP8_LAYER.values())
    wbytes = weight_bytes(ops)
    copies = max(2, -(-4 * gpu.l2_bytes // wbytes))
    weights = chain_weights(gpu, ops, copies, seed)
    x = gpu.alloc((8 * MAX_MT, ops[0].K), np.uint16)
    randfill.fill_device(gpu, x, seed + 7, randfill.ACT_BF16)
    ideal = wbytes / ceiling["gbps"] / 1e3
    rows = []
    for M in ms:
        row = {"M": M, "weight_mb": round(wbytes / 1e6, 2), "ideal_us": round(ideal, 2)}
        forms = [("launches", lambda: time_launches(gpu, ops, weights, x, M))]
        free = [ChainGemm(o.N, o.K, INPUT) for o in ops]
        for c, st, wp, fill in itertools.product(costs, stages, warps, fills):
            name = "chain" + (f"_item{c:g}" if len(costs) > 1 else "") + (f"_s{st}" if st else "") \
                + (f"_w{wp}" if wp else "") + ("_bulk" if fill == "bulk" else "")
            for suffix, chain_ops in (("", ops), ("_independent", free))[:2 if independent else 1]:
                forms.append((name + suffix, lambda c=c, st=st, wp=wp, fill=fill, chain_ops=chain_ops: time_chain(
                    gpu, chain_ops, weights, x, M, c, st, fill == "bulk", wp)))
        for form, timer in forms:
            us = timer()
            row[form] = {"us": round(us, 2), "pct_of_ceiling": round(100 * ideal / us, 1)}
        rows.append(row)
        said = (f"{f} {row[f]['us']:.2f} us ({row[f]['pct_of_ceiling']} %)" for f, _ in forms)
        _say(f"M={M:2d} (ideal {ideal:.2f} us): " + ", ".join(said))
    result = {"bench": "chain", "device": gpu.name, "item_chunks": costs,
              "copy_ceiling_gbps": round(ceiling["gbps"], 1),
              "ops": {k: {"N": o.N, "K": o.K, "src": o.src} for k, o in KIMI_TP8_LAYER.items()},
              "weight_copies": copies, "rows": rows}
    if as_json:
        emit_json(result)
