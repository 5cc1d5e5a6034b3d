"""Launchers of the pruned verify's small kernels (kernels/prune_ops.cu; issue 53) and their numpy twins.

    k = PruneOps(gpu)
    k.mask_dead(tokens, live, tokens_out, n, stream)                   # the tree as a pruned walk sees it
    table = CalibrationTable.of(calibration, depths)                   # the calibration maps, packed for the device
    k.path_probs(scores, parents, depth, n, table_dev, rate_terms, path_prob, rate, stream)

A dead row's routing (its pairs on the root's experts at weight 0) is applied inside the routing kernels, before
their alignment (kernels/route_common.cuh live_rows, in router.cu and moe.cu moe_route): live_args gives them its
pointer arguments, route_live_twin is its numpy twin.

Every tensor argument is a device address (a DeviceArray, an int or a Tensor's .ptr); one block a launch; nothing
is allocated or synchronised, so the launches can be captured in a CUDA graph. Letters: q rows (= n tree nodes),
k = topk, D drafter depths, P points of a calibration map.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddtree.plugins.device import Gpu, ptr
from ddtree.tree.budget import path_probs
from ddtree.tree.prune import MAX_NODES, PruneError

SOURCE = "prune_ops.cu"
THREADS = 256                   # PO_THREADS


def route_live_twin(ids, weights, live) -> tuple:
    """-> (ids [q, k] as the experts read them, weights [q, k], routed_ids [q, k] = the ids as routed). A dead row
    (live 0, not row 0 = the root) takes the root's experts with weight 0: it reads no expert a live row does not
    (the routing kernels' live_rows, applied before their alignment)."""
    ids, weights = np.array(ids, np.int32), np.array(weights, np.float32)
    routed = ids.copy()
    dead = np.asarray(live).reshape(-1) == 0
    dead[0] = False
    ids[dead] = ids[0]
    weights[dead] = 0.0
    return ids, weights, routed


def live_args(who: str, ids, weights, given: bool, live=None, routed_ids=None, live_ids=None, live_w=None) -> tuple:
    """The four live-mask pointer arguments both routing kernels take after their own (router.cu, moe.cu moe_route:
    live, routed_ids, live_ids, live_w; all null without a mask). live [M] int32: a pruned verify's mask (row 0, the
    root, is live whatever it says); routed_ids [M, topk] int32 (written: the ids as routed); live_ids / live_w
    [M, topk] (written: what the alignment and the experts read, dead rows on the root's experts at weight 0):
    ids / weights themselves by default (in place, the router's own buffers), other buffers for a given routing
    (which must name them: its buffers are the caller's and stay as given)."""
    if live is None:
        if routed_ids is not None or live_ids is not None or live_w is not None:
            raise ValueError(f"{who}: routed_ids / live_ids / live_w given without a live mask")
        return ptr(None), ptr(None), ptr(None), ptr(None)
    if routed_ids is None:
        raise ValueError(f"{who}: a live mask needs routed_ids ([M, topk] int32, the ids as routed)")
    if (live_ids is None) != (live_w is None):
        raise ValueError(f"{who}: live_ids and live_w go together (both or neither)")
    if live_ids is None:
        if given:
            raise ValueError(f"{who}: a given routing with a live mask needs live_ids / live_w (the given "
                             "buffers stay as given)")
        live_ids, live_w = ids, weights
    if (ptr(live_ids) == ptr(ids)) != (ptr(live_w) == ptr(weights)):
        raise ValueError(f"{who}: live_ids / live_w must both be the routing's own buffers or both other ones")
    return ptr(live), ptr(routed_ids), ptr(live_ids), ptr(live_w)


def mask_dead_twin(tokens, live) -> np.ndarray:
    """tokens [n] with dead nodes' (not the root's) -1: tree/prune.py absent_tree's tokens."""
    live = np.asarray(live).reshape(-1) != 0
    live[0] = True
    return np.where(live, np.asarray(tokens), -1).astype(np.int32)


@dataclass
class CalibrationTable:
    """tree/budget.py Calibration as the kernel reads it: x, y [D, P] float32 (depth d's map in row d - 1, its
    own or the pooled one, padded by repeating its last point), n [D] int32 points per row."""
    x: np.ndarray
    y: np.ndarray
    n: np.ndarray

    @classmethod
    def of(cls, calibration, depths: int, points: int | None = None) -> "CalibrationTable":
        """calibration None: the raw drafter probabilities (the identity map). points: P (a buffer's fixed width;
        None: the longest map's)."""
        maps = []
        for d in range(1, depths + 1):
            if calibration is None:
                maps.append({"x": [0.0, 1.0], "y": [0.0, 1.0]})
            else:
                own = calibration.depths[d - 1] if d <= len(calibration.depths) else None
                maps.append(own or calibration.pooled)
        P = max(len(m["x"]) for m in maps) if points is None else points
        if any(len(m["x"]) > P for m in maps):
            raise PruneError(f"CalibrationTable: a calibration map has more than {P} points "
                             f"({[len(m['x']) for m in maps]}); the device table holds {P}")
        x, y = np.zeros((depths, P), np.float32), np.zeros((depths, P), np.float32)
        for r, m in enumerate(maps):
            k = len(m["x"])
            x[r, :k], y[r, :k] = m["x"], m["y"]
            x[r, k:], y[r, k:] = m["x"][-1], m["y"][-1]
        return cls(x, y, np.array([len(m["x"]) for m in maps], np.int32))

    def interp(self, p, depth) -> np.ndarray:
        """The maps applied as the kernel does (np.interp in float64 on the float32 points)."""
        p, depth = np.asarray(p, np.float64), np.asarray(depth)
        out = np.empty(p.shape)
        for i, (v, d) in enumerate(zip(p.reshape(-1), depth.reshape(-1))):
            r = min(max(int(d), 1), len(self.n)) - 1
            k = int(self.n[r])
            out.reshape(-1)[i] = np.interp(v, self.x[r, :k].astype(np.float64), self.y[r, :k].astype(np.float64))
        return out


def path_probs_twin(scores, parents, depth, table: CalibrationTable, rate_terms) -> tuple:
    """-> (path_prob [n] float32, rate float32): tree/prune.py node_path_probs from the tree's fp32 path
    log-probabilities (edge p = exp(score - parent's score)), and base + per_token x the sum of path_prob."""
    scores, parents = np.asarray(scores, np.float32).astype(np.float64), np.asarray(parents, np.int64)
    edge = np.ones(len(scores))
    rows = np.arange(1, len(scores))
    edge[rows] = table.interp(np.exp(scores[rows] - scores[parents[rows]]), np.asarray(depth)[rows])
    path = path_probs(parents, edge).astype(np.float32)
    base, per_token = (float(v) for v in np.asarray(rate_terms, np.float32))
    expected = 0.0
    for p in path:                                    # in node order, as the kernel's one thread sums
        expected += float(p)
    return path, np.float32(base + per_token * expected)


class PruneOps:
    def __init__(self, gpu: Gpu):
        self.gpu = gpu

    def _launch(self, name: str, *args, stream=None) -> None:
        self.gpu.launch(self.gpu.kernel(SOURCE, name), 1, THREADS, 0, *args, stream=stream)

    def mask_dead(self, tokens, live, tokens_out, n: int, stream=None) -> None:
        self._launch("mask_dead", ptr(tokens), ptr(live), ptr(tokens_out), np.int32(n), stream=stream)

    def path_probs(self, scores, parents, depth, n: int, table: dict, rate_terms, path_prob, rate,
                   stream=None) -> None:
        """table: {"x", "y", "n"} device arrays of a CalibrationTable (uploaded once); rate_terms [2] float32
        (base, per_token) -> path_prob [n] float32, rate [1] float32."""
        if not 1 <= n <= MAX_NODES:
            raise PruneError(f"PruneOps.path_probs: {n} nodes; the kernel's one block takes 1..{MAX_NODES}")
        D, P = table["x"].shape
        self._launch("prune_path_probs", ptr(scores), ptr(parents), ptr(depth), np.int32(n), ptr(table["x"]),
                     ptr(table["y"]), ptr(table["n"]), np.int32(D), np.int32(P), ptr(rate_terms), ptr(path_prob),
                     ptr(rate), stream=stream)
