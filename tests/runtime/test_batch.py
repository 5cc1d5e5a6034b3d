"""Several requests at once (runtime/batch.py): every request's tokens equal the same request run alone, token for
token, whatever its neighbours do (join late, finish early, get cancelled), on the numpy reference (the requests take
turns) and on an engine dir's numpy ranks (the DDTree requests' trees verified in ONE forward: the union verify,
EngineExecutor.verify_requests); the GPU executors and rank processes are refused with a message naming the flag."""
from types import SimpleNamespace

import pytest

from ddtree.builder.build import build_engine
from ddtree.data import tiny_model_dirs
from ddtree.runtime.batch import BatchDecoder, check_batchable, run_batch
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.loop import RequestError, RunStats, run_to_end
from ddtree.runtime.request import GenerationRequest

PROMPTS = ["def fib(n):", "import numpy as np\n", "class Stack:\n    def push(self, x):", "# sort a list\n"]


class UnionSpy:
    """An executor's verify_requests, recording how many requests each union verify took (or raising `fail`)."""

    def __init__(self, verify_requests):
        self.inner, self.sizes, self.fail = verify_requests, [], None

    def __call__(self, calls):
        self.sizes.append(len(calls))
        if self.fail is not None:
            raise self.fail
        return self.inner(calls)


def engine_dir_engine(tmp_path_factory, tp: int):
    out_dir = tmp_path_factory.mktemp("batch") / "engine"
    return DDTreeEngine.load(build_engine(*tiny_model_dirs(), tp, [], out_dir, graphs=False, kernels=False)["engine"])


@pytest.fixture(scope="module", params=["reference", "union"])
def engine(request, tmp_path_factory):
    """The float64 reference (no verify_requests: turns), or a tp 1 engine dir whose union verify is spied on."""
    if request.param == "reference":
        return DDTreeEngine.load()
    engine = engine_dir_engine(tmp_path_factory, 1)
    engine.executor.verify_requests = UnionSpy(engine.executor.verify_requests)
    return engine


def union_sizes(engine) -> list[int]:
    """The requests of each union verify since the last call (none on the reference), and forgets them."""
    spy = engine.executor.verify_requests
    if spy is None:
        return []
    sizes, spy.sizes = spy.sizes, []
    return sizes


def mixed_jobs(engine) -> list[tuple]:
    """Requests that differ in everything a request carries: mode, budget, block, sampling, seed, length, stops."""
    reqs = [GenerationRequest(max_new_tokens=24, temperature=0.0, budget=8),
            GenerationRequest(max_new_tokens=9, temperature=0.9, top_k=20, seed=7, budget=4, block_size=3),
            GenerationRequest(max_new_tokens=20, temperature=0.7, top_p=0.9, seed=1, mode="ar"),
            GenerationRequest(max_new_tokens=30, temperature=1.0, seed=2**40 + 3, budget=16, ignore_eos=True),
            GenerationRequest(max_new_tokens=5, temperature=0.7, seed=1, budget=2),
            GenerationRequest(max_new_tokens=16, temperature=0.7, seed=1, budget=16, logit_bias={5: 4.0, 9: -100.0}),
            GenerationRequest(max_new_tokens=0, budget=8)]
    return [(i, engine.encode(PROMPTS[i % len(PROMPTS)]), r) for i, r in enumerate(reqs)]


def alone(engine, prompt, request) -> list[int]:
    return run_to_end(engine.stream_request(prompt, request))


@pytest.mark.parametrize("max_num_seqs", [1, 3, 7])
def test_every_request_equals_itself_alone(engine, max_num_seqs):
    jobs = mixed_jobs(engine)
    union_sizes(engine)
    out = run_batch(engine, jobs, max_num_seqs)
    sizes = union_sizes(engine)
    if engine.executor.verify_requests is not None:      # the union verify took several DDTree requests' trees at once
        assert (max(sizes) >= 2 if max_num_seqs > 1 else set(sizes) == {1})
        assert max_num_seqs != 7 or max(sizes) == 5                    # every request but logit_bias and the empty
    for key, prompt, request in jobs:
        expected = alone(engine, prompt, request)
        assert out[key]["tokens"] == expected, f"request {key} ({request}) differs from itself alone"
        assert out[key]["stats"].finish_reason is not None and not out[key]["cancelled"]
    assert out[6]["tokens"] == [] and len(out[3]["tokens"]) == 30          # a run of 0 and an ignore_eos run
    assert len({tuple(out[k]["tokens"]) for k in range(6)}) == 6          # the requests do differ


def test_join_order_and_neighbours_do_not_matter(engine):
    jobs = mixed_jobs(engine)
    forward, backward = run_batch(engine, jobs, 4), run_batch(engine, jobs[::-1], 2)
    assert {k: r["tokens"] for k, r in forward.items()} == {k: r["tokens"] for k, r in backward.items()}


def test_cancelled_neighbours_leave_the_others_unchanged(engine):
    jobs = mixed_jobs(engine)
    out = run_batch(engine, jobs, 3, cancel_after={0: 2, 3: 1})
    for key, prompt, request in jobs:
        expected = alone(engine, prompt, request)
        if key in (0, 3):                             # stopped mid-run: a strict prefix of its run alone
            assert out[key]["cancelled"] and out[key]["events"] == {0: 2, 3: 1}[key]
            assert out[key]["tokens"] == expected[: len(out[key]["tokens"])] and len(out[key]["tokens"]) < len(expected)
        else:
            assert out[key]["tokens"] == expected


def test_a_sequence_joining_mid_run_changes_nothing(engine):
    """Two sequences run 3 rounds, then a third joins, then the first is removed: every stream is itself alone."""
    jobs = mixed_jobs(engine)[:4]
    batch = BatchDecoder(engine, 3)
    got = {k: [] for k, _, _ in jobs}
    for key, prompt, request in jobs[:2]:
        batch.add(key, prompt, request)
    for round_ in range(40):
        if round_ == 3:
            batch.add(*jobs[2])
        if round_ == 5:
            batch.remove(0)
            batch.add(*jobs[3])
        for ev in batch.step():
            assert ev.error is None
            got[ev.key] += ev.tokens
    assert not batch
    for key, prompt, request in jobs:
        expected = alone(engine, prompt, request)
        assert got[key] == (expected[: len(got[key])] if key == 0 else expected)


def test_logprobs_rows_stay_with_their_request(engine):
    """on_logits per sequence: each request sees the raw logits rows of its own tokens, as when alone."""
    jobs = mixed_jobs(engine)[:3]
    rows_alone = {}
    for key, prompt, request in jobs:
        rows = []
        run_to_end(engine.stream_request(prompt, request, None, rows.append))
        rows_alone[key] = rows
    batch, rows_batch = BatchDecoder(engine, 3), {k: [] for k, _, _ in jobs}
    for key, prompt, request in jobs:
        batch.add(key, prompt, request, on_logits=rows_batch[key].append)
    while batch:
        batch.step()
    for key, rows in rows_alone.items():
        assert len(rows_batch[key]) == len(rows)
        for a, b in zip(rows, rows_batch[key]):
            assert (a == b).all()


def test_a_full_batch_and_a_bad_request_are_refused_at_add(engine):
    batch = BatchDecoder(engine, 1)
    batch.add("a", [1, 2, 3], GenerationRequest(max_new_tokens=2))
    with pytest.raises(RequestError, match="--max-num-seqs"):
        batch.add("b", [1, 2, 3], GenerationRequest(max_new_tokens=2))
    batch.remove("a")
    with pytest.raises(RequestError, match="budget"):
        batch.add("c", [1, 2, 3], GenerationRequest(budget=0))
    assert not batch


def test_a_failing_step_is_one_event_and_the_others_go_on(engine):
    batch = BatchDecoder(engine, 2)

    def broken():
        yield [1]
        raise ValueError("boom")

    batch.add("ok", [1, 2, 3], GenerationRequest(max_new_tokens=6, budget=4))
    batch.seqs["bad"] = type(batch.seqs["ok"])(broken(), RunStats())
    first, second = batch.step(), batch.step()
    assert [e.key for e in first] == ["ok", "bad"] and first[1].tokens == [1]
    assert second[1].key == "bad" and isinstance(second[1].error, ValueError) and "bad" not in batch.seqs
    while batch:
        batch.step()


def test_gpu_executors_and_rank_processes_are_refused_by_flag():
    tensorrt = SimpleNamespace(processes=None, executor=SimpleNamespace(name="tensorrt", lane_pool=None))
    with pytest.raises(RequestError, match="--max-num-seqs 4 is implemented on the CPU executors"):
        check_batchable(tensorrt, 4)
    check_batchable(tensorrt, 1)                                      # one at a time: today's path
    asked = []                                                        # the GPU executor: its request lanes decide
    cuda = SimpleNamespace(processes=None, executor=SimpleNamespace(name="cuda", lane_pool=asked.append))
    check_batchable(cuda, 3)
    assert asked == [3]
    ranks = SimpleNamespace(processes=object(), executor=SimpleNamespace(name="engine-numpy", lane_pool=None))
    with pytest.raises(RequestError, match="--max-num-seqs 2: the rank processes"):
        check_batchable(ranks, 2)
    with pytest.raises(RequestError, match="at least 1"):
        check_batchable(tensorrt, 0)


def test_engine_dir_ranks_batch_equals_alone(tmp_path_factory):
    """The same on an engine dir's numpy ranks (tp 2, threads; the union verify's all-reduces over the union rows):
    EngineExecutor's caches are per request too, and turns (union=False) give the same tokens."""
    engine = engine_dir_engine(tmp_path_factory, 2)
    spy = engine.executor.verify_requests = UnionSpy(engine.executor.verify_requests)
    jobs = mixed_jobs(engine)[:4]
    out = run_batch(engine, jobs, 4)
    assert max(spy.sizes) == 4                                   # three DDTree requests and an AR one
    turns = run_batch(engine, jobs, 4, union=False)
    for key, prompt, request in jobs:
        assert out[key]["tokens"] == turns[key]["tokens"] == alone(engine, prompt, request)


def test_a_failing_union_verify_fails_its_requests_only(tmp_path_factory):
    """An error in the union forward is each of its sequences' error event; the sequence outside it (logit_bias:
    the observed executor takes turns) goes on to its end."""
    engine = engine_dir_engine(tmp_path_factory, 1)
    spy = engine.executor.verify_requests = UnionSpy(engine.executor.verify_requests)
    jobs = [mixed_jobs(engine)[i] for i in (0, 1, 2, 5)]
    batch = BatchDecoder(engine, 4)
    for job in jobs:
        batch.add(*job)
    assert all(ev.error is None for ev in batch.step())          # the prefills: no verify yet
    spy.fail = ValueError("union boom")
    events = {ev.key: ev for ev in batch.step()}
    assert spy.sizes == [3] and list(events) == [0, 1, 2, 5]
    for key in (0, 1, 2):
        assert isinstance(events[key].error, ValueError) and events[key].finished and key not in batch.seqs
    assert events[5].error is None and events[5].tokens
    got = events[5].tokens
    while batch:
        got += [t for ev in batch.step() for t in ev.tokens]
    assert spy.sizes == [3]
    assert alone(engine, jobs[3][1], jobs[3][2])[1:] == got     # the logit_bias request, its prefill token aside
