"""Request lanes of one GPU (issue 51): `--max-num-seqs N` on a tp 1 CudaExecutor keeps N requests on the device.

    pool = ex.lane_pool(4)                  # 4 lanes (memory checked before any is allocated), kept for later
    lane = pool.acquire()                   # a LaneView: the executor with this lane's caches and step state
    steps = ddtree_steps(lane, ids, ..., union=True)    # yields loop.Fused before each step (runtime/batch.py)
    tokens = pool.steps([fused, ...])       # the lanes' steps: ready ones in ONE batched graph (cuda_step_batch.py)
    pool.release(lane)

A lane is what one request needs on the device beside the weights: its target and drafter caches (max_context rows
each), its GpuSteps state (the device state and record ring, the drafter's context window, the tap rows, its tree
builders and sampler: each lane samples with its own parameters and seed) and its own CudaOps (its own arena and
launcher workspaces, so lanes' drafts, walks and compactions can run as parallel branches of one graph without
sharing a buffer they write). The weights (CudaWeights) are the executor's, shared. A LaneView is the executor
seen through that lane: the primitives (prefill, the composition's steps) are the executor's own methods on the
lane's caches; new_target_cache / new_drafter_cache hand out the lane's; ddtree_step / ar_step are the lane's
GpuSteps (one request alone: what a lane does when it cannot join the batched graph).
"""
from __future__ import annotations

import copy

from ddtree.backends.cuda_backend import CudaOps
from ddtree.plugins.device import _driver, check
from ddtree.runtime.cuda_model import HeldCaches, device_caches
from ddtree.runtime.cuda_step import GpuSteps
from ddtree.runtime.cuda_step_batch import BatchSteps
from ddtree.runtime.loop import RequestError

LANE_WORKSPACE_BYTES = 64 << 20     # a lane's arena and launcher workspaces (the drafter, walk, compaction), stated


class LaneView(HeldCaches):
    """The executor seen through lane `index`: its caches and step state (the module docstring)."""

    def __init__(self, ex, index: int):
        self.ex, self.index = ex, index
        self.ops = CudaOps(ex.gpu, ex.lay, ex.store, kernel_plan=ex.kernel_plan)
        self.target_cache, self.draft_cache = device_caches(ex.gpu, ex.config, ex.drafter_config, ex.lay.tp,
                                                            ex.max_context)
        self.steps = GpuSteps(self)
        self.steps.pipeline = False         # a lane's step is never enqueued ahead: the next may be a batched one

    def __getattr__(self, name):            # config, gpu, store, the primitives ...: the executor's
        return getattr(self.ex, name)

    def ar_step(self, state, params):
        return self.steps.ar_step(state, params)

    def ddtree_step(self, state, params, budget: int):
        return self.steps.ddtree_step(state, params, budget)

    def drafter_prefill(self, state) -> None:
        self.steps.drafter_prefill(state)


def lane_bytes(ex) -> int:
    """One lane's device bytes: its caches (the executor's memory plan's KV) and LANE_WORKSPACE_BYTES."""
    return int(ex.memory_plan["KV"]) + LANE_WORKSPACE_BYTES


class LanePool:
    def __init__(self, ex):
        if ex.lay.tp != 1 or ex.steps is None:
            raise RequestError("--max-num-seqs > 1: the GPU's request lanes need a tp 1 engine with step graphs "
                               f"(this one: tp {ex.lay.tp}, graphs {'on' if ex.steps is not None else 'off'})")
        self.ex, self.lanes, self.free = ex, [], []
        self.batch = BatchSteps(ex)

    def grow(self, lanes: int) -> "LanePool":
        """At least `lanes` request slots, the new ones refused before any is allocated when they do not fit the
        GPU's free memory."""
        new = lanes - len(self.lanes)
        if new <= 0:
            return self
        free, _ = check(_driver().cuMemGetInfo(), "cuMemGetInfo")
        each = lane_bytes(self.ex)
        if new * each > free:
            raise RequestError(f"--max-num-seqs {lanes}: {new} more request lanes need {new * each / 2**30:.2f} GiB "
                               f"(each {each / 2**20:.1f} MiB: caches of --max-context {self.ex.max_context} rows + "
                               f"workspaces) but the GPU has {free / 2**30:.2f} GiB free: lower --max-num-seqs or "
                               "--max-context")
        for i in range(len(self.lanes), lanes):
            lane = LaneView(self.ex, i)
            self.lanes.append(lane)
            self.free.append(lane)
        return self

    def acquire(self) -> LaneView:
        if not self.free:
            raise RequestError(f"every request lane is taken ({len(self.lanes)}, --max-num-seqs)")
        return self.free.pop(0)

    def release(self, lane: LaneView) -> None:
        self.batch.forget(lane)
        lane.steps.drain()
        if lane not in self.free:
            self.free.append(lane)
            self.free.sort(key=lambda v: v.index)

    def steps(self, fused: list) -> list:
        """The steps of loop.Fused items (each on its own lane; budget None: an AR step) -> each one's committed
        tokens, or the exception its step raised. Those the batched graph can take (a step its lane's graph could
        take, without --budget auto's table or pruning) run as one graph per (budget, block size), the AR steps as
        one AR graph; the others alone, in order.
        A round of one graph whose every lane surely steps again (the furthest its step can reach leaves room for
        another) enqueues the next round's step before reading this one's records (BatchSteps.step ahead); a
        round that differs from it takes the step in flight for the lanes it has (BatchSteps.settle)."""
        out: list = [None] * len(fused)
        batch = self.batch
        if batch.inflight is not None:
            lanes, budget = batch.inflight[0], batch.inflight[1]
            present = {f.ex.index: (i, f.state) for i, f in enumerate(fused)
                       if f.ex in lanes and f.budget == budget}
            exact = len(present) == len(lanes) == len(fused)
            if not exact:
                try:
                    settled = batch.settle({k: (fused[i].ex, st) for k, (i, st) in present.items()})
                except Exception as e:            # the step in flight failed: each of its requests' error
                    settled = {k: e for k in present}
                for k, tokens in settled.items():
                    out[present[k][0]] = tokens
        groups: dict[tuple, list[int]] = {}
        for i, f in enumerate(fused):
            if out[i] is not None:
                continue
            if batch.can_take(f.ex, f.state, f.budget):
                groups.setdefault((f.budget, f.state.block), []).append(i)
            else:
                out[i] = _guarded(lambda f=f: f.ex.ar_step(f.state, f.params) if f.budget is None
                                  else f.ex.ddtree_step(f.state, f.params, f.budget))
        alone = any(r is not None for r in out)
        for (budget, _), idx in groups.items():
            ahead = len(groups) == 1 and not alone and all(_steps_again(fused[i], budget) for i in idx)
            try:
                tokens = batch.step([(fused[i].ex, fused[i].state, fused[i].params) for i in idx], budget, ahead)
            except Exception as e:                  # the batched step's error is each of its requests'
                batch.inflight = None
                tokens = [e] * len(idx)
            for i, t in zip(idx, tokens):
                out[i] = t
        return out


def _steps_again(f, budget: int | None) -> bool:
    """Whether f's lane surely takes another batched step after this one (GpuSteps.ddtree_step's / ar_step's test
    for a step enqueued ahead: even the longest acceptance leaves tokens to make, and that step fits the graph)."""
    if budget is None:
        return f.state.start + 2 < min(f.state.end, f.ex.max_context)
    nxt = copy.copy(f.state)
    nxt.start += nxt.block
    return nxt.start < nxt.end and f.ex.steps.graph_ready(nxt, budget)


def _guarded(fn):
    try:
        return fn()
    except Exception as e:
        return e
