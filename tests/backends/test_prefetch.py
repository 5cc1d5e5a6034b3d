"""CPU tests of the L2 prefetch hint: what the cuda backend stages within its budget (backends/cuda_branch.py
BranchOps.prefetch), which buffers a weight name means (runtime/cuda_weights.py layouts), and the launcher's
grid and checks (plugins/prefetch.py) against a brute-force cover of the bytes."""
import numpy as np
import pytest

from ddtree.backends.cuda_branch import BranchOps
from ddtree.plugins import prefetch as pf
from ddtree.runtime.cuda_weights import CudaWeights


class Buf:
    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = ptr, nbytes


class Store:
    def __init__(self, sizes):
        self.bufs = {name: [Buf(0x1000 * (i + 1), n)] if n else [] for i, (name, n) in enumerate(sizes.items())}

    def layouts(self, name):
        return self.bufs[name]


class Staged(BranchOps):
    """BranchOps over a recording launcher: (address, nbytes) lists handed to the prefetch kernel."""

    def __init__(self, sizes, budget):
        self.store, self.prefetch_bytes, self.stream, self.runs = Store(sizes), budget, None, []
        self.prefetch_chunk = pf.CHUNK
        self.lane = 0
        runs = self.runs

        class Recorder:
            def run(self, buffers, stream=None):
                runs.append(list(buffers))
        self.recorder = Recorder()

    def launcher(self, key, make):
        self.keys = [*getattr(self, "keys", []), key]
        return self.recorder


SIZES = {"o_proj": 14 << 20, "router": 6 << 20, "gate": 8 << 20, "up": 0, "down": 4 << 20}


@pytest.mark.parametrize("budget, staged", [
    (64 << 20, ["o_proj", "router", "gate", "down"]),          # all fit; up lives in gate's buffer
    (28 << 20, ["o_proj", "router", "gate"]),                  # exactly fills at gate
    (27 << 20, ["o_proj", "router"]),                          # gate does not fit: the list ends there,
    (14 << 20, ["o_proj"]),                                    # even where a later, smaller one (down) would
    (13 << 20, []),
    (0, []),
])
def test_budget_stages_the_first_readers_in_order(budget, staged):
    ops = Staged(SIZES, budget)
    ops.prefetch(*SIZES)
    want = [(ops.store.bufs[n][0].ptr, SIZES[n]) for n in staged]
    assert ops.runs == ([want] if want else [])
    assert sum(n for _, n in want) <= budget


def test_a_budget_per_site_stages_each_site_within_its_own():
    """{site: bytes}: the attention's prefetch and the next front's take their own budget (bench step --prefetch-mb
    next:36 lets the next layer's q_a join its front without growing the attention's fill)."""
    ops = Staged(SIZES, {"attention": 64 << 20, "next": 14 << 20})
    ops.prefetch_next, ops.prefetch_next_beside, ops.lay = True, "collective", type("Lay", (), {"tp": 8})
    ops.prefetch(*SIZES, beside="attention")
    ops.prefetch(*SIZES, beside="collective")
    every = [(ops.store.bufs[n][0].ptr, SIZES[n]) for n in ("o_proj", "router", "gate", "down")]
    assert ops.runs == [every, every[:1]]


def test_a_budget_dict_missing_a_site_is_refused_by_name():
    ops = Staged(SIZES, {"next": 14 << 20})
    with pytest.raises(ValueError, match="no budget for the 'attention' site"):
        ops.prefetch("o_proj", beside="attention")


@pytest.mark.parametrize("text, want", [("17", 17 << 20), ("0", 0), ("next:36", {"next": 36 << 20}),
                                        ("attention:0.5, next:40", {"attention": 1 << 19, "next": 40 << 20})])
def test_budget_mib_parses_one_value_or_sites(text, want):
    assert pf.parse_budget_mb(text) == want


@pytest.mark.parametrize("text", ["-1", "x", "mlp:3", "next:3,next:4", "next:", "nan"])
def test_a_bad_budget_mib_says_what_is_wrong(text):
    with pytest.raises(ValueError, match="MiB|SITE:VALUE"):
        pf.parse_budget_mb(text)


@pytest.mark.parametrize("rows, forced, chunk", [(1, None, 16384), (2, None, 4096), (9, None, 4096),
                                                  (1, 8192, 8192), (9, 16384, 16384)])
def test_the_chunk_follows_the_calls_rows_unless_forced(rows, forced, chunk):
    """One row keeps 16 KiB a thread (a faster fill took DRAM from the next layer's first GEMM at AR); more rows ask
    4 KiB (~4x the blocks issue the fill); bench step --prefetch-chunk-kb forces one chunk everywhere."""
    ops = Staged(SIZES, 64 << 20)
    ops.prefetch_chunk, ops.rows = forced, rows
    ops.prefetch("o_proj")
    assert ops.keys == [("l2_prefetch", chunk)] and pf.chunk_for(rows, "attention", forced) == chunk
    assert pf.chunks(forced) == {site: {"one_row": forced or pf.CHUNK, "more_rows": forced or pf.CHUNK_ROWS}
                                 for site in pf.SITES}


@pytest.mark.parametrize("beside, prefetch_next_beside, site", [("attention", "collective", "attention"),
                                                                ("collective", "collective", "next"),
                                                                ("experts", "experts", "next")])
def test_a_chunk_forced_per_site_reaches_only_that_sites_launch(beside, prefetch_next_beside, site):
    """{site: bytes} forces the chunk of the prefetches at that site (the attention's own, or the next front's at
    either of its two sites); the other site keeps the rule by rows."""
    ops = Staged(SIZES, 64 << 20)
    ops.prefetch_next, ops.prefetch_next_beside, ops.lay = True, prefetch_next_beside, type("Lay", (), {"tp": 8})
    ops.prefetch_chunk, ops.rows = {site: 8192}, 1
    ops.prefetch("o_proj", beside=beside)
    ops.release_held()
    other = next(s for s in pf.SITES if s != site)
    assert ops.keys == [("l2_prefetch", 8192)]
    assert pf.chunk_for(1, other, ops.prefetch_chunk) == pf.CHUNK and pf.chunk_for(2, other, ops.prefetch_chunk) == \
        pf.CHUNK_ROWS


@pytest.mark.parametrize("text, want", [("16", 16384), ("attention:4", {"attention": 4096}),
                                        ("attention:4,next:16", {"attention": 4096, "next": 16384})])
def test_chunk_kib_parses_one_value_or_sites(text, want):
    assert pf.parse_chunk_kb(text) == want


@pytest.mark.parametrize("text", ["0", "x", "4.5", "mlp:4", "attention:4,attention:8", "next:", "attention:-1"])
def test_a_bad_chunk_kib_names_the_flag(text):
    with pytest.raises(ValueError, match="KiB|SITE:VALUE"):
        pf.parse_chunk_kb(text)


def test_layouts_name_the_buffers_a_kernel_reads():
    w = CudaWeights.__new__(CudaWeights)
    w._tiled = {"mlp.gate_proj.weight": "gate+up tiled", "o_proj.weight": "tiled"}
    w.raw = {"mlp.gate.e_score_correction_bias": "raw"}
    assert w.layouts("o_proj.weight") == ["tiled"]
    assert w.layouts("mlp.gate_proj.weight") == ["gate+up tiled"]
    assert w.layouts("mlp.up_proj.weight") == []                   # interleaved into gate's layout
    assert w.layouts("mlp.gate.e_score_correction_bias") == ["raw"]
    with pytest.raises(KeyError, match="not among the rank's weights"):
        w.layouts("mlp.down_proj.weight")


def kernel_cover(sizes, blocks, threads, chunk):
    """What kernels/prefetch.cu's l2_prefetch asks for, thread by thread: {buffer: [(offset, len)]}."""
    asked = {b: [] for b in range(len(sizes))}
    for t in range(blocks * threads):
        c = t
        for b, n in enumerate(sizes):
            chunks = -(-n // chunk)
            if c < chunks:
                asked[b].append((c * chunk, min(chunk, n - c * chunk)))
                break
            c -= chunks
    return asked


@pytest.mark.parametrize("sizes", [[16], [4096], [pf.CHUNK - 16], [pf.CHUNK], [pf.CHUNK + 16], [14 << 20],
                                   [(14 << 20) + 48, 16, pf.CHUNK * 3 + 32, 6 << 20],
                                   [pf.CHUNK * pf.THREADS * 3 + 16, 0, 48]])
def test_launch_grid_covers_every_byte_once(sizes):
    blocks, threads = pf.launches(sizes)
    for b, pieces in kernel_cover(sizes, blocks, threads, pf.CHUNK).items():
        covered = np.zeros(sizes[b] // 16, int)
        for at, n in pieces:
            assert n > 0 and at % 16 == 0 and n % 16 == 0
            covered[at // 16: (at + n) // 16] += 1
        assert (covered == 1).all(), b
    assert (blocks - 1) * threads < sum(-(-n // pf.CHUNK) for n in sizes)      # no block without work


class FakeGpu:
    def __init__(self, arch="sm_90"):
        self.arch, self.name, self.launched = arch, "fake", []

    def kernel(self, source, name):
        return (source, name)

    def launch(self, kernel, grid, block, smem, *args, stream=None):
        self.launched.append((kernel, grid, block, [int(a) for a in args]))


def test_launcher_packs_four_buffers_a_launch_and_checks_them():
    gpu = FakeGpu()
    pre = pf.L2Prefetch(gpu)
    bufs = [(0x10000, 4 << 20), (0x20010, 32), (0x30000, 1 << 20), (0x40000, 64), (0x50000, 2 << 20)]
    pre.run(bufs)
    k = ("prefetch.cu", "l2_prefetch")
    first = [v for b in bufs[:4] for v in b]
    assert gpu.launched == [(k, 3, 128, first + [pf.CHUNK]),                       # 256 + 1 + 64 + 1 chunks
                            (k, 1, 128, [0x50000, 2 << 20] + [0, 0] * 3 + [pf.CHUNK])]
    for bad in [(0x10008, 32), (0x10000, 40), (0x10000, 0)]:
        with pytest.raises(ValueError, match="16-byte aligned"):
            pre.run([bad])
    with pytest.raises(RuntimeError, match="sm_90 or newer"):
        pf.L2Prefetch(FakeGpu("sm_80"))
    with pytest.raises(ValueError, match="multiple of 16"):
        pf.L2Prefetch(FakeGpu(), chunk=1000)


@pytest.mark.parametrize("stride, sizes", [(pf.PAGE, [706 << 20, 22 << 20, 353 << 20, 11 << 20]),
                                           (pf.PAGE, [4, pf.PAGE, pf.PAGE + 4, 3 * pf.PAGE - 4]),
                                           (64 << 10, [(1 << 20) + 8, 0, 64 << 10])])
def test_touch_loads_one_word_in_every_page_once(stride, sizes):
    """kernels/prefetch.cu touch_pages maps threads to (buffer, page) as l2_prefetch maps them to chunks; each page
    of each buffer gets exactly one 4-byte load at its first byte, inside the buffer."""
    blocks, threads = pf.launches(sizes, stride)
    for b, pieces in kernel_cover(sizes, blocks, threads, stride).items():
        loads = [at for at, _ in pieces]
        assert all(at + 4 <= sizes[b] for at in loads)
        assert sorted(at // stride for at in loads) == list(range(-(-sizes[b] // stride))), b


def test_page_touch_launcher_packs_four_buffers_a_launch_and_checks_them():
    gpu = FakeGpu()
    touch = pf.PageTouch(gpu)
    bufs = [(0x10000, 706 << 20), (0x20004, 22 << 20), (0x30000, 353 << 20), (0x40000, 11 << 20), (0x50000, 8)]
    touch.run(bufs)
    k = ("prefetch.cu", "touch_pages")
    first = [v for b in bufs[:4] for v in b]
    assert gpu.launched == [(k, 5, 128, first + [pf.PAGE]),                     # 353 + 11 + 177 + 6 pages
                            (k, 1, 128, [0x50000, 8] + [0, 0] * 3 + [pf.PAGE])]
    for bad in [(0x10002, 32), (0x10000, 0), (0x10000, 6)]:
        with pytest.raises(ValueError, match="4-byte aligned"):
            touch.run([bad])
    with pytest.raises(ValueError, match="multiple of 16"):
        pf.PageTouch(FakeGpu(), stride=1000)


class Builder:
    """A graph builder's split / join as cuda.core's GraphBuilder offers them (recorded)."""
    log = []

    def __init__(self, name):
        self.name = name
        self.is_join_required = False

    def split(self, n):
        assert n == 2
        Builder.log.append(("split", self.name))
        return self, Builder(self.name + "'")

    @staticmethod
    def join(main, side):
        Builder.log.append(("join", main.name, side.name))
        return main


def test_prefetch_branch_stays_open_until_the_end_of_the_next_call():
    """While capturing, the prefetch goes on a split of the builder and the main chain goes on at once; the end of
    its own call (CudaOps.call: join_pending) leaves it open, so neither this layer nor the next waits for the
    prefetch launch; the end of the next call joins it, and every=True (before a graph ends) joins all."""
    ops = Staged(SIZES, 64 << 20)
    ops.branches, main = True, Builder("main")
    ops.stream, Builder.log, ops.calls = main, [], 1
    streams = []
    ops.recorder.run = lambda buffers, stream=None: streams.append(stream)
    ops.prefetch("o_proj", "router")                                   # call 1 (beside its attention)
    assert ops.stream is main and [s.name for s in streams] == ["main'"]
    assert Builder.log == [("split", "main")]
    ops.join_pending()                                                 # the end of call 1: still open
    assert Builder.log == [("split", "main")]
    ops.calls = 2
    ops.prefetch("o_proj")                                             # call 2's own
    ops.join_pending()                                                 # the end of call 2: call 1's joins
    assert Builder.log == [("split", "main"), ("split", "main"), ("join", "main", "main'")] and ops.stream is main
    ops.join_pending(every=True)                                       # the graph's end: call 2's too
    assert Builder.log[-1] == ("join", "main", "main'") and len(Builder.log) == 4
    ops.join_pending(every=True)                                       # nothing left open
    assert len(Builder.log) == 4 and ops._pending == []


def test_open_branches_get_their_own_lanes_and_launchers():
    """Two branches open at once run on distinct lanes, and CudaOps.launcher keys a branch's launchers by its
    lane, so two parallel GEMMs of one shape never share a workspace; a lane is reused once joined."""
    from ddtree.backends.cuda_backend import CudaOps
    ops = Staged(SIZES, 0)
    main = Builder("main")
    ops.branches, ops.stream, ops.kernels = True, main, {}
    made = []

    def get():
        return CudaOps.launcher(ops, ("gemm", 128, 7168, False), lambda: made.append(ops.lane) or object())
    base = get()
    with ops.branch() as k_path:
        in_k = get()
        assert ops.lane == 1
    with ops.branch() as v_path:
        in_v = get()
        assert ops.lane == 2
    assert ops.lane == 0 and ops.stream is main
    assert len({id(base), id(in_k), id(in_v)}) == 3 and made == [0, 1, 2]
    ops.join(k_path)
    with ops.branch() as again:
        assert ops.lane == 1 and get() is in_k                      # lane 1 is free again; v_path still holds 2
    ops.join(v_path)
    ops.join(again)
    assert ops.stream is main and ops._open == []


class Site(Staged):
    """Staged with the next-front knobs of CudaOps (prefetch_next, prefetch_next_beside) at tp `tp`."""

    def __init__(self, beside, tp=8, on=True):
        super().__init__(SIZES, 64 << 20)
        self.prefetch_next, self.prefetch_next_beside = on, beside
        self.lay = type("Lay", (), {"tp": tp})()


@pytest.mark.parametrize("beside", ["collective", "experts"])
def test_one_site_of_the_next_front_acts(beside):
    """The description offers the next layer's attention weights at two sites (beside the routed experts, then beside
    the MLP all-reduce); only the chosen one stages them, the attention-side prefetch is untouched, and the experts
    site waits for release_held (the cuda MoE, once routed; else the end of the call)."""
    ops = Site(beside)
    ops.prefetch("router", beside="experts")
    assert ops.runs == []                                          # held (experts) or not this site (collective)
    ops.release_held()
    want = [(ops.store.bufs["router"][0].ptr, SIZES["router"])]
    assert ops.runs == ([want] if beside == "experts" else [])
    ops.release_held()                                             # released once
    assert len(ops.runs) == (1 if beside == "experts" else 0)
    ops.prefetch("router", beside="collective")
    assert len(ops.runs) == 1                                      # one of the two sites staged it
    ops.prefetch("o_proj")                                         # beside the attention: whatever the knob
    assert ops.runs[-1] == [(ops.store.bufs["o_proj"][0].ptr, SIZES["o_proj"])]


def test_next_front_off_and_tp1():
    ops = Site("experts", on=False)
    ops.prefetch("router", beside="experts")
    ops.prefetch("router", beside="collective")
    ops.release_held()
    assert ops.runs == []
    ops = Site("collective", tp=1)                                 # no collective to hide behind at tp 1
    ops.prefetch("router", beside="collective")
    assert ops.runs == []
    ops = Site("experts", tp=1)                                    # the experts are there at tp 1 too
    ops.prefetch("router", beside="experts")
    ops.release_held()
    assert len(ops.runs) == 1
