"""The cross-rank top-p protocol (plugins/top_p_ranks.py) decides what one rank with the whole row decides
(plugins/top_p_bins.py row_cut / sample_top_p, the single-GPU kernels' twin): the same kept set, the same flags
and the same sampled tokens, for rows split over 2, 4 and 8 ranks, including rows whose crossing bin holds many
equal logits, ties across rank boundaries and a crossing bin past MAX_BIN_KEYS (kept whole, flagged)."""
import numpy as np
import pytest

from ddtree.plugins.top_p_bins import BIN_OVERFLOW, row_cut, sample_top_p
from ddtree.plugins.top_p_ranks import ranks_kept, ranks_sample_top_p


def split(row, tp):
    V_r = row.size // tp
    return [row[r * V_r: (r + 1) * V_r] for r in range(tp)], [r * V_r for r in range(tp)]


def rows(V: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"normal": (rng.standard_normal(V) * 3).astype(np.float32),
            "quantised": np.round(rng.standard_normal(V) * 4).astype(np.float32) / 2,     # many equal logits
            "peaked": np.concatenate([[12.0, 12.0], rng.standard_normal(V - 2) - 4]).astype(np.float32),
            "flat": (rng.standard_normal(V) * 1e-3).astype(np.float32)}                  # one huge crossing bin


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.9), (1.0, 0.5), (1.3, 0.99)])
def test_the_ranks_keep_what_one_rank_keeps(tp, temperature, top_p):
    for name, row in rows(8192, tp).items():
        one = row_cut(row, temperature, top_p)
        kept, flags = ranks_kept(*split(row, tp), temperature, top_p)
        np.testing.assert_array_equal(np.concatenate(kept), one.kept_mask, err_msg=f"{name}, tp {tp}")
        assert flags == one.flags, (name, flags, one.flags)
        if name == "flat":
            assert flags == BIN_OVERFLOW


@pytest.mark.parametrize("tp", [2, 8])
def test_the_ranks_sample_the_tokens_one_rank_samples(tp):
    rng = np.random.default_rng(tp)
    logits = (rng.standard_normal((6, 4096)) * 2).astype(np.float32)
    positions = np.arange(100, 106)
    want = sample_top_p(logits, positions, 0.8, 0.9, seed=2 ** 33 + 7)
    slices, offsets = zip(*(split(row, tp) for row in logits))
    per_rank = [np.stack([s[r] for s in slices]) for r in range(tp)]
    got = ranks_sample_top_p(per_rank, list(offsets[0]), positions, 0.8, 0.9, seed=2 ** 33 + 7)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
