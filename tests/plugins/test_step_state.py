"""The step record and state on the CPU (plugins/step_state.py; the kernels' GPU test is
tests/runtime/test_cuda_step_gpu.py): the numpy twins against hand-made cases, and the host's reading of the
record ring — a slot is trusted only when it holds the step number asked for, the tokens are its first count
words, and the layout matches the kernel's word indices (kernels/step_state.cu)."""
import re
from pathlib import Path

import numpy as np

from ddtree.plugins import step_state as ss

KERNEL = Path(ss.__file__).parent / "kernels" / "step_state.cu"


def test_word_indices_match_the_kernel():
    text = KERNEL.read_text()
    defines = {m[0]: int(m[1]) for m in re.findall(r"#define (\w+) (\d+)", text)}
    assert (defines["ST_START"], defines["ST_BONUS"], defines["ST_STEPS"]) == (ss.START, ss.BONUS, ss.STEPS)
    assert (defines["REC_SEQ"], defines["REC_COUNT"], defines["REC_STATUS"], defines["REC_START"],
            defines["REC_TOKENS"]) == (ss.SEQ, ss.COUNT, ss.STATUS, ss.REC_START, ss.TOKENS)


def test_twins_by_hand():
    p = ss.prologue_ref(np.array([40, 7, 3, 0]), 4, 99, 4)
    assert p["block_ids"].tolist() == [7, 99, 99, 99] and p["block_pos"].tolist() == [40, 41, 42, 43]
    assert (p["draft_len"], p["target_len"]) == (36, 40)
    window, taps = np.arange(8).reshape(4, 2), 100 + np.arange(12).reshape(6, 2)
    accepted = np.array([0, 2, 5, -1, -1, -1])
    assert ss.ctx_window_ref(window, taps, accepted, 3).tolist() == [[6, 7], [100, 101], [104, 105], [110, 111]]
    tokens, after = ss.commit_ref(np.array([40, 7, 3, 0]), np.array([7, 11, 12, 13, 14, 15]), accepted, 3, 77)
    assert tokens == [12, 15, 77] and after.tolist() == [43, 77, 4, 0]
    tokens, after = ss.commit_ref(np.array([40, 7, 3, 0]), None, None, None, 5)      # the AR step
    assert tokens == [5] and after.tolist() == [41, 5, 4, 0]


def test_force_accept_twin_follows_the_first_child_chain():
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 3]            # chain 0 -> 1 -> 3 -> 6 -> 7; 2, 4, 5, 8 off it
    assert ss.force_accept_ref(parents, 1) == [0]
    assert ss.force_accept_ref(parents, 3) == [0, 1, 3]
    assert ss.force_accept_ref(parents, 9) == [0, 1, 3, 6, 7]        # the chain ends at depth 4
    assert ss.force_accept_ref([-1, 0, 0, 0], 4) == [0, 1]           # a flat tree: depth 1


def test_the_host_trusts_a_slot_only_with_its_step_number():
    st = object.__new__(ss.StepState)
    st.slots, st.record_words = 4, ss.TOKENS + 8
    st.ring = np.zeros((4, st.record_words), np.int32)
    assert st.record(1) is None                                   # nothing written yet
    st.ring[0, :ss.TOKENS + 3] = [1, 3, 0, 43, 12, 15, 77]
    assert st.record(1) == {"count": 3, "status": 0, "start": 43, "tokens": [12, 15, 77]}
    assert st.record(5) is None                                   # slot 0 holds step 1, not step 5
    st.ring[0, ss.SEQ] = 5
    assert st.record(5)["tokens"] == [12, 15, 77]
