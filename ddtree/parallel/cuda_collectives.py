"""GPU collectives for tp ranks that are threads of one process on one GPU (docs/interfaces.md section 9), and the
op set's collective ops of the cuda backend (CollectiveOps, mixed into CudaOps).

    group = ThreadRankGroup(tp)
    ex_r = CudaExecutor.of_weights(cfg, dcfg, plan, tensors_r, rank=r, collective=group.member(r))   # per thread

Each rank has its own Gpu (its own stream) and runs its layer functions in its own thread; the ranks meet in
every all-reduce: a rank finishes its stream (its partial is written), deposits the partial's address and
meets the others (a barrier); each then sums every rank's partial in rank order 0..tp-1 in float32 with one
rounding to bf16 (kernels/allreduce.cu allreduce_sum_local: the bits the one-shot all-reduce gives, so every
rank holds the same), finishes, and meets them again, so no partial is overwritten before every rank has read
it. All-gather: each rank copies every rank's part into its [tp, ...] output in rank order. This is how a test
runs every rank slice of a tp N model on one device (the collectives summed there); rank processes on their
own GPUs use the one-shot all-reduce (plugins/allreduce.py). Eager only: host syncs and barriers cannot be
captured in a graph. A rank that fails aborts the barrier, which releases the others (BrokenBarrierError).

Rank processes (on their own GPUs or sharing one): ProcessRankMember(one_shot, nccl) over the rank's connected
OneShotAllReduce and/or NCCL communicator (--allreduce: parallel/rank_collective.py), whose all-reduce and all-gather
only launch on the op set's stream, so a captured step graph holds them (`capturable`); every rank must run the
same sequence of collectives (one device counter).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from ddtree.parallel.collectives import RankGroup
from ddtree.parallel.rank_collective import RankCollective
from ddtree.plugins.allreduce import SOURCE, THREADS, VECTOR


class CollectiveOps:
    """The op set's collectives for CudaOps (backends/cuda_backend.py): identity at tp 1; at tp > 1 through the rank's
    `collective` (a ThreadRankMember or ProcessRankMember, launched on self.stream; captured only where the
    collective is `capturable`; ddtree bench step's stand-ins: bench/bench_ops.py), else an error naming what is
    missing."""

    def _single_rank(self, what: str) -> None:
        if self.lay.tp != 1 and self.collective is None:
            raise NotImplementedError(f"cuda backend: {what} at tp {self.lay.tp} needs a collective: "
                                      "CudaOps(collective=...) (parallel/cuda_collectives.py: ranks as threads of one "
                                      "process; ProcessRankMember: rank processes) or stand-ins (bench step)")

    def all_reduce(self, x, tag):
        self._single_rank(f"all_reduce ({tag})")
        return self._reduced(x)

    def all_gather(self, x, tag):
        self._single_rank(f"all_gather ({tag})")
        tp = self.lay.tp
        if tp > 1:                                             # [tp, ...]: every rank's x in rank order
            out = self.new((tp, *x.shape), x.dtype)
            self._collective().all_gather(self.gpu, x, out, stream=self.stream)
            return out
        return replace(x, shape=(1, *x.shape), strides=(int(np.prod(x.shape)), *x.strides),
                       host=None if x.host is None else x.host[None])

    def _collective(self):
        if self.capturing and not getattr(self.collective, "capturable", False):
            raise RuntimeError(f"{self.where}: the in-process collective syncs and waits on the host; it cannot be "
                               "captured in a graph")
        return self.collective

    def _reduced(self, x):
        """x summed over the ranks: itself at tp 1; with a collective the rank-ordered sum of every rank's x (a new
        tensor)."""
        if self.lay.tp == 1:
            return x
        out = self.new(x.shape, x.dtype)
        self._collective().all_reduce(self.gpu, x, out, stream=self.stream)
        return out


class StandinGather:
    """A capturable stand-in all-gather of tp ranks: every slot of out [tp, ...] gets this rank's own x (the bytes
    land as a real all-gather's would; nothing crosses a link). ddtree bench step's stand-ins (bench/bench_ops.py)
    and the top-p-across-ranks tests and timings use it."""
    capturable = True

    def __init__(self, tp: int):
        self.tp = tp

    def all_gather(self, gpu, x, out, stream=None) -> None:
        nbytes = int(np.prod(x.shape)) * x.itemsize
        for r in range(self.tp):
            gpu.copy_d2d(out.ptr + r * nbytes, x.ptr, nbytes, stream=stream)


class ThreadRankGroup(RankGroup):
    """The CPU ranks' group (parallel/collectives.py: slots and a barrier, a rank's exchange with a combine), its
    members on the GPU."""

    def __init__(self, size: int, timeout_s: float = 300.0):
        if size < 2:
            raise ValueError(f"ThreadRankGroup: {size} rank(s); a group is 2 or more (tp 1 needs no collective)")
        super().__init__(size, timeout_s)

    def member(self, rank: int) -> "ThreadRankMember":
        return ThreadRankMember(self, rank)


class ThreadRankMember:
    """One rank's side, what CudaOps(collective=...) calls: all_reduce(gpu, x, out), all_gather(gpu, x, out) (x, out:
    Tensors on this rank's gpu; launched on its stream). Each finishes this rank's stream, then exchanges x's
    Tensor through the group (RankGroup._exchange), the combine launching on every rank's partials and finishing
    before the exchange's second barrier, so no partial is overwritten before every rank has read it."""

    def __init__(self, group: ThreadRankGroup, rank: int):
        self.group, self.rank = group, rank
        self.parts = None                  # device array of the tp partial addresses (made on first use)

    def _exchange(self, gpu, x, combine) -> None:
        if not x.contiguous:
            self.group.abort()
            raise ValueError(f"rank {self.rank}: a collective on a strided tensor {x.shape} {x.strides}")
        gpu.sync()                         # x written before any rank reads it

        def launched(parts):
            combine(parts)
            gpu.sync()
        self.group._exchange(self.rank, x, launched)

    def all_reduce(self, gpu, x, out, stream=None) -> None:
        """out = bf16(the float32 sum of every rank's x, in rank order); x, out bf16 of the same shape. stream:
        unused (eager: CollectiveOps passes None, its stream outside a capture)."""
        n = int(np.prod(x.shape))

        def summed(parts):
            if x.dtype != np.uint16 or out.dtype != np.uint16 or n % VECTOR or any(p.shape != x.shape for p in parts):
                self.group.abort()
                raise ValueError(f"rank {self.rank}: all-reduce of bf16 {x.shape} (a multiple of {VECTOR} elements, "
                                 f"the same shape on every rank), got {x.dtype} and shapes {[p.shape for p in parts]}")
            if self.parts is None:
                self.parts = gpu.alloc(self.group.size, np.uint64)
            gpu.copy_in(self.parts, np.array([p.ptr for p in parts], np.uint64))
            n8 = n // VECTOR
            gpu.launch(gpu.kernel(SOURCE, "allreduce_sum_local"), min(-(-n8 // THREADS), 4 * gpu.sm_count), THREADS,
                       0, np.uint64(self.parts.ptr), np.int32(self.group.size), np.uint64(out.ptr), np.uint32(n8))
        self._exchange(gpu, x, summed)

    def all_gather(self, gpu, x, out, stream=None) -> None:
        """out [tp, *x.shape] = every rank's x in rank order. stream: unused, as in all_reduce."""
        nbytes = int(np.prod(x.shape)) * x.itemsize

        def stacked(parts):
            for r, p in enumerate(parts):
                gpu.copy_d2d(out.ptr + r * nbytes, p.ptr, nbytes)
        self._exchange(gpu, x, stacked)


class ProcessRankMember:
    """A rank process's side, what CudaOps(collective=...) calls: the rank's connected one-shot all-reduce
    (plugins/allreduce.py OneShotAllReduce; the peers are other processes, on this GPU or others) and/or its NCCL
    communicator, chosen per message by parallel/rank_collective.py RankCollective (--allreduce; `models`: the choice
    by size, one-shot / two-shot / NCCL). Every collective only
    launch on `stream` (the op set's: a graph builder while capturing; None: gpu's own stream), no sync, no
    allocation."""
    capturable = True

    def __init__(self, one_shot=None, nccl=None, one_shot_max_bytes: int | None = None, models=None):
        self.collective = RankCollective(nccl=nccl, one_shot=one_shot, one_shot_max_bytes=one_shot_max_bytes,
                                         models=models)
        self.one_shot, self.rank, self.nranks = one_shot, self.collective.rank, self.collective.nranks

    def _check(self, what: str, x, out, out_shape) -> None:
        if not x.contiguous or not out.contiguous or out.shape != out_shape or out.dtype != x.dtype:
            raise ValueError(f"rank {self.rank}: {what} of {x.dtype} {x.shape} {x.strides} into "
                             f"{out.dtype} {out.shape} {out.strides}; needs dense tensors, out {out_shape} of x's "
                             "dtype")

    def all_reduce(self, gpu, x, out, stream=None) -> None:
        """out = bf16(the float32 sum of every rank's x: in rank order by the one-shot and the two-shot, NCCL's order by
        NCCL); x, out
        bf16 of the same shape."""
        self._check("all-reduce", x, out, x.shape)
        if x.dtype != np.uint16:
            raise ValueError(f"rank {self.rank}: all-reduce of {x.dtype}; the collectives sum bf16 (uint16 bits)")
        self.collective.all_reduce(x.ptr, out.ptr, int(np.prod(x.shape)), gpu.stream if stream is None else stream)

    def all_gather(self, gpu, x, out, stream=None) -> None:
        """out [tp, *x.shape] = every rank's x in rank order (any dtype)."""
        self._check("all-gather", x, out, (self.nranks, *x.shape))
        nbytes = int(np.prod(x.shape)) * x.itemsize
        self.collective.all_gather(x.ptr, out.ptr, nbytes, gpu.stream if stream is None else stream)

    def check(self) -> None:
        """After a sync: a one-shot peer that did not answer, or an NCCL error, raised with the rank named."""
        self.collective.check()


def run_ranks(executors: list, fn) -> list:
    """fn(ex) for every rank's executor, each in a thread of its own with its GPU current; results in rank order.
    A rank that raises aborts its group (the others' waits end) and its error is raised."""

    def body(ex):
        ex.gpu.dev.set_current()
        try:
            return fn(ex)
        except BaseException:
            member = ex.ops.collective
            if member is not None:
                member.group.abort()
            raise
    with ThreadPoolExecutor(len(executors)) as pool:
        futures = [pool.submit(body, ex) for ex in executors]
        return [f.result() for f in futures]
