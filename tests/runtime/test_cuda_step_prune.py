"""The GPU step's pruning bookkeeping on the host (runtime/cuda_step_prune.py; no GPU: a recording stand-in for the
device): the stats read back from the step's host-mapped buffers are what runtime/pruning.py Pruner.verify keeps on
the CPU (distinct experts of every node / of the live nodes at each MoE layer, the nodes pruned), and the rate's
terms and another pruner's constants are written before a step."""
from types import SimpleNamespace

import numpy as np

from ddtree.plugins.prune_ops import CalibrationTable
from ddtree.runtime.cuda_step_prune import TABLE_POINTS, StepPruning
from ddtree.runtime.pruning import Pruner
from ddtree.tree.budget import Calibration


class Host:
    """The Gpu calls StepPruning makes, on numpy arrays (mapped: (array, the array itself))."""

    def __init__(self):
        self.writes = []

    def upload(self, a):
        return np.array(a)

    def alloc(self, shape, dtype):
        return np.zeros(shape, dtype)

    zeros = alloc

    def mapped(self, shape, dtype):
        a = np.zeros(shape, dtype)
        return a, a

    def copy_in(self, dst, a):
        self.writes.append(np.array(a))
        dst[...] = np.asarray(a).reshape(dst.shape)


def steps(cfg):
    ops = SimpleNamespace(max_tokens=32)
    return SimpleNamespace(gpu=Host(), ops=ops, ex=SimpleNamespace(config=cfg), B_max=8)


def test_record_is_the_cpu_pruners_stats():
    cfg = SimpleNamespace(moe_layers=(1, 2, 3), num_experts_per_tok=2)
    pruner = Pruner(cfg, 1000, rate=1e-4, every=2)
    sp = StepPruning(steps(cfg), pruner)
    rng = np.random.default_rng(0)
    n = 9
    ids = rng.integers(0, 16, (3, n, 2))
    lives = np.ones((3, n), np.int32)
    lives[1:, [2, 5, 6]] = 0                           # pruned at MoE layer 0: rows 2, 5, 6 dead after it
    lives[2, 7] = 0
    sp.routed_host[:, :n], sp.lives_host[:, :n] = ids, lives
    sp.final_host[:n] = lives[2]
    sp.final_host[n:] = 1                              # rows past the tree are not read
    sp.record(n)
    d = pruner.stats.to_dict()
    want_before = [len(np.unique(ids[j])) for j in range(3)]
    want_after = [len(np.unique(ids[j][lives[j] != 0])) for j in range(3)]
    assert pruner.stats.experts_before == want_before and pruner.stats.experts_after == want_after
    assert d["pruned_per_step"] == [4] and d["pruned_nodes"] == 4
    sp.record(n, experts=False)                        # a step without the experts' copies: its pruned count only
    assert pruner.stats.per_step == [4, 4] and len(pruner.stats.experts_before) == 3


def test_stats_steps_are_a_requests_first_and_every_stats_every_th():
    from ddtree.runtime.cuda_step_prune import STATS_EVERY
    cfg = SimpleNamespace(moe_layers=(1, 2, 3), num_experts_per_tok=2)
    sp = StepPruning(steps(cfg), Pruner(cfg, 1000, rate=1e-4))
    due = [sp.stats_due(first=i in (0, 11)) for i in range(3 * STATS_EVERY)]
    assert [i for i, d in enumerate(due) if d] == [0, STATS_EVERY, 11, 11 + STATS_EVERY]


def test_prepare_writes_the_rate_terms_and_another_pruners_constants():
    cfg = SimpleNamespace(moe_layers=(1, 2), num_experts_per_tok=2)
    first = Pruner(cfg, 1000, rate=2e-9)
    sp = StepPruning(steps(cfg), first)
    sp.prepare(first, 16, 100)
    assert sp.rate_terms.tolist() == [np.float32(2e-9), 0.0] and sp.expert_bytes.tolist() == [1000]
    cal = Calibration((), {"x": [0.0, 0.5, 1.0], "y": [0.0, 0.2, 0.9], "samples": 100})
    tuning = SimpleNamespace(calibration=cal, budgets=[16], step_times_at=lambda c: {16: 1000.0},
                             expected_distinct_experts=[10.0])               # one budget: no measured expert cost
    second = Pruner(cfg, 2000, tuning=tuning)
    sp.prepare(second, 16, 100)
    want = CalibrationTable.of(cal, 7, TABLE_POINTS)
    assert sp.pruner is second and sp.expert_bytes.tolist() == [2000]
    assert np.array_equal(sp.table["x"], want.x) and np.array_equal(sp.table["n"], want.n)
    assert sp.rate_terms.tolist() == list(np.float32(second.rate_terms(16, 100)))
