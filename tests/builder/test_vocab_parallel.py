"""Sampling and draft top-k on vocab-split logits equal the single-device definitions
(tree/sampling.sample, tree/build.topk_logprobs) on the concatenated logits, token for token."""
import numpy as np
import pytest

from ddtree.runtime import vocab_parallel as vp
from ddtree.tree.build import topk_logprobs
from ddtree.tree.sampling import SamplingParams, sample

V = 512
PARAMS = [SamplingParams(), SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=1.0, top_k=5, seed=9),
          SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=2**40 + 1),
          SamplingParams(temperature=1.3, top_p=0.95, seed=77), SamplingParams(temperature=0.5, top_p=0.5, seed=1),
          SamplingParams(temperature=1.0, top_k=V + 3, top_p=0.8, seed=5)]


def split(logits, tp):
    n = logits.shape[1] // tp
    return [logits[:, r * n: (r + 1) * n] for r in range(tp)], [r * n for r in range(tp)]


def logit_rows(rng, n):
    """Peaked, flat (top-p must gather far beyond the first candidates), and tied rows."""
    peaked = rng.standard_normal((n, V)) * 3.0
    flat = rng.standard_normal((n, V)) * 0.01
    tied = np.round(rng.standard_normal((n, V)), 1)          # many exact ties across ranks
    tied[:, [7, 300]] = tied.max() + 1.0                      # the top value on two ranks
    return np.concatenate([peaked, flat, tied])


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("params", PARAMS, ids=[f"T{p.temperature}-k{p.top_k}-p{p.top_p}" for p in PARAMS])
def test_sample_equals_single_device(tp, params):
    rng = np.random.default_rng(tp)
    logits = logit_rows(rng, 6)
    positions = rng.integers(0, 10_000, len(logits))
    parts, offsets = split(logits, tp)
    got = vp.sample(parts, offsets, positions, params)
    want = sample(logits, positions, params)
    np.testing.assert_array_equal(got, want)
    if params.greedy:       # ties across ranks go to the lower id
        assert (got[12:] == 7).all()


def test_top_p_without_top_k_gathers_more_than_the_first_round():
    """A flat row needs far more than FIRST_CANDIDATES tokens per rank to reach top_p = 0.95."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, V)) * 0.01
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=4)
    parts, offsets = split(logits, 4)
    vals, ids = vp._kept_row([p[0] for p in parts], offsets, 0, 0.95)
    assert len(ids) > 4 * vp.FIRST_CANDIDATES
    np.testing.assert_array_equal(vp.sample(parts, offsets, np.arange(3), params), sample(logits, np.arange(3), params))


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("k", [1, 7, 64, 200])
def test_topk_logprobs_equals_single_device(tp, k):
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((5, V)) * 4
    logits[:, 130] = logits[:, 3] = logits.max() + 1                   # a tie across ranks
    got_lp, got_ids = vp.topk_logprobs(*split(logits, tp), k)
    want_lp, want_ids = topk_logprobs(logits, k)
    np.testing.assert_array_equal(got_ids, want_ids)
    assert got_ids.dtype == np.int32 and got_lp.dtype == np.float32 and got_lp.shape == (5, k)
    if tp == 1:
        np.testing.assert_array_equal(got_lp, want_lp)
    else:
        np.testing.assert_allclose(got_lp, want_lp, rtol=1e-6, atol=1e-6)
