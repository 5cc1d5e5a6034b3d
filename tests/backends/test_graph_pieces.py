"""The pieces around the graphs: the cross-rank AllReduce, weight binding by layer, node attribute
checks, plugin fields, the plugins' runners where a kernel or a collective is missing, the TensorRT-RTX parser
link and the error of --trt without the wheels. None of it needs TensorRT."""
import sys
import threading

import numpy as np
import onnx
import pytest

from ddtree.backends.onnx_graph import GraphBuilder
from ddtree.backends.tensorrt.fields import attrs_from_fields, field_arrays, node_attrs
from ddtree.backends.tensorrt.kernels import MissingKernelError, node_runner, register_rank_collective
from ddtree.backends.tensorrt.loader import TrtUnavailable, ensure_parser_link
from ddtree.builder.build import build_engine
from ddtree.builder.output_dir import BuildError
from ddtree.description.layers import layer_weight_name
from ddtree.description.nodes import NODES, node_spec
from ddtree.parallel.collectives import RankGroup
from ddtree.plugins.compile import KERNEL_DIR
from ddtree.runtime.graph_ranks import GraphRanks


def test_rank_group_sums_in_rank_order_on_every_rank():
    group, parts = RankGroup(3), [np.array([1e16, 1.0]), np.array([-1e16, 1.0]), np.array([1.0, 1.0])]
    results = [None] * 3

    def rank(r):
        results[r] = group.all_reduce(r, parts[r])
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = (parts[0] + parts[1]) + parts[2]                  # rank order: ((1e16 - 1e16) + 1) = 1, not 0
    for got in results:
        np.testing.assert_array_equal(got, want)


def test_a_failing_rank_releases_the_others(engine):
    g = GraphRanks.from_engine(engine("tiny", 2), act="float64")
    del g.weights[1]["model.embed_tokens.weight"]          # rank 1 fails; rank 0 waits in its AllReduce
    with pytest.raises(KeyError, match="model.embed_tokens.weight.*rank1"):
        g.run("embed", {"ids": np.array([1, 2], np.int32)})
    g.weights[1]["model.embed_tokens.weight"] = g.weights[0]["model.embed_tokens.weight"]
    out = g.run("embed", {"ids": np.array([1, 2], np.int32)})          # the group is usable again
    assert out[0]["h"].shape == (2, g.cfg.hidden_size)


def test_layer_weight_names():
    assert layer_weight_name("model.layers.1.mlp.gate.weight", "model.layers.1.", 7) == "model.layers.7.mlp.gate.weight"
    assert layer_weight_name("drafter.layers.0.self_attn.q_proj.weight", "drafter.layers.0.", 3) == \
        "drafter.layers.3.self_attn.q_proj.weight"
    assert layer_weight_name("lm_head.weight", "model.layers.1.", 7) == "lm_head.weight"
    assert layer_weight_name("model.layers.11.x", "model.layers.1.", 7) == "model.layers.11.x"


def test_node_attributes_are_checked():
    g = GraphBuilder("t", "float64")
    x = g.input("x", onnx.TensorProto.DOUBLE, ["q", 4])
    with pytest.raises(ValueError, match=r"missing \['world_size'\]"):
        g.node("AllReduce", [x], {"rank": 0}, [("y", onnx.TensorProto.DOUBLE, ["q", 4])], "ar")
    with pytest.raises(ValueError, match="budget=2.5 must be of kind int"):
        node_spec("TreeBuild").check_attrs({"rank": 0, "world_size": 1, "budget": 2.5}, "here")
    with pytest.raises(KeyError, match="Nope is not a ddtree node"):
        node_spec("Nope")


def test_fields_round_trip_every_exported_node(engine):
    """Node attributes -> the parser's field arrays -> attributes (floats are float32 values)."""
    g = GraphRanks.from_engine(engine("tiny", 2))
    seen = set()
    for graphs in g.graphs:
        for lg in graphs.values():
            for node in lg.model.graph.node:
                if node.domain != "ddtree":
                    continue
                spec, attrs = NODES[node.op_type], node_attrs(node)
                fields = [(name, arr) for name, arr, _ in field_arrays(spec, attrs)]
                assert attrs_from_fields(spec, fields, node.name) == attrs
                seen.add(node.op_type)
    assert seen == set(NODES)


# What each plugin launches, written out here rather than read from the node table under test:
# op -> (its kernel files under ddtree/plugins/kernels/, whether its enqueue launches them).
KERNELS = {"AllReduce": (("allreduce.cu",), True),        # world_size 1: a device copy; more: the registered collective
           "AllGather": ((), True),
           "MarlinMoE": (("moe.cu",), True),
           "Rope": (("layer_ops.cu",), True),
           "KvAppend": (("kv_cache.cu",), True),
           "KvCompact": (("kv_cache.cu",), True),
           "MlaTreeAttention": (("mla_attention.cu", "mla_decode.cu"), True),
           "DraftAttention": (("layer_ops.cu", "draft_attention.cu"), True),
           "VocabWinner": (("sample.cu",), True),
           "VocabTopK": (("tree_build.cu",), True),
           "TreeBuild": (("tree_build.cu",), True),
           "AcceptWalk": (("sample.cu",), True)}


def any_attrs(spec) -> dict:
    return {name: {"int": 1, "float": 1.0, "str": "yarn", "ints": [1]}[kind] for name, kind in spec.fields.items()}


def test_node_table_names_real_kernel_files_and_wires_exactly_the_launched_ops():
    assert {op: (s.kernel_files, s.wired) for op, s in NODES.items()} == KERNELS
    for op, spec in NODES.items():
        for name in spec.kernel_files:
            assert (KERNEL_DIR / name).is_file(), f"ddtree::{op}: kernel file {name} is not in {KERNEL_DIR}"
        if spec.wired:
            assert node_runner(spec, any_attrs(spec), device=0) is not None     # made without touching a GPU


@pytest.mark.parametrize("op", sorted(op for op, (_, wired) in KERNELS.items() if not wired) or ["none"])
def test_plugins_without_a_launcher_fail_naming_their_kernel(op):
    if op == "none":
        assert all(s.wired for s in NODES.values())
        return
    spec, files = NODES[op], KERNELS[op][0]
    with pytest.raises(MissingKernelError) as err:
        node_runner(spec, any_attrs(spec))
    msg = str(err.value)
    assert msg.startswith(f"ddtree::{op} plugin cannot run: ") and spec.kernel in msg
    assert msg.endswith("; plans that contain this node build, but do not execute")
    assert "its enqueue does not launch its CUDA kernel yet" in msg
    assert all(f"ddtree/plugins/kernels/{name}" in msg for name in files)


def test_collectives_without_a_registered_rank_collective_and_expert_parallel_moe_fail_clearly(monkeypatch):
    from ddtree.backends.tensorrt import kernels
    monkeypatch.setattr(kernels, "_COLLECTIVES", {})
    ar = node_runner(NODES["AllReduce"], {"rank": 0, "world_size": 2}, device=3)
    with pytest.raises(MissingKernelError, match=r"AllReduce plugin cannot run at world_size 2 on GPU 3: no rank "
                                                 r"collective is registered for it .*register_rank_collective"):
        ar.prepare([(4, 8)], ["bfloat16"], [(4, 8)], ["bfloat16"])
    register_rank_collective(3, object())
    ar.prepare([(4, 8)], ["bfloat16"], [(4, 8)], ["bfloat16"])          # found: no error
    node_runner(NODES["AllReduce"], {"rank": 0, "world_size": 1}, device=5).prepare([(4, 8)], ["bfloat16"],
                                                                                     [(4, 8)], ["bfloat16"])
    moe = NODES["MarlinMoE"]
    attrs = {"rank": 1, "world_size": 2, "hidden": 128, "inter": 512, "experts": 4, "n_routed_experts": 8,
             "expert_start": 4, "topk": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "group_size": 32}
    with pytest.raises(MissingKernelError, match="expert-parallel"):
        node_runner(moe, attrs, device=0).prepare([(1,)] * 8, ["bfloat16"] * 8, [(1,)], ["bfloat16"])


def test_parser_link_is_created_once_and_checked(tmp_path, capsys):
    (tmp_path / "libtensorrt_rtx.so.1").write_bytes(b"lib")
    link = ensure_parser_link(tmp_path)
    assert link.is_symlink() and link.resolve() == (tmp_path / "libtensorrt_rtx.so.1").resolve()
    assert "created" in capsys.readouterr().err
    ensure_parser_link(tmp_path)                                   # present: nothing to do, nothing said
    assert capsys.readouterr().err == ""
    link.unlink()
    (tmp_path / "other").write_bytes(b"x")
    link.symlink_to("other")
    with pytest.raises(TrtUnavailable, match="is not libtensorrt_rtx.so.1"):
        ensure_parser_link(tmp_path)
    with pytest.raises(TrtUnavailable, match="missing from the tensorrt-rtx-cu13-libs wheel"):
        ensure_parser_link(tmp_path / "nowhere")


def test_trt_without_the_wheels_says_what_to_install(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_rtx_libs", None)             # import fails as if not installed
    with pytest.raises(BuildError, match=r"--trt: TensorRT-RTX is not installed: pip install -e '\.\[trt\]'"):
        build_engine(*checkpoint("tiny"), 1, ["sm_120"], tmp_path / "e", trt=True)
    assert not (tmp_path / "e").exists()
