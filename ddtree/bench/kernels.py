"""`ddtree bench moe` and `ddtree bench gemm`: kernel latency and bandwidth against the copy ceiling
(docs/interfaces.md section 7).

Method: weights filled on the device (ddtree.plugins.randfill), enough distinct copies that together
they are >= 4x the L2; R launches, each on the next weights copy (GEMM) or with its own uniform random
top-8 routing (MoE, seeded), are captured in one CUDA graph; the graph is warmed, then replayed between
CUDA events; latency = median replay time / R. Achieved bandwidth counts the bytes a launch must touch
(distinct experts' INT4 weights and scales, or the bf16 weight, plus activations in and out). The
ceiling is a plain device-to-device copy of >= 4 GB (read + write) outside graph capture.
"""
from __future__ import annotations

import statistics

import click
import numpy as np

from ddtree.bench.project import DraftProfile
from ddtree.bench.routing import tree_ids
from ddtree.cli_types import FiniteFloatRange, comma_list
from ddtree.errors import reported
from ddtree.jsonout import emit_json
from ddtree.plugins import randfill
from ddtree.plugins.device import Gpu
from ddtree.plugins.gemm import SkinnyGemm
from ddtree.plugins.moe import FusedMoE, MoEShape

TP_SHAPES = {1: dict(inter=2048), 8: dict(inter=256)}
HIDDEN, EXPERTS, TOPK, VOCAB = 7168, 384, 8, 163840
# (name, N, K, residual epilogue) per tensor-parallel degree; TP8 rows are one rank's slice
GEMM_SHAPES = {
    1: [("q_a", 1536, 7168, False), ("kv_a", 576, 7168, False), ("q_b", 12288, 1536, False),
        ("o_proj", 7168, 8192, True), ("shared_gate_up", 4096, 7168, False), ("shared_down", 7168, 2048, True),
        ("dense_gate_up", 36864, 7168, False), ("dense_down", 7168, 18432, True), ("router", 384, 7168, False),
        ("lm_head", VOCAB, 7168, False)],
    8: [("q_a", 1536, 7168, False), ("q_b", 1536, 1536, False), ("kv_b", 2048, 512, False),
        ("o_proj", 7168, 1024, True), ("shared_gate_up", 512, 7168, False), ("shared_down", 7168, 256, True),
        ("dense_gate_up", 4608, 7168, False), ("dense_down", 7168, 2304, True), ("router", 384, 7168, False),
        ("lm_head", VOCAB // 8, 7168, False)],
}


def _ints(text: str) -> list[int]:
    return comma_list(text, None, int)


def _ring(text: str | None) -> tuple | None:
    if not text:
        return None
    try:
        slots, chunks = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise click.BadParameter(f"expected SLOTSxCHUNKS like 8x1, got {text!r}")
    return slots, chunks


def _say(msg: str) -> None:
    click.echo(msg, err=True)


def measure_ceiling(gpu, nbytes: int = 2 << 30, repeats: int = 5) -> dict:
    """D2D copy of nbytes (2 * nbytes moved), median of `repeats` after a warm-up."""
    src, dst = gpu.alloc(nbytes, np.uint8), gpu.alloc(nbytes, np.uint8)
    gpu.memset(src, 1)
    gpu.copy_d2d(dst.ptr, src.ptr, nbytes)
    ms = statistics.median(gpu.timed_ms(lambda: gpu.copy_d2d(dst.ptr, src.ptr, nbytes), repeats))
    return {"bytes_moved": 2 * nbytes, "ms": ms, "gbps": 2 * nbytes / ms / 1e6}


def open_gpu():
    """The device and its copy ceiling, measured first while nothing else is allocated (said on stderr)."""
    try:
        from cuda.pathfinder import DynamicLibNotFoundError  # cuda: the cuda extra
    except ImportError as e:
        raise click.ClickException(f"this benchmark runs on an NVIDIA GPU and needs the 'cuda' extra "
                                   f"(pip install -e '.[cuda]'): {e}") from e
    try:
        gpu = Gpu()
    except DynamicLibNotFoundError as e:               # cuda-python installed, no NVIDIA driver on this machine
        raise click.ClickException(f"this benchmark runs on an NVIDIA GPU: {e}") from e
    ceiling = measure_ceiling(gpu)
    gpu.free_all()
    _say(f"{gpu.name}: copy ceiling {ceiling['gbps']:.0f} GB/s")
    return gpu, ceiling


def time_graph(gpu, launches, replays: int = 7) -> float:
    """Capture launches(stream) in a graph; median ms per replay after two warm replays."""
    graph = gpu.capture(launches)
    for _ in range(2):
        gpu.replay(graph)
    gpu.sync()
    return statistics.median(gpu.timed_ms(lambda: gpu.replay(graph), replays))


def _row(extra: dict, nbytes: float, us: float, ceiling_gbps: float) -> dict:
    gbps = nbytes / us / 1e3
    return {**extra, "latency_us": round(us, 2), "touched_mb": round(nbytes / 1e6, 3),
            "ideal_us": round(nbytes / ceiling_gbps / 1e3, 2), "gbps": round(gbps, 1),
            "pct_of_ceiling": round(100 * gbps / ceiling_gbps, 1)}


def moe_weight_shapes(E: int, H: int, I: int) -> dict[str, tuple[tuple, type]]:
    """The stacked routed experts of one layer in the kernel layout (gate/up fused): name -> (shape, dtype)."""
    return {"gate_up": ((E, I // 16, H // 64, 2, 32, 4), np.int32),
            "gate_up_scale": ((E, I // 16, H // 64, 2, 8, 4), np.uint16),
            "down": ((E, H // 32, I // 64, 2, 32, 4), np.int32),
            "down_scale": ((E, H // 32, I // 64, 2, 8, 4), np.uint16)}


def moe_touched_bytes(distinct: float, expert_bytes: float, M: int, H: int) -> float:
    """Bytes one MoE launch moves: the distinct experts' weights, x [M, H] in and y [M, H] out (bf16)."""
    return distinct * expert_bytes + 2 * M * H * 2


# (FusedMoE.streaming, FusedMoE.down_cols) per --paths name: the plan's choice, the two launches with moe_down, the
# streaming launch, the two launches with moe_down_cols (plugins/moe_down_cols.py)
MOE_PATHS = {"auto": (None, None), "two-kernel": (False, False), "stream": (True, None), "cols": (False, True)}
DRAFT_DEPTHS = 7                   # Kimi K2.6's drafter block_size - 1: the depths of bench step's stated tree


def moe_routing_ids(rng, M: int, routing: str, reuse: float) -> np.ndarray:
    """[M, TOPK] int32 ids of one launch: 'uniform' (top-8 of E at random per token) or 'tree' (bench/routing.py
    tree_ids on bench step's stated tree of M nodes, DraftProfile().tree(M - 1): a node's experts reuse its
    parent's with probability `reuse`, so fewer distinct experts with more rows each)."""
    if routing == "uniform":
        return np.stack([rng.permutation(EXPERTS)[:TOPK] for _ in range(M)]).astype(np.int32)
    parents = DraftProfile().tree(M - 1, DRAFT_DEPTHS).parents if M > 1 else np.array([-1])
    return tree_ids(rng, parents, EXPERTS, TOPK, reuse)


def moe_operands(gpu, tp: int, max_m: int, seed: int) -> tuple:
    """(shape, weights, x, out, expert_bytes) of Kimi's routed experts at tp: random INT4 words and bf16 scales
    (seed + i in moe_weight_shapes' order), x [max_m, H] random (seed + 8), out [max_m, H], the bytes of one
    expert's slices."""
    inter = TP_SHAPES[tp]["inter"]
    shape = MoEShape(HIDDEN, inter, EXPERTS, TOPK, scaling=2.827, max_tokens=max_m)
    weights = {k: gpu.alloc(s, dtype) for k, (s, dtype) in moe_weight_shapes(EXPERTS, HIDDEN, inter).items()}
    for i, (key, arr) in enumerate(weights.items()):
        randfill.fill_device(gpu, arr, seed + i, randfill.SCALES_BF16 if "scale" in key else randfill.INT4_WORDS)
    x = gpu.alloc((max_m, HIDDEN), np.uint16)
    randfill.fill_device(gpu, x, seed + 8, randfill.ACT_BF16)
    out = gpu.alloc((max_m, HIDDEN), np.uint16)
    return shape, weights, x, out, sum(a.nbytes for a in weights.values()) / EXPERTS


def moe_routes(gpu, rng, M: int, launches: int, routing: str, reuse: float) -> tuple:
    """(routes, distinct): `launches` given routings of M tokens on the device (moe_routing_ids' ids, equal weights
    summing to the scaling factor) and the distinct experts each touches."""
    routes, distinct = [], []
    for _ in range(launches):
        ids = moe_routing_ids(rng, M, routing, reuse)
        routes.append((gpu.upload(ids), gpu.upload(np.full((M, TOPK), 2.827 / TOPK, np.float32))))
        distinct.append(len(np.unique(ids)))
    return routes, distinct


def bench_moe_rows(gpu, tp: int, ms: list[int], launches: int, ceiling_gbps: float, seed: int,
                   overrides: dict | None = None, router: bool = True, pdl: bool = True,
                   parts: bool = False, paths: tuple = ("auto",), stream_knobs: dict | None = None,
                   routing: str = "uniform", reuse: float = 0.5, cols_knobs: dict | None = None) -> list[dict]:
    """Rows of the experts (route kernel + gate_up -> down) per M and per path of `paths` (MOE_PATHS: the plan's
    choice, the two launches, the streaming launch, the two launches with moe_down_cols: cols_knobs forces its plan_down_cols
    knobs), then the router's rows. routing: moe_routing_ids'."""
    E, H = EXPERTS, HIDDEN
    shape, weights, x, out, expert_bytes = moe_operands(gpu, tp, max(ms), seed)
    router_w = gpu.alloc((E // 16, H // 64, 4, 32, 8), np.uint16)          # tile_bf16 layout
    randfill.fill_device(gpu, router_w, seed + 7, randfill.WEIGHT_BF16)
    bias = gpu.upload(np.zeros(E, np.float32))
    moe = FusedMoE(gpu, shape, weights, router=router_w, bias=bias, pdl=pdl)
    rng = np.random.default_rng(seed)
    rows = []
    for M in ms:
        if overrides:
            moe.override(M, **overrides)
        if "stream" in paths and (stream_knobs or overrides):     # the streaming launch on the same gate_up knobs
            moe.override_stream(M, **(stream_knobs or {}),
                                **{k: v for k, v in (overrides or {}).items() if k.startswith("gu_")})
        routes, distinct = moe_routes(gpu, rng, M, launches, routing, reuse)
        touched = moe_touched_bytes(float(np.mean(distinct)), expert_bytes, M, H)
        if "cols" in paths and cols_knobs:
            moe.override_cols(M, **cols_knobs)
        for path in paths:
            moe.streaming, moe.down_cols = MOE_PATHS[path]
            if path == "cols" and not moe.uses_down_cols(M):
                moe.cols_plan(M)                        # raises, naming the shared memory it needs
                raise click.BadParameter(f"M = {M}: the down k-split is {moe.plan(M).dn_splits}; moe_down_cols sums "
                                         "one (moe_down's at one split)", param_hint="--paths cols")
            us = time_moe(gpu, moe, x, out, M, routes)
            rows.append(_row({"tp": tp, "part": "experts", "M": M, "path": path, "routing": routing,
                              "reuse": reuse if routing == "tree" else None,
                              "distinct_experts": round(float(np.mean(distinct)), 1), "plan": moe_plan_row(moe, M)},
                             touched, us, ceiling_gbps))
        moe.streaming, moe.down_cols = MOE_PATHS[paths[0]]
        if parts:       # cumulative prefixes of the chain: route; route + gate_up (same routings, same graph shape)
            def prefix(stream, upto):
                for ids, w in routes:
                    moe.launch_route(None, M, ids, w, stream)
                    if upto == "gate_up":
                        moe.gate_up(x, M, stream)
            for upto in ("route", "gate_up"):
                us_p = time_graph(gpu, lambda st: prefix(st, upto)) * 1e3 / launches
                rows.append({"tp": tp, "part": f"prefix_{upto}", "M": M, "latency_us": round(us_p, 2)})
            _say(f"  moe tp{tp} M={M:4d} route {rows[-2]['latency_us']:.1f} us, + gate_up {rows[-1]['latency_us']:.1f} us")
        if router:
            rows += router_rows(gpu, moe, x, tp, M, launches, parts, ceiling_gbps)
        for main in [r for r in rows if r["part"] == "experts" and r["M"] == M]:
            _say(f"  moe tp{tp} M={M:4d} {routing:7s} {main['path']:10s} {main['latency_us']:9.1f} us  "
                 f"{main['gbps']:7.0f} GB/s  {main['pct_of_ceiling']:5.1f}%")
    gpu.free_all()
    return rows


def time_moe(gpu, moe, x, out, M: int, routes: list) -> float:
    """us per moe.run (route kernel + experts), one launch per routing in one graph."""
    moe.run(x, out, M, topk=routes[0])             # compile, set smem limits, outside capture
    gpu.sync()

    def launch_all(stream):
        for r in routes:
            moe.run(x, out, M, topk=r, stream=stream)
    return time_graph(gpu, launch_all) * 1e3 / len(routes)


def moe_plan_row(moe, M: int) -> dict:
    """The plan of the path moe.run takes at M (the streaming launch's or the two launches')."""
    if moe.uses_stream(M):
        p = moe.stream_plan(M)
        return {"stream": True, "warps": p.warps, "ring": "%dx%d" % p.ring, "gate_up_splits": p.gu_splits,
                "gate_up_blocks_x": p.gu_nb, "gate_up_tpw": p.gu_tpw, "down_tpw": p.dn_tpw, "down_blocks_x": p.dn_nb,
                "blocks": p.blocks, "prefetch_tiles": p.prefetch_tiles, "smem": p.smem, "bulk": p.bulk, "pin": p.pin,
                "pdl": moe.pdl}
    p = moe.plan(M)
    gate_up = {"stream": False, "gate_up_splits": p.gu_splits, "gate_up_warps": p.gu_warps, "gate_up_blocks_x": p.gu_nb,
               "gate_up_ring": "%dx%d" % p.gu_ring, "gate_up_tpw": p.gu_tpw, "gate_up_occ": p.gu_occ, "pdl": moe.pdl}
    if moe.uses_down_cols(M):
        c = moe.cols_plan(M)
        return {**gate_up, "down_cols": True, "cols_warps": c.warps, "cols_upb": c.upb, "cols_ring": "%dx%d" % c.ring,
                "cols_blocks": c.blocks, "cols_smem": c.smem}
    return {**gate_up, "down_warps": p.dn_warps, "down_tpw": p.dn_tpw, "down_blocks_x": p.dn_nb,
            "down_splits": p.dn_splits, "down_ring": "%dx%d" % p.dn_ring, "down_occ": p.dn_occ}


def router_rows(gpu, moe, x, tp: int, M: int, launches: int, parts: bool, ceiling_gbps: float) -> list[dict]:
    """The router's rows, 'router' last: FusedMoE.route as the engine runs it (the fused kernel, plugins/router.py).
    With parts, before it: 'router_unfused' (the path it replaced: the fp32 router GEMM, then moe_route),
    'router_gemm' and 'route_topk' (those two kernels alone) and 'router_fused_given' (the fused kernel aligning
    given ids, as bench step's given routing runs it)."""
    E, H = moe.shape.experts, moe.shape.hidden

    def timed(launch) -> float:              # us a launch; one launch outside the capture (compile, smem limit)
        launch(gpu.stream)
        gpu.sync()
        return time_graph(gpu, lambda s: [launch(s) for _ in range(launches)]) * 1e3 / launches

    def unfused(s):
        moe.fused_router = False
        try:
            moe.route(x, M, stream=s)
        finally:
            moe.fused_router = True

    rows = []
    if parts:
        for part, launch in (
                ("router_unfused", unfused),
                ("router_gemm", lambda s: moe.router_gemm.run(x, moe.router, moe.logits, M, stream=s)),
                ("route_topk", lambda s: moe.launch_route(moe.logits, M, moe.topk_ids, moe.topk_w, s)),
                ("router_fused_given", lambda s: moe.route_given(x, M, moe.topk_ids, moe.topk_w, stream=s))):
            rows.append({"tp": tp, "part": part, "M": M, "latency_us": round(timed(launch), 2)})
        _say(f"  moe tp{tp} M={M:4d} router before: {rows[0]['latency_us']:.1f} us (GEMM {rows[1]['latency_us']:.1f}, "
             f"route kernel with top-k {rows[2]['latency_us']:.1f}); fused, given ids {rows[3]['latency_us']:.1f} us")
    us = timed(lambda s: moe.route(x, M, stream=s))
    p = moe.router_fused.plan(M)
    plan = {"fused": True, "mt": p.mt, "token_blocks": p.mb, "warps": p.warps, "tiles": p.tiles, "n_blocks": p.nb,
            "splits": p.splits, "blocks": p.blocks, "smem": p.smem}
    rows.append(_row({"tp": tp, "part": "router", "M": M, "plan": plan}, E * H * 2 + M * H * 2, us, ceiling_gbps))
    return rows


def device_bf16_weight(gpu, N: int, K: int, seed: int):
    """A random [N, K] bf16 weight in the skinny GEMM's tiled layout (layout.tile_bf16's shape), filled on the GPU."""
    w = gpu.alloc((-(-N // 16), K // 64, 4, 32, 8), np.uint16)
    randfill.fill_device(gpu, w, seed, randfill.WEIGHT_BF16)
    return w


def gemm_operands(gpu, N: int, K: int, max_m: int, seed: int, x_seed: int) -> tuple:
    """(ws, x, out, launches) for timing an [N, K] skinny GEMM: random weight copies in the tile_bf16 layout that
    together exceed 4x the L2 (weights seed + i), x [max_m, K] random (x_seed), out [max_m, N] zeros, and the
    launches a timing graph takes (a multiple of the copies, at least 8)."""
    copies = max(1, -(-4 * gpu.l2_bytes // (N * K * 2)))
    ws = [device_bf16_weight(gpu, N, K, seed + i) for i in range(copies)]
    x = gpu.alloc((max_m, K), np.uint16)
    randfill.fill_device(gpu, x, x_seed, randfill.ACT_BF16)
    return ws, x, gpu.zeros((max_m, N), np.uint16), copies * max(1, -(-8 // copies))


def time_gemm(gpu, gemm, operands: tuple, M: int, residual: bool, swiglu: bool = False) -> float:
    """us a launch of gemm at M rows (its current plan): one launch outside the capture (compile, shared-memory
    limit), then a graph of the operands' launches, each on the next weight copy (out as the residual if any;
    swiglu: the SwiGLU epilogue, out's first N / 2 columns)."""
    ws, x, out, launches = operands
    res = out if residual else None
    gemm.run(x, ws[0], out, M, residual=res, swiglu=swiglu)
    gpu.sync()
    return time_graph(gpu, lambda s: [gemm.run(x, ws[i % len(ws)], out, M, residual=res, stream=s, swiglu=swiglu)
                                      for i in range(launches)]) * 1e3 / launches


def bench_gemm_rows(gpu, tp: int, ms: list[int], ceiling_gbps: float, seed: int, names: list[str] | None,
                    overrides: dict | None = None, pdl: bool = True, measured: bool = True) -> list[dict]:
    """overrides: forced plan knobs (SkinnyGemm.override: the fitted plan under them); measured False: the fitted
    plan everywhere (no gemm_measured table)."""
    rows = []
    max_m = max(ms)
    for name, N, K, residual in GEMM_SHAPES[tp]:
        if names and name not in names:
            continue
        wbytes = N * K * 2
        operands = gemm_operands(gpu, N, K, max_m, seed, seed + 1000)
        gemm = SkinnyGemm(gpu, N, K, max_m, pdl=pdl, measured=measured)
        for M in ms:
            knobs = {k: v for k, v in (overrides or {}).items() if k != "tm" or M > 16}   # tm takes M > 16 only
            if knobs:
                gemm.override(M, **knobs)
            us = time_gemm(gpu, gemm, operands, M, residual)
            nbytes = wbytes + M * K * 2 + M * N * 2 * (2 if residual else 1)
            p = gemm.plan(M)
            source = "forced" if knobs else ("measured" if gemm.measured_knobs(M) else "fitted")
            rows.append(_row({"tp": tp, "name": name, "N": N, "K": K, "M": M, "weight_mb": round(wbytes / 1e6, 2),
                              "residual": residual,
                              "plan": {"source": source, "kernel": p.kernel, "dsmem": p.dsmem, "mt": p.mt,
                                       "splits": p.splits, "blocks": p.blocks, "warps": p.warps, "tpw": p.tpw,
                                       "pdl": gemm.pdl}},
                             nbytes, us, ceiling_gbps))
            _say(f"  gemm tp{tp} {name:15s} M={M:4d} {us:9.1f} us  {rows[-1]['gbps']:7.0f} GB/s  "
                 f"{rows[-1]['pct_of_ceiling']:5.1f}%")
        gpu.free_all()
    return rows


def _emit(bench: str, gpu, rows: list[dict], ceiling: dict, as_json: bool) -> None:
    if as_json:
        emit_json({"bench": bench, "device": gpu.name, "rows": rows, "ceiling": ceiling})


@click.command("moe")
@click.option("--tp", "tps", default="1,8", show_default=True, help="tensor-parallel shapes: 1 (I=2048), 8 (I=256)")
@click.option("--m", "m_list", default="1,2,4,8,16,32,64,128,256", show_default=True, help="token counts")
@click.option("--launches", default=16, show_default=True, help="launches per captured graph")
@click.option("--splits", type=int, default=None, help="force the gate_up k-splits (sweeps)")
@click.option("--warps", type=int, default=None, help="force the warps per block of both GEMMs (sweeps)")
@click.option("--down-splits", type=int, default=None, help="force the down k-splits (sweeps)")
@click.option("--down-warps", type=int, default=None, help="force the down warps per block (sweeps)")
@click.option("--down-tpw", type=int, default=None, help="force the down tile pairs per warp (sweeps)")
@click.option("--gu-tpw", type=int, default=None, help="force the gate_up tile pairs per warp (sweeps)")
@click.option("--gu-ring", default=None, help="gate_up ring SLOTSxCHUNKS, e.g. 8x1 or 4x2 (sweeps)")
@click.option("--down-ring", default=None, help="down ring SLOTSxCHUNKS (sweeps)")
@click.option("--gu-occ", type=int, default=None, help="gate_up blocks an SM: a compiled occupancy variant (sweeps)")
@click.option("--down-occ", type=int, default=None, help="down blocks an SM: a compiled occupancy variant (sweeps)")
@click.option("--routing", default="uniform", show_default=True, type=click.Choice(["uniform", "tree"]),
              help="ids of each launch: uniform top-8, or bench step's tree routing (a node reuses its parent's "
              "experts with probability --reuse: fewer distinct experts, more rows each)")
@click.option("--reuse", default=0.5, show_default=True, type=FiniteFloatRange(0.0, 1.0), help="--routing tree")
@click.option("--no-pdl", is_flag=True, help="plain launches instead of programmatic dependent launch")
@click.option("--paths", default="auto", show_default=True,
              help="experts paths to time, comma-separated: auto (the plan's choice), two-kernel (moe_gate_up + "
              "moe_down), stream, cols (moe_gate_up + moe_down_cols)")
@click.option("--cols-warps", type=int, default=None, help="force moe_down_cols' warps a block (path cols)")
@click.option("--cols-upb", type=int, default=None, help="force moe_down_cols' tile pairs (32 columns) a block")
@click.option("--cols-ring", default=None, help="force moe_down_cols' ring SLOTSxCHUNKS (2x2, 3x2, 4x2, 2x4)")
@click.option("--stream-dn-tpw", type=int, default=None, help="force the streaming launch's down tile pairs per warp")
@click.option("--stream-blocks-per-sm", type=int, default=None, help="force the streaming launch's blocks per SM")
@click.option("--stream-prefetch", type=int, default=None,
              help="streaming launch: L2-prefetch the down weights up to this many tiles (0: never)")
@click.option("--stream-bulk", is_flag=True, help="streaming launch: ring slots as bulk copies on mbarriers")
@click.option("--stream-pin", is_flag=True, help="streaming launch (with --stream-bulk): each block's first down item "
              "pinned to it, its weights requested at the block's start")
@click.option("--parts", is_flag=True, help="also time the route and route + gate_up prefixes, and the router's "
              "parts and the unfused router it replaced")
@click.option("--no-router", is_flag=True, help="skip the router rows")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
@reported()
def moe_command(tps, m_list, launches, splits, warps, down_splits, down_warps, down_tpw, gu_tpw, gu_ring, down_ring,
                gu_occ, down_occ, routing, reuse, no_pdl, paths, stream_dn_tpw, stream_blocks_per_sm, stream_prefetch,
                stream_bulk, stream_pin, cols_warps, cols_upb, cols_ring, parts, no_router, seed, as_json):
    """Fused W4A16 MoE (routing uniform random top-8) vs the device-to-device copy ceiling."""
    path_list = tuple(p.strip() for p in paths.split(",") if p.strip())
    if not path_list or any(p not in MOE_PATHS for p in path_list):
        raise click.BadParameter(f"--paths: expected names among {sorted(MOE_PATHS)}, got {paths!r}")
    stream_knobs = {k: v for k, v in (("dn_tpw", stream_dn_tpw), ("blocks_per_sm", stream_blocks_per_sm),
                                      ("prefetch", stream_prefetch), ("bulk", stream_bulk or None),
                                      ("pin", stream_pin or None)) if v is not None}
    cols_knobs = {k: v for k, v in (("warps", cols_warps), ("upb", cols_upb), ("ring", _ring(cols_ring))) if v}
    gpu, ceiling = open_gpu()
    rows = []
    for tp in _ints(tps):
        if tp not in TP_SHAPES:
            raise click.BadParameter(f"--tp must be among {sorted(TP_SHAPES)}, got {tp}")
        overrides = {k: v for k, v in (("gu_splits", splits), ("gu_warps", warps), ("dn_warps", down_warps or warps),
                                       ("dn_splits", down_splits), ("dn_tpw", down_tpw), ("gu_tpw", gu_tpw),
                                       ("gu_ring", _ring(gu_ring)), ("dn_ring", _ring(down_ring)),
                                       ("gu_occ", gu_occ), ("dn_occ", down_occ)) if v}
        rows += bench_moe_rows(gpu, tp, _ints(m_list), launches, ceiling["gbps"], seed, overrides, not no_router,
                               not no_pdl, parts, path_list, stream_knobs, routing, reuse, cols_knobs)
    _emit("moe", gpu, rows, ceiling, as_json)


@click.command("gemm")
@click.option("--tp", "tps", default="1,8", show_default=True, help="tensor-parallel shapes: 1, 8")
@click.option("--m", "m_list", default="1,2,4,8,16,32,64,128,256", show_default=True, help="token counts")
@click.option("--names", default="", help="comma-separated subset of shape names (default all)")
@click.option("--splits", type=int, default=None, help="force the k-splits (sweeps; must divide K / 64)")
@click.option("--tpw", type=int, default=None, help="force the 16-row tiles per warp (sweeps)")
@click.option("--warps", type=int, default=None, help="force the warps per block (sweeps)")
@click.option("--x-kb", type=int, default=None, help="shared memory for the token rows, KB (sweeps)")
@click.option("--form", type=click.Choice(["auto", "tm", "mt"]), default="auto", show_default=True,
              help="past 16 rows: tokens as the mma's M side (tm), the 8-row kernels (mt), or the plan's (auto)")
@click.option("--no-dsmem", is_flag=True, help="split-K partials through global memory, not a cluster's shared memory "
              "(a forced knob: the fitted plan)")
@click.option("--fitted", is_flag=True, help="plan_gemm's fitted plans everywhere, not the measured table "
              "(plugins/gemm_measured.py)")
@click.option("--no-pdl", is_flag=True, help="plain launches instead of programmatic dependent launch")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON object on stdout")
@reported()
def gemm_command(tps, m_list, names, splits, tpw, warps, x_kb, form, no_dsmem, fitted, no_pdl, seed, as_json):
    """BF16 skinny GEMM (M <= 256) vs the device-to-device copy ceiling."""
    gpu, ceiling = open_gpu()
    rows = []
    wanted = [n for n in names.split(",") if n]
    for tp in _ints(tps):
        if tp not in GEMM_SHAPES:
            raise click.BadParameter(f"--tp must be among {sorted(GEMM_SHAPES)}, got {tp}")
        known = {n for n, *_ in GEMM_SHAPES[tp]}
        if any(n not in known for n in wanted):
            raise click.BadParameter(f"--names: unknown {sorted(set(wanted) - known)}; known {sorted(known)}")
        overrides = {k: v for k, v in (("splits", splits), ("tpw", tpw), ("warps", warps),
                                       ("x_budget", x_kb and x_kb * 1024)) if v}
        if form != "auto":
            overrides["tm"] = form == "tm"
        if no_dsmem:
            overrides["dsmem"] = False
        rows += bench_gemm_rows(gpu, tp, _ints(m_list), ceiling["gbps"], seed, wanted, overrides, not no_pdl,
                                not fitted)
    _emit("gemm", gpu, rows, ceiling, as_json)
