"""CPU tests of the pruned verify's small kernels (kernels/prune_ops.cu, plugins/prune_ops.py; issue 53): they compile
for sm_90 and sm_120, their limits are the pruning module's, and their numpy twins are the CPU rule's:
  route_live  (the twin of the routing kernels' live mask, route_common.cuh live_rows) the MoE over the rewritten
              routing (dead rows on the root's experts at weight 0) is bit for bit the MoE with dead rows routed to
              no expert (numpy_math.moe_routed's -1), and reads exactly the live rows' experts;
  mask_dead   tree/prune.py absent_tree's tokens;
  path probs  from the tree build's fp32 path log-probabilities = tree/prune.py node_path_probs from the drafter
              logits (raw and calibrated) to fp32 rounding, and the rate base + per_token x their sum is
              runtime/pruning.py Pruner.rate.
The kernels against these twins on a GPU: tests/plugins/test_prune_ops_gpu.py (the live mask:
tests/plugins/test_route_live_gpu.py)."""
import re
from pathlib import Path

import numpy as np
import pytest

from ddtree.model.bf16 import f32_to_bf16
from ddtree.model.int4 import pack_int4, quantize_int4
from ddtree.plugins import compile as kc
from ddtree.plugins import layout, prune_ops
from ddtree.plugins.reference import moe_given_routing
from ddtree.tree import prune
from ddtree.tree.budget import Calibration
from ddtree.tree.build import build_tree, topk_logprobs

SOURCE = Path(kc.KERNEL_DIR) / prune_ops.SOURCE
KERNELS = ("mask_dead", "prune_path_probs")


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_kernels_compile(arch):
    blob = kc.compile_cubin(prune_ops.SOURCE, arch).read_bytes()
    assert blob[:4] == b"\x7fELF" and all(k.encode() in blob for k in KERNELS)


def test_limits_match_the_launcher():
    defines = {m[0]: int(m[1]) for m in re.findall(r"#define (\w+) (\d+)", SOURCE.read_text())}
    assert (defines["PO_THREADS"], defines["PO_MAX_NODES"]) == (prune_ops.THREADS, prune.MAX_NODES)
    with pytest.raises(prune.PruneError, match="1..1024"):
        prune_ops.PruneOps(None).path_probs(0, 0, 0, prune.MAX_NODES + 1, {}, 0, 0, 0)


def random_experts(rng, E: int, H: int, I: int) -> dict:
    def int4(n, k):
        q, s = quantize_int4(rng.standard_normal((n, k)) * 0.05, 32)
        return pack_int4(q), s, np.array([n, k])
    return layout.repack_experts([(int4(I, H), int4(I, H), int4(H, I)) for _ in range(E)])


def test_route_live_is_routing_dead_rows_to_no_expert():
    rng = np.random.default_rng(3)
    E, H, I, q, k = 8, 64, 64, 9, 2
    packed = random_experts(rng, E, H, I)
    x = f32_to_bf16(rng.standard_normal((q, H)).astype(np.float32))
    shared = rng.standard_normal((q, H))
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(q)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (q, k)).astype(np.float32)
    for live in (np.array([1, 0, 1, 1, 0, 0, 1, 0, 1]), np.ones(q, int), np.array([0] + [0] * (q - 1))):
        dead = live == 0
        dead[0] = False                                   # the root is live whatever the mask says
        got_ids, got_w, routed = prune_ops.route_live_twin(ids, weights, live)
        assert routed.tolist() == ids.tolist()            # the routing itself goes to tree_prune and the stats
        want = moe_given_routing(x, np.where(dead[:, None], -1, ids), weights.astype(np.float64), packed, shared)
        got = moe_given_routing(x, got_ids, got_w.astype(np.float64), packed, shared)
        # float64 BLAS over an expert's rows may round a row by the rows beside it: to 1e-12, not bit for bit
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
        assert set(got_ids.reshape(-1)) == set(ids[~dead].reshape(-1))     # no expert only a dead row wanted
        assert np.array_equal(got[dead], shared[dead])    # 0 x an expert adds exactly nothing


def test_mask_dead_is_absent_tree():
    rng = np.random.default_rng(5)
    for _ in range(20):
        tree, _ = random_tree(rng, budget=int(rng.integers(1, 40)))
        live = (rng.random(tree.size) < 0.6).astype(np.int32)
        live[0] = 1
        assert prune_ops.mask_dead_twin(tree.tokens, live).tolist() == prune.absent_tree(tree, live).tokens.tolist()
    assert prune_ops.mask_dead_twin([4, 5], [0, 0]).tolist() == [4, -1]          # the root stays


def random_tree(rng, budget: int, D: int = 7, V: int = 50):
    logits = rng.standard_normal((D, V)) * 3
    logp, ids = topk_logprobs(logits, min(budget, V))
    return build_tree(int(rng.integers(V)), logp, ids, budget), logits


CALIBRATED = Calibration(({"x": [0.0, 0.2, 0.5, 1.0], "y": [0.05, 0.1, 0.6, 0.9], "samples": 80}, None,
                          {"x": [0.0, 0.3, 1.0], "y": [0.0, 0.5, 0.7], "samples": 70}),
                         {"x": [0.0, 0.1, 0.4, 0.8, 1.0], "y": [0.0, 0.02, 0.3, 0.5, 0.55], "samples": 300})


@pytest.mark.parametrize("calibration", [None, CALIBRATED], ids=["raw", "calibrated"])
def test_path_probs_from_the_tree_scores_are_node_path_probs(calibration):
    rng = np.random.default_rng(9)
    depths = 7
    table = prune_ops.CalibrationTable.of(calibration, depths, points=12)
    for budget in (1, 4, 16, 64):
        tree, logits = random_tree(rng, budget, D=depths)
        want = prune.node_path_probs(tree.parents, tree.depth, tree.tokens, logits, calibration)
        got, rate = prune_ops.path_probs_twin(tree.scores, tree.parents, tree.depth, table, (0.0, 2.0))
        assert got.dtype == np.float32 and got[0] == 1.0
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
        assert rate == np.float32(2.0 * float(got.astype(np.float64).sum()))


def test_the_table_is_the_calibration():
    table = prune_ops.CalibrationTable.of(CALIBRATED, 5, points=8)
    assert table.x.shape == (5, 8) and table.n.tolist() == [4, 5, 3, 5, 5]        # depth 2 and 4, 5: the pooled map
    p = np.linspace(-0.1, 1.1, 61)
    for d in range(1, 6):
        np.testing.assert_allclose(table.interp(p, np.full(p.shape, d)), CALIBRATED.calibrate(p, d), rtol=1e-6,
                                   atol=1e-7)
    raw = prune_ops.CalibrationTable.of(None, 3)
    inside = np.linspace(0.0, 1.0, 51)
    assert np.array_equal(raw.interp(inside, np.ones(51)), inside)
    with pytest.raises(prune.PruneError, match="more than 4 points"):
        prune_ops.CalibrationTable.of(CALIBRATED, 2, points=4)


def test_rate_terms_are_the_rate():
    from ddtree.runtime.pruning import Pruner
    from ddtree.tree.prune import DEFAULT_RATE, DEFAULT_RATE_PER_TOKEN

    class Cfg:
        moe_layers = (1, 2, 3)
    assert Pruner(Cfg(), 1000, rate=3e-9).rate_terms(16, 100) == (3e-9, 0.0)
    assert Pruner(Cfg(), 1000).rate_terms(16, 100) == (0.0, DEFAULT_RATE_PER_TOKEN)
    assert Pruner(Cfg(), 1000).rate(16, 100, 5.0) == pytest.approx(DEFAULT_RATE, rel=1e-12)    # at its 5 tokens
