"""The TP plan's divisibility errors, and the per-rank weight files against the checkpoint: every
dense tensor is exactly the plan's slice, and the repacked experts unpack (plugins/layout.py) to the
checkpoint's INT4 tensors, reassembled across ranks (tp) or gathered from their owners (ep)."""
from dataclasses import replace

import numpy as np
import pytest

from ddtree.builder.plan import PlanError, make_plan
from ddtree.builder.tensor_io import RankFileWriter, TensorReader
from ddtree.builder.weights import DRAFTER_PREFIX
from ddtree.description.opset import RankLayout
from ddtree.engine_dir import STORED, load_rank_tensors, read_engine_config
from ddtree.model.checkpoint import Checkpoint, DrafterCheckpoint
from ddtree.model.presets import get_preset
from ddtree.model.safetensors_io import CheckpointError, SafetensorsFile
from ddtree.model.tensors import TensorSpec, expert_name
from ddtree.plugins import layout


def rank_tensors(engine, tp):
    """rank -> {name: array as stored}."""
    files = read_engine_config(engine)["weight_files"]
    return [load_rank_tensors(engine, r, files, convert=STORED) for r in range(tp)]


@pytest.mark.parametrize("change,tp,message", [
    ({}, 3, "--tp 3: must be one of 1, 2, 4, 8"),
    ({}, 8, "num_attention_heads 4 is not divisible by 8"),
    ({"vocab_size": 514}, 4, "vocab_size 514 is not divisible by 4"),
    ({"num_attention_heads": 8, "moe_intermediate_size": 256}, 8,
     "moe_intermediate_size / tp = 256 / 8 32 is not divisible by 64"),
    ({"quant": None}, 2, "no quantization_config"),
])
def test_plan_errors_name_the_field_and_tp(change, tp, message):
    cfg, dcfg = get_preset("tiny")
    with pytest.raises(PlanError, match=message.replace("(", r"\(")):
        make_plan(replace(cfg, **change), dcfg, tp)


def test_plan_errors_for_the_drafter_and_expert_parallel():
    cfg, dcfg = get_preset("tiny")
    with pytest.raises(PlanError, match="drafter config.json: num_key_value_heads 2 is not divisible by 4"):
        make_plan(cfg, replace(dcfg, num_attention_heads=4, num_key_value_heads=2), 4)
    with pytest.raises(PlanError, match="n_routed_experts 12 is not divisible by 8.*--experts ep"):
        make_plan(replace(cfg, num_attention_heads=8, n_routed_experts=12, num_experts_per_tok=2), dcfg, 8, "ep")


@pytest.mark.parametrize("tp,mode", [(1, "tp"), (4, "tp"), (2, "ep")])
def test_plan_sizes_and_rank_layout(tp, mode):
    cfg, dcfg = get_preset("tiny")
    plan = make_plan(cfg, dcfg, tp, mode)
    d = plan.to_dict()
    for r in range(tp):
        lay = RankLayout.from_plan(d, r)
        assert (lay.vocab_start, lay.vocab_stop) == plan.vocab_range(r) == (r * 512 // tp, (r + 1) * 512 // tp)
        assert (lay.expert_start, lay.expert_stop) == plan.expert_range(r)
        assert lay.fc_stop - lay.fc_start == 2 * 128 // tp
    assert plan.moe_inter * (tp if mode == "tp" else 1) == 512
    assert plan.experts_per_rank * (tp if mode == "ep" else 1) == 8


@pytest.mark.parametrize("tp,mode", [(2, "tp"), (4, "tp"), (2, "ep")])
def test_rank_files_are_the_plans_slices(tiny_ckpt, engine_dir, tp, mode):
    engine = engine_dir(tp, mode)
    ranks = rank_tensors(engine, tp)
    ck, dk = Checkpoint(tiny_ckpt[0]), DrafterCheckpoint(tiny_ckpt[1])
    plan = make_plan(ck.config, dk.config, tp, mode)
    assert set(ranks[0]) == set(ranks[-1])
    for name in ranks[0]:
        if ".mlp.experts." in name:
            continue
        drafter = name.startswith(DRAFTER_PREFIX)
        src = name[len(DRAFTER_PREFIX):] if drafter else name
        full = (dk if drafter else ck).get(src)
        axis = plan.drafter_split(src) if drafter else plan.target_split(src)
        for r, tensors in enumerate(ranks):
            want = full if axis is None else np.split(full, tp, axis=axis)[r]
            np.testing.assert_array_equal(tensors[name], want, err_msg=f"{name} rank {r}")
    # every routed expert, unpacked from the kernel layout, is the checkpoint's expert
    cfg = ck.config
    for L in cfg.moe_layers:
        p = f"model.layers.{L}.mlp.experts."
        for e in range(cfg.n_routed_experts):
            pieces = []
            for r, tensors in enumerate(ranks):
                lo, hi = plan.expert_range(r)
                if lo <= e < hi:
                    packed = {key: tensors[p + suffix][e - lo] for key, suffix in
                              [("gate_up", "gate_up.words"), ("gate_up_scale", "gate_up.scales"),
                               ("down", "down.words"), ("down_scale", "down.scales")]}
                    pieces.append(layout.unrepack_expert(packed))
            assert len(pieces) == (tp if mode == "tp" else 1)
            for proj, axis in (("gate", 0), ("up", 0), ("down", 1)):
                m = expert_name(L, e, f"{proj}_proj")
                np.testing.assert_array_equal(np.concatenate([pc[proj][0] for pc in pieces], axis=axis),
                                              ck.get(f"{m}.weight_packed"), err_msg=m)
                np.testing.assert_array_equal(np.concatenate([pc[proj][1] for pc in pieces], axis=axis),
                                              ck.get(f"{m}.weight_scale"), err_msg=m)


def test_tensor_reader_rows_match_checkpoint(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt[0])
    rd = TensorReader(ck)
    head = ck.get("lm_head.weight")
    np.testing.assert_array_equal(rd.rows("lm_head.weight", 100, 357), head[100:357])
    np.testing.assert_array_equal(rd.read("model.layers.1.mlp.gate.e_score_correction_bias"),
                                  ck.get("model.layers.1.mlp.gate.e_score_correction_bias"))
    with pytest.raises(CheckpointError, match="rows \\[500, 600\\) of tensor 'language_model.lm_head.weight'"):
        rd.rows("lm_head.weight", 500, 600)
    rd.close()


def test_rank_file_writer_checks_every_row(tmp_path):
    specs = {"a": TensorSpec("F32", (4, 3)), "b": TensorSpec("BF16", (2,))}
    w = RankFileWriter(tmp_path / "x.safetensors", specs)
    w.write("a", 2, np.ones((2, 3), np.float32))
    with pytest.raises(CheckpointError, match="rows of tensor 'a' in \\[3, 4\\) were already written"):
        w.write("a", 3, np.ones((1, 3), np.float32))
    with pytest.raises(CheckpointError, match="tensor 'b' is BF16 \\[2\\]; got a row block float32"):
        w.write("b", 0, np.ones(2, np.float32))
    w.write("b", 0, np.array([1, 2], np.uint16))
    with pytest.raises(CheckpointError, match="tensors not fully written: \\['a'\\]"):
        w.close()
    assert not (tmp_path / "x.safetensors").exists()
    w = RankFileWriter(tmp_path / "y.safetensors", specs)
    w.write("a", 0, np.arange(12, dtype=np.float32).reshape(4, 3))
    w.write("b", 0, np.array([1, 2], np.uint16))
    w.close()
    f = SafetensorsFile(tmp_path / "y.safetensors")
    np.testing.assert_array_equal(f.read("a"), np.arange(12, dtype=np.float32).reshape(4, 3))
    from safetensors import safe_open  # the package reads our files too
    with safe_open(str(tmp_path / "y.safetensors"), framework="numpy") as g:
        np.testing.assert_array_equal(g.get_tensor("a"), f.read("a"))
