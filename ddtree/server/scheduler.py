"""One engine, many clients: a bounded FIFO in front of one worker thread that owns the DDTreeEngine.

    scheduler = Scheduler(engine, max_queue, metrics); scheduler.start()
    job = Job(ids, request, loop)       # request: a GenerationRequest (runtime/request.py)
    scheduler.submit(job)               # ApiError 429 (Retry-After) when max_queue requests already wait
    event = await job.events.get()      # ("tokens", [ids], logprobs) per step, then ("done", stats) or ("error", exc)
    scheduler.cancel(job)               # a client gone: out of the queue now, or stopped at the next step
    scheduler.drain(timeout)            # refuse new jobs (503), finish the queued ones, stop the thread;
                                        # past the timeout, stop the running job and fail the queued ones

Generation runs off the event loop: the worker hands each step's tokens to the job's asyncio queue with
loop.call_soon_threadsafe. It checks `cancelled` between steps, so a disconnected client (or a stop
string matched by the HTTP side) frees the engine at the next step. A request that raises is answered
with its error and the worker goes on to the next one; only an exception that is not an Exception
(the thread itself dying) leaves the engine dead: /health then says 503 and every queued job is failed.
"""
from __future__ import annotations

import asyncio
import collections
import math
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from ddtree.runtime.loop import RunStats
from ddtree.runtime.request import GenerationRequest
from ddtree.server.errors import ApiError
from ddtree.server.logprobs import token_logprobs


@dataclass(eq=False)                            # a job is itself: compared and hashed by identity
class Job:
    ids: list[int]
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    stats: RunStats = field(default_factory=RunStats)
    arrived: float = field(default_factory=time.perf_counter)
    result: dict | None = None                  # the run's stats, once "done" arrived
    top_logprobs: int | None = None             # None: no logprobs; else the alternatives per token

    def push(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:                    # the event loop is closed: nobody is listening any more
            pass


class Scheduler:
    def __init__(self, engine, max_queue: int, metrics):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: Job | None = None
        self.cond = threading.Condition()
        self.draining = False
        self.dead: str | None = None            # why the worker thread died
        self.thread = threading.Thread(target=self._worker, name="ddtree-engine", daemon=True)
        self.recent_s = 1.0                     # moving mean of a request's engine time, for Retry-After

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.dead is None and self.thread.is_alive()

    def depth(self) -> int:
        return len(self.waiting)

    def n_running(self) -> int:
        """Requests the engine is generating now (0 or 1 here; up to --max-num-seqs in batch_scheduler.py)."""
        return int(self.running is not None)

    def submit(self, *jobs: Job) -> None:
        """Queue the jobs (the n choices of one request: all of them or none)."""
        with self.cond:
            if not self.alive:
                raise ApiError(503, f"the engine is dead ({self.dead or 'its worker is not running'})",
                               code="engine_dead")
            if self.draining:
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if len(jobs) > self.max_queue:
                raise ApiError(400, f"n: {len(jobs)} choices are more than the queue holds ({self.max_queue}, "
                               "--max-queue)", param="n")
            if len(self.waiting) + len(jobs) > self.max_queue:
                wait_s = max(1, math.ceil(self.recent_s * (len(self.waiting) + 1)))
                raise ApiError(429, f"the queue is full ({self.max_queue} requests waiting, --max-queue); "
                               f"retry in about {wait_s} s", code="queue_full",
                               headers={"Retry-After": str(wait_s)})
            self.waiting.extend(jobs)
            self.metrics.queue_depth.set(len(self.waiting))
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled.set()
        with self.cond:
            if job in self.waiting:
                self.waiting.remove(job)
                self.metrics.queue_depth.set(len(self.waiting))

    def drain(self, timeout: float | None = None) -> None:
        with self.cond:
            self.draining = True
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.thread.is_alive():              # past the timeout: stop the running job, fail the waiting ones
            with self.cond:
                for job in [self.running, *self.waiting]:
                    if job is not None:
                        job.cancelled.set()
                        job.push("error", ApiError(503, "the server is shutting down", code="shutting_down"))
                self.waiting.clear()
            self.thread.join(timeout)

    # --- the worker thread ----------------------------------------------------------------------
    def _worker(self) -> None:
        job = None
        try:
            self.engine.bind_thread()
            while True:
                with self.cond:
                    while not self.waiting and not self.draining:
                        self.cond.wait()
                    if not self.waiting:            # draining and nothing left
                        return
                    job = self.running = self.waiting.popleft()
                    self.metrics.queue_depth.set(len(self.waiting))
                self.metrics.running.set(1)
                self._run(job)
                job = self.running = None
                self.metrics.running.set(0)
        except BaseException as e:                  # the thread itself is going: the engine is dead
            self.dead = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
            with self.cond:
                for failed in [job, *self.waiting]:
                    if failed is not None:
                        failed.push("error", ApiError(503, f"the engine is dead ({self.dead})", code="engine_dead"))
                self.waiting.clear()
                self.running = None
                self.metrics.queue_depth.set(0)
                self.metrics.running.set(0)

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        t0 = last = time.perf_counter()
        steps = None
        rows = []                                   # the raw target logits of each chunk (logprobs only)
        try:
            steps = self.engine.stream_request(job.ids, job.request, job.stats,
                                               rows.append if job.top_logprobs is not None else None)
            for i, tokens in enumerate(steps):
                now = time.perf_counter()
                if i == 0:
                    self.metrics.ttft.observe(now - job.arrived)
                else:
                    ar = job.request.mode == "ar"
                    self.metrics.step(now - last, len(tokens), None if ar else (job.stats.budgets or [None])[-1]
                                      or job.request.budget)
                last = now
                self.metrics.generation_tokens.inc(len(tokens))
                logprobs = token_logprobs(rows.pop(), tokens, job.top_logprobs) if rows else None
                job.push("tokens", list(tokens), logprobs)
                if job.cancelled.is_set():          # checked between steps: the client is gone or done
                    break
        except Exception as e:                      # this request failed; the server goes on
            job.push("error", e)
            return
        finally:
            if steps is not None and hasattr(steps, "close"):
                steps.close()
        took = time.perf_counter() - t0
        self.recent_s = 0.8 * self.recent_s + 0.2 * took
        self.metrics.request_seconds.observe(time.perf_counter() - job.arrived)
        job.push("done", job.stats.to_dict())
