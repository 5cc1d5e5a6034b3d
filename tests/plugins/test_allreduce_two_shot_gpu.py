"""The two-shot all-reduce (plugins/allreduce.py protocol "two-shot") between 2, 4 and 8 rank processes sharing GPU 0
over CUDA IPC: on every rank, in a captured graph replayed with new inputs (the device counter moving on) between
push and pull one-shots on the same buffer, its output is bit-equal to reference_sum (the rank-ordered float32 sum
rounded once) and to the one-shot's output on the same inputs, out of place and in place, at 1, 9, 17 and 65 rows of
7168 and at sizes below and not divisible by N x 8; a killed peer ends with its bit in the error word. One GPU."""
import numpy as np
import pytest

from ddtree.parallel.spawn_ranks import run_ranks
from ddtree.plugins.allreduce import reference_sum
from tests.plugins.two_shot_cases import killed_peer_two_shot_rank, rank_part, two_shot_rank

pytestmark = pytest.mark.gpu

SIZES = [24, 8 * 37, 7168, 9 * 7168, 17 * 7168, 65 * 7168]      # 24: 3 vectors, chunks of 1 and empty ones


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_two_shot_bit_equal_to_reference_and_one_shot_in_a_replayed_graph(ranks):
    replays = 3
    results = run_ranks(two_shot_rank, [0] * ranks, args=(SIZES, replays))
    for rank, res in enumerate(results):
        assert res["errors"] == [], f"rank {rank}: error bits {res['errors']}"
        assert res["sequence"] == 4 * len(SIZES) * replays
    for elems in SIZES:
        for rep in range(replays):
            want = reference_sum([rank_part(r, elems, rep) for r in range(ranks)])
            for rank, res in enumerate(results):
                got = res["outs"][elems][rep]
                for name in ("two", "in_place", "push", "pull"):
                    bad = np.flatnonzero(got[name] != want)
                    assert bad.size == 0, (f"{name} rank {rank} of {ranks}, {elems} elems, rep {rep}: {bad.size} "
                                           f"differ, first at {bad[0]}: {got[name][bad[0]]:#06x} != "
                                           f"{want[bad[0]]:#06x}")
                np.testing.assert_array_equal(got["two"], got["push"])


def test_killed_peer_sets_the_error_bit_of_a_two_shot_within_the_bound():
    max_spins = 200_000
    results = run_ranks(killed_peer_two_shot_rank, [0, 0, 0], args=(max_spins,), may_exit={2}, timeout_s=120)
    assert results[2] is None
    for rank in (0, 1):
        res = results[rank]
        assert res["errors"] == [2], f"rank {rank}: error bits {res['errors']}"
        first, second = res["seconds"]
        assert first < 10.0, f"rank {rank}: the first two-shot took {first:.2f} s"
        assert second < 0.5, f"rank {rank}: the second two-shot waited again ({second:.2f} s) though the bit was set"
        assert res["sequence"] == 2
