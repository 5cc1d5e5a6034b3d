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


def one_shot_rank(link, gpu_id: int, ms: list[int], replays: int, protocol: str = "push") -> dict:
    """Per M: a graph of one out-of-place all-reduce replayed `replays` times with new inputs, then one
    eager in-place call (input rep = replays). Returns the outputs, the device counter and the error bits."""
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import Gpu
    gpu = Gpu(gpu_id)
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, max(ms) * HIDDEN, protocol=protocol)
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
    from ddtree.parallel.nccl_group import NcclGroup, new_unique_id
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
    """The AllReduce plugin's runner of this rank (backends/tensorrt/kernels.py) over a registered one-shot
    all-reduce: prepared, its enqueue captured once in global mode on a raw stream, the graph replayed with this
    rank's part of each replay written in place. Returns the outputs."""
    from cuda.bindings import driver

    from ddtree.backends.tensorrt.kernels import node_runner, register_rank_collective
    from ddtree.description.nodes import NODES
    from ddtree.parallel.rank_collective import RankCollective
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


# ---- the one-shot all-gather (issue 25): bodies of test_allgather_shared_gpu.py -------------------------------
# (dtype, shape) of the gathered parts: the DDTree step's candidates and winners, and sizes that move in 16-, 4-,
# 2- and 1-byte words (float32 [64, 256]: 64 KB, 16 blocks)
GATHER_CASES = (("float32", (8, 16)), ("int32", (17,)), ("bfloat16", (1001,)), ("uint8", (37,)),
                ("float32", (64, 256)))


def gather_nbytes(case: int) -> int:
    dtype, shape = GATHER_CASES[case]
    itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
    return int(np.prod(shape)) * itemsize


def gather_part(rank: int, case: int, rep: int) -> np.ndarray:
    """Rank `rank`'s part of GATHER_CASES[case] in replay `rep`, as its bytes: random, so every bit pattern of
    the dtype (NaNs included) must arrive as it was."""
    return np.random.default_rng([rank, case, rep, 25]).integers(0, 256, gather_nbytes(case), dtype=np.uint8)


def all_gather_rank(link, gpu_id: int, replays: int) -> dict:
    """A graph of an all-reduce of [1, HIDDEN], every GATHER_CASES all-gather, and an all-reduce of the first's
    sum in place (the counter shared by both kinds), replayed `replays` times with new inputs; odd ranks gather
    from x 4 bytes off 16-byte alignment (their word is smaller than even ranks'). Then one eager in-place
    all-gather of case 1 (x = out's part `rank`). Returns the outputs' bytes, the counter and the error bits."""
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import Gpu
    gpu = Gpu(gpu_id)
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, 17 * HIDDEN)
    ar.connect(link.all_exchange(ar.ipc_handle()))
    h, summed = gpu.alloc(HIDDEN, np.uint16), gpu.alloc(HIDDEN, np.uint16)
    skew = 4 * (link.rank % 2)
    xs = [gpu.alloc(gather_nbytes(c) + 16, np.uint8).view(skew, (gather_nbytes(c),)) for c in range(len(GATHER_CASES))]
    outs = [gpu.alloc(link.nranks * gather_nbytes(c), np.uint8) for c in range(len(GATHER_CASES))]

    def record(s):
        ar(h, summed, HIDDEN, stream=s)
        for c, (x, out) in enumerate(zip(xs, outs)):
            ar.all_gather(x.ptr, out.ptr, gather_nbytes(c), stream=s)
        ar(summed, summed, HIDDEN, stream=s)
    graph = gpu.capture(record)
    sums, gathered = [], []
    for rep in range(replays):
        gpu.copy_in(h, part(link.rank, 1, rep))
        for c, x in enumerate(xs):
            gpu.copy_in(x, gather_part(link.rank, c, rep))
        gpu.replay(graph)
        sums.append(gpu.download(summed))
        gathered.append([gpu.download(out) for out in outs])
    n1 = gather_nbytes(1)
    mine = outs[1].view(link.rank * n1, (n1,))
    gpu.copy_in(mine, gather_part(link.rank, 1, replays))
    ar.all_gather(mine.ptr, outs[1].ptr, n1)
    result = {"sums": sums, "gathered": gathered, "in_place": gpu.download(outs[1]), "sequence": ar.sequence(),
              "errors": ar.error_ranks()}
    link.all_exchange("done")
    ar.close()
    return result


def step_collectives(ops):
    """A layer function of the op set's collectives as the tp > 1 step uses them: the all-reduce of a hidden row,
    then the all-gathers of the draft candidates' values and ids ([D, k] float32 / int32)."""
    from ddtree.description.opset import ACT, F32, I32
    ops.output("summed", ops.all_reduce(ops.input("h", [1, HIDDEN], ACT), "h"), [1, HIDDEN], ACT)
    ops.output("values", ops.all_gather(ops.input("values", [7, 4], F32), "values"), [ops.lay.tp, 7, 4], F32)
    ops.output("ids", ops.all_gather(ops.input("ids", [7, 4], I32), "ids"), [ops.lay.tp, 7, 4], I32)


def cuda_ops_rank(link, gpu_id: int, replays: int) -> dict:
    """ProcessRankMember under CudaOps: step_collectives run eagerly (input rep 0: its buffers made), then captured
    as runtime/cuda_step.py captures a step (ops.stream a graph builder, ops.capturing) and replayed with inputs
    rep 1..replays. Returns each run's outputs, the counter and the error bits."""
    from ddtree.backends.cuda_backend import CudaOps
    from ddtree.description.opset import RankLayout
    from ddtree.parallel.cuda_collectives import ProcessRankMember
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import DeviceArray, Gpu
    gpu = Gpu(gpu_id)
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, HIDDEN)
    ar.connect(link.all_exchange(ar.ipc_handle()))
    ops = CudaOps(gpu, RankLayout(link.rank, link.nranks, 0, 1, 0, 1, 0, 1), store=None,
                  collective=ProcessRankMember(ar))
    feeds = {"h": gpu.alloc((1, HIDDEN), np.uint16), "values": gpu.alloc((7, 4), np.float32),
             "ids": gpu.alloc((7, 4), np.int32)}

    def fed(rep):
        gpu.copy_in(feeds["h"], part(link.rank, 1, rep))
        for name in ("values", "ids"):
            raw = DeviceArray(gpu, feeds[name].ptr, (112,), np.dtype(np.uint8))
            gpu.copy_in(raw, cuda_ops_part(link.rank, name, rep))

    def downloaded(outputs):
        return {name: DeviceArray(gpu, t.ptr, t.shape, t.dtype).numpy() for name, t in outputs.items()}
    fed(0)
    runs = [downloaded(ops.call(step_collectives, feeds=feeds))]

    captured = {}

    def record(stream):
        ops.stream, ops.capturing = stream, True
        captured.update(ops.call(step_collectives, feeds=feeds))
    try:
        graph = gpu.capture(record)
    finally:
        ops.stream, ops.capturing = None, False
    for rep in range(1, replays + 1):
        fed(rep)
        gpu.replay(graph)
        runs.append(downloaded(captured))
    result = {"runs": runs, "sequence": ar.sequence(), "errors": ar.error_ranks()}
    link.all_exchange("done")
    ar.close()
    return result


def cuda_ops_part(rank: int, name: str, rep: int) -> np.ndarray:
    """The bytes of rank `rank`'s [7, 4] float32 values / int32 ids in run `rep` of cuda_ops_rank."""
    return np.random.default_rng([rank, rep, ("values", "ids").index(name), 27]).integers(0, 256, 112, dtype=np.uint8)


def killed_peer_gather_rank(link, gpu_id: int, max_spins: int) -> dict:
    """killed_peer_rank with all-gathers: rank 1 is killed after connecting; rank 0's first all-gather must end
    with rank 1's error bit after at most max_spins polls, the second skip the wait."""
    from ddtree.plugins.allreduce import OneShotAllReduce
    from ddtree.plugins.device import Gpu
    gpu = Gpu(gpu_id)
    ar = OneShotAllReduce(gpu, link.rank, link.nranks, HIDDEN, max_spins=max_spins)
    ar.connect(link.all_exchange(ar.ipc_handle()))
    x, out = gpu.zeros(68, np.uint8), gpu.zeros(link.nranks * 68, np.uint8)
    gpu.sync()
    link.all_exchange("connected")
    if link.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    link.all_exchange("after the kill")
    times = []
    for _ in range(2):
        t0 = time.monotonic()
        ar.all_gather(x, out, 68)
        gpu.sync()
        times.append(time.monotonic() - t0)
    return {"seconds": times, "errors": ar.error_ranks(), "sequence": ar.sequence()}
