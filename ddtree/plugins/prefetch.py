"""L2 prefetch (kernels/prefetch.cu): stage device buffers in L2 ahead of the kernels that read them.

    pf = L2Prefetch(gpu)
    pf.run([(address, nbytes), ...], stream)        # one launch per buffer; returns at once on the GPU

Why: the tree attention of a layer is latency-bound (8 heads x 17 rows: ~15-20 us while DRAM mostly idles), and
the kernels after it read weights from DRAM at a fraction of the copy ceiling (o_proj, the router, the shared
expert: skinny GEMMs whose fixed costs are not hidden). Fetching those weights into L2 while the attention runs
moves their DRAM time under the attention's. The cuda backend chooses what to stage within a byte budget
(backends/cuda_branch.py BranchOps.prefetch); the values read never change (a prefetch moves no data a kernel sees).
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.device import Gpu, ptr

SOURCE = "prefetch.cu"
THREADS = 128
CHUNK = 16384                       # bytes one thread asks L2 for (one bulk prefetch instruction) at one row;
CHUNK_ROWS = 4096                   # past one row ~4x the blocks issue a fill (H100, bench step: budget 8 tree
                                    # -1.5 %, while at one row, AR, it was +3.6 %: the faster fill took DRAM from the
                                    # next layer's first GEMM; kernels/NOTES.md, ninth session)
SLOTS = 4                           # buffers one launch takes (kernels/prefetch.cu)
# Where a layer stages weights (description/layers.py ops.prefetch's beside): "attention", o_proj and the MLP's
# front while the latency-bound attention runs; "next", the next layer's attention front beside the MLP's
# all-reduce or the routed experts. The two fills contend with different kernels (the attention's few bytes; the
# next layer's q_a | kv_a GEMM), so a chunk or a budget may be set per site.
SITES = ("attention", "next")
SITES_HELP = "attention: o_proj and the MLP's front beside the attention; next: the next layer's front"


def site_of(beside: str) -> str:
    """The chunk site of ops.prefetch(beside=...): the attention's own, or the next front's (either of its two)."""
    return "attention" if beside == "attention" else "next"


def chunk_for(rows: int, site: str, forced: int | dict | None = None) -> int:
    """The bytes one prefetch thread asks for at `site` in a layer call of `rows` rows. forced: every call's
    chunk (an int), or {site: bytes} for the sites it names (the others by rows)."""
    if site not in SITES:
        raise ValueError(f"L2 prefetch: site {site!r} is not one of {SITES}")
    forced = per_site(forced, site)
    return forced or (CHUNK if rows <= 1 else CHUNK_ROWS)


def chunks(forced: int | dict | None = None) -> dict:
    """What chunk_for gives each site at one row and at more (the benches' JSON)."""
    return {site: {"one_row": chunk_for(1, site, forced), "more_rows": chunk_for(2, site, forced)}
            for site in SITES}


def per_site(value, site: str):
    """A per-site setting (chunk bytes, budget bytes): one value for every site, or {site: value}."""
    return value.get(site) if isinstance(value, dict) else value


def parse_sites(text: str, parse_one) -> object:
    """bench's per-site options: "V" (every site) or "attention:V,next:V" (either or both sites) -> parse_one(V) or
    {site: parse_one(V)}; a ValueError says which part is wrong (the caller names the flag)."""
    if ":" not in text:
        return parse_one(text, "")
    out = {}
    for part in text.split(","):
        site, _, value = (p.strip() for p in part.partition(":"))
        if site not in SITES or site in out:
            raise ValueError(f"{part!r}: want SITE:VALUE with SITE one of {', '.join(SITES)}, each once")
        out[site] = parse_one(value, f"{site}: ")
    return out


def parse_chunk_kb(text: str) -> int | dict:
    """--prefetch-chunk-kb: KiB -> bytes, for every site or per site (parse_sites)."""
    def kib(value: str, what: str) -> int:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{what}{value!r} is not a positive whole number of KiB")
        return int(value) << 10
    return parse_sites(text.strip(), kib)


def parse_budget_mb(text: str) -> int | dict:
    """--prefetch-mb: MiB (0: none) -> bytes, for every site or per site (parse_sites)."""
    def mib(value: str, what: str) -> int:
        try:
            mb = float(value)
        except ValueError:
            mb = -1.0
        if not 0 <= mb < 1e6:
            raise ValueError(f"{what}{value!r} is not a number of MiB >= 0")
        return int(mb * 2**20)
    return parse_sites(text.strip(), mib)


def launches(sizes, chunk: int = CHUNK) -> tuple[int, int]:
    """(blocks, threads a block) of one launch over buffers of these sizes (<= SLOTS): a thread per chunk."""
    threads = sum(-(-n // chunk) for n in sizes)
    return max(1, -(-threads // THREADS)), THREADS


class L2Prefetch:
    def __init__(self, gpu: Gpu, chunk: int = CHUNK):
        if int(gpu.arch[3:].rstrip("a")) < 90:
            raise RuntimeError(f"L2 prefetch: cp.async.bulk.prefetch.L2 needs sm_90 or newer; {gpu.name} is {gpu.arch}")
        if chunk % 16 or chunk <= 0:
            raise ValueError(f"L2 prefetch: chunk = {chunk} must be a positive multiple of 16 bytes")
        self.gpu, self.chunk = gpu, chunk
        self.kernel = gpu.kernel(SOURCE, "l2_prefetch")

    def run(self, buffers, stream=None) -> None:
        """buffers: (address, nbytes) pairs (DeviceArray addresses or ints), each 16-byte aligned with nbytes a
        multiple of 16 (the bulk prefetch's rule); one launch per SLOTS of them."""
        buffers = list(buffers)
        for address, nbytes in buffers:
            if int(ptr(address)) % 16 or nbytes % 16 or nbytes <= 0:
                raise ValueError(f"L2 prefetch: buffer {int(ptr(address)):#x} of {nbytes} B must be 16-byte aligned "
                                 "and a positive multiple of 16 bytes")
        launch_slots(self.gpu, self.kernel, buffers, self.chunk, np.uint32(self.chunk), stream)


def launch_slots(gpu: Gpu, kernel, buffers: list, chunk: int, last, stream) -> None:
    """prefetch.cu's launches over buffers: SLOTS (address, nbytes) pairs a launch (unused ones (0, 0)), a thread
    per chunk of each, then `last` (the kernel's chunk or stride argument)."""
    for i in range(0, len(buffers), SLOTS):
        group = buffers[i: i + SLOTS]
        blocks, threads = launches([n for _, n in group], chunk)
        args = []
        for address, nbytes in group + [(0, 0)] * (SLOTS - len(group)):
            args += [ptr(address), np.uint64(nbytes)]
        gpu.launch(kernel, blocks, threads, 0, *args, last, stream=stream)


PAGE = 2 << 20                      # the stride of touch_pages: the GPU's large-page size (2 MiB on sm_90 / sm_120)


class PageTouch:
    """touch_pages (kernels/prefetch.cu): one load a page of each buffer, so that the address translations of a
    reader that picks its pages late (the routed experts, chosen by the router on the chain) are ready before it.
    No bytes are staged beyond one sector a page; no value changes. A diagnosis tool, not in the step: one H100
    measured the routed experts at one row 1.1 us slower picking from 60 layers than from one, and no faster after
    a touch (tests/plugins/profile_moe_pages.py; the step with the touch beside each attention, commit 8c8dba8's
    `bench step --page-touch`: AR +1.1 %, budget 8 tree -0.8 %, within the spread; ddtree/plugins/kernels/NOTES.md,
    fourteenth session)."""

    def __init__(self, gpu: Gpu, stride: int = PAGE):
        if stride % 16 or stride <= 0:
            raise ValueError(f"page touch: stride = {stride} must be a positive multiple of 16 bytes")
        self.gpu, self.stride = gpu, stride
        self.kernel = gpu.kernel(SOURCE, "touch_pages")

    def run(self, buffers, stream=None) -> None:
        """buffers: (address, nbytes) pairs, each 4-byte aligned with nbytes a positive multiple of 4 (a page's
        4-byte load never reaches past its buffer); one launch per SLOTS of them."""
        buffers = [(int(ptr(a)), int(n)) for a, n in buffers]
        for address, nbytes in buffers:
            if address % 4 or nbytes % 4 or nbytes <= 0:
                raise ValueError(f"page touch: buffer {address:#x} of {nbytes} B must be 4-byte aligned and a positive "
                                 "multiple of 4 bytes")
        launch_slots(self.gpu, self.kernel, buffers, self.stride, np.uint64(self.stride), stream)
