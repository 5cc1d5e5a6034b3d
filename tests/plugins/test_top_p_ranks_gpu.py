"""GPU tests of top-p across ranks (kernels/sample_top_p_ranks.cu, plugins/top_p_ranks_gpu.py): rows of V 163840
(LM-like and flat) and the adversarial rows of test_top_p_gpu.py (cumulative within 1e-9 of top_p, thousands of
tied logits at the cut, a tied bin past 4096 tokens, equal probabilities of distinct logits, -inf logits) split
over 2, 4 and 8 ranks, the ranks as threads on one GPU meeting in ThreadRankGroup's all-gathers. Every rank ends
with the same tokens, flags and row decision; they equal the single-rank TreeSampler's on the whole row (the
kernels the ranks' kernels share their device functions with) and the numpy twin's ranks_sample_top_p."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_top_p_gpu import CASES, V_BIG

from ddtree.parallel.cuda_collectives import StandinGather
from ddtree.plugins import top_p_bins as tb
from ddtree.plugins.top_p_ranks import ranks_sample_top_p
from ddtree.tree.sampling import SamplingParams

pytestmark = pytest.mark.gpu
TPS = (2, 4, 8)


@pytest.fixture(scope="module")
def rank_gpus():
    from ddtree.plugins.device import Gpu
    gpus = [Gpu(0) for _ in range(max(TPS))]
    yield gpus
    for g in gpus:
        g.free_all()


def bounds(V: int, tp: int) -> list[int]:
    return [r * V // tp for r in range(tp + 1)]


@pytest.fixture(scope="module")
def split_sampler(rank_gpus):
    """run(l [n, V], pos [n], params, tp) -> every rank's (tokens, flags, row_state, status)."""
    from ddtree.parallel.cuda_collectives import ThreadRankGroup
    from ddtree.plugins.top_p_ranks_gpu import TopPRanks
    cache = {}

    def ranks_of(tp, V):
        if (tp, V) not in cache:
            group, b = ThreadRankGroup(tp), bounds(V, tp)
            cache[tp, V] = group, [TopPRanks(rank_gpus[r], group.member(r), tp, V, b[r + 1] - b[r], max_rows=80)
                                   for r in range(tp)]
        return cache[tp, V]

    def run(l, pos, params, tp):
        n, V = l.shape
        group, samplers = ranks_of(tp, V)
        b = bounds(V, tp)

        def rank(r):
            s = samplers[r]
            s.gpu.dev.set_current()
            try:
                x, q = s.gpu.upload(np.ascontiguousarray(l[:, b[r]: b[r + 1]])), s.gpu.upload(pos)
                out = s.run(x, b[r], q, params, n)
                return out.tokens.numpy(), out.flags.numpy(), s.row_state(n).copy(), s.check_status(allow_inexact=True)
            except BaseException:
                group.abort()
                raise
        with ThreadPoolExecutor(tp) as pool:
            return list(pool.map(rank, range(tp)))
    return run


@pytest.fixture(scope="module")
def single(gpu):
    """The single-rank TreeSampler on whole rows -> (tokens, row_state)."""
    from ddtree.plugins.tree_sample import TreeSampler
    cache = {}

    def run(l, pos, params):
        n, V = l.shape
        if V not in cache:
            cache[V] = TreeSampler(gpu, vocab=V, max_rows=80)
        s = cache[V]
        out = s.run(gpu.upload(l), gpu.upload(pos), params, n)
        tokens, st = out.target.numpy(), s.row_state(n).copy()
        s.check_status(allow_inexact=True)
        return tokens, st
    return run


def check_split(split_sampler, single, l, pos, params, name):
    n, V = l.shape
    want_tokens, want_st = single(l, pos, params)
    T, top_p = params.temperature, params.top_p
    twin_ok = np.array([tb.row_cut(row, T, top_p).bin < tb.CLAMP for row in l])    # expf vs numpy in bin 4095
    flags_seen = set()
    for tp in TPS:
        b = bounds(V, tp)
        twin_tokens, twin_flags = ranks_sample_top_p([l[:, b[r]: b[r + 1]] for r in range(tp)], b[:-1], pos + 1,
                                                     T, top_p, params.seed)
        ranks = split_sampler(l, pos, params, tp)
        for r, (tokens, flags, st, status) in enumerate(ranks):
            where = f"{name}, tp {tp}, rank {r}"
            np.testing.assert_array_equal(tokens, want_tokens, err_msg=f"{where}: tokens vs TreeSampler")
            for field in ("l_top", "bin", "kept", "cut_key", "flags"):
                np.testing.assert_array_equal(st[field], want_st[field], err_msg=f"{where}: row_state {field}")
            np.testing.assert_array_equal(flags, want_st["flags"], err_msg=f"{where}: flags")
            assert status == np.bitwise_or.reduce(flags), where
            np.testing.assert_array_equal(tokens[twin_ok], twin_tokens[twin_ok], err_msg=f"{where}: tokens vs twin")
            np.testing.assert_array_equal(flags[twin_ok], twin_flags[twin_ok], err_msg=f"{where}: flags vs twin")
            flags_seen |= set(flags.tolist())
    return flags_seen


@pytest.mark.parametrize("shape, T, top_p", [("lm", 1.0, 0.95), ("flat", 0.7, 0.9), ("lm", 0.3, 0.5)])
def test_batches_split_over_ranks_sample_the_single_ranks_tokens(split_sampler, single, shape, T, top_p):
    from ddtree.bench.tree import lm_logits
    rng = np.random.default_rng(int(T * 100) + len(shape))
    l = lm_logits(rng, 17, V_BIG, shape == "flat")
    pos = rng.integers(0, 1 << 30, size=17).astype(np.int32)
    params = SamplingParams(temperature=T, top_p=top_p, seed=(3 << 40) + 17)
    assert check_split(split_sampler, single, l, pos, params, f"{shape} T {T} top_p {top_p}") == {0}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[c[0] for c in CASES])
def test_adversarial_rows_split_over_ranks(split_sampler, single, case):
    name, l, T, top_p, certified = CASES[case]
    params = SamplingParams(temperature=T, top_p=top_p, seed=(7 << 32) + case)
    flags = check_split(split_sampler, single, l[None], np.array([12345], np.int32), params, name)
    if certified is not None:
        assert (flags == {0}) == certified, (name, flags)


def test_rows_run_again_after_a_bin_overflow(split_sampler, single):
    """The records' counts are cleared by each launch: an overflowing row, then ordinary rows, on the same
    samplers, still give the single rank's tokens."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=1.0, top_p=0.37, seed=9)
    zeros = np.zeros((3, V_BIG), np.float32)
    assert check_split(split_sampler, single, zeros, np.arange(3, dtype=np.int32), params, "zeros") == {tb.BIN_OVERFLOW}
    l = rng.standard_normal((3, V_BIG)).astype(np.float32)
    assert check_split(split_sampler, single, l, np.arange(3, dtype=np.int32), params, "after") == {0}


def test_launch_is_captured_and_replays_with_new_params(gpu):
    """launch() holds no host sync: with a capturable collective it is captured in a graph, and replays read the
    parameter record set_params rewrites (the graph's tokens equal eager runs at both parameter sets)."""
    from ddtree.bench.tree import lm_logits
    from ddtree.plugins.top_p_ranks_gpu import TopPRanks
    rng = np.random.default_rng(3)
    V_r, n = 20480, 9
    x = gpu.upload(lm_logits(rng, n, V_r, False))
    q = gpu.upload(rng.integers(0, 1 << 20, n).astype(np.int32))
    s = TopPRanks(gpu, StandinGather(4), 4, 4 * V_r, V_r, max_rows=16)
    p1, p2 = SamplingParams(temperature=1.0, top_p=0.9, seed=1), SamplingParams(temperature=0.6, top_p=0.7, seed=2)
    eager = [s.run(x, V_r, q, p, n).tokens.numpy().copy() for p in (p1, p2)]
    assert not (eager[0] == eager[1]).all()
    graph = gpu.capture(lambda st: s.launch(x, V_r, q, n, stream=st))
    for p, want in zip((p1, p2, p1), eager + eager[:1]):
        s.set_params(p)
        gpu.replay(graph)
        np.testing.assert_array_equal(s.out.tokens.numpy()[:n], want)
    s.check_status(allow_inexact=True)
