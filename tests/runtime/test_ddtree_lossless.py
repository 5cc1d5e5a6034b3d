"""DDTree == autoregressive decoding token for token on the float64 reference (docs/interfaces.md 6),
greedy and sampled, with a random drafter and an oracle drafter; the compacted cache equals AR's."""
import numpy as np
import pytest

from ddtree.reference.drafter import Drafter
from ddtree.runtime.executor import NumpyExecutor
from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps, run_to_end
from ddtree.tree.sampling import SamplingParams

PROMPTS = [[256] + list(b"def fib(n):"), [256] + list(b"import os\n"), [256, 259, 259, 7]]  # MASK in prompt
GREEDY = SamplingParams()
WARM = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1234)
HOT = SamplingParams(temperature=1.0, top_k=0, top_p=0.95, seed=2**40 + 5)
N = 64


class RecordingExecutor(NumpyExecutor):
    """Remembers the last target cache it made, so a test can compare caches after a run."""

    def new_target_cache(self, capacity=256, limit=None):
        self.last_cache = super().new_target_cache(capacity, limit)
        return self.last_cache


class OracleExecutor(RecordingExecutor):
    """Test double: the 'drafter' proposes the target's own continuation (same sampling params,
    so under the shared Gumbel noise it is exactly what the target will commit), so every step
    accepts the full depth and compacts at maximum depth."""

    params = GREEDY

    def drafter_forward(self, block_ids, pos, ctx_taps, cache):
        b = len(block_ids)
        scratch = self.last_cache.copy()                       # committed prefix, before this step's verify
        token, p = int(block_ids[0]), int(pos[0])
        logits = np.zeros((b - 1, self.config.vocab_size))
        for k in range(b - 1):
            lg, _ = self.target.forward([token], [p], np.ones((1, scratch.length + 1), bool), scratch)
            token = int(self.sample(lg, np.array([p + 1]), self.params)[0])
            logits[k, token] = 12.0
            p += 1
        return logits


def ddtree(ex, prompt, params, budget, block=None, stats=None):
    return run_to_end(ddtree_steps(ex, prompt, N, params, budget, block_size=block, stats=stats))


def ar(ex, prompt, params):
    return run_to_end(ar_steps(ex, prompt, N, params))


@pytest.mark.parametrize("block,budget,params,prompt", [
    (4, 1, GREEDY, 0), (4, 2, WARM, 1), (4, 7, HOT, 2), (4, 16, GREEDY, 1), (4, 64, WARM, 0),
    (8, 1, HOT, 1), (8, 7, GREEDY, 2), (8, 16, WARM, 2), (8, 64, HOT, 0), (8, 2, GREEDY, 0),
])
def test_random_drafter_equals_ar(random_executors, block, budget, params, prompt):
    ex = random_executors[block]
    want = ar(ex, PROMPTS[prompt], params)
    assert len(want) == N
    assert ddtree(ex, PROMPTS[prompt], params, budget) == want
    if block == 8:   # a shorter block than the drafter's own
        assert ddtree(ex, PROMPTS[prompt], params, budget, block=4) == want


@pytest.mark.parametrize("block", [4, 8])
@pytest.mark.parametrize("params", [GREEDY, WARM, HOT], ids=["greedy", "t0.7", "t1.0"])
def test_oracle_drafter_accepts_full_depth_and_cache_matches_ar(tiny_dirs, tiny_target, block, params):
    ex = OracleExecutor(tiny_target, Drafter.from_checkpoint(tiny_dirs[block], tiny_target))
    ex.params = params
    prompt = PROMPTS[0]
    stats = RunStats()
    got = ddtree(ex, prompt, params, budget=16, stats=stats)
    dd_cache = ex.last_cache
    want = ar(ex, prompt, params)
    ar_cache = ex.last_cache
    assert got == want and len(set(got)) > 20
    # every step but possibly the last (cut at N) commits the whole depth plus the bonus
    assert all(a == block for a in stats.accept_lens[:-1]), stats.accept_lens
    assert stats.to_dict()["per_depth_accept_rate"][-1] >= (stats.steps - 1) / stats.steps
    # the compacted tree cache holds exactly the entries AR computed for the same tokens
    n = min(dd_cache.length, ar_cache.length)
    assert n >= len(prompt) + N - block - 1
    for layer in range(tiny_target.config.num_hidden_layers):
        np.testing.assert_allclose(dd_cache.entries(layer, n), ar_cache.entries(layer, n), rtol=1e-12, atol=1e-13)


def test_stops_at_eos_and_never_filters_mask_tokens(random_executors):
    ex = random_executors[4]
    want = ar(ex, PROMPTS[0], HOT)
    # make the 20th AR token an EOS: both loops must stop right after it, keeping it
    eos = want[19]
    cut = run_to_end(ar_steps(ex, PROMPTS[0], N, HOT, eos_ids=[eos]))
    assert cut == want[: want.index(eos) + 1]
    assert run_to_end(ddtree_steps(ex, PROMPTS[0], N, HOT, 16, eos_ids=[eos])) == cut
    # the mask id is an ordinary token for the output: a target that emits it keeps it
    mask = ex.drafter_config.mask_token_id
    params = SamplingParams(temperature=50.0, seed=29)      # near-uniform; this seed emits MASK at token 24
    want = run_to_end(ar_steps(ex, PROMPTS[0], 40, params))
    assert mask in want
    assert run_to_end(ddtree_steps(ex, PROMPTS[0], 40, params, 4)) == want


def test_bad_block_size(random_executors):
    with pytest.raises(ValueError, match="block size 9 must be in 2..8"):
        ddtree(random_executors[8], PROMPTS[0], GREEDY, 4, block=9)
