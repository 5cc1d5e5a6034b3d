"""CPU tests of the two-shot all-reduce (plugins/allreduce.py protocol "two-shot", kernels/allreduce.cu
allreduce_two_shot): its numpy twin, which runs both phases over emulated exchange buffers, gives every rank
reference_sum's bits (N = 2, 3, 4, 8; sizes not divisible by N x 8, and below it, where chunks are empty); the
chunks and the blocks' shares of them (the kernel's arithmetic, written again here) cover every vector once; and
the double-buffered slots stay safe when the protocol changes from one collective to the next (push, pull and
two-shot mixed, under random schedules), while one flag round for both phases, or one slot, would not be."""
import numpy as np
import pytest

from ddtree.model.bf16 import f32_to_bf16
from ddtree.plugins import allreduce as ar

SIZES = [8, 16, 24, 56, 8 * 13, 8 * 37, 7168, 7168 + 8 * 3, 3 * 7168]


def parts(nranks: int, elems: int, seed: int) -> list[np.ndarray]:
    """Mixed magnitudes, so the order and the single rounding of the sum show in the bits."""
    rng = np.random.default_rng([nranks, elems, seed])
    return [f32_to_bf16(rng.standard_normal(elems).astype(np.float32)
                        * np.exp2(rng.integers(-8, 9, elems)).astype(np.float32)) for _ in range(nranks)]


@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_two_shot_twin_is_reference_sum_on_every_rank(nranks):
    for elems in SIZES:
        for seed in range(2):
            ps = parts(nranks, elems, seed)
            want = ar.reference_sum(ps)
            outs = ar.two_shot_twin(ps)
            assert len(outs) == nranks
            for rank, got in enumerate(outs):
                bad = np.flatnonzero(got != want)
                assert bad.size == 0, f"N {nranks} elems {elems} rank {rank}: {bad.size} of {elems} differ"


def test_two_shot_twin_shows_a_lost_chunk():
    """The twin can fail: a chunk map that leaves the last vector to nobody leaves the poison (0xFFFF) there."""
    ps = parts(3, 8 * 7, 0)
    chunks = ar.two_shot_chunks(8 * 7, 3)
    real = ar.two_shot_chunks
    try:
        ar.two_shot_chunks = lambda elems, n: chunks[:-1] + [(chunks[-1][0], chunks[-1][1] - 8)]
        outs = ar.two_shot_twin(ps)
    finally:
        ar.two_shot_chunks = real
    assert all((o[-8:] == 0xFFFF).all() for o in outs)
    assert not np.array_equal(outs[0], ar.reference_sum(ps))


def kernel_spans(elems: int, nranks: int) -> list[list[tuple[int, int]]]:
    """[chunk k][block b] -> vectors [lo, hi) as allreduce_two_shot's chunk_span computes them (u32 arithmetic
    without overflow at these sizes), with the grid the launcher gives."""
    n8 = elems // 8
    chunk = -(-n8 // nranks)
    blocks, _ = ar.two_shot_grid(elems, nranks)
    per = -(-chunk // blocks)
    out = []
    for k in range(nranks):
        start = min(n8, k * chunk)
        spans = []
        for b in range(blocks):
            lo = min(chunk, b * per)
            spans.append((min(n8, start + lo), min(n8, start + min(chunk, lo + per))))
        out.append(spans)
    return out


@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
@pytest.mark.parametrize("elems", SIZES + [17 * 7168, 65 * 7168, 8 * 100_003])
def test_chunks_and_block_shares_cover_every_vector_once(nranks, elems):
    n8 = elems // 8
    chunks = ar.two_shot_chunks(elems, nranks)
    assert chunks[0][0] == 0 and chunks[-1][1] == elems
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))          # contiguous, in rank order
    assert all(lo % 8 == 0 and hi % 8 == 0 for lo, hi in chunks)          # on 16-byte vectors
    sizes = [hi - lo for lo, hi in chunks]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - min(s for s in sizes if s) <= 8 * nranks
    blocks, _ = ar.two_shot_grid(elems, nranks)
    assert 1 <= blocks <= ar.limits()[1]
    seen = np.zeros(n8, np.int64)
    for k, spans in enumerate(kernel_spans(elems, nranks)):
        for lo, hi in spans:
            assert chunks[k][0] // 8 <= lo <= hi <= chunks[k][1] // 8 or lo == hi, (k, lo, hi)
            seen[lo:hi] += 1
    assert (seen == 1).all()


# ---- the slots under a changing protocol ------------------------------------------------------------------------
def steps_of(protocol: str, rank: int, peers: list[int], nranks: int) -> list[tuple]:
    """One collective of `rank` as (kind, round, cells) steps. A cell is (buffer, src, chunk, reader): the part of
    src at chunk `chunk` of buffer's data[slot][src], read there by `reader` (push and pull move the whole part:
    every chunk)."""
    every = range(nranks)
    if protocol == "push":
        return [("write", 0, [(d, rank, c, d) for d in peers for c in every]), ("wait", 0),
                ("read", 0, [(rank, s, c, rank) for s in peers for c in every])]
    if protocol == "pull":
        return [("write", 0, [(rank, rank, c, d) for d in peers for c in every]), ("wait", 0),
                ("read", 0, [(s, s, c, rank) for s in peers for c in every])]
    return [("write", 0, [(d, rank, d, d) for d in peers]), ("wait", 0),             # chunk d of x to rank d
            ("read", 0, [(rank, s, rank, rank) for s in peers]),                      # my chunk, every part
            ("write", 1, [(d, rank, rank, d) for d in peers]), ("wait", 1),           # my sum to every peer
            ("read", 1, [(rank, s, s, rank) for s in peers])]                         # every peer's sum


def simulate_mixed(nranks: int, calls: int, seed: int, flag_round=lambda r: r) -> None:
    """Every rank runs `calls` collectives, collective k in protocol protocols[k] on every rank (chosen at random
    per k), as steps a random scheduler interleaves. A written cell remembers its seq; a read must find its own
    seq, and no write may land on a cell a reader has not read yet. flag_round maps a round to the flag words it
    uses (the kernel: its own words per round)."""
    rng = np.random.default_rng(seed)
    protocols = [None] + [str(p) for p in rng.choice(ar.PROTOCOLS, calls)]
    counter, step = [0] * nranks, [0] * nranks
    flags, written, unread = {}, {}, set()             # flags: (dest, flag round, slot, src) -> seq
    while min(counter) < calls:
        rank = int(rng.integers(nranks))
        seq = counter[rank] + 1
        if seq > calls:
            continue
        slot, peers = ar.slot_of(seq), [d for d in range(nranks) if d != rank]
        steps = steps_of(protocols[seq], rank, peers, nranks)
        kind, rnd = steps[step[rank]][:2]
        if kind == "write":                            # (pull: one cell, several readers)
            cells = {(buffer, slot, src, chunk) for buffer, src, chunk, _ in steps[step[rank]][2]}
            for cell in cells:
                assert not any(u[1:] == cell for u in unread), f"rank {rank} overwrote {cell} before it was read"
            for buffer, src, chunk, reader in steps[step[rank]][2]:
                written[(buffer, slot, src, chunk)] = seq
                unread.add((reader, buffer, slot, src, chunk))
            for d in peers:
                flags[(d, flag_round(rnd), slot, rank)] = seq
        elif kind == "wait":
            if not all(flags.get((rank, flag_round(rnd), slot, s)) == seq for s in peers):
                continue
        else:
            for buffer, src, chunk, reader in steps[step[rank]][2]:
                cell = (buffer, slot, src, chunk)
                assert written.get(cell) == seq, f"rank {rank} seq {seq} read {cell} of seq {written.get(cell)}"
                unread.discard((reader, *cell))
        step[rank] += 1
        if step[rank] == len(steps):
            counter[rank], step[rank] = seq, 0


@pytest.mark.parametrize("nranks", [2, 3, 4, 8])
def test_double_buffered_slots_hold_when_the_protocol_changes_per_call(nranks):
    for seed in range(25):
        simulate_mixed(nranks, calls=14, seed=seed)


def test_one_flag_round_for_both_phases_would_be_caught():
    """With the all-gather's flags in the reduce-scatter's words, a rank takes a peer's round-0 flag for its sum."""
    with pytest.raises(AssertionError, match=r"seq \d+ read .* of seq"):
        for seed in range(50):
            simulate_mixed(3, calls=14, seed=seed, flag_round=lambda r: 0)


def test_one_slot_would_be_caught_under_mixed_protocols(monkeypatch):
    monkeypatch.setattr(ar, "slot_of", lambda seq: 0)
    with pytest.raises(AssertionError):
        for seed in range(50):
            simulate_mixed(3, calls=14, seed=seed)


def test_a_call_names_an_unknown_protocol_before_launching():
    one = object.__new__(ar.OneShotAllReduce)
    one.protocol, one.peers = "push", None
    with pytest.raises(ValueError, match="protocol 'ring'"):
        one(0, 0, 8, protocol="ring")


def test_bench_allreduce_times_the_two_shot_too():
    from ddtree.bench.allreduce import IMPLS, parse_flags
    assert "two-shot" in IMPLS
    assert parse_flags("1,9", 7168, "one-shot,two-shot,nccl", "0,1", 3, 122)[1] == ["one-shot", "two-shot", "nccl"]


def test_bench_allreduce_names_where_the_two_shot_starts_to_win():
    from ddtree.bench.allreduce import faster_from
    rows = [{"impl": impl, "bytes": b, "mode": "in_graph", "us": us}
            for b, one, two in ((14336, 9.0, 16.0), (129024, 40.0, 24.0), (243712, 69.0, 31.0))
            for impl, us in (("one-shot", one), ("two-shot", two))]
    assert faster_from(rows, "two-shot", "one-shot") == 129024
    assert faster_from(rows, "one-shot", "two-shot") is None
