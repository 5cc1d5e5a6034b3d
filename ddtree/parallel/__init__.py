"""Ranks and the collectives between them.

    collectives.py      the rank-ordered float32 sum and the in-process group of ranks as threads
    shm_group.py        the host group of rank processes over shared memory (CPU ranks, host gathers)
    cuda_collectives.py the GPU one-shot all-reduce / all-gather over CUDA IPC (and stand-ins for one GPU)
    nccl_group.py       NCCL through nccl4py; rank_collective.py chooses one-shot / NCCL per rank
    spawn_ranks.py      starting rank processes and gathering their results
Nothing here knows the model: the backends call these for their all-reduce and all-gather ops."""
