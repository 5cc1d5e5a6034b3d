"""Round times of the GPU's batched step (issue 51), not a test: R requests on R lanes in their steady state.

    PYTHONPATH=. python3 tests/runtime/profile_batch.py [--budget 16] [--rounds 40] [--sequential]

For R in 1, 2, 4: R requests (held-out prompts, greedy, 300 new tokens (512 cache rows): none ends while timed) join one
BatchDecoder; after 4 warm-up rounds (prefills, eager first steps, captures), the next rounds are timed on the
host (a round = one batched graph replay + each lane's record read). Printed: us per round, tokens per round,
aggregate tokens/s of the decode alone, the graph's device time replayed alone; and R = 1 on the executor's own step graph (no lane) for reference.
"""
import argparse
import statistics
import tempfile
import time
from pathlib import Path

from ddtree.model.tokenizer import load_tokenizer
from ddtree.runtime.batch import BatchDecoder
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.request import GenerationRequest


def rounds(eng, prompts, R: int, budget: int, n: int, lanes: bool) -> dict:
    dec = BatchDecoder(eng, R if lanes else 1)
    if lanes and R == 1:                         # one request on a lane: the batched graph with one lane
        dec.lanes = eng.executor.lane_pool(1)
    req = GenerationRequest(max_new_tokens=300, budget=budget, ignore_eos=True)
    for i in range(R):
        dec.add(i, prompts[i % len(prompts)], req)
    for _ in range(4):
        dec.step()
    times, tokens = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        events = dec.step()
        times.append(time.perf_counter() - t0)
        for e in events:
            if e.error is not None or e.finished:
                raise RuntimeError(f"request {e.key} ended while timed: {e.error!r}")
        tokens.append(sum(len(e.tokens) for e in events))
    ex = eng.executor
    if lanes:                                    # the batched graph alone, replayed (device time, events)
        graph = next(g for k, g in ex.lanes.batch.graphs.items() if k[0] == tuple(range(R)) and k[1] == budget)
    else:
        graph = next(pair[0] for k, pair in ex.steps.graphs.items() if k[:2] == ("ddtree", budget))
    gpu_us = statistics.median(ex.gpu.timed_ms(lambda: ex.gpu.replay(graph), 10)) * 1e3
    for i in range(R):
        dec.remove(i)
    us = statistics.median(times) * 1e6
    return {"R": R, "lanes": lanes, "round_us": us, "tokens_per_round": statistics.fmean(tokens),
            "tok_s": sum(tokens) / sum(times), "graph_us": gpu_us}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--sequential", action="store_true", help="the lanes in order on one chain (no branches)")
    args = ap.parse_args()
    if args.sequential:
        from ddtree.runtime.cuda_step_batch import BatchSteps
        BatchSteps._fork = lambda self, R: [self.ops.stream] * R
    from tests.runtime.tiny_gpu import tiny_gpu_executor

    class Temp:                                  # tiny_gpu_executor's tmp_path_factory: a temp dir
        @staticmethod
        def mktemp(name):
            return Path(tempfile.mkdtemp(prefix=name))
    ex, prompts = tiny_gpu_executor(Temp, "profile-batch")
    eng = DDTreeEngine(ex, load_tokenizer(ex.tokenizer_dir, ex.config), None, None)
    for R, lanes in ((1, False), (1, True), (2, True), (4, True)):
        r = rounds(eng, prompts, R, args.budget, args.rounds, lanes)
        print(f"R {r['R']} {'lanes' if lanes else 'own  '}: round {r['round_us']:.0f} us (graph alone "
              f"{r['graph_us']:.0f} us), "
              f"{r['tokens_per_round']:.2f} tokens a round, {r['tok_s']:.0f} tok/s")
    print(ex.device_stats())


if __name__ == "__main__":
    main()
