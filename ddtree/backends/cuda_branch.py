"""Parallel branches of a CudaOps launch sequence: launches forked off the current stream run beside the ones
that follow, until a join. Latency-bound kernels leave most SMs idle (the fused router's one-block routing, the
skinny GEMMs' tails); a branch lets independent work fill them (CudaOps.moe: the shared expert beside the router;
layers.mla_attention: the next GEMMs' weights prefetched into L2 beside the tree attention).

    with ops.branch() as b:             # the op set's branch (description/opset.py): launches in here go to the branch
        y = ops.swiglu_mlp(x, ...)
    ... launches on the main stream ...
    ops.join(b)                         # what follows waits for both

BranchOps (mixed into CudaOps) implements the op set's branch / join with a Fork: None (in order) when
ops.branches is off or the stream cannot fork (a TensorRT plugin's raw stream).

In a captured graph the branch is a builder split from the ops' builder (cuda.core GraphBuilder.split / join: two
parallel chains of nodes); eagerly it is a second stream that waits on the GPU's stream. Buffers: every op site
has its own arena buffer and every launcher its own workspace, and a branch launches through launchers of its
own (CudaOps.launcher keys them by the branch's lane), so it shares nothing it writes with a parallel chain.
"""
from __future__ import annotations

from contextlib import contextmanager

from ddtree.plugins.prefetch import L2Prefetch, chunk_for, per_site, site_of


class Fork:
    def __init__(self, main, side, lane):
        self.main, self.side_stream, self.lane = main, side, lane     # main None: eager (the GPU's stream)

    @staticmethod
    def of(ops, lane) -> "Fork | None":
        """lane: the branch's eager side stream and its launchers' key (CudaOps.launcher): two branches open at
        once (or a branch and the prefetches, joined only at the end of a call) neither queue behind each other
        eagerly nor share a launcher's workspace (a GEMM's split-K partials) while capturing."""
        if not getattr(ops, "branches", False):
            return None
        s = ops.stream
        if s is None:                                     # eager: a second stream, after all launched so far
            streams = ops.__dict__.setdefault("_side_streams", {})
            if lane not in streams:
                streams[lane] = ops.gpu.dev.create_stream()
            streams[lane].wait(ops.gpu.stream)
            return Fork(None, streams[lane], lane)
        if hasattr(s, "split") and hasattr(s, "is_join_required"):     # a graph builder while capturing
            main, side = s.split(2)
            if main is not s:
                raise RuntimeError("cuda backend: GraphBuilder.split did not return the ops' builder first")
            return Fork(main, side, lane)
        return None                                       # another stream kind (a TensorRT plugin's): in order

    @contextmanager
    def side(self, ops):
        outer = ops.stream, ops.lane
        ops.stream, ops.lane = self.side_stream, self.lane
        try:
            yield
        finally:
            ops.stream, ops.lane = outer

    def join(self, ops) -> None:
        if self.main is None:
            ops.gpu.stream.wait(self.side_stream)
            return
        joined = type(self.main).join(self.main, self.side_stream)
        if joined is not self.main:
            raise RuntimeError("cuda backend: GraphBuilder.join did not keep the ops' builder")
        ops.stream = self.main


class BranchOps:
    """The op set's scheduling hints in the cuda backend: branch / join (above) and prefetch: the weights a
    layer reads next staged in L2 (plugins/prefetch.py) within `prefetch_bytes` (0: off; or {site: bytes}), in
    the order given (the first readers first; a buffer that does not fit the rest of the budget ends the list),
    one launch on a branch of its own that nothing waits for until the end of the NEXT call (join_pending:
    CudaOps.call) or of the captured graph (join_pending(every=True)). A prefetch writes nothing a kernel reads, so
    no later op needs to wait for it; waiting at o_proj cost more than it saved (the launch takes ~10 us for 15 MB:
    ddtree/plugins/kernels/NOTES.md), and joining the one beside the MLP's all-reduce at the end of its own layer
    made the next layer's first kernel wait for it (8 us a layer on the H100 under copy stand-ins: bench step
    --timeline, issue 48)."""

    @contextmanager
    def branch(self):
        opened = self.__dict__.setdefault("_open", [])
        lane = min(set(range(1, len(opened) + 2)) - {f.lane for f in opened})     # the lowest lane not open
        fork = Fork.of(self, lane)
        if fork is None:
            yield None
            return
        opened.append(fork)
        with fork.side(self):
            yield fork

    def join(self, b) -> None:
        if b is not None:
            b.join(self)
            self._open.remove(b)

    def prefetch(self, *names, beside: str = "attention") -> None:
        if beside in ("collective", "experts"):      # the two sites of the next layer's front: one of them acts
            if not self.prefetch_next or self.prefetch_next_beside != beside:
                return
            if beside == "collective" and self.lay.tp == 1:
                return                               # tp 1's all-reduce is no collective: nothing to hide behind
        chosen = self._within_budget(names, site_of(beside))
        if beside == "experts":                      # held until the routed experts launch (release_held)
            self.__dict__.setdefault("_held", []).extend(chosen)
        elif chosen:
            self._launch_prefetch(chosen, site_of(beside))

    def release_held(self) -> None:
        """Launch the prefetch held by prefetch(beside="experts"): the cuda MoE calls this once the routing and the
        shared expert are launched, so the fill runs beside the routed experts (at few rows latency-bound: the HBM
        mostly idles) and not beside the router and the shared expert, which are on the chain and read DRAM
        themselves; CudaOps.call releases what no MoE took (a dense layer)."""
        held, self._held = self.__dict__.get("_held", []), []
        if held:
            self._launch_prefetch(held, site_of("experts"))

    def _within_budget(self, names, site: str) -> list:
        """(address, bytes) of the names' buffers in order while they fit the site's prefetch_bytes; the first that
        does not ends the list (the first readers come first)."""
        budget, chosen = per_site(self.prefetch_bytes, site), []
        if budget is None:
            raise ValueError(f"cuda backend: prefetch_bytes {self.prefetch_bytes!r} names no budget for the {site!r} "
                             "site (give every site of plugins/prefetch.py SITES, or one int)")
        for name in names:
            for buf in self.store.layouts(name):
                if buf.nbytes > budget:
                    break
                chosen.append((buf.ptr, buf.nbytes))
                budget -= buf.nbytes
            else:
                continue
            break
        return chosen

    def _launch_prefetch(self, chosen, site: str) -> None:
        chunk = chunk_for(getattr(self, "rows", 1), site, self.prefetch_chunk)
        pre = self.launcher(("l2_prefetch", chunk), lambda: L2Prefetch(self.gpu, chunk))
        fork = Fork.of(self, "prefetch")
        if fork is None:
            pre.run(chosen, stream=self.stream)
            return
        with fork.side(self):
            pre.run(chosen, stream=self.stream)
        self.__dict__.setdefault("_pending", []).append((fork, getattr(self, "calls", 0)))

    def join_pending(self, every: bool = False) -> None:
        """Join the prefetch branches of earlier calls into the main chain (the end of a call: by then they are long
        done, and none was waited for by the call that follows its own), or every open one (every: before a graph
        ends, which must rejoin its branches, or an eager run gives way to a capture)."""
        now = getattr(self, "calls", 0)
        pending = self.__dict__.get("_pending", [])
        self._pending = [] if every else [(f, c) for f, c in pending if c >= now]
        for fork, call in pending:
            if every or call < now:
                fork.join(self)
