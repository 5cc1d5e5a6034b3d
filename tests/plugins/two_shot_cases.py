"""Rank-process bodies of the two-shot GPU tests (test_allreduce_two_shot_gpu.py): importable by the spawned ranks as
tests.plugins.two_shot_cases. Inputs are rebuilt from seeds, so the test recomputes every rank's part and the
expected sums on the host."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from ddtree.model.bf16 import f32_to_bf16


def rank_part(rank: int, elems: int, rep: int) -> np.ndarray:
    """Rank `rank`'s bf16 part (uint16 bits) of replay `rep`: mixed magnitudes, so that the order and the single
    rounding of the sum show in the bits."""
    rng = np.random.default_rng([rank, elems, rep, 49])
    x = rng.standard_normal(elems).astype(np.float32) * np.exp2(rng.integers(-6, 7, elems)).astype(np.float32)
    return f32_to_bf16(x)


def two_shot_rank(link, gpu_id: int, sizes: list[int], replays: int) -> dict:
    """Per size (bf16 elements): a graph of four all-reduces of this rank's x on one exchange buffer, the protocol
    changing per call (push into `push`, pull into `pull`, two-shot into `two`, and two-shot in place on a copy of x),
    replayed `replays` times with new inputs. Returns the outputs, the device counter and the error bits."""
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import Gpu
    gpu = Gpu(gpu_id)
    top = max(sizes)
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, top)
    ar.connect(link.all_exchange(ar.ipc_handle()))
    x = gpu.alloc(top, np.uint16)
    outs = {name: gpu.alloc(top, np.uint16) for name in ("push", "pull", "two", "in_place")}
    got = {}
    for elems in sizes:
        def record(s):
            ar(x, outs["push"], elems, stream=s)
            ar(x, outs["pull"], elems, stream=s, protocol="pull")
            ar(x, outs["two"], elems, stream=s, protocol="two-shot")
            gpu.copy_d2d(outs["in_place"].ptr, x.ptr, 2 * elems, stream=s)
            ar(outs["in_place"], outs["in_place"], elems, stream=s, protocol="two-shot")
        graph = gpu.capture(record)
        runs = []
        for rep in range(replays):
            gpu.copy_in(x, rank_part(link.rank, elems, rep))
            gpu.replay(graph)
            runs.append({name: gpu.download(a.view(0, (elems,))) for name, a in outs.items()})
        got[elems] = runs
    result = {"outs": got, "sequence": ar.sequence(), "errors": ar.error_ranks()}
    link.all_exchange("done")                              # no rank unmaps before the others finished
    ar.close()
    return result


def killed_peer_two_shot_rank(link, gpu_id: int, max_spins: int) -> dict:
    """The last rank is killed (SIGKILL) after connecting; the others then run two two-shot all-reduces: the first
    must end with the dead rank's error bit after at most two bounds (one per flag round), the second skip the
    waits (the bit is sticky)."""
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import Gpu
    gpu = Gpu(gpu_id)
    elems = 9 * 7168
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, elems, max_spins=max_spins, protocol="two-shot")
    ar.connect(link.all_exchange(ar.ipc_handle()))
    x = gpu.zeros(elems, np.uint16)
    gpu.sync()
    link.all_exchange("connected")
    if link.rank == link.nranks - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    link.all_exchange("after the kill")                   # completes once the last rank is gone
    times = []
    for _ in range(2):
        t0 = time.monotonic()
        ar(x, x, elems)
        gpu.sync()
        times.append(time.monotonic() - t0)
    return {"seconds": times, "errors": ar.error_ranks(), "sequence": ar.sequence()}
