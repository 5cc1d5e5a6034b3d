"""tp 2 on the GPU, end to end (issue 25): the ranks of a tp 2 engine as two processes (runtime/ranks.py
RankProcesses(cuda=...), runtime/cuda_ranks.py), each a CudaExecutor on its GPU whose layers' all-reduces go through
the one-shot all-reduce over CUDA IPC, the logits slices gathered through the host group. Both ranks share GPU 0
here (one GPU is enough; two GPUs run the same code with --gpu 0,1). Greedy AR and DDTree decoding on small-mla
(the real MLA head dims, a decisive router) commit the float64 reference's tokens (EngineExecutor, every rank as a
thread) except at counted near-ties (the bound of tests/runtime/test_cuda_executor_gpu.py), and the CLI runs it.
A worker killed mid-step ends the run with an error naming it, no kernel left spinning (rank 0's GPU decodes again)."""
import json
import os
import signal
import threading
import time

import pytest

from ddtree.builder.build import build_engine
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.tree.sampling import SamplingParams
from tests.runtime.test_cuda_executor_gpu import PROMPTS, near_ties, small_mla_decisive

pytestmark = pytest.mark.gpu
# the rank processes' GPUs: both on GPU 0 by default (one GPU is enough); DDTREE_TEST_GPUS=0,1 on a 2-GPU machine
GPUS = [int(g) for g in os.environ.get("DDTREE_TEST_GPUS", "0,0").split(",")]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-mla-tp2")
    return build_engine(*small_mla_decisive(root), 2, ["sm_90"], root / "engine", graphs=False)["engine"]


def decoded(procs, mode: str, prompt, n: int, budget: int = 16) -> list[int]:
    from ddtree.runtime.ranks import Request
    req = Request(mode, tuple(prompt), n, SamplingParams(), budget, (), None)
    return [t for chunk in procs.steps(req) for t in chunk]


def test_tp2_rank_processes_on_the_gpu_decode_the_reference_tokens(engine):
    from ddtree.runtime.ranks import RankProcesses
    ref = EngineExecutor(engine)
    procs = RankProcesses(engine, cuda={"gpus": GPUS, "max_context": 256, "kernel_plan": "fast"})
    try:
        assert procs.executor.lay.tp == 2 and procs.executor.ops.collective is not None
        for mode in ("ar", "ddtree"):
            ties, total = 0, 0
            for prompt in PROMPTS:
                tokens = decoded(procs, mode, prompt, 24)
                assert len(tokens) == 24
                ties, total = ties + near_ties(ref, prompt, tokens), total + len(tokens)
            print(f"tp 2, 2 processes on GPUs {GPUS}, greedy {mode}: {total - ties} of {total} tokens are the float64 "
                  f"argmax, {ties} near-ties")
    finally:
        procs.close()


def test_the_cli_runs_a_tp2_engine_on_one_gpu(engine):
    from tests.cli.bad_input import ddtree
    r = ddtree(["run", "--model", str(engine), "--device", "cuda", "--gpu", "0,0", "--max-new-tokens", "8",
                "--allreduce", "auto", "--json", "hello"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["tokens"]) == 8 or out["stats"]["finish_reason"] == "stop"
    assert out["stats"]["allreduce"] == "one-shot"            # auto on ranks sharing a GPU: no NCCL there
    r = ddtree(["run", "--model", str(engine), "--device", "cuda", "--gpu", "0,0,0", "hello"])
    assert r.returncode == 1 and "needs one GPU index per rank" in r.stderr


def test_a_killed_gpu_worker_is_named_and_no_kernel_hangs(engine):
    """SIGKILL rank 1 while rank 0 replays step graphs with the one-shot inside: rank 0's waits on the dead peer end
    after their bounded spin (error bit) or the host group sees the death first; either way the error names rank 1,
    within a bound, and rank 0's GPU is usable after: new rank processes decode the tokens decoded before."""
    from ddtree.parallel.shm_group import RankError
    from ddtree.plugins.allreduce import AllReduceError
    from ddtree.runtime.ranks import RankProcesses, Request
    cuda = {"gpus": GPUS, "max_context": 1024, "kernel_plan": "fast"}
    procs = RankProcesses(engine, timeout_s=3.0, heartbeat_s=1.0, cuda=cuda)
    try:
        want = decoded(procs, "ddtree", PROMPTS[0], 16)
        steps = procs.steps(Request("ddtree", tuple(PROMPTS[0]), 600, SamplingParams(), 16, (), None))
        next(steps)
        acted = []
        timer = threading.Timer(0.2, lambda: (os.kill(procs.pids[1], signal.SIGKILL), acted.append(time.monotonic())))
        timer.start()
        with pytest.raises((RankError, AllReduceError)) as err:
            for _ in steps:
                pass
        took = time.monotonic() - acted[0]
        timer.join()
    finally:
        procs.close(kill=True)
    print(f"killed rank 1: {type(err.value).__name__} after {took:.2f} s: {err.value}")
    assert "rank 1" in str(err.value) or "[1]" in str(err.value), err.value
    assert took < 20.0                  # heartbeat 1 s, collective timeout 3 s, one-shot spins ~1 s a call
    again = RankProcesses(engine, cuda=cuda)
    try:
        assert decoded(again, "ddtree", PROMPTS[0], 16) == want
    finally:
        again.close()
