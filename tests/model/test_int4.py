"""compressed-tensors INT4 packing against a hand-computed word and a per-element formula."""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.model.int4 import dequantize_int4, dequantize_packed, pack_int4, quantize_int4, unpack_int4


def test_hand_computed_word():
    # columns 0..7 hold q = -8, -7, 0, 7, 1, -1, 3, -3 -> nibbles 0, 1, 8, 15, 9, 7, 11, 5 (lowest first)
    q = np.array([[-8, -7, 0, 7, 1, -1, 3, -3]])
    word = 0x5B79F810  # nibble i of the word (from the least significant end) is column i
    packed = pack_int4(q)
    assert packed.dtype == np.int32 and packed.shape == (1, 1)
    assert int(packed.view(np.uint32)[0, 0]) == word
    assert unpack_int4(np.array([[np.uint32(word).view(np.int32)]], dtype=np.int32), [1, 8]).tolist() == q.tolist()


def test_negative_word_unpacks_with_mask():
    # top nibble >= 8 makes the int32 negative: arithmetic shifts must not leak sign bits
    q = np.full((2, 8), 7)
    packed = pack_int4(q)
    assert (packed < 0).all()
    assert (unpack_int4(packed, (2, 8)) == 7).all()


@pytest.mark.parametrize("n,k", [(5, 64), (3, 8), (4, 20), (1, 1)])
def test_round_trip_exact(n, k):
    rng = np.random.default_rng(0)
    q = rng.integers(-8, 8, size=(n, k))
    packed = pack_int4(q)
    assert packed.shape == (n, -(-k // 8))
    for shape in (np.array([n, k], np.int32), np.array([n, k], np.int64)):
        assert np.array_equal(unpack_int4(packed, shape), q)


def test_pack_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.array([[8]]))


def test_unpack_rejects_wrong_shape():
    with pytest.raises(ValueError, match="weight_shape"):
        unpack_int4(np.zeros((2, 3), np.int32), [2, 32])


def test_dequantize_matches_formula():
    rng = np.random.default_rng(1)
    n, k, g = 6, 96, 32
    q = rng.integers(-8, 8, size=(n, k))
    scale = f32_to_bf16(rng.uniform(0.01, 0.1, size=(n, k // g)).astype(np.float32))
    w = dequantize_packed(pack_int4(q), scale, [n, k], g)
    s = bf16_to_f32(scale)
    for i in range(n):
        for j in range(0, k, 7):
            assert w[i, j] == np.float32(q[i, j]) * s[i, j // g]


def test_quantize_is_close_and_uses_15_levels():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 128)).astype(np.float32)
    q, scale = quantize_int4(w, 32)
    assert q.min() >= -7 and q.max() <= 7
    deq = dequantize_int4(q, scale, 32)
    # error per element at most half a step (plus bf16 rounding of the scale)
    step = np.repeat(bf16_to_f32(scale), 32, axis=1)
    assert np.all(np.abs(deq - w) <= 0.5 * step * 1.01 + 1e-7)
