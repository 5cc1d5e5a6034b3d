"""Where the host time of a GPU DDTree step goes (H200, tiny engine): each host call of the pipelined step timed
(a copy of GpuSteps._step with timers) and a cProfile of two requests. Run on a GPU:
    PYTHONPATH=. python3 tests/runtime/profile_step.py
Found with it: the steady state costs ~15 us of host time a step (replay 7, event 2, record 5); the rest of the
mean was the per-request start (state and window uploads, which synchronise), now counted apart."""
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ddtree.builder.build import build_engine
from ddtree.data import tiny_model_dirs
from ddtree.runtime.cuda_executor import CudaExecutor
from ddtree.runtime.loop import ar_steps, ddtree_steps, run_to_end
from ddtree.tree.sampling import SamplingParams

root = Path(tempfile.mkdtemp())
engine = build_engine(*tiny_model_dirs(), 1, ["sm_90"], root / "engine", graphs=False)["engine"]
ex = CudaExecutor(engine, max_context=896)
prompt = list(range(40, 140))
g = ex.gpu
orig_replay, orig_record = g.replay, g.stream.record
T = {"replay": [], "record_event": []}
def replay(graph):
    t = time.perf_counter(); orig_replay(graph); T["replay"].append(time.perf_counter() - t)
g.replay = replay
from ddtree.runtime import cuda_step

P = {"enter": [], "replay_next": [], "record_next": [], "sync": [], "after": []}
def _step(self, key, body, prepare, ahead):
    t0 = time.perf_counter()
    if self.inflight is not None and self.inflight[0] == key:
        event = self.inflight[1]
    else:
        self.drain(); prepare(); self._run(key, body); event = self.gpu.stream.record()
    t1 = time.perf_counter()
    self.inflight = None
    if ahead and self.pipeline and key in self.graphs:
        self._replay(key)
        t2 = time.perf_counter()
        self.inflight = (key, self.gpu.stream.record())
    else:
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    event.sync()
    t4 = time.perf_counter()
    step = self.state.steps + 1
    rec = self.state.record(step)
    self.state.steps = step
    t5 = time.perf_counter()
    for k, v in zip(P, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
        P[k].append(v)
    self.host_s += t5 - t0 - (t4 - t3); self.graph_steps += 1
    return rec
cuda_step.GpuSteps._step = _step
for budget in (1, 16):
    run_to_end(ddtree_steps(ex, prompt, 128, SamplingParams(), budget))   # warm-up + capture
    for k in T: T[k].clear()
    ex.steps.host_s, ex.steps.graph_steps = 0.0, 0
    pr = cProfile.Profile(); pr.enable()
    t0 = time.perf_counter()
    out = run_to_end(ddtree_steps(ex, prompt, 256, SamplingParams(), budget))
    wall = time.perf_counter() - t0
    pr.disable()
    print(f"budget {budget}: {len(out)} tokens in {wall*1e3:.1f} ms, steps {ex.steps.graph_steps}, host us/step "
          f"{ex.steps.stats()['host_us_per_step']:.1f}, replay us mean {1e6*np.mean(T['replay']):.1f} "
          f"median {1e6*np.median(T['replay']):.1f} max {1e6*np.max(T['replay']):.1f}")
    print("  per-step us (median): " + ", ".join(f"{k} {1e6*np.median(v[-50:]):.1f}" for k, v in P.items()))
    for v in P.values(): v.clear()
# GPU time of one replay alone
key = next(k for k in ex.steps.graphs if k[0] == "ddtree" and k[1] == 16)
gr = ex.steps.graphs[key][0]
print("graph nodes:", len(gr.graph.nodes()) if hasattr(gr, "graph") else "?")
