"""An executor over a built engine directory, with the ranks simulated in one process on CPU.

Same primitives as NumpyExecutor (docs/interfaces.md section 6). Each rank's weights are its own
rank<r>/*.safetensors; every layer is the one description of description/layers.py run by the numpy backend,
one thread per rank, the ranks meeting in their all-reduce (parallel/collectives.py). The logits stay
vocab-split per rank: `sample` and `tree_build` run the vocab-parallel algorithms of
runtime/vocab_parallel.py. target_forward / drafter_forward still return the full logits [q, V] (an
all-gather of the slices), because the loop's interface hands logits from one primitive to the next;
a GPU executor keeps them split and gathers only the winners.

One rank per process (runtime/ranks.py): `rank=r` loads only rank r's weights and runs its share with
`collective` (a SharedMemoryGroup); the logits slices are all-gathered through it, so every rank holds
the same full logits and reaches the same samples, tree and walk from the same bits (the rank-symmetric
step); caches then hold that one rank.

Computes in float64 by default (bf16 weights and INT4 experts convert exactly), so its logits equal
the reference's on the source checkpoint up to summation order (~1e-15 relative). Meant for small
(synthetic) engines: the weights are held in memory as float64.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ddtree.backends.numpy_backend import NumpyOps, NumpyRanks
from ddtree.backends.numpy_math import union_feeds
from ddtree.description import layers, stack
from ddtree.description.opset import RankLayout
from ddtree.engine_dir import check_engine, engine_configs, load_rank_tensors, tokenizer_dir
from ddtree.parallel.collectives import collective_for
from ddtree.runtime import vocab_parallel
from ddtree.runtime.caches import DraftCaches, TargetCaches
from ddtree.runtime.executor import Executor
from ddtree.runtime.per_rank import per_rank_run
from ddtree.tree.build import Tree, build_tree, pack_visibility
from ddtree.tree.sampling import SamplingParams

DRAFT_CAPACITY = 256            # drafter context rows to start with (grown on demand on CPU)


def checked_forward_inputs(ids, pos, visible, T: int, vocab_size: int, error=ValueError) -> tuple:
    """A target call's ids [q], pos [q], visible [q, T + q] as arrays, checked: shapes, ids in the vocab, and the
    whole cache prefix visible (the kernels' contract: only the new tokens are masked). Raises `error`."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    pos = np.asarray(pos, dtype=np.int64).reshape(-1)
    visible = np.asarray(visible, dtype=bool)
    q = len(ids)
    if visible.shape != (q, T + q) or pos.shape != (q,):
        raise error(f"target_forward: pos must be [{q}] and visible [{q}, {T + q}] for a cache of "
                    f"length {T}, got {list(pos.shape)} and {list(visible.shape)}")
    if q == 0 or ids.min() < 0 or ids.max() >= vocab_size:
        raise error(f"target_forward: token ids must be a non-empty list in 0..{vocab_size - 1}")
    if not visible[:, :T].all():
        raise error("target_forward: every new token must see the whole cache prefix (the tree mask "
                    "covers only the new tokens)")
    return ids, pos, visible


def checked_drafter_inputs(ctx_taps, block_ids, dcfg, min_rows: int = 0, error=ValueError) -> np.ndarray:
    """A drafter call's new context ctx_taps [n >= min_rows, K H] and block [2 .. block_size], checked.
    Returns ctx_taps as an array. Raises `error`."""
    ctx_taps = np.asarray(ctx_taps)
    width = dcfg.num_taps * dcfg.hidden_size
    if ctx_taps.ndim != 2 or ctx_taps.shape[1] != width or len(ctx_taps) < min_rows:
        rows = f"n >= {min_rows}" if min_rows else "n"
        raise error(f"drafter_forward: ctx_taps must be [{rows}, {width}], got {list(ctx_taps.shape)}")
    if not 2 <= len(block_ids) <= dcfg.block_size:
        raise error(f"drafter_forward: a block of {len(block_ids)} tokens (the drafter takes 2..{dcfg.block_size})")
    return ctx_taps


class EngineExecutor(Executor):
    name = "engine-numpy"

    def __init__(self, engine_dir, dtype=np.float64, verify: bool = True, rank: int | None = None, collective=None,
                 checked: tuple | None = None):
        """verify: every file's sha256 against manifest.json (the weights while they are read); False skips
        the hashes only, never the structural checks (engine_dir.check_engine). rank None: every rank, as
        threads; rank r: only rank r, meeting its peers in `collective`. checked: check_engine's result
        when the caller already has it (rank processes: rank 0 checks once, each rank hashes its weights)."""
        self.engine_dir = Path(engine_dir)
        self.meta, digests = checked if checked is not None else check_engine(self.engine_dir, verify)
        cfg, dcfg = engine_configs(self.engine_dir, self.meta)
        local = list(range(int(self.meta["tp"]))) if rank is None else [rank]
        weights = [load_rank_tensors(self.engine_dir, r, self.meta["weight_files"], convert=np.dtype(dtype),
                                     digests=digests) for r in local]
        self._setup(cfg, dcfg, weights, dtype, rank, collective)
        self.tokenizer_dir = tokenizer_dir(self.engine_dir)

    @classmethod
    def of_weights(cls, cfg, dcfg, plan: dict, weights: list[dict], budgets=(16,), dtype=np.float64) -> "EngineExecutor":
        """Every rank of `plan` (TPPlan.to_dict()) over tensors given in memory (weights[r]: rank r's tensors as an
        engine stores them, or objects numpy reads as such: bench/hash_model.py) instead of an engine directory;
        ranks as threads. budgets: the largest sets the drafter head's top-k (an engine's manifest budgets)."""
        self = cls.__new__(cls)
        self.engine_dir, self.tokenizer_dir = None, None
        self.meta = {"tp": plan["tp"], "plan": plan, "budgets": list(budgets)}
        self._setup(cfg, dcfg, weights, dtype, None, None)
        return self

    def _setup(self, cfg, dcfg, weights: list[dict], dtype, rank: int | None, collective) -> None:
        meta = self.meta
        self.config, self.drafter_config = cfg, dcfg
        self.dtype = np.dtype(dtype)
        self.tp = int(meta["tp"])
        self.moe_inter = meta["plan"]["per_rank"]["moe_intermediate"]
        self.layouts = [RankLayout.from_plan(meta["plan"], r) for r in range(self.tp)]
        self.local = list(range(self.tp)) if rank is None else [rank]          # the ranks held here
        self.held = len(self.local)
        self.collective = collective_for(self.tp) if rank is None else collective
        self.ranks = NumpyRanks([NumpyOps(w, self.layouts[r], self.collective, self.dtype)
                                 for w, r in zip(weights, self.local)])
        self.run = per_rank_run(lambda kind, fn, args, feeds, layer: self.ranks.call(fn, *args, feeds=feeds),
                                self.held)           # description/stack.py's run: every layer function on the ranks

    def _gathered(self, logits: list, what: str) -> np.ndarray:
        """Every rank's logits slice [q, V_r] -> [q, V]: joined here, or all-gathered from the other processes."""
        if self.held == self.tp:
            return np.concatenate(logits, axis=1)
        parts = self.collective.all_gather(self.local[0], logits[0], f"logits of {what}")   # [tp, q, V_r]
        return np.concatenate(list(parts), axis=1)

    # caches ------------------------------------------------------------------------------------
    def new_target_cache(self, capacity: int = 256, limit: int | None = None) -> TargetCaches:
        """`capacity` rows now, grown by doubling on demand up to `limit` rows (None: no limit)."""
        c = self.config
        return TargetCaches(self.held, c.num_hidden_layers, c.kv_lora_rank + c.qk_rope_head_dim, capacity, self.dtype,
                            limit)

    def new_drafter_cache(self, capacity: int = DRAFT_CAPACITY, limit: int | None = None) -> DraftCaches:
        d = self.drafter_config
        return DraftCaches(self.held, d.num_hidden_layers, d.num_key_value_heads // self.tp, d.head_dim, capacity,
                           self.dtype, limit)

    # primitives --------------------------------------------------------------------------------
    def prune_forward(self, ids, pos, visible, cache: TargetCaches, taps=(), pruning: stack.Pruning | None = None):
        """target_forward with the verify pruned inside (pruning: description/stack.py Pruning; its feeds hold the
        final live mask after the call, one entry per rank held here)."""
        return self.target_forward(ids, pos, visible, cache, taps, pruning)

    @property
    def expert_bytes(self) -> int:
        """One routed expert's bytes on a rank (its four kernel-layout tensors, as stored): tree_prune's cost unit."""
        L = self.config.moe_layers[0]
        w = self.ranks.ranks[0].weights
        names = [f"model.layers.{L}.mlp.experts.{k}" for k in ("gate_up.words", "gate_up.scales", "down.words",
                                                               "down.scales")]
        return sum(int(np.asarray(w[n]).nbytes) for n in names) // (self.layouts[0].expert_stop
                                                                      - self.layouts[0].expert_start)

    def target_forward(self, ids, pos, visible, cache: TargetCaches, taps=(), pruning: stack.Pruning | None = None):
        """ids [q], pos [q], visible [q, T+q] -> logits [q, V] (all-gathered), {L: h [q, H]}.
        The whole cache prefix must be visible (the kernels' contract: only the new tokens are masked)."""
        cfg = self.config
        T = cache.length
        ids, pos, visible = checked_forward_inputs(ids, pos, visible, T, cfg.vocab_size)
        q = len(ids)
        cache.reserve(T + q)
        feeds = {"ids": ids.astype(np.int32), "pos": pos.astype(np.int32), "cache_len": np.array([T], np.int32),
                 "tree_mask": pack_visibility(visible[:, T:]).view(np.int32)}
        head = {"sample_pos": feeds["pos"] + 1, "temperature": np.zeros(1, np.float32), "seed": np.zeros(2, np.int32)}
        tapped = {}
        outs = stack.target_forward(self.run, cfg, self.moe_inter, feeds, cache, taps,
                                    lambda L, h: tapped.__setitem__(L, h[0].copy()), head_feeds=head, prune=pruning)
        cache.length = T + q
        return self._gathered(outs["logits"], "head"), tapped

    def verify_requests(self, calls: list[tuple]) -> list[tuple]:
        """The union verify (the Executor ability): calls [(ids, pos, visible, cache, taps)] of Rq requests, each
        a target_forward call on its own cache -> [(logits [q_i, V], {L: h [q_i, H]})], as ONE forward over the
        union rows (description/stack.py target_forward with requests=Rq): row-wise ops over all rows, the
        append and the attention per request (numpy: the union's rows equal each call's alone up to BLAS summation
        order, ~1e-15 relative; tests/runtime/test_union_verify.py)."""
        if len(calls) == 1:
            return [self.target_forward(*calls[0])]
        cfg, checked, lens = self.config, [], []
        for ids, pos, visible, cache, _ in calls:
            lens.append(cache.length)
            checked.append(checked_forward_inputs(ids, pos, visible, cache.length, cfg.vocab_size))
            cache.reserve(cache.length + len(checked[-1][0]))
        masks = [pack_visibility(visible[:, T:]).view(np.int32) for (_, _, visible), T in zip(checked, lens)]
        feeds = union_feeds([i for i, _, _ in checked], [p for _, p, _ in checked], lens, masks)
        offsets = feeds["row_offsets"]                                               # [Rq + 1]
        head = {"sample_pos": feeds["pos"] + 1, "temperature": np.zeros(1, np.float32), "seed": np.zeros(2, np.int32)}
        taps = sorted({L for *_, t in calls for L in t})
        tapped = {}
        caches = stack.RequestCaches([cache for *_, cache, _ in calls])
        outs = stack.target_forward(self.run, cfg, self.moe_inter, feeds, caches, taps,
                                    lambda L, h: tapped.__setitem__(L, h[0].copy()), head_feeds=head,
                                    requests=len(calls))
        logits = self._gathered(outs["logits"], "head")                               # [q, V]
        results = []
        for (*_, cache, call_taps), T, a, b in zip(calls, lens, offsets[:-1], offsets[1:]):
            cache.length = T + b - a
            results.append((logits[a:b], {L: tapped[L][a:b] for L in call_taps}))
        return results

    def drafter_forward(self, block_ids, pos, ctx_taps, cache: DraftCaches) -> np.ndarray:
        """block_ids [b], pos [b], ctx_taps [n, K H] -> draft logits [b-1, V] (all-gathered)."""
        d = self.drafter_config
        ctx_taps = checked_drafter_inputs(ctx_taps, block_ids, d).astype(self.dtype, copy=False)
        T, n, b = cache.length, len(ctx_taps), len(block_ids)
        cache.reserve(T + n)
        feeds = {"ctx_taps": ctx_taps, "ids": np.asarray(block_ids, np.int32), "pos": np.asarray(pos, np.int32),
                 "cache_len": np.array([T], np.int32)}
        k = layers.draft_topk(self.meta["budgets"], self.layouts[0].vocab_stop - self.layouts[0].vocab_start)
        outs = stack.drafter_forward(self.run, self.config, d, feeds, cache, b, head=(layers.draft_head, (k,)))
        cache.length = T + n
        return self._gathered(outs["logits"], "draft_head")

    def compact(self, cache: TargetCaches, start: int, keep) -> None:
        """Keep the verify's rows start + keep[i] at start + i (every layer, every rank), through the op set."""
        keep = np.asarray(keep, dtype=np.int32).reshape(-1)
        if not 0 <= start <= cache.length:
            raise ValueError(f"compact: start {start} must be within the cache length {cache.length}")
        stack.compact(self.run, self.config, {"cache_len": np.array([start], np.int32), "accepted": keep,
                                              "accepted_count": np.array([len(keep)], np.int32)}, cache)
        cache.length = start + len(keep)

    def sample(self, logits, positions, params: SamplingParams) -> np.ndarray:
        return vocab_parallel.sample(*vocab_parallel.split_logits(logits, self.layouts), positions, params)

    def tree_build(self, root_token: int, draft_logits: np.ndarray, budget: int) -> Tree:
        logp, ids = vocab_parallel.topk_logprobs(*vocab_parallel.split_logits(draft_logits, self.layouts), budget)
        return build_tree(root_token, logp, ids, budget)
