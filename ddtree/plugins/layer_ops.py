"""Launchers for the small per-layer kernels (kernels/layer_ops.cu): the op set's embed, rms_norm, the add +
RMSNorm after an all-reduce, the two ropes, the drafter's per-head norms, SiLU * up, row gathers, casts.

    ops = LayerOps(gpu)
    table = RopeTable.interleaved(gpu, cfg.rope, cfg.qk_rope_head_dim, max_pos)    # once per model
    ops.rms_norm(x, w, out, m, D, eps)
    ops.rope_interleaved(q_pe, pos, table, q, heads, token_stride, head_stride)   # in place

Every method takes device pointers (DeviceArray or int address), host dims and stream=None, and only launches:
no allocation, no sync, no host read of device data, so the calls can be captured into a CUDA graph.
Per-step values (ids, positions, gathered rows) are device int32 buffers, so one graph serves every step.
bf16 storage (uint16 bits), fp32 math, one rounding to bf16 per output. Numpy twins: plugins/reference.py.
Letters as in description/opset.py; strides are in elements.
"""
from __future__ import annotations

import numpy as np

from ddtree.model.rope import rope_frequencies, rope_magnitude
from ddtree.plugins.device import DeviceArray, Gpu, ptr
from ddtree.plugins.gemm import supports_pdl

SOURCE = "layer_ops.cu"
ROW_THREADS = 256                  # row kernels: threads per block at most (over 16-byte vectors)
HEAD_WARPS = 4                     # head_rms_norm: rows (warps) per block
ELEMENT_THREADS = 256              # element-wise kernels: threads per block


def rope_table(freqs: np.ndarray, magnitude: float, max_pos: int) -> np.ndarray:
    """[max_pos, d/2, 2] float32 (m cos(p phi_i), m sin(p phi_i)) for p < max_pos, computed in float64.

    Why a table: the kernel cannot form the angle p * phi_i in fp32. At p ~ 2.6e5 the angle is ~1e5 rad,
    where an fp32 ulp is 2^-7 rad: phi_i's own rounding (2^-24 relative) and the product's rounding move
    the angle by up to ~1e-2 rad, so cos/sin would be off by ~1e-2. Here the angle is exact in float64
    (p < 2^53) and only the final cos/sin are rounded to fp32 (error <= 2^-24 m)."""
    if max_pos < 1:
        raise ValueError(f"rope table: max_pos must be >= 1, got {max_pos}")
    freqs = np.asarray(freqs, np.float64)
    table = np.empty((max_pos, len(freqs), 2), np.float32)
    for p0 in range(0, max_pos, 16384):                         # chunks: float64 temporaries stay small
        angle = np.arange(p0, min(max_pos, p0 + 16384), dtype=np.float64)[:, None] * freqs[None, :]   # [P, d/2]
        table[p0: p0 + len(angle), :, 0] = np.cos(angle) * magnitude
        table[p0: p0 + len(angle), :, 1] = np.sin(angle) * magnitude
    return table


class RopeTable:
    """The device table of one rope (built and uploaded once per model): table [max_pos, d/2, 2] float32.
    Positions >= max_pos turn the token's pairs into NaN on the GPU (so a too-short table shows)."""

    def __init__(self, gpu: Gpu, freqs: np.ndarray, magnitude: float, max_pos: int):
        self.dim, self.max_pos, self.magnitude = 2 * len(freqs), max_pos, float(magnitude)
        self.freqs = np.asarray(freqs, np.float64)
        self.table: DeviceArray = gpu.upload(rope_table(self.freqs, self.magnitude, max_pos))

    @classmethod
    def interleaved(cls, gpu: Gpu, rope, dim: int, max_pos: int) -> "RopeTable":
        """The target's MLA rope: YaRN frequencies of `rope` (model/rope.py), magnitude rope_magnitude."""
        return cls(gpu, rope_frequencies(rope, dim), rope_magnitude(rope), max_pos)

    @classmethod
    def rotate_half(cls, gpu: Gpu, rope, dim: int, attention_factor: float, max_pos: int) -> "RopeTable":
        """The drafter's rope: frequencies of its `rope`, cos/sin scaled by its attention_factor."""
        return cls(gpu, rope_frequencies(rope, dim), attention_factor, max_pos)

    @classmethod
    def of(cls, gpu: Gpu, kind: str, rope, dim: int, factor: float | None, max_pos: int) -> "RopeTable":
        """kind "interleaved" (the target's MLA rope) or "rotate_half" (the drafter's, scaled by `factor`)."""
        if kind == "interleaved":
            return cls.interleaved(gpu, rope, dim, max_pos)
        if kind == "rotate_half":
            return cls.rotate_half(gpu, rope, dim, factor, max_pos)
        raise ValueError(f"RopeTable: kind {kind!r}; 'interleaved' or 'rotate_half'")


def _aligned(what: str, address, align: int) -> None:
    if address is not None and int(ptr(address)) % align:
        raise ValueError(f"{what}: address {int(ptr(address)):#x} is not {align}-byte aligned")


def _multiple(what: str, **dims) -> None:
    for name, (value, of) in dims.items():
        if value % of:
            raise ValueError(f"{what}: {name} = {value} must be a multiple of {of} (16-byte vectors of bf16)"
                             if of == 8 else f"{what}: {name} = {value} must be a multiple of {of}")


def _row_threads(vectors: int) -> int:
    """Threads per block for one row of `vectors` 16-byte vectors: a warp multiple, at most ROW_THREADS."""
    return min(ROW_THREADS, 32 * -(-vectors // 32))


class LayerOps:
    """The per-layer kernels on one GPU. pdl: programmatic dependent launch (default: on where supported)."""

    def __init__(self, gpu: Gpu, pdl: bool | None = None):
        self.gpu = gpu
        self.pdl = supports_pdl(gpu) if pdl is None else bool(pdl) and supports_pdl(gpu)

    def _launch(self, name: str, grid, block: int, *args, stream=None) -> None:
        self.gpu.launch(self.gpu.kernel(SOURCE, name), grid, block, 0, *args, stream=stream, pdl=self.pdl)

    def _elements(self, total: int) -> int:
        """Blocks of ELEMENT_THREADS for `total` work items (grid-stride beyond 32 blocks per SM)."""
        return max(1, min(-(-total // ELEMENT_THREADS), 32 * self.gpu.sm_count))

    # ---- embedding and norms --------------------------------------------------------------------
    def embed(self, ids, table, out, q: int, H: int, vocab_start: int, vocab_rows: int, stream=None) -> None:
        """out [q, H] = table [vocab_rows, H] rows of ids [q] (int32, global) in [vocab_start, +vocab_rows),
        zeros for the other ranks' ids."""
        _multiple("embed", H=(H, 8))
        for what, a in (("embed table", table), ("embed out", out)):
            _aligned(what, a, 16)
        if q < 1 or vocab_rows < 1 or vocab_start < 0:
            raise ValueError(f"embed: q = {q}, vocab_rows = {vocab_rows} must be >= 1, vocab_start = {vocab_start} >= 0")
        self._launch("embed_rows", q, _row_threads(H // 8), ptr(ids), ptr(table), np.int32(vocab_start),
                     np.int32(vocab_rows), ptr(out), np.int32(H), stream=stream)

    def rms_norm(self, x, w, out, m: int, D: int, eps: float, x_stride: int | None = None,
                 out_stride: int | None = None, stream=None, x_group: int = 1,
                 x_group_stride: int | None = None) -> None:
        """out [m, D] = w [D] * x / sqrt(mean(x^2) + eps) per row; x rows x_stride apart (default D: a column
        slice of a wider output, e.g. c_kv = latent[:, :R], has stride R + Dr), out rows out_stride apart.
        x_group g > 1: x is [m / g, g, D] with those g rows x_stride apart and groups x_group_stride apart (the
        heads of a column slice). out may be x (in place)."""
        x_stride, out_stride = x_stride or D, out_stride or D
        x_group_stride = x_stride * x_group if x_group_stride is None else x_group_stride
        _multiple("rms_norm", D=(D, 8), x_stride=(x_stride, 8), out_stride=(out_stride, 8),
                  x_group_stride=(x_group_stride, 8))
        for what, a in (("rms_norm x", x), ("rms_norm w", w), ("rms_norm out", out)):
            _aligned(what, a, 16)
        if m < 1 or x_stride < D or out_stride < D or x_group < 1 or m % x_group or (
                x_group > 1 and x_group_stride < x_group * x_stride):
            raise ValueError(f"rms_norm: m = {m} must be >= 1 and a multiple of x_group = {x_group}, strides "
                             f"({x_stride}, {out_stride}) >= D = {D}, x_group_stride {x_group_stride} >= x_group "
                             "x_stride")
        self._launch("rms_norm_rows", m, _row_threads(D // 8), ptr(x), np.int32(x_stride), np.int32(x_group),
                     np.int32(x_group_stride), ptr(w), ptr(out), np.int32(out_stride), np.int32(D), np.float32(eps),
                     stream=stream)

    def add_rms_norm(self, h, delta, w, out, m: int, D: int, eps: float, stream=None, h_in=None) -> None:
        """h [m, D] = h_in + delta [m, D] (rounded to bf16; h_in None: h itself, in place), then out [m, D] =
        RMSNorm(h) with w [D]: the residual add and the next norm after an all-reduce."""
        _multiple("add_rms_norm", D=(D, 8))
        h_in = h if h_in is None else h_in
        for what, a in (("add_rms_norm h", h), ("add_rms_norm h_in", h_in), ("add_rms_norm delta", delta),
                        ("add_rms_norm w", w), ("add_rms_norm out", out)):
            _aligned(what, a, 16)
        if m < 1:
            raise ValueError(f"add_rms_norm: m = {m} must be >= 1")
        self._launch("add_rms_norm_rows", m, _row_threads(D // 8), ptr(h_in), ptr(h), ptr(delta), ptr(w), ptr(out),
                     np.int32(D), np.float32(eps), stream=stream)

    def add(self, a, b, out, n: int, stream=None) -> None:
        """out [n] = bf16(a + b) element-wise, bf16 [n] each, n % 8 == 0 (the residual of add_rms_norm alone)."""
        _multiple("add", n=(n, 8))
        for what, x in (("add a", a), ("add b", b), ("add out", out)):
            _aligned(what, x, 16)
        if n < 8:
            raise ValueError(f"add: n = {n} must be >= 8")
        self._launch("add_rows", self._elements(n // 8), ELEMENT_THREADS, ptr(a), ptr(b), ptr(out),
                     np.int64(n // 8), stream=stream)

    def head_rms_norm(self, x, w, m: int, n: int, d: int, eps: float, token_stride: int | None = None,
                      head_stride: int | None = None, stream=None) -> None:
        """x [m, n, d] in place: every (token, head) row of d normed with w [d] (the drafter's q/k norms).
        Element (t, h, c) at t token_stride + h head_stride + c (defaults: dense)."""
        head_stride = head_stride or d
        token_stride = token_stride or n * head_stride
        _multiple("head_rms_norm", d=(d, 2), token_stride=(token_stride, 2), head_stride=(head_stride, 2))
        _aligned("head_rms_norm x", x, 4)
        _aligned("head_rms_norm w", w, 4)
        if m < 1 or n < 1 or d < 2:
            raise ValueError(f"head_rms_norm: m = {m}, n = {n} must be >= 1 and d = {d} >= 2")
        self._launch("head_rms_norm", -(-(m * n) // HEAD_WARPS), HEAD_WARPS * 32, ptr(x), np.int32(token_stride),
                     np.int32(head_stride), ptr(w), np.int32(m * n), np.int32(n), np.int32(d), np.float32(eps),
                     stream=stream)

    # ---- rope -----------------------------------------------------------------------------------
    def _rope(self, name: str, x, pos, table: RopeTable, q: int, n: int, token_stride, head_stride, stream,
              src=None, src_token_stride=None, src_head_stride=None):
        d = table.dim
        head_stride = head_stride or d
        token_stride = token_stride or n * head_stride
        if src is None:
            src, src_token_stride, src_head_stride = x, token_stride, head_stride
        src_head_stride = src_head_stride or d
        src_token_stride = src_token_stride or n * src_head_stride
        if q < 1 or n < 1:
            raise ValueError(f"{name}: q = {q} and n = {n} must be >= 1")
        if name == "rope_interleaved":          # pairs are read as one 4-byte word
            _multiple(name, token_stride=(token_stride, 2), head_stride=(head_stride, 2),
                      src_token_stride=(src_token_stride, 2), src_head_stride=(src_head_stride, 2))
            _aligned(f"{name} x", x, 4)
            _aligned(f"{name} src", src, 4)
        self._launch(name, self._elements(q * n * d // 2), ELEMENT_THREADS, ptr(src), np.int32(src_token_stride),
                     np.int32(src_head_stride), ptr(x), np.int32(token_stride), np.int32(head_stride), ptr(pos),
                     ptr(table.table), np.int32(table.max_pos), np.int32(q), np.int32(n), np.int32(d // 2),
                     stream=stream)

    def rope_interleaved(self, x, pos, table: RopeTable, q: int, n: int, token_stride: int | None = None,
                         head_stride: int | None = None, stream=None, src=None, src_token_stride: int | None = None,
                         src_head_stride: int | None = None) -> None:
        """x [q, n, d] (d = table.dim) = src with pairs (2i, 2i+1) turned by pos[t] phi_i (the target's MLA
        rope, GPT-J pairs, YaRN frequencies); pos [q] int32 on the device. Element (t, h, c) at
        t token_stride + h head_stride + c (defaults: dense), so q_pe can stay inside q_b's output; src None:
        x in place, else src's elements at its own strides (a strided view roped into a dense x in one pass)."""
        self._rope("rope_interleaved", x, pos, table, q, n, token_stride, head_stride, stream, src,
                   src_token_stride, src_head_stride)

    def rope_rotate_half(self, x, pos, table: RopeTable, q: int, n: int, token_stride: int | None = None,
                         head_stride: int | None = None, stream=None, src=None, src_token_stride: int | None = None,
                         src_head_stride: int | None = None) -> None:
        """As rope_interleaved with the drafter's NeoX pairs (i, i + d/2) (table from RopeTable.rotate_half)."""
        self._rope("rope_rotate_half", x, pos, table, q, n, token_stride, head_stride, stream, src,
                   src_token_stride, src_head_stride)

    # ---- element-wise and copies ----------------------------------------------------------------
    def silu_mul(self, gu, out, m: int, I: int, stream=None) -> None:
        """out [m, I] = silu(gate) * up with gu [m, 2I] = SkinnyGemm(x, [gate; up]): gate columns 0 .. I-1,
        up columns I .. 2I-1 of each row. The model's MLPs apply it in the GEMM's epilogue instead
        (SkinnyGemm.run swiglu=True, the same bits); this unfused form is that epilogue's reference on the GPU
        (tests/plugins/test_gemm_swiglu_gpu.py)."""
        _multiple("silu_mul", I=(I, 2))
        _aligned("silu_mul gu", gu, 4)
        _aligned("silu_mul out", out, 4)
        if m < 1:
            raise ValueError(f"silu_mul: m = {m} must be >= 1")
        self._launch("silu_mul", self._elements(m * I // 2), ELEMENT_THREADS, ptr(gu), ptr(out), np.int32(m),
                     np.int32(I), stream=stream)

    def gather_rows(self, src, rows, out, k: int, W: int, src_rows: int, src_stride: int | None = None,
                    out_stride: int | None = None, itemsize: int = 2, stream=None) -> None:
        """out [k, W] = src [src_rows, W] rows at rows [k] (int32, device): a negative row gives zeros, a row
        >= src_rows all-ones bytes (NaN). Rows of W elements of `itemsize` bytes, a multiple of 16 bytes."""
        src_stride, out_stride = src_stride or W, out_stride or W
        if itemsize not in (1, 2, 4, 8, 16):
            raise ValueError(f"gather_rows: itemsize must be 1, 2, 4, 8 or 16 bytes, got {itemsize}")
        for name, value in (("W", W), ("src_stride", src_stride), ("out_stride", out_stride)):
            if value * itemsize % 16:
                raise ValueError(f"gather_rows: {name} = {value} elements of {itemsize} B must be a multiple of 16 B")
        _aligned("gather_rows src", src, 16)
        _aligned("gather_rows out", out, 16)
        if k < 1 or src_rows < 1 or src_stride < W or out_stride < W:
            raise ValueError(f"gather_rows: k = {k}, src_rows = {src_rows} must be >= 1 and strides >= W = {W}")
        vec = 16 // itemsize
        self._launch("gather_rows", k, _row_threads(W // vec), ptr(src), np.int32(src_stride // vec),
                     np.int32(src_rows), ptr(rows), ptr(out), np.int32(out_stride // vec), np.int32(W // vec),
                     stream=stream)

    def positions_from(self, base, out, n: int, stream=None) -> None:
        """out [n] int32 = base[0] + i (base: a device int32 length)."""
        if n < 1:
            raise ValueError(f"positions_from: n = {n} must be >= 1")
        self._launch("positions_from", self._elements(n), ELEMENT_THREADS, ptr(base), ptr(out), np.int32(n),
                     stream=stream)

    def rows_at(self, dst, dst_rows: int, row0, src, n: int, W: int, itemsize: int = 2, stream=None,
                src_stride: int | None = None) -> None:
        """dst [dst_rows, W] rows row0[0] .. row0[0] + n - 1 = src [n, W] (row0: a device int32 length; rows past
        dst_rows are skipped, so the caller checks capacity). Rows of a multiple of 16 bytes; src rows src_stride
        elements apart (default W: dense)."""
        src_stride = W if src_stride is None else src_stride
        if W * itemsize % 16 or src_stride * itemsize % 16 or src_stride < W or n < 1:
            raise ValueError(f"rows_at: W = {W} and src_stride = {src_stride} >= W elements of {itemsize} B must be "
                             f"multiples of 16 B and n = {n} >= 1")
        _aligned("rows_at src", src, 16)
        _aligned("rows_at dst", dst, 16)
        vecs = W * itemsize // 16
        self._launch("rows_at", n, _row_threads(vecs), ptr(dst), np.int32(vecs), np.int32(dst_rows), ptr(row0),
                     ptr(src), np.int32(src_stride * itemsize // 16), np.int32(vecs), stream=stream)

    def cast_f32_bf16(self, x, out, n: int, stream=None) -> None:
        """out [n] bf16 = x [n] float32 rounded to nearest even."""
        if n < 1:
            raise ValueError(f"cast_f32_bf16: n = {n} must be >= 1")
        self._launch("cast_f32_bf16", self._elements(n), ELEMENT_THREADS, ptr(x), ptr(out), np.int64(n),
                     stream=stream)
