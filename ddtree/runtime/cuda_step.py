"""The DDTree step and the autoregressive step on one GPU, each one captured CUDA graph (docs/interfaces.md 6, 8).

    steps = GpuSteps(ex)                         # ex: a CudaExecutor; ex.ar_step / ex.ddtree_step call these
    tokens = steps.ddtree_step(state, params, budget)      # one graph replay, one record read

A DDTree step graph (one per (budget, block size, sampling mode)) runs, with no host round trip:
    prologue     state [start, bonus] -> block ids [bonus, MASK..], positions start + i, cache lengths
    draft        draft_fc over the context window (the taps of the last b committed positions, re-appended
                 at start - b: rows the drafter cache holds already are rewritten with the same keys), the
                 drafter layers, draft_logits [b-1, V]                      (description/layers.py, cuda backend)
    tree         DraftTreeBuilder.run: per-depth top-k + best-first tree of `budget` nodes, root = bonus
    verify       embed + every decoder layer over the tree (its ancestor mask), taps copied at the tap
                 layers, head_logits [n, V]
    sample+walk  TreeSampler.launch: the sampling definition at every node, then the acceptance walk
    compact      every layer's cache: accepted rows -> start + i (count read on the device)
    window       the context window shifted by the accepted count, the accepted nodes' taps appended
    commit       accepted drafts + new bonus into the host-mapped record ring; state advanced
With --prune auto (a loop.DecodeState's prune: runtime/pruning.py Pruner) the verify is the pruned one and the walk
sees dead nodes as absent, all inside the same graph (runtime/cuda_step_prune.py; its graphs are keyed apart).
The AR step graph is prologue, embed + layers + head_logits over one token, the sampler, commit. A rank of a
tp > 1 engine: runtime/cuda_step_tp.py (the node kernels and the collectives in the graphs; this class's rest).

Both are captured after a warm-up: the first call of a key runs the step eagerly (it is that step; it
allocates the arena and loads the modules), then records the same launches into a graph. Everything that
changes between steps or requests is in device buffers (the state, the sampler's parameter record, the
tree tensors, cache lengths), so a graph replays every step of every request with the same sampling mode.

A step runs as a graph when it can (start >= b so the window is whole, its positions inside the context
and the caches); otherwise it is the composition of the primitives (runtime/loop.py ddtree_step): the
first steps after a prompt shorter than b, and the last ones near the end of the context.
"""
from __future__ import annotations

import copy
import time

import numpy as np

from ddtree.backends.cuda_tensor import Tensor, dense_strides
from ddtree.description import layers, stack
from ddtree.model.bf16 import as_float, f32_to_bf16
from ddtree.plugins.device import DeviceArray
from ddtree.plugins.step_state import StepState
from ddtree.plugins.tree_build import DraftTreeBuilder
from ddtree.plugins.tree_sample import TreeSampler
from ddtree.runtime import loop
from ddtree.runtime.cuda_model import draft_feeds, target_feeds, target_layers
from ddtree.runtime.cuda_step_prune import StepPruning
from ddtree.tree.build import pack_visibility
from ddtree.tree.sampling import SamplingParams


def _array(gpu, t: Tensor):
    return DeviceArray(gpu, t.ptr, t.shape, t.dtype)


class GpuSteps:
    def __init__(self, ex):
        self.ex, self.gpu, self.ops = ex, ex.gpu, ex.ops
        cfg, d = ex.config, ex.drafter_config
        self.V = ex.lay.vocab_stop - ex.lay.vocab_start
        self.sampler = self._make_sampler()
        self.B_max = d.block_size if d is not None else 1
        self.state = StepState(self.gpu, max_tokens=max(self.B_max, 1))
        self.taps = tuple(d.target_layer_ids) if d is not None else ()
        self.H, self.KH = cfg.hidden_size, len(self.taps) * cfg.hidden_size
        g = self.gpu
        self.block_ids, self.block_pos = g.alloc((self.B_max,), np.int32), g.alloc((self.B_max,), np.int32)
        self.draft_len = g.alloc((1,), np.int32)
        self.ar_mask = g.upload(pack_visibility(np.ones((1, 1), bool)).view(np.int32))     # [1, 1]: sees itself
        if self.KH:
            self.window = g.alloc((self.B_max, self.KH), np.uint16)
            self.window_next = g.alloc((self.B_max, self.KH), np.uint16)
            self.tap_rows = g.alloc((self.ops.max_tokens, self.KH), np.uint16)
        self.builders: dict[int, object] = {}
        self.graphs: dict[tuple, list] = {}
        self.capture_s = 0.0
        self.host_s, self.graph_steps = 0.0, 0           # steps already in flight when asked for
        self.started_s, self.started_steps = 0.0, 0      # steps the host started (state uploaded)
        self.synced: tuple | None = None      # (start, bonus) the device state holds, when the host knows it
        self.in_window = 0                    # > 0: the drafter context is the device window (its new rows)
        self.plan = self.params = None
        self.last: dict = {}                  # the last DDTree step's verify buffers (last_verify)
        self.lasts: dict[tuple, dict] = {}
        self.values: dict[tuple, dict] = {}   # (budget, b) -> the step's intermediate tensors (phase_times)
        self.table_host = None                # (host view, device address) of --budget auto's table buffer
        self.inflight: tuple | None = None    # (key, event) of a step enqueued ahead of the host
        self.pipeline = True                  # False: one step at a time (last_verify reads the step just read)
        self.pruning: StepPruning | None = None   # --prune auto's device buffers (made on the first pruned step)

    def _make_sampler(self):         # the fused sampler + walk over full logits (tp 1's; cuda_step_tp.py has none)
        return TreeSampler(self.gpu, vocab=self.V, max_rows=self.ops.max_tokens)

    # ---- request set-up --------------------------------------------------------------------------
    def new_request(self) -> None:
        """A new sequence: the device state and window say nothing about it until its first graph step."""
        self.drain()
        self.synced, self.in_window = None, 0

    def set_params(self, params: SamplingParams):
        if params != self.params:
            self.plan, self.params = self.sampler.set_params(params), params
        return self.plan

    def builder(self, depth: int):
        if depth not in self.builders:
            self.builders[depth] = DraftTreeBuilder(self.gpu, vocab=self.V, depth=depth,
                                                    max_budget=min(255, self.ops.max_tokens - 1))
        return self.builders[depth]

    # ---- graphs ----------------------------------------------------------------------------------
    def capture(self, body):
        """body's launches recorded into an executable CUDA graph (nothing runs): CudaOps.capture_graph."""
        return self.ops.capture_graph(body)

    def _run(self, key: tuple, body) -> None:
        """Replay the graph of `key`, or run the step eagerly and capture it (the first time)."""
        if key in self.graphs:
            self._replay(key)
            self.last = self.lasts.get(key, {})
            return
        self.eager(body)
        self.lasts[key] = self.last
        t0 = time.perf_counter()
        self.graphs[key] = [self.capture(body), self.capture(body)]
        self.capture_s += time.perf_counter() - t0

    def eager(self, body) -> None:
        """body's launches run now (synchronised), planned as its captured graph's will be: the first step of a
        key (the step itself, and the capture's warm-up), or a bench's one-off step."""
        self.ops.graph_plans = True
        try:
            body()
            self.gpu.sync()
        finally:
            self.ops.graph_plans = False

    def _step(self, key: tuple, body, prepare, ahead: bool) -> dict:
        """Step k through the graph of `key` -> its record. When `ahead`, step k + 1 of the same graph is
        enqueued before k's record is read (the state it needs is on the device), so the host's work overlaps
        the GPU's; the next call with the same key takes it. `prepare()` readies the device for a step the
        host starts (window, state: Gpu.copy_in lands them, ordered with the Gpu's stream, before it returns);
        skipped for a step already in flight."""
        t0 = time.perf_counter()
        started = self.inflight is None or self.inflight[0] != key     # the host starts this step itself
        if not started:
            event = self.inflight[1]
        else:
            self.drain()
            prepare()
            if key not in self.graphs:
                capture = time.perf_counter()
                self._run(key, body)
                t0 += time.perf_counter() - capture                     # capture time is counted apart
            else:
                self._run(key, body)
            event = self.gpu.stream.record()
        self.inflight = None
        if ahead and self.pipeline and key in self.graphs:
            self._replay(key)
            self.inflight = (key, self.gpu.stream.record())
        t1 = time.perf_counter()
        event.sync()
        wait = time.perf_counter() - t1
        rec = self.read_record()
        host = time.perf_counter() - t0 - wait
        if started:
            self.started_s, self.started_steps = self.started_s + host, self.started_steps + 1
        else:
            self.host_s, self.graph_steps = self.host_s + host, self.graph_steps + 1
        return rec

    def read_record(self) -> dict:
        """The next step's record (its graph has finished); a step whose sampler or tree builder flagged a bad
        input raises their error (nothing stays in flight then)."""
        step = self.state.steps + 1
        rec = self.state.record(step)
        if rec is None:
            raise RuntimeError(f"GPU step {step}: its record was not written (the graph did not run to its end)")
        self.state.steps = step
        if rec["status"]:
            self.drain()
            if self.sampler is not None:
                self.sampler.check_status()
            for builder in self.builders.values():
                builder.check_status()
        return rec

    def _replay(self, key: tuple) -> None:
        """Two executable copies of each graph, launched in turn: a launch of the copy that is not running
        (step k + 1 enqueued while step k runs) does not wait for the running one on the host."""
        pair = self.graphs[key]
        pair.reverse()
        self.gpu.replay(pair[0])

    @staticmethod
    def _check_follows(rec: dict, start: int) -> None:
        if rec["start"] - rec["count"] != start:
            raise RuntimeError(f"GPU step record starts at {rec['start'] - rec['count']}, the host's sequence at "
                               f"{start} (a step ran on another state)")

    def drain(self) -> None:
        """Finish and drop a step enqueued ahead (a new request, an error): its record is never read."""
        if self.inflight is not None:
            self.inflight[1].sync()
            self.state.steps += 1
            self.inflight, self.synced, self.in_window = None, None, 0

    def _sync_state(self, start: int, bonus: int) -> None:
        if self.synced != (start, bonus):
            self.state.set(start, bonus)

    # ---- the autoregressive step -------------------------------------------------------------------
    def _ar_body(self):
        ex, ops, cfg, st = self.ex, self.ops, self.ex.config, self.state
        lengths = ex.target_cache.dev.lengths
        st.prologue(1, 0, 0, self.block_ids, self.block_pos, None, lengths, stream=ops.stream)
        feeds = {"ids": Tensor.of(self.block_ids.view(0, (1,))), "pos": Tensor.of(self.block_pos.view(0, (1,))),
                 "cache_len": Tensor.of(lengths), "tree_mask": Tensor.of(self.ar_mask)}
        h = target_layers(ex, feeds, ex.target_cache)
        logits = ops.call(layers.head_logits, cfg, feeds={"h": h})["logits"]
        out = self.sampler.launch(self.plan, _array(self.gpu, logits), self.block_pos, 1, stream=ops.stream)
        st.commit(None, None, None, out.target, status=(self.sampler.status, None), stream=ops.stream)

    def ar_step(self, s, params: SamplingParams) -> list[int]:
        """One token through the AR graph; `s` a loop.DecodeState on the executor's target cache."""
        if s.cache is not self.ex.target_cache or s.start + 1 > self.ex.max_context:
            self.drain()
            self.synced = None
            return loop.ar_step(self.ex, s, params)
        key = ("ar", self.set_params(params).mode)
        ahead = s.start + 2 < min(s.end, self.ex.max_context)     # step k + 1 needed and inside the cache
        rec = self._step(key, self._ar_body, lambda: self._sync_state(s.start, s.bonus), ahead)
        self._check_follows(rec, s.start)
        s.start, s.bonus = rec["start"], rec["tokens"][-1]
        s.cache.length = s.start
        self.synced = (s.start, s.bonus)
        return rec["tokens"]

    # ---- the DDTree step -------------------------------------------------------------------------
    def _copy_tap(self, L: int, h: Tensor) -> None:
        """After target layer L: h [n, H] -> tap_rows[:, j H : (j+1) H] when L is the drafter's j-th tap layer."""
        if L in self.taps:
            n, j, ops = h.shape[0], self.taps.index(L), self.ops
            ops.k.gather_rows(h.ptr, ops.iota, self.tap_rows.ptr + 2 * j * self.H, n, self.H, n, out_stride=self.KH,
                              stream=ops.stream)

    PHASES = stack.PHASES

    def _ddtree_body(self, budget: int, b: int, only=None, k: int | None = None, prune: bool = False,
                     stats: bool = True):
        """The step's launches, phase by phase (PHASES); `only`: just those phases, on the buffers of the last
        full run (phase_times captures each alone to time it). k: --budget auto's table width (the table is
        copied to the host-mapped buffer table_host with the record). prune: the verify pruned inside
        (self.pruning, runtime/cuda_step_prune.py; stats: a stats step's copies)."""
        ex, ops, cfg, d, st, g = self.ex, self.ops, self.ex.config, self.ex.drafter_config, self.state, self.gpu
        S, n = ops.stream, budget + 1
        lengths = ex.target_cache.dev.lengths
        v = self.values.setdefault((budget, b), {})
        builder = self.builder(b - 1)

        def draft():
            h = self._drafter(b)
            v["draft"] = self.drafted(ops.call(layers.draft_logits, d, b, feeds={"h": h})["logits"])    # [b-1, V]

        def tree():
            v["tree"] = builder.run(_array(g, v["draft"]), st.bonus_ptr, st.start_ptr, budget, stream=S, k=k)

        def verify():    # the tree after the committed rows, taps copied at the tap layers
            t = v["tree"]
            W = t.vis.shape[1]
            feeds = {"ids": Tensor.of(t.tokens), "pos": Tensor.of(t.positions), "cache_len": Tensor.of(lengths),
                     "tree_mask": Tensor(t.vis.ptr, (n, W), np.dtype(np.int32), dense_strides((n, W)))}
            pruning = self.pruning.verify_feeds(t, n, S, stats) if prune else None   # path probs, rate: device
            h = target_layers(ex, feeds, ex.target_cache, self._copy_tap, self.taps, prune=pruning)
            v["logits"] = ops.call(layers.head_logits, cfg, feeds={"h": h})["logits"]      # [n, V] float32
            if prune:
                v["live"] = pruning.feeds["live"]                                          # [n] int32 Tensor

        def sample_walk():
            t = v["tree"]
            walk = self.pruning.walk_tree(t, v["live"], n, S) if prune else t          # dead nodes absent
            v["out"] = self.walked(self.sampler.launch(self.plan, _array(g, v["logits"]), t.positions, n, tree=walk,
                                                       stream=S), t.parents, n)
            self.last = {"logits": _array(g, v["logits"]), "tree": t, "sampled": v["out"]}

        def update():
            out = v["out"]
            if k:
                g.copy_d2d(self._table(b - 1, k)[1], v["tree"].table_logp.ptr, (b - 1) * k * 4, stream=S)
            if prune:
                self.pruning.finish(n, S)
            self._update(b, v["tree"].tokens, Tensor.of(out.accepted), Tensor.of(out.count), out.bonus,
                         (self.sampler.status, builder.status))

        for name, phase in zip(self.PHASES, (draft, tree, verify, sample_walk, update)):
            if only is None or name in only:
                phase()

    def drafted(self, logits: Tensor) -> Tensor:
        """The draft logits [b-1, V] the tree is built from: the drafter's (bench/bench_steps.py states its own)."""
        return logits

    def walked(self, out, parents, n: int):
        """The sampler's walk over the n nodes: as sampled (bench/bench_steps.py forces a path of its own)."""
        return out

    def _drafter(self, b: int) -> Tensor:
        """The prologue, the drafter over the window (b rows at start - b) and the block at start -> h [b, H]."""
        ex, ops, cfg, d, S = self.ex, self.ops, self.ex.config, self.ex.drafter_config, self.ops.stream
        self.state.prologue(b, d.mask_token_id, b, self.block_ids, self.block_pos, self.draft_len,
                            ex.target_cache.dev.lengths, stream=S)
        feeds = {"ctx_taps": Tensor.of(self.window.view(0, (b, self.KH))),
                 "ids": Tensor.of(self.block_ids.view(0, (b,))), "pos": Tensor.of(self.block_pos.view(0, (b,))),
                 "cache_len": Tensor.of(self.draft_len)}
        return stack.drafter_forward(ops.run, cfg, d, feeds, draft_feeds(ex.draft_cache), b, head=None)["h"]

    def _update(self, b: int, tokens, accepted: Tensor, count: Tensor, bonus, status) -> None:
        """Compaction to the accepted path, the context window, the record (status: two flag words or None)."""
        ex, ops, S, g = self.ex, self.ops, self.ops.stream, self.gpu
        stack.compact(ops.run, ex.config, {"cache_len": Tensor.of(ex.target_cache.dev.lengths), "accepted": accepted,
                                           "accepted_count": count}, target_feeds(ex.target_cache))
        self.state.ctx_window(self.window, self.tap_rows, accepted.ptr, count.ptr, self.window_next, b, 2 * self.KH,
                              stream=S)
        g.copy_d2d(self.window.ptr, self.window_next.ptr, b * self.KH * 2, stream=S)
        self.state.commit(tokens.ptr, accepted.ptr, count.ptr, bonus.ptr, status=status, stream=S)

    def _table(self, depth: int, k: int):
        """The host-mapped [depth, k] float32 buffer a step copies its drafter table into (--budget auto)."""
        if self.table_host is None or self.table_host[0].size < depth * k:
            self.table_host = self.gpu.mapped((depth * k,), np.float32)
        return self.table_host

    def graph_ready(self, s, budget: int) -> bool:
        """Whether this step can run as the graph (else the composition of the primitives)."""
        ex, b = self.ex, s.block
        limit = min(ex.max_context, int(ex.config.max_position_embeddings))
        return (s.cache is ex.target_cache and s.start >= b and s.start + b - 1 < limit
                and s.start + budget + 1 <= ex.target_cache.capacity and budget + 1 <= self.ops.max_tokens
                and (b - 1) * min(budget, self.V) >= budget)

    def ddtree_step(self, s, params: SamplingParams, budget: int) -> list[int]:
        ex, b = self.ex, s.block
        if not self.graph_ready(s, budget):
            self.drain()
            self._leave_window(s)
            return loop.ddtree_step(ex, s, params, budget)
        k, prune = s.table_k, s.prune
        key = ("ddtree", budget, b, self.set_params(params).mode) + ((k,) if k else ())
        stats = False
        if prune is not None:                           # its own graphs: the pruned verify at the pruner's layers
            self.pruning = self.pruning or StepPruning(self, prune)
            stats = self.pruning.stats_due(first=not prune.stats.per_step)
            key += ("prune", prune.at, stats)
        nxt = copy.copy(s)
        nxt.start += b                                  # the furthest step k + 1 can start
        # auto: the next budget waits; pruned: the stats' buffers and the rate's context are this step's
        ahead = nxt.start < s.end and self.graph_ready(nxt, budget) and not k and prune is None

        def prepare():
            self._enter_window(s)
            self._sync_state(s.start, s.bonus)
            if prune is not None:
                self.pruning.prepare(prune, budget, s.start)
        pruned = {"prune": True, "stats": stats} if prune is not None else {}     # (TpSteps' body: tp > 1 refuses)
        rec = self._step(key, lambda: self._ddtree_body(budget, b, k=k, **pruned), prepare, ahead)
        self._check_follows(rec, s.start)
        if prune is not None:
            self.pruning.record(budget + 1, stats)
        if k:
            s.draft_logp = self.table_host[0][: (b - 1) * k].reshape(b - 1, k).copy()
        old = s.start
        s.start, s.bonus = rec["start"], rec["tokens"][-1]
        s.cache.length, s.dcache.length = s.start, old
        self.synced, self.in_window = (s.start, s.bonus), rec["count"]
        return rec["tokens"]

    def _enter_window(self, s) -> None:
        """From the host's context to the device window: the drafter cache must hold every row before the
        window (start - b), the window the taps of the last b positions."""
        if self.in_window:
            return
        b, ex = s.block, self.ex
        ahead = len(s.ctx) - b                          # pending rows before the window: append them now
        if ahead > 0:
            block = np.array([s.bonus] + [ex.drafter_config.mask_token_id] * (b - 1))
            ex.drafter_forward(block, np.arange(s.start, s.start + b), s.ctx[:ahead], s.dcache)   # logits unused
        s.dcache.length = s.start - b
        self.gpu.copy_in(self.window, f32_to_bf16(np.asarray(s.window, np.float64)))
        s.ctx, self.in_window = None, b                 # the window's b rows are not in the drafter cache yet

    def drafter_prefill(self, s) -> None:
        """The loop's hook after the prompt's prefill: the drafter ingests the prompt's context now (as the
        target does), so the first step starts from the device window like every later one."""
        if s.cache is self.ex.target_cache and s.start >= s.block:
            self._enter_window(s)

    def _leave_window(self, s) -> None:
        """Back to the host's context (the composition's steps): the window's new rows become s.ctx."""
        if not self.in_window:
            return
        b = s.block
        window = as_float(self.window.numpy()[:b], np.float32)
        s.window, s.ctx = window, window[b - self.in_window:]
        s.dcache.length = s.start - self.in_window
        self.in_window, self.synced = 0, None

    def last_verify(self) -> dict:
        """The last DDTree step's verify on the host (its buffers hold it until the next step): logits [n, V],
        the tree tensors, and the sampler's target tokens, accepted nodes, count and bonus (tests)."""
        tree, out = self.last["tree"], self.last["sampled"]
        return {"logits": self.last["logits"].numpy(), "tokens": tree.tokens.numpy(), "parents": tree.parents.numpy(),
                "positions": tree.positions.numpy(), "target": out.target.numpy(), "accepted": out.accepted.numpy(),
                "count": int(out.count.numpy()[0]), "bonus": int(out.bonus.numpy()[0])}

    def stats(self) -> dict:
        """host_us_per_step: the host's time per step that was already in flight when the loop asked for it (the
        steady state: replay the next, read this one's record); started steps (the first of a request or after a
        step off the graph: state and window uploaded, synchronising) are counted apart, capture excluded."""
        mean = lambda s, n: 1e6 * s / n if n else 0.0                  # noqa: E731
        return {"capture_s": self.capture_s, "graph_steps": self.graph_steps + self.started_steps,
                "host_us_per_step": mean(self.host_s, self.graph_steps),
                "started_steps": self.started_steps, "host_us_per_started_step": mean(self.started_s, self.started_steps)}
