"""parallel/cuda_collectives.py's protocol on the CPU, with a recording stand-in for the Gpu: every rank finishes its
stream before it publishes, reads all partials in rank order, finishes its own launch before anyone goes on, and a
rank with bad input fails by name while the others are released (the GPU test: test_cuda_collectives_gpu.py)."""
import threading
from threading import BrokenBarrierError
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree.parallel.cuda_collectives import ThreadRankGroup


class RecordingGpu:
    sm_count = 4

    def __init__(self):
        self.log = []

    def sync(self):
        self.log.append("sync")

    def alloc(self, n, dtype):
        return SimpleNamespace(ptr=1)

    def copy_in(self, dst, values):
        self.log.append(("parts", [int(v) for v in values]))

    def kernel(self, source, name):
        return name

    def launch(self, kernel, *args, **kw):
        self.log.append(kernel)

    def copy_d2d(self, dst, src, nbytes):
        self.log.append(("copy", dst, src, nbytes))


def tensor(ptr, dtype=np.uint16):
    return SimpleNamespace(ptr=ptr, shape=(2, 8), strides=(8, 1), dtype=np.dtype(dtype), contiguous=True, itemsize=2)


def run(n, body):
    errors, threads = [], []

    def guarded(r):
        try:
            body(r)
        except Exception as e:                     # noqa: BLE001 (collected for the test)
            errors.append(e)
    for r in range(n):
        threads.append(threading.Thread(target=guarded, args=(r,)))
        threads[-1].start()
    for t in threads:
        t.join()
    return errors


def test_each_rank_syncs_reads_every_partial_in_rank_order_and_syncs_again():
    group, gpus = ThreadRankGroup(3), [RecordingGpu() for _ in range(3)]

    def body(r):
        m = group.member(r)
        m.all_reduce(gpus[r], tensor(100 + r), tensor(200 + r))
        m.all_gather(gpus[r], tensor(100 + r), tensor(300))
    assert run(3, body) == []
    for g in gpus:
        assert g.log == ["sync", ("parts", [100, 101, 102]), "allreduce_sum_local", "sync",
                         "sync", ("copy", 300, 100, 32), ("copy", 332, 101, 32), ("copy", 364, 102, 32), "sync"]


def test_a_rank_with_bad_input_fails_by_name_and_releases_the_others():
    group = ThreadRankGroup(3, timeout_s=30)

    def body(r):
        out = tensor(200 + r, np.float32 if r == 2 else np.uint16)
        group.member(r).all_reduce(RecordingGpu(), tensor(100 + r), out)
    errors = run(3, body)
    assert any(isinstance(e, ValueError) and "rank 2" in str(e) for e in errors)
    assert all(isinstance(e, (ValueError, BrokenBarrierError)) for e in errors) and len(errors) == 3


def test_a_group_is_two_ranks_or_more():
    with pytest.raises(ValueError, match="a group is 2 or more"):
        ThreadRankGroup(1)
