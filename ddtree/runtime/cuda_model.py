"""The model (description/stack.py) on the cuda backend: the device caches and the stack's feeds of them.

    cache, dcache = device_caches(gpu, cfg, dcfg, tp, rows);  h = target_layers(ex, feeds, cache, tap, taps)
    h = union_layers(ex, feeds, [cache_0, cache_1, ...])             # Rq requests' rows in one forward

Shared by the executor's primitives (cuda_executor.py) and the step graphs (cuda_step.py, cuda_step_tp.py), which
run the same functions with device buffers as feeds.
"""
from __future__ import annotations

import numpy as np

from ddtree.backends.cuda_tensor import Tensor
from ddtree.description import stack
from ddtree.plugins.kv_cache import DeviceLatentCache
from ddtree.runtime.loop import RequestError


class GpuTargetCache:
    """The latent cache of every layer on the device (plugins/kv_cache.py DeviceLatentCache) + its length."""

    def __init__(self, dev):
        self.dev, self.length = dev, 0

    @property
    def capacity(self) -> int:
        return self.dev.capacity

    def reserve(self, rows: int) -> None:
        if rows > self.capacity:
            raise RequestError(f"GPU target cache: {rows} rows asked for, past its capacity of {self.capacity} "
                               "(--max-context)")

    def layer(self, L: int) -> Tensor:
        return Tensor.of(self.dev.layer(L))

    def entries(self, layer: int, end: int | None = None) -> np.ndarray:
        return self.dev.layer(layer).numpy()[: self.length if end is None else end]


class GpuDraftCache:
    def __init__(self, gpu, layers: int, capacity: int, kv_heads: int, d: int):
        self.k = [gpu.alloc((capacity, kv_heads, d), np.uint16) for _ in range(layers)]
        self.v = [gpu.alloc((capacity, kv_heads, d), np.uint16) for _ in range(layers)]
        self.lengths = gpu.zeros(1, np.int32)
        self.capacity, self.length = capacity, 0

    def reserve(self, rows: int) -> None:
        if rows > self.capacity:
            raise RequestError(f"GPU drafter cache: {rows} rows asked for, past its capacity of {self.capacity} "
                               "(--max-context)")


def drafter_kv_heads(dcfg, tp: int) -> int:
    """A rank's drafter KV heads: its share, or 1 (replicated) where the ranks outnumber them."""
    return dcfg.num_key_value_heads // tp if dcfg.num_key_value_heads >= tp else 1


def cache_bytes(cfg, dcfg, tp: int, rows: int) -> dict:
    """Device bytes of one request's caches of `rows` rows on a rank of tp: {"target": ..., "drafter": ...}."""
    return {"target": cfg.num_hidden_layers * rows * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2,
            "drafter": 2 * dcfg.num_hidden_layers * rows * drafter_kv_heads(dcfg, tp) * dcfg.head_dim * 2}


def new_target_cache(gpu, cfg, rows: int) -> GpuTargetCache:
    return GpuTargetCache(DeviceLatentCache(gpu, cfg.num_hidden_layers, rows, latent=cfg.kv_lora_rank,
                                            rope=cfg.qk_rope_head_dim))


def device_caches(gpu, cfg, dcfg, tp: int, rows: int) -> tuple[GpuTargetCache, GpuDraftCache]:
    """One request's target and drafter caches of `rows` rows on a rank of tp (what cache_bytes counts)."""
    return new_target_cache(gpu, cfg, rows), GpuDraftCache(gpu, dcfg.num_hidden_layers, rows,
                                                           drafter_kv_heads(dcfg, tp), dcfg.head_dim)


class HeldCaches:
    """new_target_cache / new_drafter_cache over caches allocated once (self.target_cache, self.draft_cache of
    self.max_context rows): handed out emptied, the step graphs told of the new request (self.steps). The
    executor's own (cuda_executor.py) and each request lane's (cuda_lanes.py)."""

    def new_target_cache(self, capacity: int = 0, limit: int | None = None) -> GpuTargetCache:
        if limit is not None and limit > self.max_context:
            raise RequestError(f"prompt + new tokens need {limit} cache rows; the GPU caches hold {self.max_context} "
                               "(--max-context)")
        self.target_cache.length = 0
        if self.steps:
            self.steps.new_request()
        return self.target_cache

    def new_drafter_cache(self, capacity: int = 0, limit: int | None = None) -> GpuDraftCache:
        self.draft_cache.length = 0
        return self.draft_cache


def target_layers(ex, feeds: dict, cache: GpuTargetCache, tap=None, taps=(), prune: stack.Pruning | None = None
                  ) -> Tensor:
    """The embedding and every decoder layer of ex (an executor, or bench step's SyntheticRank: ops, config,
    moe_inter) through description/stack.py (feeds: ids, pos, cache_len, tree_mask) -> h [q, H]; tap(L, h) after
    each layer L in taps (the primitives download taps, the step graph copies them on the device). prune: a pruned
    verify (--prune auto; its final live mask in prune.feeds["live"]). The layers chain their norms where the ops
    say so (CudaOps.chain_norms: the add at a layer's end fused with the next layer's input norm)."""
    return stack.target_forward(ex.ops.run, ex.config, ex.moe_inter, feeds, target_feeds(cache), taps, tap,
                                head=None, prune=prune, chain_norms=ex.ops.chain_norms)["h"]


def union_layers(ex, feeds: dict, caches: list, tap=None, taps=()) -> Tensor:
    """target_layers over Rq requests' rows at once, the union verify (description/stack.py target_forward with
    requests=Rq; feeds: ids, pos, cache_len [Rq], row_offsets [Rq + 1], tree_mask.<i>): each request's append and
    attention on its own GpuTargetCache, every other op over the union rows -> h [q, H]. The row offsets must be
    known on the host: a numpy array, or (to capture it: fixed per graph) a device buffer carrying its host copy
    (Tensor.of(buf, host=offsets), as bench/step_requests.py does)."""
    return stack.target_forward(ex.ops.run, ex.config, ex.moe_inter, feeds,
                                stack.RequestCaches([target_feeds(c) for c in caches]), taps, tap, head=None,
                                requests=len(caches), chain_norms=ex.ops.chain_norms)["h"]


def target_feeds(cache: GpuTargetCache) -> stack.InPlace:
    return stack.InPlace(lambda L: {"cache": cache.layer(L)}, stacked=lambda: {"cache": Tensor.of(cache.dev.buf)})


def draft_feeds(cache: GpuDraftCache) -> stack.InPlace:
    return stack.InPlace(lambda L: {"cache_k": cache.k[L], "cache_v": cache.v[L]})
