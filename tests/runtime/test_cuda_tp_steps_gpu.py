"""The tp 2 step graphs on the GPU (issue 25, runtime/cuda_step_tp.py): the ranks of a tp 2 small-mla engine as two
processes sharing GPU 0 (runtime/ranks.py RankProcesses(cuda=...)), each capturing and replaying its own AR and
DDTree graphs with the one-shot collectives inside.

- Greedy AR and DDTree through the graphs commit the float64 reference's tokens except counted near-ties (near_ties
  of tests/runtime/test_cuda_executor_gpu.py: the decisive router, the logits' error bound).
- Sampled at T 0.8 (plain temperature: the node kernels' Gumbel) DDTree through the graphs == AR through the graphs,
  and AR through the graphs == AR through the primitives (the host's float64 sampling definition on the gathered
  logits: a wrong sample position in both graphs would keep the first equality and break this one), except at
  near-ties by runtime/near_tie.py's rule (tests/runtime/test_cuda_step_gpu.py's): the two departing tokens'
  logits at the departure are measured on the verify (BLOCK and BUDGET + 1 rows) and the one-token decode paths by
  teacher-forcing the first run's tokens through this engine's ranks as threads of this process (the same kernels
  and rank-ordered sums, parallel/cuda_collectives.py ThreadRankGroup); a departure is a near-tie when their z + g
  margin is within the sum of their own verify-vs-decode differences / T.
- Top-k at tp 2 runs the primitives (counted in stats), with the same rule between DDTree and AR; the kept set is
  a discrete choice too: the rule takes it as measured on each path (a candidate the cut moved across is a
  near-tie if the scores allow it, one no path keeps never is).
- Top-p 0.9 at T 0.8 (no top-k) runs in the graphs through TopPRanks (none counted as primitives): DDTree graph ==
  AR graph, AR graph == AR primitives, except near-ties by the same rule, the kept set's cut included.
- Decode speed, printed (and written to $DDTREE_TP_STEPS_JSON when set): tp 2 graphs, tp 2 primitives and tp 1 graphs
  on the same model. Two processes share one GPU here, so tp 2 measures the protocol, not a speed-up.
"""
import json
import os
import time

import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps, run_to_end
from ddtree.runtime.near_tie import classify_departure, describe, path_differences
from ddtree.tree.sampling import SamplingParams
from tests.runtime.test_cuda_executor_gpu import PROMPTS, near_ties, small_mla_decisive

pytestmark = pytest.mark.gpu
N, BUDGET, BLOCK = 24, 16, 8                          # small-mla's drafter block is 8
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, seed=5)
TOP_K = SamplingParams(temperature=0.8, top_k=20, seed=7)
TOP_P = SamplingParams(temperature=0.8, top_p=0.9, seed=9)
CUDA = {"gpus": [0, 0], "max_context": 256, "kernel_plan": "fast"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The decisive small-mla model built at tp 2 and at tp 1 (the same weights)."""
    root = tmp_path_factory.mktemp("small-mla-tp-steps")
    dirs = small_mla_decisive(root)
    return {tp: build_engine(*dirs, tp, ["sm_90"], root / f"engine-tp{tp}", graphs=False)["engine"] for tp in (2, 1)}


def rank_processes(engine, graphs: bool):
    from ddtree.runtime.ranks import RankProcesses
    return RankProcesses(engine, cuda={**CUDA, "graphs": graphs})


@pytest.fixture(scope="module")
def procs(engines):
    p = rank_processes(engines[2], graphs=True)
    yield p
    p.close()


@pytest.fixture(scope="module")
def primitives(engines):
    p = rank_processes(engines[2], graphs=False)
    yield p
    p.close()


def decode(procs, mode: str, prompt, n: int, params: SamplingParams, stats=None) -> list[int]:
    from ddtree.runtime.ranks import Request
    req = Request(mode, tuple(prompt), n, params, BUDGET, (), None)
    return [t for chunk in procs.steps(req, stats) for t in chunk]


class ThreadRanks:
    """The tp engine's ranks as threads of this process on GPU 0 behind one target_forward giving the full logits
    (what runtime/near_tie.py reads); each rank keeps its own cache."""

    def __init__(self, engine, tp: int = 2):
        from ddtree.parallel.cuda_collectives import ThreadRankGroup
        from ddtree.runtime.cuda_executor import CudaExecutor
        group = ThreadRankGroup(tp)
        self.ranks = [CudaExecutor(engine, gpu=0, max_context=CUDA["max_context"], graphs=False, rank=r,
                                   collective=group.member(r), host_group=group) for r in range(tp)]
        self.config = self.ranks[0].config

    def new_target_cache(self, capacity: int = 0, limit: int | None = None) -> list:
        return [ex.new_target_cache(capacity, limit) for ex in self.ranks]

    def target_forward(self, ids, pos, visible, caches, taps=()):
        from ddtree.parallel.cuda_collectives import run_ranks
        return run_ranks(self.ranks, lambda ex: ex.target_forward(ids, pos, visible, caches[ex.lay.rank], taps))[0]


@pytest.fixture(scope="module")
def threads(engines):
    return ThreadRanks(engines[2])


def test_verify_and_decode_differ_by_rounding_at_tp2(procs, threads):
    """The whole-row verify-vs-decode differences (a diagnostic: the near-tie rule reads only the departing
    tokens' logits, runtime/near_tie.py)."""
    per_position = []
    for prompt in PROMPTS:
        ar = decode(procs, "ar", prompt, N, GREEDY)
        per_position.extend(path_differences(threads, prompt, ar, rows=(BLOCK, BUDGET + 1)))
    per_position = np.array(per_position)
    d = float(per_position.max())
    print(f"delta at tp 2 (verify vs decode, teacher-forced, {len(PROMPTS)} prompts x {N} tokens x 2 row counts): "
          f"max {d:.3e}, median {np.median(per_position):.3e}")
    assert np.median(per_position) < 0.1          # a wrong verify path moves logits by their own scale (~10)


def test_greedy_graphs_at_tp2_commit_the_float64_tokens(engines, procs):
    from ddtree.runtime.cuda_step_tp import TpSteps
    ref = EngineExecutor(engines[2])
    steps = procs.executor.steps
    assert isinstance(steps, TpSteps) and procs.executor.ops.collective.capturable
    for mode in ("ar", "ddtree"):
        before, ties, total = steps.stats()["graph_steps"], 0, 0
        for prompt in PROMPTS:
            tokens = decode(procs, mode, prompt, N, GREEDY)
            assert len(tokens) == N
            ties, total = ties + near_ties(ref, prompt, tokens), total + N
        graph_steps = steps.stats()["graph_steps"] - before
        print(f"tp 2 graphs, 2 processes on GPU 0, greedy {mode}: {total - ties} of {total} tokens are the float64 "
              f"argmax, {ties} near-ties; {graph_steps} graph steps")
        assert graph_steps > 0
    assert ("ar", "greedy") in steps.graphs and ("ddtree", BUDGET, BLOCK, "greedy") in steps.graphs
    print("rank 0 step stats:", steps.stats())


def departure(threads, prompt, a, b, params, what: str) -> int:
    """1 if the runs a and b depart (asserting a near-tie there, runtime/near_tie.py's rule, the kept set's
    membership included), else 0."""
    v = classify_departure(threads, prompt, a, b, params, rows=(BLOCK, BUDGET + 1))
    if v is None:
        return 0
    print(f"{what}, prompt {prompt}: {describe(v)}")
    assert v["near_tie"], f"{what}: {describe(v)}"
    return 1


def test_sampled_graphs_at_tp2_follow_the_definition(procs, primitives, threads):
    steps = procs.executor.steps
    before = steps.stats()["primitive_sampling_steps"]
    departures = {"ddtree graph vs ar graph": 0, "ar graph vs ar primitives": 0}
    for prompt in PROMPTS:
        ar, dd = decode(procs, "ar", prompt, N, SAMPLED), decode(procs, "ddtree", prompt, N, SAMPLED)
        host = decode(primitives, "ar", prompt, N, SAMPLED)
        assert len(ar) == len(dd) == len(host) == N
        for what, (a, b) in zip(departures, ((ar, dd), (host, ar))):
            departures[what] += departure(threads, prompt, a, b, SAMPLED, what)
    print(f"T {SAMPLED.temperature} at tp 2, {len(PROMPTS)} x {N} tokens: departures (all near-ties) {departures}")
    assert ("ar", "gumbel") in steps.graphs and ("ddtree", BUDGET, BLOCK, "gumbel") in steps.graphs
    assert steps.stats()["primitive_sampling_steps"] == before


def test_top_k_at_tp2_runs_the_primitives(procs, threads):
    steps = procs.executor.steps
    before, departures = steps.stats()["primitive_sampling_steps"], 0
    for prompt in PROMPTS:
        ar, dd = decode(procs, "ar", prompt, N, TOP_K), decode(procs, "ddtree", prompt, N, TOP_K)
        assert len(ar) == len(dd) == N
        departures += departure(threads, prompt, ar, dd, TOP_K, "top-k ddtree vs ar")
    counted = steps.stats()["primitive_sampling_steps"] - before
    print(f"top-k 20 at tp 2: {counted} steps ran the primitives, {departures} departures (near-ties)")
    assert counted >= len(PROMPTS) * (N - 1) and not any("top_k" in key for key in steps.graphs)


def test_top_p_at_tp2_runs_in_the_graphs(procs, primitives, request):
    """Top-p without top-k through TopPRanks inside both graphs: no step counted as primitives, both graphs of mode
    top_p captured; DDTree graph vs AR graph and AR graph vs AR primitives (the host's float64 definition on the
    gathered logits) depart only at near-ties (threads are built only if a run departs)."""
    steps = procs.executor.steps
    before, graph_before = steps.stats()["primitive_sampling_steps"], steps.stats()["graph_steps"]
    departures = {"top-p ddtree graph vs ar graph": 0, "top-p ar graph vs ar primitives": 0}
    for prompt in PROMPTS:
        ar, dd = decode(procs, "ar", prompt, N, TOP_P), decode(procs, "ddtree", prompt, N, TOP_P)
        host = decode(primitives, "ar", prompt, N, TOP_P)
        assert len(ar) == len(dd) == len(host) == N
        for what, (a, b) in zip(departures, ((ar, dd), (host, ar))):
            if a != b:
                threads = request.getfixturevalue("threads")
                departures[what] += departure(threads, prompt, a, b, TOP_P, what)
    stats = steps.stats()
    print(f"top-p {TOP_P.top_p} T {TOP_P.temperature} at tp 2, {len(PROMPTS)} x {N} tokens: departures (all "
          f"near-ties) {departures}; {stats['graph_steps'] - graph_before} graph steps, "
          f"{stats['primitive_sampling_steps'] - before} primitive sampling steps")
    assert ("ar", "top_p") in steps.graphs and ("ddtree", BUDGET, BLOCK, "top_p") in steps.graphs
    assert stats["primitive_sampling_steps"] == before and stats["graph_steps"] - graph_before >= len(PROMPTS)
    assert steps.top_p is not None and steps.top_p.tp == 2


def test_decode_speed_tp2_graphs_tp2_primitives_tp1(engines, procs, primitives):
    from ddtree.runtime.cuda_executor import CudaExecutor
    tp1 = CudaExecutor(engines[1], max_context=CUDA["max_context"])
    prompt, n = PROMPTS[2], 64

    def local(mode, stats):
        steps = ar_steps(tp1, prompt, n, GREEDY, stats=stats) if mode == "ar" else \
            ddtree_steps(tp1, prompt, n, GREEDY, BUDGET, stats=stats)
        return run_to_end(steps)
    runs = {"tp 2 graphs": lambda mode, stats: decode(procs, mode, prompt, n, GREEDY, stats),
            "tp 2 primitives": lambda mode, stats: decode(primitives, mode, prompt, n, GREEDY, stats),
            "tp 1 graphs": local}
    rows = []
    for name, run in runs.items():
        for mode in ("ar", "ddtree"):
            run(mode, RunStats())                                   # warm-up: the graphs captured
            stats, t0 = RunStats(), time.perf_counter()
            tokens = run(mode, stats)
            wall = time.perf_counter() - t0
            assert len(tokens) == n
            d = stats.to_dict()
            rows.append({"run": name, "mode": mode, "budget": BUDGET if mode == "ddtree" else None, "new_tokens": n,
                         "tokens_per_s": n / wall, "steps": d["steps"], "mean_accept_len": d["mean_accept_len"]})
            print(f"{name:16s} {mode:6s}: {n / wall:8.1f} tok/s ({n} tokens after an {len(prompt)}-token prompt, "
                  f"prefill included; {d['steps']} steps, mean accept {d['mean_accept_len']:.2f})")
    if os.environ.get("DDTREE_TP_STEPS_JSON"):
        with open(os.environ["DDTREE_TP_STEPS_JSON"], "w") as f:
            json.dump({"device": tp1.gpu.name, "model": "small-mla (decisive router)", "note": "tp 2 = two processes "
                       "sharing GPU 0 (the protocol, not a speed-up)", "rows": rows}, f, indent=1)
