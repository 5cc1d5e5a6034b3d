"""The training script end to end at toy sizes (seconds), and its quantisation / balancing pieces."""
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddtree.model.checkpoint import Checkpoint, DrafterCheckpoint  # noqa: E402
from ddtree.model.int4 import dequantize_int4, quantize_int4  # noqa: E402
from ddtree.training import train  # noqa: E402
from ddtree.training.target_model import MoE, fake_quant  # noqa: E402

# 12 target / 6 drafter steps after a 2-step warm-up: enough for both losses to fall by well over a nat
# (measured: target 5.6 -> 3.5 train, 5.5 -> 3.3 held-out; drafter 5.2 -> 1.2), while with --lr 0
# (a broken optimizer) they stay at ln 512 = 6.2 within 0.1.
TOY = ["--target-steps", "12", "--warmup", "2", "--batch", "2", "--seq-len", "64", "--gen-seqs", "4",
       "--gen-batch", "4", "--prompt-min", "16", "--prompt-max", "24", "--drafter-steps", "6", "--anchors", "4",
       "--drafter-batch", "2", "--eval-every", "1", "--qat-frac", "0.5"]
FALL_NATS = 1.0


def test_training_runs_end_to_end(tmp_path):
    report = train.main(["--out", str(tmp_path), "--seed", "3", *TOY])
    ckpt, dckpt = Checkpoint(tmp_path / "target"), DrafterCheckpoint(tmp_path / "drafter")
    ckpt.verify()
    dckpt.verify()
    assert ckpt.is_int4("model.layers.1.mlp.experts.0.up_proj")
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["args"]["seed"] == 3 and len(log["target"]["history"]) == 12 and len(log["drafter"]["history"]) == 6
    train_nats = [h["train_nats"] for h in report["target"]["history"]]
    heldout = [h["heldout_nats"] for h in report["target"]["history"]]
    drafter = [h["loss"] for h in report["drafter"]["history"]]
    assert np.mean(train_nats[-3:]) < np.mean(train_nats[:3]) - FALL_NATS, train_nats      # batches vary: means
    assert heldout[-1] < heldout[0] - FALL_NATS, heldout                                   # fixed windows
    assert np.mean(drafter[-2:]) < drafter[0] - FALL_NATS, drafter


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
