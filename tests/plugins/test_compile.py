"""CPU tests: the kernels compile to cubins for sm_90 and sm_120 with the pip NVRTC (no GPU needed),
the cache is keyed by source, arch and options, and the package imports without cuda-python."""
import subprocess
import sys

from ddtree.plugins import compile as kc
from ddtree.plugins.mla_attention import VARIANTS
from ddtree.plugins.moe import RINGS

# every extern "C" kernel the launchers look up, per source
KERNELS = {"moe.cu": ["moe_route"] + [f"moe_{k}_r{r}c{c}" for k in ("gate_up", "down") for r, c in RINGS],
           "gemm.cu": ["gemm_bf16_mt1", "gemm_bf16_mt2", "gemm_bf16_mt4", "gemm_bf16_mt8"],
           "fill.cu": ["fill_hash_u32"],
           "mla_attention.cu": ["mla_attention_combine", "mla_attention_smem_sizes"]
                               + [f"mla_attention_p{w // 2}_s{s}" for f, w, s, _ in VARIANTS if f == "tree"],
           "mla_decode.cu": ["mla_decode_smem_sizes"]
                            + [f"mla_decode_r{g}_k{w // g}_s{s}" for f, w, s, g in VARIANTS if f == "decode"],
           "kv_cache.cu": ["kv_append", "kv_compact"],
           "tree_build.cu": ["draft_lse_parts", "draft_topk", "draft_merge"],
           "sample.cu": ["sample_greedy", "sample_gumbel", "sample_filtered"],
           "sample_top_p.cu": ["sample_mass", "sample_kept"]}


def test_compile_all_archs_to_cubin(tmp_path):
    paths = kc.compile_all(("sm_90", "sm_120"), cache=tmp_path)
    assert set(paths) == {(s, a) for s in kc.SOURCES for a in ("sm_90", "sm_120")}
    for (source, arch), path in paths.items():
        blob = path.read_bytes()
        assert blob[:4] == b"\x7fELF", f"{path} is not a cubin"
        for name in KERNELS[source]:
            assert name.encode() in blob, f"{name} missing from {path}"
    sm90, sm120 = paths[("moe.cu", "sm_90")].read_bytes(), paths[("moe.cu", "sm_120")].read_bytes()
    assert sm90 != sm120
    # cached: same path, file untouched
    mtime = paths[("fill.cu", "sm_90")].stat().st_mtime_ns
    again = kc.compile_cubin("fill.cu", "sm_90", cache=tmp_path)
    assert again == paths[("fill.cu", "sm_90")] and again.stat().st_mtime_ns == mtime


def test_cache_key_tracks_options_and_arch():
    base = kc.cubin_key("fill.cu", "sm_90")
    assert kc.cubin_key("fill.cu", "sm_120") != base
    assert kc.cubin_key("fill.cu", "sm_90", {"DD_STAGES": 3}) != base
    assert kc.cubin_key("fill.cu", "sm_90") == base


def test_bad_source_or_arch_is_named():
    import pytest
    with pytest.raises(ValueError, match="unknown kernel source 'nope.cu'"):
        kc.compile_cubin("nope.cu", "sm_90")
    with pytest.raises(ValueError, match="arch must look like"):
        kc.compile_cubin("fill.cu", "90")


def test_package_imports_without_cuda_python():
    code = ("import sys; sys.modules['cuda'] = None\n"
            "import ddtree.cli, ddtree.plugins.layout, ddtree.plugins.moe, ddtree.plugins.gemm, "
            "ddtree.plugins.reference, ddtree.bench.kernels, ddtree.plugins.mla_attention, "
            "ddtree.plugins.kv_cache, ddtree.bench.attention, ddtree.plugins.tree_build, "
            "ddtree.plugins.tree_sample, ddtree.bench.tree\n")
    subprocess.run([sys.executable, "-c", code], check=True)
