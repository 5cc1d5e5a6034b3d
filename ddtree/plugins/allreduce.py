"""One-shot all-reduce of bf16, and all-gather of any bytes, between rank processes whose GPUs map each other's
memory, or that share one GPU (kernels/allreduce.cu; docs/interfaces.md section 9: the `one-shot` implementation).

    ar = OneShotAllReduce(gpu, rank, nranks, max_elems=65 * 7168)
    handles = exchange(ar.ipc_handle())            # the caller moves the bytes between processes (a pipe)
    ar.connect(handles)                             # opens every peer's buffer (CUDA IPC, peer access)
    ar(x, out, elems)                               # launches only: capturable, no sync, no allocation
    ar(x, out, elems, protocol="two-shot")          # reduce-scatter + all-gather (PROTOCOLS; every rank the same)
    ar.all_gather(x, out, nbytes)                   # out [N, nbytes] = every rank's x in rank order
    ar.error_ranks()                                # after a sync: peers that did not answer in time

Protocol (push, one kernel): collective number seq = the device counter + 1 uses slot seq & 1 of every
rank's exchange buffer. Each block pushes its chunk of x into data[slot][rank] of every peer, publishes
flags[0][slot][rank][block] = seq there (release, system scope), waits for its own flags[0][slot][r][block] ==
seq from every peer r (acquire, at most max_spins polls, then bit r of the error word), and sums the
parts in rank order 0..N-1 in float32 with one rounding to bf16, so every rank holds identical bits
(reference_sum is the numpy twin). The last block stores seq into the counter: a captured graph replays
with the count moving on, and every rank must run the same sequence of collectives on its buffer.
Double buffering is safe: a rank reaches collective k + 2 only after k + 1 completed, which needed every
peer's k + 1 flags, which a peer publishes only after its kernel k (all reads of slot k & 1) finished.

Pull (protocol="pull", allreduce_pull; the alternative issue 25 asks to measure): each block copies its chunk
into data[slot][rank] of its own buffer, publishes the same flags, waits the same way, then reads every peer
s's chunk from data[slot][s] of s's buffer and sums in the same rank order: the same bits as push. The link
carries peer writes in push and peer reads in pull (on PCIe a read is a non-posted round trip).

Two-shot (protocol="two-shot", allreduce_two_shot; issue 49: on PCIe a rank moves 2 (N-1)/N of the message
instead of (N-1) times it, for a second synchronisation round): reduce-scatter, then all-gather. The n8 vectors
are cut into N chunks of ceil(n8 / N) vectors (two_shot_chunks: the last shorter or empty), and block b owns
the same share of every chunk (two_shot_grid). Phase 1 (flag round 0): rank r pushes chunk c of x into
data[slot][r] of rank c, at chunk c's place; publishes flags[0][slot][r][b]; waits for every peer's; sums its
own chunk over the N parts in rank order 0..N-1 in float32 with one rounding (reference_sum's bits for that
chunk), writes it into out and into data[slot][r] of every peer at chunk r's place (a place phase 1 never
writes in that buffer: rank r wrote only chunk c's place of rank c's buffer). Phase 2 (flag round 1):
publishes flags[1][slot][r][b], waits, and copies every peer s's summed chunk from data[slot][s] into out.
two_shot_twin is the numpy twin of both phases, chunk by chunk.

Protocols may change from one collective to the next (RankCollective chooses per message size), but every rank
must use the same one for the same collective number: within one collective the ranks' writes and reads are
laid out for one protocol (a mix reads stale parts). Double buffering holds for any such sequence: collective k
(any protocol) touches only slot k & 1 (data and flags), all inside its kernel k, and on every rank that kernel
finishes only after it saw, in every round it has, a flag of k from every peer. A peer publishes its first flag
of k only after its kernel k - 1 finished. So a rank that reaches collective k + 2 (after its kernel k + 1,
which saw every peer's k + 1 flags) knows every peer finished kernel k: every read of slot k & 1, in its own
buffer or in others', and every wait on a k flag is over before the slot's data or flags are written again.
Within collective k the regions written never overlap one another (push: data[slot][r] of each peer; pull:
data[slot][r] of r's own; two-shot: chunk c's place and, in round 1, chunk r's place of data[slot][r]) and the
two rounds' flags are distinct words, so a round-0 flag never releases a round-1 wait.

All-gather (allgather_push): the same collective moving bytes, so it shares the buffer, the slots, the flags,
the device counter and the error word with the all-reduce (one numbering: a rank's all-reduces and all-gathers
stay in one order, and the argument above holds for any mix of the two). Block b pushes its chunk of x
into data[slot][rank] of every peer, publishes, waits, then copies its chunk of every rank's part (its own
from x) into out[r * nbytes:] in rank order. The numpy twin is np.stack of the ranks' parts: nothing is
computed, so every rank's out equals it bit for bit, for any dtype.

Layout of one exchange buffer (bytes): flags [2 round, 2 slot, AR_MAX_RANKS, AR_MAX_BLOCKS] u64 (round 1: the
two-shot's all-gather), then data [2 slot, N src, region_bytes(max_elems)].
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins.compile import defines_for
from ddtree.plugins.device import DeviceArray, Gpu, _driver, check, ptr

SOURCE = "allreduce.cu"
THREADS = 256                       # threads per block; one 16-byte vector (8 bf16) per thread and step
VECTOR = 8                          # bf16 per 16-byte vector: elems must be a multiple of it
PROTOCOLS = ("push", "pull", "two-shot")   # how an all-reduce's parts cross the link (all-gathers always push)
KERNELS = {"push": "allreduce_push", "pull": "allreduce_pull", "two-shot": "allreduce_two_shot"}
ROUNDS = 2                          # flag rounds of the layout: every protocol's exchange, the two-shot's all-gather
DEFAULT_MAX_SPINS = 2_000_000       # polls of one flag before a peer counts as lost (~1 s: 200 ns sleeps)


class AllReduceError(RuntimeError):
    """A peer rank did not publish its part within the spin bound (dead, hung or out of sequence)."""


def limits() -> tuple[int, int]:
    """(max ranks, max blocks) the kernel is compiled for (compile.SOURCES, the one table)."""
    d = defines_for(SOURCE, "sm_90")
    return d["AR_MAX_RANKS"], d["AR_MAX_BLOCKS"]


def flag_bytes() -> int:
    max_ranks, max_blocks = limits()
    return ROUNDS * 2 * max_ranks * max_blocks * 8


def region_bytes(max_elems: int) -> int:
    """Bytes of one (slot, src) part: max_elems bf16, rounded up to 256 B."""
    return -(-2 * max_elems // 256) * 256


def exchange_bytes(nranks: int, max_elems: int) -> int:
    return flag_bytes() + 2 * nranks * region_bytes(max_elems)


def slot_of(seq: int) -> int:
    """The slot collective number seq (1, 2, ...) uses."""
    return seq & 1


def region_offset(slot: int, src: int, nranks: int, max_elems: int) -> int:
    """Byte offset of src's part of `slot` in a rank's exchange buffer."""
    return flag_bytes() + (slot * nranks + src) * region_bytes(max_elems)


def flag_offset(slot: int, src: int, block: int, round: int = 0) -> int:
    """Byte offset of flags[round][slot][src][block] in a rank's exchange buffer."""
    max_ranks, max_blocks = limits()
    return (((round * 2 + slot) * max_ranks + src) * max_blocks + block) * 8


def gather_grid(nbytes: int) -> tuple[int, int]:
    """(blocks, 16-byte vectors per block) of an all-gather of nbytes: block b owns bytes [b * per * 16,
    (b + 1) * per * 16) of every part, cut at nbytes (the kernel computes per the same way)."""
    n16 = -(-nbytes // 16)
    blocks = max(1, min(limits()[1], -(-n16 // THREADS)))
    return blocks, -(-n16 // blocks)


def gather_unit(nbytes: int, x: int, out: int) -> int:
    """The word the all-gather moves on this rank: the largest of 16, 8, 4, 2, 1 bytes that divides nbytes and
    aligns x and out (so out + r * nbytes too). Chunk edges are multiples of 16, so ranks may differ in it."""
    return math.gcd(16, nbytes, int(x), int(out))


def grid_for(elems: int) -> tuple[int, int]:
    """(blocks, vectors per block) for elems bf16: one block per THREADS vectors, at most AR_MAX_BLOCKS."""
    n8 = elems // VECTOR
    blocks = max(1, min(limits()[1], -(-n8 // THREADS)))
    return blocks, -(-n8 // blocks)


def two_shot_chunks(elems: int, nranks: int) -> list[tuple[int, int]]:
    """Element range [lo, hi) of rank c's chunk of a two-shot all-reduce of elems bf16, c = 0..nranks-1: ceil(n8 /
    nranks) 16-byte vectors each, the last ones shorter or empty (the kernel's chunk)."""
    n8 = elems // VECTOR
    chunk = -(-n8 // nranks)
    return [(VECTOR * min(n8, c * chunk), VECTOR * min(n8, (c + 1) * chunk)) for c in range(nranks)]


def two_shot_grid(elems: int, nranks: int) -> tuple[int, int]:
    """(blocks, vectors per block of each chunk) of a two-shot all-reduce: grid_for of one chunk. Block b owns
    vectors [b * per, (b + 1) * per) of every chunk, cut at the chunk's end (the kernel's chunk_span)."""
    lo, hi = two_shot_chunks(elems, nranks)[0]
    return grid_for(max(hi - lo, VECTOR))


def reference_sum(partials: list[np.ndarray]) -> np.ndarray:
    """The numpy twin: bf16 bits of the rank-ordered float32 sum of bf16 parts (uint16 bits in, out)."""
    acc = bf16_to_f32(partials[0]).copy()
    for p in partials[1:]:
        acc += bf16_to_f32(p)
    return f32_to_bf16(acc)


def two_shot_twin(partials: list[np.ndarray]) -> list[np.ndarray]:
    """The two-shot's numpy twin: every rank's out (uint16 bits), by the kernel's two phases over emulated exchange
    buffers data[rank][src] (filled with 0xFFFF, a NaN, so a chunk nobody wrote shows). Phase 1: rank s's chunk c
    lands in data[c][s]; rank c sums its chunk over the parts in rank order in float32, rounds once, and pushes
    the sum into data[d][c] of every peer d. Phase 2: rank d's out is its own sum and data[d][c] for c != d."""
    n, elems = len(partials), partials[0].size
    chunks = two_shot_chunks(elems, n)
    data = np.full((n, n, elems), 0xFFFF, np.uint16)
    for s in range(n):                                          # reduce-scatter: chunk c of rank s to rank c
        for c, (lo, hi) in enumerate(chunks):
            if c != s:
                data[c, s, lo:hi] = partials[s][lo:hi]
    summed = []
    for c, (lo, hi) in enumerate(chunks):                       # rank c's chunk, rank order, one rounding
        acc = np.zeros(hi - lo, np.float32)
        for s in range(n):
            acc += bf16_to_f32(partials[c][lo:hi] if s == c else data[c, s, lo:hi])
        summed.append(f32_to_bf16(acc))
        for d in range(n):                                      # all-gather: the sum to every peer
            if d != c:
                data[d, c, lo:hi] = summed[c]
    outs = []
    for d in range(n):
        out = np.full(elems, 0xFFFF, np.uint16)
        for c, (lo, hi) in enumerate(chunks):
            out[lo:hi] = summed[c] if c == d else data[d, c, lo:hi]
        outs.append(out)
    return outs


# ---- CUDA IPC and peer access (cuda.bindings.driver) -----------------------------------------------
def ipc_handle(address: int) -> bytes:
    """The 64-byte IPC handle of a cuMemAlloc allocation (its base address)."""
    handle = check(_driver().cuIpcGetMemHandle(address), "cuIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), _driver().CU_IPC_HANDLE_SIZE)


def open_ipc(handle_bytes: bytes) -> int:
    """Map a peer's allocation into this process (peer access enabled): its address here."""
    driver = _driver()
    handle = driver.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), bytes(handle_bytes), driver.CU_IPC_HANDLE_SIZE)
    flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    return int(check(driver.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle"))


def close_ipc(address: int) -> None:
    check(_driver().cuIpcCloseMemHandle(address), "cuIpcCloseMemHandle")


def can_access_peer(device: int, peer: int) -> bool:
    driver = _driver()
    return bool(check(driver.cuDeviceCanAccessPeer(driver.CUdevice(device), driver.CUdevice(peer)),
                      "cuDeviceCanAccessPeer"))


class OneShotAllReduce:
    """One rank's side. max_elems: the largest message (bf16 elements) a call may reduce; an all-gather's part
    may have as many bytes as that (max_bytes). protocol: PROTOCOLS, the default of a call (a call may name
    another); every rank uses the same protocol for the same call."""

    def __init__(self, gpu: Gpu, rank: int, nranks: int, max_elems: int, max_spins: int = DEFAULT_MAX_SPINS,
                 protocol: str = "push"):
        max_ranks, _ = limits()
        if protocol not in PROTOCOLS:
            raise ValueError(f"one-shot all-reduce: protocol {protocol!r}; expected one of {PROTOCOLS}")
        if not 2 <= nranks <= max_ranks or not 0 <= rank < nranks:
            raise ValueError(f"one-shot all-reduce: rank {rank} of {nranks}; 2..{max_ranks} ranks are supported")
        if max_elems < VECTOR or max_elems % VECTOR:
            raise ValueError(f"one-shot all-reduce: max_elems = {max_elems} must be a positive multiple of {VECTOR}")
        self.gpu, self.rank, self.nranks, self.max_elems, self.protocol = gpu, rank, nranks, max_elems, protocol
        self.max_spins = int(max_spins)
        self.buffer = gpu.zeros(exchange_bytes(nranks, max_elems), np.uint8)
        self.state = gpu.zeros(4, np.uint64)           # [0] last seq, [1] blocks done, [2] low word: error bits
        self.error = self.state.view(2, (2,)).ptr      # int32 at byte 16
        self.kernels = {p: gpu.kernel(SOURCE, name) for p, name in KERNELS.items()}
        self.gather_kernel = gpu.kernel(SOURCE, "allgather_push")
        self.opened: list[int] = []
        self.peers: DeviceArray | None = None
        gpu.sync()                                     # zeroed before any peer can see the buffer

    def ipc_handle(self) -> bytes:
        return ipc_handle(self.buffer.ptr)

    def connect(self, handles: list[bytes]) -> None:
        """handles[r]: rank r's ipc_handle(), in rank order (this rank's own is not opened)."""
        if len(handles) != self.nranks:
            raise ValueError(f"one-shot all-reduce: {len(handles)} handles for {self.nranks} ranks")
        addresses = []
        for r, h in enumerate(handles):
            if r == self.rank:
                addresses.append(self.buffer.ptr)
            else:
                addresses.append(open_ipc(h))
                self.opened.append(addresses[-1])
        self.peers = self.gpu.upload(np.array(addresses, np.uint64))

    def __call__(self, x, out, elems: int, stream=None, protocol: str | None = None) -> None:
        """out [elems] bf16 = the rank-ordered sum of every rank's x [elems] (out may be x). protocol: this call's
        (None: the instance's), the same on every rank."""
        protocol = self.protocol if protocol is None else protocol
        if protocol not in PROTOCOLS:
            raise ValueError(f"one-shot all-reduce: protocol {protocol!r}; expected one of {PROTOCOLS}")
        if self.peers is None:
            raise RuntimeError("one-shot all-reduce: connect(handles) first")
        if not 0 < elems <= self.max_elems or elems % VECTOR:
            raise ValueError(f"one-shot all-reduce: elems = {elems} must be a multiple of {VECTOR} in "
                             f"[{VECTOR}, {self.max_elems}]")
        for what, a in (("x", x), ("out", out)):
            if int(ptr(a)) % 16:
                raise ValueError(f"one-shot all-reduce: {what} address {int(ptr(a)):#x} is not 16-byte aligned")
        blocks, _ = two_shot_grid(elems, self.nranks) if protocol == "two-shot" else grid_for(elems)
        self.gpu.launch(self.kernels[protocol], blocks, THREADS, 0, ptr(x), ptr(out), np.uint32(elems // VECTOR),
                        ptr(self.peers), np.int32(self.rank), np.int32(self.nranks),
                        np.uint64(region_bytes(self.max_elems)), ptr(self.state), np.uint64(self.error),
                        np.uint32(self.max_spins), stream=stream)

    @property
    def max_bytes(self) -> int:
        """The largest all-gather part (bytes a rank): the all-reduce's max_elems bf16."""
        return 2 * self.max_elems

    def all_gather(self, x, out, nbytes: int, stream=None) -> None:
        """out [nranks, nbytes] = every rank's x [nbytes] in rank order, bytes of any dtype (numpy twin:
        np.stack of the parts). Launches only, like __call__; collective number state[0] + 1 as well. x may be
        out's part `rank` (in place); no other overlap. Any alignment: the word moved is gather_unit's."""
        if self.peers is None:
            raise RuntimeError("one-shot all-gather: connect(handles) first")
        if not 0 < nbytes <= self.max_bytes:
            raise ValueError(f"one-shot all-gather: nbytes = {nbytes} must be in [1, {self.max_bytes}] "
                             f"(2 bytes per element of max_elems = {self.max_elems})")
        xa, oa = int(ptr(x)), int(ptr(out))
        if xa != oa + self.rank * nbytes and xa < oa + self.nranks * nbytes and oa < xa + nbytes:
            raise ValueError(f"one-shot all-gather: x [{xa:#x}, +{nbytes}) overlaps out [{oa:#x}, "
                             f"+{self.nranks} * {nbytes}) other than as its part {self.rank} (in place)")
        blocks, _ = gather_grid(nbytes)
        self.gpu.launch(self.gather_kernel, blocks, THREADS, 0, np.uint64(xa), np.uint64(oa), np.uint32(nbytes),
                        np.int32(gather_unit(nbytes, xa, oa)), ptr(self.peers), np.int32(self.rank),
                        np.int32(self.nranks), np.uint64(region_bytes(self.max_elems)), ptr(self.state),
                        np.uint64(self.error), np.uint32(self.max_spins), stream=stream)

    def sequence(self) -> int:
        """Collectives completed on this rank (syncs)."""
        return int(self.state.numpy()[0])

    def error_ranks(self) -> list[int]:
        """Peers that did not answer within the bound in some call so far (syncs)."""
        bits = int(self.state.numpy()[2]) & 0xFFFFFFFF
        return [r for r in range(self.nranks) if bits >> r & 1]

    def check(self) -> None:
        late = self.error_ranks()
        if late:
            raise AllReduceError(f"one-shot all-reduce on rank {self.rank}: rank(s) {late} did not publish "
                                 f"their part within {self.max_spins} polls (dead, hung or out of sequence)")

    def close(self) -> None:
        self.gpu.sync()
        for address in self.opened:
            close_ipc(address)
        self.opened.clear()
