"""--prune auto in the GPU DDTree step graph (issue 53; runtime/cuda_step.py + cuda_step_prune.py) on the embedded
tiny model's tp 1 engine under the batch-invariant kernel plan: DDTree with the verify pruned inside the captured
graph commits exactly the AR graph's tokens, greedy and sampled, budgets 4 and 16, at a rate so high that every
node with a marginal expert goes (pruned_nodes > 0 proves the pruned graph ran) at every MoE layer and every
PRUNE_EVERY-th, and at the default rate; the step composition on the GPU (graphs off) prunes the same way; pruned and
unpruned graphs interleave on one executor; `ddtree run --device cuda --prune auto --json` carries the stats.
Run: python3 -m pytest -q tests/runtime/test_prune_step_gpu.py"""
import json

import pytest

from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps, run_to_end
from ddtree.runtime.pruning import Pruner
from ddtree.tree.prune import PRUNE_EVERY
from ddtree.tree.sampling import SamplingParams

pytestmark = pytest.mark.gpu
N = 48
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
HIGH = 1e-4          # tokens per byte: with the tiny model's ~110 KB experts, any node with a marginal expert goes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.runtime.tiny_gpu import tiny_gpu_executor
    return tiny_gpu_executor(tmp_path_factory, "tiny-prune", n_prompts=2, kernel_plan="batch-invariant")


def steps_run(ex) -> int:
    return ex.steps.stats()["graph_steps"]


def pruned_run(ex, ids, params, budget, rate, every) -> tuple[list[int], dict]:
    stats = RunStats()
    tokens = run_to_end(ddtree_steps(ex, ids, N, params, budget, stats=stats,
                                     prune=Pruner.for_executor(ex, rate=rate, every=every)))
    return tokens, stats.to_dict() | {"steps": stats.steps}


def check_stats(d: dict, budget: int, high: bool, every_step: bool = False) -> None:
    """every_step: the distinct experts were counted on every step (the graph's stats steps are a sample:
    cuda_step_prune.py STATS_EVERY, which may all be steps with nothing to prune)."""
    assert len(d["pruned_per_step"]) == d["steps"] and d["pruned_nodes"] == sum(d["pruned_per_step"])
    assert all(0 <= p <= budget for p in d["pruned_per_step"])
    assert d["distinct_experts_after"] <= d["distinct_experts_before"]
    if high:
        assert d["pruned_nodes"] > 0
    if high and every_step:
        assert d["distinct_experts_after"] < d["distinct_experts_before"]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("budget", [4, 16])
@pytest.mark.parametrize("rate,every", [(HIGH, 1), (HIGH, PRUNE_EVERY), (None, PRUNE_EVERY)],
                         ids=["high-every-layer", "high-every-4", "default"])
def test_pruned_step_graph_commits_ar_tokens(tiny, params, budget, rate, every):
    ex, prompts = tiny
    for ids in prompts:
        ar = run_to_end(ar_steps(ex, ids, N, params))
        before = steps_run(ex)
        dd, d = pruned_run(ex, ids, params, budget, rate, every)
        assert steps_run(ex) > before                                   # the captured (pruned) step graphs ran
        assert dd == ar, f"budget {budget}: left AR at token {next(i for i in range(N) if dd[i] != ar[i])}"
        check_stats(d, budget, rate == HIGH)


def test_stats_steps_count_what_the_pruned_graph_read(tiny, monkeypatch):
    """With every step a stats step, the distinct experts read drop where the high rate prunes."""
    monkeypatch.setattr("ddtree.runtime.cuda_step_prune.STATS_EVERY", 1)
    ex, prompts = tiny
    for params in (GREEDY, SAMPLED):
        dd, d = pruned_run(ex, prompts[0], params, 16, HIGH, PRUNE_EVERY)
        assert dd == run_to_end(ar_steps(ex, prompts[0], N, params))
        check_stats(d, 16, True, every_step=True)


def test_pruned_and_unpruned_graphs_interleave(tiny):
    ex, prompts = tiny
    ids = prompts[0]
    ar = run_to_end(ar_steps(ex, ids, N, GREEDY))
    for prune in (True, False, True):
        got = pruned_run(ex, ids, GREEDY, 16, HIGH, 1)[0] if prune else run_to_end(ddtree_steps(ex, ids, N, GREEDY, 16))
        assert got == ar


def test_the_composition_on_the_gpu_prunes_too(tmp_path_factory):
    """graphs=False: every step is runtime/loop.py ddtree_step over the GPU primitives, pruned through
    CudaExecutor.prune_forward (the fallback of the graph's first and last steps)."""
    from tests.runtime.tiny_gpu import tiny_gpu_executor
    ex, prompts = tiny_gpu_executor(tmp_path_factory, "tiny-prune-eager", n_prompts=1, graphs=False,
                                    kernel_plan="batch-invariant")
    assert ex.steps is None
    for params in (GREEDY, SAMPLED):
        ar = run_to_end(ar_steps(ex, prompts[0], N, params))
        dd, d = pruned_run(ex, prompts[0], params, 16, HIGH, 1)
        assert dd == ar
        check_stats(d, 16, True, every_step=True)            # the host's composition counts every step


def test_run_cli_prunes_on_the_gpu(tiny):
    from tests.cli.bad_input import ddtree
    ex, _ = tiny
    r = ddtree(["run", "--model", str(ex.engine_dir), "--device", "cuda", "--kernel-plan", "batch-invariant",
                "--prune", "auto", "--budget", "16", "--max-new-tokens", "32", "--mode", "both", "--json",
                "def f(x):"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    s = out["stats"]
    assert out["identical"] is True and s["prune"] == "auto" and len(s["pruned_per_step"]) == s["steps"]
    assert s["distinct_experts_after"] <= s["distinct_experts_before"]
