"""GPU tests of the DFlash drafter block attention (kernels/draft_attention.cu via plugins/draft_attention.py)
against its float64 twin (plugins/reference.py draft_block_attention): the tiny drafter's dims (8 q / 4 kv
heads, d 32), d 64, small-mla's and Kimi's (d 128; 64 q / 8 kv heads at tp 1, 8 / 1 at tp 8), blocks of
1 .. 16, contexts 0 .. 5000 rows (n new rows after T), full and sliding-window attention, one and many key
splits. One launcher serves every context (T is read from its device buffer), as a captured graph must.

Tolerance, argued: inputs are exact bf16 and the twin exact in float64. The kernel's scores are fp32 dot
products of d terms (relative 2^-24 d), exp2f is within 2 ulp, and the weighted sums over L <= 5100 keys
accumulate in fp32 (<= L 2^-24 of the sum of |p v|, itself <= max |v|), then one bf16 rounding (2^-8 |o|).
So |o - ref| <= 2^-8 |ref| + 1e-3 max |v| everywhere (L 2^-24 < 3.1e-4; the rest covers score error times
scores of a few units). A wrong mask, split boundary, head mapping or lost merge moves outputs by O(max|v| /
sqrt(visible keys)) >> 1e-3 max|v| at these sizes; queries are scaled so scores spread over a few units
(the softmax is far from uniform). Outputs are poisoned with NaN first.
"""
import numpy as np
import pytest

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.plugins import reference as twins

pytestmark = pytest.mark.gpu
# (Hq, Hk, d): tiny drafter, a d-64 shape, small-mla's drafter, Kimi's at tp 1, Kimi's at tp 8
HEADS = [(8, 4, 32), (16, 2, 64), (8, 4, 128), (64, 8, 128), (8, 1, 128)]
# (T, n, b, window)
CASES = [(0, 1, 1, 0), (0, 5, 4, 0), (5, 3, 16, 0), (100, 3, 8, 0), (100, 3, 8, 16), (700, 0, 16, 64),
         (5000, 4, 8, 0), (5000, 4, 16, 2048)]
CAPACITY = 5200


def bf16(rng, shape, scale=1.0):
    return f32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))


def run_case(gpu, attn, dev, T, n, b, window, rng, pos=None, v_tok=None):
    """Fresh block inputs and positions, context length T on the device; kernel output vs twin. v_tok: the block
    values as the tail of wider token rows (a column slice of the drafter's q | k | v GEMM output), the columns
    before them filled with other values."""
    Hq, Hk, d = attn.heads, attn.kv_heads, attn.d
    q, k, v = bf16(rng, (b, Hq, d), 2.0), bf16(rng, (b, Hk, d)), bf16(rng, (b, Hk, d))
    pos = np.arange(T + n, T + n + b, dtype=np.int32) if pos is None else pos
    gpu.copy_in(dev["len"], np.array([T], np.int32))
    gpu.copy_in(dev["pos"], pos)
    for name, x in (("q", q), ("k", k)):
        gpu.copy_in(dev[name], x)
    width, v_at = Hk * d, dev["v"]
    if v_tok is not None:                                            # rows [other values | v] of v_tok each
        rows = bf16(rng, (16, v_tok))
        rows[:b, v_tok - width:] = v.reshape(b, width)
        gpu.copy_in(dev["v_wide"], rows.reshape(-1)[: dev["v_wide"].shape[0]])
        v_at = dev["v_wide"].view(v_tok - width, (16 * v_tok - v_tok + width,))
    else:
        gpu.copy_in(dev["v"], v)
    gpu.memset(dev["o"], 0xFF)
    splits = attn.run(dev["q"], dev["k"], v_at, dev["ck"], dev["cv"], dev["len"], n, dev["pos"], dev["o"], b,
                      window=window, v_tok=v_tok)
    got = bf16_to_f32(dev["o"].numpy().reshape(-1)[: b * Hq * d].reshape(b, Hq * d)).astype(np.float64)
    ref = twins.draft_block_attention(q, k, v, dev["cache_k"], dev["cache_v"], T + n, pos, window, d ** -0.5)
    what = f"Hq {Hq} Hk {Hk} d {d} T {T} n {n} b {b} window {window} splits {splits}"
    assert np.isfinite(got).all(), f"{what}: unwritten or non-finite output"
    vmax = max(np.abs(bf16_to_f32(dev["cache_v"][: T + n])).max(initial=0), np.abs(bf16_to_f32(v)).max())
    excess = np.abs(got - ref) - (2.0 ** -8 * np.abs(ref) + 1e-3 * vmax)
    assert excess.max() <= 0, f"{what}: element {np.unravel_index(excess.argmax(), ref.shape)} off by " \
                              f"{np.abs(got - ref).flat[excess.argmax()]:.3e}"
    return splits


@pytest.mark.parametrize("heads", HEADS, ids=[f"hq{h}_hk{k}_d{d}" for h, k, d in HEADS])
def test_draft_attention_matches_the_twin(gpu, heads):
    from ddtree.plugins.draft_attention import DraftAttention
    Hq, Hk, d = heads
    rng = np.random.default_rng(Hq * 1000 + Hk * 10 + d)
    cache_k, cache_v = bf16(rng, (CAPACITY, Hk, d)), bf16(rng, (CAPACITY, Hk, d))
    dev = {"ck": gpu.upload(cache_k), "cv": gpu.upload(cache_v), "cache_k": cache_k, "cache_v": cache_v,
           "len": gpu.alloc(1, np.int32), "pos": gpu.alloc(16, np.int32), "q": gpu.alloc((16, Hq, d), np.uint16),
           "k": gpu.alloc((16, Hk, d), np.uint16), "v": gpu.alloc((16, Hk, d), np.uint16),
           "o": gpu.alloc((16, Hq * d), np.uint16), "v_wide": gpu.alloc((16 * (Hq + 2 * Hk) * d,), np.uint16)}
    attn = DraftAttention(gpu, Hq, Hk, d, max_block=16, max_context=CAPACITY)
    splits = {run_case(gpu, attn, dev, *case, rng) for case in CASES}
    for case in ((100, 3, 8, 0), (5000, 4, 16, 2048)):              # v a column slice of q | k | v (v_tok)
        run_case(gpu, attn, dev, *case, rng, v_tok=(Hq + 2 * Hk) * d)
    # block positions out of order and apart from the context (the window edge inside the block)
    run_case(gpu, attn, dev, 300, 2, 8, 6, rng, pos=np.array([302, 309, 303, 308, 304, 307, 305, 306], np.int32))
    one = DraftAttention(gpu, Hq, Hk, d, max_block=16, max_context=16)     # short context: a single split
    splits |= {run_case(gpu, one, dev, 40, 3, 16, 0, rng), run_case(gpu, one, dev, 40, 3, 4, 8, rng)}
    assert 1 in splits and max(splits) > 1, f"both the direct and the split-and-combine paths ran: {splits}"
    # the combine's most splits: 5000 keys in 32-key tiles leave ~3 splits of 160 empty at T 5000 and most at T 100
    most = DraftAttention(gpu, Hq, Hk, d, max_block=16, max_context=CAPACITY, splits=160)
    for case in ((5000, 4, 8, 0), (100, 3, 8, 0), (5000, 4, 16, 2048)):
        assert run_case(gpu, most, dev, *case, rng) == 160
