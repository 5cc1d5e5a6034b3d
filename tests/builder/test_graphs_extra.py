"""Without the `graphs` extra (onnx, onnx-graphsurgeon, ml_dtypes) a build that exports graphs is an
error naming the extra, raised before anything is written. Nothing in tests/builder or tests/graphs
skips on a missing extra: their engines export graphs, so they fail (CI installs the extra)."""
import sys

import pytest

from ddtree.builder.build import build_engine
from ddtree.builder.trt_build import BuildError


def test_graphs_without_the_extra_say_what_to_install(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnx_graphsurgeon", None)            # import fails as if not installed
    with pytest.raises(BuildError, match=r"the layer graphs needs the 'graphs' extra \(pip install -e '\.\[graphs\]'"):
        build_engine(*tiny_ckpt, 1, ["sm_120"], tmp_path / "e")
    assert not (tmp_path / "e").exists()
