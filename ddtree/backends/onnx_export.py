"""The onnx backend's product: all graphs of one rank (the layer functions of description/layers.py run
through OnnxOps), and the engine directory's graphs/ folder.

    graphs/index.json              {"format", "act", "dims", "kinds": {kind: {"layers", "weight_prefix",
                                    "inputs", "outputs"}}, "ranks": [{kind: "graphs/rank<r>/<kind>.onnx"}]}
    graphs/rank<r>/<kind>.onnx     kinds: embed, dense_layer, moe_layer, head, draft_fc, draft_layer
                                   (draft_layer_full / draft_layer_sliding when the drafter mixes both),
                                   draft_head, tree_b<B> per budget, accept
A layer graph serves several layers: its weight inputs are named after its first layer, and
`layer_weight_name` gives layer L's tensor for each input. Graph metadata (onnx metadata_props)
repeats kind, layers, weight prefix, rank and world size, so a lone .onnx file explains itself.
Symbolic dims: q tokens per call, W = ceil(q / 32) mask words, S cache capacity, n new drafter
context tokens, nodes tree nodes; `dim_ranges` gives the TensorRT optimisation profile of each.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ddtree import engine_dir as ed
from ddtree.backends.onnx_backend import OnnxOps
from ddtree.backends.onnx_graph import GraphBuilder
from ddtree.description.layers import rank_kinds
from ddtree.description.opset import RankLayout
from ddtree.model.safetensors_io import SafetensorsFile
from ddtree.model.tensors import TensorSpec

GRAPHS_FORMAT = "ddtree-graphs/1"
MAX_TOKENS = 256                 # tokens per target call and new drafter context per call (the kernels' M)
ENGINE_ACT = "bfloat16"          # activation dtype of the engine's graphs and plans


@dataclass
class LayerGraph:
    kind: str
    model: onnx.ModelProto
    layers: list[int] = field(default_factory=list)      # decoder (or drafter) layers this graph serves
    weight_prefix: str | None = None                      # "model.layers.1." / "drafter.layers.0."


def dim_ranges(cfg) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) per symbolic dim: the plans' optimisation profile."""
    S = cfg.max_position_embeddings + MAX_TOKENS        # a verify appends up to MAX_TOKENS rows past the context
    return {"q": (1, 64, MAX_TOKENS), "W": (1, 2, -(-MAX_TOKENS // 32)), "S": (1, min(4096, S), S),
            "n": (0, 16, MAX_TOKENS), "nodes": (1, 33, 256)}


def export_rank(cfg, dcfg, plan: dict, rank: int, specs: dict[str, TensorSpec], budgets, act: str = ENGINE_ACT
                ) -> dict[str, LayerGraph]:
    """Every graph of rank `rank`: kind -> LayerGraph. `plan` is the engine config's "plan" entry,
    `specs` the rank's tensors (name -> TensorSpec, as in its safetensors headers)."""
    lay = RankLayout.from_plan(plan, rank)
    out: dict[str, LayerGraph] = {}
    for kind, (fn, args, layers, prefix) in rank_kinds(cfg, dcfg, plan, lay, budgets).items():
        g = GraphBuilder(f"{kind}.{ed.rank_name(rank)}", act)
        fn(OnnxOps(g, lay, specs), *args)
        g.metadata.update({"ddtree.kind": kind, "ddtree.rank": str(rank), "ddtree.world_size": str(lay.tp),
                           "ddtree.layers": ",".join(map(str, layers)), "ddtree.weight_prefix": prefix or ""})
        out[kind] = LayerGraph(kind, g.export(), list(layers), prefix)
    return out


def rank_specs(engine_dir, weight_files, rank: int = 0) -> dict[str, TensorSpec]:
    """name -> TensorSpec of one rank's tensors, from its safetensors headers."""
    specs = {}
    for fname in weight_files:
        f = SafetensorsFile(ed.rank_dir(engine_dir, rank) / fname)
        specs.update(f.entries)
        f.close()
    return specs


def io_of(model: onnx.ModelProto) -> tuple[list[dict], list[dict]]:
    """Graph inputs and outputs as [{"name", "dtype", "shape"}] (symbolic dims as their names)."""
    def one(v):
        t = v.type.tensor_type
        shape = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
        return {"name": v.name, "dtype": onnx.TensorProto.DataType.Name(t.elem_type), "shape": shape}
    return [one(v) for v in model.graph.input], [one(v) for v in model.graph.output]


def write_graphs(out_dir, cfg, dcfg, plan: dict, specs: dict[str, TensorSpec], budgets, on_rank=None) -> dict:
    """Export every rank's graphs (engine activation dtype) under out_dir/graphs; returns the index."""
    index = {"format": GRAPHS_FORMAT, "act": ENGINE_ACT, "opset": None, "dims": dim_ranges(cfg),
             "kinds": {}, "ranks": []}
    for r in range(plan["tp"]):
        graphs = export_rank(cfg, dcfg, plan, r, specs, budgets)
        ed.graphs_rank_dir(out_dir, r).mkdir(parents=True, exist_ok=True)
        files = {}
        for kind, lg in graphs.items():
            rel = ed.graph_rel(r, kind)
            onnx.save(lg.model, Path(out_dir) / rel)
            files[kind] = rel
            inputs, outputs = io_of(lg.model)
            index["kinds"][kind] = {"layers": lg.layers, "weight_prefix": lg.weight_prefix,
                                    "inputs": inputs, "outputs": outputs}
            index["opset"] = lg.model.opset_import[0].version
        index["ranks"].append(files)
        if on_rank:
            on_rank(r)
    ed.graphs_index_path(out_dir).write_text(json.dumps(index, indent=1) + "\n")
    return index
