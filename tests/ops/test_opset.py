"""Every backend implements the whole op set, with the op set's signatures; the cuda backend's ops are
stubs that say which launcher will back them (nothing falls back silently)."""
import inspect

import pytest

from ddtree.ops.cuda_backend import LAUNCHERS, CudaOps
from ddtree.ops.meter import MeterOps
from ddtree.ops.numpy_backend import NumpyOps
from ddtree.ops.onnx_backend import OnnxOps
from ddtree.ops.opset import OP_NAMES, Ops, RankLayout

LAY = RankLayout(0, 1, 0, 256, 0, 8, 0, 64)


def test_the_op_set_has_the_ops_the_layers_use():
    assert {"linear", "all_reduce_add_rms_norm", "rope", "kv_append", "mla_absorb_q", "mla_tree_attention", "mla_absorb_out",
            "moe", "draft_attention", "all_reduce", "vocab_winner", "vocab_topk", "tree_build", "accept_walk"} \
        <= set(OP_NAMES)


@pytest.mark.parametrize("backend", [NumpyOps, OnnxOps, MeterOps, CudaOps])
def test_every_backend_implements_every_op_with_its_signature(backend):
    assert not getattr(backend, "__abstractmethods__", None)
    for name in OP_NAMES:
        assert getattr(backend, name) is not getattr(Ops, name), f"{backend.__name__}.{name} is not implemented"
        want = list(inspect.signature(getattr(Ops, name)).parameters)
        assert list(inspect.signature(getattr(backend, name)).parameters) == want, f"{backend.__name__}.{name}"


def test_cuda_ops_name_their_launcher_until_they_exist():
    ops = CudaOps(gpu=None, lay=LAY)
    with pytest.raises(NotImplementedError, match=r"op 'mla_tree_attention' .*plugins/mla_attention.py"):
        ops.mla_tree_attention(None, None, None, None, None, None)
    with pytest.raises(NotImplementedError, match=r"op 'rope' .*plugins/layer_ops.py LayerOps.rope_interleaved"):
        ops.rope(None, None, None)
    assert set(LAUNCHERS) == set(OP_NAMES)
