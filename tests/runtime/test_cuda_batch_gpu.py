"""Several requests at once on the GPU (issue 51; runtime/cuda_lanes.py, runtime/cuda_step_batch.py), tiny tp 1
engine under --kernel-plan batch-invariant: every request's tokens are bitwise those of the same request run alone
(its own seed and sampling parameters), whatever its neighbours do (join late, finish early, are cancelled), and
the lanes' steps really ran as batched graphs of several lanes.
"""
import pytest

from ddtree.runtime.batch import BatchDecoder, run_batch
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.request import GenerationRequest

pytestmark = pytest.mark.gpu
N = 48


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from ddtree.model.tokenizer import load_tokenizer
    from tests.runtime.tiny_gpu import tiny_gpu_executor
    ex, prompts = tiny_gpu_executor(tmp_path_factory, "tiny-batch", kernel_plan="batch-invariant")
    return DDTreeEngine(ex, load_tokenizer(ex.tokenizer_dir, ex.config), None, None), prompts


def requests():
    """Mixed requests: greedy and sampled, budgets 4 and 16, different lengths and EOS stops (they finish at
    different rounds, some with a step of theirs already enqueued: BatchSteps.forget)."""
    return [GenerationRequest(max_new_tokens=N, budget=16, ignore_eos=True),
            GenerationRequest(max_new_tokens=N // 2, temperature=0.8, top_p=0.95, seed=7, budget=16, ignore_eos=True),
            GenerationRequest(max_new_tokens=N, temperature=1.0, top_k=20, seed=3, budget=16, ignore_eos=True),
            GenerationRequest(max_new_tokens=N - 5, budget=4, ignore_eos=True),
            GenerationRequest(max_new_tokens=N, temperature=0.7, seed=11, budget=16),      # may stop at EOS
            GenerationRequest(max_new_tokens=N, temperature=1.3, seed=12, budget=16)]


def alone(engine, prompt, request) -> list[int]:
    return [t for chunk in engine.stream_request(prompt, request) for t in chunk]


def test_batched_requests_equal_each_alone_bitwise(engine):
    eng, prompts = engine
    jobs = [(i, prompts[i % len(prompts)], r) for i, r in enumerate(requests())]
    expected = {i: alone(eng, p, r) for i, p, r in jobs}
    batch = eng.executor.lanes.batch if eng.executor.lanes else None
    before = batch.lane_steps if batch else 0
    out = run_batch(eng, jobs, 3)                      # 6 requests through 3 lanes: later ones join as others end
    for i, _, r in jobs:
        assert len(out[i]["tokens"]) == len(expected[i]) and (len(expected[i]) == r.max_new_tokens or not r.ignore_eos)
        assert out[i]["tokens"] == expected[i], f"request {i} differs from itself alone"
    batch = eng.executor.lanes.batch
    assert batch.lane_steps > before
    assert any(len(key[0]) >= 2 for key in batch.graphs), "no step ran with two or more lanes in one graph"
    assert batch.lane_steps / max(batch.batched_steps, 1) > 1.5      # steps shared their graph on average
    assert batch.ahead_steps > 0                                     # and were enqueued ahead of the host


def test_cancelled_neighbour_does_not_change_the_others(engine):
    eng, prompts = engine
    reqs = requests()[:3]
    jobs = [(i, prompts[i], r) for i, r in enumerate(reqs)]
    expected = {i: alone(eng, p, r) for i, p, r in jobs}
    out = run_batch(eng, jobs, 3, cancel_after={1: 2})
    assert out[1]["cancelled"] and out[1]["tokens"] == expected[1][: len(out[1]["tokens"])]
    for i in (0, 2):
        assert out[i]["tokens"] == expected[i]
    assert len(eng.executor.lanes.free) == len(eng.executor.lanes.lanes)      # every lane given back


def test_ar_requests_batch_too_and_lane_limits(engine):
    """AR requests' tokens go through one union forward a round (their own AR graph), beside a DDTree one."""
    eng, prompts = engine
    ars = [GenerationRequest(max_new_tokens=24, mode="ar", temperature=0.9, seed=2, ignore_eos=True),
           GenerationRequest(max_new_tokens=20, mode="ar", ignore_eos=True),
           GenerationRequest(max_new_tokens=24, mode="ar", temperature=0.7, top_k=10, seed=9, ignore_eos=True)]
    dd = GenerationRequest(max_new_tokens=16, budget=8, ignore_eos=True)
    jobs = [(f"ar{i}", prompts[i], r) for i, r in enumerate(ars)] + [("dd", prompts[3], dd)]
    out = run_batch(eng, jobs, 4)
    for key, prompt, r in jobs:
        assert out[key]["tokens"] == alone(eng, prompt, r), key
    assert any(k[1] is None and len(k[0]) >= 2 for k in eng.executor.lanes.batch.graphs)   # an AR union graph
    decoder = BatchDecoder(eng, 2)
    decoder.add("a", prompts[0], dd)
    decoder.add("b", prompts[1], dd)
    with pytest.raises(Exception, match="full"):
        decoder.add("c", prompts[2], dd)
    decoder.remove("a")
    decoder.remove("b")
