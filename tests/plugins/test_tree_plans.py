"""CPU tests of the GPU tree step's host side: the key encoding shared with the kernels, the sampling
plan, the sampler's device parameter record (its numpy layout against the C struct), and the errors raised
before anything is allocated."""
import re
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree.plugins.compile import KERNEL_DIR
from ddtree.plugins.tree_build import table_keys
from ddtree.plugins.tree_sample import (
    CANDIDATES,
    GREEDY,
    GUMBEL,
    SAMPLE_PARAMS_DTYPE,
    TOP_K,
    TOP_P,
    params_record,
    plan_sampling,
)
from ddtree.tree.sampling import SamplingParams


def test_table_keys_order_is_topk_order():
    """Descending keys = descending value, ties to the lower id (-0 equals +0): numpy's lexsort order."""
    rng = np.random.default_rng(0)
    values = rng.choice(np.array([-0.0, 0.0, -1.0, -1.5, -np.inf, 2.0, -1e-30, 1e-30], np.float32), size=500)
    ids = rng.permutation(100000)[:500]
    by_key = np.argsort(table_keys(values, ids))[::-1]
    by_lexsort = np.lexsort((ids, -values.astype(np.float64)))
    np.testing.assert_array_equal(by_key, by_lexsort)
    assert (table_keys(values, ids) > 0).all()         # 0 is the padding key


@pytest.mark.parametrize("params,vocab,mode,top_k,cands", [
    (SamplingParams(), 1000, GREEDY, 0, 0),
    (SamplingParams(temperature=0.5), 1000, GUMBEL, 0, 0),
    (SamplingParams(temperature=0.5, top_k=1000), 1000, GUMBEL, 0, 0),       # top_k >= V is off
    (SamplingParams(temperature=0.5, top_k=40, top_p=0.9), 1000, TOP_K, 40, 40),
    (SamplingParams(temperature=0.5, top_p=0.9), 1000, TOP_P, 0, CANDIDATES),
    (SamplingParams(temperature=0.5, top_k=5000, top_p=0.9), 1000, TOP_P, 0, CANDIDATES),
])
def test_plan_sampling(params, vocab, mode, top_k, cands):
    plan = plan_sampling(params, vocab)
    assert (plan.mode, plan.top_k, plan.candidates) == (mode, top_k, cands)


def test_plan_sampling_rejects_large_top_k():
    with pytest.raises(ValueError, match="top_k 300 is above the supported 256"):
        plan_sampling(SamplingParams(temperature=1.0, top_k=300), 163840)


def c_struct_offsets(text: str, name: str) -> tuple[dict, int]:
    """Field offsets and size of a C struct of scalars laid out by the natural-alignment rule."""
    sizes = {"double": 8, "int": 4, "u32": 4}
    body = re.search(r"struct %s \{(.*?)\};" % name, text, re.S).group(1)
    offsets, at, widest = {}, 0, 1
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        ctype, names = decl.split(None, 1)
        for field in names.split(","):
            size = sizes[ctype]
            at = -(-at // size) * size
            offsets[field.strip()], at, widest = at, at + size, max(widest, size)
    return offsets, -(-at // widest) * widest


def test_sample_params_dtype_is_the_c_struct():
    """The numpy record the launcher writes has SampleParamsDev's layout: the fields of the header's
    declaration in its order, at the offsets of the C natural-alignment rule, and the size the header's
    static_assert states (NVRTC checks that one when test_compile builds sample.cu)."""
    text = (KERNEL_DIR / "sample_common.cuh").read_text()
    offsets, size = c_struct_offsets(text, "SampleParamsDev")
    asserted_size = int(re.search(r"sizeof\(SampleParamsDev\) == (\d+)", text).group(1))
    numpy_offsets = {f: SAMPLE_PARAMS_DTYPE.fields[f][1] for f in SAMPLE_PARAMS_DTYPE.names}
    assert list(SAMPLE_PARAMS_DTYPE.names) == list(offsets)
    assert numpy_offsets == offsets
    assert SAMPLE_PARAMS_DTYPE.itemsize == size == asserted_size


@pytest.mark.parametrize("params,vocab", [
    (SamplingParams(), 1000),
    (SamplingParams(temperature=0.7, seed=(5 << 32) + 9), 163840),
    (SamplingParams(temperature=1.3, top_k=50, top_p=0.9, seed=(1 << 64) - 1), 163840),
    (SamplingParams(temperature=2.0, top_k=5000, top_p=0.25, seed=3), 1000)])
def test_params_record_bytes(params, vocab):
    """The record's bytes are the C struct's (packed here independently), with the plan's top_k and C."""
    plan = plan_sampling(params, vocab)
    want = struct.pack("<ddiiII", params.temperature, params.top_p, plan.top_k, plan.candidates,
                       params.seed % (1 << 32), params.seed // (1 << 32))
    assert params_record(params, plan).tobytes() == want


def test_builder_and_sampler_check_arguments_before_allocating():
    from ddtree.plugins.tree_build import DraftTreeBuilder
    from ddtree.plugins.tree_sample import TreeSampler

    class NoGpu:          # any allocation would fail loudly
        arch = "sm_90"

        def alloc(self, *a):
            raise AssertionError("allocated before validating")
        zeros = alloc

    with pytest.raises(ValueError, match="depth .* must be in 1..16"):
        DraftTreeBuilder(NoGpu(), vocab=1000, depth=17)
    with pytest.raises(ValueError, match="max_budget must be in 1..255"):
        DraftTreeBuilder(NoGpu(), vocab=1000, depth=7, max_budget=256)
    with pytest.raises(ValueError, match="above the 4096 merged"):
        DraftTreeBuilder(NoGpu(), vocab=16384 * 17, depth=7, max_budget=255)
    with pytest.raises(ValueError, match="max_rows must be in 1..256"):
        TreeSampler(NoGpu(), vocab=1000, max_rows=257)


def test_bench_tree_rejects_unknown_mode():
    from ddtree.cli import main
    result = CliRunner().invoke(main, ["bench", "tree", "--mode", "greedy,nucleus"])
    assert result.exit_code != 0 and "unknown mode(s) ['nucleus']" in result.output


def test_bench_tree_rejects_unknown_build():
    """--build names its choices before any GPU is opened."""
    from ddtree.cli import main
    result = CliRunner().invoke(main, ["bench", "tree", "--build", "auto,heap"])
    assert result.exit_code == 2 and "--build" in result.output and "auto, candidates, pops" in result.output
