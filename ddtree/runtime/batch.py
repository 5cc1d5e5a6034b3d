"""Several requests at once on the CPU executors: R sequences advance together, one step each per round.

    batch = BatchDecoder(engine, max_num_seqs=4)
    batch.add("a", prompt_ids, GenerationRequest(max_new_tokens=64, seed=1))   # joins at the next round
    while batch:
        for event in batch.step():        # one step of every sequence, in join order
            event.key, event.tokens, event.finished, event.error
    batch.remove("a")                     # cancelled mid-run: its generator is closed, the others go on

Each sequence is the engine's own decode loop for that request (runtime/loop.py's generator from
DDTreeEngine.stream_request): its own target / drafter caches, context window, seed, sampling parameters,
budget, stop rules and RunStats. A round advances each once, so a sequence's tokens are exactly those of the same
request run alone, whatever its neighbours do (join, finish, be cancelled): tests/runtime/test_batch.py checks this
token for token.

The union verify: where the executor declares verify_requests (runtime/executor.py; EngineExecutor), a sequence
stops at its verify (loop.ddtree_steps(union=True) yields a loop.Verify after its draft and tree; an AR sequence's
is its one token, loop.ar_steps(union=True)), and the round verifies every waiting sequence in ONE target forward
(rows = the sum of the trees' nodes, each request's rows seeing only its own cache and ancestors:
description/layers.py decoder_layer(requests=Rq)), then each sequence samples, walks and compacts on its own.
The drafter runs per request (its own call: on the CPU a second request's rows cost as much as the first's, so one
drafter call over R blocks would gain nothing here; the GPU batched step is where it would). Sequences the union
cannot take (logit_bias / logprobs, the prefill's first token) take their turn as before, in the same round.
Without verify_requests (the float64 reference NumpyExecutor, which runs the oracle, not the op set) every
sequence takes turns. An error in the union forward is the error of every sequence in it.
The GPU (a tp 1 CudaExecutor with step graphs): every sequence takes a request lane of the executor's LanePool
(runtime/cuda_lanes.py: its own caches and device state), its DDTree steps yield a loop.Fused, and the round runs
the waiting lanes' steps as one batched graph (runtime/cuda_step_batch.py: drafts and walks in parallel branches,
the trees verified in one forward; the AR sequences' tokens in one forward of their own). Rank processes run
one request loop in lock step, and other GPU executors keep one request's state: both are refused with more than
one sequence (RequestError naming --max-num-seqs).

A sequence finishes in the round that yields its last tokens (its RunStats has a finish_reason): the event
carries those tokens and finished=True, and its generator is closed. A request whose step raises yields one
event with the error; the others go on.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ddtree.runtime.loop import Fused, RequestError, RunStats, Verify
from ddtree.runtime.request import GenerationRequest

BATCHING_EXECUTORS = ("numpy", "engine-numpy")     # the CPU executors: every request's state lives on the host


def check_batchable(engine, max_num_seqs: int) -> None:
    """A RequestError naming --max-num-seqs when this engine cannot interleave max_num_seqs requests."""
    if max_num_seqs < 1:
        raise RequestError(f"--max-num-seqs {max_num_seqs}: expected at least 1")
    if max_num_seqs == 1:
        return
    if engine.processes is not None:
        raise RequestError(f"--max-num-seqs {max_num_seqs}: the rank processes run one request at a time "
                           "(--ranks processes); use --ranks threads or --max-num-seqs 1")
    ex = engine.executor
    if ex.lane_pool is not None:
        ex.lane_pool(max_num_seqs)                   # the GPU's request lanes: refused here (tp, graphs, memory)
        return
    if ex.name not in BATCHING_EXECUTORS:
        raise RequestError(f"--max-num-seqs {max_num_seqs} is implemented on the CPU executors (--device cpu) and "
                           f"the GPU's tp 1 executor; the {ex.name} executor keeps one request's state on the device "
                           "(--max-num-seqs 1 there)")


@dataclass
class Event:
    key: object
    tokens: list[int]                   # the tokens this step committed (empty with an error, or a run of 0)
    finished: bool = False              # the last step of this sequence: stats.finish_reason is set
    error: Exception | None = None      # the step raised: the sequence is gone
    step_s: float = 0.0                 # the wall time of this sequence's step
    at: float = 0.0                     # time.perf_counter() when it ended (the tokens' time, not the round's)


@dataclass
class Sequence:
    steps: Iterator[list[int]]
    stats: RunStats
    joined: float = field(default_factory=time.perf_counter)
    lane: object = None                 # the GPU's request lane it holds (runtime/cuda_lanes.py), or None


class BatchDecoder:
    def __init__(self, engine, max_num_seqs: int, union: bool = True):
        """union: verify the sequences' steps in one forward where the executor can (verify_requests);
        False: every sequence takes its turn."""
        check_batchable(engine, max_num_seqs)
        self.engine, self.max_num_seqs = engine, max_num_seqs
        ex = engine.executor
        self.lanes = ex.lane_pool(max_num_seqs) if ex.lane_pool is not None and max_num_seqs > 1 else None
        self.verify_requests = ex.verify_requests if union and engine.processes is None else None
        self.seqs: dict[object, Sequence] = {}        # insertion order = join order = event order in a round

    def __len__(self) -> int:
        return len(self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    @property
    def full(self) -> bool:
        return len(self.seqs) >= self.max_num_seqs

    def add(self, key, prompt, request: GenerationRequest, stats: RunStats | None = None, on_logits=None) -> None:
        """Join at the next round. A request the engine refuses raises here (RequestError), before any step."""
        if key in self.seqs:
            raise ValueError(f"sequence {key!r} is already in the batch")
        if self.full:
            raise RequestError(f"the batch is full ({self.max_num_seqs} sequences, --max-num-seqs)")
        stats = stats if stats is not None else RunStats()
        if self.lanes is None:
            steps = self.engine.stream_request(prompt, request, stats, on_logits,
                                               union=self.verify_requests is not None)
            self.seqs[key] = Sequence(steps, stats)
            return
        lane = self.lanes.acquire()
        try:
            steps = self.engine.stream_request(prompt, request, stats, on_logits, union=True, lane=lane)
        except BaseException:
            self.lanes.release(lane)
            raise
        self.seqs[key] = Sequence(steps, stats, lane=lane)

    def remove(self, key) -> None:
        """Leave now (cancelled): the sequence's generator is closed; unknown keys are ignored."""
        seq = self.seqs.pop(key, None)
        if seq is not None:
            seq.steps.close()
            if seq.lane is not None:
                self.lanes.release(seq.lane)

    def step(self) -> list[Event]:
        """One step of every sequence -> one event each, in join order. The sequences waiting for their verify
        get it from one verify_requests call over all of them; those waiting for a fused step (GPU lanes), from
        one LanePool.steps call (the batched graph)."""
        order, events, waiting = list(self.seqs), {}, {}
        for key, seq in list(self.seqs.items()):
            pending = self._advance(key, seq, events, seq.steps.__next__)
            if pending is not None:
                waiting[key] = pending
        if waiting:
            t0 = time.perf_counter()
            items = [item for item, _ in waiting.values()]
            try:
                if all(isinstance(item, Fused) for item in items):
                    results = self.lanes.steps(items)
                else:
                    results = self.verify_requests([verify.call for verify in items])
            except Exception as e:                    # the union's error is each of its sequences'
                results = [e] * len(waiting)
            union_s = time.perf_counter() - t0
            for (key, (_, spent)), result in zip(waiting.items(), results):
                steps = self.seqs[key].steps
                failed = isinstance(result, Exception)
                resume = (lambda: steps.throw(result)) if failed else (lambda: steps.send(result))
                self._advance(key, self.seqs[key], events, resume, spent + union_s)
        return [events[key] for key in order if key in events]

    def _advance(self, key, seq: Sequence, events: dict, resume, spent: float = 0.0) -> tuple | None:
        """Run the sequence to its next yield: its tokens (events[key]), or (its Verify, seconds so far)."""
        t0 = time.perf_counter()
        try:
            item = resume()
        except StopIteration:                         # a run of 0 new tokens: nothing to commit
            self.remove(key)
            now = time.perf_counter()
            events[key] = Event(key, [], True, None, spent + now - t0, now)
            return None
        except Exception as e:                        # this request failed; the batch goes on
            self.remove(key)
            now = time.perf_counter()
            events[key] = Event(key, [], True, e, spent + now - t0, now)
            return None
        now = time.perf_counter()
        if isinstance(item, (Verify, Fused)):
            return item, spent + now - t0
        finished = seq.stats.finish_reason is not None
        if finished:
            self.remove(key)
        events[key] = Event(key, list(item), finished, None, spent + now - t0, now)
        return None


def run_batch(engine, jobs: list[tuple], max_num_seqs: int, cancel_after: dict | None = None,
              union: bool = True) -> dict:
    """Run jobs [(key, prompt, request)] through one BatchDecoder: FIFO, each joining as a slot frees (at the
    start of a round); cancel_after {key: n}: the sequence is removed after its n-th event. -> {key: {"tokens",
    "stats", "joined_s", "first_s", "end_s" (when its first / last step ended; seconds from the
    call), "cancelled", "events"}}."""
    cancel_after = cancel_after or {}
    batch, waiting, out = BatchDecoder(engine, max_num_seqs, union), list(jobs), {}
    t0 = time.perf_counter()
    while waiting or batch:
        while waiting and not batch.full:
            key, prompt, request = waiting.pop(0)
            out[key] = {"tokens": [], "stats": RunStats(), "joined_s": time.perf_counter() - t0, "first_s": None,
                        "end_s": None, "cancelled": False, "events": 0}
            batch.add(key, prompt, request, out[key]["stats"])
        for ev in batch.step():
            rec = out[ev.key]
            if ev.error is not None:
                raise ev.error
            rec["tokens"] += ev.tokens
            rec["events"] += 1
            now = ev.at - t0
            if rec["first_s"] is None and ev.tokens:
                rec["first_s"] = now
            if ev.finished:
                rec["end_s"] = now
            elif rec["events"] >= cancel_after.get(ev.key, float("inf")):
                batch.remove(ev.key)
                rec["cancelled"], rec["end_s"] = True, now
    return out
