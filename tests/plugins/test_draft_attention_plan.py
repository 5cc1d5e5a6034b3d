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
    (1, 64, 4096 + 12, 129),       # Kimi's drafter at tp 8, block 8: 2 row blocks, 32 keys a split
    (8, 64, 4096 + 12, 33),        # at tp 1: 16 row blocks, ~four a SM
    (1, 64, 32768 + 12, 132),      # a long context: one split a SM
    (1, 64, 40, 2),                # a short one: a split a tile
    (1, 64, 32, 1),
])
def test_plan_fills_the_gpu_with_splits(kv_heads, rows, keys, want):
    assert da.plan_splits(kv_heads, rows, keys, sm_count=132) == want


def test_forced_splits_are_checked():
    with pytest.raises(ValueError, match="splits 161 must be in"):
        da.DraftAttention(None, 8, 1, 128, splits=161)
