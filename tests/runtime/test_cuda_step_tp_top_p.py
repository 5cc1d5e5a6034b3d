"""CPU checks of top-p at tp > 1 inside the step graphs (runtime/cuda_step_tp.py through plugins/top_p_ranks_gpu.py
TopPRanks), on test_cuda_step_tp.py's recording GPU and one-shot: a top-p step launches TopPRanks' kernels and
all-gathers (their sizes exchange_bytes', the same on both ranks) between the verify and the walk, reads the
verify's positions and commits TopPRanks' status; top-k takes the primitives; a flagged row raises naming the step
and rows; the rank processes' one-shot holds TopPRanks' largest part."""
from types import SimpleNamespace

import numpy as np
import pytest

from ddtree.runtime.cuda_step_tp import TOP_P, TpSteps
from ddtree.tree.sampling import SamplingParams
from tests.runtime.test_cuda_step_tp import CaptureBuilder, ranks_of, recording_device  # noqa: F401 (a fixture)

TOP_P_PARAMS = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
TOP_P_KERNELS = ["topp_ranks_max", "all_gather", "topp_ranks_mass", "all_gather", "topp_ranks_decide",
                 "topp_ranks_scan", "all_gather", "topp_ranks_cut"]


def top_p_launches(launches: list) -> list:
    """The kernels and collectives from the first topp_ranks_max to the step's commit."""
    names = [name for name, _ in launches]
    first = names.index("topp_ranks_max")
    return names[first: names.index("step_commit", first) + 1]


@pytest.mark.parametrize("preset", ["tiny", "small-mla"])
def test_a_top_p_step_samples_through_top_p_ranks_in_the_graph(recording_device, preset):
    """Top-p without top-k: head_logits (no VocabWinner, no winners gathered), TopPRanks' five kernels around its
    three all-gathers of exchange_bytes(n) (the same on both ranks, in the same order among the layers'
    collectives), then the DDTree step's walk over its tokens (AcceptWalk of one rank) or the AR step's commit of its
    one token; the capture pass allocates nothing."""
    from ddtree.plugins.top_p_ranks_gpu import TopPRanks, exchange_bytes
    ranks = ranks_of(preset, 2)
    b = ranks[0].drafter_config.block_size
    for ex in ranks:
        steps, gpu = ex.steps, ex.gpu
        ex.ops.collective.one_shot.launches = gpu.launches
        steps.set_params(TOP_P_PARAMS)
        assert steps.plan.mode == TOP_P and isinstance(steps.top_p, TopPRanks)
        assert steps.top_p.V == ex.config.vocab_size and steps.top_p.V_r == ex.lay.vocab_stop - ex.lay.vocab_start
        for body, walk in ((lambda: steps._ddtree_body(16, b), ["node_accept_walk"]), (steps._ar_body, [])):
            for capturing in (False, True):
                launched, allocations = len(gpu.launches), gpu.allocations
                ex.ops.stream, ex.ops.capturing = (CaptureBuilder(), True) if capturing else (None, False)
                try:
                    body()
                finally:
                    ex.ops.stream, ex.ops.capturing = None, False
                step = gpu.launches[launched:]
                names = [name for name, _ in step]
                after = names[names.index("topp_ranks_max"):]                # the verify's layers all ran before
                assert "node_vocab_winner" not in names and names[-1] == "step_commit"
                assert [x for x in after if x in ("all_reduce", "all_gather")] == ["all_gather"] * 3
                seq = top_p_launches(step)
                assert seq[: len(TOP_P_KERNELS) + len(walk)] == TOP_P_KERNELS + walk
                assert names.count("node_accept_walk") == len(walk) and (walk or seq == TOP_P_KERNELS + ["step_commit"])
                if capturing:
                    assert gpu.allocations == allocations
                    assert {getattr(s, "name", s) for _, s in step} == {"capture stream"}
        assert ex.ops.kernels[("accept_walk", 1)].tp == 1                      # the walk over tokens every rank holds
    calls = [ex.ops.collective.one_shot.calls for ex in ranks]
    assert calls[0] == calls[1]
    for n in (17, 1):
        sizes = exchange_bytes(n)
        parts = [sizes["row_max"], sizes["bins"], sizes["records"]]
        gathers = [nbytes for kind, nbytes in calls[0] if kind == "all_gather"]
        assert any(gathers[i: i + 3] == parts for i in range(len(gathers) - 2)), (n, parts)


def test_a_top_p_step_reads_the_sampled_tokens_at_the_verify_positions(recording_device):
    """TopPRanks reads this rank's head logits [n, V_r] at its vocab offset and the verify's positions (start +
    depth: its tokens are for position + 1); the AR step reads the prologue's start and commits TopPRanks' token;
    both records carry TopPRanks' status word (the step's flags)."""
    (ex, _) = ranks_of("tiny", 2)
    steps, b, seen, commits = ex.steps, ex.drafter_config.block_size, [], []
    steps.set_params(TOP_P_PARAMS)
    launch, commit = steps.top_p.launch, steps.state.commit

    def committed(tree_tokens, accepted, count, token, status=(None, None), stream=None):
        commits.append([int(getattr(x, "ptr", x)) for x in (token, status[0])])
        return commit(tree_tokens, accepted, count, token, status=status, stream=stream)
    steps.state.commit = committed

    def recorded(logits, offset, query_pos, n, stream=None):
        seen.append((tuple(logits.shape), offset, int(query_pos.ptr), n))
        return launch(logits, offset, query_pos, n, stream=stream)
    steps.top_p.launch = recorded
    steps._ddtree_body(16, b)
    steps._ar_body()
    build = ex.ops.kernels[("tree_build", 2, b - 1, steps._k(16), 16)]
    V_r = ex.lay.vocab_stop - ex.lay.vocab_start
    assert seen == [((17, V_r), ex.lay.vocab_start, build.positions.ptr, 17),
                    ((1, V_r), ex.lay.vocab_start, steps.block_pos.ptr, 1)]
    assert [status for _, status in commits] == [steps.top_p.status.ptr] * 2
    assert commits[1][0] == steps.top_p.out.tokens.ptr


def test_top_p_at_tp2_takes_the_graph_and_top_k_the_primitives(monkeypatch):
    import ddtree.runtime.loop as loop
    from ddtree.runtime.cuda_step import GpuSteps
    monkeypatch.setattr(GpuSteps, "ddtree_step", lambda self, s, params, budget: ["graph"])
    monkeypatch.setattr(GpuSteps, "ar_step", lambda self, s, params: ["graph"])
    monkeypatch.setattr(loop, "ddtree_step", lambda ex, s, params, budget: ["primitives"])
    monkeypatch.setattr(loop, "ar_step", lambda ex, s, params: ["primitives"])
    steps = TpSteps.__new__(TpSteps)
    steps.vocab, steps.ex, steps.ops, steps.primitive_sampling_steps = 1024, None, SimpleNamespace(collective=None), 0
    steps.drain, steps._leave_window = (lambda: None), (lambda s: None)
    s = SimpleNamespace(table_k=0)
    assert steps.ddtree_step(s, TOP_P_PARAMS, 16) == steps.ar_step(s, TOP_P_PARAMS) == ["graph"]
    assert steps.primitive_sampling_steps == 0
    top_k = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    assert steps.ddtree_step(s, top_k, 16) == steps.ar_step(s, top_k) == ["primitives"]
    assert steps.primitive_sampling_steps == 2


class FlaggedTopP:
    """TopPRanks' check_status and out.flags as a step left them."""

    def __init__(self, status: int, row_flags):
        from ddtree.plugins.tree_sample import STATUS_NAN_TARGET
        self.status, self.nan = status, STATUS_NAN_TARGET
        self.out = SimpleNamespace(flags=SimpleNamespace(numpy=lambda: np.array(row_flags, np.int32)))

    def check_status(self, allow_inexact=False):
        if self.status & self.nan:
            raise ValueError("TopPRanks: this rank's logits contained NaN")
        assert allow_inexact
        flags, self.status = self.status, 0
        return flags


@pytest.mark.parametrize("ahead_ran", [False, True])
def test_a_flagged_top_p_row_raises_naming_the_step_and_row(monkeypatch, ahead_ran):
    """As tp 1's GpuSteps with TreeSampler.check_status: a record whose status carries INEXACT / BIN_OVERFLOW
    raises, naming the step, its position and the flagged rows (unless allow_inexact); NaN logits always raise;
    a record without status is not checked."""
    from ddtree.plugins.tree_sample import STATUS_BIN_OVERFLOW, STATUS_INEXACT, STATUS_NAN_TARGET
    from ddtree.runtime.cuda_step import GpuSteps
    steps = TpSteps.__new__(TpSteps)
    steps.tp, steps.allow_inexact, steps.state = 2, False, SimpleNamespace(steps=6)
    status = {"word": STATUS_INEXACT}

    def step(self, key, body, prepare, ahead):
        self.state.steps += 2 if ahead_ran else 1            # _step drained a step enqueued ahead
        return {"status": status["word"], "start": 45, "count": 3, "tokens": [1, 2, 3]}
    monkeypatch.setattr(GpuSteps, "_step", step)
    key = ("ddtree", 16, 8, TOP_P)
    steps.top_p = FlaggedTopP(STATUS_INEXACT, [0, 0, 0, 16, 0, 0, 0, 0, 0, 16] + [0] * 246)
    overwritten = "of the step enqueued after it" if ahead_ran else r"\(rows"
    with pytest.raises(ValueError, match=rf"tp 2 DDTree step 7 \(from position 42\): .*INEXACT.*{overwritten}.*"
                                         r"\[3, 9\]"):
        steps._step(key, None, None, True)
    steps.top_p = FlaggedTopP(STATUS_BIN_OVERFLOW, [4])
    with pytest.raises(ValueError, match=r"tp 2 AR step .*BIN_OVERFLOW.*\[0\]"):
        steps._step(("ar", TOP_P), None, None, False)
    steps.allow_inexact = True
    steps.top_p = FlaggedTopP(STATUS_INEXACT, [16])
    assert steps._step(("ar", TOP_P), None, None, False)["tokens"] == [1, 2, 3]
    assert steps.top_p.status == 0                                       # read and cleared
    steps.top_p = FlaggedTopP(STATUS_NAN_TARGET, [0])
    with pytest.raises(ValueError, match="NaN"):
        steps._step(("ar", TOP_P), None, None, False)
    status["word"], steps.allow_inexact = 0, False
    steps.top_p = FlaggedTopP(STATUS_INEXACT, [16])                     # not read: the record says nothing
    assert steps._step(("ar", TOP_P), None, None, False)["status"] == 0 and steps.top_p.status == STATUS_INEXACT


@pytest.mark.parametrize("preset", ["tiny", "small-mla", "kimi-k2.6"])
def test_the_one_shot_holds_top_ps_largest_part(preset):
    """The rank processes' one-shot: max(the step's largest all-reduce, TopPRanks' largest all-gather part at the
    kernels' 256 rows), in bf16 elements (2 B each) and a multiple of the one-shot's vector."""
    from ddtree.backends.cuda_backend import MAX_TOKENS
    from ddtree.model.presets import get_preset
    from ddtree.plugins.allreduce import VECTOR
    from ddtree.plugins.top_p_ranks_gpu import RECORD_BYTES, exchange_bytes
    from ddtree.runtime.cuda_ranks import all_reduce_elems, one_shot_elems, top_p_gather_elems
    cfg, dcfg = get_preset(preset, layers=2 if preset == "kimi-k2.6" else None)
    part = max(exchange_bytes(MAX_TOKENS).values())
    assert part == RECORD_BYTES * MAX_TOKENS
    elems = top_p_gather_elems()
    assert 2 * elems >= part and 2 * (elems - VECTOR) < part and elems % VECTOR == 0
    assert one_shot_elems(cfg, dcfg) == max(all_reduce_elems(cfg, dcfg), elems) >= MAX_TOKENS * cfg.hidden_size
