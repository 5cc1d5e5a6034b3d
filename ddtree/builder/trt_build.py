"""TensorRT-RTX plans from an engine's graphs: one plan per rank and graph kind, for SM120, built on
any machine (CPU-only AOT is TensorRT-RTX's default; docs/tensorrt-rtx.md section 2).

    rank<r>/<kind>.plan    parsed from graphs/rank<r>/<kind>.onnx with the ddtree plugin creators
                           registered; strongly typed (bf16 activations); weights stay network inputs
                           (no weights in a plan) and the runtime binds each layer's tensors
    plans.json             {"format", "compute_capability", "tensorrt_rtx", "plans": {"rank<r>/<kind>.plan":
                           {"graph", "rank", "kind", "bytes", "seconds", "plugins": [op types],
                            "inputs"/"outputs": [{"name", "dtype", "shape"}] (-1 = dynamic)}}}
Dynamic dims get one optimisation profile from graphs/index.json "dims" (min, opt, max). Aliased
plugin outputs (the caches) need PreviewFeature.ALIASED_PLUGIN_IO_10_03. Plans run only on
TensorRT-RTX GPUs with compute capability 12.0; an H200 (SM90) refuses them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ddtree import engine_dir as ed
from ddtree.backends.tensorrt.loader import TrtUnavailable, import_trt
from ddtree.builder.output_dir import BuildError

if TYPE_CHECKING:                       # onnx is the `graphs` extra: imported only when plans are built
    import onnx

PLANS_FORMAT = "ddtree-plans/1"


class PlanBuildError(BuildError):
    """TensorRT could not parse or build one graph; the message names the graph file and the errors."""


def require_graphs() -> None:
    """BuildError unless onnx and onnx-graphsurgeon (the `graphs` extra) import."""
    try:
        import onnx_graphsurgeon  # noqa: F401
    except ImportError as e:
        raise BuildError(f"exporting the layer graphs needs the 'graphs' extra (pip install -e '.[graphs]': onnx, "
                         f"onnx-graphsurgeon), or build with --no-graphs; {e}") from e


def require_trt() -> None:
    """Import the wheels now (and fix the parser link), or raise BuildError with the install command."""
    try:
        import_trt()
    except TrtUnavailable as e:
        raise BuildError(f"--trt: {e}") from e


def export_graphs(engine_dir, cfg, dcfg, plan: dict, weight_files, budgets, advance=None) -> dict:
    """graphs/ of an engine whose rank weights are written (their headers give every input's shape)."""
    from ddtree.backends.onnx_export import rank_specs, write_graphs  # onnx, onnx_graphsurgeon: the graphs extra
    specs = rank_specs(engine_dir, weight_files)
    return write_graphs(engine_dir, cfg, dcfg, plan, specs, budgets, on_rank=lambda r: advance and advance(1))


def _profile_shapes(model: onnx.ModelProto, dims: dict) -> dict[str, tuple]:
    """Network input -> (min, opt, max) shapes, for inputs with symbolic dims."""
    out = {}
    for v in model.graph.input:
        ds = v.type.tensor_type.shape.dim
        if not any(d.dim_param for d in ds):
            continue
        shapes = []
        for i in range(3):
            shape = []
            for d in ds:
                if d.dim_param and d.dim_param not in dims:
                    raise PlanBuildError(f"graph input {v.name}: dim {d.dim_param!r} has no profile range")
                shape.append(dims[d.dim_param][i] if d.dim_param else d.dim_value)
            shapes.append(tuple(shape))
        out[v.name] = tuple(shapes)
    return out


def _io(trt, tensors) -> list[dict]:
    names = {trt.DataType.BF16: "BFLOAT16", trt.DataType.FLOAT: "FLOAT", trt.DataType.INT32: "INT32",
             trt.DataType.INT64: "INT64", trt.DataType.BOOL: "BOOL", trt.DataType.INT8: "INT8"}
    return [{"name": t.name, "dtype": names.get(t.dtype, str(t.dtype)), "shape": list(t.shape)} for t in tensors]


def _plugin_ops(trt, network) -> list[str]:
    """Op types of the network's plugin layers (the ddtree nodes TensorRT will run as plugins)."""
    ops = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer
            core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
            ops.append(core.plugin_name)
    return sorted(set(ops))


class _Logger:
    """TensorRT logger that keeps errors for the exception message."""

    def __init__(self, trt):
        class L(trt.ILogger):
            def __init__(inner):
                trt.ILogger.__init__(inner)
                inner.errors = []

            def log(inner, severity, msg):
                if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                    inner.errors.append(msg)
        self.logger = L()


def build_plan(trt, graph_path: Path, dims: dict) -> tuple[bytes, dict]:
    """One ONNX graph -> (plan bytes, record for plans.json)."""
    log = _Logger(trt).logger
    builder = trt.Builder(log)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(str(graph_path)):
        errors = [parser.get_error(i).desc() for i in range(parser.num_errors)] + log.errors
        raise PlanBuildError(f"{graph_path}: TensorRT-RTX could not parse the graph: {'; '.join(errors)}")
    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(trt.ComputeCapability.SM120, 0)
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    # every I/O address is the runtime's (weights, caches, activations): what an outer CUDA-graph capture of the
    # step needs (runtime/trt_executor.py), and what TensorRT requires before a stream it runs on is captured
    config.set_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)
    import onnx  # onnx: the graphs extra
    shapes = _profile_shapes(onnx.load(str(graph_path), load_external_data=False), dims)
    if shapes:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    t0 = time.perf_counter()
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise PlanBuildError(f"{graph_path}: TensorRT-RTX could not build an SM120 plan: {'; '.join(log.errors)}")
    record = {"inputs": _io(trt, (network.get_input(i) for i in range(network.num_inputs))),
              "outputs": _io(trt, (network.get_output(i) for i in range(network.num_outputs))),
              "plugins": _plugin_ops(trt, network), "seconds": round(time.perf_counter() - t0, 3)}
    return bytes(blob), record


def build_plans(engine_dir, on_plan=None) -> dict:
    """Every graphs/rank<r>/<kind>.onnx -> rank<r>/<kind>.plan; writes and returns plans.json."""
    from ddtree.backends.tensorrt.creators import register_creators, trt  # onnx: the graphs extra
    register_creators()
    root = Path(engine_dir)
    index = json.loads(ed.graphs_index_path(root).read_text())
    plans = {}
    for r, files in enumerate(index["ranks"]):
        for kind, rel in files.items():
            blob, record = build_plan(trt, root / rel, index["dims"])
            name = ed.plan_rel(r, kind)
            (root / name).write_bytes(blob)
            plans[name] = {"graph": rel, "rank": r, "kind": kind, "bytes": len(blob), **record}
            if on_plan:
                on_plan(name)
    out = {"format": PLANS_FORMAT, "compute_capability": "12.0", "tensorrt_rtx": trt.__version__,
           "runs_on": "TensorRT-RTX GPUs with compute capability 12.0 (RTX PRO 6000 Blackwell); SM90 refuses them",
           "plans": plans}
    ed.plans_path(root).write_text(json.dumps(out, indent=1) + "\n")
    return out


def describe_plans(engine_dir) -> dict | None:
    """plans.json of an engine (None without one), for `ddtree inspect`."""
    path = ed.plans_path(engine_dir)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _is_weight(name: str) -> bool:
    return name.startswith(("model.", "lm_head.", "drafter."))


def plan_lines(plans: dict | None) -> list[str]:
    """Human summary: one line per plan kind (rank 0; every rank's plans have the same I/O)."""
    if not plans:
        return ["  plans    none (build with --trt for TensorRT-RTX plans)"]
    entries = plans["plans"]
    total = sum(p["bytes"] for p in entries.values())
    lines = [f"  plans    {len(entries)} for SM{plans['compute_capability'].replace('.', '')} "
             f"(TensorRT-RTX {plans['tensorrt_rtx']}), {total / 2**20:.1f} MiB; {plans['runs_on']}"]

    def fmt(ts):
        return ", ".join(f"{t['name']} {t['dtype'].lower()}{t['shape']}" for t in ts if not _is_weight(t["name"]))
    for name, p in entries.items():
        if p["rank"] != 0:
            continue
        weights = sum(_is_weight(t["name"]) for t in p["inputs"])
        lines.append(f"    {p['kind']:<12} {p['bytes'] / 1024:8.1f} KiB  plugins {','.join(p['plugins']) or '-'}")
        lines.append(f"      in  {fmt(p['inputs'])}" + (f" + {weights} weight inputs" if weights else ""))
        lines.append(f"      out {fmt(p['outputs'])}")
    return lines
