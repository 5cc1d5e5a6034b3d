"""CPU tests of the one-shot all-reduce (plugins/allreduce.py) and its bench's flags: the numpy twin is the
rank-ordered float32 sum rounded once to bf16 (against ml_dtypes' rounding, and an order-sensitive case);
the exchange-buffer layout, the block chunks and the double-buffered slots (a protocol simulation under
random schedules: no rank overwrites a part a peer has not read yet); `ddtree bench allreduce` names bad
flags; the kernel compiles for sm_90 and sm_120 within the sm_120's 99 KB of shared memory per block."""
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree.bench.allreduce import allreduce_command, parse_flags
from ddtree.errors import InputError
from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import allreduce as ar
from ddtree.plugins import compile as kc


def bf16_bits(values) -> np.ndarray:
    return f32_to_bf16(np.asarray(values, np.float32))


def test_reference_sum_is_the_rank_ordered_float32_sum_rounded_once():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    parts = [bf16_bits(rng.standard_normal(4096) * np.exp2(rng.integers(-8, 9, 4096))) for _ in range(4)]
    acc = np.zeros(4096, np.float32)
    for p in parts:                                    # element by element, float32 scalars, rank order
        acc = np.array([np.float32(a) + np.float32(b) for a, b in zip(acc, bf16_to_f32(p))], np.float32)
    want = acc.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ar.reference_sum(parts), want)


def test_reference_sum_order_is_visible():
    # 2^24 + 1 rounds to 2^24 in float32, so rank order gives 0; other orders (and float64) give 1
    parts = [bf16_bits([2.0 ** 24]), bf16_bits([1.0]), bf16_bits([-(2.0 ** 24)])]
    assert bf16_to_f32(ar.reference_sum(parts))[0] == 0.0
    assert bf16_to_f32(ar.reference_sum(parts[::-1]))[0] == 1.0          # -2^24 + 1 is exact
    assert bf16_to_f32(ar.reference_sum([parts[0], parts[2], parts[1]]))[0] == 1.0


@pytest.mark.parametrize("nranks, max_elems", [(2, 7168), (2, 65 * 7168), (8, 8), (3, 24)])
def test_layout_regions_disjoint_aligned_and_inside_the_buffer(nranks, max_elems):
    max_ranks, max_blocks = ar.limits()
    spans = [(ar.flag_offset(s, r, b, k), 8) for k in range(ar.ROUNDS) for s in range(2) for r in range(max_ranks)
             for b in range(max_blocks)]
    spans += [(ar.region_offset(s, r, nranks, max_elems), 2 * max_elems) for s in range(2) for r in range(nranks)]
    spans.sort()
    for (a, na), (b, _) in zip(spans, spans[1:]):
        assert a + na <= b, f"overlap at {a}"
    assert spans[-1][0] + spans[-1][1] <= ar.exchange_bytes(nranks, max_elems)
    assert all(off % 16 == 0 for off, n in spans if n > 8)           # 16-byte vectors
    assert ar.flag_bytes() == 2 * 2 * max_ranks * max_blocks * 8        # [round, slot, src, block] u64
    assert ar.flag_offset(1, 3, 5) == ((1 * max_ranks + 3) * max_blocks + 5) * 8    # round 0: the one-shot's words


@pytest.mark.parametrize("elems", [8, 7168, 17 * 7168, 65 * 7168, 8 * 257, 8 * 100_003])
def test_block_chunks_cover_every_vector_once(elems):
    blocks, per = ar.grid_for(elems)
    n8 = elems // 8
    assert 1 <= blocks <= ar.limits()[1]
    seen = np.zeros(n8, np.int64)
    for b in range(blocks):                            # the kernel's lo, hi per block
        lo, hi = b * per, min(n8, b * per + per)
        seen[lo:hi] += 1
    assert (seen == 1).all()


def simulate(nranks: int, calls: int, seed: int, protocol: str = "push") -> None:
    """The kernel's protocol with one block, as steps a random scheduler interleaves: write (push: my part into
    every peer's slot; pull: into my own slot), publish seq to every peer, wait (every peer's flag == seq), read
    (push: the parts in my buffer; pull: each peer's part in its buffer), finish (counter = seq). Each region
    remembers which seq wrote it; a read must find its own seq, and no write may overwrite a part one of its
    readers has not read yet."""
    rng = np.random.default_rng(seed)
    counter = [0] * nranks
    phase = ["push"] * nranks
    flags = {}                                         # (dest, slot, src) -> seq
    written = {}                                       # (buffer, slot, src) -> seq of the part there
    unread = set()                                     # (reader, buffer, slot, src) parts written, not yet read
    while min(counter) < calls:
        rank = int(rng.integers(nranks))
        seq = counter[rank] + 1
        slot = ar.slot_of(seq)
        if seq > calls:
            continue
        peers = [d for d in range(nranks) if d != rank]
        if phase[rank] == "push":
            targets = [(d, d) for d in peers] if protocol == "push" else [(rank, d) for d in peers]
            for buffer, reader in targets:             # the part lands in `buffer`, `reader` reads it there
                assert (reader, buffer, slot, rank) not in unread, f"rank {rank} overwrote a part unread by {reader}"
                written[(buffer, slot, rank)] = seq
                unread.add((reader, buffer, slot, rank))
            for d in peers:
                flags[(d, slot, rank)] = seq
            phase[rank] = "wait"
        elif phase[rank] == "wait":
            if all(flags.get((rank, slot, s)) == seq for s in peers):
                phase[rank] = "read"
        elif phase[rank] == "read":
            for s in peers:
                buffer = rank if protocol == "push" else s
                assert written[(buffer, slot, s)] == seq
                unread.discard((rank, buffer, slot, s))
            counter[rank] = seq
            phase[rank] = "push"


@pytest.mark.parametrize("protocol", ["push", "pull"])          # the two-shot and mixes: test_allreduce_two_shot.py
@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_double_buffered_slots_under_random_schedules(nranks, protocol):
    for seed in range(20):
        simulate(nranks, calls=12, seed=seed, protocol=protocol)
    assert [ar.slot_of(k) for k in range(1, 6)] == [1, 0, 1, 0, 1]


def test_a_single_slot_would_be_caught_by_the_simulation(monkeypatch):
    """The simulation can fail: with every collective in one slot, a fast rank overwrites an unread part."""
    monkeypatch.setattr(ar, "slot_of", lambda seq: 0)
    for protocol in ("push", "pull"):
        with pytest.raises(AssertionError, match="overwrote"):
            for seed in range(50):
                simulate(3, calls=12, seed=seed, protocol=protocol)


def test_an_unknown_protocol_is_named_before_any_allocation():
    with pytest.raises(ValueError, match="protocol 'ring'"):
        ar.OneShotAllReduce(None, 0, 2, 8, protocol="ring")


@pytest.mark.parametrize("flags, named", [
    (dict(sizes="1,x"), "--sizes"), (dict(sizes="0,17"), "--sizes"), (dict(sizes=""), "--sizes"),
    (dict(hidden=7164), "--hidden"), (dict(hidden=0), "--hidden"),
    (dict(impls="one-shot,mpi"), "--impl"), (dict(impls=""), "--impl"),
    (dict(gpus="0"), "--gpu"), (dict(gpus="0,0"), "--gpu"), (dict(gpus="0,1,2,3,4,5,6,7,8"), "--gpu"),
    (dict(gpus="-1,0"), "--gpu"), (dict(replays=0), "--replays"), (dict(collectives=0), "--collectives")])
def test_bench_flags_are_named(flags, named):
    args = {**dict(sizes="1,17,65", hidden=7168, impls="one-shot,nccl", gpus="0,1", replays=5, collectives=122),
            **flags}
    with pytest.raises(InputError, match=named):
        parse_flags(**args)


def test_bench_cli_reports_a_bad_flag_without_starting_ranks():
    result = CliRunner().invoke(allreduce_command, ["--sizes", "1,-2", "--json"])
    assert result.exit_code == 1
    assert "--sizes" in result.output and "Traceback" not in result.output
    assert parse_flags("1,17,65", 7168, "nccl", "1,0", 3, 122) == ([1, 17, 65], ["nccl"], [1, 0])


def shared_bytes(cubin: bytes, kernel: str) -> int:
    """Size of the cubin's .nv.shared.<kernel> section (the kernel's static shared memory), 0 if none."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    for name_at, _, _, _, _, size in headers:
        name = cubin[strtab + name_at: cubin.index(b"\0", strtab + name_at)].decode()
        if name == f".nv.shared.{kernel}":
            return size
    return 0


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_kernel_compiles_within_the_sm120_shared_memory(arch):
    cubin = kc.compile_cubin("allreduce.cu", arch).read_bytes()
    for name in ("allreduce_push", "allreduce_pull", "allreduce_two_shot", "allreduce_pingpong"):
        assert name.encode() in cubin
    for name in ("allreduce_push", "allreduce_pull", "allreduce_two_shot"):
        used = shared_bytes(cubin, name)
        assert 0 < used <= 99 * 1024          # s_seq + s_failed; the launcher asks for no dynamic shared memory
    assert shared_bytes(cubin, "no_such_kernel") == 0


def test_nccl_faster_from_is_where_nccl_wins_at_every_larger_size():
    from ddtree.bench.allreduce import nccl_faster_from

    def rows(times):             # bytes -> (one-shot us, nccl us), in graph; "alone" rows must be ignored
        out = []
        for b, (one, nccl) in times.items():
            out += [{"impl": "one-shot", "bytes": b, "mode": "in_graph", "us": one},
                    {"impl": "nccl", "bytes": b, "mode": "in_graph", "us": nccl},
                    {"impl": "nccl", "bytes": b, "mode": "alone", "us": 0.0}]
        return out
    assert nccl_faster_from(rows({100: (4, 9), 1000: (6, 8), 10_000: (12, 10), 100_000: (30, 20)})) == 10_000
    assert nccl_faster_from(rows({100: (4, 3), 1000: (6, 8), 10_000: (12, 10)})) == 10_000   # a win below a loss
    assert nccl_faster_from(rows({100: (4, 9), 1000: (6, 8)})) is None
    assert nccl_faster_from(rows({100: (4, 3)})) == 100
