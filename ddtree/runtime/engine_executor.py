"""An executor over a built engine directory, with the ranks simulated in one process on CPU.

Same primitives as NumpyExecutor (docs/interfaces.md section 6). Each rank's weights are its own
rank<r>/*.safetensors; every layer runs as the per-rank functions of graphs/ranks.py, one call per
rank, and the partial results are summed at the all-reduce points. The logits stay vocab-split
per rank: `sample` and `tree_build` run the vocab-parallel algorithms of graphs/vocab_parallel.py.
target_forward / drafter_forward still return the full logits [q, V] (an all-gather of the slices),
because the loop's interface hands logits from one primitive to the next; a GPU executor keeps
them split and gathers only the winners.

Computes in float64 by default (bf16 weights and INT4 experts convert exactly), so its logits equal
the reference's on the source checkpoint up to summation order (~1e-15 relative). Meant for small
(synthetic) engines: the weights are held in memory as float64.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ddtree.engine_dir import config_path, load_rank_tensors, read_engine_config, tokenizer_dir
from ddtree.model.config import DrafterConfig, KimiConfig
from ddtree.reference.cache import LatentCache
from ddtree.reference.drafter import DraftCache
from ddtree.reference.rope import Rope, rope_frequencies
from ddtree.graphs import ranks, vocab_parallel
from ddtree.tree.build import Tree, build_tree
from ddtree.tree.sampling import SamplingParams
from ddtree.tree.walk import WalkResult, accept_walk


class RankCaches:
    """The target's latent cache on every rank (replicated: each rank writes the same entries)."""

    def __init__(self, caches: list[LatentCache]):
        self.ranks = caches

    @property
    def length(self) -> int:
        return self.ranks[0].length

    def set_length(self, n: int) -> None:
        for c in self.ranks:
            c.set_length(n)

    def compact(self, start: int, keep) -> None:
        for c in self.ranks:
            c.compact(start, keep)

    def truncate(self, n: int) -> None:
        for c in self.ranks:
            c.truncate(n)

    def entries(self, layer: int, end: int | None = None) -> np.ndarray:
        return self.ranks[0].entries(layer, end)


class RankDraftCaches:
    """The drafter's context K/V cache, split by kv head: rank r holds its own heads."""

    def __init__(self, caches: list[DraftCache]):
        self.ranks = caches

    @property
    def length(self) -> int:
        return self.ranks[0].length


class EngineExecutor:
    name = "engine-numpy"

    def __init__(self, engine_dir, dtype=np.float64):
        self.engine_dir = Path(engine_dir)
        self.meta = meta = read_engine_config(self.engine_dir)
        self.config = cfg = KimiConfig.from_dict(meta["model"], where=f"{config_path(self.engine_dir)} model")
        self.drafter_config = dcfg = DrafterConfig.from_dict(meta["drafter"],
                                                             where=f"{config_path(self.engine_dir)} drafter")
        self.dtype = np.dtype(dtype)
        self.tp = int(meta["tp"])
        self.layouts = [ranks.RankLayout.from_plan(meta["plan"], r) for r in range(self.tp)]
        # dense weights as self.dtype; routed experts stay in the kernel layout
        self.weights = [load_rank_tensors(self.engine_dir, r, meta["weight_files"], convert=self.dtype)
                        for r in range(self.tp)]
        self.expert_cache = [{} for _ in range(self.tp)]      # dequantised experts, filled on first use
        self.offsets = [lay.vocab_start for lay in self.layouts]
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim)
        self.draft_freqs = rope_frequencies(dcfg.rope, dcfg.head_dim)
        self.tokenizer_dir = tokenizer_dir(self.engine_dir)

    def _each(self, fn, *args) -> list[np.ndarray]:
        """fn(rank's weights, rank's layout, rank index, *args) for every rank."""
        return [fn(w, lay, r, *args) for r, (w, lay) in enumerate(zip(self.weights, self.layouts))]

    def _split(self, logits: np.ndarray) -> list[np.ndarray]:
        return [logits[:, lay.vocab_start: lay.vocab_stop] for lay in self.layouts]

    # caches ------------------------------------------------------------------------------------
    def new_target_cache(self, capacity: int = 256) -> RankCaches:
        c = self.config
        return RankCaches([LatentCache(c.num_hidden_layers, c.kv_lora_rank, c.qk_rope_head_dim, self.dtype, capacity)
                           for _ in range(self.tp)])

    def new_drafter_cache(self) -> RankDraftCaches:
        d = self.drafter_config
        return RankDraftCaches([DraftCache(d.num_hidden_layers, d.num_key_value_heads // self.tp, d.head_dim,
                                           self.dtype) for _ in range(self.tp)])

    # primitives --------------------------------------------------------------------------------
    def target_forward(self, ids, pos, visible, cache: RankCaches, taps=()):
        """ids [q], pos [q], visible [q, T+q] -> logits [q, V] (all-gathered), {L: h [q, H]}."""
        cfg, dt = self.config, self.dtype
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        pos = np.asarray(pos, dtype=np.int64).reshape(-1)
        visible = np.asarray(visible, dtype=bool)
        T, q = cache.length, len(ids)
        if visible.shape != (q, T + q) or pos.shape != (q,):
            raise ValueError(f"target_forward: pos must be [{q}] and visible [{q}, {T + q}] for a cache of "
                             f"length {T}, got {list(pos.shape)} and {list(visible.shape)}")
        if q == 0 or ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"target_forward: token ids must be a non-empty list in 0..{cfg.vocab_size - 1}")
        h = ranks.all_reduce(self._each(lambda w, lay, r: ranks.rank_embed(ids, w, lay, dt)))      # [q, H]
        tapped = {}
        for L in range(cfg.num_hidden_layers):
            h = h + ranks.all_reduce(self._each(lambda w, lay, r: ranks.rank_attention(
                h, pos, visible, cache.ranks[r], L, w, cfg, self.rope, dt)))
            h = h + ranks.all_reduce(self._each(lambda w, lay, r: ranks.rank_mlp(
                h, L, w, cfg, lay, dt, self.expert_cache[r])))
            if L in taps:
                tapped[L] = h.copy()
        cache.set_length(T + q)
        local = self._each(lambda w, lay, r: ranks.rank_logits(h, w, cfg, dt))                      # [q, V_r] each
        return np.concatenate(local, axis=1), tapped

    def drafter_forward(self, block_ids, pos, ctx_taps, cache: RankDraftCaches) -> np.ndarray:
        """block_ids [b], pos [b], ctx_taps [n, K H] -> draft logits [b-1, V] (all-gathered)."""
        d, dt = self.drafter_config, self.dtype
        block_ids = np.asarray(block_ids, dtype=np.int64)
        pos = np.asarray(pos, dtype=np.int64)
        ctx_taps = np.asarray(ctx_taps, dtype=dt)
        if ctx_taps.ndim != 2 or ctx_taps.shape[1] != d.num_taps * d.hidden_size:
            raise ValueError(f"drafter_forward: ctx_taps must be [n, {d.num_taps * d.hidden_size}], "
                             f"got {list(ctx_taps.shape)}")
        T0, n = cache.length, len(ctx_taps)
        ctx_pos = np.arange(T0, T0 + n)
        fc_out = ranks.all_reduce(self._each(lambda w, lay, r: ranks.rank_draft_fc(ctx_taps, w, lay, dt)))
        ctx = [ranks.rank_draft_context(fc_out, w, d, dt) for w in self.weights]      # replicated [n, H]
        h = ranks.all_reduce(self._each(lambda w, lay, r: ranks.rank_embed(block_ids, w, lay, dt)))   # [b, H]
        for L in range(d.num_hidden_layers):
            h = h + ranks.all_reduce(self._each(lambda w, lay, r: ranks.rank_draft_attention(
                h, ctx[r], pos, ctx_pos, cache.ranks[r], L, w, d, self.draft_freqs, dt)))
            h = h + ranks.all_reduce(self._each(lambda w, lay, r: ranks.rank_draft_mlp(h, L, w, d, dt)))
        local = self._each(lambda w, lay, r: ranks.rank_draft_logits(h, w, d, dt))            # [b-1, V_r] each
        return np.concatenate(local, axis=1)

    def compact(self, cache: RankCaches, start: int, keep) -> None:
        cache.compact(start, keep)

    def sample(self, logits, positions, params: SamplingParams) -> np.ndarray:
        return vocab_parallel.sample(self._split(np.asarray(logits)), self.offsets, positions, params)

    def tree_build(self, root_token: int, draft_logits: np.ndarray, budget: int) -> Tree:
        logp, ids = vocab_parallel.topk_logprobs(self._split(np.asarray(draft_logits)), self.offsets, budget)
        return build_tree(root_token, logp, ids, budget)

    def accept_walk(self, tree: Tree, target_tokens) -> WalkResult:
        return accept_walk(tree, target_tokens)
