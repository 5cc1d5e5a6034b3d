"""Rank processes that share one GPU (issue 25: tp ranks need not have a GPU each): the one-shot all-reduce between
2 and 4 processes on GPU 0 over CUDA IPC, pushed or pulled, is bit-equal to the rank-ordered float32 sum on every rank, and the
AllReduce plugin's runner at world_size 2 (a registered one-shot, its enqueue captured once in global mode and
replayed with new inputs) gives the same bits. One GPU is enough."""
import numpy as np
import pytest

from ddtree.parallel.spawn_ranks import run_ranks
from ddtree.plugins.allreduce import reference_sum
from tests.plugins.allreduce_cases import one_shot_rank, part, plugin_all_reduce_rank

pytestmark = pytest.mark.gpu


def assert_sums(results, ms, replays, outs_of=lambda res, M: res["outs"][M]):
    for rank, res in enumerate(results):
        assert res["errors"] == [], f"rank {rank}: error bits {res['errors']}"
        for M in ms:
            for rep, got in enumerate(outs_of(res, M)[:replays]):
                want = reference_sum([part(r, M, rep) for r in range(len(results))])
                bad = np.flatnonzero(got != want)
                assert bad.size == 0, f"rank {rank} M {M} rep {rep}: {bad.size} of {want.size} differ"


@pytest.mark.parametrize("protocol", ["push", "pull"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_one_shot_between_processes_on_one_gpu(ranks, protocol):
    ms, replays = [1, 17], 3
    results = run_ranks(one_shot_rank, [0] * ranks, args=(ms, replays, protocol))
    assert_sums(results, ms, replays)
    assert all(res["sequence"] == len(ms) * (replays + 1) for res in results)


def test_all_reduce_plugin_at_world_size_2_on_one_gpu():
    M, replays = 17, 3
    results = run_ranks(plugin_all_reduce_rank, [0, 0], args=(M, replays))
    assert_sums(results, [M], replays, outs_of=lambda res, M: res["outs"])
    assert all(res["sequence"] == replays for res in results)


def test_nccl_bindings_on_one_rank():
    """NCCL through nccl4py (parallel/nccl_group.py) on a one-rank communicator: the calls the 2-GPU tests make (init from
    a unique id, an all-reduce captured in a graph and replayed with new inputs, an eager all-gather, the async error
    word), on one GPU. A one-rank sum is the part itself; this checks our use of the bindings (pointers, counts,
    dtypes, the stream a capture runs on), not NCCL's transport."""
    pytest.importorskip("nccl.bindings.nccl", reason="needs nccl4py (the 'nccl' extra)")
    from tests.plugins.allreduce_cases import nccl_rank
    M, replays = 17, 3
    (res,) = run_ranks(nccl_rank, [0], args=(M, replays), timeout_s=120)
    for rep, got in enumerate(res["sums"]):
        np.testing.assert_array_equal(got, part(0, M, rep))
    np.testing.assert_array_equal(res["gathered"][0], part(0, M, replays - 1))
    assert res["async_error"] == 0
