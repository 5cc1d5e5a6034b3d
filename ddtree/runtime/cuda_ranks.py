"""A rank process of a tp N engine on a GPU (runtime/ranks.py RankProcesses(cuda=...)): CudaExecutor(rank=r) on its
GPU, the layers' all-reduces through the one-shot all-reduce over CUDA IPC (plugins/allreduce.py: every rank pushes
its partial into every peer's buffer, the sum in rank order with one rounding, so every rank holds the same bits),
and the logits slices gathered through the ranks' host group (ops/shm_group.py), so every rank samples, builds and
walks the same tree from the same bits. Ranks may share a GPU (CUDA IPC works between processes on one device;
NCCL refuses that): tp 2 runs on one H200 as two processes.

The exchange of IPC handles is a collective: every rank builds its executor at the same time and they meet in the
host group's all-gather. The steps are captured graphs with the collectives inside (runtime/cuda_step_tp.py;
graphs=False: the primitives of runtime/loop.py).
"""
from __future__ import annotations

import numpy as np

from ddtree.ops.cuda_backend import MAX_TOKENS


def all_reduce_elems(cfg, dcfg) -> int:
    """The largest all-reduce of a step, in elements: [256 rows, hidden] (the target's or the drafter's)."""
    return MAX_TOKENS * max(cfg.hidden_size, dcfg.hidden_size)


def connect_one_shot(gpu, rank: int, group, max_elems: int):
    """A one-shot all-reduce on `gpu` connected to every peer's buffer, the IPC handles exchanged through `group`."""
    from ddtree.plugins.allreduce import OneShotAllReduce
    ar = OneShotAllReduce(gpu, rank, group.size, max_elems)
    handles = group.all_gather(rank, np.frombuffer(ar.ipc_handle(), np.uint8), "one-shot all-reduce IPC handles")
    ar.connect([bytes(h.tobytes()) for h in handles])
    return ar


def one_shot_member(gpu, rank: int, group, max_elems: int):
    """This rank's GPU collective for CudaOps: the connected one-shot (all-reduce and all-gather)."""
    from ddtree.ops.cuda_collectives import ProcessRankMember
    return ProcessRankMember(connect_one_shot(gpu, rank, group, max_elems))


def cuda_rank_executor(engine_dir, rank: int, group, checked, gpus: list[int], max_context: int | None = None,
                       cap_context: bool = False, kernel_plan: str = "fast", graphs: bool = True):
    """Rank `rank` on GPU gpus[rank] (a list of one index per rank; indices may repeat); graphs: the step graphs
    (False: the primitives, e.g. to compare the two)."""
    from ddtree.engine_dir import engine_configs
    from ddtree.runtime.cuda_executor import CudaExecutor
    max_elems = all_reduce_elems(*engine_configs(engine_dir, checked[0]))
    return CudaExecutor(engine_dir, gpu=gpus[rank], max_context=max_context, cap_context=cap_context,
                        kernel_plan=kernel_plan, rank=rank, graphs=graphs,
                        collective=lambda gpu: one_shot_member(gpu, rank, group, max_elems), host_group=group,
                        checked=checked)
