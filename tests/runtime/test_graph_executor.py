"""GraphExecutor (runtime/graph_executor.py): the loop decodes through an engine's own per-rank graphs, kind by kind
(here under onnx.reference at float64, every rank a thread; --device tensorrt runs the same graphs as plans). Greedy
and sampled DDTree commit exactly the AR tokens (lossless), and those are EngineExecutor's (the op set run by the
numpy backend): the graphs are the same model."""
import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.data import tiny_model_dirs
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.loop import ar_steps, ddtree_steps, run_to_end
from ddtree.tree.sampling import SamplingParams

pytest.importorskip("onnx_graphsurgeon", reason="needs the 'graphs' extra")
PROMPT = [256] + list(b"def fib(n):")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_engine(*tiny_model_dirs(), 2, ["sm_90"], tmp_path_factory.mktemp("graphs") / "e")["engine"]


@pytest.fixture(scope="module")
def executors(engine):
    from ddtree.runtime.graph_executor import GraphExecutor
    from ddtree.runtime.graph_ranks import GraphRanks
    return GraphExecutor(GraphRanks.from_engine(engine, act="float64")), EngineExecutor(engine)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=7)], ids=["greedy", "T0.8"])
def test_graphs_decode_the_reference_tokens_and_ddtree_is_lossless(executors, params):
    graphs, numpy_ex = executors
    n = 12
    ar = run_to_end(ar_steps(graphs, PROMPT, n, params))
    assert len(ar) == n
    assert run_to_end(ddtree_steps(graphs, PROMPT, n, params, 16)) == ar
    assert run_to_end(ar_steps(numpy_ex, PROMPT, n, params)) == ar


def test_graph_logits_equal_the_numpy_executor(executors):
    """Within 1e-6 of the logits' scale: the graphs hold float attributes (the routing scale, the softmax scale)
    as float32, as ONNX stores them (tests/backends/test_graphs_reference.py: 1e-12 against a float32-attribute twin)."""
    graphs, numpy_ex = executors
    P = len(PROMPT)
    vis = np.tril(np.ones((P, P), bool))
    got, got_taps = graphs.target_forward(PROMPT, np.arange(P), vis, graphs.new_target_cache(64), (0, 2))
    want, want_taps = numpy_ex.target_forward(PROMPT, np.arange(P), vis, numpy_ex.new_target_cache(64), (0, 2))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * np.abs(want).max())
    for L in (0, 2):
        np.testing.assert_allclose(got_taps[L], want_taps[L], rtol=0, atol=1e-6 * np.abs(want_taps[L]).max())


def test_the_graphs_as_rank_processes_decode_the_same_tokens(engine, executors):
    """Each rank process runs only its own graphs and weights (GraphRanks(rank=r)), their AllReduce nodes meeting
    in the shared-memory group and the logits slices gathered through it (runtime/ranks.py, graphs=...): the
    tokens of every rank as a thread, greedy and sampled, DDTree and AR."""
    from ddtree.runtime.ranks import RankProcesses, Request
    graphs, _ = executors
    procs = RankProcesses(engine, graphs={"act": "float64"})
    try:
        assert procs.executor.ranks.held == 1 and procs.executor.ranks.tp == 2
        for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=7)):
            want = run_to_end(ar_steps(graphs, PROMPT, 8, params))
            for mode in ("ar", "ddtree"):
                req = Request(mode, tuple(PROMPT), 8, params, 16, (), None)
                assert [t for chunk in procs.steps(req) for t in chunk] == want, (mode, params)
    finally:
        procs.close()
