"""CPU tests: the kernels compile to cubins for sm_90 and sm_120 with the pip NVRTC (no GPU needed),
the MLA attention and KV cache at every preset's latent dims (Kimi's cubins byte-identical to those the
H200 measurements were taken with), unsupported dims refused by name before NVRTC, the cache is keyed by
source, arch and options, and the package imports without cuda-python."""
import hashlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddtree.errors import InputError
from ddtree.model.presets import PRESETS, get_preset
from ddtree.plugins import compile as kc
from ddtree.plugins.mla_attention import VARIANTS
from ddtree.plugins.moe_down_cols import COLS_RINGS
from ddtree.plugins.moe_plan import RINGS

# every extern "C" kernel the launchers look up, per source
KERNELS = {"moe.cu": ["moe_route"] + [f"moe_{k}_r{r}c{c}" for k in ("gate_up", "down", "stream") for r, c in RINGS]
                     + [f"moe_down_cols_r{r}c{c}" for r, c in COLS_RINGS],
           "gemm.cu": [f"gemm_bf16_mt{mt}" for mt in range(1, 9)],
           "fill.cu": ["fill_hash_u32"],
           "mla_attention.cu": ["mla_attention_combine", "mla_attention_smem_sizes"]
                               + [f"mla_attention_p{w // 2}_s{s}" for f, w, s, _ in VARIANTS if f == "tree"],
           "mla_decode.cu": ["mla_decode_smem_sizes"]
                            + [f"mla_decode_r{g}_k{w // g}_s{s}" for f, w, s, g in VARIANTS if f == "decode"],
           "mla_invariant.cu": ["mla_invariant_split", "mla_invariant_combine"],
           "kv_cache.cu": ["kv_append", "kv_compact", "kv_append_normed"],
           "mla_absorb.cu": [f"mla_absorb{q}_mt{mt}" for q in ("", "_q_rope") for mt in (1, 2, 4)],
           "draft_attention.cu": ["draft_attention_d32", "draft_attention_d64", "draft_attention_d128",
                                  "draft_attention_combine"],
           "tree_build.cu": ["draft_lse_parts", "draft_topk", "draft_merge"],
           "sample.cu": ["sample_greedy", "sample_gumbel", "sample_filtered"],
           "sample_top_p.cu": ["sample_row_max", "sample_mass", "sample_kept"],
           "sample_top_p_ranks.cu": ["topp_ranks_max", "topp_ranks_mass", "topp_ranks_decide", "topp_ranks_scan",
                                     "topp_ranks_cut"],
           "layer_ops.cu": ["embed_rows", "rms_norm_rows", "add_rms_norm_rows", "add_rows", "rope_interleaved",
                            "rope_rotate_half", "head_rms_norm", "silu_mul", "gather_rows", "cast_f32_bf16", "positions_from", "rows_at"],
           "step_state.cu": ["step_prologue", "ctx_window", "step_commit", "step_force_accept"],
           "allreduce.cu": ["allreduce_push", "allreduce_pull", "allreduce_two_shot", "allreduce_pingpong",
                           "allreduce_sum_local", "allgather_push"],
           "router.cu": [f"router_fused_mt{mt}" for mt in range(1, 9)],
           "prefetch.cu": ["l2_prefetch", "touch_pages"],
           "pcie_standin.cu": ["pcie_standin"],
           "gemm_chain.cu": ["gemm_chain_mt1", "gemm_chain_mt2", "gemm_chain_mt3"],
           "tree_prune.cu": ["tree_prune"],
           "prune_ops.cu": ["mask_dead", "prune_path_probs"]}


# sha256 of Kimi's (latent 512, rope 64) cubins, by NVRTC version: the kernels the H200 numbers in
# ddtree/plugins/kernels/NOTES.md were measured with. The attention's (mla_attention.cu, mla_decode.cu) are
# those of commit c79509e (issue 23's before/after tables and plan sweep); kv_cache.cu's were recomputed
# (compile_cubin, NVRTC 13.5) when kv_compact gained its device count (min(n, *count) entries move) and again
# when kv_append_normed joined the file (kv_append and kv_compact unchanged in the source); its timings are not
# among ddtree/plugins/kernels/NOTES.md numbers.
# 2026-12-07: common.cuh's arrive_last no longer calls atomicExch, so no cubin that includes common.cuh carries the
# unused global __nv_atomic_triv_cp_helper<unsigned>::__val that it instantiated; the PTX of these sources differs
# from the measured one by that declaration alone (checked for all six), so their kernels are the measured ones.
KIMI_CUBINS = {(13, 5): {
    ("mla_attention.cu", "sm_90"): "3006d7eb7e8924f0d15c3ea177db212b206c60b9233bbbcc183f764bca3dafbe",
    ("mla_attention.cu", "sm_120"): "e2f2d00bb1b5cafa9e48ef58e9531318a96c3fad421c1dfba6998f6fcc9ae1ef",
    ("mla_decode.cu", "sm_90"): "2f0dea4512d60b33d0f6aacd290a8286130f74b22deb6dcec5339853f7b65dea",
    ("mla_decode.cu", "sm_120"): "4314e3dd252911f0f2cd39b63072d8cbdd859695dd8c1cf348759eb806e188d5",
    ("kv_cache.cu", "sm_90"): "bf3d721c30f6fd0a4f7edd65550a7b0054ea090e4e60c2deac24f29268d98a25",
    ("kv_cache.cu", "sm_120"): "f3b9129e9044e09fe33507e38bde2e41c378df01a73373ae9b8e22bd305afa65"}}


@pytest.fixture(scope="module")
def cubin_cache(kernel_cache):
    """The session's cubin cache (conftest kernel_cache): each (source, arch, dims) compiles once per run, here or
    in any other test that needs it."""
    return kernel_cache


def preset_dims(name: str) -> tuple[int, int]:
    cfg = get_preset(name, layers=2 if name == "kimi-k2.6" else None)[0]
    return cfg.kv_lora_rank, cfg.qk_rope_head_dim


def test_compile_all_archs_to_cubin(cubin_cache):
    tmp_path = cubin_cache
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


def test_step_stamps_diagnosis_build_compiles_for_the_product(cubin_cache):
    """-D DD_STEP_STAMPS (kernels/stamps.cuh, tests/plugins/profile_step_stamps.py) builds router.cu and moe.cu for
    sm_120 and carries the ring the profile reads by name; the plain build (test above) carries none of it. The two
    stamped builds compile side by side (NVRTC in threads, as compile_all does): 44 s one after the other on 2 cores."""
    sources = ("router.cu", "moe.cu")
    with ThreadPoolExecutor(len(sources)) as pool:
        stamped = list(pool.map(lambda s: kc.compile_cubin(s, "sm_120", {"DD_STEP_STAMPS": 1}, cache=cubin_cache),
                                sources))
    for source, path in zip(sources, stamped):
        plain = kc.compile_cubin(source, "sm_120", cache=cubin_cache).read_bytes()
        for name in (b"dd_stamp_ring", b"dd_stamp_count"):
            assert name in path.read_bytes() and name not in plain, (source, name)


@pytest.mark.parametrize("preset", PRESETS)
def test_latent_kernels_compile_at_every_preset_dims(cubin_cache, preset):
    latent, rope = preset_dims(preset)
    paths = kc.compile_all(("sm_90", "sm_120"), cache=cubin_cache, latent=latent, rope=rope)
    kimi = kc.compile_all(("sm_90", "sm_120"), cache=cubin_cache)
    for source in kc.LATENT_SOURCES:
        for arch in ("sm_90", "sm_120"):
            blob = paths[(source, arch)].read_bytes()
            assert blob[:4] == b"\x7fELF", f"{paths[(source, arch)]} is not a cubin"
            for name in KERNELS[source]:
                assert name.encode() in blob, f"{name} missing from {source} {arch} at latent {latent}, rope {rope}"
            # one cubin per dims: another model's is another file with other code (same file at Kimi's dims)
            assert (paths[(source, arch)] == kimi[(source, arch)]) == ((latent, rope) == (512, 64))
            if (latent, rope) != (512, 64):
                assert blob != kimi[(source, arch)].read_bytes()
    assert paths[("moe.cu", "sm_90")] == kimi[("moe.cu", "sm_90")]       # the other sources take no dims


def test_kimi_cubins_are_the_measured_ones(cubin_cache):
    """Making the dims defines changed no byte of Kimi's kernels, so the H200 timings still hold."""
    want = KIMI_CUBINS.get(kc.nvrtc_version())
    if want is None:
        pytest.skip(f"digests recorded for NVRTC {sorted(KIMI_CUBINS)}, this is {kc.nvrtc_version()}")
    for (source, arch), digest in want.items():
        path = kc.compile_cubin(source, arch, kc.latent_defines(512, 64), cache=cubin_cache)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, f"{source} {arch} changed"


@pytest.mark.parametrize("latent, rope, match", [
    (48, 16, r"latent \(kv_lora_rank\) = 48 must be a multiple of 32"),
    (1024, 64, r"latent \(kv_lora_rank\) = 1024 must be a multiple of 32 in \[32, 512\]"),
    (0, 16, r"latent \(kv_lora_rank\) = 0"),
    (64, 8, r"rope \(qk_rope_head_dim\) = 8 must be a positive multiple of 16"),
    (64, 0, r"rope \(qk_rope_head_dim\) = 0"),
    (64.0, 16, r"latent \(kv_lora_rank\) must be an int, got 64.0")])
def test_unsupported_dims_are_refused_by_name_before_compiling(tmp_path, latent, rope, match):
    from ddtree.plugins.kv_cache import DeviceLatentCache
    from ddtree.plugins.mla_attention import MlaTreeAttention, plan_attention
    with pytest.raises(kc.LatentDimsError, match=match) as err:
        kc.latent_defines(latent, rope)
    assert isinstance(err.value, InputError)               # a checkpoint's config can carry such dims
    for source in kc.LATENT_SOURCES:
        with pytest.raises(kc.LatentDimsError, match=match):
            kc.compile_cubin(source, "sm_90", {"MLA_DL": latent, "MLA_DR": rope}, cache=tmp_path)
    assert not list(tmp_path.iterdir())                    # nothing compiled
    with pytest.raises(kc.LatentDimsError, match=match):   # the launchers check before touching the GPU
        MlaTreeAttention(None, 8, 0.1, latent=latent, rope=rope)
    with pytest.raises(kc.LatentDimsError, match=match):
        DeviceLatentCache(None, 1, 16, latent=latent, rope=rope)
    with pytest.raises(kc.LatentDimsError, match=match):
        plan_attention(1, 8, 100, 132, 232448, latent=latent, rope=rope)


def test_latent_sources_need_the_dims(tmp_path):
    with pytest.raises(kc.LatentDimsError, match="mla_decode.cu compiles per model: pass defines=latent_defines"):
        kc.compile_cubin("mla_decode.cu", "sm_90", cache=tmp_path)
    with pytest.raises(kc.LatentDimsError, match="kv_cache.cu compiles per model"):
        kc.compile_cubin("kv_cache.cu", "sm_90", {"MLA_DL": 512}, cache=tmp_path)


def test_cache_key_tracks_options_and_arch():
    base = kc.cubin_key("fill.cu", "sm_90")
    assert kc.cubin_key("fill.cu", "sm_120") != base
    assert kc.cubin_key("fill.cu", "sm_90", {"DD_STAGES": 3}) != base
    assert kc.cubin_key("fill.cu", "sm_90") == base
    kimi, tiny = kc.latent_defines(512, 64), kc.latent_defines(64, 16)
    assert kc.cubin_key("mla_attention.cu", "sm_90", kimi) != kc.cubin_key("mla_attention.cu", "sm_90", tiny)


def test_bad_source_or_arch_is_named():
    import pytest
    with pytest.raises(ValueError, match="unknown kernel source 'nope.cu'"):
        kc.compile_cubin("nope.cu", "sm_90")
    with pytest.raises(ValueError, match="arch must look like"):
        kc.compile_cubin("fill.cu", "90")


def test_package_imports_without_cuda_python():
    code = ("import sys; sys.modules['cuda'] = None\n"
            "import ddtree.plugins.mla_absorb, ddtree.plugins.draft_attention\n"
            "import ddtree.cli, ddtree.plugins.layout, ddtree.plugins.moe, ddtree.plugins.gemm, "
            "ddtree.plugins.reference, ddtree.bench.kernels, ddtree.plugins.mla_attention, "
            "ddtree.plugins.kv_cache, ddtree.bench.attention, ddtree.plugins.tree_build, "
            "ddtree.plugins.tree_sample, ddtree.bench.tree, ddtree.plugins.layer_ops\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compile_all_threads_do_not_race_cuda_core_import(tmp_path):
    """compile_all's threads each import cuda.core on a cache miss; cuda.core's __init__ overwrites its own
    __spec__, so unguarded concurrent first imports see a half-built module (CI failed that way, about one
    fresh process in two). Five fresh interpreters, every compile a miss that imports Program in 8 threads."""
    pytest.importorskip("cuda.core")
    script = f"""
from pathlib import Path
from ddtree.plugins import compile as kc
def fake_compile(source, arch, defines=None, cache=None):
    from cuda.core import Program, ProgramOptions  # what a real miss imports
    return Path(cache) / source
kc.compile_cubin = fake_compile
kc.os.cpu_count = lambda: 8
got = kc.compile_all(cache=Path({str(tmp_path)!r}))
assert len(got) == len(kc.SOURCES) * len(kc.DEFAULT_ARCHS), len(got)
"""
    for _ in range(5):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]


def test_a_cubin_asked_for_by_two_threads_compiles_once(tmp_path):
    """The tests' background precompile (tests/kernel_precompile.py) and a test may ask for the same cubin at once:
    the second waits for the first's NVRTC run (~55 s for gemm.cu) and gets its file, instead of compiling again
    into the same temporary name. NVRTC stands in for a fake that takes 0.3 s and counts its calls, in a fresh
    interpreter (a fake set here would also serve this session's background compiles)."""
    script = f"""
import threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from ddtree.plugins import compile as kc
calls, lock = [], threading.Lock()
def fake_nvrtc(path, source, arch, defines):
    with lock:
        calls.append((source, arch))
    time.sleep(0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"ELF" + source.encode())
kc._nvrtc_to, kc.nvrtc_version = fake_nvrtc, lambda: (0, 0)
jobs = [("gemm.cu", "sm_90")] * 4 + [("fill.cu", "sm_90")] * 2 + [("gemm.cu", "sm_120")]
with ThreadPoolExecutor(len(jobs)) as pool:
    paths = list(pool.map(lambda job: kc.compile_cubin(*job, cache=Path({str(tmp_path)!r})), jobs))
assert sorted(calls) == sorted(set(jobs)), calls                  # one NVRTC run a distinct cubin
assert len(set(paths[:4])) == 1 and paths[0].read_bytes() == b"ELFgemm.cu"
assert paths[4] == paths[5] != paths[0] != paths[6]
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
