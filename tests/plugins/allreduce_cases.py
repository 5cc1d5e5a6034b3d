"""Rank-process bodies of the 2-GPU collective tests (test_allreduce_gpu.py): importable by the spawned
ranks as tests.plugins.allreduce_cases. Inputs are rebuilt from seeds, so the test can recompute every
rank's part and the expected sums on the host."""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from ddtree.model.bf16 import f32_to_bf16

HIDDEN = 7168


def part(rank: int, M: int, rep: int) -> np.ndarray:
    """Rank `rank`'s bf16 part (uint16 bits) of replay `rep` at M rows: mixed magnitudes, so that the order
    and the single rounding of the sum show in the bits."""
    rng = np.random.default_rng([rank, M, rep])
    x = rng.standard_normal(M * HIDDEN).astype(np.float32) * np.exp2(rng.integers(-6, 7, M * HIDDEN)).astype(np.float32)
    return f32_to_bf16(x)


def one_shot_rank(link, gpu_id: int, ms: list[int], replays: int) -> dict:
    """Per M: a graph of one out-of-place all-reduce replayed `replays` times with new inputs, then one
    eager in-place call (input rep = replays). Returns the outputs, the device counter and the error bits."""
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import Gpu
    gpu = Gpu(gpu_id)
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, max(ms) * HIDDEN)
    ar.connect(link.all_exchange(ar.ipc_handle()))
    x, out = gpu.alloc(max(ms) * HIDDEN, np.uint16), gpu.alloc(max(ms) * HIDDEN, np.uint16)
    got, calls = {}, 0
    for M in ms:
        elems = M * HIDDEN
        graph = gpu.capture(lambda s: ar(x, out, elems, stream=s))
        outs = []
        for rep in range(replays):
            gpu.copy_in(x, part(link.rank, M, rep))
            gpu.replay(graph)
            outs.append(gpu.download(out.view(0, (elems,))))
            calls += 1
        gpu.copy_in(x, part(link.rank, M, replays))
        ar(x, x, elems)                                   # eager, in place
        outs.append(gpu.download(x.view(0, (elems,))))
        calls += 1
        got[M] = outs
    result = {"outs": got, "sequence": ar.sequence(), "calls": calls, "errors": ar.error_ranks()}
    link.all_exchange("done")                              # no rank unmaps before the other finished
    ar.close()
    return result


def nccl_rank(link, gpu_id: int, M: int, replays: int) -> dict:
    """NCCL all-reduce (in a graph replayed with new inputs) and all-gather of bf16 parts."""
    from ddtree.ops.nccl_group import NcclGroup, new_unique_id
    from ddtree.plugins.device import Gpu
    gpu = Gpu(gpu_id)
    uid = link.all_exchange(new_unique_id() if link.rank == 0 else None)[0]
    group = NcclGroup(gpu, uid, link.rank, link.nranks)
    elems = M * HIDDEN
    x, out = gpu.alloc(elems, np.uint16), gpu.alloc(elems, np.uint16)
    gathered = gpu.alloc((link.nranks, elems), np.uint16)
    graph = gpu.capture(lambda s: group.all_reduce(x, out, elems, stream=s))
    sums = []
    for rep in range(replays):
        gpu.copy_in(x, part(link.rank, M, rep))
        gpu.replay(graph)
        sums.append(gpu.download(out))
    group.all_gather(x, gathered, elems)
    result = {"sums": sums, "gathered": gpu.download(gathered), "async_error": group.async_error()}
    group.close()
    return result


def killed_peer_rank(link, gpu_id: int, max_spins: int) -> dict:
    """Rank 1 is killed (SIGKILL) after connecting; rank 0 then runs two all-reduces: the first must end
    with rank 1's error bit after at most max_spins polls, the second skip the wait (the bit is sticky)."""
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import Gpu
    gpu = Gpu(gpu_id)
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, 17 * HIDDEN, max_spins=max_spins)
    ar.connect(link.all_exchange(ar.ipc_handle()))
    x = gpu.zeros(17 * HIDDEN, np.uint16)
    gpu.sync()
    link.all_exchange("connected")
    if link.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    link.all_exchange("after the kill")                   # completes once rank 1 is gone
    times = []
    for _ in range(2):
        t0 = time.monotonic()
        ar(x, x, 17 * HIDDEN)
        gpu.sync()
        times.append(time.monotonic() - t0)
    return {"seconds": times, "errors": ar.error_ranks(), "sequence": ar.sequence()}


def plugin_all_reduce_rank(link, gpu_id: int, M: int, replays: int) -> dict:
    """The AllReduce plugin's runner of this rank (ops/tensorrt/kernels.py) over a registered one-shot
    all-reduce: prepared, its enqueue captured once in global mode on a raw stream, the graph replayed with this
    rank's part of each replay written in place. Returns the outputs."""
    from cuda.bindings import driver

    from ddtree.ops.nodes import NODES
    from ddtree.ops.tensorrt.kernels import RankCollective, node_runner, register_rank_collective
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import Gpu, check
    gpu = Gpu(gpu_id)
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, M * HIDDEN)
    ar.connect(link.all_exchange(ar.ipc_handle()))
    register_rank_collective(gpu_id, RankCollective(one_shot=ar))
    runner = node_runner(NODES["AllReduce"], {"rank": link.rank, "world_size": link.nranks}, device=gpu_id)
    dims, types = [(M, HIDDEN)], ["bfloat16"]
    runner.prepare(dims, types, dims, types)
    x, out = gpu.alloc(M * HIDDEN, np.uint16), gpu.alloc(M * HIDDEN, np.uint16)
    stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
    check(driver.cuStreamBeginCapture(stream, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL), "capture")
    try:
        runner.enqueue(dims, types, [x.ptr], dims, [out.ptr], int(stream))
    finally:
        graph = check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
    exe = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    outs = []
    for rep in range(replays):
        gpu.copy_in(x, part(link.rank, M, rep))
        check(driver.cuGraphLaunch(exe, stream), "cuGraphLaunch")
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        outs.append(gpu.download(out))
    result = {"outs": outs, "errors": ar.error_ranks(), "sequence": ar.sequence()}
    link.all_exchange("done")
    ar.close()
    return result
