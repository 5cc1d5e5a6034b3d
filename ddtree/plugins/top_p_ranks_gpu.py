"""Launcher of top-p sampling over a vocab split across tp ranks (kernels/sample_top_p_ranks.cu; the protocol
and its numpy twin: plugins/top_p_ranks.py). Each rank holds its logits slice [n, V_r] and meets the other
ranks in three all-gathers through its rank collective; every rank ends with the same tokens (global ids) and
flags, those one rank holding the whole row would sample (TreeSampler's top-p, kernels/sample_top_p.cu).

    sampler = TopPRanks(gpu, collective, ranks=tp, vocab=V, slice_vocab=V_r)     # workspaces for max_rows rows
    out = sampler.run(logits_r, offset_r, query_pos, params, n)     # 5 launches + 3 all-gathers, no host sync
    out.tokens [n] int32 (global ids, for the position query_pos + 1), out.flags [n] int32 (INEXACT | BIN_OVERFLOW)

    sampler.set_params(params)                                      # outside a graph, as TreeSampler's
    graph = gpu.capture(lambda s: sampler.launch(logits_r, offset_r, query_pos, n, stream=s))   # capturable
                                                                    # collective (ProcessRankMember) only

`collective`: all_gather(gpu, x, out, stream) of dense tensors, out [tp, *x.shape] in rank order (ops/
cuda_collectives.py: ThreadRankMember for ranks as threads of one process, eager; ProcessRankMember for rank
processes, launches only, so run() can be captured). Every exchange is an all-gather of bytes; sums happen in
the kernels afterwards, in rank order, on integers (exact). The parameters live in a device record written by
set_params (tree_sample.py's SampleParamsDev), never in kernel arguments.

The steps (per row; n rows at once):
    topp_ranks_max     -> row_max [n] f32                 all-gather   4 B a row
    topp_ranks_mass    -> bins [n, 4096] u64 (fixed point) all-gather  32 KB a row
    topp_ranks_decide     the crossing bin b* and the bounds, the same on every rank
    topp_ranks_scan    -> record [n]: the Gumbel winners above b* and in b*, counts, b*'s keys
                                                           all-gather  RECORD_BYTES = 32 816 B a row
    topp_ranks_cut        the cut, its certificate and the token, the same on every rank
Bytes a rank sends per step: n (4 + 32 768 + 32 816) B, about 65.6 KB a row, 4.3 MB at n = 65 (exchange_bytes);
each part must fit the collective (the one-shot's max_bytes per rank). With the push one-shot each rank writes
its part into every peer: (tp - 1) x that on the link.

What a smaller exchange would save (kernels not built; the protocol's numpy twin is plugins/top_p_ranks.py
ranks_kept_coarse / ranks_sample_top_p_coarse, its bytes coarse_exchange_bytes): the bins and the keys are
fixed-size so the exchange can be captured, but nearly all of both is zeros. Coarse then fine: 64 float64 coarse
masses a row (512 B), then the crossing coarse bin's 64 integer fine sums (512 B), then this record with a fixed
prefix of K = 256 keys a rank (2 096 B; a rank holding more of the crossing bin keeps it whole, BIN_OVERFLOW).
Four all-gathers instead of three (the keys need their own round: the crossing fine bin is known only once the
fine sums are in), 3 124 B a row instead of 65 588, 0.2 MB at n = 65 instead of 4.3 MB. The bounds add the float64
rounding of the coarse sums (derived in the twin's docstring): deterministic on every rank, not the single rank's
bits, so a row within about 5e-14 of its certificate's threshold may be flagged where one rank's is not. CPU, 1000
random rows at V 163840 (tests/plugins/test_top_p_ranks_coarse.py): LM-like rows none flagged over 2, 4 or 8
ranks; standard-normal rows 229 BIN_OVERFLOW over 2 ranks (over 256 crossing-bin keys a rank), none over 4 or 8.
On PCIe Gen5 (about 50 GB/s one way, docs/hardware-and-kernels.md 4.4) the one-shot push of 4.3 MB to each of 7
peers is about 0.6 ms a step (projected: the one-shot is measured only to 0.93 MB, on NVLink); the smaller
exchange about 30 us (1.4 MB to the 7 peers) plus a fourth round's latency.
H200 (tests/plugins/time_top_p_ranks.py, V 163840 over 8 ranks, n 65): the five kernels of one rank take
60 us (LM-like rows) / 70 us (flat), 100 / 118 us with the all-gathers as local copies.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr, set_words
from ddtree.plugins.gemm import supports_pdl
from ddtree.plugins.top_p_bins import bin_scales
from ddtree.plugins.tree_sample import (
    MASS_BINS,
    MAX_BIN_KEYS,
    MAX_TOP_P_VOCAB,
    ROW_STATE_DTYPE,
    STATUS_BIN_OVERFLOW,
    STATUS_INEXACT,
    STATUS_NAN_TARGET,
    STATUS_WRONG_MODE,
    TOP_P,
    params_record,
    plan_sampling,
)
from ddtree.tree.sampling import SamplingParams

SOURCE = "sample_top_p_ranks.cu"
KERNELS = ("topp_ranks_max", "topp_ranks_mass", "topp_ranks_decide", "topp_ranks_scan", "topp_ranks_cut")  # in order
THREADS = 512                  # SP_THREADS
MAX_THREADS = 256              # SP_MAX_THREADS (topp_ranks_max)
SLICE = 16384                  # SP_SLICE
MAX_ROWS = 256
MAX_RANKS = 64                 # SPR_MAX_RANKS
WINNER_BYTES = 16              # struct Winner { double value; int id; } (padded)
RECORD_BYTES = 48 + 8 * MAX_BIN_KEYS   # struct RankRow: two Winners, count, kept_above, pad, the keys
RECORD_DTYPE = np.dtype([("above_value", "<f8"), ("above_id", "<i4"), ("_p0", "<i4"), ("bin_value", "<f8"),
                         ("bin_id", "<i4"), ("_p1", "<i4"), ("count", "<u4"), ("kept_above", "<u4"),
                         ("_p2", "<u4", 2), ("keys", "<u8", MAX_BIN_KEYS)])
assert RECORD_DTYPE.itemsize == RECORD_BYTES


def exchange_bytes(n: int) -> dict[str, int]:
    """Bytes one rank contributes to each all-gather of a step of n rows (its part; the gathered outputs are
    tp times that)."""
    return {"row_max": 4 * n, "bins": 8 * MASS_BINS * n, "records": RECORD_BYTES * n}


@dataclass(frozen=True)
class Dense:
    """A dense device tensor as the rank collectives take it (backends/cuda_tensor.py Tensor's fields they read)."""
    ptr: int
    shape: tuple
    dtype: np.dtype
    contiguous = True

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def strides(self) -> tuple:                 # in elements
        return tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))


@dataclass
class RanksOutputs:
    tokens: DeviceArray        # [n] int32 global token ids, the same on every rank
    flags: DeviceArray         # [n] int32 STATUS_INEXACT | STATUS_BIN_OVERFLOW per row (0: the definition's)


class TopPRanks:
    def __init__(self, gpu: Gpu, collective, ranks: int, vocab: int, slice_vocab: int, max_rows: int = MAX_ROWS,
                 pdl: bool | None = None):
        """ranks: tp; vocab: the whole row's V (the bound's V); slice_vocab: this rank's V_r (the logits' width)."""
        if not 2 <= ranks <= MAX_RANKS:
            raise ValueError(f"TopPRanks: ranks must be in 2..{MAX_RANKS} (tp 1 is TreeSampler's), got {ranks}")
        if not 1 <= vocab <= MAX_TOP_P_VOCAB:
            raise ValueError(f"TopPRanks: vocab must be in 1..{MAX_TOP_P_VOCAB}, got {vocab}")
        if not 1 <= slice_vocab <= vocab:
            raise ValueError(f"TopPRanks: slice_vocab must be in 1..vocab ({vocab}), got {slice_vocab}")
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"TopPRanks: max_rows must be in 1..{MAX_ROWS}, got {max_rows}")
        if not callable(getattr(collective, "all_gather", None)):
            raise ValueError("TopPRanks: collective needs all_gather(gpu, x, out, stream) (parallel/cuda_collectives.py "
                             f"ThreadRankMember or ProcessRankMember), got {type(collective).__name__}")
        self.gpu, self.collective, self.tp, self.V, self.V_r = gpu, collective, ranks, vocab, slice_vocab
        self.max_rows, self.S = max_rows, math.ceil(slice_vocab / SLICE)
        self.pdl = supports_pdl(gpu) if pdl is None else pdl
        R, tp = max_rows, ranks
        self.slice_max = gpu.alloc((R * self.S,), np.float32)
        self.row_max = gpu.alloc((R,), np.float32)
        self.all_max = gpu.alloc((tp * R,), np.float32)
        self.rank_mass = gpu.zeros((R * MASS_BINS,), np.uint64)             # cleared by topp_ranks_decide
        self.all_mass = gpu.alloc((tp * R * MASS_BINS,), np.uint64)
        self.records = gpu.zeros((R * RECORD_BYTES // 8,), np.uint64)      # counts cleared by topp_ranks_cut
        self.all_records = gpu.alloc((tp * R * RECORD_BYTES // 8,), np.uint64)
        self.slice_wins = gpu.alloc((R * self.S * 2 * WINNER_BYTES,), np.uint8)
        self.state = gpu.zeros((R * ROW_STATE_DTYPE.itemsize,), np.uint8)
        self.max_tickets = gpu.zeros((R,), np.uint32)
        self.scan_tickets = gpu.zeros((R,), np.uint32)
        self.bin_scale = gpu.upload(bin_scales())
        self.status = gpu.zeros((1,), np.int32)
        self.inexact_rows = gpu.zeros((1,), np.uint32)      # running count of flagged rows
        self.params = gpu.zeros((8,), np.uint32)            # SampleParamsDev (32 B): set_params
        self.out = RanksOutputs(gpu.alloc((R,), np.int32), gpu.alloc((R,), np.int32))

    def set_params(self, params: SamplingParams, stream=None) -> None:
        """Write `params` (top-p without top-k) into the device record, stream-ordered on `stream`."""
        plan = plan_sampling(params, self.V)
        if plan.mode != TOP_P:
            raise ValueError(f"TopPRanks: params must be top-p alone (temperature > 0, 0 < top_p < 1, no top_k), got "
                             f"temperature {params.temperature}, top_p {params.top_p}, top_k {params.top_k} "
                             f"({plan.mode}: the node kernels or TreeSampler sample it)")
        set_words(self.params.ptr, np.frombuffer(params_record(params, plan).tobytes(), np.uint32),
                  stream if stream is not None else self.gpu.stream)

    def run(self, logits, offset: int, query_pos, params: SamplingParams, n: int, stream=None) -> RanksOutputs:
        """set_params + launch."""
        self.set_params(params, stream=stream)
        return self.launch(logits, offset, query_pos, n, stream=stream)

    def launch(self, logits, offset: int, query_pos, n: int, stream=None) -> RanksOutputs:
        """logits [>= n, V_r] float32 (this rank's slice, dense rows), offset its first global id, query_pos [n]
        int32: the kernels and the all-gathers on the parameters in the device record. No host sync (the
        collective's own aside)."""
        self._check(logits, offset, n)
        g, tp, S, p = self.gpu, self.tp, self.S, ptr(self.params)
        o = self.out

        def launch(name, grid, threads, *args):
            g.launch(g.kernel(SOURCE, name), grid, (threads, 1, 1), 0, *args, stream=stream, pdl=self.pdl)

        V_r = np.int32(self.V_r)
        launch("topp_ranks_max", (S, n, 1), MAX_THREADS, ptr(logits), V_r, p, ptr(self.slice_max), ptr(self.row_max),
               ptr(self.max_tickets), ptr(self.status))
        self._gather(self.row_max, self.all_max, (n,), np.float32, stream)
        launch("topp_ranks_mass", (S, n, 1), THREADS, ptr(logits), V_r, p, ptr(self.all_max), np.int32(tp),
               ptr(self.rank_mass))
        self._gather(self.rank_mass, self.all_mass, (n, MASS_BINS), np.uint64, stream)
        launch("topp_ranks_decide", (n, 1, 1), THREADS, p, ptr(self.all_max), ptr(self.all_mass), np.int32(tp),
               np.int32(self.V), ptr(self.bin_scale), ptr(self.rank_mass), ptr(self.state))
        launch("topp_ranks_scan", (S, n, 1), THREADS, ptr(logits), V_r, np.int32(offset), ptr(query_pos), p,
               ptr(self.state), ptr(self.slice_wins), ptr(self.records), ptr(self.scan_tickets))
        self._gather(self.records, self.all_records, (n, RECORD_BYTES // 8), np.uint64, stream)
        launch("topp_ranks_cut", (n, 1, 1), THREADS, ptr(query_pos), p, ptr(self.all_records), np.int32(tp),
               np.int32(self.V), ptr(self.bin_scale), ptr(self.state), ptr(self.records), ptr(o.tokens),
               ptr(o.flags), ptr(self.status), ptr(self.inexact_rows))
        return RanksOutputs(o.tokens.view(0, (n,)), o.flags.view(0, (n,)))

    def _check(self, logits, offset: int, n: int) -> None:
        if not 1 <= n <= self.max_rows:
            raise ValueError(f"TopPRanks.run: n {n} must be in 1..{self.max_rows} (max_rows)")
        shape = tuple(logits.shape)
        if np.dtype(logits.dtype) != np.float32 or len(shape) != 2 or shape[1] != self.V_r or shape[0] < n:
            raise ValueError(f"TopPRanks.run: logits must be this rank's float32 slice [>= {n}, {self.V_r}], "
                             f"got {np.dtype(logits.dtype).name} {list(shape)}")
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or \
                not 0 <= offset <= self.V - self.V_r:
            raise ValueError(f"TopPRanks.run: offset (the slice's first global id) must be an int in "
                             f"0..{self.V - self.V_r} (vocab {self.V} - slice_vocab {self.V_r}), got {offset!r}")

    def _gather(self, mine: DeviceArray, gathered: DeviceArray, shape: tuple, dtype, stream) -> None:
        """gathered[:tp * prod(shape)] = every rank's mine[:prod(shape)] in rank order (dense tensors)."""
        x = Dense(int(mine.ptr), shape, np.dtype(dtype))
        out = Dense(int(gathered.ptr), (self.tp, *shape), np.dtype(dtype))
        self.collective.all_gather(self.gpu, x, out, stream)

    def row_state(self, n: int) -> np.ndarray:
        """The last launch's per-row decision [n] ROW_STATE_DTYPE (l_top, bin, kept, cut_key, flags, ...) (syncs)."""
        return self.state.numpy()[: n * ROW_STATE_DTYPE.itemsize].view(ROW_STATE_DTYPE)

    def check_status(self, allow_inexact: bool = False) -> int:
        """Raise on NaN logits, a record of another mode or (unless allow_inexact) a flagged row since the last
        check; returns the flags (syncs; outside graphs)."""
        flags = int(self.status.numpy()[0])
        if flags:
            self.gpu.memset(self.status, 0)
        if flags & STATUS_NAN_TARGET:
            raise ValueError("TopPRanks: this rank's logits contained NaN (sampled tokens are meaningless)")
        if flags & STATUS_WRONG_MODE:
            raise ValueError("TopPRanks: the parameter record is not top-p alone (set_params)")
        if flags & (STATUS_INEXACT | STATUS_BIN_OVERFLOW) and not allow_inexact:
            raise ValueError("TopPRanks: a row's top-p cut is flagged (INEXACT: within the certified bound of top_p; "
                             "BIN_OVERFLOW: the crossing bin kept whole); out.flags says which row")
        return flags
