"""runtime/near_tie.py on the CPU: the margin of what the sampler ranks (against a hand computation), a
departure's classification on the float64 executor (a made-up departure: its margin is the argmax gap), and
--device cuda's default KV rows (docs/interfaces.md 8)."""
import numpy as np
import pytest

from ddtree.runtime.near_tie import classify_departure, first_difference, margin
from ddtree.runtime.run_cli import default_max_context
from ddtree.tree.sampling import SamplingParams, gumbel, sample


def test_margin_greedy_and_sampled_by_hand():
    row = np.array([1.0, 3.0, 2.5, -1.0])
    assert margin(row, 7, SamplingParams()) == 0.5
    p = SamplingParams(temperature=0.5, seed=9)
    z = row / 0.5 + gumbel(9, 7, np.arange(4))
    top = np.sort(z)[-2:]
    assert np.isclose(margin(row, 7, p), top[1] - top[0], rtol=0, atol=1e-12)
    assert int(np.argmax(z)) == int(sample(row[None], np.array([7]), p)[0])      # the same scores the sampler ranks


def test_classify_a_departure_on_the_reference():
    from ddtree.data import tiny_model_dirs
    from ddtree.reference.drafter import Drafter
    from ddtree.reference.model import Target
    from ddtree.runtime.executor import NumpyExecutor
    from ddtree.runtime.loop import ar_steps, run_to_end
    target_dir, drafter_dir = tiny_model_dirs()
    target = Target.from_checkpoint(target_dir)
    ex = NumpyExecutor(target, Drafter.from_checkpoint(drafter_dir, target))
    prompt = [256, 100, 101, 102]
    ar = run_to_end(ar_steps(ex, prompt, 4, SamplingParams()))
    assert classify_departure(ex, prompt, ar, list(ar), SamplingParams(), 0.1) is None
    dd = ar[:2] + [(ar[2] + 1) % 256] + ar[3:]
    v = classify_departure(ex, prompt, ar, dd, SamplingParams(), 0.1)
    logits, _ = ex.target_forward(np.array(prompt + ar[:2]), np.arange(len(prompt) + 2),
                                  np.tril(np.ones((6, 6), bool)), ex.new_target_cache())
    top = np.sort(logits[-1])[-2:]
    assert v["index"] == 2 and np.isclose(v["margin"], top[1] - top[0]) and v["bound"] == 0.2
    assert v["near_tie"] == (top[1] - top[0] < 0.2)


def test_default_max_context_rounds_the_request_up():
    assert default_max_context("abc", 100, 16, chat=False) == 256             # 3 + 1 + 100 + 16 + 1 = 121
    assert default_max_context("é" * 200, 100, 16, chat=False) == 768          # 400 bytes: 518 rows
    assert default_max_context("x", 1, 1, chat=True) == 512                    # 1 + 256 + 1 + 1 + 1 = 260


@pytest.mark.parametrize("a, b, want", [([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 5, 3], 1), ([4], [5], 0),
                                        ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1], 1), ([], [7], 0)])
def test_first_difference(a, b, want):
    assert first_difference(a, b) == first_difference(b, a) == want
