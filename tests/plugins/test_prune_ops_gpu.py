"""GPU test of the pruned verify's small kernels (kernels/prune_ops.cu) against their numpy twins (plugins/prune_ops.py):
mask_dead bit for bit on random trees and masks (the root always live, whatever the mask says); prune_path_probs
against path_probs_twin on trees built by tree/build.py, raw and calibrated (float64 exp on the device is within an
ulp of numpy's, so path_prob and the rate to 1e-6, not bit for bit). The live mask of the routing kernels
(route_live_twin's rule): tests/plugins/test_route_live_gpu.py.
Run: python3 -m pytest -q tests/plugins/test_prune_ops_gpu.py"""
import numpy as np
import pytest

from ddtree.plugins.prune_ops import CalibrationTable, PruneOps, mask_dead_twin, path_probs_twin
from tests.plugins.test_prune_ops import CALIBRATED, random_tree

pytestmark = pytest.mark.gpu


def test_mask_dead_is_its_twin(gpu):
    rng = np.random.default_rng(2)
    for n in (1, 5, 17, 257, 1024):
        tokens = rng.integers(0, 163840, n).astype(np.int32)
        live = (rng.random(n) < 0.5).astype(np.int32)
        out = gpu.zeros((n,), np.int32)
        PruneOps(gpu).mask_dead(gpu.upload(tokens), gpu.upload(live), out, n)
        assert gpu.download(out).tolist() == mask_dead_twin(tokens, live).tolist()


@pytest.mark.parametrize("calibration", [None, CALIBRATED], ids=["raw", "calibrated"])
def test_path_probs_are_their_twin(gpu, calibration):
    rng = np.random.default_rng(4)
    table = CalibrationTable.of(calibration, 7, points=34)
    dev_table = {"x": gpu.upload(table.x), "y": gpu.upload(table.y), "n": gpu.upload(table.n)}
    for budget in (1, 4, 16, 64, 255):
        tree, _ = random_tree(rng, budget, D=7, V=300)
        n = tree.size
        terms = np.array([1e-9, 3e-10], np.float32)
        path, rate = gpu.zeros((n,), np.float32), gpu.zeros((1,), np.float32)
        PruneOps(gpu).path_probs(gpu.upload(tree.scores.astype(np.float32)), gpu.upload(tree.parents.astype(np.int32)),
                                 gpu.upload(tree.depth.astype(np.int32)), n, dev_table, gpu.upload(terms), path, rate)
        want_path, want_rate = path_probs_twin(tree.scores, tree.parents, tree.depth, table, terms)
        np.testing.assert_allclose(gpu.download(path), want_path, rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(gpu.download(rate)[0], want_rate, rtol=1e-6)
