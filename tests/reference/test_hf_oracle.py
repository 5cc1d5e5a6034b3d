"""The independent oracle: Hugging Face transformers' DeepSeek-V3 implementation on the same
synthetic checkpoint must give the logits (and layer outputs) of our reference, for a prompt and
for a few decode steps through each side's own KV cache.

Nothing here goes through ddtree's checkpoint reader, INT4 code or config parser on the HF side:
the shards are read with `safetensors.torch`, INT4 experts are unpacked with torch ops written from
the compressed-tensors description (docs/kimi-k2.md 4.2), and HF parses config.json itself.

Matching conventions (both documented in docs/kimi-k2.md 5.1 / ddtree/reference/mla.py): HF's q_a and
kv_a RMSNorms use the module default eps 1e-6, our reference (like vLLM) uses config.rms_norm_eps;
the HF modules are set to config.rms_norm_eps here. HF runs in float64 but keeps RMSNorm, the
router, the attention softmax and the RoPE table in float32, so agreement is at the float32 level.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from ddtree.reference.model import Target, causal_visible

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import safe_open  # noqa: E402  (torch needed)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

# Tolerances relative to the largest |value|. Measured HF-vs-reference: 3e-7 near position 0, where
# HF's float32 norms/router/softmax dominate; 5e-4 around position 70000, where HF's float32 RoPE
# angles (ulp of p * phi) dominate. Real bugs (rope pairing, YaRN ramp, mscale, routing) move logits
# by 0.1 .. 1, and a latent-norm eps of 1e-6 instead of 1e-5 by 1e-5 (caught near position 0).
RTOL_NEAR = 3e-6
RTOL_FAR = 5e-3
PROMPT = np.array([256, 84, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110])  # BOS "The quick brown"
DECODE_STEPS = 4


def hf_config(ckpt_dir: Path):
    raw = json.loads((ckpt_dir / "config.json").read_text())
    text = dict(raw.get("text_config", raw))
    text.pop("quantization_config", None)        # experts are dequantised below
    # eager experts and attention: the plain loops, which also run in float64 (grouped_mm does not)
    return transformers.DeepseekV3Config(**text, experts_implementation="eager", attn_implementation="eager")


def dequantize_int4_torch(packed, scale, shape, group):
    """compressed-tensors pack-quantized: nibble i of int32 word j is column 8j+i, value nibble - 8."""
    out_dim, in_dim = (int(v) for v in shape)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    nibbles = (packed.to(torch.int64)[:, :, None] >> shifts) & 0xF          # [out, in/8, 8]
    q = nibbles.reshape(out_dim, -1)[:, :in_dim] - 8
    s = scale.to(torch.float64).repeat_interleave(group, dim=1)[:, :in_dim]
    return q.to(torch.float64) * s


def read_checkpoint(ckpt_dir: Path, group: int) -> dict:
    """Canonical name -> float64 tensor, INT4 experts dequantised."""
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())["weight_map"]
    raw = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(ckpt_dir / shard), framework="pt") as f:
            for stored in f.keys():
                raw[stored.removeprefix("language_model.")] = f.get_tensor(stored)
    out = {}
    for name, t in raw.items():
        if name.endswith(".weight_packed"):
            m = name[: -len(".weight_packed")]
            out[f"{m}.weight"] = dequantize_int4_torch(t, raw[f"{m}.weight_scale"], raw[f"{m}.weight_shape"], group)
        elif not name.endswith((".weight_scale", ".weight_shape")):
            out[name] = t.to(torch.float64)
    return out


def hf_model(ckpt_dir: Path):
    cfg = hf_config(ckpt_dir)
    group = json.loads((ckpt_dir / "config.json").read_text())
    group = group.get("text_config", group)["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    w = read_checkpoint(ckpt_dir, group)
    model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.float64).eval()
    state = {}
    for name in model.state_dict():
        if name.endswith("mlp.experts.gate_up_proj"):          # HF fuses experts: [E, 2I, H] gate then up
            p = name[: -len("gate_up_proj")]
            state[name] = torch.stack([torch.cat([w[f"{p}{e}.gate_proj.weight"], w[f"{p}{e}.up_proj.weight"]])
                                       for e in range(cfg.n_routed_experts)])
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            state[name] = torch.stack([w[f"{p}{e}.down_proj.weight"] for e in range(cfg.n_routed_experts)])
        else:
            state[name] = w[name]
    model.load_state_dict(state, strict=True)
    for layer in model.model.layers:                            # match the reference's latent-norm eps
        layer.self_attn.q_a_layernorm.variance_epsilon = cfg.rms_norm_eps
        layer.self_attn.kv_a_layernorm.variance_epsilon = cfg.rms_norm_eps
    return model


@pytest.fixture(scope="module")
def models(synth_dir):
    """(preset, layout) -> (our Target, HF model), built once per module."""
    made = {}

    def get(preset, layout):
        if (preset, layout) not in made:
            ckpt = synth_dir(preset, layout)
            made[preset, layout] = Target.from_checkpoint(ckpt), hf_model(ckpt)
        return made[preset, layout]

    return get


@pytest.mark.parametrize("preset", ["tiny", "small-mla"])
def test_rope_tables_and_scales_match_hf(models, preset):
    """YaRN frequencies (HF computes them in float32), cos/sin magnitude and the softmax scale."""
    ours, theirs = models(preset, "k2.6")
    rotary = theirs.model.rotary_emb
    np.testing.assert_allclose(ours.mla.rope.freqs, rotary.inv_freq.double().numpy(), rtol=1e-6)
    assert ours.mla.rope.magnitude == pytest.approx(rotary.attention_scaling, rel=1e-15)
    for layer in theirs.model.layers:
        assert ours.mla.scale == pytest.approx(layer.self_attn.scaling, rel=1e-15)


@pytest.mark.parametrize("preset, layout, start, rtol", [
    ("tiny", "k2.6", 0, RTOL_NEAR),
    ("tiny-grouped", "k2-thinking", 0, RTOL_NEAR),   # n_group > 1 routing, flat config layout
    ("small-mla", "k2.6", 0, RTOL_NEAR),             # real MLA head dims and the real YaRN (factor 64)
    ("small-mla", "k2.6", 70000, RTOL_FAR),          # far past original_max_position_embeddings
])
def test_reference_matches_hf_deepseek_v3(models, preset, layout, start, rtol):
    ours, theirs = models(preset, layout)

    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())
    n_layers = ours.config.num_hidden_layers
    taps = tuple(range(n_layers - 1))      # HF replaces hidden_states[-1] with the final-normed state

    cache = ours.new_cache()
    pos = start + np.arange(len(PROMPT))
    logits, tapped = ours.forward(PROMPT, pos, causal_visible(0, len(PROMPT)), cache, taps)
    with torch.no_grad():
        out = theirs(input_ids=torch.tensor(PROMPT[None]), position_ids=torch.tensor(pos[None]),
                     use_cache=True, output_hidden_states=True)
    close(logits, out.logits[0].numpy())
    for L in taps:
        close(tapped[L], out.hidden_states[L + 1][0].numpy())

    hf_cache, next_pos = out.cache, int(pos[-1]) + 1
    token = int(np.argmax(logits[-1]))
    for _ in range(DECODE_STEPS):
        logits, _ = ours.forward(np.array([token]), np.array([next_pos]), causal_visible(cache.length, 1), cache)
        with torch.no_grad():
            out = theirs(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[next_pos]]),
                         cache=hf_cache, use_cache=True)
        close(logits, out.logits[0].numpy())
        hf_cache, next_pos, token = out.cache, next_pos + 1, int(np.argmax(logits[-1]))
