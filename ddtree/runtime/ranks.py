"""One process per rank (docs/interfaces.md section 9): rank 0 here, ranks 1..N-1 spawned.

    procs = RankProcesses(engine_dir)           # spawns the workers; each loads only its own rank's weights
    for chunk in procs.steps(Request(...)): ... # rank 0 drives; workers follow step by step
    procs.close()                               # or DDTreeEngine.close(); also at interpreter exit

The step is rank-symmetric: every rank runs the same decode loop (runtime/loop.py) over its own executor
(rank_executor: EngineExecutor(rank=r) on CPU, CudaExecutor(rank=r) on its GPU, or its own graphs / TensorRT-RTX
plans) and the shared-memory group (parallel/shm_group.py). The logits slices are all-gathered,
so every rank samples, builds the tree and walks it from the same bits and reaches the same decisions;
rank 0 alone owns the tokenizer and hands tokens to the caller. A worker needs the Request once (prompt ids,
mode, lengths, sampling) and then one ControlRecord per step from rank 0 over its pipe: step index, start
position, budget, sampling parameters and seed, stop flag, and a digest of every token committed so far. A
worker checks the record against its own state, its own committed tokens included (a rank that diverged is an
error, not a silent wrong token) and runs the step, or stops the request.

Failure, bounded: a collective's wait ends on a peer's error flag, a missing heartbeat, a dead process
(rank 0 polls its workers' exit codes) or the group timeout, with an error naming the rank and what was
waited for (RankError subclasses). Rank 0 then kills every worker and unlinks the segment; a worker whose
parent is gone (polled every ORPHAN_POLL_S by a watchdog thread, and in every wait) unlinks the segment and
exits. After a failure the RankProcesses refuses further requests.

Workers are started with 'spawn' (no forked copy of rank 0's state or threads; no forkserver process
left behind) and as daemons, so multiprocessing also ends them when rank 0 exits normally.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ddtree.engine_dir import check_engine, tokenizer_dir
from ddtree.errors import InputError
from ddtree.parallel.shm_group import (
    GroupSpec,
    RankDiedError,
    RankError,
    RankFailedError,
    RankTimeoutError,
    SharedMemoryGroup,
    new_spec,
    unlink,
)
from ddtree.parallel.spawn_ranks import stdout_to_stderr
from ddtree.runtime.engine_executor import EngineExecutor
from ddtree.runtime.loop import RunStats, ar_steps, ddtree_steps
from ddtree.tree.sampling import SamplingParams

ORPHAN_POLL_S = 0.1
EXIT_ORPHANED = 70                    # a worker's exit code when rank 0 went away
POLITE_JOIN_S = 5.0                   # a worker's time to leave after "shutdown" before it is killed


@dataclass(frozen=True)
class Request:
    """One generation, sent once to every worker."""
    mode: str                          # "ddtree" | "ar"
    prompt: tuple[int, ...]
    max_new_tokens: int
    params: SamplingParams
    budget: int                        # or a per-step chooser (runtime/auto_budget.py; tp 1 only)
    eos_ids: tuple[int, ...]
    block_size: int | None = None
    prune: object | None = None        # a runtime/pruning.py Pruner (--prune auto; tp 1 only)


@dataclass(frozen=True)
class ControlRecord:
    """What rank 0 sends every worker before each step (docs/interfaces.md section 9). start: the position
    of the first token the step feeds (0 for the prefill, then the bonus token's position)."""
    step: int
    start: int
    budget: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: bool = False
    digest: int = 0                    # crc32 of every token committed so far: the ranks' tokens, not only counts

    @classmethod
    def of(cls, req: Request, step: int, committed: "Committed", stop: bool = False) -> "ControlRecord":
        """committed: what the request committed before this step, on the sending or checking rank."""
        p = req.params
        start = 0 if step == 0 else len(req.prompt) + committed.count - 1
        budget = req.budget if isinstance(req.budget, int) else -1          # -1: chosen per step (tp 1 only)
        return cls(step, start, budget, p.temperature, p.top_k, p.top_p, p.seed, stop, committed.digest)


@dataclass(frozen=True)
class Committed:
    """The tokens a request committed so far, as a control record carries them: their count and a running crc32
    (the crc32 of all of them, extended by each step's chunk: no list kept, no rehash)."""
    count: int = 0
    digest: int = 0

    def plus(self, chunk) -> "Committed":
        return Committed(self.count + len(chunk), zlib.crc32(np.asarray(chunk, np.int64).tobytes(), self.digest))


def decode_steps(ex, req: Request, stats: RunStats | None = None) -> Iterator[list[int]]:
    """The loop every rank runs for `req` (runtime/loop.py), over that rank's executor."""
    if req.mode == "ar":
        return ar_steps(ex, list(req.prompt), req.max_new_tokens, req.params, req.eos_ids, stats)
    return ddtree_steps(ex, list(req.prompt), req.max_new_tokens, req.params, req.budget, req.eos_ids,
                        req.block_size, stats, req.prune)


# ----------------------------------------------------------------------------------------------
# rank 0

def rank_executor(engine_dir, rank: int, group: SharedMemoryGroup, checked, dtype, cuda: dict | None,
                  graphs: dict | None = None):
    """Rank `rank`'s executor: EngineExecutor (float64 numpy, the CPU ranks); with `cuda` ({"gpus": one GPU index
    per rank, "max_context", "kernel_plan"}) a CudaExecutor on its GPU with the one-shot all-reduce
    (runtime/cuda_ranks.py); with `graphs` ({"act": None for the engine's graphs/, or a dtype to export them at})
    the engine's own graphs of this rank under onnx.reference, their AllReduce nodes meeting in the group
    (runtime/graph_executor.py), or ({"gpus": one GPU index per rank}) its TensorRT-RTX plans on its GPU
    (runtime/trt_executor.py PlanRanks). Every rank builds its own at the same time (they meet in the group)."""
    if graphs is not None:
        from ddtree.runtime.graph_executor import GraphExecutor  # ml_dtypes, onnx, onnx_graphsurgeon: the graphs extra
        if "gpus" in graphs:                       # the graphs as TensorRT-RTX plans (--device tensorrt)
            from ddtree.runtime.trt_executor import PlanRanks  # ml_dtypes, onnx, onnx_graphsurgeon: the graphs extra
            ranks = PlanRanks(engine_dir, graphs["gpus"][rank], rank=rank, group=group, checked=checked)
            return GraphExecutor(ranks, "tensorrt", group, tokenizer_dir(engine_dir))
        from ddtree.runtime.graph_ranks import GraphRanks  # ml_dtypes, onnx, onnx_graphsurgeon: the graphs extra
        ranks = GraphRanks.from_engine(engine_dir, graphs.get("act"), rank=rank, group=group, checked=checked)
        return GraphExecutor(ranks, host_group=group, tokenizer_dir=tokenizer_dir(engine_dir))
    if cuda is None:
        return EngineExecutor(engine_dir, np.dtype(dtype), rank=rank, collective=group, checked=checked)
    from ddtree.runtime.cuda_ranks import cuda_rank_executor  # heavy: the GPU executor, for --device cuda only
    return cuda_rank_executor(engine_dir, rank, group, checked, **cuda)


class RankProcesses:
    def __init__(self, engine_dir, verify: bool = True, dtype=np.float64, timeout_s: float = 60.0,
                 heartbeat_s: float = 5.0, load_timeout_s: float = 600.0, cuda: dict | None = None,
                 graphs: dict | None = None):
        """timeout_s: the longest wait for a live peer in a collective; heartbeat_s: a peer silent this long
        is frozen or dead; load_timeout_s: a worker's time to load and hash its weights. cuda: the ranks run on
        GPUs; graphs: the ranks run the engine's graphs (rank_executor)."""
        checked = check_engine(engine_dir, verify)             # once, here; each rank hashes its own weights
        self.tp = int(checked[0]["tp"])
        self.spec: GroupSpec = new_spec(self.tp, timeout_s=timeout_s, heartbeat_s=heartbeat_s)
        self.procs: dict[int, mp.Process] = {}
        self.conns: dict = {}
        self.broken: str | None = None
        self._active = None
        self.group = SharedMemoryGroup(self.spec, 0, create=True, exit_code=self._exit_code)
        self._finalizer = weakref.finalize(self, _shutdown, self.group, self.procs, self.conns, True)
        try:
            ctx = mp.get_context("spawn")
            for r in range(1, self.tp):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_worker, name=f"ddtree rank {r}", daemon=True,
                                args=(str(engine_dir), r, self.spec, checked, np.dtype(dtype).str, theirs, os.getpid(),
                                      cuda, graphs))
                p.start()
                theirs.close()
                self.procs[r], self.conns[r] = p, mine
            self.executor = rank_executor(engine_dir, 0, self.group, checked, dtype, cuda, graphs)
            for r in self.procs:
                self._ready(r, load_timeout_s)
        except BaseException:
            self.close(kill=True)
            raise

    @property
    def pids(self) -> dict[int, int]:
        """rank -> pid of every worker."""
        return {r: p.pid for r, p in self.procs.items()}

    def _exit_code(self, r: int):
        p = self.procs.get(r)
        return None if p is None else p.exitcode

    def _died(self, r: int, doing: str) -> RankDiedError:
        self.procs[r].join(1.0)
        code = self.procs[r].exitcode
        how = "still running" if code is None else (
            f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}")
        return RankDiedError(f"rank {r} (pid {self.procs[r].pid}) died ({how}) {doing}")

    def _ready(self, r: int, timeout_s: float) -> None:
        conn, deadline = self.conns[r], time.monotonic() + timeout_s
        while not conn.poll(0.05):
            if self.procs[r].exitcode is not None:
                raise self._died(r, "while it loaded its weights")
            if time.monotonic() > deadline:
                raise RankTimeoutError(f"rank {r} did not load its weights within {timeout_s:g} s")
        try:
            kind, value = conn.recv()
        except EOFError:
            raise self._died(r, "while it loaded its weights") from None
        if kind == "error":
            raise value                                   # the worker's own error (a damaged rank file, named)

    def _send(self, r: int, msg) -> None:
        try:
            self.conns[r].send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise self._died(r, "before rank 0 could send it the next control record") from None

    def steps(self, req: Request, stats: RunStats | None = None) -> Iterator[list[int]]:
        """Run `req` on every rank; yields the tokens each step commits (rank 0's loop)."""
        if self.broken is not None:
            raise RankError(f"the rank processes stopped after an error and take no more requests: {self.broken}")
        if self._active is not None:                      # a request left unfinished: stop it on every rank
            self._active.close()
        gen = self._drive(req, stats)
        self._active = gen
        return gen

    def _drive(self, req: Request, stats) -> Iterator[list[int]]:
        loop, step, committed, before = decode_steps(self.executor, req, stats), 0, Committed(), self.group.count
        try:
            for r in self.conns:
                self._send(r, req)
            while True:
                for r in self.conns:
                    self._send(r, ControlRecord.of(req, step, committed))
                try:
                    chunk = next(loop)
                except StopIteration:
                    return
                step, committed = step + 1, committed.plus(chunk)
                yield chunk
        except GeneratorExit:                             # the caller stopped early: the workers stop too
            loop.close()
            for r in self.conns:
                self._send(r, ControlRecord.of(req, step, committed, stop=True))
            raise
        except InputError:
            if self.group.count == before:                # refused before any collective: every rank refused
                raise
            self._fail()
            raise
        except BaseException as e:
            self._fail(f"{type(e).__name__}: {e}")
            raise
        finally:
            self._active = None

    def _fail(self, why: str = "rank 0 failed") -> None:
        self.broken = why
        self.group.fail(f"rank 0: {why}")
        self.close(kill=True)

    def close(self, kill: bool = False) -> None:
        """Stop every worker (politely unless kill), then unlink the segment. Idempotent."""
        self._finalizer.detach()
        _shutdown(self.group, self.procs, self.conns, kill)


def _shutdown(group: SharedMemoryGroup, procs: dict, conns: dict, kill: bool) -> None:
    if not kill:
        for conn in conns.values():
            try:
                conn.send("shutdown")
            except OSError:
                pass
        deadline = time.monotonic() + POLITE_JOIN_S
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs.values():
        if p.exitcode is None:
            p.kill()                                      # SIGKILL also ends a stopped (SIGSTOP) worker
        p.join()
    for conn in conns.values():
        conn.close()
    procs.clear()
    conns.clear()
    group.close()


# ----------------------------------------------------------------------------------------------
# ranks 1..N-1

def _worker(engine_dir: str, rank: int, spec: GroupSpec, checked, dtype: str, conn, parent_pid: int,
            cuda: dict | None = None, graphs: dict | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is rank 0's to handle; it stops the workers
    stdout_to_stderr()                                    # rank 0's stdout is the command's (`ddtree run --json`)
    threading.Thread(target=_watch_parent, args=(parent_pid, spec.name), daemon=True).start()
    group, code = None, 0
    try:
        group = SharedMemoryGroup(spec, rank, parent_pid=parent_pid)
        ex = rank_executor(engine_dir, rank, group, checked, dtype, cuda, graphs)
        conn.send(("ready", rank))
        while (req := _receive(conn, parent_pid)) is not None and req != "shutdown":
            _follow(ex, group, conn, req, parent_pid, rank)
    except BaseException as e:
        code = 1
        if group is not None:
            group.fail(f"rank {rank}: {type(e).__name__}: {e}")
        _report(conn, rank, e)
    finally:
        if group is not None:
            group.close()
    os._exit(code)                # no interpreter teardown: nothing of rank 0's is this process's to clean


def _follow(ex, group: SharedMemoryGroup, conn, req: Request, parent_pid: int, rank: int) -> None:
    """Run `req` step by step as rank 0's control records say."""
    loop, committed, before = decode_steps(ex, req), Committed(), group.count
    for step in range(1 << 62):
        record = _receive(conn, parent_pid)
        if record is None or record == "shutdown":
            raise RankError(f"rank {rank}: rank 0 went away in the middle of a request (step {step})")
        if record.stop:
            loop.close()
            return
        want = ControlRecord.of(req, step, committed)
        if record != want:
            raise RankFailedError(f"rank {rank} diverged: rank 0 sent {record}, this rank is at {want}")
        try:
            chunk = next(loop)
        except StopIteration:
            return
        except InputError:
            if group.count == before:                     # rank 0 refuses the same request the same way
                return
            raise
        committed = committed.plus(chunk)


def _receive(conn, parent_pid: int):
    """The next message from rank 0, or None when rank 0 is gone (its end closed, or this process orphaned)."""
    while not conn.poll(ORPHAN_POLL_S):
        if os.getppid() != parent_pid:
            return None
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _report(conn, rank: int, e: BaseException) -> None:
    for err in (e, RankFailedError(f"rank {rank}: {type(e).__name__}: {e}")):
        try:
            conn.send(("error", err))
            return
        except Exception:                 # not picklable, or rank 0 is gone: the fallback, then nothing
            continue


def _watch_parent(parent_pid: int, segment: str) -> None:
    """A worker whose rank 0 is gone (killed, even with SIGKILL) unlinks the segment and exits."""
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_POLL_S)
    unlink(segment)
    os._exit(EXIT_ORPHANED)
