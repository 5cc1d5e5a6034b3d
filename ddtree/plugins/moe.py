"""Launcher for the fused W4A16 MoE (kernels/moe.cu), 1 <= M <= max_tokens <= 256 tokens.

    moe = FusedMoE(gpu, MoEShape(hidden, inter, experts, topk), weights, router=...)
    moe.run(x, out, M)                    # router GEMM -> route -> gate_up -> down + combine
    moe.run(x, out, M, topk=(ids, w))     # given routing (tests, benchmarks)
    ids, w = moe.route(x, M, live=live, routed_ids=routed)   # a pruned verify's routing (issue 53), one launch
    FusedMoE(..., streaming=True)         # gate_up -> down in one persistent launch (plugins/moe_stream.py)
    FusedMoE(..., down_cols=True)         # the two launches' down by output columns (plugins/moe_down_cols.py)

Letters: M tokens, H hidden, I expert intermediate (per rank), E experts, P = M * topk pairs.
Weights are in the layout of ddtree/plugins/layout.py, stacked over experts. Every workspace is
allocated here for max_tokens; run() only launches, so it can be captured in a CUDA graph, and no
step reads anything back to the host (the tile count stays on the device). With pdl (default) the
kernels use programmatic dependent launch: each may start while the previous one drains (moe_down
streams its first weights meanwhile); requires sm_90 or newer.
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import SkinnyGemm, supports_pdl
from ddtree.plugins.moe_down_cols import ColsPlan, cols_default, plan_down_cols
from ddtree.plugins.moe_measured import two_launch_knobs
from ddtree.plugins.moe_plan import DEFAULT_RING, SOURCE, MoEPlan, MoEShape, plan_moe, plan_moe_stream
from ddtree.plugins.moe_stream import STREAM_MEASURED, StreamPlan, stream_default, stream_knobs  # noqa: F401  (the plan's table, re-exported)
from ddtree.plugins.prune_ops import live_args
from ddtree.plugins.router import FusedRouter, RouterShape


class FusedMoE:
    # route() / route_given(): True = one fused router kernel (plugins/router.py); False = the router GEMM
    # (SkinnyGemm, fp32 out) then moe_route, as before issue 22 (kept for bench moe --parts' before/after)
    fused_router = True

    def __init__(self, gpu: Gpu, shape: MoEShape, weights: dict[str, DeviceArray],
                 router: DeviceArray | None = None, bias: DeviceArray | None = None, pdl: bool = True,
                 invariant: bool = False, streaming: bool | None = None, down_cols: bool | None = None,
                 down_prefetch: int = 0):
        """weights: {"gate_up", "gate_up_scale", "down", "down_scale"} device arrays stacked over experts
        (layout.repack_experts); router (layout.tile_bf16 of the [E, H] bf16 gate) and bias [E] fp32 are
        needed only for routed runs. pdl: programmatic dependent launch (sm_90+). invariant: the batch-invariant
        plan (docs/interfaces.md section 6): gate_up's k-split is the one planned for max_tokens at every M and the
        router GEMM's likewise (SkinnyGemm invariant), so a token's sums do not depend on the tokens beside it.
        streaming: experts() as one persistent launch (moe_stream: gate_up -> down without a kernel boundary; the
        same sums, bitwise, at the same gate_up split) if True, as moe_gate_up + moe_down if False; None: by
        stream_default (the M range where the H200 measured it faster). uses_stream(M) says which runs.
        down_cols: the two launches' down as moe_down_cols (by output columns, y in shared memory; bitwise moe_down's
        at one down k-split) wherever its plan fits if True, moe_down if False; None: where cols_default measured it
        faster and its plan fits. uses_down_cols(M) says which runs.
        down_prefetch: the two launches' gate_up asks L2 for the routed experts' down weights (kernels/moe.cu
        gate_up_impl) when the launch has at most this many tiles (0: never); the same bits either way."""
        E, H, I = shape.experts, shape.hidden, shape.inter
        want = {"gate_up": (E, I // 16, H // 64, 2, 32, 4), "gate_up_scale": (E, I // 16, H // 64, 2, 8, 4),
                "down": (E, H // 32, I // 64, 2, 32, 4), "down_scale": (E, H // 32, I // 64, 2, 8, 4)}
        for key, shp in want.items():
            if key not in weights or tuple(weights[key].shape) != shp:
                got = tuple(weights[key].shape) if key in weights else "missing"
                raise ValueError(f"FusedMoE: weights[{key!r}] must be {list(shp)}, got {got}")
        self.gpu, self.shape, self.w, self.router, self.bias = gpu, shape, weights, router, bias
        self.pdl = pdl and supports_pdl(gpu)
        self._overrides: dict[int, MoEPlan] = {}
        self._stream_overrides: dict[int, StreamPlan] = {}
        self.streaming = streaming
        self.down_cols = down_cols
        if down_prefetch < 0:
            raise ValueError(f"FusedMoE: down_prefetch = {down_prefetch} tiles must be >= 0 (0: no prefetch)")
        self.down_prefetch = down_prefetch
        self._cols_overrides: dict[int, ColsPlan] = {}
        self.ring = DEFAULT_RING.get(gpu.arch.rstrip("a"), DEFAULT_RING["default"])
        mx = shape.max_tokens
        self.fixed_splits = None                    # the batch-invariant plan's gate_up k-split (None: by M)
        if invariant:                               # plan_moe's heuristic split at max_tokens (no measured knobs)
            self.fixed_splits = plan_moe(shape, mx, gpu.sm_count, gpu.smem_optin, self.ring).gu_splits
        plans = [self.plan(m) for m in range(1, mx + 1)]
        self.stream_fallback: dict[int, str] = {}      # M -> why no streaming plan fits (streaming None: two launches)
        splans = []
        for m in range(1, mx + 1) if streaming is not False else ():
            try:
                splans.append(self.stream_plan(m))
            except ValueError as exc:
                if streaming:
                    raise
                self.stream_fallback[m] = str(exc)
                try:                                # sized for too: `streaming = True` set later takes it
                    splans.append(self.plain_stream_plan(m))
                except ValueError:
                    pass
        P = mx * shape.topk
        self.topk_ids = gpu.alloc((mx, shape.topk), np.int32)
        self.topk_w = gpu.alloc((mx, shape.topk), np.float32)
        self.tile_expert = gpu.alloc(shape.max_tiles(mx), np.int32)
        self.tile_pairs = gpu.alloc((shape.max_tiles(mx), 8), np.int32)
        self.num_tiles = gpu.zeros(1, np.int32)
        self.act = gpu.alloc((P, I), np.uint16)
        self.y = gpu.alloc(max(p.dn_splits * m * shape.topk * H for m, p in enumerate(plans, 1)), np.float32)
        part = max([p.tiles * p.gu_nb * p.gu_splits * p.gu_warps * 2 * p.gu_tpw * 32 * 4 for p in plans]
                   + [p.tiles * p.gu_nb * p.gu_splits * p.warps * 2 * p.gu_tpw * 32 * 4 for p in splans])
        self.gu_partial = gpu.alloc(part, np.float32)
        self.gu_counters = gpu.zeros(max(p.tiles * p.gu_nb for p in plans + splans), np.uint32)
        self.dn_counters = gpu.zeros(mx * max(p.dn_nb for p in plans + splans), np.uint32)
        self.queue = gpu.zeros(2, np.uint32)                 # moe_stream: tickets, blocks done (reset by the kernel)
        self.ready = gpu.zeros(shape.max_tiles(mx), np.uint32)   # moe_stream: complete act n-blocks per tile
        self.logits = None
        if router is not None:
            self.logits = gpu.alloc((mx, E), np.float32)
            self.router_gemm = SkinnyGemm(gpu, E, H, mx, out_f32=True, pdl=pdl, invariant=invariant)
            self.router_fused = FusedRouter(gpu, RouterShape(E, H, shape.topk, shape.n_group, shape.topk_group,
                                                             shape.scaling, mx), router, bias, pdl, invariant)

    def plan(self, M: int) -> MoEPlan:
        """The two launches' plan at M: an override, else plan_moe with the measured knobs (moe_measured; not under
        the batch-invariant split, whose gate_up k-split is max_tokens' at every M)."""
        if M in self._overrides:
            return self._overrides[M]
        g = self.gpu
        knobs = two_launch_knobs(g.arch, self.shape, M) if self.fixed_splits is None else {}
        return plan_moe(self.shape, M, g.sm_count, g.smem_optin, self.ring, **{"gu_splits": self.fixed_splits, **knobs})

    def cols_plan(self, M: int) -> ColsPlan:
        """moe_down_cols' plan at M: an override, else plan_down_cols with the measured knobs (ValueError where its
        shared memory does not fit)."""
        if M in self._cols_overrides:
            return self._cols_overrides[M]
        g = self.gpu
        return plan_down_cols(self.shape, M, g.sm_count, g.smem_optin, **(cols_default(g.arch, self.shape, M) or {}))

    def override_cols(self, M: int, **knobs) -> ColsPlan:
        """Benchmark sweeps and tests: moe_down_cols at M with forced plan_down_cols knobs (warps, upb, ring)."""
        g = self.gpu
        self._cols_overrides[M] = p = plan_down_cols(self.shape, M, g.sm_count, g.smem_optin, **knobs)
        return p

    def uses_down_cols(self, M: int) -> bool:
        """Whether the two launches' down at M is moe_down_cols: never beside a down k-split above 1 (its sums are
        moe_down's at one split) or where its plan does not fit (the launch's act rows live in shared memory: few
        rows only); else `down_cols` if set, or an override, or where cols_default measured it faster."""
        if self.down_cols is False or self.plan(M).dn_splits != 1:
            return False
        if self.down_cols is None and M not in self._cols_overrides and cols_default(self.gpu.arch, self.shape,
                                                                                     M) is None:
            return False
        try:
            self.cols_plan(M)
        except ValueError:
            return False
        return True

    def uses_stream(self, M: int) -> bool:
        """Whether experts() at M tokens is the streaming launch (moe_stream) or moe_gate_up + moe_down:
        `streaming` if set, else an overridden stream plan or stream_default (unless its plan failed)."""
        if self.streaming is not None:
            return self.streaming
        if M in self._stream_overrides:
            return True
        return stream_default(self.gpu.arch, self.shape, M) and M not in self.stream_fallback

    def stream_plan(self, M: int) -> StreamPlan:
        """The streaming plan at M: an override, else the measured knobs (stream_knobs: gate_up ones on plan_moe,
        except the batch-invariant split, which stays) or the two launches' gate_up plan alone where none are
        measured. Knobs that do not fit (a pinned item or two blocks an SM beside the batch-invariant split) raise
        when the plan chooses the path (streaming None: the two launches run there) and give the plain plan when
        the streaming launch is forced."""
        if M in self._stream_overrides:
            return self._stream_overrides[M]
        g = self.gpu
        knobs = stream_knobs(g.arch, self.shape, M)
        if knobs:
            gate_up = {k: v for k, v in knobs.items() if k.startswith("gu_")}
            if self.fixed_splits is not None:          # the batch-invariant plan's split stays
                gate_up.pop("gu_splits", None)
            try:
                base = plan_moe(self.shape, M, g.sm_count, g.smem_optin, self.ring,
                                **{"gu_splits": self.fixed_splits, **gate_up}) if gate_up else self.plan(M)
                return plan_moe_stream(self.shape, M, g.sm_count, g.smem_optin, self.ring, g.l2_bytes, base=base,
                                       **{k: v for k, v in knobs.items() if not k.startswith("gu_")})
            except ValueError as exc:
                if self.streaming is None:
                    raise ValueError(f"MoE stream: the measured knobs {knobs} do not fit at M = {M}: {exc}") from exc
        return self.plain_stream_plan(M)

    def plain_stream_plan(self, M: int) -> StreamPlan:
        """The streaming plan on the two launches' gate_up plan at M, no measured knobs."""
        g = self.gpu
        return plan_moe_stream(self.shape, M, g.sm_count, g.smem_optin, self.ring, g.l2_bytes, base=self.plan(M))

    def override_stream(self, M: int, dn_tpw: int | None = None, blocks_per_sm: int | None = None,
                        prefetch: int | None = None, bulk: bool = False, pin: bool = False,
                        **plan_kw) -> StreamPlan:
        """Benchmark sweeps and tests: take the streaming launch at M with forced knobs (plan_stream's, and
        plan_moe's gate_up ones: gu_splits, gu_warps, gu_tpw, gu_ring); grows the workspaces if needed (call it
        before capturing a graph)."""
        g = self.gpu
        p = plan_moe_stream(self.shape, M, g.sm_count, g.smem_optin, self.ring, g.l2_bytes, dn_tpw=dn_tpw,
                            blocks_per_sm=blocks_per_sm, prefetch=prefetch, bulk=bulk, pin=pin,
                            **{"gu_splits": self.fixed_splits, **plan_kw})
        self._reserve(p, p.warps)
        self._stream_overrides[M] = p
        return p

    def _reserve(self, p, gu_warps: int) -> None:
        """Grow the gate_up partials and the counters to what plan p needs (gu_warps: its gate_up warps a block)."""
        part = p.tiles * p.gu_nb * p.gu_splits * gu_warps * 2 * p.gu_tpw * 32 * 4
        if part > self.gu_partial.shape[0]:
            self.gu_partial = self.gpu.alloc(part, np.float32)
        if p.tiles * p.gu_nb > self.gu_counters.shape[0]:
            self.gu_counters = self.gpu.zeros(p.tiles * p.gu_nb, np.uint32)
        if self.shape.max_tokens * p.dn_nb > self.dn_counters.shape[0]:
            self.dn_counters = self.gpu.zeros(self.shape.max_tokens * p.dn_nb, np.uint32)

    def override(self, M: int, **kw) -> MoEPlan:
        """Benchmark sweeps: force plan_moe keywords for M (grows the workspaces if the plan needs more;
        call it before capturing a graph)."""
        p = plan_moe(self.shape, M, self.gpu.sm_count, self.gpu.smem_optin, self.ring, **kw)
        self._reserve(p, p.gu_warps)
        if p.dn_splits * M * self.shape.topk * self.shape.hidden > self.y.shape[0]:
            self.y = self.gpu.alloc(p.dn_splits * M * self.shape.topk * self.shape.hidden, np.float32)
        self._overrides[M] = p
        return p

    def route(self, x: DeviceArray | int, M: int, stream=None, live=None, routed_ids=None) -> tuple:
        """Router logits (fp32) + top-k + alignment: one fused launch, or (fused_router False) two -> (ids, weights)
        the experts read (the router's own buffers). live [M] int32 (a pruned verify, issue 53) and routed_ids
        [M, topk] int32 (written: the ids as routed): the routing launch moves each dead row's pairs onto the
        root's experts at weight 0 before it aligns (plugins/prune_ops.py live_args)."""
        if self.router is None:
            raise ValueError("FusedMoE.route: constructed without router weights")
        if self.fused_router:
            self.router_fused.run(x, M, self.logits, self.topk_ids, self.topk_w, self._tiles(), stream=stream,
                                  live=live, routed_ids=routed_ids)
        else:
            self.router_gemm.run(x, self.router, self.logits, M, stream=stream)
            self.launch_route(self.logits, M, self.topk_ids, self.topk_w, stream, live, routed_ids)
        return self.topk_ids, self.topk_w

    def route_given(self, x, M: int, ids, weights, stream=None, live=None, routed_ids=None) -> tuple:
        """Benchmarks' given routing (ddtree bench step --routing uniform|tree): the router GEMM runs (its cost is
        real; its logits are not used), then the route kernel aligns the given ids [M, topk] / weights (its
        top-k skipped): one route launch, as in route() -> (ids, weights) the experts read: the given ones, or
        with a live mask (as route()'s) the router's own buffers holding the given routing with the dead rows
        moved (the given buffers stay as given: the benchmark reuses them every step)."""
        if self.router is None:
            raise ValueError("FusedMoE.route_given: constructed without router weights")
        out = (ids, weights) if live is None else (self.topk_ids, self.topk_w)
        masks = {} if live is None else dict(live=live, routed_ids=routed_ids, live_ids=out[0], live_w=out[1])
        if self.fused_router:            # the fused kernel computes the logits, skips its top-k, aligns the ids
            self.router_fused.run(x, M, self.logits, ids, weights, self._tiles(), given=True, stream=stream, **masks)
        else:
            self.router_gemm.run(x, self.router, self.logits, M, stream=stream)
            self.launch_route(None, M, ids, weights, stream, **masks)
        return out

    def _tiles(self) -> tuple:
        return self.tile_expert, self.tile_pairs, self.num_tiles

    def launch_route(self, logits, M, ids, weights, stream, live=None, routed_ids=None, live_ids=None,
                     live_w=None) -> None:
        """The route kernel alone. logits [M, E] fp32 (device): routes into ids [M, topk] int32 and
        weights [M, topk] fp32, then fills the tile lists; logits None: ids/weights are a given routing,
        only the tile lists are filled. live: a pruned verify's mask, applied before the alignment
        (plugins/prune_ops.py live_args: a given routing names live_ids / live_w)."""
        s = self.shape
        masks = live_args("moe_route", ids, weights, logits is None, live, routed_ids, live_ids, live_w)
        self.gpu.launch(self.gpu.kernel(SOURCE, "moe_route"), 1, 1024, 0,
                        ptr(logits), ptr(self.bias), np.int32(M), np.int32(s.experts), np.int32(s.topk),
                        np.int32(s.n_group), np.int32(s.topk_group), np.float32(s.scaling), ptr(ids), ptr(weights),
                        ptr(self.tile_expert), ptr(self.tile_pairs), ptr(self.num_tiles), *masks, stream=stream,
                        pdl=self.pdl)

    def run(self, x: DeviceArray | int, out: DeviceArray | int, M: int, shared: DeviceArray | int | None = None,
            topk: tuple | None = None, stream=None) -> None:
        """out[M, H] bf16 = sum_k w_k expert_k(x) (+ shared[M, H]). topk = (ids [M, topk] int32,
        weights [M, topk] fp32) device arrays skips the router and uses that routing."""
        if not 1 <= M <= self.shape.max_tokens:
            raise ValueError(f"FusedMoE: M = {M} outside [1, {self.shape.max_tokens}]")
        if topk is None:
            self.route(x, M, stream)
            ids, weights = self.topk_ids, self.topk_w
        else:
            ids, weights = topk
            self.launch_route(None, M, ids, weights, stream)
        self.experts(x, out, M, ids, weights, shared, stream)

    def experts(self, x, out, M, ids, weights, shared=None, stream=None) -> None:
        """gate_up + down/combine, after the route kernel filled the tile lists: one streaming launch or two."""
        if self.uses_stream(M):
            self.stream_experts(x, out, M, weights, shared, stream)
            return
        self.gate_up(x, M, stream)
        self.down_combine(out, M, weights, shared, stream)

    def down_combine(self, out, M, weights, shared=None, stream=None) -> None:
        """The two launches' second: moe_down_cols where uses_down_cols(M), else moe_down (the same bits)."""
        if self.uses_down_cols(M):
            self.down_by_cols(out, M, weights, shared, stream)
        else:
            self.down(out, M, weights, shared, stream)

    def stream_experts(self, x, out, M, weights, shared=None, stream=None) -> None:
        """out[M, H] = sum_k weights[:, k] expert_k(x) (+ shared) in one persistent launch (kernels/moe_stream.cuh)."""
        s, p, g = self.shape, self.stream_plan(M), self.gpu
        g.allow_smem(SOURCE, p.kernel, p.smem)
        g.launch(g.kernel(SOURCE, p.kernel), p.blocks, p.warps * 32, p.smem,
                 ptr(x), ptr(self.w["gate_up"]), ptr(self.w["gate_up_scale"]), ptr(self.w["down"]),
                 ptr(self.w["down_scale"]), ptr(self.tile_expert), ptr(self.tile_pairs), ptr(self.num_tiles),
                 ptr(self.act), ptr(self.gu_partial), ptr(self.gu_counters), ptr(self.y), ptr(weights), ptr(shared),
                 ptr(out), ptr(self.dn_counters), ptr(self.queue), ptr(self.ready), np.int32(s.hidden),
                 np.int32(s.inter), np.int32(s.topk), np.int32(p.gu_splits), np.int32(p.gu_tpw), np.int32(p.gu_nb),
                 np.int32(p.dn_tpw), np.int32(p.dn_nb), np.int32(M * s.topk), np.int32(p.prefetch_tiles),
                 np.int32(p.pin), stream=stream, pdl=self.pdl)

    def gate_up(self, x, M, stream=None) -> None:
        """act[pair] = silu(x W_gate^T) * (x W_up^T) for every routed pair (after the route kernel)."""
        s, p, g = self.shape, self.plan(M), self.gpu
        g.allow_smem(SOURCE, p.gate_up_kernel, p.gu_smem)
        g.launch(g.kernel(SOURCE, p.gate_up_kernel), (p.gu_nb, p.gu_splits, p.tiles), p.gu_warps * 32, p.gu_smem,
                 ptr(x), ptr(self.w["gate_up"]), ptr(self.w["gate_up_scale"]), ptr(self.tile_expert),
                 ptr(self.tile_pairs), ptr(self.num_tiles), ptr(self.act), ptr(self.gu_partial),
                 ptr(self.gu_counters), np.int32(s.hidden), np.int32(s.inter // 8), np.int32(s.topk),
                 np.int32(p.gu_splits), np.int32(p.gu_tpw), ptr(self.w["down"]), ptr(self.w["down_scale"]),
                 np.int32(self.down_prefetch), stream=stream, pdl=self.pdl)

    def down(self, out, M, weights, shared=None, stream=None) -> None:
        """out[M, H] = sum_k weights[:, k] * act[pair_k] W_down^T (+ shared), after gate_up."""
        s, p, g = self.shape, self.plan(M), self.gpu
        g.allow_smem(SOURCE, p.down_kernel, p.dn_smem)
        g.launch(g.kernel(SOURCE, p.down_kernel), (p.dn_nb, p.dn_splits, p.tiles), p.dn_warps * 32, p.dn_smem,
                 ptr(self.act), ptr(self.w["down"]), ptr(self.w["down_scale"]), ptr(self.tile_expert),
                 ptr(self.tile_pairs), ptr(self.num_tiles), ptr(self.y), ptr(weights), ptr(shared), ptr(out),
                 ptr(self.dn_counters), np.int32(s.inter), np.int32(s.hidden // 16), np.int32(s.topk),
                 np.int32(p.dn_tpw), np.int32(M * s.topk), stream=stream, pdl=self.pdl)

    def down_by_cols(self, out, M, weights, shared=None, stream=None) -> None:
        """moe_down's output (bitwise, at one down k-split) from moe_down_cols: blocks own output columns of every
        tile, y stays in shared memory (kernels/moe_down_cols.cuh), after gate_up."""
        s, p, g = self.shape, self.cols_plan(M), self.gpu
        g.allow_smem(SOURCE, p.kernel, p.smem)
        g.launch(g.kernel(SOURCE, p.kernel), p.blocks, p.warps * 32, p.smem,
                 ptr(self.act), ptr(self.w["down"]), ptr(self.w["down_scale"]), ptr(self.tile_expert),
                 ptr(self.tile_pairs), ptr(self.num_tiles), ptr(weights), ptr(shared), ptr(out),
                 np.int32(s.inter), np.int32(s.hidden // 32), np.int32(s.topk), np.int32(M * s.topk),
                 np.int32(p.upb), np.int32(p.max_tiles), stream=stream, pdl=self.pdl)
