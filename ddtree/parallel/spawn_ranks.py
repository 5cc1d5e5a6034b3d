"""One process per GPU rank, started here, with the parent relaying what the ranks exchange (the GPU
collectives' handles and NCCL id, host barriers); for the all-reduce bench and its tests.

    rows = run_ranks(worker, gpus=[0, 1], args=(...,))      # worker(link, gpu_id, *args) in every rank
    # in a rank:  handles = link.all_exchange(my_bytes)      # every rank's value in rank order (a barrier)

Processes are spawned (a fresh interpreter: CUDA is never forked). Every wait has a timeout; a rank that
raises, exits or stays silent past timeout_s stops the others (killed) and raises RankProcessError naming
it. `may_exit`: ranks allowed to die (a test's killed peer): an exchange then completes without them (None).
A rank still running at the timeout is first asked (SIGUSR1, faulthandler) to print its Python stacks on
stderr, so a hang shows where it waits. A rank writes nothing to the command's stdout (the parent's: its JSON):
its file descriptor 1 is its stderr.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait


def stdout_to_stderr() -> None:
    """In a rank process: its file descriptor 1 becomes its stderr. The command's stdout is the parent's (`--json`
    output); a rank's writes to fd 1, NCCL's NCCL_DEBUG lines (stdout unless NCCL_DEBUG_FILE) among them, would land
    in it, and C stdio buffers them there, so a killed rank lost its last lines (NCCL_DEBUG_FILE, which NCCL writes
    unbuffered, keeps them)."""
    sys.stdout.flush()
    os.dup2(2, 1)


class RankProcessError(RuntimeError):
    """A rank process failed, died or timed out; the message names it."""


class Link:
    """A rank's end of its pipe to the parent."""

    def __init__(self, conn, rank: int, nranks: int):
        self.conn, self.rank, self.nranks = conn, rank, nranks

    def all_exchange(self, value) -> list:
        """Every rank's value (picklable), in rank order; returns once every live rank has sent its own."""
        self.conn.send(("x", value))
        return self.conn.recv()


def _rank_main(fn, rank: int, nranks: int, gpu_id: int, conn, args: tuple) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # never NVLink multicast
    stdout_to_stderr()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        conn.send(("done", fn(Link(conn, rank, nranks), gpu_id, *args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_ranks(fn, gpus: list[int], args: tuple = (), timeout_s: float = 180.0, may_exit=()) -> list:
    """Run fn(link, gpus[rank], *args) in len(gpus) processes; their return values in rank order."""
    ctx = mp.get_context("spawn")
    n = len(gpus)
    conns, procs = [], []
    for rank, gpu_id in enumerate(gpus):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank_main, args=(fn, rank, n, gpu_id, child, args), name=f"rank {rank}", daemon=True)
        p.start()
        child.close()
        conns.append(parent)
        procs.append(p)
    results, finished, gone, pending = [None] * n, set(), set(), {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(finished | gone) < n:
            live = [conns[r] for r in range(n) if r not in finished | gone]
            ready = wait(live, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [r for r in range(n) if r not in finished | gone]
                for r in late:
                    os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(1.0)
                raise RankProcessError(f"rank(s) {late} did not finish within {timeout_s} s")
            for conn in ready:
                rank = conns.index(conn)
                try:
                    kind, value = conn.recv()
                except EOFError:
                    procs[rank].join(5)
                    if rank not in may_exit:
                        raise RankProcessError(f"rank {rank} (GPU {gpus[rank]}) exited "
                                               f"(code {procs[rank].exitcode}) without a result") from None
                    gone.add(rank)
                    continue
                if kind == "error":
                    raise RankProcessError(f"rank {rank} (GPU {gpus[rank]}) failed:\n{value}")
                if kind == "done":
                    results[rank] = value
                    finished.add(rank)
                else:
                    pending[rank] = value
            waiting = [r for r in range(n) if r not in gone]
            if pending and all(r in pending for r in waiting if r not in finished):
                values = [pending.get(r) for r in range(n)]
                for r in pending:
                    conns[r].send(values)
                pending = {}
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
