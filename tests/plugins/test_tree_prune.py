"""CPU tests of the tree pruning kernel (kernels/tree_prune.cu, plugins/tree_prune.py): it compiles for sm_90 and
sm_120 with the pip NVRTC, its limits match the twin's module (tree/prune.py) and the launcher refuses shapes past
them by name. The kernel against its twin on a GPU: tests/plugins/test_tree_prune_gpu.py."""
import re
from pathlib import Path

import pytest

from ddtree.plugins import compile as kc
from ddtree.plugins import tree_prune as tp
from ddtree.tree import prune

SOURCE = Path(kc.KERNEL_DIR) / tp.SOURCE


@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_kernel_compiles(arch):
    blob = kc.compile_cubin(tp.SOURCE, arch).read_bytes()
    assert blob[:4] == b"\x7fELF" and tp.KERNEL.encode() in blob


def test_limits_match_the_twin_and_the_launcher():
    defines = {m[0]: int(m[1]) for m in re.findall(r"#define (\w+) (\d+)", SOURCE.read_text())}
    assert (defines["TP_MAX_NODES"], defines["TP_MAX_EXPERTS"], defines["TP_THREADS"]) == \
        (prune.MAX_NODES, prune.MAX_EXPERTS, tp.THREADS)
    assert tp.reference is prune.prune_nodes
    with pytest.raises(prune.PruneError, match="n_experts"):
        tp.TreePrune(None, top_k=8, n_experts=prune.MAX_EXPERTS + 1)
    with pytest.raises(prune.PruneError, match="top_k"):
        tp.TreePrune(None, top_k=prune.MAX_TOPK + 1, n_experts=8)
