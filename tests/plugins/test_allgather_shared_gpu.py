"""The one-shot all-gather (plugins/allreduce.py OneShotAllReduce.all_gather) between rank processes that share
GPU 0 (issue 25: NCCL refuses two ranks on one GPU): float32 / int32 / bf16 / uint8 parts (random bytes, NaN
patterns included) arrive bit for bit in rank order on every rank (np.stack, the numpy twin), in a graph
replayed with new inputs between two all-reduces (one device counter for both kinds), and in place;
ProcessRankMember under CudaOps inside a captured graph; a killed peer sets the error bit within the bound."""
import numpy as np
import pytest

from ddtree.parallel.spawn_ranks import run_ranks
from ddtree.plugins.allreduce import reference_sum
from tests.plugins.allreduce_cases import (
    GATHER_CASES,
    all_gather_rank,
    cuda_ops_part,
    cuda_ops_rank,
    gather_part,
    killed_peer_gather_rank,
    part,
)

pytestmark = pytest.mark.gpu


def assert_bytes(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got = np.ascontiguousarray(got).view(np.uint8).ravel()
    bad = np.flatnonzero(got != want.ravel())
    assert got.size == want.size and bad.size == 0, f"{what}: {bad.size} of {want.size} bytes differ"


@pytest.mark.parametrize("ranks", [2, 4])
def test_all_gather_between_processes_on_one_gpu(ranks):
    replays = 3
    results = run_ranks(all_gather_rank, [0] * ranks, args=(replays,))
    for rank, res in enumerate(results):
        assert res["errors"] == [], f"rank {rank}: error bits {res['errors']}"
        assert res["sequence"] == replays * (2 + len(GATHER_CASES)) + 1
        for rep in range(replays):
            first = reference_sum([part(r, 1, rep) for r in range(ranks)])
            np.testing.assert_array_equal(res["sums"][rep], reference_sum([first] * ranks))
            for c, got in enumerate(res["gathered"][rep]):
                want = np.stack([gather_part(r, c, rep) for r in range(ranks)])
                assert_bytes(got, want, f"rank {rank} rep {rep} {GATHER_CASES[c]}")
        want = np.stack([gather_part(r, 1, replays) for r in range(ranks)])
        assert_bytes(res["in_place"], want, f"rank {rank} in place")


def test_process_rank_member_in_a_captured_cuda_ops_graph():
    ranks, replays = 2, 3
    results = run_ranks(cuda_ops_rank, [0] * ranks, args=(replays,))
    for rank, res in enumerate(results):
        assert res["errors"] == [], f"rank {rank}: error bits {res['errors']}"
        assert res["sequence"] == 3 * (replays + 1)
        for rep, run in enumerate(res["runs"]):
            np.testing.assert_array_equal(run["summed"][0], reference_sum([part(r, 1, rep) for r in range(ranks)]))
            for name, dtype in (("values", np.float32), ("ids", np.int32)):
                assert run[name].shape == (ranks, 7, 4) and run[name].dtype == dtype
                want = np.stack([cuda_ops_part(r, name, rep) for r in range(ranks)])
                assert_bytes(run[name], want, f"rank {rank} run {rep} {name}")


def test_killed_peer_sets_the_error_bit_of_an_all_gather_within_the_bound():
    max_spins = 200_000
    results = run_ranks(killed_peer_gather_rank, [0, 0], args=(max_spins,), may_exit={1}, timeout_s=120)
    res = results[0]
    assert results[1] is None
    assert res["errors"] == [1]
    first, second = res["seconds"]
    assert first < 10.0, f"the first all-gather took {first:.2f} s"
    assert second < 0.5, f"the second all-gather waited again ({second:.2f} s) though the error bit was set"
    assert res["sequence"] == 2
