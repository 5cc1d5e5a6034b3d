"""Continuous batching: `ddtree serve --max-num-seqs N` (vLLM's spelling) runs up to N requests at once.

    scheduler = BatchScheduler(engine, max_queue, metrics, max_num_seqs=4); scheduler.start()
    scheduler.submit(job, ...)          # as Scheduler (server/scheduler.py): FIFO of --max-queue, 429 beyond it

The worker owns a runtime/batch.py BatchDecoder. Each round it first admits waiting jobs (FIFO) while the batch
has room, drops the jobs whose client is gone (cancelled), then runs one step of every sequence in the batch and
hands each its tokens (streaming stays per request: the job's asyncio queue, as Scheduler). A sequence leaves
the batch in the round of its last token; the next waiting job joins at the start of the next round. Every
request's tokens are those of the same request run alone (runtime/batch.py: each sequence is its own decode
loop), so a served answer never depends on its neighbours.

Gauges: num_requests_running = the sequences in the batch, num_requests_waiting = the queue. Retry-After
divides a request's mean engine time by N (N requests drain at once). The CPU executors only: a GPU executor
or rank processes with N > 1 are refused at startup, naming the flag (runtime/batch.py check_batchable).
"""
from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field

from ddtree.runtime.batch import BatchDecoder, check_batchable
from ddtree.server.errors import ApiError
from ddtree.server.logprobs import token_logprobs
from ddtree.server.scheduler import Job, Scheduler


@dataclass
class Running:
    """A job in the batch: when it joined, its last step's time, its logits rows (logprobs only)."""
    joined: float
    last: float
    rows: list = field(default_factory=list)
    steps: int = 0


class BatchScheduler(Scheduler):
    def __init__(self, engine, max_queue: int, metrics, max_num_seqs: int):
        check_batchable(engine, max_num_seqs)
        super().__init__(engine, max_queue, metrics)
        self.max_num_seqs = max_num_seqs
        self.batch: dict[Job, Running] = {}       # the worker's; read elsewhere only for its length

    def n_running(self) -> int:
        return len(self.batch)

    # --- the worker thread ----------------------------------------------------------------------
    def _worker(self) -> None:
        self.engine.bind_thread()
        decoder = BatchDecoder(self.engine, self.max_num_seqs)
        try:
            while True:
                with self.cond:
                    while not self.waiting and not self.batch and not self.draining:
                        self.cond.wait()
                    if not self.waiting and not self.batch:    # draining and nothing left
                        return
                    joining = []
                    while self.waiting and len(self.batch) + len(joining) < self.max_num_seqs:
                        joining.append(self.waiting.popleft())
                    self.metrics.queue_depth.set(len(self.waiting))
                for job in joining:
                    self._join(decoder, job)
                for job in [j for j in self.batch if j.cancelled.is_set()]:
                    self._leave(decoder, job)
                self.metrics.running.set(len(self.batch))
                if self.batch:
                    self._round(decoder)
                self.metrics.running.set(len(self.batch))
        except BaseException as e:                  # the thread itself is going: the engine is dead
            self.dead = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
            with self.cond:
                for failed in [*self.batch, *self.waiting]:
                    failed.push("error", ApiError(503, f"the engine is dead ({self.dead})", code="engine_dead"))
                self.waiting.clear()
                self.batch.clear()
                self.metrics.queue_depth.set(0)
                self.metrics.running.set(0)

    def _join(self, decoder: BatchDecoder, job: Job) -> None:
        if job.cancelled.is_set():
            return
        now = time.perf_counter()
        run = Running(now, now)
        try:
            decoder.add(job, job.ids, job.request, job.stats,
                        run.rows.append if job.top_logprobs is not None else None)
        except Exception as e:                      # refused by the engine: this request fails, the batch goes on
            job.push("error", e)
            return
        self.batch[job] = run

    def _leave(self, decoder: BatchDecoder, job: Job) -> None:
        decoder.remove(job)
        self.batch.pop(job, None)

    def _round(self, decoder: BatchDecoder) -> None:
        for ev in decoder.step():
            job, run = ev.key, self.batch[ev.key]
            if ev.error is not None:
                self.batch.pop(job)
                job.push("error", ev.error)
                continue
            if ev.tokens:
                now = ev.at                         # when its step ended (the round goes on with the others)
                if run.steps == 0:
                    self.metrics.ttft.observe(now - job.arrived)
                else:
                    ar = job.request.mode == "ar"
                    self.metrics.step(now - run.last, len(ev.tokens),
                                      None if ar else (job.stats.budgets or [None])[-1] or job.request.budget)
                run.last, run.steps = now, run.steps + 1
                self.metrics.generation_tokens.inc(len(ev.tokens))
                logprobs = token_logprobs(run.rows.pop(), ev.tokens, job.top_logprobs) if run.rows else None
                job.push("tokens", list(ev.tokens), logprobs)
            if ev.finished:
                self.batch.pop(job)
                took = time.perf_counter() - run.joined
                self.recent_s = 0.8 * self.recent_s + 0.2 * took / self.max_num_seqs
                self.metrics.request_seconds.observe(time.perf_counter() - job.arrived)
                job.push("done", job.stats.to_dict())
            elif job.cancelled.is_set():            # the client is gone or done (a stop string): leave now
                self._leave(decoder, job)
