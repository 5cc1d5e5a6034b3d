"""GPU test of the tree pruning kernel (kernels/tree_prune.cu) against its numpy twin (tree/prune.py prune_nodes):
live_out bit for bit on random trees and routings (tests/tree/prune_cases.py) at rates that prune nothing, some
and most and horizons 1 (the last MoE layer), 3, 60 (Kimi's first MoE layer) and 1024 (the limit), on Kimi's
shapes (384 experts, top 8, up to 1024 nodes) and the kernel's limits (512 experts, top 16, int32 expert bytes),
and on the edge cases: nothing pruned, everything but the root pruned, chains, a threshold that only the horizon
crosses, an input mask with dead subtrees, and live_out written over live itself. Run: python3 -m pytest -q tests/plugins/test_tree_prune_gpu.py"""
import numpy as np
import pytest

from ddtree.plugins.tree_prune import TreePrune
from ddtree.tree.prune import prune_nodes
from tests.tree.prune_cases import cases, random_case

pytestmark = pytest.mark.gpu


def on_gpu(gpu, case, top_k, E, bytes_, rate, horizon=1, in_place=False):
    q = len(case["live"])
    dev = {k: gpu.upload(np.ascontiguousarray(v)) for k, v in case.items()}
    rate_d = gpu.upload(np.array([rate], np.float32))
    bytes_d = gpu.upload(np.array([bytes_], np.int32))
    out = dev["live"] if in_place else gpu.zeros((q,), np.int32)
    TreePrune(gpu, top_k, E).run(dev["live"], dev["parents"], dev["path_prob"], dev["routed_ids"], rate_d, bytes_d,
                                 out, q, horizon)
    return gpu.download(out)                                  # synchronises


def twin(case, E, bytes_, rate, horizon=1):
    return prune_nodes(case["live"], case["parents"], case["path_prob"], case["routed_ids"], bytes_, rate, E,
                       horizon=horizon)


def test_random_small_cases(gpu):
    for case, bytes_, rate, horizon in cases(seed=7, n=30):
        top_k = case["routed_ids"].shape[1]
        got = on_gpu(gpu, case, top_k, 64, bytes_, rate, horizon)
        assert got.tolist() == twin(case, 64, bytes_, rate, horizon).tolist(), (case, bytes_, rate, horizon)


@pytest.mark.parametrize("q,top_k,E", [(17, 8, 384), (65, 8, 384), (257, 8, 384), (1024, 8, 384), (1024, 16, 512),
                                       (1, 8, 384), (300, 1, 2)])
@pytest.mark.parametrize("chain", [False, True])
def test_kimi_shapes_and_limits(gpu, q, top_k, E, chain):
    rng = np.random.default_rng(q * 31 + top_k + chain)
    case = random_case(rng, q, top_k, E, chain=chain)
    for bytes_, horizon in ((3_096_576, 1), (3_096_576, 60), (2**31 - 1, 1024)):
        for rate in (0.0, 1e-12, 1e-10, 1e-9, 1e-7, 1.0):
            r = float(np.float32(rate))
            want = twin(case, E, bytes_, r, horizon)
            assert on_gpu(gpu, case, top_k, E, bytes_, r, horizon).tolist() == want.tolist(), (rate, horizon)
            assert on_gpu(gpu, case, top_k, E, bytes_, r, horizon, in_place=True).tolist() == want.tolist()


def test_edge_cases(gpu):
    rng = np.random.default_rng(11)
    q, top_k, E = 40, 2, 80
    case = random_case(rng, q, top_k, E, dead=0.0)
    case["routed_ids"] = np.arange(q * top_k, dtype=np.int32).reshape(q, top_k)     # every expert marginal
    nothing = on_gpu(gpu, case, top_k, E, 1000, 0.0)
    assert nothing.tolist() == [1] * q == twin(case, E, 1000, 0.0).tolist()
    everything = on_gpu(gpu, case, top_k, E, 1000, 1.0)
    assert everything.tolist() == [1] + [0] * (q - 1) == twin(case, E, 1000, 1.0).tolist()
    chain = random_case(rng, q, top_k, E, chain=True, dead=0.0)
    chain["routed_ids"] = case["routed_ids"]
    chain["path_prob"] = np.float32(0.9) ** np.arange(q, dtype=np.float32)
    rate = float(np.float32(0.5 / 2000))                  # threshold 0.5 for two marginal experts of 1000 bytes
    got = on_gpu(gpu, chain, top_k, E, 1000, rate)
    first = int(np.argmax(chain["path_prob"] < 0.5))
    assert got.tolist() == [1] * first + [0] * (q - first) == twin(chain, E, 1000, rate).tolist()
    # the same rate over 3 layers left: threshold 1.5, every node past the root goes (path probs <= 0.9)
    assert on_gpu(gpu, chain, top_k, E, 1000, rate, 3).tolist() == [1] + [0] * (q - 1) == \
        twin(chain, E, 1000, rate, 3).tolist()
    half = float(np.float32(0.25 / 2000))                 # threshold 0.25 for one layer left, 0.5 for two
    one, two = on_gpu(gpu, chain, top_k, E, 1000, half), on_gpu(gpu, chain, top_k, E, 1000, half, 2)
    assert one.tolist() == twin(chain, E, 1000, half).tolist() and two.tolist() == twin(chain, E, 1000, half, 2).tolist()
    assert int(two.sum()) == first < int(one.sum())
    case["routed_ids"] = np.zeros((q, top_k), np.int32) + np.arange(top_k, dtype=np.int32)   # all share: none
    assert on_gpu(gpu, case, top_k, E, 1000, 1.0).tolist() == [1] * q
