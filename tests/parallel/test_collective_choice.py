"""The choice of all-reduce by message size (issue 49; parallel/collective_models.py, parallel/rank_collective.py):
the two-shot model is derived from the one-shot fit as its docstring says; choose_protocol takes the one-shot below
and the two-shot above their crossover, and NCCL above the two-shot's, each crossover computed here from the fit's
numbers by the formula; a rank's RankCollective launches what choose_protocol names (the two-shot as the one-shot
buffer's protocol), never the two-shot for an all-gather, and the same sequence on every rank; bench project's rows
and bench step's PCIe stand-ins name and price the same choice."""
import json

import pytest
from click.testing import CliRunner

from ddtree.bench.bench_ops import PcieCollective
from ddtree.bench.projection import ALLREDUCE_CHOICES, TWO_SHOT
from ddtree.cli import main
from ddtree.parallel.collective_models import (
    NCCL,
    ONE_SHOT,
    AllReduceModel,
    choose_protocol,
    models_for,
    two_shot_from,
)
from ddtree.parallel.rank_collective import RankCollective
from ddtree.plugins.allreduce import grid_for, two_shot_grid

ROW = 7168 * 2                                           # one row of Kimi's hidden state, bf16


def formula_us(latency_us, gbps, nbytes, n=8):
    return latency_us + nbytes * (n - 1) / n / (gbps * 1e3)


def crossover(a, b, n=8):
    """Bytes where two lines latency + bytes (n - 1) / n / bandwidth meet: a = (latency, GB/s), b likewise."""
    return (b[0] - a[0]) / ((n - 1) / n * (1 / (a[1] * 1e3) - 1 / (b[1] * 1e3)))


def test_two_shot_is_derived_from_the_one_shot_fit():
    # one-shot: (N - 1) x bytes per rank, one flag round; two-shot: 2 (N - 1) / N x bytes, two rounds
    assert (TWO_SHOT.latency_us, TWO_SHOT.bandwidth_gbps) == pytest.approx((2 * 7.96, 3.48 * 8 / 2))
    assert TWO_SHOT.name == "two-shot" and not TWO_SHOT.measured and ONE_SHOT.measured and NCCL.measured
    assert "DERIVED" in TWO_SHOT.source and "not measured" in TWO_SHOT.source
    # the byte term at N = 8 is 2 / N of the one-shot's, as link bytes 2 (N-1)/N : (N-1) say
    nbytes = 1 << 20
    one_bytes_term = ONE_SHOT.us(nbytes, 8) - ONE_SHOT.latency_us
    assert TWO_SHOT.us(nbytes, 8) - TWO_SHOT.latency_us == pytest.approx(one_bytes_term * 2 / 8)
    assert two_shot_from(ONE_SHOT, 4).bandwidth_gbps == pytest.approx(3.48 * 2)


def test_choose_protocol_switches_at_the_formulas_crossovers():
    one, two, nccl = (7.96, 3.48), (2 * 7.96, 3.48 * 4), (30.84, 20.37)
    one_two, two_nccl = crossover(one, two), crossover(two, nccl)
    assert 40_000 < one_two < 44_000 and 700_000 < two_nccl < 800_000           # ~41 KB and ~750 KB
    models = ALLREDUCE_CHOICES["auto"]
    assert [m.name for m in models] == ["one-shot", "two-shot", "nccl"]
    for nbytes, want in ((256, "one-shot"), (one_two * 0.99, "one-shot"), (one_two * 1.01, "two-shot"),
                         (two_nccl * 0.99, "two-shot"), (two_nccl * 1.01, "nccl"), (8 << 20, "nccl")):
        assert choose_protocol(nbytes, 8, models) == want, nbytes
        us = [formula_us(*p, nbytes) for p in (one, two, nccl)]
        assert ["one-shot", "two-shot", "nccl"][us.index(min(us))] == want
    # the step's messages: 1 row one-shot, 9 and 17 rows two-shot, 65 rows NCCL; two-shot alone where no NCCL
    assert [choose_protocol(m * ROW, 8, models) for m in (1, 9, 17, 65)] == ["one-shot", "two-shot", "two-shot", "nccl"]
    assert choose_protocol(65 * ROW, 8, (ONE_SHOT, TWO_SHOT)) == "two-shot"
    assert choose_protocol(ROW, 8, ALLREDUCE_CHOICES["two-shot"]) == "two-shot"
    tie = AllReduceModel("nccl", ONE_SHOT.latency_us, ONE_SHOT.bandwidth_gbps, "t")
    assert choose_protocol(ROW, 8, (ONE_SHOT, tie)) == "one-shot"              # a tie: the earlier model
    with pytest.raises(ValueError, match="no all-reduce model"):
        choose_protocol(ROW, 8, ())


class OneShot:
    def __init__(self, rank=0, nranks=8, max_bytes=65 * ROW):
        self.rank, self.nranks, self.max_bytes, self.calls = rank, nranks, max_bytes, []

    def __call__(self, x, out, elems, stream=None, protocol=None):
        self.calls.append(("all_reduce", protocol or "push", elems))

    def all_gather(self, x, out, nbytes, stream=None):
        self.calls.append(("all_gather", "push", nbytes))


class Nccl:
    def __init__(self, rank=0, nranks=8):
        self.rank, self.nranks, self.calls = rank, nranks, []

    def all_reduce(self, x, out, elems, stream):
        self.calls.append(("all_reduce", "nccl", elems))

    def all_gather(self, x, out, nbytes, stream, dtype):
        self.calls.append(("all_gather", "nccl", nbytes))


def run_sizes(collective, rows):
    for m in rows:
        collective.all_reduce(1, 2, m * ROW // 2, "s")
    collective.all_gather(3, 4, 7 * 4 * 4, "s")         # the draft candidates: [7, 4] float32 a rank
    collective.all_gather(3, 4, 512 * 1024, "s")        # 4 MB gathered: NCCL's


def test_rank_collective_launches_what_choose_protocol_names():
    rows = (1, 9, 17, 65)
    one, nccl = OneShot(), Nccl()
    both = RankCollective(nccl=nccl, one_shot=one, models=ALLREDUCE_CHOICES["auto"])
    run_sizes(both, rows)
    assert one.calls == [("all_reduce", "push", ROW // 2), ("all_reduce", "two-shot", 9 * ROW // 2),
                         ("all_reduce", "two-shot", 17 * ROW // 2), ("all_gather", "push", 112)]
    assert nccl.calls == [("all_reduce", "nccl", 65 * ROW // 2), ("all_gather", "nccl", 512 * 1024)]
    assert [both.choice(m * ROW) for m in rows] == [choose_protocol(m * ROW, 8, ALLREDUCE_CHOICES["auto"])
                                                    for m in rows]
    shared = OneShot()                                   # ranks on one GPU: no NCCL, the two-shot above ~41 KB
    run_sizes(RankCollective(one_shot=shared, models=(ONE_SHOT, TWO_SHOT)), rows)
    assert [c[1] for c in shared.calls] == ["push", "two-shot", "two-shot", "two-shot", "push", "push"]
    only = OneShot()                                     # --allreduce two-shot: every all-reduce; gathers push
    run_sizes(RankCollective(one_shot=only, models=(TWO_SHOT,)), (1,))
    assert [c[:2] for c in only.calls] == [("all_reduce", "two-shot"), ("all_gather", "push"), ("all_gather", "push")]
    small = OneShot(max_bytes=4 * ROW)                   # what the buffer cannot hold goes to NCCL
    assert RankCollective(nccl=Nccl(), one_shot=small, models=(ONE_SHOT, TWO_SHOT, NCCL)).choice(9 * ROW) == "nccl"


def test_every_rank_makes_the_same_choices():
    seqs = []
    for rank in range(8):
        one = OneShot(rank=rank)
        run_sizes(RankCollective(one_shot=one, models=(ONE_SHOT, TWO_SHOT)), (1, 9, 1, 33, 17, 2, 65))
        seqs.append(one.calls)
    assert all(s == seqs[0] for s in seqs)


def test_models_without_their_implementation_are_refused():
    with pytest.raises(ValueError, match="model 'nccl' needs NCCL"):
        RankCollective(one_shot=OneShot(), models=(ONE_SHOT, NCCL))
    with pytest.raises(ValueError, match="model 'two-shot' needs the one-shot"):
        RankCollective(nccl=Nccl(), models=(TWO_SHOT,))
    with pytest.raises(ValueError, match="model 'ring' names no implementation"):
        RankCollective(one_shot=OneShot(), models=(AllReduceModel("ring", 1.0, 1.0, "t"),))
    assert RankCollective(one_shot=OneShot(), models=(TWO_SHOT,)).describe() == "two-shot"
    assert "one-shot / two-shot / nccl by message size" in RankCollective(
        one_shot=OneShot(), nccl=Nccl(), models=ALLREDUCE_CHOICES["auto"]).describe()


def pcie(allreduce: str) -> PcieCollective:
    c = object.__new__(PcieCollective)                       # the pricing alone: no GPU, no kernel
    c.tp, c.models, c.allreduce = 8, ALLREDUCE_CHOICES[allreduce], allreduce
    return c


def test_pcie_stand_in_prices_and_occupies_the_chosen_protocol():
    auto = pcie("auto")
    for m, model in ((1, ONE_SHOT), (9, TWO_SHOT), (65, NCCL)):
        assert auto.modelled_us(m * ROW) == pytest.approx(model.us(m * ROW, 8), rel=1e-12)
    assert auto.blocks(9 * ROW) == two_shot_grid(9 * 7168, 8)[0] < grid_for(9 * 7168)[0]
    assert auto.blocks(ROW) == grid_for(7168)[0]
    assert pcie("two-shot").modelled_us(ROW) == pytest.approx(TWO_SHOT.us(ROW, 8))
    assert pcie("two-shot").modelled_us(8 * ROW, "all_gather") == pytest.approx(ONE_SHOT.us(8 * ROW, 8))
    gather = auto.modelled_us(9 * ROW, "all_gather")       # the cheaper of one-shot and NCCL, not the two-shot's
    assert gather == pytest.approx(min(ONE_SHOT.us(9 * ROW, 8), NCCL.us(9 * ROW, 8)))
    assert gather > TWO_SHOT.us(9 * ROW, 8)
    assert {m["name"]: m["measured"] for m in auto.describe()["models"]} == {"one-shot": True, "two-shot": False,
                                                                            "nccl": True}


def test_bench_project_rows_name_the_chosen_collective():
    r = CliRunner().invoke(main, ["bench", "project", "--budget", "8", "--context", "4096", "--routing", "uniform",
                                  "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["rows"]
    reduces = {c["message_bytes"]: c for c in row["projection"]["collectives"] if c["op"] == "all_reduce"}
    assert reduces[9 * ROW]["collective"] == "two-shot"
    assert reduces[9 * ROW]["us_each"] == pytest.approx(TWO_SHOT.us(9 * ROW, 8))
    gathers = [c for c in row["projection"]["collectives"] if c["op"] == "all_gather"]
    assert gathers and all(c["collective"] != "two-shot" for c in gathers)      # the two-shot only reduces
    for c in row["projection"]["collectives"]:
        models = models_for(c["op"], ALLREDUCE_CHOICES["auto"])
        assert c["collective"] == choose_protocol(c["message_bytes"], 8, models)
        assert c["us_each"] == pytest.approx(min(m.us(c["message_bytes"], 8) for m in models))
    models = row["projection"]["allreduce_model"]["models"]
    assert [m["name"] for m in models] == ["one-shot", "two-shot", "nccl"] and models[1]["measured"] is False
    r = CliRunner().invoke(main, ["bench", "project", "--budget", "8", "--context", "4096", "--routing", "uniform",
                                  "--allreduce", "two-shot", "--json"])
    assert r.exit_code == 0, r.output
    named = {(c["op"], c["collective"]) for c in json.loads(r.stdout)["rows"][0]["projection"]["collectives"]}
    assert named == {("all_reduce", "two-shot"), ("all_gather", "one-shot")}    # gathers: the one-shot's
