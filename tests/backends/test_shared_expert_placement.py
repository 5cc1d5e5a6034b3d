"""CPU tests of where the cuda backend's MoE puts the shared expert's branch (backends/cuda_moe.py): the order of its
launches, forks and joins against a recording FusedMoE. The shared output must be joined before the launch that
reads it (down, or the one streaming launch), and the branch forks after the routing only where the two-launch
path runs (the streaming launch reads the shared output itself, so there it stays beside the router)."""
from contextlib import contextmanager

import pytest

from ddtree.backends.cuda_moe import MoeOps
from ddtree.description.opset import MoESpec

SPEC = MoESpec(hidden=64, inter=64, experts=8, n_routed_experts=8, expert_start=0, topk=2, n_group=1, topk_group=1,
               routed_scaling_factor=1.0, group_size=32)
STREAM_ROWS = 65                    # the recording FusedMoE streams from here, as moe_stream does for many rows


class Buf:
    def __init__(self, name):
        self.name, self.ptr, self.shape = name, name, (1, SPEC.hidden)


class RecordingFused:
    def __init__(self, log):
        self.log = log

    def uses_stream(self, M):
        return M >= STREAM_ROWS

    def route(self, x, M, stream=None, live=None, routed_ids=None):
        self.log.append("route")
        return "ids", "weights"

    def gate_up(self, x, M, stream=None):
        self.log.append("gate_up")

    def down_combine(self, out, M, weights, shared, stream=None):
        self.log.append(f"down({shared})")

    def experts(self, x, out, M, ids, weights, shared, stream=None):
        self.log.append(f"experts({shared})")


class Recorder(MoeOps):
    """The parts of CudaOps that MoeOps._moe calls, each appending what it launched to `log`."""

    def __init__(self, fork, join, rows):
        self.shared_fork, self.shared_join, self.M = fork, join, rows
        self.where, self.max_tokens, self.invariant, self.moe_down_cols = "test", 256, False, None
        self.stream, self.log, self.lane = None, [], 0
        self.store = type("Store", (), {"device": staticmethod(Buf), "tiled": staticmethod(Buf)})()

    def launcher(self, key, make):
        return RecordingFused(self.log)

    def new(self, shape, dtype):
        return Buf("out")

    def _rows(self, x, site):
        return self.M

    @contextmanager
    def branch(self):
        self.log.append("fork")
        self.lane = 1
        yield "shared branch"
        self.lane = 0

    def join(self, b):
        self.log.append(f"join({b})")

    def swiglu_mlp(self, x, *weights):
        self.log.append(f"shared on lane {self.lane}")
        return Buf("shared_out")

    def release_held(self):
        self.log.append("release_held")


def moe(ops):
    experts = {k: Buf(k) for k in ("gate_up.words", "gate_up.scales", "down.words", "down.scales")}
    ops.moe(Buf("x"), Buf("router"), Buf("bias"), experts, (Buf("gate"), Buf("up"), Buf("down")), SPEC)
    return ops.log


BESIDE_ROUTER = ["fork", "shared on lane 1", "route", "release_held"]


@pytest.mark.parametrize("fork, join, rows, want", [
    ("routed", "down", 1, ["route", "release_held", "fork", "shared on lane 1", "gate_up", "join(shared branch)",
                           "down(shared_out)"]),
    ("routed", "down", 17, ["route", "release_held", "fork", "shared on lane 1", "gate_up", "join(shared branch)",
                            "down(shared_out)"]),
    ("routed", "down", STREAM_ROWS, BESIDE_ROUTER + ["join(shared branch)", "experts(shared_out)"]),
    ("router", "down", 1, BESIDE_ROUTER + ["gate_up", "join(shared branch)", "down(shared_out)"]),
    ("router", "experts", 1, BESIDE_ROUTER + ["join(shared branch)", "experts(shared_out)"]),
])
def test_the_shared_branch_forks_and_joins_where_its_reader_needs_it(fork, join, rows, want):
    assert moe(Recorder(fork, join, rows)) == want


@pytest.mark.parametrize("fork, join, match", [("routed", "experts", "shared_join must be 'down'"),
                                               ("beside", "down", "shared_fork 'beside'"),
                                               ("router", "late", "shared_join 'late'")])
def test_a_placement_that_cannot_hold_is_refused_before_any_launch(fork, join, match):
    ops = Recorder(fork, join, 1)
    with pytest.raises(ValueError, match=match):
        moe(ops)
    assert ops.log == []

