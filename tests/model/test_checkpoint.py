"""Synthetic write -> lazy read round trips in both layouts, and every bad-checkpoint error."""
import json
import struct
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from ddtree.cli import main
from ddtree.model.checkpoint import Checkpoint, DrafterCheckpoint
from ddtree.model.int4 import dequantize_packed
from ddtree.model.presets import get_preset
from ddtree.model.safetensors_io import CheckpointError, write_safetensors
from ddtree.model.synthetic import given_blocks, random_blocks, synth, write_target
from ddtree.model.tensors import TensorSpec, drafter_tensor_specs, target_tensor_specs


def _expected(source, specs):
    return {n: np.concatenate(list(source(n, s))) if len(s.shape) > 1 else next(source(n, s))
            for n, s in specs.items()}


@pytest.mark.parametrize("layout", ["k2.6", "k2-thinking"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-grouped"])
def test_synth_round_trip(tmp_path, layout, preset):
    target, drafter = synth(tmp_path, preset, seed=7, layout=layout, shard_mb=0.5)
    cfg, dcfg = get_preset(preset)
    ck = Checkpoint(target)
    assert ck.config.layout == layout and ck.config.n_routed_experts == cfg.n_routed_experts
    index = json.loads((target / "model.safetensors.index.json").read_text())
    stored = list(index["weight_map"])
    prefix = "language_model." if layout == "k2.6" else ""
    assert all(n.startswith(prefix + "model.") or n == prefix + "lm_head.weight" for n in stored)
    assert len({*index["weight_map"].values()}) > 1, "shard_mb should have split the checkpoint"
    ck.verify()
    want = _expected(random_blocks(7, cfg), target_tensor_specs(cfg))
    assert sorted(ck.names()) == sorted(want)
    for name, arr in want.items():
        got = ck.get(name)
        assert got.dtype == arr.dtype and np.array_equal(got, arr), name
    dk = DrafterCheckpoint(drafter)
    dk.verify()
    dwant = _expected(random_blocks(8, dcfg), drafter_tensor_specs(dcfg))
    assert sorted(dk.names()) == sorted(dwant)
    for name, arr in dwant.items():
        assert np.array_equal(dk.get(name), arr), name


def test_int4_experts_dequantize_through_reader(tmp_path):
    target, _ = synth(tmp_path, "tiny", seed=3)
    ck = Checkpoint(target)
    m = "model.layers.2.mlp.experts.5.down_proj"
    assert ck.is_int4(m) and not ck.is_int4("model.layers.2.self_attn.o_proj")
    shape = ck.get(m + ".weight_shape")
    assert shape.tolist() == [ck.config.hidden_size, ck.config.moe_intermediate_size]
    w = ck.dense_weight(m)
    ref = dequantize_packed(ck.get(m + ".weight_packed"), ck.get(m + ".weight_scale"), shape, 32)
    assert w.shape == (128, 512) and np.array_equal(w, ref)
    # scaled so that a linear keeps unit variance (std(W) ~ 1/sqrt(fan_in))
    assert 0.7 < w.std() * np.sqrt(512) < 1.3


def test_given_weights_and_i64_weight_shape(tmp_path):
    cfg, _ = get_preset("tiny")
    specs = target_tensor_specs(cfg, "I64")
    given = _expected(random_blocks(1, cfg), specs)
    write_target(tmp_path / "t", cfg, given_blocks(given, "test"), "k2-thinking", shape_dtype="I64")
    ck = Checkpoint(tmp_path / "t")
    ck.verify()
    assert ck.get("model.layers.1.mlp.experts.0.up_proj.weight_shape").dtype == np.int64
    bad = dict(given, **{"model.norm.weight": given["model.norm.weight"][:-1]})
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        write_target(tmp_path / "u", cfg, given_blocks(bad, "test"), shape_dtype="I64")


def test_vision_tensors_skipped(tmp_path):
    target, _ = synth(tmp_path, "tiny")
    idx_path = target / "model.safetensors.index.json"
    index = json.loads(idx_path.read_text())
    write_safetensors(target / "vision.safetensors", {"vision_tower.patch.weight": TensorSpec("BF16", (4, 4))},
                      [("vision_tower.patch.weight", np.zeros((4, 4), np.uint16))])
    index["weight_map"]["vision_tower.patch.weight"] = "vision.safetensors"
    idx_path.write_text(json.dumps(index))
    assert not any(n.startswith("vision") for n in Checkpoint(target).names())


# ------------------------------------------------------------------------------------------------
# bad checkpoints: each error names the shard and the tensor

@pytest.fixture
def ckdir(tmp_path):
    target, _ = synth(tmp_path, "tiny", shard_mb=0.5)
    return target


def _shard_of(ckdir, stored):
    return ckdir / json.loads((ckdir / "model.safetensors.index.json").read_text())["weight_map"][stored]


def test_missing_shard_file(ckdir):
    shard = _shard_of(ckdir, "language_model.lm_head.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: shard file not found"):
        Checkpoint(ckdir).get("lm_head.weight")


def test_tensor_absent_from_index(ckdir):
    idx = ckdir / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    del index["weight_map"]["language_model.model.norm.weight"]
    idx.write_text(json.dumps(index))
    ck = Checkpoint(ckdir)
    with pytest.raises(CheckpointError, match="'model.norm.weight' is absent from the index"):
        ck.get("model.norm.weight")
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        ck.verify()


def test_index_names_tensor_its_shard_lacks(ckdir):
    idx = ckdir / "model.safetensors.index.json"
    index = json.loads(idx.read_text())
    wm = index["weight_map"]
    other = next(f for f in sorted(set(wm.values())) if f != wm["language_model.model.norm.weight"])
    wm["language_model.model.norm.weight"] = other
    idx.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{other}: the index places tensor 'language_model.model.norm.weight'"):
        Checkpoint(ckdir).get("model.norm.weight")


def test_wrong_shape_or_dtype(ckdir):
    cfg = json.loads((ckdir / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 256      # the file's tensors are now the wrong shape
    (ckdir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model-\d+-of-\d+.safetensors: tensor 'language_model.model.norm.weight' "
                                              r"is BF16 \[128\], the config expects BF16 \[256\]"):
        Checkpoint(ckdir).get("model.norm.weight")


def test_truncated_file(ckdir):
    shard = _shard_of(ckdir, "language_model.lm_head.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated file: tensor '.*' ends at byte"):
        Checkpoint(ckdir).get("lm_head.weight")


def test_corrupt_header(ckdir):
    shard = _shard_of(ckdir, "language_model.lm_head.weight")
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff{{{"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name}: corrupt safetensors header"):
        Checkpoint(ckdir).get("lm_head.weight")
    shard.write_bytes(struct.pack("<Q", 1 << 40) + bytes(data[8:]))
    with pytest.raises(CheckpointError, match=f"{shard.name}: corrupt safetensors header"):
        Checkpoint(ckdir).get("lm_head.weight")


def test_files_load_with_the_safetensors_package(ckdir):
    from safetensors import safe_open
    shard = _shard_of(ckdir, "language_model.model.layers.1.mlp.gate.e_score_correction_bias")
    ck = Checkpoint(ckdir)
    with safe_open(str(shard), framework="numpy") as f:
        name = "language_model.model.layers.1.mlp.gate.e_score_correction_bias"
        assert np.array_equal(f.get_tensor(name), ck.get("model.layers.1.mlp.gate.e_score_correction_bias"))


def test_one_tensor_from_a_1gb_shard_keeps_rss_low(tmp_path):
    path = tmp_path / "big.safetensors"
    rows, cols = 1024, 1 << 19            # 1024 x 512K uint16 = 1 GiB
    specs = {"big": TensorSpec("BF16", (rows, cols)), "small": TensorSpec("F32", (16,))}
    block = np.full((64, cols), 0x3F80, np.uint16)
    chunks = [("big", block)] * (rows // 64) + [("small", np.arange(16, dtype=np.float32))]
    write_safetensors(path, specs, chunks)
    assert path.stat().st_size > 1 << 30
    # VmHWM, not ru_maxrss: Linux carries the forking parent's (pytest's) high-water mark into
    # ru_maxrss across exec, while VmHWM belongs to the child's own address space
    code = ("from ddtree.model.safetensors_io import SafetensorsFile;"
            f"f = SafetensorsFile({str(path)!r}); a = f.read('small');"
            "assert a.tolist() == list(range(16));"
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])")
    hwm_kib = int(subprocess.check_output([sys.executable, "-c", code]).decode().strip())
    assert hwm_kib < 200 * 1024, f"peak RSS {hwm_kib / 1024:.0f} MiB reading 64 bytes of a 1 GiB shard"
    # and the check can fail: touching the whole big tensor does exceed the bound
    big = code.replace("a = f.read('small');", "a = f.read('small'); b = f.read('big');")
    assert int(subprocess.check_output([sys.executable, "-c", big]).decode().strip()) > 900 * 1024


def test_synth_cli_json(tmp_path):
    r = CliRunner().invoke(main, ["synth", "--preset", "tiny", "--out", str(tmp_path), "--json",
                                  "--layout", "k2-thinking", "--shard-mb", "1"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["preset"] == "tiny" and Checkpoint(out["target"]).config.layout == "k2-thinking"
    r = CliRunner().invoke(main, ["synth", "--preset", "tiny", "--out", str(tmp_path)])
    assert r.exit_code != 0 and "--force" in r.output
    r = CliRunner().invoke(main, ["synth", "--preset", "kimi-k2.6", "--out", str(tmp_path / "k")])
    assert r.exit_code != 0 and "--layers" in r.output


def test_tensors_are_read_by_the_safetensors_library(monkeypatch):
    """SafetensorsFile.read goes through safetensors.safe_open (numpy + ml_dtypes: BF16 as bfloat16), and hands
    BF16 on as its uint16 bits, equal to the file's bytes."""
    import glob

    import ml_dtypes
    import numpy as np
    import safetensors

    from ddtree.data import tiny_model_dirs
    from ddtree.model.safetensors_io import SafetensorsFile
    opened = []
    real = safetensors.safe_open

    def spy(path, framework, **kw):
        opened.append((path, framework))
        return real(path, framework=framework, **kw)

    import ddtree.model.safetensors_io as io
    monkeypatch.setattr(io, "safe_open", spy)                 # where the reader looks it up
    path = sorted(glob.glob(str(tiny_model_dirs()[0] / "*.safetensors")))[0]
    f = SafetensorsFile(path)
    name = next(n for n in f.keys() if f.entries[n].dtype == "BF16")
    got = f.read(name)
    assert opened == [(path, "numpy")] and got.dtype == np.uint16
    with real(path, framework="numpy") as lib:
        want = lib.get_tensor(name)
    assert want.dtype == ml_dtypes.bfloat16 and np.array_equal(got, want.view(np.uint16))
    b, e = f.offsets[name]
    raw = open(path, "rb").read()[f.data_start + b: f.data_start + e]
    assert got.tobytes() == raw
