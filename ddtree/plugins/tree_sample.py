"""Launcher for the GPU sampler and acceptance walk (kernels/sample.cu, kernels/sample_top_p.cu).

    sampler = TreeSampler(gpu, vocab=V)                             # workspaces for up to 256 rows
    out = sampler.run(logits, query_pos, params, n, tree=tree)      # 1 launch (3 for top-p alone), no host sync
    out.target [n], out.accepted [n] (node indices, then -1), out.count [1], out.bonus [1]

    plan = sampler.set_params(params)                               # outside a graph: the device record
    graph = gpu.capture(lambda s: sampler.launch(plan.mode, logits, query_pos, n, tree=tree, stream=s))
    sampler.set_params(other_params_of_that_mode); gpu.replay(graph)  # the graph reads the new record

How parameters reach the kernels: never as kernel arguments. set_params writes temperature, top_p,
top_k, C (candidates per slice) and the seed into one device record (`params`, SAMPLE_PARAMS_DTYPE, the
twin of SampleParamsDev in kernels/sample_common.cuh) with stream-ordered memsets on the launch stream, so
it lands after the work already queued there and before what follows. Every sampling kernel reads the
record through a pointer. The mode (greedy / gumbel / top_k / top_p) picks the kernels and is the only
thing a launch fixes: a graph captured by launch(mode) serves any parameters of that mode set later, so a
step graph is keyed by mode (set_params returns the plan whose mode picks the graph). A record of another
mode is caught on the device and raised by check_status. run() = set_params + launch (inside a capture
its memsets are captured too: that graph rewrites the record it was captured with at every replay).

The token at every row is the sampling definition of docs/interfaces.md section 5 (ddtree/tree/sampling.py)
for the position query_pos + 1: greedy, or Gumbel-max over z = l / T with top-k / top-p, in float64.
With `tree` (a DeviceTree from DraftTreeBuilder), the last block walks it (ddtree/tree/walk.py).
Without a tree it is a plain sampler (autoregressive decoding: n = 1).
Limits: top_k <= 256 (a larger top_k raises; 0 or >= V means off).
Top-p without top-k (kernels/sample_top_p.cu, numpy twin plugins/top_p_bins.py): float32 weights in exact
fixed point per bin, the cut in float64, and a certified bound. A row whose cumulative probability at the
cut lies within the bound of top_p (about 2e-11 at V 163840: the definition's own float64 rounding
dominates it) keeps the kernels' cut and is *flagged*, not recomputed: SP_STATUS_INEXACT, per row in
row_state(n)["flags"] and counted in inexact_rows; a cut bin of more than 4096 tokens (logits within 1/128
of z of each other) is kept whole and flagged BIN_OVERFLOW. check_status raises on either unless
allow_inexact=True (then it returns the flags).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddtree.plugins.device import DeviceArray, Gpu, ptr, set_words
from ddtree.plugins.gemm import supports_pdl
from ddtree.plugins.top_p_bins import bin_scales
from ddtree.tree.sampling import SamplingParams

SOURCE, TOP_P_SOURCE = "sample.cu", "sample_top_p.cu"
THREADS = 512
GREEDY_THREADS = 256           # SP_GREEDY_THREADS
SLICE = 16384                  # SP_SLICE
CANDIDATES = 256               # SP_CAND: per slice, top-p without top-k; also the largest top_k
MAX_LIST_KEYS = 3072           # SP_MAX_LIST_KEYS: S * C keys of a row merged in shared memory
MASS_BINS = 4096               # SP_BINS
MAX_BIN_KEYS = 4096            # SP_MAX_BIN_KEYS: tokens of a top-p crossing bin sorted in shared memory
MAX_TOP_P_VOCAB = 1 << 28      # a row's fixed-point bin sums (2^35 per token) stay below 2^64
MAX_ROWS = 256
ROW_MAX_THREADS = 256          # SP_MAX_THREADS (sample_row_max)
GREEDY, GUMBEL, TOP_K, TOP_P = "greedy", "gumbel", "top_k", "top_p"
STATUS_NAN_TARGET, STATUS_BIN_OVERFLOW, STATUS_WRONG_MODE, STATUS_INEXACT = 2, 4, 8, 16
WINNER_BYTES = 16              # struct Winner { double value; int id; } (padded)
# struct RowState (sample_common.cuh): top-p's per-row decision, read back by tests and diagnostics
ROW_STATE_DTYPE = np.dtype([("l_top", "<f4"), ("bin", "<i4"), ("above", "<f8"), ("norm", "<f8"),
                            ("err_above", "<f8"), ("err_below", "<f8"), ("cut_key", "<u8"), ("kept", "<u4"),
                            ("flags", "<u4")], align=True)
# struct SampleParamsDev (sample_common.cuh): the device record every sampling kernel reads
SAMPLE_PARAMS_DTYPE = np.dtype([("temperature", "<f8"), ("top_p", "<f8"), ("top_k", "<i4"), ("candidates", "<i4"),
                                ("seed_lo", "<u4"), ("seed_hi", "<u4")], align=True)


@dataclass(frozen=True)
class SamplePlan:
    mode: str                  # GREEDY, GUMBEL (no filter), TOP_K (top-k, maybe top-p), TOP_P (top-p alone)
    top_k: int                 # 0 = off (normalised: 0 < top_k < V)
    candidates: int            # C: keys per slice (TOP_K, TOP_P)


def plan_sampling(params: SamplingParams, vocab: int) -> SamplePlan:
    if params.greedy:
        return SamplePlan(GREEDY, 0, 0)
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k > CANDIDATES:
        raise ValueError(f"GPU sampler: top_k {params.top_k} is above the supported {CANDIDATES} "
                         f"(use top_k <= {CANDIDATES}, or 0 for no top-k)")
    if top_k:
        return SamplePlan(TOP_K, top_k, top_k)
    return SamplePlan(GUMBEL, 0, 0) if params.top_p >= 1 else SamplePlan(TOP_P, 0, CANDIDATES)


def params_record(params: SamplingParams, plan: SamplePlan) -> np.ndarray:
    """The device record of `params` under `plan` (greedy: temperature 0, the rest unused)."""
    record = np.zeros((), SAMPLE_PARAMS_DTYPE)
    record["temperature"], record["top_p"] = params.temperature, params.top_p
    record["top_k"], record["candidates"] = plan.top_k, plan.candidates
    record["seed_lo"], record["seed_hi"] = params.seed & 0xFFFFFFFF, params.seed >> 32
    return record


@dataclass
class SampleOutputs:
    target: DeviceArray        # [n] int32 the target's token at every row
    accepted: DeviceArray      # [n] int32 accepted node indices in depth order, then -1 (with a tree)
    count: DeviceArray         # [1] int32 accepted nodes, root included (tau)
    bonus: DeviceArray         # [1] int32 the next bonus token


class TreeSampler:
    def __init__(self, gpu: Gpu, vocab: int, max_rows: int = MAX_ROWS, pdl: bool | None = None,
                 top_p_defines: dict[str, int] | None = None):
        """top_p_defines: compile-time switches of sample_top_p.cu for diagnosis builds (DD_PROFILE,
        SP_ABLATE: tests/plugins/profile_top_p.py); None for the product."""
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"TreeSampler: max_rows must be in 1..{MAX_ROWS}, got {max_rows}")
        if not 1 <= vocab < 2 ** 31:
            raise ValueError(f"TreeSampler: vocab must be in 1..2^31-1, got {vocab}")
        self.gpu, self.V, self.max_rows, self.top_p_defines = gpu, vocab, max_rows, top_p_defines
        self.S = math.ceil(vocab / SLICE)
        self.pdl = supports_pdl(gpu) if pdl is None else pdl
        self.keys = gpu.alloc((max_rows * self.S * CANDIDATES,), np.uint64)
        self.wins = gpu.alloc((max_rows * self.S * 2 * WINNER_BYTES,), np.uint8)  # top-p: above the bin, in it
        self.slice_max = gpu.alloc((max_rows * self.S,), np.float32)
        self.state = gpu.zeros((max_rows * ROW_STATE_DTYPE.itemsize,), np.uint8)
        self.mass = gpu.zeros((max_rows, MASS_BINS), np.uint64)              # fixed point; cleared after use
        self.bin_keys = gpu.alloc((max_rows, MAX_BIN_KEYS), np.uint64)
        self.row_counts = gpu.zeros((2 * max_rows,), np.uint32)              # cleared after use
        self.bin_scale = gpu.upload(bin_scales())                            # exp(-b / 128)
        self.status = gpu.zeros((1,), np.int32)
        self.full_row_rows = gpu.zeros((1,), np.uint32)      # running count of top-p rows that kept > 256 tokens
        self.inexact_rows = gpu.zeros((1,), np.uint32)       # running count of flagged top-p rows
        self.row_tickets = gpu.zeros((max_rows,), np.uint32)
        self.done_ticket = gpu.zeros((1,), np.uint32)
        self.params = gpu.zeros((SAMPLE_PARAMS_DTYPE.itemsize,), np.uint8)   # SampleParamsDev: set_params
        self.out = SampleOutputs(gpu.alloc((max_rows,), np.int32), gpu.alloc((max_rows,), np.int32),
                                 gpu.alloc((1,), np.int32), gpu.alloc((1,), np.int32))

    def set_params(self, params: SamplingParams, stream=None) -> SamplePlan:
        """Write `params` into the device record (stream-ordered memsets on `stream`, default the Gpu's);
        returns the plan whose mode picks the kernels (and the graph) that serve it."""
        plan = plan_sampling(params, self.V)
        if plan.mode == TOP_P and self.V > MAX_TOP_P_VOCAB:
            raise ValueError(f"TreeSampler: top-p without top-k supports vocab <= {MAX_TOP_P_VOCAB}, got {self.V}")
        if plan.mode == TOP_K and self.S * plan.candidates > MAX_LIST_KEYS:
            raise ValueError(f"TreeSampler: vocab {self.V} ({self.S} slices) x {plan.candidates} candidates "
                             f"exceeds the {MAX_LIST_KEYS} keys merged per row (lower top_k)")
        set_words(self.params.ptr, np.frombuffer(params_record(params, plan).tobytes(), np.uint32),
                  stream if stream is not None else self.gpu.stream)
        return plan

    def run(self, logits: DeviceArray, query_pos: DeviceArray, params: SamplingParams, n: int, tree=None,
            stream=None) -> SampleOutputs:
        """set_params + launch: logits [n, V] float32 (rows may be a prefix of a larger buffer), query_pos
        [n] int32. Launches: greedy / plain Gumbel 1, top-k 1, top-p alone 3."""
        return self.launch(self.set_params(params, stream=stream), logits, query_pos, n, tree=tree, stream=stream)

    def launch(self, mode: str | SamplePlan, logits: DeviceArray, query_pos: DeviceArray, n: int, tree=None,
               stream=None) -> SampleOutputs:
        """The kernels of `mode` (GREEDY, GUMBEL, TOP_K, TOP_P, or a plan's) on the parameters in the device
        record at run time (set_params, before the launch or between replays of a graph holding it)."""
        mode = mode.mode if isinstance(mode, SamplePlan) else mode
        if mode not in (GREEDY, GUMBEL, TOP_K, TOP_P):
            raise ValueError(f"TreeSampler.launch: mode must be one of {GREEDY}, {GUMBEL}, {TOP_K}, {TOP_P} "
                             f"(or a SamplePlan), got {mode!r}")
        if not 1 <= n <= self.max_rows:
            raise ValueError(f"TreeSampler.run: n {n} must be in 1..{self.max_rows} (max_rows)")
        if np.dtype(logits.dtype) != np.float32 or logits.shape[-1] != self.V or logits.shape[0] < n:
            raise ValueError(f"TreeSampler.run: logits must be float32 [>= {n}, {self.V}], "
                             f"got {np.dtype(logits.dtype).name} {list(logits.shape)}")
        if tree is not None and tree.tokens.shape[0] != n:
            raise ValueError(f"TreeSampler.run: the tree has {tree.tokens.shape[0]} nodes but n is {n}")
        g, S, o, t, p = self.gpu, self.S, self.out, tree, ptr(self.params)
        walk = (ptr(t and t.tokens), ptr(t and t.parents), ptr(t and t.depth), ptr(o.accepted), ptr(o.count),
                ptr(o.bonus), ptr(self.row_tickets), ptr(self.done_ticket))

        def launch(source, name, *a, threads=THREADS):          # grid: a block per slice of each row
            defines = self.top_p_defines if source == TOP_P_SOURCE else None
            kernel = g.kernel(source, name, defines) if defines else g.kernel(source, name)
            g.launch(kernel, (S, n, 1), (threads, 1, 1), 0, *a, stream=stream, pdl=self.pdl)

        if mode == GREEDY:
            launch(SOURCE, "sample_greedy", ptr(logits), np.int32(self.V), p, ptr(self.keys), ptr(o.target),
                   ptr(self.status), *walk, threads=GREEDY_THREADS)
        elif mode == GUMBEL:
            launch(SOURCE, "sample_gumbel", ptr(logits), np.int32(self.V), ptr(query_pos), p, ptr(self.wins),
                   ptr(o.target), ptr(self.status), *walk)
        elif mode == TOP_K:
            launch(SOURCE, "sample_filtered", ptr(logits), np.int32(self.V), ptr(query_pos), p, ptr(self.keys),
                   ptr(o.target), ptr(self.status), *walk)
        else:
            launch(TOP_P_SOURCE, "sample_row_max", ptr(logits), np.int32(self.V), p, ptr(self.slice_max),
                   ptr(self.status), threads=ROW_MAX_THREADS)
            launch(TOP_P_SOURCE, "sample_mass", ptr(logits), np.int32(self.V), p, ptr(self.slice_max),
                   ptr(self.bin_scale), ptr(self.state), ptr(self.mass), ptr(self.row_tickets))
            launch(TOP_P_SOURCE, "sample_kept", ptr(logits), np.int32(self.V), ptr(query_pos), p,
                   ptr(self.bin_scale), ptr(self.state), ptr(self.wins), ptr(self.bin_keys), ptr(self.row_counts),
                   ptr(o.target), ptr(self.status), ptr(self.full_row_rows), ptr(self.inexact_rows), *walk)
        return SampleOutputs(o.target.view(0, (n,)), o.accepted.view(0, (n,)), o.count, o.bonus)

    def row_state(self, n: int) -> np.ndarray:
        """The last top-p launch's per-row decision [n] ROW_STATE_DTYPE (bin, kept, cut_key, flags, ...)."""
        return self.state.numpy()[: n * ROW_STATE_DTYPE.itemsize].view(ROW_STATE_DTYPE)

    def check_status(self, allow_inexact: bool = False) -> int:
        """Raise if any run since the last check saw NaN target logits, parameters of another mode or (unless
        allow_inexact) a top-p cut not certified to be the definition's; returns the flags (synchronises;
        outside graphs)."""
        flags = int(self.status.numpy()[0])
        if flags:
            self.gpu.memset(self.status, 0)
        if flags & STATUS_NAN_TARGET:
            raise ValueError("TreeSampler: the target logits contained NaN (sampled tokens are meaningless)")
        if flags & STATUS_WRONG_MODE:
            raise ValueError("TreeSampler: kernels of one sampling mode ran with the parameters of another (replay "
                             "the graph of the mode set_params returned; sampled tokens are meaningless)")
        if flags & STATUS_BIN_OVERFLOW and not allow_inexact:
            raise ValueError(f"TreeSampler: a top-p cut fell among more than {MAX_BIN_KEYS} logits within 1/128 of z "
                             "of each other; that bin was kept whole (not the exact definition)")
        if flags & STATUS_INEXACT and not allow_inexact:
            raise ValueError("TreeSampler: a top-p cut lay within the certified error bound of top_p (inexact: the "
                             "kernels' cut may not be the float64 definition's; row_state(n)['flags'] says which row)")
        return flags
