"""The op set's MoE in the cuda backend (MoeOps, mixed into CudaOps: backends/cuda_backend.py): plugins/moe.py FusedMoE
(the fused router, then the routed experts' gate_up + down, the shared expert's output added in down).

The shared expert (swiglu_mlp: two skinny GEMMs, ~10-13 us at tp 8) needs only x, like the router. It runs on a
parallel branch (backends/cuda_branch.py) that forks after the routing launch (`ops.shared_fork = "routed"`, the
default), so its 10.5 MB (tp 8) stream beside the routed gate_up, a latency-bound launch at few rows that leaves
most of the HBM idle, and joins before the down launch that reads its output (`ops.shared_join = "down"`). Forked
beside the router instead (`shared_fork = "router"`; joined before the experts' launch with `shared_join =
"experts"`, or before the down launch), the two split the DRAM while the routing is on the chain: one H100, AR
6.6 % and budget 8 tree 0.5 2.5 % slower (ddtree/plugins/kernels/NOTES.md, tenth session; A/B `ddtree bench step
--shared-fork`, `--shared-join`). Where one streaming launch (moe_stream, many rows) runs the experts and reads the
shared output itself, the branch stays beside the router and joins before that launch.
`ops.branches = False` runs them in order (A/B: ddtree bench step --no-branches); the outputs are the same bits
either way (the same kernels on the same inputs).

moe_live (a pruned verify, issue 53): the same launches; the router (one launch, or the given routing's) applies
the live mask itself before its alignment (kernels/route_common.cuh live_rows: dead rows read no expert of their
own) and writes the routed ids beside."""
from __future__ import annotations

import numpy as np

from ddtree.plugins.moe import FusedMoE, MoEShape


class MoeOps:
    def route(self, fused, x, M: int, router_name: str, live=None, routed=None) -> tuple:
        """The router over x's M rows -> (expert ids [M, k], weights [M, k]) the experts read, in the fused MoE's
        buffers. live / routed: moe_live's mask [M] and routed ids [M, k] (device addresses; FusedMoE.route)."""
        return fused.route(x.ptr, M, stream=self.stream, live=live, routed_ids=routed)

    def moe(self, x, router, bias, experts, shared, spec):
        return self._moe(x, router, bias, experts, shared, spec)[0]

    def moe_live(self, x, router, bias, experts, shared, spec, live):
        """The pruned verify's MoE (issue 53): the router as in moe, one launch, which before its alignment moves
        each dead row's pairs onto the root's experts with weight 0 (rather than an id outside the expert range,
        which the alignment cannot take, or a zero weight on the row's own experts, which would still read them;
        plugins/prune_ops.py route_live_twin): a dead row makes the MoE read no expert that a live row does not
        (the experts-touched count stays honest), and its routed part is 0. Row 0 is the tree's root, always live.
        -> (partial [q, H], routed ids [q, topk] I32: the routing of every row, global)."""
        return self._moe(x, router, bias, experts, shared, spec, live)

    def _moe(self, x, router, bias, experts, shared, spec, live=None) -> tuple:
        if spec.expert_start != 0 or spec.experts != spec.n_routed_experts:
            raise NotImplementedError("cuda backend: expert-parallel MoE (a rank holding some experts) needs the "
                                      "kernel's expert offset; tp 1 holds them all")
        if self.shared_join not in ("experts", "down"):
            raise ValueError(f"{self.where}: shared_join {self.shared_join!r}: 'experts' or 'down'")
        if self.shared_fork not in ("router", "routed"):
            raise ValueError(f"{self.where}: shared_fork {self.shared_fork!r}: 'router' or 'routed'")
        if self.shared_fork == "routed" and self.shared_join != "down":
            raise ValueError(f"{self.where}: shared_fork 'routed' forks after the routing, so the branch can only "
                             f"join before the down launch: shared_join must be 'down', not {self.shared_join!r} "
                             "(or shared_fork 'router')")
        shape = MoEShape(spec.hidden, spec.inter, spec.experts, spec.topk, spec.n_group, spec.topk_group,
                         spec.routed_scaling_factor, self.max_tokens)
        keys = {"gate_up": "gate_up.words", "gate_up_scale": "gate_up.scales", "down": "down.words",
                "down_scale": "down.scales"}
        fused = self.launcher(("moe", router.name), lambda: FusedMoE(
            self.gpu, shape, {k: self.store.device(experts[v].name) for k, v in keys.items()},
            router=self.store.tiled(router.name), bias=self.store.device(bias.name), invariant=self.invariant,
            down_cols=self.moe_down_cols, down_prefetch=self.moe_down_prefetch))
        out, M = self.new(x.shape, np.uint16), self._rows(x, "moe")
        streamed = fused.uses_stream(M)                 # one launch runs the experts and reads the shared output

        def shared_branch():                            # -> (its branch, shared_out [m, H]) beside what follows
            with self.branch() as path:
                return path, self.swiglu_mlp(x, *shared)
        # beside the routed gate_up (off the router's chain), except where the streaming launch reads the shared
        # output itself: there it stays beside the router
        late = self.shared_fork == "routed" and not streamed
        if not late:
            shared_path, shared_out = shared_branch()
        routed = None
        if live is not None:
            if live.shape != (M,) or live.dtype != np.int32:
                raise ValueError(f"{self.where}: moe_live's live must be [{M}] int32, got {live.shape} {live.dtype}")
            routed = self.new((M, spec.topk), np.int32)
        # with live: dead rows moved in the routing launch (into the router's own buffers; a given routing stays)
        masks = () if live is None else (live.ptr, routed.ptr)
        ids, weights = self.route(fused, x, M, router.name, *masks)
        self.release_held()                                             # prefetch(beside="experts"): from here on
        if late:
            shared_path, shared_out = shared_branch()
        if self.shared_join == "down" and not streamed:                 # only down reads the shared output
            fused.gate_up(x.ptr, M, self.stream)
            self.join(shared_path)
            fused.down_combine(out.ptr, M, weights, shared_out.ptr, self.stream)
            return out, routed
        self.join(shared_path)
        fused.experts(x.ptr, out.ptr, M, ids, weights, shared_out.ptr, self.stream)
        return out, routed
