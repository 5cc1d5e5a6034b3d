"""A rank process of a tp N engine on a GPU (runtime/ranks.py RankProcesses(cuda=...)): CudaExecutor(rank=r) on its
GPU, the layers' all-reduces through the one-shot all-reduce over CUDA IPC (plugins/allreduce.py: every rank pushes
its partial into every peer's buffer, the sum in rank order with one rounding, so every rank holds the same bits),
and the logits slices gathered through the ranks' host group (parallel/shm_group.py), so every rank samples, builds and
walks the same tree from the same bits. Ranks may share a GPU (CUDA IPC works between processes on one device;
NCCL refuses that): tp 2 runs on one H200 as two processes.

--allreduce (parallel/rank_collective.py) picks the one-shot (the default), its two-shot protocol, NCCL (a GPU per
rank), or the cheapest per message size by the PCIe model (auto). The exchange of IPC handles (and NCCL's unique id) is a collective: every rank builds its
executor at the same time and they meet in the host group's all-gather. The steps are captured graphs with the collectives inside (runtime/cuda_step_tp.py;
graphs=False: the primitives of runtime/loop.py).
"""
from __future__ import annotations

import numpy as np

from ddtree.backends.cuda_backend import MAX_TOKENS
from ddtree.engine_dir import engine_configs
from ddtree.parallel.cuda_collectives import ProcessRankMember
from ddtree.parallel.nccl_group import NcclGroup, new_unique_id
from ddtree.parallel.rank_collective import allreduce_refusal, collective_parts
from ddtree.plugins.allreduce import VECTOR, OneShotAllReduce
from ddtree.plugins.top_p_ranks_gpu import exchange_bytes
from ddtree.runtime.cuda_executor import CudaExecutor


def all_reduce_elems(cfg, dcfg) -> int:
    """The largest all-reduce of a step, in elements: [256 rows, hidden] (the target's or the drafter's)."""
    return MAX_TOKENS * max(cfg.hidden_size, dcfg.hidden_size)


def top_p_gather_elems(rows: int = MAX_TOKENS) -> int:
    """The largest all-gather part of top-p across ranks (plugins/top_p_ranks_gpu.py TopPRanks: the records,
    32 816 B a row) for `rows` rows, in the one-shot's bf16 elements (a part holds 2 B an element), rounded up to
    its vector."""
    elems = -(-max(exchange_bytes(rows).values()) // 2)
    return -(-elems // VECTOR) * VECTOR


def one_shot_elems(cfg, dcfg) -> int:
    """The step graphs' one-shot size: the largest of its all-reduces and of top-p's all-gather parts (at 256 rows
    and tp 8 the latter is 8.4 MB a part, a 134 MB buffer a rank: 2 slots x 8 sources)."""
    return max(all_reduce_elems(cfg, dcfg), top_p_gather_elems())


def connect_one_shot(gpu, rank: int, group, max_elems: int):
    """A one-shot all-reduce on `gpu` connected to every peer's buffer, the IPC handles exchanged through `group`."""
    ar = OneShotAllReduce(gpu, rank, group.size, max_elems)
    handles = group.all_gather(rank, np.frombuffer(ar.ipc_handle(), np.uint8), "one-shot all-reduce IPC handles")
    ar.connect([bytes(h.tobytes()) for h in handles])
    return ar


def nccl_communicator(gpu, rank: int, group):
    """This rank's NCCL communicator, rank 0's unique id sent to every rank through `group`."""
    uid = np.frombuffer(new_unique_id(), np.uint8) if rank == 0 else np.zeros(128, np.uint8)
    ids = group.all_gather(rank, uid, "NCCL unique id")
    return NcclGroup(gpu, bytes(ids[0].tobytes()), rank, group.size)


def rank_member(gpu, rank: int, group, max_elems: int, allreduce: str = "one-shot", gpus: list[int] | None = None):
    """This rank's GPU collective for CudaOps (parallel/rank_collective.py): the connected one-shot (all-reduce and
    all-gather; its two-shot protocol too), NCCL, or the choice by size among them (--allreduce auto: the PCIe model;
    NCCL only with a GPU per rank)."""
    gpus = list(range(group.size)) if gpus is None else gpus
    why = allreduce_refusal(allreduce, gpus)
    if why:
        raise ValueError(why)
    use_one_shot, use_nccl, models = collective_parts(allreduce, gpus)
    one_shot = connect_one_shot(gpu, rank, group, max_elems) if use_one_shot else None
    nccl = nccl_communicator(gpu, rank, group) if use_nccl else None
    return ProcessRankMember(one_shot=one_shot, nccl=nccl, models=models)


def cuda_rank_executor(engine_dir, rank: int, group, checked, gpus: list[int], max_context: int | None = None,
                       cap_context: bool = False, kernel_plan: str = "fast", graphs: bool = True,
                       allreduce: str = "one-shot"):
    """Rank `rank` on GPU gpus[rank] (a list of one index per rank; indices may repeat); graphs: the step graphs
    (False: the primitives, e.g. to compare the two); allreduce: --allreduce (parallel/rank_collective.py)."""
    max_elems = one_shot_elems(*engine_configs(engine_dir, checked[0]))
    return CudaExecutor(engine_dir, gpu=gpus[rank], max_context=max_context, cap_context=cap_context,
                        kernel_plan=kernel_plan, rank=rank, graphs=graphs,
                        collective=lambda gpu: rank_member(gpu, rank, group, max_elems, allreduce, gpus),
                        host_group=group, checked=checked)
