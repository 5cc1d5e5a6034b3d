"""Run an engine's per-rank graphs on CPU with onnx.reference: one thread per rank, AllReduce nodes
meeting in a RankGroup (parallel/collectives.py), weights fed from the engine's rank<r>/*.safetensors.

    ranks = GraphRanks.from_engine(engine_dir, act="float64")   # graphs exported in memory at float64
    ranks = GraphRanks.from_engine(engine_dir)                  # the engine's own graphs/ (bfloat16)
    caches = ranks.new_target_caches(capacity)
    out = ranks.target_forward(ids, pos, tree_mask, caches, taps=(1, 2))   # logits, taps, winners
    d = ranks.drafter_forward(block_ids, pos, ctx_taps, ranks.new_drafter_caches(capacity))
    tree = ranks.tree_build(root, d.candidates, budget);  walk = ranks.accept(tree, out.winners)

Every rank computes the replicated parts (norms, latent cache, tree build, walk) itself, exactly as
the GPU ranks will; the runner returns rank 0's copy after checking the ranks agree where they must.
The draft candidates and sampling winners are gathered inside the tree and accept graphs (AllGather
nodes); the caller gets the ranks' logits side by side, and their candidates and winners stacked [tp, ...]
to feed back, one slice per rank.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator

from ddtree import engine_dir as ed
from ddtree.backends.numpy_backend import run_on_ranks
from ddtree.backends.onnx_export import LayerGraph, export_rank, rank_specs
from ddtree.backends.onnx_nodes import ops_for
from ddtree.description import layers, stack
from ddtree.description.layers import layer_weight_name
from ddtree.description.opset import RankLayout
from ddtree.model.config import DrafterConfig, KimiConfig
from ddtree.parallel.collectives import collective_for
from ddtree.runtime.caches import DraftCaches, TargetCaches
from ddtree.runtime.per_rank import per_rank_run
from ddtree.tree.build import pack_visibility

ACT_NUMPY = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}


def mask_words(visible_new: np.ndarray) -> np.ndarray:
    """[q, q] bool visibility among the new tokens -> tree_mask [q, ceil(q/32)] int32 bits."""
    return pack_visibility(np.asarray(visible_new, dtype=bool)).view(np.int32)


@dataclass
class TargetOut:
    logits: np.ndarray                      # [q, V] the ranks' slices side by side
    taps: dict[int, np.ndarray]             # layer -> h [q, H]
    winners: tuple[np.ndarray, np.ndarray]  # (value [tp, q], id [tp, q]): each rank's sampling winner


@dataclass
class DraftOut:
    logits: np.ndarray                      # [D, V]
    candidates: dict[str, np.ndarray]       # topk_values/topk_ids [tp, D, k], row_max/row_sumexp [tp, D]


def kind_maps(kinds) -> tuple[dict[int, str], dict[int, str]]:
    """(kind, layers, weight_prefix) of every graph kind -> (decoder layer -> its kind, drafter layer -> its kind)."""
    kinds = list(kinds)
    layer_kind = {L: kind for kind, layers, prefix in kinds if prefix and kind in ("dense_layer", "moe_layer")
                  for L in layers}
    draft_kind = {L: kind for kind, layers, _ in kinds if kind.startswith("draft_layer") for L in layers}
    return layer_kind, draft_kind


class GraphRanks:
    def __init__(self, cfg: KimiConfig, dcfg: DrafterConfig, graphs: list[dict[str, LayerGraph]],
                 weights: list[dict[str, np.ndarray]], act: str, rank: int | None = None, tp: int | None = None,
                 group=None, plan: dict | None = None):
        """graphs / weights: every rank's (rank None: the ranks as threads meeting in an in-process group), or one
        rank's: this process is rank `rank` of `tp`, meeting the other rank processes in `group` (parallel/shm_group.py),
        and the outputs it returns are its own (the logits its vocab slice). plan: the engine's TP plan (its
        ranks' vocab slices: `layouts`)."""
        self.cfg, self.dcfg, self.graphs, self.weights, self.act = cfg, dcfg, graphs, weights, act
        self.held = len(graphs)                                   # ranks run here
        self.tp = self.held if rank is None else int(tp)
        self.local = list(range(self.held)) if rank is None else [rank]
        self.group = collective_for(self.tp) if rank is None else group
        ops = ops_for(self.group)
        self.evaluators = [{kind: ReferenceEvaluator(lg.model, new_ops=ops) for kind, lg in g.items()} for g in graphs]
        self.pool = ThreadPoolExecutor(self.held) if self.held > 1 else None
        self.layer_kind, self.draft_kind = kind_maps((k, lg.layers, lg.weight_prefix) for k, lg in graphs[0].items())
        self.layouts = None if plan is None else [RankLayout.from_plan(plan, r) for r in range(self.tp)]
        self.stack_run = per_rank_run(self.graph_run, self.held)

    @classmethod
    def from_engine(cls, engine_dir, act: str | None = None, verify: bool = True, rank: int | None = None,
                    group=None, checked: tuple | None = None) -> "GraphRanks":
        """act None: the engine's graphs/ as written; else every graph exported now at `act`. The engine is
        checked first (engine_dir.check_engine; verify=False skips the hashes only; checked: its result when the
        caller has it). rank None: every rank here; rank r: only rank r's graphs and weights (a rank process)."""
        meta, digests = checked if checked is not None else ed.check_engine(engine_dir, verify)
        cfg, dcfg = ed.engine_configs(engine_dir, meta)
        tp, files = int(meta["tp"]), meta["weight_files"]
        ranks = range(tp) if rank is None else [rank]
        if act is None:
            graphs = [load_graphs(engine_dir)[r] for r in ranks]
            act = json.loads(ed.graphs_index_path(engine_dir).read_text())["act"]
        else:
            specs = rank_specs(engine_dir, files)
            graphs = [export_rank(cfg, dcfg, meta["plan"], r, specs, meta["budgets"], act) for r in ranks]
        weights = [ed.load_rank_tensors(engine_dir, r, files, convert=ed.BFLOAT16, digests=digests) for r in ranks]
        return cls(cfg, dcfg, graphs, weights, act, rank=rank, tp=tp, group=group, plan=meta["plan"])

    # running ---------------------------------------------------------------------------------------
    def run(self, kind: str, feeds, layer: int | None = None) -> list[dict[str, np.ndarray]]:
        """Run graph `kind` on every rank (feeds: one dict for all ranks or one per rank); bind layer
        `layer`'s weights to the graph's weight inputs. Returns each rank's {output name: array}."""
        per_rank = feeds if isinstance(feeds, list) else [feeds] * self.held

        def one(r: int) -> dict[str, np.ndarray]:
            lg, ev = self.graphs[r][kind], self.evaluators[r][kind]
            inputs = dict(per_rank[r])
            for name in ev.input_names:
                if name not in inputs:
                    inputs[name] = self._weight(r, layer_weight_name(name, lg.weight_prefix, layer), kind)
            return dict(zip(ev.output_names, ev.run(None, inputs)))

        return run_on_ranks(self.pool, [self.group] * self.held, [lambda r=r: one(r) for r in range(self.held)])

    def _weight(self, rank: int, name: str, kind: str) -> np.ndarray:
        if name not in self.weights[rank]:
            raise KeyError(f"graph {kind} (rank {self.local[rank]}): input '{name}' is neither fed nor a tensor of "
                           f"{ed.rank_name(self.local[rank])}/*.safetensors")
        return self.weights[rank][name]

    def _act(self, a) -> np.ndarray:
        return np.asarray(a).astype(ACT_NUMPY[self.act])

    def _same(self, outs: list[dict], name: str) -> np.ndarray:
        """A replicated output: equal on every rank (bitwise), returned once."""
        return self._same_values([o[name] for o in outs], name)

    @staticmethod
    def _same_values(values: list, name: str) -> np.ndarray:
        for r, v in enumerate(values[1:], 1):
            if not np.array_equal(v, values[0]):
                raise AssertionError(f"replicated output '{name}' differs between rank 0 and rank {r}")
        return values[0]

    # caches ----------------------------------------------------------------------------------------
    def new_target_caches(self, capacity: int, limit: int | None = None) -> TargetCaches:
        """The held ranks' latent caches: `capacity` rows, grown on demand up to `limit` (None: no limit)."""
        c = self.cfg
        return TargetCaches(self.held, c.num_hidden_layers, c.kv_lora_rank + c.qk_rope_head_dim, capacity,
                            ACT_NUMPY[self.act], limit)

    def new_drafter_caches(self, capacity: int, limit: int | None = None) -> DraftCaches:
        d = self.dcfg
        return DraftCaches(self.held, d.num_hidden_layers, d.num_key_value_heads // self.tp, d.head_dim, capacity,
                           ACT_NUMPY[self.act], limit)

    # the model, graph by graph -----------------------------------------------------------------------
    def graph_run(self, kind: str, fn, args: tuple, feeds: list, layer: int | None = None) -> list[dict]:
        """description/stack.py's run over the graphs: the graph kind the engine exported for `kind` (the drafter's
        block embedding is the target's embed graph; fn and args are in the graph already)."""
        return self.run("embed" if kind == "draft_embed" else kind, feeds, layer=layer)

    def target_forward(self, ids, pos, tree_mask, caches: TargetCaches, taps=(), temperature: float = 0.0,
                       seed: int = 0) -> TargetOut:
        """ids [q], pos [q], tree_mask [q, W] int32 bits among the new tokens (the cache prefix is all
        visible) -> logits, taps, per-rank sampling winners at positions pos + 1."""
        T = caches.length
        feeds = {"ids": np.asarray(ids, np.int32), "pos": np.asarray(pos, np.int32),
                 "cache_len": np.array([T], np.int32), "tree_mask": np.asarray(tree_mask, np.int32)}
        head = {"sample_pos": feeds["pos"] + 1, "temperature": np.array([temperature], np.float32),
                "seed": np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint32).view(np.int32)}
        tapped = {}
        # the graphs hold their shapes and arguments: moe_inter (None here) and fn's args are not read
        outs = stack.target_forward(self.stack_run, self.cfg, None, feeds, caches, taps,
                                    lambda L, h: tapped.__setitem__(L, self._same_values(h, "h_out")),
                                    head_feeds=head)
        caches.length = T + len(feeds["ids"])
        logits = np.concatenate(outs["logits"], axis=1)
        return TargetOut(logits, tapped, (np.stack(outs["win_value"]), np.stack(outs["win_id"])))

    def drafter_forward(self, block_ids, pos, ctx_taps, caches: DraftCaches) -> DraftOut:
        """block_ids [b], pos [b], ctx_taps [n, K H] of the tokens committed since the last call."""
        T = caches.length
        feeds = {"ctx_taps": self._act(ctx_taps), "ids": np.asarray(block_ids, np.int32),
                 "pos": np.asarray(pos, np.int32), "cache_len": np.array([T], np.int32)}
        outs = stack.drafter_forward(self.stack_run, self.cfg, self.dcfg, feeds, caches,
                                     head=(layers.draft_head, (None,)))       # k: the graph's own
        caches.length = T + len(ctx_taps)
        cands = {k: np.stack(outs[k]) for k in ("topk_values", "topk_ids", "row_max", "row_sumexp")}
        return DraftOut(np.concatenate(outs["logits"], axis=1), cands)

    def compact(self, caches: TargetCaches, start: int, accepted, count: int) -> None:
        """The walk's accepted rows of a verify at `start` kept at start.. in every layer (the compact graph)."""
        stack.compact(self.stack_run, self.cfg, {"cache_len": np.array([start], np.int32),
                                                 "accepted": np.asarray(accepted, np.int32),
                                                 "accepted_count": np.array([count], np.int32)}, caches)
        caches.length = start + count

    def tree_build(self, root: int, candidates: dict, budget: int) -> dict[str, np.ndarray]:
        root = np.array([root], np.int32)
        outs = self.run(f"tree_b{budget}", [{"root": root, **{k: v[r] for k, v in candidates.items()}}
                                            for r in range(self.held)])
        return {k: self._same(outs, k) for k in ("tokens", "parents", "depth", "visibility")}

    def accept(self, tokens, parents, winners) -> dict[str, np.ndarray]:
        common = {"tokens": np.asarray(tokens, np.int32), "parents": np.asarray(parents, np.int32)}
        outs = self.run("accept", [{**common, "win_value": winners[0][r], "win_id": winners[1][r]}
                                   for r in range(self.held)])
        return {k: self._same(outs, k) for k in ("target_tokens", "accepted", "accepted_count", "bonus")}


def load_graphs(engine_dir) -> list[dict[str, LayerGraph]]:
    """The engine's graphs/rank<r>/*.onnx with their index entries."""
    index_path = ed.graphs_index_path(engine_dir)
    if not index_path.is_file():
        raise ed.EngineFormatError(f"{index_path}: missing (build the engine with graphs: ddtree-build "
                                   "without --no-graphs)")
    index = json.loads(index_path.read_text())
    out = []
    for files in index["ranks"]:
        out.append({kind: LayerGraph(kind, onnx.load(Path(engine_dir) / rel), index["kinds"][kind]["layers"],
                                     index["kinds"][kind]["weight_prefix"]) for kind, rel in files.items()})
    return out
