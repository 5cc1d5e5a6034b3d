"""CPU tests of the skinny GEMM's token blocks of up to 9 sub-tiles and its four-tile group kernel (plugins/gemm.py
token_tiles, plan_gemm max_mt / tpw 4): the blocks cover M with the fewest sub-tiles past M, every plan the knobs
give fits the shared memory and names a kernel the cubin holds, for sm_90 and sm_120."""
import pytest

from ddtree.bench.kernels import GEMM_SHAPES
from ddtree.plugins import compile as kc
from ddtree.plugins.gemm import (
    G4_MTS,
    G4_STAGES,
    MAX_MT,
    TM_SLOTS,
    TM_TTS,
    plan_gemm,
    plan_gemm_tm,
    tm_tiles,
    token_tiles,
)

H200_SMEM, PRO6000_SMEM = 232448, 101376


@pytest.mark.parametrize("max_mt", range(1, MAX_MT + 1))
def test_token_tiles_cover_the_rows_with_the_fewest_blocks(max_mt):
    for M in range(1, 257):
        mt, mb = token_tiles(M, max_mt)
        sub = -(-M // 8)
        assert 1 <= mt <= max_mt and mt * mb >= sub                  # every row in a block
        assert mb == -(-sub // max_mt)                               # the fewest blocks of at most max_mt
        assert (mt - 1) * mb < sub                                   # one sub-tile less a block would not cover
    assert token_tiles(65, 9) == (9, 1) and token_tiles(65) == (5, 2) and token_tiles(72, 9) == (9, 1)
    assert token_tiles(73, 9) == (5, 2)


def test_token_tiles_refuse_a_block_the_kernels_lack():
    with pytest.raises(ValueError, match=r"sub-tiles per block must be in \[1, 9\], got 10"):
        token_tiles(65, 10)


@pytest.mark.parametrize("smem", [H200_SMEM, PRO6000_SMEM])
@pytest.mark.parametrize("tp", sorted(GEMM_SHAPES))
def test_forced_tile_plans_fit_and_name_their_kernel(tp, smem):
    for name, N, K, _ in GEMM_SHAPES[tp]:
        for M in (17, 33, 65, 72, 129, 256):
            for max_mt in (8, 9):
                for tpw, warps in ((1, 4), (2, 4), (2, 8), (4, 4)):
                    try:
                        p = plan_gemm(M, N, K, 132, smem, warps, 6, tpw=tpw, max_mt=max_mt)
                    except ValueError as exc:                        # nothing fits (the small sm_120 budget)
                        assert "no k-split" in str(exc), exc
                        continue
                    x_bytes = 8 * p.mt * ((K // 64 // p.splits) * 64 + 32) * 2
                    stages = G4_STAGES if p.kernel.endswith("_g4") else 6
                    assert p.smem == x_bytes + warps * stages * 2048 <= smem - 1024, (name, M, p)
                    assert p.kernel.endswith("_g4") == (tpw == 4 and p.mt in G4_MTS)
                    assert p.mt * p.mb * 8 >= M and p.mt <= max_mt
                    assert p.nb * warps * tpw * 16 >= N


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_every_planned_kernel_is_compiled(arch):
    blob = kc.compile_cubin("gemm.cu", arch).read_bytes()
    names = [f"gemm_bf16_mt{mt}" for mt in range(1, MAX_MT + 1)] + [f"gemm_bf16_mt{mt}_g4" for mt in G4_MTS]
    names += [f"gemm_bf16_tm{tt}_g{g}" for tt in TM_TTS for g in TM_SLOTS]
    for name in names:
        assert name.encode() + b"\0" in blob, f"{name} missing from gemm.cu {arch}"


def test_tm_tiles_cover_the_rows_with_the_fewest_blocks_of_5():
    for M in range(17, 257):
        tt, mb = tm_tiles(M)
        tiles = -(-M // 16)
        assert tt in TM_TTS and tt * mb >= tiles and mb == -(-tiles // 5) and (tt - 1) * mb < tiles, M
    assert tm_tiles(17) == (2, 1) and tm_tiles(65) == (5, 1) and tm_tiles(80) == (5, 1) and tm_tiles(81) == (3, 2)
    with pytest.raises(ValueError, match="M > 16 rows, got M = 16"):
        tm_tiles(16)


@pytest.mark.parametrize("smem", [H200_SMEM, PRO6000_SMEM])
@pytest.mark.parametrize("tp", sorted(GEMM_SHAPES))
def test_tm_plans_fit_and_name_their_kernel(tp, smem):
    """Every planned and forced tokens-as-M plan of Kimi's GEMMs fits the block's shared memory (16 TT token rows
    of K / S, rings of TM_SLOTS[G] chunks of G tiles a warp), covers N and names a compiled kernel."""
    for name, N, K, _ in GEMM_SHAPES[tp]:
        for M in (17, 33, 65, 80, 81, 129, 256):
            for knobs in (dict(), dict(warps=8, tpw=2), dict(warps=4, tpw=1)):
                try:
                    p = plan_gemm_tm(M, N, K, 132, smem, **knobs)
                except ValueError as exc:
                    assert "no k-split" in str(exc), exc
                    continue
                x_bytes = 16 * p.mt * (K // 64 // p.splits) * 64 * 2
                assert p.tm and p.smem == x_bytes + p.warps * TM_SLOTS[p.tpw] * p.tpw * 2048 <= smem - 1024, (name, M, p)
                assert p.kernel == f"gemm_bf16_tm{p.mt}_g{p.tpw}" and (p.mt, p.mb) == tm_tiles(M)
                assert p.nb * p.warps * p.tpw * 16 >= N and (K // 64) % p.splits == 0
                if not knobs:
                    assert p.tpw == (2 if N * K * 2 >= 64 << 20 else 1), (name, p)


def test_tm_plan_refuses_bad_knobs():
    with pytest.raises(ValueError, match="weight tiles a warp must be one of \\[1, 2\\], got 4"):
        plan_gemm_tm(65, 1536, 7168, 132, H200_SMEM, tpw=4)
    with pytest.raises(ValueError, match="splits 5 must divide K / 64 = 112"):
        plan_gemm_tm(65, 1536, 7168, 132, H200_SMEM, splits=5)
    with pytest.raises(ValueError, match="no k-split whose 80 token rows fit"):
        plan_gemm_tm(65, 1536, 7168, 132, PRO6000_SMEM, splits=1)
