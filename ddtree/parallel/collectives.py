"""Implementations of the collective ops (docs/interfaces.md section 9) for the CPU backends.

    Identity      tp 1: the sum of one partial is itself, the gather of one part a leading axis of 1
    RankGroup     ranks as threads of one process: each rank deposits its part, waits for all, and
                  sums them in rank order 0..tp-1 (what the one-shot all-reduce computes on every rank)
                  or stacks them in rank order, so every rank receives identical bits
    SharedMemoryGroup  ranks as processes on one host (parallel/shm_group.py): the one-shot protocol over
                  shared memory, with heartbeats and a timeout on every wait
One-shot peer-to-peer over PCIe and NCCL come with the GPU ranks. A rank that fails aborts the group,
which releases the others (BrokenBarrierError for threads, a named RankError for processes).
Every implementation takes `what` (the op's tag and layer) so a failed wait can say what it waited for.
"""
from __future__ import annotations

import threading

import numpy as np


def rank_order_sum(partials: list[np.ndarray]) -> np.ndarray:
    """The sum of the ranks' partials in rank order (every rank computes exactly this)."""
    out = np.array(partials[0], copy=True)
    for p in partials[1:]:
        out += p
    return out


class Identity:
    size = 1

    def all_reduce(self, rank: int, x: np.ndarray, what: str = "") -> np.ndarray:
        return np.array(x, copy=True)

    def all_gather(self, rank: int, x: np.ndarray, what: str = "") -> np.ndarray:
        return np.array(x, copy=True)[None]

    def abort(self) -> None:
        pass


class RankGroup:
    def __init__(self, size: int, timeout_s: float = 300.0):
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout_s)

    def _exchange(self, rank: int, x: np.ndarray, combine) -> np.ndarray:
        self.slots[rank] = x
        self.barrier.wait()
        out = combine(self.slots)
        self.barrier.wait()                      # nobody reuses its slot before every rank has read them all
        return out

    def all_reduce(self, rank: int, x: np.ndarray, what: str = "") -> np.ndarray:
        return self._exchange(rank, x, rank_order_sum)

    def all_gather(self, rank: int, x: np.ndarray, what: str = "") -> np.ndarray:
        return self._exchange(rank, x, np.stack)

    def abort(self) -> None:
        self.barrier.abort()

    def reset(self) -> None:
        self.barrier.reset()


def collective_for(tp: int):
    return Identity() if tp == 1 else RankGroup(tp)
