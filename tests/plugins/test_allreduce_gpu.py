"""2-GPU tests of the collectives, one spawned process per GPU (parallel/spawn_ranks.py): the one-shot all-reduce
is bit-equal to the rank-ordered float32 sum (plugins/allreduce.reference_sum) on both ranks, in a graph
replayed with new inputs and eagerly in place; NCCL gives identical bits on both ranks, close to that sum,
and an exact all-gather; a killed peer sets the one-shot error bit within the spin bound, no hang."""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32

pytestmark = pytest.mark.gpu


def gpu_count() -> int:
    try:
        from cuda.bindings import driver
        driver.cuInit(0)
        err, n = driver.cuDeviceGetCount()
        return int(n) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


if gpu_count() < 2:
    pytest.skip("needs 2 CUDA GPUs and cuda-python", allow_module_level=True)

from ddtree.parallel.spawn_ranks import run_ranks  # noqa: E402
from ddtree.plugins.allreduce import reference_sum  # noqa: E402
from tests.plugins.allreduce_cases import killed_peer_rank, nccl_rank, one_shot_rank, part  # noqa: E402


@pytest.mark.parametrize("protocol", ["push", "pull"])
def test_one_shot_sum_bit_equal_on_both_ranks_in_a_replayed_graph(protocol):
    ms, replays = [1, 17, 65], 3
    results = run_ranks(one_shot_rank, [0, 1], args=(ms, replays, protocol))
    for rank, res in enumerate(results):
        assert res["errors"] == [], f"rank {rank}: error bits {res['errors']}"
        assert res["sequence"] == res["calls"] == len(ms) * (replays + 1)
        for M in ms:
            for rep, got in enumerate(res["outs"][M]):
                want = reference_sum([part(r, M, rep) for r in range(2)])
                bad = np.flatnonzero(got != want)
                assert bad.size == 0, (f"rank {rank} M {M} rep {rep}: {bad.size} of {want.size} differ, first at "
                                       f"{bad[0]}: {got[bad[0]]:#06x} != {want[bad[0]]:#06x}")


def test_nccl_identical_on_both_ranks():
    pytest.importorskip("nccl.bindings.nccl", reason="needs nccl4py (the 'nccl' extra)")
    M, replays = 17, 3
    results = run_ranks(nccl_rank, [0, 1], args=(M, replays))
    for rank, res in enumerate(results):
        assert res["async_error"] == 0
        # the all-gather runs after the replays, on the last replay's parts
        np.testing.assert_array_equal(res["gathered"], np.stack([part(r, M, replays - 1) for r in range(2)]))
    for rep in range(replays):
        a, b = results[0]["sums"][rep], results[1]["sums"][rep]
        np.testing.assert_array_equal(a, b)
        exact = bf16_to_f32(part(0, M, rep)).astype(np.float64) + bf16_to_f32(part(1, M, rep))
        np.testing.assert_allclose(bf16_to_f32(a), exact, rtol=2 ** -8, atol=0)   # one bf16 rounding


def test_killed_peer_sets_the_error_bit_within_the_bound():
    max_spins = 200_000                     # ~0.05-0.2 s of polls at <= 1 us each (200 ns sleeps)
    results = run_ranks(killed_peer_rank, [0, 1], args=(max_spins,), may_exit={1}, timeout_s=120)
    res = results[0]
    assert results[1] is None
    assert res["errors"] == [1]
    first, second = res["seconds"]
    assert first < 10.0, f"the first call took {first:.2f} s"
    assert second < 0.5, f"the second call waited again ({second:.2f} s) though the error bit was set"
    assert res["sequence"] == 2
