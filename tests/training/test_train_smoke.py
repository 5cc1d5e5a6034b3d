"""The training script end to end at toy sizes (seconds), and its quantisation / balancing pieces."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddtree.model.checkpoint import Checkpoint, DrafterCheckpoint  # noqa: E402
from ddtree.model.int4 import dequantize_int4, quantize_int4  # noqa: E402
from ddtree.training import train  # noqa: E402
from ddtree.training.target_model import MoE, fake_quant  # noqa: E402

TOY = ["--target-steps", "3", "--batch", "2", "--seq-len", "64", "--gen-seqs", "4", "--gen-batch", "4",
       "--prompt-min", "16", "--prompt-max", "24", "--drafter-steps", "3", "--anchors", "4",
       "--drafter-batch", "2", "--eval-every", "1", "--qat-frac", "0.5"]


def test_training_runs_end_to_end(tmp_path):
    report = train.main(["--out", str(tmp_path), "--seed", "3", *TOY])
    ckpt, dckpt = Checkpoint(tmp_path / "target"), DrafterCheckpoint(tmp_path / "drafter")
    ckpt.verify()
    dckpt.verify()
    assert ckpt.is_int4("model.layers.1.mlp.experts.0.up_proj")
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["args"]["seed"] == 3 and len(log["target"]["history"]) == 3 and len(log["drafter"]["history"]) == 3
    hist = report["target"]["history"]
    assert hist[-1]["train_nats"] < hist[0]["train_nats"] + 0.5 and np.isfinite(hist[-1]["heldout_nats"])


def test_fake_quant_is_the_exported_int4_grid():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = quantize_int4(w.numpy(), 32)
    np.testing.assert_array_equal(fake_quant(w, 32).numpy(), dequantize_int4(q, scale, 32))
    w.requires_grad_(True)
    fake_quant(w, 32).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.ones((64, 96), np.float32))   # straight through


def test_aux_free_bias_moves_toward_balance():
    cfg, _ = train.embedded_configs()
    moe = MoE(cfg)
    moe.load = torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6])
    moe.update_bias(0.01)
    bias = moe.gate.e_score_correction_bias
    assert bias[0] == -0.01 and bias[7] == -0.01 and (bias[1:7] == 0.01).all()
