"""backends/dense_experts.py: the numpy backend's memo of dequantized experts gives reference.expert_matrices' bits,
keeps no more than its limit, and turns a later write into a kept expert's source into an error."""
import numpy as np
import pytest

from ddtree.backends.dense_experts import DenseExperts
from ddtree.plugins import layout
from ddtree.plugins.reference import expert_matrices, moe_given_routing


def stacked_experts(E=3, H=64, I=64, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def packed(n, k):
        q = rng.integers(-8, 8, (E, n, k)).astype(np.int8)
        s = rng.integers(0x3c00, 0x3e00, (E, n, k // 32)).astype(np.uint16)        # bf16 bits of 1 .. 2
        pairs = [layout.repack_q(q[e], s[e]) for e in range(E)]
        return np.stack([w for w, _ in pairs]), np.stack([sc for _, sc in pairs])
    gate_up, gate_up_scale = packed(2 * I, H)
    down, down_scale = packed(H, I)
    return {"gate_up": gate_up, "gate_up_scale": gate_up_scale, "down": down, "down_scale": down_scale}


def test_kept_experts_are_the_twin_bits_and_reused():
    packed, dense = stacked_experts(), DenseExperts()
    for e in range(3):
        got = dense(packed, e)
        for a, b in zip(got, expert_matrices(packed, e)):
            np.testing.assert_array_equal(a, b)
        assert all(a is b for a, b in zip(dense(packed, e), got))                  # the second call dequantizes nothing
    assert dense.used == sum(m.nbytes for e in range(3) for m in expert_matrices(packed, e))
    x = np.random.default_rng(1).standard_normal((5, 64))
    ids, w = np.array([[0, 2], [1, 2], [2, 0], [1, 0], [0, 1]]), np.full((5, 2), 0.5)
    np.testing.assert_array_equal(moe_given_routing(x, ids, w, packed, matrices=dense),
                                  moe_given_routing(x, ids, w, packed))


def test_other_arrays_are_other_experts_and_the_limit_holds():
    a, b = stacked_experts(seed=0), stacked_experts(seed=1)
    one = sum(m.nbytes for m in expert_matrices(a, 0))
    dense = DenseExperts(limit_bytes=one)
    np.testing.assert_array_equal(dense(a, 0)[2], expert_matrices(a, 0)[2])
    np.testing.assert_array_equal(dense(b, 0)[2], expert_matrices(b, 0)[2])    # same index, other arrays: not a's
    assert len(dense.kept) == 1 and dense.used == one                              # b's did not fit: made per call
    assert b["down"].flags.writeable                                               # and b was left as it was


def test_writing_a_kept_source_raises():
    packed, dense = stacked_experts(), DenseExperts()
    dense(packed, 1)
    with pytest.raises(ValueError, match="read-only"):
        packed["down"][1] = 0
