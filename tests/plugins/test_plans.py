"""CPU tests of the launch plans: every plan the launchers can pick fits the shared memory of both
target archs (H200 sm_90: 227 KB per block; RTX PRO 6000 sm_120: 99 KB), and bad knobs are named.
The attention plans are checked at every preset's latent dims (kv_lora_rank, qk_rope_head_dim)."""
import pytest

from ddtree.model.presets import PRESETS, get_preset
from ddtree.plugins.gemm import plan_gemm
from ddtree.plugins.moe_plan import DEFAULT_RING, ONE_CHUNK_RING, RINGS, STAGE_BYTES, MoEShape, plan_moe

ARCHS = {"sm_90": dict(sm_count=132, smem_limit=232448), "sm_120": dict(sm_count=188, smem_limit=101376)}
STAGES = 6                                          # compile.SOURCES ring depth of the skinny GEMM
MOE_SHAPES = {"tp1": MoEShape(7168, 2048, 384, 8), "tp8": MoEShape(7168, 256, 384, 8)}
GEMM_SHAPES = [(163840 // 8, 7168), (1536, 7168), (7168, 18432), (12288, 1536), (384, 7168), (7168, 256)]
KIMI = dict(latent=512, rope=64)


def preset_latent(name: str) -> dict:
    cfg = get_preset(name, layers=2 if name == "kimi-k2.6" else None)[0]
    return dict(latent=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("name", sorted(MOE_SHAPES))
def test_moe_plans_fit(arch, name):
    a, shape = ARCHS[arch], MOE_SHAPES[name]
    ring = DEFAULT_RING.get(arch, DEFAULT_RING["default"])
    for M in range(1, 257):
        p = plan_moe(shape, M, a["sm_count"], a["smem_limit"], ring)
        assert max(p.gu_smem, p.dn_smem) <= a["smem_limit"]
        assert (shape.hidden // 64) % p.gu_splits == 0 and (shape.inter // 64) % p.dn_splits == 0
        # the kernel's layout: 8 rows of (kspan + 32) bf16, the float4 bias terms, the warps' rings
        kspan = shape.inter // p.dn_splits
        assert p.dn_smem == 16 * (kspan + 32) + 2 * kspan + p.dn_warps * p.dn_ring[0] * p.dn_ring[1] * STAGE_BYTES
        assert p.gu_warps >= 8 and p.gate_up_kernel == "moe_gate_up_r%dc%d" % ring
        assert p.dn_ring == (ONE_CHUNK_RING if name == "tp8" else ring)
        for other in RINGS:                         # every compiled ring has a plan that fits, or a clear error
            try:
                q = plan_moe(shape, M, a["sm_count"], a["smem_limit"], other, gu_warps=8, dn_warps=4)
            except ValueError as exc:
                assert "shared memory" in str(exc) or "k-split that fits" in str(exc)
                continue
            assert max(q.gu_smem, q.dn_smem) <= a["smem_limit"] and q.gate_up_kernel.endswith("r%dc%d" % other)
            assert q.down_kernel.endswith("r%dc%d" % (ONE_CHUNK_RING if name == "tp8" else other))


def test_moe_plan_rejects_bad_down_split_and_ring():
    with pytest.raises(ValueError, match="down: splits 3 must divide inter / 64 = 32"):
        plan_moe(MOE_SHAPES["tp1"], 1, 132, 232448, (4, 2), dn_splits=3)
    with pytest.raises(ValueError, match="down: splits 4 must divide inter / 64 = 4 into a multiple of 2"):
        plan_moe(MOE_SHAPES["tp8"], 1, 132, 232448, (4, 2), dn_splits=4, dn_ring=(4, 2))
    with pytest.raises(ValueError, match=r"ring \(5, 1\) is not compiled"):
        plan_moe(MOE_SHAPES["tp1"], 1, 132, 232448, (4, 2), gu_ring=(5, 1))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_gemm_plans_fit(arch):
    a = ARCHS[arch]
    for N, K in GEMM_SHAPES:
        for M in (1, 2, 8, 16, 17, 64, 256):
            p = plan_gemm(M, N, K, a["sm_count"], a["smem_limit"], 4, STAGES)
            assert p.smem <= a["smem_limit"] and (K // 64) % p.splits == 0 and p.mb * 8 * p.mt >= M


def test_gemm_plan_rejects_bad_warps():
    with pytest.raises(ValueError, match=r"warps per block must be in \[1, 8\], got 16"):
        plan_gemm(1, 1536, 7168, 132, 232448, 16, STAGES)


def test_gemm_two_tiles_per_warp_only_for_big_weights_from_9_tokens():
    big, small = (163840, 7168), (1536, 7168)
    for M in (9, 16, 17, 33, 65, 256):
        assert plan_gemm(M, *big, 132, 232448, 4, STAGES).tpw == 2
    assert plan_gemm(8, *big, 132, 232448, 4, STAGES).tpw == 1
    for M in (16, 17, 65):
        assert plan_gemm(M, *small, 132, 232448, 4, STAGES).tpw == 1


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("hidden, inter", [(64, 64), (128, 64), (512, 64), (7168, 64), (7168, 128), (576, 192)])
def test_moe_small_shapes_fall_back_to_one_chunk_slots(arch, hidden, inter):
    """The default 2-chunk ring needs an even number of chunks per split; other shapes (tests, tiny
    presets) get the one-chunk ring for that kernel only, never an error."""
    a, ring = ARCHS[arch], DEFAULT_RING.get(arch, DEFAULT_RING["default"])
    shape = MoEShape(hidden, inter, 16, 4, max_tokens=64)
    for M in (1, 5, 64):
        p = plan_moe(shape, M, a["sm_count"], a["smem_limit"], ring)
        assert (hidden // 64 // p.gu_splits) % p.gu_ring[1] == 0 and (inter // 64 // p.dn_splits) % p.dn_ring[1] == 0
        assert p.dn_ring == ONE_CHUNK_RING                         # short K (<= 8 chunks): one-chunk slots
        assert max(p.gu_smem, p.dn_smem) <= a["smem_limit"]
    forced = plan_moe(MOE_SHAPES["tp8"], 1, 132, 232448, (4, 2), dn_splits=4)      # down falls back alone
    assert forced.dn_ring == ONE_CHUNK_RING and forced.gu_ring == (4, 2)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_attention_plans_fit_and_fill_the_gpu(arch, preset):
    from ddtree.plugins.mla_attention import DECODE_MAX_ROWS, MIN_CHUNK, blocks_per_sm, plan_attention
    a, dims = ARCHS[arch], preset_latent(preset)
    for heads in (4, 8, 64):
        for context in (0, 1, 100, 4096, 131072):
            for q in range(1, 257):
                p = plan_attention(q, heads, context, a["sm_count"], a["smem_limit"], **dims)
                assert p.smem <= a["smem_limit"]
                assert p.row_tiles * p.rows_per_block >= q * heads > (p.row_tiles - 1) * p.rows_per_block
                assert p.form in (("decode",) if q * heads <= DECODE_MAX_ROWS else ("tree", "tree_qreg"))
                assert p.prefix_splits >= 1 and p.tree_own == (p.prefix_splits >= 2)
                # no split shorter than MIN_CHUNK keys, at most 4 waves' worth of splits
                capacity = a["sm_count"] * blocks_per_sm(p.smem, a["smem_limit"])
                assert p.prefix_splits <= min(max(1, -(-context // MIN_CHUNK)), 4 * capacity)
    # bandwidth-bound: a long prefix spread over one wave that also holds the tree's block
    p = plan_attention(1, 8, 131072, a["sm_count"], a["smem_limit"], **dims)
    assert p.form == "decode" and p.splits * p.row_tiles == a["sm_count"] * blocks_per_sm(p.smem, a["smem_limit"])


def test_attention_split_choice_on_measured_h200_shapes():
    """The wave model picks what the H200 sweeps found best (ddtree/plugins/kernels/NOTES.md): decode one wave with the tree block,
    64 row tiles of 8 warps 2 splits + tree (not one merged split on half the SMs), 256 tiles one merged split."""
    from ddtree.plugins.mla_attention import plan_attention
    h200 = dict(sm_count=132, smem_limit=232448, **KIMI)
    assert plan_attention(1, 8, 32768, **h200).prefix_splits == 131
    p = plan_attention(64, 64, 4096, **h200)
    assert (p.row_tiles, p.prefix_splits, p.tree_own) == (64, 2, True)
    p = plan_attention(256, 8, 32768, **h200)
    assert (p.row_tiles, p.prefix_splits, p.tree_own) == (32, 4, True)
    p = plan_attention(256, 64, 4096, **h200)
    assert (p.prefix_splits, p.tree_own) == (1, False)


def test_attention_plan_errors_name_the_bad_value():
    from ddtree.plugins.mla_attention import plan_attention
    with pytest.raises(ValueError, match="q = 257"):
        plan_attention(257, 8, 10, 132, 232448, **KIMI)
    with pytest.raises(ValueError, match="heads = 0"):
        plan_attention(1, 0, 10, 132, 232448, **KIMI)
    with pytest.raises(ValueError, match=r"\(form, warps, stages, row groups\) = \('tree', 6, 2, 6\) not compiled"):
        plan_attention(1, 8, 10, 132, 232448, form="tree", warps=6, stages=2, row_groups=6, **KIMI)
    with pytest.raises(ValueError, match="needs .* B of shared memory; the device allows 101376"):
        plan_attention(64, 8, 10, 188, 101376, form="tree", warps=8, stages=3, row_groups=8, **KIMI)


def test_attention_smem_follows_the_latent_dims():
    """sizeof(MlaSmem) / sizeof(DecodeSmem) by hand for tiny's dims (latent 64, rope 16: rows of 88 bf16):
    the launcher sizes shared memory for the dims it compiles (the GPU test compares with the kernel's
    sizeof at every dims); a smaller model fits deeper rings on the 99 KB sm_120."""
    from ddtree.plugins.mla_attention import plan_attention, smem_bytes
    # tree, 2 pairs, 3 stages: q 32 rows + kv 3 x 32 rows of 88 bf16, p 2 x 16 x 40 bf16, swap 2 x 2 x 16 fp32, 3 u64
    assert smem_bytes("tree", 4, 3, 4, 64, 16) == 32 * 88 * 2 + 96 * 88 * 2 + 2 * 16 * 40 * 2 + 2 * 2 * 16 * 4 + 3 * 8
    # decode, 1 row group x 2 streams, 4 slots: q 8 rows; union(ring 4 x 16 rows, merge 2 x 8 x (64 + 4) fp32
    # + m, l); pt 2 x 8 x 24 bf16; full + empty 2 x 4 u64
    assert smem_bytes("decode", 2, 4, 1, 64, 16) == 8 * 88 * 2 + max(4 * 16 * 88 * 2, 2 * 8 * 68 * 4 + 2 * 2 * 8 * 4) \
        + 2 * 8 * 24 * 2 + 2 * 4 * 8
    assert smem_bytes("tree", 4, 3, 4, 512, 64) == 32 * 584 * 2 + 96 * 584 * 2 + 2 * 16 * 40 * 2 + 2 * 2 * 16 * 4 + 24
    tiny = plan_attention(64, 4, 4096, 188, 101376, latent=64, rope=16)
    kimi = plan_attention(64, 4, 4096, 188, 101376, **KIMI)
    assert tiny.smem < kimi.smem and (tiny.warps, tiny.stages) >= (kimi.warps, kimi.stages)


def test_combine_shape_divides_the_latent():
    """mla_attention_combine's grid y is latent / (4 lanes): lanes divide latent / 4 at every dims; they narrow
    (groups grow, up to the split count's power of two) only while the grid would leave SMs without a block."""
    from ddtree.plugins.mla_attention import combine_shape
    for latent in (32, 64, 96, 160, 512):
        for splits in (2, 3, 5, 17, 200):
            for rows in (8, 64, 136, 2048):
                groups, lanes = combine_shape(splits, latent, rows, 132)
                blocks = rows * latent // (4 * lanes)
                assert groups * lanes == 256 and (latent // 4) % lanes == 0 and 8 <= lanes <= 128
                if lanes > 8:      # narrower would not have helped: the grid fills the GPU or groups cover the splits
                    assert blocks >= 132 or groups >= 2 ** (splits - 1).bit_length()
    # H200 shapes: 136 rows x 26 splits one block per row (it was 1088 blocks of 16 x 16: over one wave);
    # 8 rows x 132 splits 32 groups of 8 lanes; few splits over few rows as before
    assert combine_shape(26, 512, 136, 132) == (2, 128)
    assert combine_shape(132, 512, 8, 132) == (32, 8)
    assert [combine_shape(s, 512, 8, 132) for s in (2, 3, 5)] == [(2, 128), (4, 64), (8, 32)]
    assert combine_shape(2, 64, 8, 132) == (16, 16) and combine_shape(3, 96, 8, 132) == (32, 8)


def test_gemm_plans_against_the_recorded_h200_sweep():
    """tests/fixtures/plugins/gemm_sweep_h200_tp8.json (tests/plugins/sweep_gemm.py on an H200: every (warps,
    splits) plan of Kimi's tp 8 GEMMs timed at M = 1..65, and the plan the waves model chose then): at M <= 16
    plan_gemm still picks that plan; at M > 16 its plans' measured times sum to >= 10 % less than the waves
    model's and within 5 % of the best plan's at every M."""
    import json
    from collections import defaultdict
    from pathlib import Path
    sweep = json.loads((Path(__file__).parents[1] / "fixtures" / "plugins" / "gemm_sweep_h200_tp8.json").read_text())
    sums = defaultdict(lambda: [0.0, 0.0, 0.0])                   # M -> (chosen, waves model, best) us
    for r in sweep["rows"]:
        p = plan_gemm(r["M"], r["N"], r["K"], 132, 232448, None, STAGES)
        chosen = [c for c in r["candidates"] if (c["warps"], c["splits"]) == (p.warps, p.splits)]
        assert chosen, f"{r['name']} M={r['M']}: plan {p} was not swept"
        if r["M"] <= 16:
            assert (p.warps, p.splits) == (r["planned"]["warps"], r["planned"]["splits"]), (r["name"], r["M"])
        s = sums[r["M"]]
        s[0] += chosen[0]["us"]
        s[1] += r["planned"]["us"]
        s[2] += min(c["us"] for c in r["candidates"])
    for M, (chosen, waves, best) in sums.items():
        if M > 16:
            assert chosen <= 0.9 * waves and chosen <= 1.05 * best, (M, chosen, waves, best)


def test_gemm_token_tiles_are_exact():
    """A token block holds exactly the 8-token sub-tiles it needs (the skinny GEMM's and the fused router's
    blocks): the fewest blocks of <= 64 rows, balanced, never an empty block nor a whole empty sub-tile (the
    rounding to a power of two it replaced computed 64 rows for 33)."""
    from ddtree.plugins.gemm import token_tiles
    assert [token_tiles(M) for M in (1, 8, 9, 17, 33, 64, 65, 129, 256)] == [
        (1, 1), (1, 1), (2, 1), (3, 1), (5, 1), (8, 1), (5, 2), (6, 3), (8, 4)]
    for M in range(1, 257):
        mt, mb = token_tiles(M)
        assert 1 <= mt <= 8 and mb == -(-M // 64) == -(-M // (8 * mt))
        assert (mb - 1) * 8 * mt < M <= mb * 8 * mt            # no empty token block
        assert 0 <= mb * mt * 8 - M < 8 * mb                   # less than one sub-tile of padding a block
