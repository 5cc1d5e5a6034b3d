"""Which implementation carries a rank's collective (docs/interfaces.md section 9: `--allreduce one-shot|nccl|auto`).

    collective = RankCollective(one_shot=ar, nccl=group, one_shot_max_bytes=AUTO_ONE_SHOT_MAX_BYTES)
    collective.all_reduce(x, out, elems, stream)    # device addresses; bf16 sum
    collective.all_gather(x, out, nbytes, stream)   # out [nranks, nbytes] in rank order
    collective.check()                              # after a sync: a late peer or an NCCL error, named
    collective.describe()                           # "one-shot", "nccl" or "one-shot <= 1048576 B, nccl above"

The one-shot (plugins/allreduce.py) sums in rank order with one rounding; NCCL (parallel/nccl_group.py) in its own
order: both leave identical bits on every rank, but not each other's bits. The choice is made per call from the
message's size alone, which every rank knows, so every rank takes the same implementation for the same call and
each implementation's sequence of calls agrees across ranks (the one-shot's device counter relies on that).

`auto`: the one-shot up to one_shot_max_bytes, NCCL above. AUTO_ONE_SHOT_MAX_BYTES is the top of the range the
one-shot was measured faster in (docs/hardware-and-kernels.md 4.4: 2 NVLink-joined H200s, up to 932 KB at M = 65,
against NCCL through torch); on a PCIe box re-measure with `ddtree bench allreduce`, whose JSON names the
crossover. Ranks that share a GPU have no NCCL (it refuses two ranks on one device): `auto` is the one-shot there,
and describe() says so.
"""
from __future__ import annotations

from ddtree.parallel.nccl_group import NcclError

ALLREDUCE_CHOICES = ("one-shot", "nccl", "auto")
AUTO_ONE_SHOT_MAX_BYTES = 1 << 20


def allreduce_refusal(choice: str, gpus: list[int]) -> str | None:
    """Why `--allreduce choice` cannot run on ranks placed on `gpus` (None: it can)."""
    if choice not in ALLREDUCE_CHOICES:
        return f"--allreduce {choice!r}: expected one of {', '.join(ALLREDUCE_CHOICES)}"
    if choice == "nccl" and len(set(gpus)) != len(gpus):
        return (f"--allreduce nccl: NCCL needs one GPU per rank, and --gpu {','.join(map(str, gpus))} puts ranks on "
                "one GPU (use --allreduce one-shot, or one GPU index per rank)")
    return None


def collective_parts(choice: str, gpus: list[int]) -> tuple[bool, bool, int | None]:
    """(one-shot?, nccl?, one_shot_max_bytes) for a checked choice; ranks sharing a GPU get no NCCL."""
    distinct = len(set(gpus)) == len(gpus)
    if choice == "one-shot" or (choice == "auto" and not distinct):
        return True, False, None
    if choice == "nccl":
        return False, True, None
    return True, True, AUTO_ONE_SHOT_MAX_BYTES


class RankCollective:
    """A rank's collectives over its connected one-shot (plugins/allreduce.py) and/or NCCL communicator
    (parallel/nccl_group.py). With both, a message of at most one_shot_max_bytes goes through the one-shot (None: every
    message it holds), a larger one through NCCL; with one, that one (the one-shot refuses what it cannot hold)."""

    def __init__(self, nccl=None, one_shot=None, one_shot_max_bytes: int | None = None):
        if nccl is None and one_shot is None:
            raise ValueError("RankCollective: neither a one-shot all-reduce nor an NCCL communicator")
        self.nccl, self.one_shot, self.one_shot_max_bytes = nccl, one_shot, one_shot_max_bytes
        source = one_shot if one_shot is not None else nccl
        self.rank, self.nranks = source.rank, source.nranks

    @property
    def one_shot_limit(self) -> int:
        """With both: the largest message the one-shot carries (bytes), at most what it holds."""
        held = self.one_shot.max_bytes
        return held if self.one_shot_max_bytes is None else min(self.one_shot_max_bytes, held)

    def _by_one_shot(self, nbytes: int) -> bool:
        if self.one_shot is None or self.nccl is None:
            return self.one_shot is not None
        return nbytes <= self.one_shot_limit

    def all_reduce(self, x: int, out: int, elems: int, stream) -> None:
        """out [elems] bf16 = the sum of every rank's x."""
        if self._by_one_shot(2 * elems):
            self.one_shot(x, out, elems, stream=stream)
        else:
            self.nccl.all_reduce(x, out, elems, stream=stream)

    def all_gather(self, x: int, out: int, nbytes: int, stream) -> None:
        """out [nranks, nbytes] = every rank's x in rank order (bytes of any dtype)."""
        if self._by_one_shot(nbytes):
            self.one_shot.all_gather(x, out, nbytes, stream=stream)
        else:
            self.nccl.all_gather(x, out, nbytes, stream=stream, dtype="u8")

    def check(self) -> None:
        """Raise if a one-shot peer did not answer in time or NCCL reported an asynchronous error (syncs)."""
        if self.one_shot is not None:
            self.one_shot.check()
        if self.nccl is not None:
            code = self.nccl.async_error()
            if code:
                self.nccl.abort()
                raise NcclError(f"NCCL rank {self.rank}: asynchronous error {code} (communicator aborted)")

    def describe(self) -> str:
        if self.nccl is None:
            return "one-shot"
        if self.one_shot is None:
            return "nccl"
        return f"one-shot <= {self.one_shot_limit} B, nccl above"
