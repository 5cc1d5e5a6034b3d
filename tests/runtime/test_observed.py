"""logit_bias, ignore_eos and the committed rows' logits (runtime/observed.py) on the embedded tiny model:
DDTree == AR token for token with them, greedy and sampled, and both equal an independent reference (a
plain loop over the float64 target, one whole-sequence forward per token, sampling l + bias by section 5)."""
import numpy as np
import pytest

from ddtree.reference.model import causal_visible
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.loop import RequestError
from ddtree.runtime.observed import log_softmax
from ddtree.tree.sampling import SamplingParams, sample

PROMPT = "def fib(n):"
N = 24
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=40, seed=99)


@pytest.fixture(scope="module")
def engine():
    return DDTreeEngine.load()


def reference(engine, ids, n, bias, params: SamplingParams, stop_ids=()):
    """-> (tokens, raw logits row of each token): the target run from scratch for every token (no cache reuse,
    no tree), the token sampled from l + bias at its position."""
    target = engine.executor.target
    ids, out, rows = list(ids), [], []
    for _ in range(n):
        cache = engine.executor.new_target_cache(len(ids) + 1)
        logits, _ = target.forward(np.array(ids), np.arange(len(ids)), causal_visible(0, len(ids)), cache)
        row = np.asarray(logits[-1], dtype=np.float64)
        token = int(sample((row + bias)[None], np.array([len(ids)]), params)[0])
        out.append(token)
        rows.append(row)
        ids.append(token)
        if token in stop_ids:
            break
    return out, np.array(rows)


def run(engine, mode, **kw):
    rows, chunks = [], []
    for chunk in engine.stream(PROMPT, max_new_tokens=N, budget=8, mode=mode, on_logits=rows.append, **kw):
        chunks.append(list(chunk))
    assert [len(r) for r in rows] == [len(c) for c in chunks]
    return [t for c in chunks for t in c], np.concatenate(rows), chunks


def bias_of(engine, logit_bias):
    bias = np.zeros(engine.config.vocab_size)
    for t, b in logit_bias.items():
        bias[t] = b
    return bias


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_logit_bias_ddtree_equals_ar_and_reference(engine, sampling):
    plain, _, _ = run(engine, "ar", **sampling)
    # push down the model's own first choices so the bias changes the output
    logit_bias = {plain[0]: -30.0, plain[1]: -30.0, ord(" "): 3.0}
    got_dd, rows_dd, chunks = run(engine, "ddtree", logit_bias=logit_bias, **sampling)
    got_ar, rows_ar, _ = run(engine, "ar", logit_bias=logit_bias, **sampling)
    params = SamplingParams(**{"top_k": 0, "top_p": 1.0, "seed": 0, **sampling})
    want, want_rows = reference(engine, engine.encode(PROMPT), N, bias_of(engine, logit_bias), params)
    assert got_dd == got_ar == want
    assert got_dd != plain
    assert max(len(c) for c in chunks) > 1                       # the tree committed several tokens a step
    # the rows are the raw target logits the tokens were sampled from (float64 reference: ~1e-15)
    np.testing.assert_allclose(rows_dd, want_rows, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rows_ar, want_rows, rtol=1e-12, atol=1e-12)
    lp_dd = log_softmax(rows_dd)[np.arange(N), got_dd]
    lp_ar = log_softmax(rows_ar)[np.arange(N), got_ar]
    np.testing.assert_allclose(lp_dd, lp_ar, rtol=1e-12, atol=1e-12)


def test_log_softmax_against_the_formula():
    rows = np.array([[1.0, 2.0, 3.0], [1000.0, 1000.0, -1000.0]])
    want = np.log(np.exp(rows[0]) / np.exp(rows[0]).sum())
    np.testing.assert_allclose(log_softmax(rows)[0], want, rtol=1e-14)
    np.testing.assert_allclose(log_softmax(rows)[1], [np.log(0.5), np.log(0.5), -2000 - np.log(2)], rtol=1e-14)


@pytest.mark.parametrize("mode", ["ddtree", "ar"])
def test_ignore_eos_runs_past_a_stop_token(engine, mode):
    eos = engine.config.eos_token_ids[0]
    forced = {eos: 100.0}                                        # EOS first: the run would end at once
    stopped, _, _ = run(engine, mode, logit_bias=forced, **GREEDY)
    assert stopped == [eos]
    kept, _, _ = run(engine, mode, logit_bias=forced, ignore_eos=True, **GREEDY)
    assert kept == [eos] * N
    result = []
    for c in engine.stream(PROMPT, max_new_tokens=N, mode=mode, budget=8, ignore_eos=True, **SAMPLED):
        result += c
    want, _ = reference(engine, engine.encode(PROMPT), N, np.zeros(engine.config.vocab_size),
                        SamplingParams(**SAMPLED))
    assert result == want and len(result) == N


def test_bad_logit_bias_token_is_named(engine):
    with pytest.raises(RequestError, match="logit_bias: token id 999999 is outside the vocabulary"):
        list(engine.stream(PROMPT, max_new_tokens=2, logit_bias={999999: 1.0}))
