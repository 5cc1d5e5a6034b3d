"""CPU tests of the live mask inside the routing kernels (issue 53: kernels/route_common.cuh live_rows, applied by
router.cu's fused router and moe.cu's moe_route before their alignment):
  - both kernels compile for sm_90 and sm_120 (NVRTC, no GPU);
  - the launchers pass exactly the kernels' parameters (counted in the source), the mask's four pointers last:
    null without a mask (the launch as before, plus four zeros), the router's own buffers rewritten in place when
    it routes, the router's own buffers written (the given ones only read) for a given routing;
  - live_args refuses a mask without routed ids, a given routing without buffers of its own, half-aliased outputs.
The kernels against route_live_twin on a GPU: tests/plugins/test_route_live_gpu.py."""
import re
from pathlib import Path

import numpy as np
import pytest

from ddtree.plugins import compile as kc
from ddtree.plugins.device import DeviceArray
from ddtree.plugins.moe import FusedMoE, MoEShape
from ddtree.plugins.prune_ops import live_args

KERNEL_DIR = Path(kc.KERNEL_DIR)


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_routing_kernels_with_the_live_mask_compile(arch, kernel_cache):
    for source, names in (("router.cu", [f"router_fused_mt{mt}" for mt in range(1, 9)]), ("moe.cu", ["moe_route"])):
        blob = kc.compile_cubin(source, arch, cache=kernel_cache).read_bytes()
        assert blob[:4] == b"\x7fELF" and all(n.encode() in blob for n in names), f"{source} {arch}"


def kernel_params(source: str, signature: str) -> list[str]:
    """The parameter names of the kernel whose declaration starts with `signature(` in `source` (macro
    continuations removed)."""
    text = (KERNEL_DIR / source).read_text().replace("\\\n", "\n")
    params = re.search(re.escape(signature) + r"\((.*?)\)\s*\{", text, re.S).group(1)
    return [p.split()[-1].lstrip("*") for p in params.split(",")]


class RecordingGpu:
    """The Gpu calls FusedMoE makes, on fake addresses: launches are recorded, never run."""
    arch, sm_count, smem_optin, l2_bytes = "sm_90", 132, 232448, 50 * 2 ** 20

    def __init__(self):
        self.next, self.launches = 1 << 20, []

    def alloc(self, shape, dtype):
        shape = tuple(np.atleast_1d(shape).tolist())
        a = DeviceArray(self, self.next, shape, np.dtype(dtype))
        self.next += (a.nbytes + 255) // 256 * 256 + 256
        return a

    zeros = alloc

    def defines(self, source):
        return kc.defines_for(source, self.arch)

    def allow_smem(self, *args, **kw):
        pass

    def kernel(self, source, name):
        return name

    def launch(self, kernel, grid, block, smem, *args, stream=None, pdl=False, cluster=None):
        self.launches.append((kernel, [int(a) for a in args]))


def tiny_moe(gpu, fused_router: bool) -> FusedMoE:
    E, H = 8, 128
    weights = {"gate_up": gpu.alloc((E, 4, H // 64, 2, 32, 4), np.int32),
               "gate_up_scale": gpu.alloc((E, 4, H // 64, 2, 8, 4), np.uint16),
               "down": gpu.alloc((E, H // 32, 1, 2, 32, 4), np.int32),
               "down_scale": gpu.alloc((E, H // 32, 1, 2, 8, 4), np.uint16)}
    moe = FusedMoE(gpu, MoEShape(H, 64, E, 2, max_tokens=32), weights, router=gpu.alloc((1, 2, 32, 4), np.int32),
                   bias=gpu.alloc(E, np.float32))
    moe.fused_router = fused_router
    return moe


@pytest.mark.parametrize("fused_router", [True, False], ids=["fused", "gemm+moe_route"])
def test_launchers_pass_the_mask_last(fused_router):
    gpu = RecordingGpu()
    moe = tiny_moe(gpu, fused_router)
    kernel, signature = ("router_fused_mt", "router_fused_mt##MT") if fused_router else ("moe_route", "moe_route")
    params = kernel_params("router.cu" if fused_router else "moe.cu", signature)
    assert params[-4:] == ["live", "routed_ids", "live_ids", "live_w"]
    at = {name: params.index(name) for name in ("topk_ids", "topk_w")}
    M, k = 9, 2
    live, routed = gpu.alloc(M, np.int32), gpu.alloc((M, k), np.int32)
    given = gpu.alloc((M, k), np.int32), gpu.alloc((M, k), np.float32)
    own = moe.topk_ids.ptr, moe.topk_w.ptr

    def last_route(call):
        gpu.launches.clear()
        got = call()
        args = [a for name, a in gpu.launches if name.startswith(kernel)][-1]
        assert len(args) == len(params), f"{kernel}: {len(args)} arguments for {len(params)} parameters"
        return got, (args[at["topk_ids"]], args[at["topk_w"]]), args[-4:]

    got, routing, masks = last_route(lambda: moe.route(0, M))
    assert routing == own and masks == [0, 0, 0, 0] and (got[0].ptr, got[1].ptr) == own
    got, routing, masks = last_route(lambda: moe.route(0, M, live=live, routed_ids=routed))
    assert routing == own and masks == [live.ptr, routed.ptr, *own] and (got[0].ptr, got[1].ptr) == own
    got, routing, masks = last_route(lambda: moe.route_given(0, M, *given))
    assert routing == (given[0].ptr, given[1].ptr) and masks == [0, 0, 0, 0] and got == given
    got, routing, masks = last_route(lambda: moe.route_given(0, M, *given, live=live, routed_ids=routed))
    assert routing == (given[0].ptr, given[1].ptr)                  # read only: the kernel writes the router's own
    assert masks == [live.ptr, routed.ptr, *own] and (got[0].ptr, got[1].ptr) == own


def test_live_args_refuse_what_the_kernels_cannot_take():
    ids, w, live, routed, other_ids, other_w = 1 << 12, 2 << 12, 3 << 12, 4 << 12, 5 << 12, 6 << 12
    assert [int(a) for a in live_args("t", ids, w, False)] == [0, 0, 0, 0]
    assert [int(a) for a in live_args("t", ids, w, False, live, routed)] == [live, routed, ids, w]
    assert [int(a) for a in live_args("t", ids, w, True, live, routed, other_ids, other_w)] == \
        [live, routed, other_ids, other_w]
    with pytest.raises(ValueError, match="t: a live mask needs routed_ids"):
        live_args("t", ids, w, False, live)
    with pytest.raises(ValueError, match="t: a given routing with a live mask needs live_ids / live_w"):
        live_args("t", ids, w, True, live, routed)
    with pytest.raises(ValueError, match="both be the routing's own buffers or both other ones"):
        live_args("t", ids, w, False, live, routed, ids, other_w)
    with pytest.raises(ValueError, match="live_ids and live_w go together"):
        live_args("t", ids, w, False, live, routed, other_ids)
    with pytest.raises(ValueError, match="given without a live mask"):
        live_args("t", ids, w, False, None, routed)
