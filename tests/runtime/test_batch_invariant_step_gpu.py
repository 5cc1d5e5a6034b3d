"""The batch-invariant kernel plan end to end (docs/interfaces.md section 6) on the embedded tiny model's tp 1
engine: the verify and the one-token decode give bitwise the same logits (delta = 0 where the fast plan's is
> 0: tests/runtime/test_cuda_step_gpu.py), and the DDTree step graphs commit exactly the AR graph's tokens at
budgets 1, 4, 16 and 64, greedy and sampled: no departure at all, near-tie or not.
"""
import numpy as np
import pytest

from ddtree.runtime.loop import ar_steps, ddtree_steps, run_to_end
from ddtree.runtime.near_tie import path_differences
from ddtree.tree.sampling import SamplingParams

pytestmark = pytest.mark.gpu
N = 64
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runtime.tiny_gpu import tiny_gpu_executor
    return tiny_gpu_executor(tmp_path_factory, "tiny-invariant", kernel_plan="batch-invariant")


def test_verify_logits_are_the_decode_logits_bitwise(tiny):
    """AR tokens teacher-forced through calls of 8 and 65 rows and through one-token calls: identical logits."""
    ex, prompts = tiny
    for ids in prompts:
        ar = run_to_end(ar_steps(ex, ids, N, GREEDY))
        diff = path_differences(ex, ids, ar, rows=(8, 65))
        assert diff.shape == (2 * N,)
        assert np.all(diff == 0.0), f"verify != decode at {np.flatnonzero(diff)[:8]} (max {diff.max():.3e})"


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_ddtree_graph_commits_ar_tokens_exactly(tiny, params):
    ex, prompts = tiny
    accepted = []
    for ids in prompts:
        ar = run_to_end(ar_steps(ex, ids, N, params))
        for budget in (1, 4, 16, 64):
            steps_before = ex.steps.graph_steps
            dd = run_to_end(ddtree_steps(ex, ids, N, params, budget))
            assert ex.steps.graph_steps > steps_before                 # the captured step graphs ran
            assert dd == ar, f"budget {budget}: DDTree left AR at token {next(i for i in range(N) if dd[i] != ar[i])}"
            accepted.append(N / (ex.steps.graph_steps - steps_before))
    # the drafter still drafts (a plan that broke the trees would pass the equality with acceptance 1)
    assert np.mean(accepted) > 1.5, accepted


@pytest.fixture(scope="module")
def tiny_cols(tmp_path_factory):
    """The same engine with every MoE's down launch as moe_down_cols wherever its plan fits (plugins/moe_down_cols.py;
    the tiny shape is outside its measured range, so the default would not take it)."""
    from tests.runtime.tiny_gpu import tiny_gpu_executor
    ex, prompts = tiny_gpu_executor(tmp_path_factory, "tiny-invariant-cols", n_prompts=2,
                                    kernel_plan="batch-invariant")
    ex.ops.moe_down_cols = True
    return ex, prompts


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_ddtree_commits_ar_tokens_with_the_column_down(tiny_cols, params):
    """moe_down_cols at one row (AR) and at 5 and 17 (the verifies): the tokens are AR's exactly."""
    from ddtree.plugins.moe import FusedMoE
    ex, prompts = tiny_cols
    for ids in prompts:
        ar = run_to_end(ar_steps(ex, ids, N, params))
        for budget in (4, 16):
            dd = run_to_end(ddtree_steps(ex, ids, N, params, budget))
            assert dd == ar, f"budget {budget}: DDTree left AR at token {next(i for i in range(N) if dd[i] != ar[i])}"
    moes = [k for k in ex.ops.kernels.values() if isinstance(k, FusedMoE)]
    assert moes and all(m.down_cols and m.uses_down_cols(M) for m in moes for M in (1, 5, 17))
