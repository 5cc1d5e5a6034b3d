"""CPU tests of the tree pruning kernel (kernels/tree_prune.cu, plugins/tree_prune.py): it compiles for sm_90 and
sm_120 with the pip NVRTC, takes the horizon as a scalar argument after n_experts, its limits match the twin's
module (tree/prune.py) and the launcher refuses shapes and horizons past them by name. The kernel against its twin on a GPU: tests/plugins/test_tree_prune_gpu.py."""
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
    launcher = object.__new__(tp.TreePrune)                      # no GPU: run() checks before it launches
    for bad in (-1, prune.MAX_HORIZON + 1, 2.0):
        with pytest.raises(prune.PruneError, match="horizon"):
            launcher.run(0, 0, 0, 0, 0, 0, 0, 5, bad)


def test_kernel_takes_the_horizon_as_a_scalar_argument():
    src = SOURCE.read_text()
    signature = re.search(r"tree_prune\((.*?)\)\s*\{", src, re.S).group(1)
    assert [a.split()[-1] for a in signature.split(",")][-4:] == ["q", "top_k", "n_experts", "horizon"]
    assert "(long long)expert_bytes[0] * (long long)horizon" in src          # the int64 product, as the twin's
    assert f"0 <= horizon <= {prune.MAX_HORIZON}" in src
