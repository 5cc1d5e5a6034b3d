"""The shipped tiny model: loads through the real readers, has the Kimi K2 structure, INT4 experts unpack."""
import json

import numpy as np
import pytest

from ddtree.data import DATA_DIR, HELDOUT_PROMPTS, TINY_DIR, tiny_model_dirs
from ddtree.model.checkpoint import Checkpoint, DrafterCheckpoint
from ddtree.model.int4 import dequantize_int4, unpack_int4
from ddtree.model.tokenizer import ByteTokenizer, load_tokenizer
from ddtree.training.corpus import load_prompts


@pytest.fixture(scope="module")
def shipped():
    target_dir, drafter_dir = tiny_model_dirs()
    return Checkpoint(target_dir), DrafterCheckpoint(drafter_dir)


def test_kimi_structure_and_formats(shipped):
    ckpt, dckpt = shipped
    ckpt.verify()                      # every tensor the config implies, right dtype and shape
    dckpt.verify()
    c = ckpt.config
    assert c.layout == "k2.6" and c.tokenizer == "bytes" and c.vocab_size % 64 == 0
    assert c.first_k_dense_replace == 1 and c.num_hidden_layers >= 3
    assert c.n_routed_experts >= 8 and c.num_experts_per_tok == 2 and c.n_shared_experts == 1
    assert c.scoring_func == "sigmoid" and c.topk_method == "noaux_tc" and c.rope.type == "yarn"
    assert c.qk_nope_head_dim > 0 and c.qk_rope_head_dim > 0 and c.quant.group_size == 32
    raw = json.loads((ckpt.path / "config.json").read_text())
    assert "text_config" in raw and all(n.startswith("language_model.") for n in
                                        json.loads((ckpt.path / "model.safetensors.index.json").read_text())["weight_map"])
    dckpt.config.check_target(c)
    assert isinstance(load_tokenizer(ckpt.path, c), ByteTokenizer)
    # the correction bias was trained (aux-loss-free balancing moved it away from zero)
    assert np.abs(ckpt.get("model.layers.1.mlp.gate.e_score_correction_bias")).max() > 0


def test_int4_experts_unpack(shipped):
    ckpt, _ = shipped
    c = ckpt.config
    for L in c.moe_layers:
        for e in range(c.n_routed_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                m = f"model.layers.{L}.mlp.experts.{e}.{proj}"
                assert ckpt.is_int4(m) and not ckpt.has(f"{m}.weight")
                shape = ckpt.get(f"{m}.weight_shape")
                q = unpack_int4(ckpt.get(f"{m}.weight_packed"), shape)
                assert q.min() >= -7 and q.max() <= 7            # 15 levels, like the QAT checkpoints
                assert len(np.unique(q)) > 8                       # a real weight, not a constant
                w = ckpt.dense_weight(m)
                np.testing.assert_array_equal(w, dequantize_int4(q, ckpt.get(f"{m}.weight_scale"), 32))
    assert not ckpt.is_int4("model.layers.0.mlp.gate_proj")       # dense layer 0 and attention stay BF16
    assert ckpt.get("model.layers.1.self_attn.q_b_proj.weight").dtype == np.uint16


def test_package_files_small_and_present():
    files = [p for p in TINY_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 20 * 2 ** 20
    prompts = load_prompts(HELDOUT_PROMPTS)
    assert len(prompts) >= 10 and all(p["text"].endswith(":\n") for p in prompts)
    assert (DATA_DIR / "corpus.json").is_file()
