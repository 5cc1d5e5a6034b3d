"""Which implementation carries a rank's collective (docs/interfaces.md section 9:
`--allreduce one-shot|two-shot|nccl|auto`).

    collective = RankCollective(one_shot=ar, nccl=group, models=(ONE_SHOT, TWO_SHOT, NCCL))
    collective.all_reduce(x, out, elems, stream)    # device addresses; bf16 sum
    collective.all_gather(x, out, nbytes, stream)   # out [nranks, nbytes] in rank order
    collective.check()                              # after a sync: a late peer or an NCCL error, named
    collective.describe()                           # "one-shot", "nccl", "one-shot / two-shot / nccl by size ..."

The one-shot and the two-shot (plugins/allreduce.py: two protocols of one exchange buffer) sum in rank order with
one rounding, so they give the same bits; NCCL (parallel/nccl_group.py) sums in its own order: identical bits on
every rank, but not the one-shot's. The choice is made per call from the message's size alone, which every rank
knows (parallel/collective_models.py choose_protocol, a pure function of size, tp and the models), so every rank
takes the same implementation and protocol for the same call and each implementation's sequence of calls agrees
across ranks (the one-shot buffer's device counter relies on that).

`auto`: the cheapest of the PCIe models (parallel/collective_models.py: the one-shot for small messages, the
two-shot above ~41 KB, NCCL above ~750 KB at tp 8) among the implementations present. Ranks that share a GPU
have no NCCL (it refuses two ranks on one device): `auto` chooses between the one-shot and the two-shot there,
and describe() says so. On another machine re-measure with `ddtree bench allreduce --impl one-shot,two-shot,nccl`.
"""
from __future__ import annotations

from ddtree.parallel.collective_models import NCCL, ONE_SHOT, TWO_SHOT, choose_protocol, models_for
from ddtree.parallel.nccl_group import NcclError

ALLREDUCE_CHOICES = ("one-shot", "two-shot", "nccl", "auto")
ONE_SHOT_KINDS = ("one-shot", "two-shot")       # protocols of the one-shot's exchange buffer (plugins/allreduce.py)


def allreduce_refusal(choice: str, gpus: list[int]) -> str | None:
    """Why `--allreduce choice` cannot run on ranks placed on `gpus` (None: it can)."""
    if choice not in ALLREDUCE_CHOICES:
        return f"--allreduce {choice!r}: expected one of {', '.join(ALLREDUCE_CHOICES)}"
    if choice == "nccl" and len(set(gpus)) != len(gpus):
        return (f"--allreduce nccl: NCCL needs one GPU per rank, and --gpu {','.join(map(str, gpus))} puts ranks on "
                "one GPU (use --allreduce one-shot, or one GPU index per rank)")
    return None


def collective_parts(choice: str, gpus: list[int]) -> tuple[bool, bool, tuple | None]:
    """(one-shot?, nccl?, models) for a checked choice: models are what RankCollective chooses among per message
    (None: the one implementation present, the one-shot in its own protocol). Ranks sharing a GPU get no NCCL."""
    distinct = len(set(gpus)) == len(gpus)
    if choice == "one-shot":
        return True, False, None
    if choice == "two-shot":
        return True, False, (TWO_SHOT,)
    if choice == "nccl":
        return False, True, None
    return True, distinct, (ONE_SHOT, TWO_SHOT, NCCL) if distinct else (ONE_SHOT, TWO_SHOT)


class RankCollective:
    """A rank's collectives over its connected one-shot (plugins/allreduce.py) and/or NCCL communicator
    (parallel/nccl_group.py). models (AllReduceModels, parallel/collective_models.py): each message goes to the
    cheapest of them (choose_protocol) whose implementation is present, a one-shot kind only up to one_shot_limit
    when NCCL is there too; all-gathers choose between the one-shot and NCCL models (the two-shot is an all-reduce).
    Without models: with both, a message of at most one_shot_max_bytes goes through the one-shot (None: every message
    it holds), a larger one through NCCL; with one, that one (the one-shot refuses what it cannot hold)."""

    def __init__(self, nccl=None, one_shot=None, one_shot_max_bytes: int | None = None, models=None):
        if nccl is None and one_shot is None:
            raise ValueError("RankCollective: neither a one-shot all-reduce nor an NCCL communicator")
        for m in models or ():
            if m.name not in (*ONE_SHOT_KINDS, "nccl"):
                raise ValueError(f"RankCollective: model {m.name!r} names no implementation (expected one of "
                                 f"{', '.join((*ONE_SHOT_KINDS, 'nccl'))})")
            if (one_shot if m.name in ONE_SHOT_KINDS else nccl) is None:
                raise ValueError(f"RankCollective: model {m.name!r} needs "
                                 f"{'the one-shot all-reduce' if m.name in ONE_SHOT_KINDS else 'NCCL'}, which this "
                                 "rank does not have")
        if models is not None and not models:
            raise ValueError("RankCollective: models is empty (None: no choice by size)")
        self.nccl, self.one_shot, self.one_shot_max_bytes = nccl, one_shot, one_shot_max_bytes
        self.models = None if models is None else tuple(models)
        source = one_shot if one_shot is not None else nccl
        self.rank, self.nranks = source.rank, source.nranks

    def choice(self, nbytes: int, gather: bool = False) -> str:
        """The implementation of a message of nbytes (an all-gather's: every rank's part together): "one-shot",
        "two-shot" or "nccl", the same on every rank for the same size."""
        part = nbytes // self.nranks if gather else nbytes     # what the one-shot's buffer must hold
        if self.models is None:
            return "one-shot" if self._by_one_shot(part) else "nccl"
        models = models_for("all_gather" if gather else "all_reduce", self.models)
        held = self.nccl is None or part <= self.one_shot_limit
        fits = [m for m in models if m.name == "nccl" or held]
        return choose_protocol(nbytes, self.nranks, fits or models)

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
        impl = self.choice(2 * elems)
        if impl == "two-shot":
            self.one_shot(x, out, elems, stream=stream, protocol="two-shot")
        elif impl == "one-shot":
            self.one_shot(x, out, elems, stream=stream)
        else:
            self.nccl.all_reduce(x, out, elems, stream=stream)

    def all_gather(self, x: int, out: int, nbytes: int, stream) -> None:
        """out [nranks, nbytes] = every rank's x in rank order (bytes of any dtype)."""
        if self.choice(nbytes * self.nranks, gather=True) == "one-shot":
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
        if self.models is not None:
            names = [m.name for m in self.models]
            return names[0] if len(names) == 1 else (f"{' / '.join(names)} by message size (the PCIe model, "
                                                     "parallel/collective_models.py)")
        if self.nccl is None:
            return "one-shot"
        if self.one_shot is None:
            return "nccl"
        return f"one-shot <= {self.one_shot_limit} B, nccl above"
