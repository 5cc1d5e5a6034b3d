"""The union verify on the GPU (cuda backend: one launch of the one-request append and tree attention kernels per
request, description/layers.py decoder_layer(requests=Rq) for the rest; runtime/cuda_model.py union_layers), on the
embedded tiny model's tp 1 engine, against each request's own target_forward on its own device cache:

    batch-invariant plan   every GEMM, absorb and MoE split is the same for any row count and the attention of a
                           request is its own launch: the union's rows are each request's logits bitwise
    fast plan              the GEMM plans follow the union's row count, so a row's sums may run in another order:
                           each request's rows within bf16 rounding of its own (and much closer to its own than to
                           the same rows verified after another request's cache)
"""
import numpy as np
import pytest

from ddtree.description import layers
from ddtree.reference.model import causal_visible
from ddtree.tree.build import pack_visibility

pytestmark = pytest.mark.gpu
REQUESTS = [(0, 5), (1, 17), (2, 40)]            # (prompt index, tree nodes): masks of 1, 1 and 2 words


def tree_visible(rng, n: int) -> np.ndarray:
    vis = np.eye(n, dtype=bool)
    for i in range(1, n):
        vis[i] |= vis[int(rng.integers(0, i))]
    return vis


@pytest.fixture(scope="module", params=["batch-invariant", "fast"])
def tiny(request, tmp_path_factory):
    from tests.runtime.tiny_gpu import tiny_gpu_executor
    return request.param, *tiny_gpu_executor(tmp_path_factory, f"tiny-union-{request.param}", n_prompts=3,
                                             kernel_plan=request.param)


def prefilled(ex, caches, prompts):
    for cache, ids in zip(caches, prompts):
        cache.length = 0
        ex.target_forward(np.array(ids), np.arange(len(ids)), causal_visible(0, len(ids)), cache)


def test_the_gpu_union_forward_is_each_requests_own_forward(tiny):
    from ddtree.plugins.kv_cache import DeviceLatentCache
    from ddtree.runtime.cuda_model import GpuTargetCache, union_layers
    plan, ex, prompts = tiny
    cfg, rng = ex.config, np.random.default_rng(2)
    caches = [ex.target_cache] + [GpuTargetCache(DeviceLatentCache(ex.gpu, cfg.num_hidden_layers, 512,
                                                                   latent=cfg.kv_lora_rank,
                                                                   rope=cfg.qk_rope_head_dim)) for _ in range(2)]
    mine = [prompts[p] for p, _ in REQUESTS]
    trees = []
    for ids, (_, n) in zip(mine, REQUESTS):
        T = len(ids)
        visible = np.concatenate([np.ones((n, T), bool), tree_visible(rng, n)], axis=1)
        trees.append((rng.integers(0, cfg.vocab_size, n), T + rng.integers(0, 6, n), visible))
    prefilled(ex, caches, mine)
    lens = [c.length for c in caches]
    alone = [ex.target_forward(ids, pos, vis, cache)[0] for (ids, pos, vis), cache in zip(trees, caches)]
    rows_alone = [[c.dev.layer(L).numpy()[T: T + n] for L in range(cfg.num_hidden_layers)]
                  for c, T, (_, n) in zip(caches, lens, REQUESTS)]
    prefilled(ex, caches, mine)
    entry = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    for c, T, (_, n) in zip(caches, lens, REQUESTS):      # the tree rows wiped: the union must write them again
        for L in range(cfg.num_hidden_layers):
            ex.gpu.copy_in(c.dev.layer(L).view(T * entry, (n, entry)), np.zeros((n, entry), np.uint16))
    rows = [len(ids) for ids, _, _ in trees]
    off = np.concatenate([[0], np.cumsum(rows)]).astype(np.int32)
    feeds = {"ids": np.concatenate([t[0] for t in trees]).astype(np.int32),
             "pos": np.concatenate([t[1] for t in trees]).astype(np.int32), "cache_len": np.array(lens, np.int32),
             "row_offsets": off, **{f"tree_mask.{i}": pack_visibility(vis[:, T:]).view(np.int32)
                                    for i, ((_, _, vis), T) in enumerate(zip(trees, lens))}}
    h = union_layers(ex, feeds, caches)
    union = ex._logits(ex.ops.call(layers.head_logits, cfg, feeds={"h": h})["logits"])       # [q, V] float32
    for i, (a, b) in enumerate(zip(off[:-1], off[1:])):
        got, want = union[a:b], alone[i]
        if plan == "batch-invariant":
            assert (got == want).all(), f"request {i}: max |diff| {np.abs(got - want).max():.3e}"
        else:
            scale = np.abs(want).max()
            assert np.abs(got - want).max() <= 3e-2 * scale, f"request {i}: {np.abs(got - want).max():.3e}"
            other = alone[(i + 1) % 3][: b - a] if len(alone[(i + 1) % 3]) >= b - a else None
            if other is not None:                       # a leak of another request's cache would be this large
                assert np.abs(got - want).max() < 0.25 * np.abs(got - other).max()
        for L in range(cfg.num_hidden_layers):          # each cache holds its own request's new rows, as alone
            rows = caches[i].dev.layer(L).numpy()[lens[i]: lens[i] + b - a]
            assert rows.any() and (plan != "batch-invariant" or (rows == rows_alone[i][L]).all())
