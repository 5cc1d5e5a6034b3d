"""All-reduce and all-gather between rank processes on one host, over shared memory (docs/interfaces.md 9).

The one-shot protocol the GPU ranks use over PCIe peer to peer, with the host's memory as the wire:

    push     collective #k (every rank counts its collectives; all ranks run the same sequence) uses slot
             k % 2. Rank s writes its part into data[d, slot, s] of every peer d, then its byte count into
             sent[d, slot, s], then publishes seq[d, slot, s] = k (release: the payload is written first)
    wait     rank d reads seq[d, slot, s] until it equals k for every s (acquire: the flag is read before
             the payload), then copies the parts out
    combine  all-reduce sums the N parts in rank order 0..N-1 in the tensor's dtype (the GPU sums in
             float32 in the same order), all-gather stacks them in rank order: every rank ends with the
             same bits
    double   slot k % 2 cannot be overwritten by collective k + 2 before every rank has read it: a rank
    buffer   reaches k + 2 only after k + 1 completed, which needs every peer's k + 1 part, which a peer
             publishes only after it finished reading k
A message larger than a slot goes as several collectives of one slot each (chunks).

Memory order: numpy's copy into the mapping and the int64 flag store are plain stores, issued in
program order by the interpreter (separate C calls); x86-64 (TSO) keeps stores in order and loads in
order, so a reader that sees seq == k also sees the payload written before it. An aligned int64 store is
atomic there. Other architectures need fences, so the group refuses to start elsewhere.

Liveness: every rank's heartbeat thread writes time.monotonic() (one clock for the whole host) into
beat[rank] every HEARTBEAT_PERIOD_S. Every wait checks, while it spins: a peer that stopped with an error
(failed[r] and its note), a peer without a heartbeat for `heartbeat_s` (frozen or dead), a peer process
that exited (rank 0 holds the workers' handles: `exit_code`), and the overall `timeout_s`. The error names
the rank waited for, the collective's number and what it was for (its tag and layer).

Space: the owner checks /dev/shm's free space against the segment before creating it, and reserves every
page of it at creation (posix_fallocate), so a full /dev/shm is a ResourceError naming both sizes before
any rank starts, never a SIGBUS on the first write to a page tmpfs could not supply.

Layout of the one segment ({prefix}{owner pid}_{random}; the owner creates and unlinks it):
    beat [N] f64 | failed [N] i64 (0, or the index of the error class in FAILURES) | seq [N, 2, N] i64 |
    sent [N, 2, N] i64 | note [N, NOTE_BYTES] u8 | data [N dest, 2 slot, N src, slot_bytes] u8
"""
from __future__ import annotations

import os
import platform
import secrets
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from ddtree.errors import ResourceError
from ddtree.parallel.collectives import rank_order_sum

SHM_DIR = "/dev/shm"                    # where POSIX shared memory lives on Linux (a tmpfs)
SEGMENT_PREFIX = "ddtree_"              # /dev/shm/ddtree_<owner pid>_<hex>: tests look for leftovers by it
HEARTBEAT_PERIOD_S = 0.05
NOTE_BYTES = 512
SLOT_BYTES = 1 << 18                    # 256 KiB per (dest, slot, src): a tp 4 group maps 8 MiB


class RankError(RuntimeError):
    """A rank process failed, froze, died or lost rank 0; the message names the rank and what it did."""


class RankTimeoutError(RankError):
    """A peer is alive (heartbeat) but did not publish its part within the group's timeout."""


class RankUnresponsiveError(RankError):
    """A peer's heartbeat stopped: frozen (SIGSTOP) or dead."""


class RankDiedError(RankError):
    """A peer process exited."""


class RankFailedError(RankError):
    """A peer stopped with an error of its own (its note is in the message)."""


class RankOrphanedError(RankError):
    """Rank 0, the parent of this worker, is gone."""


FAILURES = (None, RankFailedError, RankTimeoutError, RankUnresponsiveError, RankDiedError, RankOrphanedError)


@dataclass(frozen=True)
class GroupSpec:
    """What a rank needs to attach to the group (picklable, sent to the spawned workers)."""
    name: str
    size: int
    slot_bytes: int = SLOT_BYTES
    timeout_s: float = 60.0
    heartbeat_s: float = 5.0

    def layout(self) -> dict[str, tuple[int, tuple, np.dtype]]:
        """name -> (byte offset, shape, dtype) of every array in the segment."""
        N, out, at = self.size, {}, 0
        for name, shape, dt in (("beat", (N,), np.float64), ("failed", (N,), np.int64), ("seq", (N, 2, N), np.int64),
                                ("sent", (N, 2, N), np.int64), ("note", (N, NOTE_BYTES), np.uint8),
                                ("data", (N, 2, N, self.slot_bytes), np.uint8)):
            out[name] = (at, shape, np.dtype(dt))
            at += int(np.prod(shape)) * np.dtype(dt).itemsize
        return out

    def nbytes(self) -> int:
        off, shape, dt = self.layout()["data"]
        return off + int(np.prod(shape)) * dt.itemsize


def new_spec(size: int, **kw) -> GroupSpec:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RankError(f"the shared-memory group relies on x86-64 store order (TSO); this is {platform.machine()}")
    return GroupSpec(f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}", size, **kw)


class SharedMemoryGroup:
    """One rank's handle on the group. `create=True` (rank 0, the owner) makes the segment; `exit_code(r)`
    (optional) says whether peer r's process has exited (None while it runs)."""

    def __init__(self, spec: GroupSpec, rank: int, create: bool = False, exit_code=None, parent_pid: int | None = None):
        self.spec, self.rank, self.size, self.owner = spec, rank, spec.size, create
        self.exit_code, self.parent_pid = exit_code, parent_pid
        self.count = 0                                              # collectives run by this rank
        self.shm = create_segment(spec) if create else shared_memory.SharedMemory(spec.name)
        for name, (off, shape, dt) in spec.layout().items():
            setattr(self, name, np.ndarray(shape, dt, buffer=self.shm.buf, offset=off))
        if create:                                                  # a peer still starting counts as alive
            self.failed[:] = 0
            self.seq[:] = 0
            self.beat[:] = time.monotonic()
        self.beat[rank] = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name=f"rank {rank} heartbeat", daemon=True)
        self._thread.start()

    # collectives -------------------------------------------------------------------------------
    def all_reduce(self, rank: int, x: np.ndarray, what: str = "") -> np.ndarray:
        """The sum of every rank's x, in rank order 0..N-1, in x's dtype."""
        return rank_order_sum(self._exchange(np.asarray(x), "all_reduce", what))

    def all_gather(self, rank: int, x: np.ndarray, what: str = "") -> np.ndarray:
        """Every rank's x stacked in rank order: [N, *x.shape]."""
        return np.stack(self._exchange(np.asarray(x), "all_gather", what))

    def _exchange(self, x: np.ndarray, op: str, what: str) -> list[np.ndarray]:
        mine = np.ascontiguousarray(x).view(np.uint8).reshape(-1)           # the part as bytes
        got = [np.empty(mine.size, np.uint8) for _ in range(self.size)]
        got[self.rank] = mine
        step = self.spec.slot_bytes
        for lo in range(0, max(mine.size, 1), step):
            self._one_shot(mine[lo: lo + step], lo, got, op, what)
        return [g.view(x.dtype).reshape(x.shape) for g in got]

    def _one_shot(self, chunk: np.ndarray, lo: int, got: list, op: str, what: str) -> None:
        self.count += 1
        k, slot, me, n = self.count, self.count % 2, self.rank, chunk.size
        for d in range(self.size):                                  # push into every peer's slot
            if d != me:
                self.data[d, slot, me, :n] = chunk
                self.sent[d, slot, me] = n
                self.seq[d, slot, me] = k                           # release: after the payload
        for s in range(self.size):                                  # wait for every peer, in rank order
            if s == me:
                continue
            self._wait(s, slot, k, op, what)                        # acquire: the flag before the payload
            if self.sent[me, slot, s] != n:
                self._raise(RankFailedError, f"rank {s} sent {int(self.sent[me, slot, s])} bytes for {op} #{k} "
                            f"({what}) where rank {me} sent {n}: the ranks run different collectives")
            got[s][lo: lo + n] = self.data[me, slot, s, :n]

    # liveness ----------------------------------------------------------------------------------
    def _wait(self, src: int, slot: int, k: int, op: str, what: str) -> None:
        start, delay, checked = time.monotonic(), 2e-6, 0.0
        while self.seq[self.rank, slot, src] != k:
            now = time.monotonic()
            if now - checked > 0.01:
                checked = now
                self._check(src, f"{op} #{k} ({what})", now - start)
            time.sleep(delay)
            delay = min(2 * delay, 5e-4)

    def _check(self, src: int, doing: str, waited: float) -> None:
        me, cls = self.rank, None
        for r in range(self.size):
            if r != me and self.failed[r]:
                note = bytes(self.note[r]).rstrip(b"\0").decode(errors="replace")   # the first rank's finding,
                self._raise(FAILURES[int(self.failed[r])],                          # raised as its own class
                            f"{note} (found by rank {r}; rank {me} was waiting for {doing})")
        if self.exit_code is not None and (code := self.exit_code(src)) is not None:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            cls, why = RankDiedError, f"rank {src} died ({how}) before it published {doing}"
        elif self.parent_pid is not None and os.getppid() != self.parent_pid:
            cls, why = RankOrphanedError, f"rank 0 (pid {self.parent_pid}) is gone while rank {me} waited for {doing}"
        elif time.monotonic() - self.beat[src] > self.spec.heartbeat_s:
            cls, why = RankUnresponsiveError, (f"rank {src} sent no heartbeat for {self.spec.heartbeat_s:g} s "
                                               f"(frozen or dead) and did not publish {doing}")
        elif waited > self.spec.timeout_s:
            cls, why = RankTimeoutError, f"rank {src} did not publish {doing} within {self.spec.timeout_s:g} s"
        if cls is not None:
            self._raise(cls, why)

    def _raise(self, cls, message: str):
        self.fail(message, cls)
        raise cls(message)

    def fail(self, message: str, cls=RankFailedError) -> None:
        """Mark this rank stopped with `message` (the first one kept) and the error class, so every peer's
        wait ends now with the same error."""
        if self.shm is None or self.failed[self.rank]:
            return
        raw = message.encode()[: NOTE_BYTES - 1]
        self.note[self.rank, :] = 0
        self.note[self.rank, : len(raw)] = np.frombuffer(raw, np.uint8)
        self.failed[self.rank] = FAILURES.index(cls)                # after the note (same store order)

    def abort(self) -> None:
        self.fail(f"rank {self.rank} aborted")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_PERIOD_S):
            self.beat[self.rank] = time.monotonic()

    # life cycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the heartbeat, unmap; the owner also unlinks the segment. Idempotent."""
        if self.shm is None:
            return
        self._stop.set()
        self._thread.join()
        for name in self.spec.layout():
            setattr(self, name, None)
        shm, self.shm = self.shm, None
        shm.close()
        if self.owner:
            unlink(self.spec.name)


def shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:                         # no /dev/shm to ask (another OS): creation will tell
        return None
    return st.f_bavail * st.f_frsize


def create_segment(spec: GroupSpec) -> shared_memory.SharedMemory:
    """The group's segment, its free space checked first and every page reserved (posix_fallocate)."""
    need = spec.nbytes()
    free = shm_free_bytes()
    if free is not None and need > free:
        raise ResourceError(f"{SHM_DIR}: the rank group's shared memory needs {need} bytes, {free} are free "
                            f"(free {SHM_DIR}, or raise its size: mount -o remount,size=... {SHM_DIR})")
    try:
        shm = shared_memory.SharedMemory(spec.name, create=True, size=need)
    except OSError as e:
        raise ResourceError(f"{SHM_DIR}: could not create the rank group's {need}-byte segment: {e}") from e
    try:
        if hasattr(os, "posix_fallocate"):             # Linux: tmpfs supplies every page now, or says ENOSPC now
            os.posix_fallocate(shm._fd, 0, need)
    except OSError as e:
        shm.close()
        shm.unlink()
        raise ResourceError(f"{SHM_DIR}: could not reserve the rank group's {need} bytes ({e}); free "
                            f"{SHM_DIR} or raise its size") from e
    return shm


def unlink(name: str) -> None:
    """Remove the segment by name (safe if it is already gone); also drops the resource tracker's entry."""
    try:
        seg = shared_memory.SharedMemory(name)
    except FileNotFoundError:
        return
    seg.close()
    seg.unlink()
