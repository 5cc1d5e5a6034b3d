"""The batched DDTree step on one GPU (issue 51): R requests' steps as ONE captured CUDA graph.

    batch = BatchSteps(ex)                            # ex: a tp 1 CudaExecutor
    tokens = batch.step([(lane, state, params), ...], budget)     # one replay, one record read per lane

Each lane (runtime/cuda_lanes.py LaneView) is one request with its own caches, device state, window, tree builder and
sampler. One graph per (lanes, budget, block size, the lanes' sampling modes):
    fork          R parallel branches (cuda.core GraphBuilder.split), lane i on branch i with its own CudaOps:
      draft       its prologue and the drafter over its window (its drafter cache)       (GpuSteps phases, as alone)
      tree        its best-first tree of `budget` nodes (its builder)
    join
    verify        the R trees in ONE target forward on the executor's ops: tokens and positions copied into the
                  union rows [R n] (request i's rows i n .. (i+1) n), each request's append and tree attention on
                  its own cache, length and tree mask, every other op over the union rows (description/stack.py
                  target_forward(requests=R), runtime/cuda_model.py union_layers; R = 1: the one-request verify);
                  each request's taps copied into its lane's tap rows; head_logits over the union rows [R n, V]
    fork
      sample+walk lane i: the sampling definition at its n nodes (rows i n ..), its walk (its parameters, its seed)
      update      its compaction, window and record
    join
Every lane's launches are the ones its GpuSteps would make alone; the verify's rows are each what they are alone
(row-wise ops; under --kernel-plan batch-invariant bitwise so: tests/runtime/test_cuda_batch_gpu.py). The first
step of a key runs eagerly (the lanes one after another on the GPU's stream), then the same launches are captured.
A lane whose step the graph cannot take (the first steps after a short prompt, the last near the caches' end,
--budget auto, --prune auto) takes its step alone (cuda_lanes.py LanePool.steps). AR steps (budget None) batch the
same way, one graph a lane set: each lane's prologue, the R tokens in one union forward, head logits [R, V], each
lane's sampler and commit (_ar_body).
"""
from __future__ import annotations

import time

import numpy as np

from ddtree.backends.cuda_tensor import Tensor, dense_strides
from ddtree.description import layers
from ddtree.plugins.device import DeviceArray
from ddtree.runtime.cuda_model import target_layers, union_layers

DRAFT, FINISH = ("draft", "tree"), ("sample_walk", "update")


class BatchSteps:
    def __init__(self, ex):
        self.ex, self.gpu, self.ops = ex, ex.gpu, ex.ops
        self.graphs: dict[tuple, object] = {}
        self.feeds: dict[tuple, dict] = {}          # (R, budget) -> the union verify's device feeds
        self.capture_s, self.batched_steps, self.lane_steps = 0.0, 0, 0
        self.inflight: tuple | None = None          # (lanes, budget, graph key, event) of a step enqueued ahead
        self.ahead_steps = 0

    def can_take(self, lane, s, budget: int | None) -> bool:
        """Whether lane's step joins the batched graph: its own graph could take it (GpuSteps.graph_ready; AR,
        budget None: its token inside the caches), and it has no --budget auto table or pruned verify."""
        if getattr(lane, "steps", None) is None or s.cache is not lane.target_cache:
            return False
        if budget is None:
            return s.start + 1 <= self.ex.max_context
        return (s.table_k is None and s.prune is None and budget + 1 <= self.ops.max_tokens
                and lane.steps.graph_ready(s, budget))

    # ---- the graph body ------------------------------------------------------------------------------
    def _union_feeds(self, R: int, budget: int) -> dict:
        """(R, budget)'s device buffers: ids, pos [R n], cache_len [R], row_offsets [R + 1] (its host copy: the
        per-request launches need their rows when they are recorded; fixed per graph)."""
        key = (R, budget)
        if key not in self.feeds:
            g, n = self.gpu, budget + 1
            offsets = (np.arange(R + 1) * n).astype(np.int32)
            self.feeds[key] = {"ids": g.alloc((R * n,), np.int32), "pos": g.alloc((R * n,), np.int32),
                               "cache_len": g.alloc((R,), np.int32),
                               "row_offsets": Tensor.of(g.upload(offsets), host=offsets)}
        return self.feeds[key]

    def _body(self, lanes: list, budget: int, b: int) -> None:
        ex, ops, g, n = self.ex, self.ops, self.gpu, budget + 1
        R = len(lanes)
        u = self._union_feeds(R, budget) if R > 1 else None
        branches = self._fork(R)
        for i, (lane, stream) in enumerate(zip(lanes, branches)):
            lane.ops.stream = stream
            lane.steps._ddtree_body(budget, b, only=DRAFT)
            if u is not None:                            # its rows of the union, copied on its own branch
                t = lane.steps.values[(budget, b)]["tree"]
                g.copy_d2d(u["ids"].ptr + 4 * i * n, t.tokens.ptr, 4 * n, stream=stream)
                g.copy_d2d(u["pos"].ptr + 4 * i * n, t.positions.ptr, 4 * n, stream=stream)
                g.copy_d2d(u["cache_len"].ptr + 4 * i, lane.target_cache.dev.lengths.ptr, 4, stream=stream)
        self._join(branches)
        trees = [lane.steps.values[(budget, b)]["tree"] for lane in lanes]
        S = ops.stream
        for lane in lanes:                                # the taps' gathers ride the verify's stream
            lane.ops.stream = S
        if R == 1:
            t = trees[0]
            W = t.vis.shape[1]
            feeds = {"ids": Tensor.of(t.tokens), "pos": Tensor.of(t.positions),
                     "cache_len": Tensor.of(lanes[0].target_cache.dev.lengths),
                     "tree_mask": Tensor(t.vis.ptr, (n, W), np.dtype(np.int32), dense_strides((n, W)))}
            h = target_layers(ex, feeds, lanes[0].target_cache, lanes[0].steps._copy_tap, lanes[0].steps.taps)
        else:
            feeds = {"ids": Tensor.of(u["ids"]), "pos": Tensor.of(u["pos"]), "cache_len": Tensor.of(u["cache_len"]),
                     "row_offsets": u["row_offsets"]}
            for i, t in enumerate(trees):
                W = t.vis.shape[1]
                feeds[f"tree_mask.{i}"] = Tensor(t.vis.ptr, (n, W), np.dtype(np.int32), dense_strides((n, W)))
            H = ex.config.hidden_size

            def tap(L: int, h: Tensor) -> None:          # request i's rows of the union -> its lane's tap rows
                for i, lane in enumerate(lanes):
                    lane.steps._copy_tap(L, h.at(i * n * H, (n, H)))
            h = union_layers(ex, feeds, [lane.target_cache for lane in lanes], tap, lanes[0].steps.taps)
        logits = ops.call(layers.head_logits, ex.config, feeds={"h": h})["logits"]          # [R n, V] float32
        V = logits.shape[1]
        branches = self._fork(R)
        for i, (lane, stream) in enumerate(zip(lanes, branches)):
            lane.steps.values[(budget, b)]["logits"] = logits.at(i * n * V, (n, V))
            lane.ops.stream = stream
            lane.steps._ddtree_body(budget, b, only=FINISH)
        self._join(branches)

    def _ar_body(self, lanes: list) -> None:
        """R AR steps: each lane's prologue (its bonus token at its start), the R tokens in one union forward (a
        request's row sees its own cache and itself), head logits [R, V], each lane's sampler and commit."""
        if len(lanes) == 1:
            lanes[0].ops.stream = self.ops.stream
            lanes[0].steps._ar_body()
            return
        ex, ops, g = self.ex, self.ops, self.gpu
        S, u = ops.stream, self._union_feeds(len(lanes), 0)              # one row a request
        for i, lane in enumerate(lanes):
            st, lengths = lane.steps, lane.target_cache.dev.lengths
            st.state.prologue(1, 0, 0, st.block_ids, st.block_pos, None, lengths, stream=S)
            g.copy_d2d(u["ids"].ptr + 4 * i, st.block_ids.ptr, 4, stream=S)
            g.copy_d2d(u["pos"].ptr + 4 * i, st.block_pos.ptr, 4, stream=S)
            g.copy_d2d(u["cache_len"].ptr + 4 * i, lengths.ptr, 4, stream=S)
        feeds = {"ids": Tensor.of(u["ids"]), "pos": Tensor.of(u["pos"]), "cache_len": Tensor.of(u["cache_len"]),
                 "row_offsets": u["row_offsets"],
                 **{f"tree_mask.{i}": Tensor.of(lane.steps.ar_mask) for i, lane in enumerate(lanes)}}
        h = union_layers(ex, feeds, [lane.target_cache for lane in lanes])
        logits = ops.call(layers.head_logits, ex.config, feeds={"h": h})["logits"]           # [R, V] float32
        V = logits.shape[1]
        for i, lane in enumerate(lanes):
            st = lane.steps
            row = logits.at(i * V, (1, V))
            out = st.sampler.launch(st.plan, DeviceArray(g, row.ptr, row.shape, row.dtype), st.block_pos, 1, stream=S)
            st.state.commit(None, None, None, out.target, status=(st.sampler.status, None), stream=S)

    def _fork(self, R: int) -> list:
        """R streams for the lanes: parallel graph builders while capturing (the first is the ops' own), the
        GPU's stream (None: in order) when eager."""
        S = self.ops.stream
        if S is None or R == 1:
            return [S] * R
        builders = S.split(R)
        if builders[0] is not S:
            raise RuntimeError("batched step: GraphBuilder.split did not return the ops' builder first")
        return list(builders)

    def _join(self, branches: list) -> None:
        if len(branches) > 1 and branches[0] is not None:
            joined = type(branches[0]).join(*branches)
            if joined is not branches[0]:
                raise RuntimeError("batched step: GraphBuilder.join did not keep the ops' builder")
            self.ops.stream = joined

    # ---- capture, replay -----------------------------------------------------------------------------
    def _all_ops(self, lanes) -> list:
        return [self.ops] + [lane.ops for lane in lanes]

    def _eager(self, lanes, budget: int | None, b: int) -> None:
        every = self._all_ops(lanes)
        for o in every:
            o.graph_plans = True
        try:
            self._ar_body(lanes) if budget is None else self._body(lanes, budget, b)
            self.gpu.sync()
        finally:
            for o in every:
                o.graph_plans, o.stream = False, None

    def _capture(self, lanes, budget: int | None, b: int):
        every = self._all_ops(lanes)

        def record(builder):
            for o in every:
                o.capturing, o.graph_plans, o.stream = True, True, None
            self.ops.stream = builder
            self._ar_body(lanes) if budget is None else self._body(lanes, budget, b)
            for o in every:                             # the prefetch branches the last calls left open
                o.join_pending(every=True)
        for o in every:                                 # an eager run's, before the capture
            o.join_pending(every=True)
        try:
            return self.gpu.capture(record)
        finally:
            for o in every:
                o.capturing, o.graph_plans, o.stream = False, False, None

    def step(self, items: list, budget: int | None, ahead: bool = False) -> list:
        """items [(lane, DecodeState, SamplingParams)] (distinct lanes, one block size, each can_take) -> each
        lane's committed tokens (accepted drafts in depth order, then the new bonus; budget None: AR steps, the
        next token), in the order given.
        ahead: enqueue the same lanes' next step before this one's records are read (the caller knows every lane
        takes it: LanePool.steps); the next call with the same lanes and budget takes it (settle, otherwise)."""
        given = items
        items = sorted(items, key=lambda item: item[0].index)      # one graph per lane set, whatever the order
        lanes = [lane for lane, _, _ in items]
        if len({lane.index for lane in lanes}) != len(lanes):
            raise ValueError("batched step: a lane appears twice")
        b = items[0][1].block
        if any(s.block != b for _, s, _ in items):
            raise ValueError("batched step: the lanes' block sizes differ (one graph has one)")
        inflight, self.inflight = self.inflight, None
        if inflight is not None and inflight[0] == lanes and inflight[1] == budget:
            key, event = inflight[2], inflight[3]             # this step is on the GPU already
        else:
            if inflight is not None:
                raise RuntimeError("batched step: a step in flight for other lanes was not settled")
            key = self._launch(items, budget, b)
            event = self.gpu.stream.record()
        if ahead and key in self.graphs and key[0] == tuple(lane.index for lane in lanes):  # (not a lane forgotten)
            self.gpu.replay(self.graphs[key])
            self.inflight = (lanes, budget, key, self.gpu.stream.record())
            self.ahead_steps += 1
        event.sync()
        self.batched_steps += 1
        self.lane_steps += len(items)
        tokens = {lane.index: self._finish(lane, s, budget is None) for lane, s, _ in items}
        return [tokens[lane.index] for lane, _, _ in given]

    def _launch(self, items: list, budget: int | None, b: int) -> tuple:
        """The lanes' device state readied and their graph launched (run eagerly and captured the first time)."""
        lanes, modes = [lane for lane, _, _ in items], []
        for lane, s, params in items:
            st = lane.steps
            st.drain()
            if budget is not None:
                st._enter_window(s)
            st._sync_state(s.start, s.bonus)
            modes.append(st.set_params(params).mode)
        key = (tuple(lane.index for lane in lanes), budget, b, tuple(modes))
        if key in self.graphs:
            self.gpu.replay(self.graphs[key])
        else:
            self._eager(lanes, budget, b)
            t0 = time.perf_counter()
            self.graphs[key] = self._capture(lanes, budget, b)
            self.capture_s += time.perf_counter() - t0
        return key

    def settle(self, present: dict) -> dict:
        """The step in flight when the next round is not its lanes at its budget: present {lane index: (lane,
        DecodeState)} (the round's steps at that budget) -> {lane index: tokens} for its lanes that are present
        (that step is theirs); its others (finished, cancelled) are forgotten."""
        if self.inflight is None:
            return {}
        lanes, budget, _, event = self.inflight
        self.inflight = None
        event.sync()
        out = {}
        for lane in lanes:
            if lane.index in present:
                out[lane.index] = self._finish(lane, present[lane.index][1], budget is None)
            else:
                self._drop(lane)
        return out

    def forget(self, lane) -> None:
        """A lane given back (runtime/cuda_lanes.py LanePool.release) while a step of it is in flight: that
        step still runs (ordered before anything the lane's next request launches) but is nobody's."""
        if self.inflight is not None and lane in self.inflight[0]:
            lanes, budget, key, event = self.inflight
            self.inflight = ([v for v in lanes if v is not lane], budget, key, event)
            self._drop(lane)

    @staticmethod
    def _drop(lane) -> None:
        st = lane.steps
        st.state.steps += 1                                  # its record is written, never read
        st.synced, st.in_window = None, 0

    @staticmethod
    def _finish(lane, s, ar: bool = False) -> list[int]:
        """Lane's record of the step just run -> its tokens; the host's DecodeState advanced (GpuSteps.ddtree_step,
        ar_step)."""
        st = lane.steps
        rec = st.read_record()
        st._check_follows(rec, s.start)
        old = s.start
        s.start, s.bonus = rec["start"], rec["tokens"][-1]
        s.cache.length = s.start
        if ar:
            st.synced = (s.start, s.bonus)
            return rec["tokens"]
        s.dcache.length = old
        st.synced, st.in_window = (s.start, s.bonus), rec["count"]
        return rec["tokens"]

    def stats(self) -> dict:
        return {"batched_steps": self.batched_steps, "batched_lane_steps": self.lane_steps,
                "batched_capture_s": self.capture_s, "batched_graphs": len(self.graphs),
                "batched_ahead_steps": self.ahead_steps}
