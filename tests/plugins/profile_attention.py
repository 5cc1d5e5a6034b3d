"""Diagnosis, not a test: timelines and cycles per phase of the attention kernels (built with
DD_PROFILE=$DD_PROFILE, default 1: block timelines; 2: also cycles per loop phase; 0: the plain kernels, e.g.
under ncu). Usage on the device: python tests/plugins/profile_attention.py T,q,heads[,splits] ..."""
import os
import sys

import numpy as np

import ddtree.plugins.device as device
from ddtree.plugins import randfill
from ddtree.plugins.compile import compile_cubin
from ddtree.plugins.mla_attention import MlaTreeAttention

LEVEL = int(os.environ.get("DD_PROFILE", "1"))
if LEVEL:
    device.compile_cubin = lambda source, arch, defines=None: compile_cubin(
        source, arch, defines={**(defines or {}), "DD_PROFILE": LEVEL})


def main(T=32768, q=1, heads=8, **forced):
    gpu = device.Gpu()
    cache = gpu.alloc((T + q, 576), np.uint16)
    randfill.fill_device(gpu, cache, 1, randfill.ACT_BF16)
    q_lat, q_rope = gpu.alloc((q, heads, 512), np.uint16), gpu.alloc((q, heads, 64), np.uint16)
    randfill.fill_device(gpu, q_lat, 2, randfill.WEIGHT_BF16)
    randfill.fill_device(gpu, q_rope, 3, randfill.WEIGHT_BF16)
    vis = gpu.upload(np.ones((q, (q + 31) // 32), np.uint32))
    lengths = gpu.upload(np.array([T], np.int32))
    out = gpu.alloc((q, heads, 512), np.uint16)
    attn = MlaTreeAttention(gpu, heads, 0.1447, latent=512, rope=64, max_q=q, max_context=T)
    plan = attn.override(q, T, **forced) if forced else attn.plan(q, T)
    for _ in range(3):
        attn.run(q_lat, q_rope, cache, vis, lengths, q, out, context_hint=T)
        gpu.sync()
    print(f"T={T} q={q} H={heads} {plan}", flush=True)


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["32768,1,8"]:
        T, q, h, *rest = spec.split(",")
        main(int(T), int(q), int(h), **({"splits": int(rest[0])} if rest else {}))
