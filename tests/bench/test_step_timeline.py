"""bench/step_timeline.py: the exposed and idle times of a traced replay against a brute force over a fine time grid
(which kernel is the last running at each instant; none running = idle), on hand-made overlapping timelines."""
import numpy as np
import pytest

from ddtree.bench.step_timeline import exposed_times, summarise


def kernel(name, start, end, grid=(1, 1, 1)):
    return {"name": name, "grid": list(grid), "block": [128, 1, 1], "start_us": float(start), "end_us": float(end)}


def brute(kernels, dt=0.01):
    """Per kernel: the instants where it is running and no kernel that started before it ends later (ties: the
    first in start order), i.e. where it alone extends the latest end; idle: instants with no kernel running."""
    wall = max(k["end_us"] for k in kernels)
    ts = np.arange(0, wall, dt) + dt / 2
    exposed = np.zeros(len(kernels))
    idle = 0.0
    for t in ts:
        running = [i for i, k in enumerate(kernels) if k["start_us"] <= t < k["end_us"]]
        if not running:
            idle += dt
            continue
        # the owner: the kernel whose end first covered t in start order (the latest end before it was below t)
        latest = -1.0
        for i, k in enumerate(kernels):
            if k["start_us"] > t:
                break
            if k["end_us"] > t and latest <= t:
                exposed[i] += dt
                break
            latest = max(latest, k["end_us"])
    return exposed, idle


CASES = {
    "chain with gaps": [kernel("a", 0, 3), kernel("b", 3.5, 5), kernel("c", 6, 6.5)],
    "branch inside": [kernel("a", 0, 10), kernel("branch", 1, 4), kernel("b", 10.2, 12)],
    "branch outlives": [kernel("a", 0, 4), kernel("branch", 1, 9), kernel("b", 4.5, 6), kernel("c", 6.1, 11)],
    "pdl overlap": [kernel("a", 0, 5), kernel("b", 4, 8), kernel("b", 7.5, 9), kernel("c", 12, 13)],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_exposed_and_idle_equal_the_brute_force(name):
    kernels = sorted(CASES[name], key=lambda k: (k["start_us"], k["end_us"]))
    exposed, idle = exposed_times(kernels)
    want_exposed, want_idle = brute(kernels)
    np.testing.assert_allclose(exposed, want_exposed, atol=0.03)
    assert sum(idle) == pytest.approx(want_idle, abs=0.03)
    s = summarise(kernels)
    assert s["exposed_us"] + s["idle_us"] == pytest.approx(s["wall_us"], abs=1e-9)   # every instant counted once


def test_families_sum_their_launches_largest_exposed_first():
    kernels = CASES["pdl overlap"]
    s = summarise(kernels)
    assert [f["kernel"] for f in s["families"]] == ["a", "b", "c"]
    b = s["families"][1]
    assert (b["launches"], b["us_total"], b["exposed_us"]) == (2, pytest.approx(5.5), pytest.approx(4.0))
    assert s["idle_us"] == pytest.approx(3.0) and s["kernel_us"] == pytest.approx(11.5)
