"""YaRN frequencies, the softmax scale, and interleaved-pair rotation against docs/kimi-k2.md 5.2-5.3."""
import math
from dataclasses import replace

import numpy as np
import pytest

from ddtree.model.config import RopeConfig, yarn_mscale
from ddtree.model.presets import get_preset
from ddtree.model.rope import rope_frequencies, rope_magnitude, yarn_correction_range
from ddtree.reference.rope import Rope

KIMI_ROPE = RopeConfig(theta=50000.0, type="yarn", factor=64.0, original_max_position_embeddings=4096,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


@pytest.mark.parametrize("beta_fast, low, high", [(1.0, 19, 20), (32.0, 8, 20)])
def test_yarn_correction_range_worked_values(beta_fast, low, high):
    assert yarn_correction_range(replace(KIMI_ROPE, beta_fast=beta_fast), 64) == (low, high)


def test_yarn_frequencies_hard_switch_for_beta_fast_1():
    theta = 50000.0 ** (-np.arange(32) / 32)
    phi = rope_frequencies(replace(KIMI_ROPE, beta_fast=1.0), 64)
    np.testing.assert_allclose(phi[:20], theta[:20], rtol=1e-15)      # pairs 0-19 keep theta_i
    np.testing.assert_allclose(phi[20:], theta[20:] / 64, rtol=1e-15)  # pairs >= 20 use theta_i / 64


def test_yarn_frequencies_blend_for_beta_fast_32():
    theta = 50000.0 ** (-np.arange(32) / 32)
    phi = rope_frequencies(KIMI_ROPE, 64)
    np.testing.assert_allclose(phi[:9], theta[:9], rtol=1e-15)         # gamma = 0 up to low = 8
    np.testing.assert_allclose(phi[20:], theta[20:] / 64, rtol=1e-15)
    gamma = (np.arange(9, 20) - 8) / 12                                  # the ramp between low 8 and high 20
    np.testing.assert_allclose(phi[9:20], theta[9:20] * (1 - gamma) + theta[9:20] / 64 * gamma, rtol=1e-15)
    assert np.all(phi[9:20] < theta[9:20]) and np.all(phi[9:20] > theta[9:20] / 64)


def test_default_rope_is_plain_theta():
    phi = rope_frequencies(RopeConfig(theta=10000.0), 16)
    np.testing.assert_allclose(phi, 10000.0 ** (-np.arange(8) / 8), rtol=1e-15)


def test_softmax_scale_worked_values():
    assert yarn_mscale(64.0, 1.0) == pytest.approx(1.41589, abs=1e-5)
    cfg, _ = get_preset("kimi-k2.6", layers=2)
    assert cfg.qk_head_dim == 192
    assert cfg.softmax_scale == pytest.approx(0.1446796, rel=1e-6)
    cfg32 = replace(cfg, rope=replace(cfg.rope, factor=32.0))
    assert cfg32.softmax_scale == pytest.approx(0.1308608, rel=1e-6)
    no_boost = replace(cfg, rope=replace(cfg.rope, mscale_all_dim=0.0))   # HF/vLLM default when absent
    assert no_boost.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)


def test_rope_magnitude_is_one_for_kimi_and_the_ratio_otherwise():
    assert rope_magnitude(KIMI_ROPE) == 1.0
    r = replace(KIMI_ROPE, mscale=1.0, mscale_all_dim=0.0)
    assert rope_magnitude(r) == pytest.approx(0.1 * math.log(64) + 1)


def test_interleaved_rotation_equals_complex_multiplication():
    """Pair (x_2i, x_2i+1) as the complex number x_2i + j x_2i+1, turned by e^{j p phi_i}."""
    rope = Rope(KIMI_ROPE, 64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64))                                  # [q, heads, d]
    pos = np.array([0, 1, 17, 4095, 200000])
    got = rope.apply(x, pos)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[:, None, None] * rope.freqs)
    want = np.empty_like(x)
    want[..., 0::2], want[..., 1::2] = z.real, z.imag
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(rope.apply(x[:1], pos[:1]), x[:1])    # position 0 is the identity


def test_rotated_dot_product_depends_only_on_relative_position():
    rope = Rope(KIMI_ROPE, 64)
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 64))
    d1 = rope.apply(q, np.array([1000])) @ rope.apply(k, np.array([990])).T
    d2 = rope.apply(q, np.array([10])) @ rope.apply(k, np.array([0])).T
    np.testing.assert_allclose(d1, d2, rtol=1e-9)
