"""parallel/cuda_collectives.py on one GPU: ranks as threads, each with its own Gpu (stream). The all-reduce equals
plugins/allreduce.reference_sum (the rank-ordered float32 sum rounded once to bf16) bit for bit on every rank,
the all-gather stacks the parts in rank order, and a rank that fails releases the others."""
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpus():
    from ddtree.runtime.cuda_executor import gpu_unavailable
    why = gpu_unavailable(0)
    if why:
        pytest.skip(why)
    from ddtree.plugins.device import Gpu
    return [Gpu(0) for _ in range(5)]


def run(gpus, body):
    out, errors = [None] * len(gpus), []

    def thread(r):
        gpus[r].dev.set_current()
        try:
            out[r] = body(r, gpus[r])
        except BaseException as e:             # noqa: BLE001 (collected for the main thread)
            errors.append(e)
    threads = [threading.Thread(target=thread, args=(r,)) for r in range(len(gpus))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, errors


def test_all_reduce_and_all_gather_are_the_rank_ordered_twins(gpus):
    from ddtree.backends.cuda_tensor import Tensor
    from ddtree.parallel.cuda_collectives import ThreadRankGroup
    from ddtree.plugins.allreduce import reference_sum
    rng = np.random.default_rng(3)
    parts = [rng.normal(0, 1 + r, (17, 7168)).astype(np.float32).view(np.uint32) >> 16 for r in range(len(gpus))]
    parts = [p.astype(np.uint16) for p in parts]
    group = ThreadRankGroup(len(gpus))

    def body(r, g):
        m = group.member(r)
        x, out, gathered = g.upload(parts[r]), g.alloc((17, 7168), np.uint16), g.alloc((len(gpus), 17, 7168), np.uint16)
        for _ in range(3):                                   # repeated calls reuse the slots safely
            m.all_reduce(g, Tensor.of(x), Tensor.of(out))
        m.all_gather(g, Tensor.of(x), Tensor.of(gathered))
        return out.numpy(), gathered.numpy()
    out, errors = run(gpus, body)
    assert not errors, errors
    want = reference_sum(parts)
    for r, (reduced, gathered) in enumerate(out):
        assert np.array_equal(reduced, want), f"rank {r}: all-reduce differs from reference_sum"
        assert np.array_equal(gathered, np.stack(parts)), f"rank {r}: all-gather out of rank order"


def test_a_failing_rank_releases_the_others(gpus):
    from threading import BrokenBarrierError

    from ddtree.backends.cuda_tensor import Tensor
    from ddtree.parallel.cuda_collectives import ThreadRankGroup
    group = ThreadRankGroup(len(gpus), timeout_s=60)

    def body(r, g):
        x = g.zeros((8, 64), np.uint16)
        if r == 2:
            group.member(r).all_reduce(g, Tensor.of(x), Tensor(x.ptr, (4, 64), np.dtype(np.float32), (64, 1)))
        else:
            group.member(r).all_reduce(g, Tensor.of(x), Tensor.of(x))
    _, errors = run(gpus, body)
    assert any(isinstance(e, ValueError) and "rank 2" in str(e) for e in errors)
    assert all(isinstance(e, (ValueError, BrokenBarrierError)) for e in errors)
