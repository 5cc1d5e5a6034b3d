"""CPU tests of the vocab-parallel node kernels (plugins/vocab_nodes.py): they compile for sm_90 and sm_120 with
static shared memory inside sm_120's 99 KB per block, the launcher's constants are the kernels', the sliced
normaliser twin agrees with backends/numpy_math.vocab_topk, and shapes numpy refuses are refused before any GPU
work (by the same message)."""
import re
import struct

import numpy as np
import pytest

from ddtree.backends import numpy_math as m
from ddtree.plugins import compile as kc
from ddtree.plugins import vocab_nodes as vn

NODE_KERNELS = {"tree_build.cu": ["node_vocab_topk", "node_tree_build"],
                "sample.cu": ["node_vocab_winner", "node_accept_walk"]}
SM120_SMEM = 101376                    # 99 KB: the largest block of the RTX PRO 6000 (sm_120)
STATIC_SMEM = 48 * 1024                # static __shared__ beyond this fails to launch without opt-in


def elf_sections(blob: bytes) -> dict[str, int]:
    """Section name -> size of a 64-bit little-endian ELF (a cubin)."""
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    entsize, count, names_at = struct.unpack_from("<HHH", blob, 0x3A)
    header = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * entsize) for i in range(count)]
    names = blob[header[names_at][4]: header[names_at][4] + header[names_at][5]]
    return {names[h[0]: names.index(b"\0", h[0])].decode(): h[5] for h in header}


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_node_kernels_compile_within_the_shared_memory_limits(arch):
    for source, kernels in NODE_KERNELS.items():
        blob = kc.compile_cubin(source, arch).read_bytes()
        assert blob[:4] == b"\x7fELF"
        sections = elf_sections(blob)
        for name in kernels:
            assert f".text.{name}" in sections, f"{name} missing from {source} {arch}"
            smem = sections.get(f".nv.shared.{name}", 0)
            assert 0 < smem <= min(STATIC_SMEM, SM120_SMEM), f"{name}: {smem} B of static shared memory"


def defines(source: str) -> dict[str, int]:
    text = (kc.KERNEL_DIR / source).read_text()
    return {k: int(v) for k, v in re.findall(r"^#define (\w+) (\d+)\b", text, re.M)}


def test_launcher_constants_are_the_kernels():
    tree = defines("tree_build.cu")
    sample = {**defines("sample_common.cuh"), **defines("sample.cu")}
    assert (tree["TB_THREADS"], tree["TB_THREADS"] * tree["TB_ITEMS"]) == (vn.THREADS, vn.SLICE)
    assert (tree["TB_MAX_K"], tree["TB_MAX_LIST_KEYS"], tree["TB_MAX_DEPTH"]) == (vn.MAX_K, vn.MAX_LIST_KEYS,
                                                                                  vn.MAX_DEPTH)
    assert (sample["SP_THREADS"], sample["SP_THREADS"] * sample["SP_ITEMS"]) == (vn.THREADS, vn.SLICE)
    assert sample["SP_WALK_THREADS"] == vn.WALK_THREADS == vn.MAX_ROWS   # a thread per node, shared arrays of 256


@pytest.mark.parametrize("V", [1000, 16384, 16385, 20480, 163840])
def test_sliced_normaliser_twin_is_numpys_within_fp32(V):
    """The kernel's order (per 16384-id slice, then the slices combined) against numpy's pairwise fp32 sum:
    row_max exact, row_sumexp within 2e-6 relative (a bug in the combination is off by O(1))."""
    rng = np.random.default_rng(V)
    x = (rng.standard_normal((5, V)) * 3).astype(np.float32)
    x[1, -1] = 40.0                                    # the max in the last slice
    x[2] = -np.abs(x[2]) - 50.0                        # all far below 0
    _, _, row_max, row_sumexp = m.vocab_topk(x, 1, 0)
    top, total = vn.sliced_sumexp(x)
    np.testing.assert_array_equal(top, row_max)
    assert total.dtype == np.float32
    np.testing.assert_allclose(total, row_sumexp, rtol=2e-6)
    exact = np.exp(x.astype(np.float64) - row_max[:, None]).sum(axis=1)
    np.testing.assert_allclose(total, exact, rtol=2e-6)


def test_tree_capacity_is_what_the_builder_reaches():
    """A best-first tree reaches every path of K candidates per depth: K + K^2 + ... + K^D nodes."""
    from ddtree.tree.build import build_tree
    for D, K in ((1, 3), (2, 2), (3, 1), (3, 2)):
        logp = np.tile(-np.arange(1, K + 1, dtype=np.float32), (D, 1))
        ids = np.tile(np.arange(K, dtype=np.int32), (D, 1))
        cap = vn.tree_capacity(D, K)
        assert build_tree(0, logp, ids, min(cap + 3, 255)).size - 1 == cap


def test_shapes_numpy_refuses_are_refused_before_the_gpu():
    """gpu=None: the checks come before any allocation; the messages are numpy_math's."""
    values = np.zeros((1, 2, 1), np.float32)
    with pytest.raises(ValueError, match="only 2 candidates for a budget of 3") as host:
        m.tree_build(0, values, np.zeros((1, 2, 1), np.int32), np.zeros((1, 2), np.float32),
                     np.ones((1, 2), np.float32), 3)
    with pytest.raises(ValueError, match=re.escape(str(host.value))):
        vn.TreeBuild(None, tp=1, depth=2, k=1, budget=3)
    with pytest.raises(ValueError, match="k 9 exceeds the rank's 8 vocab ids") as host:
        m.vocab_topk(np.zeros((2, 8), np.float32), 9, 0)
    with pytest.raises(ValueError, match=re.escape(str(host.value))):
        vn.VocabTopK(None, vocab=8, k=9)
    with pytest.raises(ValueError, match="17 slices of 16384"):                  # S k > 4096 keys per row
        vn.VocabTopK(None, vocab=16384 * 17, k=255)
    with pytest.raises(ValueError, match="depth must be in 1..16"):
        vn.TreeBuild(None, tp=1, depth=17, k=4, budget=4)
    with pytest.raises(ValueError, match="tp 8 x k 513"):
        vn.TreeBuild(None, tp=8, depth=2, k=513, budget=16)
    with pytest.raises(ValueError, match="rows 257 must be in 1..256"):
        vn.VocabWinner.run(type("W", (), {"max_rows": 256})(), 0, 0, 0, 0, 0, 0, rows=257)
