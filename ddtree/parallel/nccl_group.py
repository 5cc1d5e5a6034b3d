"""NCCL between rank processes, through nccl4py's bindings (docs/interfaces.md section 9: the `nccl` implementation).

    uid = new_unique_id()                         # rank 0; the caller sends the 128 bytes to every rank
    group = NcclGroup(gpu, uid, rank, nranks)     # collective: every rank constructs it; connects eagerly
    group.all_reduce(src, dst, count, stream)     # bf16 sum on device pointers; capturable in a CUDA graph
    group.all_gather(src, dst, count, stream)     # dst [nranks, count] in rank order
    group.abort()                                 # ncclCommAbort: on any failure, so no rank waits forever

Every call takes device addresses (DeviceArray or int) and a stream (cuda.core Stream or a graph builder;
None: the gpu's). NCCL sums in its own order: identical bits on every rank, not one-shot's bits.

libnccl: nccl4py finds it through cuda.pathfinder (the nvidia-nccl-cu13 wheel in site-packages, then the
system loader, then $NCCL_HOME). Where pathfinder finds none, load_libnccl() loads the first libnccl.so.2
under a site-packages directory (torch's nvidia/nccl/lib or torch/lib) before the first call.
Keep NCCL_NVLS_ENABLE=0 (set here when unset): NVLink multicast is never used.
Status (2 H200s, NCCL 2.28.9): it runs end to end in the runtime's rank processes (`ddtree run --allreduce nccl`),
and hung in the processes parallel/spawn_ranks.py starts (bench allreduce, the 2-GPU NCCL test); where is not known:
NCCL's INFO lines went to those processes' stdout, which C stdio buffers (and, with --json, into the JSON), so the
last line seen ("NET/IB : No device found") need not be where they stopped. The ranks' stdout is now their stderr,
the device scripts set NCCL_DEBUG_FILE (unbuffered) and spawn_ranks dumps the Python stacks on a timeout.
"""
from __future__ import annotations

import ctypes
import glob
import os
import site
import sys

import numpy as np

from ddtree.plugins.device import ptr

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

DTYPES = {"bf16": "Bfloat16", "f32": "Float32", "i32": "Int32", "u8": "Uint8"}


class NcclError(RuntimeError):
    """An NCCL call failed (the communicator was aborted)."""


def load_libnccl() -> str:
    """Make libnccl.so.2 loadable for nccl4py: its path (pathfinder's answer, or one found in site-packages)."""
    from cuda.pathfinder import DynamicLibNotFoundError, load_nvidia_dynamic_lib  # cuda: the cuda extra
    try:
        return load_nvidia_dynamic_lib("nccl").abs_path
    except DynamicLibNotFoundError:
        roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
        for root in roots:
            for pattern in ("nvidia/nccl/lib/libnccl.so.2", "torch/lib/libnccl.so.2"):
                for path in glob.glob(os.path.join(root, pattern)):
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)     # pathfinder then finds it already loaded
                    return path
        raise


def _bindings():
    load_libnccl()
    import nccl.bindings.nccl as nccl  # nccl: the nccl extra
    return nccl


def new_unique_id() -> bytes:
    """rank 0: the communicator's id (128 bytes) to send to every rank."""
    return bytes(_bindings().get_unique_id())


def version() -> str:
    v = int(_bindings().get_version())
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def _stream_handle(gpu, stream) -> int:
    s = stream if stream is not None else gpu.stream
    return int(getattr(s, "stream", s).handle)             # a graph builder's stream while capturing


class NcclGroup:
    """One rank's communicator. gpu: ddtree.plugins.device.Gpu of this rank (current device)."""

    def __init__(self, gpu, unique_id: bytes, rank: int, nranks: int):
        self.gpu, self.rank, self.nranks = gpu, rank, nranks
        self.nccl = _bindings()
        self.comm = None
        try:
            self.comm = self.nccl.comm_init_rank_scalable(int(nranks), int(rank), 1, bytearray(unique_id), 0)
        except Exception as e:
            raise NcclError(f"NCCL rank {rank} of {nranks}: communicator init failed: {e}") from e
        self._warm_up()

    def _warm_up(self) -> None:
        """One eager all-reduce and all-gather, synced: NCCL connects its peers on a communicator's first
        collectives, which should not happen inside a graph capture (PyTorch too warms up before capturing)."""
        scratch = self.gpu.zeros((self.nranks + 1, 256), np.uint16)
        self.all_reduce(scratch, scratch, 256)
        self.all_gather(scratch, scratch.view(256, (self.nranks, 256)), 256)
        self.gpu.sync()

    def _call(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            self.abort()
            raise NcclError(f"NCCL rank {self.rank}: {what} failed (communicator aborted): {e}") from e

    def all_reduce(self, src, dst, count: int, stream=None, dtype: str = "bf16") -> None:
        """dst [count] = the sum of every rank's src [count] (dst may be src)."""
        nccl = self.nccl
        self._call("all_reduce", nccl.all_reduce, int(ptr(src)), int(ptr(dst)), int(count),
                   int(getattr(nccl.DataType, DTYPES[dtype])), int(nccl.RedOp.Sum), self.comm,
                   _stream_handle(self.gpu, stream))

    def all_gather(self, src, dst, count: int, stream=None, dtype: str = "bf16") -> None:
        """dst [nranks, count] = every rank's src [count] in rank order."""
        nccl = self.nccl
        self._call("all_gather", nccl.all_gather, int(ptr(src)), int(ptr(dst)), int(count),
                   int(getattr(nccl.DataType, DTYPES[dtype])), self.comm, _stream_handle(self.gpu, stream))

    def async_error(self) -> int:
        """NCCL's asynchronous error code (0: none)."""
        return int(self.nccl.comm_get_async_error(self.comm)) if self.comm is not None else 0

    def abort(self) -> None:
        """ncclCommAbort: ends in-flight operations; safe to call twice."""
        if self.comm is not None:
            comm, self.comm = self.comm, None
            self.nccl.comm_abort(comm)

    def close(self) -> None:
        if self.comm is not None:
            comm, self.comm = self.comm, None
            self.nccl.comm_destroy(comm)
