"""The torch training models and the numpy reference compute the same function on the shipped files.

A rope layout, YaRN mscale, softmax-scale or routing mismatch between training and inference would
silently destroy acceptance; in float64 the two agree to ~1e-12, so these tolerances catch it.
"""
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddtree.data import tiny_model_dirs  # noqa: E402
from ddtree.model.checkpoint import DrafterCheckpoint  # noqa: E402
from ddtree.reference.drafter import Drafter  # noqa: E402
from ddtree.reference.model import Target, causal_visible  # noqa: E402
from ddtree.training.export import load_drafter, load_target  # noqa: E402

TEXT = b"    def get(self, block=True, timeout=None):\n        with self.not_empty:\n            if not block:\n"


@pytest.fixture(scope="module")
def models():
    target_dir, drafter_dir = tiny_model_dirs()
    ref = Target.from_checkpoint(target_dir)
    return ref, Drafter.from_checkpoint(drafter_dir, ref), load_target(target_dir).double(), load_drafter(drafter_dir).double()


def reference_run(ref, ids, taps):
    return ref.forward(ids, np.arange(len(ids)), causal_visible(0, len(ids)), ref.new_cache(), taps=taps)


def test_target_logits_and_taps_match(models):
    ref, refd, t, _ = models
    ids = np.array(list(TEXT))
    taps = refd.config.target_layer_ids
    logits, tapped = reference_run(ref, ids, taps)
    with torch.no_grad():
        t_logits, t_tapped = t(torch.from_numpy(ids)[None], taps=taps)
    np.testing.assert_allclose(t_logits[0].numpy(), logits, rtol=0, atol=1e-9 * np.abs(logits).max())
    for L in taps:
        np.testing.assert_allclose(t_tapped[L][0].numpy(), tapped[L], rtol=0, atol=1e-9 * np.abs(tapped[L]).max())
    assert np.abs(logits).max() > 1.0                # a trained model, not a near-zero function


def test_drafter_training_form_matches_incremental_reference(models):
    """Reference: two drafting calls with a growing context cache (as DDTree runs it). Torch: both
    blocks at once, each seeing only the context before its anchor (as training runs it)."""
    ref, refd, t, d = models
    ids = np.array(list(TEXT))
    c = refd.config
    _, tapped = reference_run(ref, ids, c.target_layer_ids)
    ctx = np.concatenate([tapped[L] for L in c.target_layer_ids], axis=1)      # [S, K*H]
    b, anchors = c.block_size, (40, 71)
    blocks = [np.array([ids[a]] + [c.mask_token_id] * (b - 1)) for a in anchors]
    cache = refd.new_cache()
    ref_logits = [refd.forward(blocks[0], np.arange(anchors[0], anchors[0] + b), ctx[: anchors[0]], cache)]
    cache.truncate(anchors[0])
    ref_logits.append(refd.forward(blocks[1], np.arange(anchors[1], anchors[1] + b), ctx[anchors[0]: anchors[1]], cache))
    embed = t.model.embed_tokens.weight
    with torch.no_grad():
        hidden = d(torch.from_numpy(ctx)[None], embed[torch.from_numpy(np.stack(blocks))][None],
                   torch.tensor([anchors]))                                     # [1, 2, b, H]
        t_logits = hidden[0, :, 1:] @ t.lm_head.weight.T                        # [2, b-1, V]
    for j in range(2):
        np.testing.assert_allclose(t_logits[j].numpy(), ref_logits[j], rtol=0,
                                   atol=1e-9 * np.abs(ref_logits[j]).max())
    # the check is sensitive: a different YaRN attention factor moves the logits far past it
    ck = DrafterCheckpoint(tiny_model_dirs()[1])
    other = Drafter(replace(c, attention_factor=c.attention_factor * 1.1386),
                    {n: ck.get_f32(n) for n in ck.specs}, ref.embed, ref.lm_head)
    moved = other.forward(blocks[0], np.arange(anchors[0], anchors[0] + b), ctx[: anchors[0]], other.new_cache())
    assert np.abs(moved - ref_logits[0]).max() > 1e-3
