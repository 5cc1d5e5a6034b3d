"""CPU tests of the drafter attention's split plan (plugins/draft_attention.py) and its constants in the kernel."""
import re

import pytest

import ddtree.plugins.compile as kc
from ddtree.plugins import draft_attention as da


def test_constants_are_the_kernels():
    text = (kc.KERNEL_DIR / "draft_attention.cu").read_text()
    d = {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)\b", text, re.M)}
    assert d["DA_MAX_SPLITS"] == da.MAX_SPLITS and d["DA_TILE"] == da.TILE
    assert d["DA_COMBINE_THREADS"] == da.COMBINE_THREADS and da.COMBINE_THREADS % max(da.HEAD_DIMS) == 0
    assert d["DA_WARPS"] * d["DA_RPW"] == da.ROWS_PER_BLOCK


@pytest.mark.parametrize("kv_heads,rows,keys,want", [
    (1, 64, 4096 + 12, 65),        # Kimi's drafter at tp 8, block 8: 2 row blocks, 64 keys a split
    (8, 64, 4096 + 12, 17),        # at tp 1: 16 blocks, ~two a SM
    (1, 64, 32768 + 12, 132),      # a long context: two blocks a SM
    (1, 64, 40, 1),                # a short one: one split
    (1, 4, 10 ** 6, 160),          # the combine's limit
])
def test_plan_fills_the_gpu_with_splits_of_64_keys(kv_heads, rows, keys, want):
    got = da.plan_splits(kv_heads, rows, keys, sm_count=132)
    assert got == want
    blocks = kv_heads * -(-rows // da.ROWS_PER_BLOCK) * got       # the formula, by hand: bounded three ways
    assert got == 1 or -(-keys // got) >= da.KEYS_PER_SPLIT or blocks >= 2 * 132 or got == da.MAX_SPLITS


def test_forced_splits_are_checked():
    with pytest.raises(ValueError, match="splits 161 must be in"):
        da.DraftAttention(None, 8, 1, 128, splits=161)
