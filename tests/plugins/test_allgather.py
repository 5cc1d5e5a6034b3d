"""CPU tests of the one-shot all-gather (plugins/allreduce.py OneShotAllReduce.all_gather, kernels/allreduce.cu
allgather_push) and the collectives around it: the kernel compiles for sm_90 and sm_120; a block's byte chunk
(the kernel's formula) covers every byte once with edges every word size divides; the word is the largest
that divides nbytes and aligns x and out; double-buffered slots stay safe when consecutive collectives differ in
grid (all-reduces and all-gathers of any size under random schedules); the launcher's argument errors;
ProcessRankMember's checks and stream; CollectiveOps captures only a `capturable` collective; RankCollective
gathers by the one-shot first."""
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree.backends.cuda_tensor import Tensor
from ddtree.parallel.collective_models import NCCL, ONE_SHOT, TWO_SHOT
from ddtree.parallel.cuda_collectives import CollectiveOps, ProcessRankMember, ThreadRankGroup
from ddtree.parallel.rank_collective import RankCollective, allreduce_refusal, collective_parts
from ddtree.plugins import allreduce as ar
from ddtree.plugins import compile as kc
from ddtree.plugins.device import DeviceArray
from tests.plugins.test_allreduce import shared_bytes


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_allgather_kernel_compiles(arch):
    cubin = kc.compile_cubin("allreduce.cu", arch).read_bytes()
    assert b"allgather_push" in cubin
    assert 0 < shared_bytes(cubin, "allgather_push") <= 99 * 1024     # begin_collective's s_seq, s_failed


def block_spans(nbytes: int) -> list[tuple[int, int]]:
    """Block b's bytes [lo, hi) as allgather_push computes them from its grid."""
    blocks, _ = ar.gather_grid(nbytes)
    per16 = -(-(-(-nbytes // 16)) // blocks)
    spans = []
    for b in range(blocks):
        lo = min(nbytes, b * per16 * 16)
        spans.append((lo, min(nbytes, lo + per16 * 16)))
    return spans


@pytest.mark.parametrize("nbytes", [1, 15, 16, 17, 68, 112, 2002, 4096, 4097, 65536, 65 * 7168 * 2, 2 ** 22 + 6])
def test_block_chunks_cover_every_byte_once(nbytes):
    blocks, per16 = ar.gather_grid(nbytes)
    assert 1 <= blocks <= ar.limits()[1] and blocks == len(block_spans(nbytes))
    assert blocks == min(ar.limits()[1], -(-nbytes // (16 * ar.THREADS)))    # one block per THREADS vectors
    seen = np.zeros(nbytes, np.int64)
    for lo, hi in block_spans(nbytes):
        seen[lo:hi] += 1
        assert lo % 16 == 0 and (hi % 16 == 0 or hi == nbytes)              # every word size divides the edges
        assert hi - lo <= per16 * 16
    assert (seen == 1).all()


@pytest.mark.parametrize("nbytes, x, out, unit", [
    (512, 0x10000, 0x20000, 16), (65536, 0x10004, 0x20000, 4), (68, 0x10000, 0x20000, 4), (2002, 0x10000, 0x20000, 2),
    (37, 0x10000, 0x20000, 1), (64, 0x10000, 0x20008, 8), (48, 0x10002, 0x20000, 2), (32, 0x10000, 0x20001, 1)])
def test_the_word_divides_nbytes_and_aligns_x_and_every_part_of_out(nbytes, x, out, unit):
    assert ar.gather_unit(nbytes, x, out) == unit
    assert all(a % unit == 0 for a in (nbytes, x, *(out + r * nbytes for r in range(8))))


def simulate_mixed(nranks: int, calls: int, seed: int) -> None:
    """The protocol at block granularity with every call its own size and grid (the same on every rank, as the
    ranks run the same sequence): a block pushes its 16-byte vectors into every peer's slot and publishes, waits
    for every peer's flag of its block, reads; a rank's next call starts once every block of this one read (one
    stream). No push may overwrite a vector a peer has not read, and a read finds its own call's vectors."""
    rng = np.random.default_rng(seed)
    n16s = rng.integers(1, 3 * ar.THREADS, calls + 1)            # vectors of call seq (1-based)
    call = [1] * nranks
    phase = [{} for _ in range(nranks)]                          # rank -> {block: "push" | "wait" | "read" | "done"}
    flags, written, unread = {}, {}, set()
    while min(call) <= calls:
        rank = int(rng.integers(nranks))
        seq = call[rank]
        if seq > calls:
            continue
        slot, nbytes = ar.slot_of(seq), int(n16s[seq]) * 16
        spans = block_spans(nbytes)
        if not phase[rank]:
            phase[rank] = {b: "push" for b in range(len(spans))}
        b = int(rng.integers(len(spans)))
        vectors = range(spans[b][0] // 16, spans[b][1] // 16)
        if phase[rank][b] == "push":
            for d in range(nranks):
                if d != rank:
                    for v in vectors:
                        assert (d, slot, rank, v) not in unread, f"rank {rank} overwrote an unread part of rank {d}"
                        written[(d, slot, rank, v)] = seq
                        unread.add((d, slot, rank, v))
                    flags[(d, slot, rank, b)] = seq
            phase[rank][b] = "wait"
        elif phase[rank][b] == "wait":
            if all(flags.get((rank, slot, s, b)) == seq for s in range(nranks) if s != rank):
                phase[rank][b] = "read"
        elif phase[rank][b] == "read":
            for s in range(nranks):
                if s != rank:
                    for v in vectors:
                        assert written[(rank, slot, s, v)] == seq
                        unread.discard((rank, slot, s, v))
            phase[rank][b] = "done"
        if all(p == "done" for p in phase[rank].values()):
            call[rank], phase[rank] = seq + 1, {}


@pytest.mark.parametrize("nranks", [2, 4])
def test_double_buffered_slots_with_mixed_grids_under_random_schedules(nranks):
    for seed in range(10):
        simulate_mixed(nranks, calls=8, seed=seed)


class FakeGpu:
    """Memory addresses and recorded launches, no device."""

    def __init__(self):
        self.launches, self.next, self.stream = [], 0x100000, "gpu stream"

    def alloc(self, shape, dtype):
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        a = DeviceArray(self, self.next, shape, np.dtype(dtype))
        self.next += -(-max(1, a.nbytes) // 256) * 256
        return a

    zeros = alloc

    def upload(self, array):
        return self.alloc(array.shape, array.dtype)

    def kernel(self, source, name):
        return name

    def sync(self):
        pass

    def launch(self, kernel, grid, block, smem, *args, stream=None):
        self.launches.append((kernel, grid, block, args, stream))


def connected(rank=1, nranks=4, max_elems=64):
    gpu = FakeGpu()
    one = ar.OneShotAllReduce(gpu, rank, nranks, max_elems)
    one.peers = gpu.alloc(nranks, np.uint64)          # what connect() makes, without CUDA IPC
    return one, gpu


def test_all_gather_launch_arguments():
    one, gpu = connected(rank=1, nranks=4, max_elems=64)
    x, out = gpu.alloc(68, np.uint8), gpu.alloc(4 * 68, np.uint8)
    one.all_gather(x, out, 68, stream="s")
    kernel, grid, block, args, stream = gpu.launches[-1]
    assert (kernel, grid, block, stream) == ("allgather_push", 1, ar.THREADS, "s")
    xa, oa, nbytes, unit, peers, rank, nranks, region, state, error, spins = (int(a) for a in args)
    assert (xa, oa, nbytes, unit, peers, rank, nranks) == (x.ptr, out.ptr, 68, 4, one.peers.ptr, 1, 4)
    assert (region, state, error, spins) == (ar.region_bytes(64), one.state.ptr, one.state.ptr + 16, one.max_spins)
    one.all_gather(out.ptr + 68, out, 68)               # in place: x is out's part 1
    assert int(gpu.launches[-1][3][0]) == out.ptr + 68 and gpu.launches[-1][4] is None


@pytest.mark.parametrize("nbytes, x_at, match", [
    (0, None, "nbytes = 0"), (129, None, "nbytes = 129"), (-4, None, "nbytes = -4"),
    (16, 0, "overlaps out"), (16, 40, "overlaps out"), (16, -8, "overlaps out")])
def test_all_gather_argument_errors(nbytes, x_at, match):
    one, gpu = connected(rank=1, nranks=4, max_elems=64)              # max_bytes 128
    out = gpu.alloc(4 * 128, np.uint8)
    x = gpu.alloc(128, np.uint8).ptr if x_at is None else out.ptr + x_at
    with pytest.raises(ValueError, match=match):
        one.all_gather(x, out, nbytes)
    assert gpu.launches == []
    one.all_gather(gpu.alloc(128, np.uint8), out, 128)                  # the largest part
    assert len(gpu.launches) == 1


def test_all_gather_before_connect_raises():
    one, gpu = connected()
    one.peers = None
    with pytest.raises(RuntimeError, match="connect"):
        one.all_gather(gpu.alloc(16, np.uint8), gpu.alloc(64, np.uint8), 16)


def tensor(ptr, shape, dtype):
    return Tensor.of(DeviceArray(None, ptr, shape, np.dtype(dtype)))


class FakeOneShot:
    def __init__(self, rank=0, nranks=2):
        self.rank, self.nranks, self.calls = rank, nranks, []

    def __call__(self, x, out, elems, stream=None):
        self.calls.append(("all_reduce", x, out, elems, stream))

    def all_gather(self, x, out, nbytes, stream=None):
        self.calls.append(("all_gather", x, out, nbytes, stream))


def test_process_rank_member_passes_bytes_and_the_stream():
    one, gpu = FakeOneShot(rank=1, nranks=3), SimpleNamespace(stream="gpu stream")
    member = ProcessRankMember(one)
    assert member.capturable
    member.all_gather(gpu, tensor(0x1000, (7, 4), np.float32), tensor(0x2000, (3, 7, 4), np.float32), stream="b")
    member.all_reduce(gpu, tensor(0x3000, (2, 64), np.uint16), tensor(0x4000, (2, 64), np.uint16))
    assert one.calls == [("all_gather", 0x1000, 0x2000, 7 * 4 * 4, "b"),
                         ("all_reduce", 0x3000, 0x4000, 128, "gpu stream")]


@pytest.mark.parametrize("what, x, out, match", [
    ("all_gather", tensor(0x1000, (7, 4), np.float32), tensor(0x2000, (2, 7, 4), np.float32), r"out \(3, 7, 4\)"),
    ("all_gather", tensor(0x1000, (7, 4), np.float32), tensor(0x2000, (3, 7, 4), np.int32), "dtype"),
    ("all_gather", Tensor(0x1000, (7, 4), np.dtype(np.float32), (8, 1)), tensor(0x2000, (3, 7, 4), np.float32),
     "dense"),
    ("all_reduce", tensor(0x1000, (2, 64), np.float32), tensor(0x2000, (2, 64), np.float32), "bf16"),
    ("all_reduce", tensor(0x1000, (2, 64), np.uint16), tensor(0x2000, (64, 2), np.uint16), r"out \(2, 64\)")])
def test_process_rank_member_argument_errors(what, x, out, match):
    one = FakeOneShot(rank=0, nranks=3)
    with pytest.raises(ValueError, match=match):
        getattr(ProcessRankMember(one), what)(SimpleNamespace(stream=None), x, out)
    assert one.calls == []


class Collectives(CollectiveOps):
    """CollectiveOps over a recorded collective: what CudaOps gives it (lay, stream, capturing, new)."""

    def __init__(self, collective, tp=3, capturing=False):
        self.lay, self.collective = SimpleNamespace(tp=tp), collective
        self.gpu, self.stream, self.capturing, self.where, self.next = "gpu", "builder", capturing, "step", 0x9000

    def new(self, shape, dtype):
        self.next += 0x1000
        return tensor(self.next, shape, dtype)


def test_collective_ops_capture_a_capturable_collective_on_their_stream():
    one = FakeOneShot(rank=2, nranks=3)
    ops = Collectives(ProcessRankMember(one), capturing=True)
    gathered = ops.all_gather(tensor(0x1000, (5,), np.int32), "winners")
    summed = ops.all_reduce(tensor(0x2000, (1, 16), np.uint16), "h")
    assert gathered.shape == (3, 5) and summed.shape == (1, 16)
    assert one.calls == [("all_gather", 0x1000, gathered.ptr, 20, "builder"),
                         ("all_reduce", 0x2000, summed.ptr, 16, "builder")]


def test_collective_ops_refuse_to_capture_the_thread_ranks():
    ops = Collectives(ThreadRankGroup(3).member(0), capturing=True)
    for call in (lambda: ops.all_gather(tensor(0x1000, (5,), np.int32), "w"),
                 lambda: ops.all_reduce(tensor(0x2000, (1, 16), np.uint16), "h")):
        with pytest.raises(RuntimeError, match="cannot be captured"):
            call()


class FakeNccl:
    def __init__(self, rank=0, nranks=3):
        self.rank, self.nranks, self.calls = rank, nranks, []

    def all_reduce(self, x, out, elems, stream):
        self.calls.append(("all_reduce", x, out, elems, stream))

    def all_gather(self, x, out, nbytes, stream, dtype):
        self.calls.append(("all_gather", x, out, nbytes, stream, dtype))


def test_rank_collective_takes_the_one_shot_up_to_its_limit_and_nccl_above():
    one, nccl = FakeOneShot(), FakeNccl()
    one.max_bytes = 1000
    both = RankCollective(nccl=nccl, one_shot=one, one_shot_max_bytes=256)
    both.all_gather(1, 2, 256, "s")                   # at the limit: one-shot
    both.all_gather(3, 4, 258, "s")                   # above it: NCCL, as bytes
    both.all_reduce(5, 6, 128, "s")                   # 256 bytes
    both.all_reduce(7, 8, 136, "s")                   # 272 bytes
    assert one.calls == [("all_gather", 1, 2, 256, "s"), ("all_reduce", 5, 6, 128, "s")]
    assert nccl.calls == [("all_gather", 3, 4, 258, "s", "u8"), ("all_reduce", 7, 8, 136, "s")]
    one.calls, nccl.calls = [], []
    unlimited = RankCollective(nccl=nccl, one_shot=one)      # every message the one-shot holds, NCCL past it
    unlimited.all_reduce(1, 2, 500, "s")
    unlimited.all_reduce(3, 4, 504, "s")
    assert one.calls == [("all_reduce", 1, 2, 500, "s")] and nccl.calls == [("all_reduce", 3, 4, 504, "s")]
    RankCollective(nccl=nccl).all_gather(3, 4, 68, "s")
    RankCollective(one_shot=one).all_reduce(1, 2, 10_000, "s")   # alone, the one-shot refuses what it cannot hold
    assert nccl.calls[-1] == ("all_gather", 3, 4, 68, "s", "u8") and one.calls[-1] == ("all_reduce", 1, 2, 10_000, "s")
    assert [c.describe() for c in (both, unlimited, RankCollective(nccl=nccl), RankCollective(one_shot=one))] == [
        "one-shot <= 256 B, nccl above", "one-shot <= 1000 B, nccl above", "nccl", "one-shot"]
    with pytest.raises(ValueError, match="neither a one-shot all-reduce nor an NCCL communicator"):
        RankCollective()


@pytest.mark.parametrize("choice, gpus, parts, refusal", [
    ("one-shot", [0, 0], (True, False, None), None),
    ("two-shot", [0, 0], (True, False, (TWO_SHOT,)), None),
    ("auto", [0, 0], (True, False, (ONE_SHOT, TWO_SHOT)), None),           # ranks sharing a GPU have no NCCL
    ("auto", [0, 1], (True, True, (ONE_SHOT, TWO_SHOT, NCCL)), None),
    ("nccl", [0, 1], (False, True, None), None),
    ("nccl", [0, 1, 1], None, "NCCL needs one GPU per rank, and --gpu 0,1,1"),
    ("ring", [0, 1], None, "--allreduce 'ring': expected one of one-shot, two-shot, nccl, auto")])
def test_allreduce_choice(choice, gpus, parts, refusal):
    why = allreduce_refusal(choice, gpus)
    if refusal is not None:
        assert refusal in why
        return
    assert why is None and collective_parts(choice, gpus) == parts
