"""Tree-attention test cases, shared by the fixture builder and the GPU tests.

Every input is bit-reproducible on any machine: the prefix cache is a ddtree.plugins.randfill stream
(filled on the device, recomputed here), queries, tree entries and tree shapes come from hash words
and exact float32 arithmetic. References for the 65536-key cases are computed here once and stored in
tests/fixtures/plugins/attention_<case>.npz (regenerate: python tests/plugins/attention_cases.py) with a
digest of the inputs; smaller cases are computed in the test.

Shaping: prefix scores have a standard deviation near 1; every tree entry carries a common direction u
that the queries share, lifting tree scores by about ln(T + 1) nats, so the tree keys hold roughly
as much attention mass as the whole prefix. A wrong mask, a wrong split boundary or a lost merge then
moves the output by O(1), far above the tolerance, at any context.

Latent dims: Kimi's (512, 64) by default (the fixtures); DIM_CASES add every other preset's dims
(kv_lora_rank, qk_rope_head_dim) and one synthetic shape, with the same shaping, checked against the same
twin at their own dims (the kernels compile per dims: ddtree.plugins.compile.latent_defines).
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np

from ddtree.model.bf16 import bf16_to_f32, f32_to_bf16
from ddtree.model.presets import PRESETS, get_preset
from ddtree.plugins import randfill

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "plugins"
SCALE = get_preset("kimi-k2.6", layers=2)[0].softmax_scale    # 192^-1/2 x YaRN mscale^2 = 0.14468
CONTEXTS = (1, 100, 4096, 65536)
QS = (1, 8, 33, 65, 256)
CASES = [(T, q, 8) for T in CONTEXTS for q in QS] + [(4096, 1, 64), (4096, 33, 64), (100, 65, 64), (65536, 1, 64)]
FIXTURE_CONTEXT = 65536            # cases at this context carry their reference as a fixture
QUERY_SCALE = np.float32(0.25)     # prefix score std near 1 at the Kimi scale
COMMON = np.float32(0.2)          # the queries' share of the common direction u
KIMI_DIMS = (512, 64)              # (latent, rope) of the fixtures and CASES


def preset_dims() -> dict[tuple[int, int], list[str]]:
    """{(kv_lora_rank, qk_rope_head_dim): [preset names]} over every preset."""
    dims: dict[tuple[int, int], list[str]] = {}
    for name in PRESETS:
        cfg = get_preset(name, layers=2 if name == "kimi-k2.6" else None)[0]
        dims.setdefault((cfg.kv_lora_rank, cfg.qk_rope_head_dim), []).append(name)
    return dims


# Every preset's dims, plus (96, 32): a latent whose n-tile count is not a power of two and whose
# combine runs with 8 lanes (latent / 4 = 24)
DIMS = sorted(set(preset_dims()) | {(96, 32)})
# Cases at the other dims (T, q, heads, latent, rope): contexts to 4096 (the twin is computed in the test)
DIM_CASES = [(T, q, heads, *d) for d in DIMS if d != KIMI_DIMS
             for T, q, heads in [(T, q, 4) for T in (1, 100, 4096) for q in (1, 8, 33, 65, 256)]
             + [(4096, 33, 64), (100, 65, 64), (4096, 1, 8)]]


def case_name(T: int, q: int, heads: int, latent: int = 512, rope: int = 64) -> str:
    dims = "" if (latent, rope) == KIMI_DIMS else f"_l{latent}_r{rope}"
    return f"T{T}_q{q}_h{heads}{dims}"


def case_seed(T: int, q: int, heads: int) -> int:
    return (T * 7919 + q * 131 + heads) & 0xFFFFFF


def _unit_floats(n: int, seed: int) -> np.ndarray:
    """n float32 values in [0, 1) from hash words."""
    return (randfill.hash_u32(n, seed) >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


def random_tree(q: int, seed: int) -> np.ndarray:
    """parents [q] int32 (root -1, parents[i] < i): half chain steps, half uniform earlier nodes."""
    words = randfill.hash_u32(2 * q, seed)
    parents = np.full(q, -1, dtype=np.int32)
    for i in range(1, q):
        parents[i] = i - 1 if words[2 * i] & 1 else int(words[2 * i + 1] % i)
    return parents


def visibility(parents: np.ndarray) -> np.ndarray:
    """[q, q] bool ancestor-or-self matrix -> packed words via ddtree.tree.build (the format's owner)."""
    from ddtree.tree.build import pack_visibility
    q = len(parents)
    vis = np.zeros((q, q), dtype=bool)
    for i in range(q):
        if parents[i] >= 0:
            vis[i] = vis[parents[i]]
        vis[i, i] = True
    return pack_visibility(vis)


def prefix_spec(T: int, q: int, seed: int, key_dim: int = 576) -> tuple[tuple, int]:
    """(shape, stream seed) of the device-filled cache: T + q rows (tree rows overwritten by the append)."""
    return (T + q, key_dim), 4 * seed + 1


def inputs(T: int, q: int, heads: int, latent: int = 512, rope: int = 64) -> dict[str, np.ndarray]:
    """Host inputs of one case (bf16 bits): q_lat [q, H, latent], q_rope [q, H, rope], tree entries
    c_kv [q, latent] and k_pe [q, rope], parents, vis words."""
    seed, dk = case_seed(T, q, heads), latent + rope
    u = bf16_to_f32(randfill.hash_array((dk,), np.uint16, 4 * seed + 2, randfill.ACT_BF16))
    base_q = bf16_to_f32(randfill.hash_array((q, heads, dk), np.uint16, 4 * seed + 3, randfill.ACT_BF16))
    base_k = bf16_to_f32(randfill.hash_array((q, dk), np.uint16, 4 * seed + 4, randfill.ACT_BF16))
    lift = np.float32(math.log(T + 1))
    gamma = lift / (COMMON * np.float32(u @ u) * np.float32(SCALE))
    jitter = np.float32(0.75) + np.float32(0.5) * _unit_floats(q, 4 * seed + 5)[:, None]   # keys differ in weight
    query = f32_to_bf16(base_q * QUERY_SCALE + COMMON * u)
    entries = f32_to_bf16(base_k + (gamma * jitter) * u)
    parents = random_tree(q, 4 * seed + 6)
    return {"q_lat": query[..., :latent].copy(), "q_rope": query[..., latent:].copy(),
            "c_kv": entries[:, :latent].copy(), "k_pe": entries[:, latent:].copy(), "parents": parents,
            "vis": visibility(parents)}


def full_cache(T: int, q: int, heads: int, case: dict) -> np.ndarray:
    """The cache the kernel sees after the append: prefix stream rows, then the tree entries."""
    latent, rope = case["c_kv"].shape[1], case["k_pe"].shape[1]
    shape, stream = prefix_spec(T, q, case_seed(T, q, heads), latent + rope)
    cache = randfill.hash_array(shape, np.uint16, stream, randfill.ACT_BF16).copy()
    cache[T:, :latent] = case["c_kv"]
    cache[T:, latent:] = case["k_pe"]
    return cache


def digest(case: dict) -> str:
    h = hashlib.sha256()
    for key in ("q_lat", "q_rope", "c_kv", "k_pe", "vis"):
        h.update(np.ascontiguousarray(case[key]).tobytes())
    return h.hexdigest()[:16]


def reference(T: int, q: int, heads: int, case: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(out [q, H, latent] fp32, lse [q, H]): the fixture when there is one for these inputs, else computed."""
    from ddtree.plugins.reference import mla_tree_attention
    case = inputs(T, q, heads) if case is None else case
    latent, rope = case["c_kv"].shape[1], case["k_pe"].shape[1]
    path = FIXTURES / f"attention_{case_name(T, q, heads, latent, rope)}.npz"
    if path.exists():
        fx = np.load(path)
        if str(fx["digest"]) == digest(case):
            return fx["out"].astype(np.float32), fx["lse"]
    return mla_tree_attention(case["q_lat"], case["q_rope"], full_cache(T, q, heads, case), T, case["vis"], SCALE)


def build() -> None:
    from ddtree.plugins.reference import mla_tree_attention
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for T, q, heads in CASES:
        if T != FIXTURE_CONTEXT:
            continue
        case = inputs(T, q, heads)
        out, lse = mla_tree_attention(case["q_lat"], case["q_rope"], full_cache(T, q, heads, case), T, case["vis"], SCALE)
        np.savez_compressed(FIXTURES / f"attention_{case_name(T, q, heads)}.npz", out=out.astype(np.float16),
                            lse=lse.astype(np.float32), digest=np.array(digest(case)))
        print(f"{case_name(T, q, heads)}: out rms {np.sqrt(np.mean(out.astype(np.float64) ** 2)):.4f}")


if __name__ == "__main__":
    build()


def ptxas_report(arch: str, defines: dict, latent: int = 512, rope: int = 64) -> dict[str, tuple[int, int]]:
    """{kernel: (registers, spill store bytes)} of mla_attention.cu compiled at (latent, rope) with `defines`
    (ptxas's resource report through NVRTC)."""
    import re

    from cuda.core import Program, ProgramOptions

    from ddtree.plugins import compile as kc
    macros = {**kc.latent_defines(latent, rope), **defines}
    opts = ProgramOptions(name="mla_attention.cu", arch=arch, std=kc.CXX_STD, include_path=[str(kc.KERNEL_DIR)],
                          define_macro=[(k, str(v)) for k, v in sorted(macros.items())], ptxas_options="-v")
    log = []

    class _Log:
        def write(self, s):
            log.append(s)

    program = Program((kc.KERNEL_DIR / "mla_attention.cu").read_text(), "c++", options=opts)
    try:
        program.compile("cubin", logs=_Log())
    finally:
        program.close()
    text = "".join(log).replace("\0", "")
    found = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry function|\Z)", text, re.S):
        found[name] = (int(re.search(r"Used (\d+) registers", body).group(1)),
                       int(re.search(r"(\d+) bytes spill stores", body).group(1)))
    return found
