"""GPU tests of what a captured DDTree step graph needs from the sampler and the KV compaction: nothing
that changes between steps or requests is a captured kernel argument (docs/interfaces.md section 8).

Sampler: one graph per mode captured from TreeSampler.launch, replayed with parameters written by
set_params between replays (other seeds, temperatures, top_k, top_p) and logits / positions rewritten in
place; every replay's tokens equal ddtree/tree/sampling.py sample on the same logits, and two requests
with different seeds each get their own tokens (no stale seed). A record of another mode is reported.
Compaction: kv_compact with its count on the device, captured once (DeviceLatentCache.compact and the
cuda backend's kv_compact), replayed with other counts and paths == ddtree/backends/numpy_math.kv_compact.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import tree_cases as tc

from ddtree.backends.numpy_math import kv_compact
from ddtree.tree.sampling import SamplingParams, sample

pytestmark = pytest.mark.gpu
V, N = 40000, 33                                    # 3 slices a row; 33 rows (a tree of budget 32)

# per mode: the requests replayed through one graph, with the logits shape each sees
REQUESTS = {
    "greedy": [(SamplingParams(), "ties"), (SamplingParams(), "flat"), (SamplingParams(), "peaked")],
    "gumbel": [(SamplingParams(temperature=1.0, seed=1), "flat"),
               (SamplingParams(temperature=0.7, seed=(5 << 32) + 9), "flat"),
               (SamplingParams(temperature=2.5, seed=(1 << 63) + 1), "peaked")],
    "top_k": [(SamplingParams(temperature=0.8, top_k=50, seed=4), "flat"),
              (SamplingParams(temperature=1.3, top_k=256, top_p=0.9, seed=7), "flat"),
              (SamplingParams(temperature=1.0, top_k=5, top_p=0.5, seed=(1 << 40) + 3), "ties"),
              (SamplingParams(temperature=1.0, top_k=1, seed=8), "peaked")],
    "top_p": [(SamplingParams(temperature=1.0, top_p=0.9, seed=7), "peaked"),      # certified by the candidates
              (SamplingParams(temperature=0.6, top_p=0.5, seed=9), "flat"),        # full-row path
              (SamplingParams(temperature=1.0, top_p=1e-9, seed=10), "flat"),      # keeps one token
              (SamplingParams(temperature=1.2, top_p=0.95, seed=(3 << 32) + 1), "ties")],
}


@pytest.fixture(scope="module")
def sampler(gpu):
    from ddtree.plugins.tree_sample import TreeSampler
    return TreeSampler(gpu, vocab=V)


def captured(gpu, sampler, mode, logits, query_pos):
    """The graph of sampler.launch(mode) (after one eager launch: modules load outside the capture). The
    warm-up reads whatever the buffers hold (all-zero logits: one top-p bin of V tokens, an overflow flag),
    so its status flags are cleared: check_status then speaks for the replays alone."""
    sampler.launch(mode, logits, query_pos, N)
    gpu.memset(sampler.status, 0)
    gpu.sync()
    holder = {}
    graph = gpu.capture(lambda s: holder.update(out=sampler.launch(mode, logits, query_pos, N, stream=s)))
    return graph, holder["out"]


@pytest.mark.parametrize("mode", list(REQUESTS))
def test_one_graph_per_mode_serves_every_parameter_set(gpu, sampler, mode):
    logits, query_pos = gpu.alloc((N, V), np.float32), gpu.alloc((N,), np.int32)
    plan = sampler.set_params(REQUESTS[mode][0][0])
    assert plan.mode == mode
    graph, out = captured(gpu, sampler, mode, logits, query_pos)
    rng = np.random.default_rng(len(mode))
    full_rows_before = int(sampler.full_row_rows.numpy()[0])
    for i, (params, shape) in enumerate(REQUESTS[mode] * 2):       # each request twice, in turn
        x = tc.target_logits(rng, N, V, shape)
        pos = rng.integers(0, (1 << 31) - 2, size=N).astype(np.int32)
        gpu.copy_in(logits, x)
        gpu.copy_in(query_pos, pos)
        assert sampler.set_params(params).mode == mode
        gpu.replay(graph)
        np.testing.assert_array_equal(out.target.numpy(), sample(x, pos.astype(np.int64) + 1, params),
                                      err_msg=f"{mode} replay {i}: {params}")
    sampler.check_status()
    if mode == "top_p":                    # the replays took both top-p paths
        full_rows = int(sampler.full_row_rows.numpy()[0]) - full_rows_before
        assert 0 < full_rows < 2 * N * len(REQUESTS[mode])


@pytest.mark.parametrize("mode,params", [("gumbel", SamplingParams(temperature=1.0)),
                                         ("top_p", SamplingParams(temperature=1.0, top_p=0.95)),
                                         ("top_k", SamplingParams(temperature=0.9, top_k=200, top_p=0.99))])
def test_back_to_back_requests_get_their_own_seed(gpu, sampler, mode, params):
    """The same logits and positions, two requests that differ only in the seed: each replay equals its own
    seed's numpy tokens, and the two differ (so a stale seed would show)."""
    from dataclasses import replace
    logits, query_pos = gpu.alloc((N, V), np.float32), gpu.alloc((N,), np.int32)
    rng = np.random.default_rng(5)
    x, pos = tc.target_logits(rng, N, V, "flat"), rng.integers(0, 1 << 20, size=N).astype(np.int32)
    gpu.copy_in(logits, x)
    gpu.copy_in(query_pos, pos)
    sampler.set_params(params)
    graph, out = captured(gpu, sampler, mode, logits, query_pos)
    got = {}
    for seed in (11, (7 << 32) + 11, 11):
        request = replace(params, seed=seed)
        sampler.set_params(request)
        gpu.replay(graph)
        got[seed] = out.target.numpy()
        np.testing.assert_array_equal(got[seed], sample(x, pos.astype(np.int64) + 1, request), err_msg=f"seed {seed}")
    assert (got[11] != got[(7 << 32) + 11]).sum() > N // 2
    sampler.check_status()


def test_a_record_of_another_mode_is_reported(gpu, sampler):
    logits, query_pos = gpu.upload(np.zeros((N, V), np.float32)), gpu.upload(np.zeros(N, np.int32))
    sampler.set_params(SamplingParams(temperature=1.0))
    graph, _ = captured(gpu, sampler, "gumbel", logits, query_pos)
    sampler.set_params(SamplingParams(temperature=1.0, top_k=40))           # a top_k record
    gpu.replay(graph)
    with pytest.raises(ValueError, match="parameters of another"):
        sampler.check_status()
    sampler.set_params(SamplingParams(temperature=1.0))
    gpu.replay(graph)
    sampler.check_status()                                                   # cleared, and right again


def test_launch_rejects_an_unknown_mode(gpu, sampler):
    with pytest.raises(ValueError, match="mode must be one of greedy, gumbel, top_k, top_p"):
        sampler.launch("nucleus", gpu.alloc((1, V), np.float32), gpu.alloc((1,), np.int32), 1)


# ---- kv_compact with a device count -----------------------------------------------------------------------
LAYERS, CAP, T0, N_MAX = 2, 400, 100, 64
# (start, accepted path padded with -1 like the walk's output, count)
COMPACTIONS = [(100, [0, 3, 9, 10, 40], 5), (37, list(range(N_MAX)), N_MAX), (250, [0], 1), (5, [0, 1, 2], 0),
               (80, [0, 2, 4, 6, 8, 63], 6), (100, [1, 2, 3, 4], 4), (0, [0, 63], 2)]


def padded(path):
    keep = np.full(N_MAX, -1, np.int32)
    keep[: len(path)] = path
    return keep


def test_kv_compact_count_on_the_device_in_a_graph(gpu):
    from ddtree.plugins.kv_cache import DeviceLatentCache
    latent, rope = 512, 64
    cache = DeviceLatentCache(gpu, LAYERS, CAP, latent=latent, rope=rope)
    keep, count = gpu.alloc((N_MAX,), np.int32), gpu.alloc((1,), np.int32)
    cache.set_length(T0)
    gpu.copy_in(count, np.array([0], np.int32))
    cache.compact(keep, N_MAX, count=count)                  # moves nothing; loads the module before capture
    graph = gpu.capture(lambda s: cache.compact(keep, N_MAX, count=count, stream=s))
    rng = np.random.default_rng(3)
    for start, path, c in COMPACTIONS:
        data = rng.integers(0, 1 << 16, size=(LAYERS, CAP, latent + rope), dtype=np.uint16)
        gpu.copy_in(cache.buf, data)
        cache.set_length(start)
        gpu.copy_in(keep, padded(path))
        gpu.copy_in(count, np.array([c], np.int32))
        gpu.replay(graph)
        got = cache.buf.numpy()
        for layer in range(LAYERS):
            want = kv_compact(data[layer].copy(), start, path, c)
            np.testing.assert_array_equal(got[layer], want, err_msg=f"start {start} path {path[:6]} count {c}")


def test_cuda_backend_kv_compact_reads_a_device_only_count(gpu):
    """accepted_count without a host copy: n = accepted rows launched, the count read in the graph; with a
    host copy: as before (n = that count)."""
    from ddtree.backends.cuda_backend import CudaOps
    from ddtree.backends.cuda_tensor import Tensor
    latent, rope = 512, 64
    ops = CudaOps(gpu, None, SimpleNamespace(latent=(latent, rope)))
    cache, cache_len = gpu.alloc((CAP, latent + rope), np.uint16), gpu.alloc((1,), np.int32)
    accepted, count = gpu.alloc((N_MAX,), np.int32), gpu.alloc((1,), np.int32)
    args = [Tensor.of(cache), Tensor.of(cache_len), Tensor.of(accepted), Tensor.of(count)]
    gpu.copy_in(count, np.array([0], np.int32))
    ops.kv_compact(*args)                                    # moves nothing; loads the module before capture

    def step(stream):
        ops.stream = stream
        ops.kv_compact(*args)
    graph = gpu.capture(step)
    ops.stream = None
    rng = np.random.default_rng(4)
    for start, path, c in COMPACTIONS + [(100, [0, 5, 7], 3)]:
        data = rng.integers(0, 1 << 16, size=(CAP, latent + rope), dtype=np.uint16)
        for host_count in (False, True):
            gpu.copy_in(cache, data)
            gpu.copy_in(cache_len, np.array([start], np.int32))
            gpu.copy_in(accepted, padded(path))
            gpu.copy_in(count, np.array([c], np.int32))
            if host_count:
                ops.kv_compact(*args[:3], Tensor.of(count, host=np.array([c], np.int32)))
            else:
                gpu.replay(graph)
            np.testing.assert_array_equal(cache.numpy(), kv_compact(data.copy(), start, path, c),
                                          err_msg=f"start {start} path {path[:6]} count {c} host {host_count}")
