"""A synthetic checkpoint of > 2 GB for the builder's memory bound, written fast.

Real layout and formats (model/synthetic.write_target / write_drafter), but the bulk tensors (the
1 GiB embed_tokens and lm_head, the INT4 experts) are filled with cheap random bits instead of the
tame random weights of `random_blocks`: the memory test needs bytes to stream, not a usable model.
A single 1 GiB tensor means a builder that reads any tensor whole breaks the 1 GB bound.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ddtree.model.config import DrafterConfig, KimiConfig
from ddtree.model.presets import get_preset
from ddtree.model.synthetic import random_blocks, write_drafter, write_target

BLOCK_ROWS_BYTES = 32 << 20


def big_configs() -> tuple[KimiConfig, DrafterConfig]:
    t, d = get_preset("tiny")
    t = replace(t, hidden_size=4096, vocab_size=131072, num_hidden_layers=3, moe_intermediate_size=512,
                n_routed_experts=16, num_experts_per_tok=2, intermediate_size=512)
    d = replace(d, hidden_size=4096, vocab_size=131072, num_hidden_layers=1, intermediate_size=512,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, target_layer_ids=(1,),
                num_target_layers=3)
    return t, d


def fast_blocks(seed: int, cfg):
    tame = random_blocks(seed, cfg)

    def blocks(name, spec):
        bulk = name.endswith((".weight_packed", "embed_tokens.weight", "lm_head.weight"))
        if not bulk:
            yield from tame(name, spec)
            return
        rng = np.random.default_rng(seed)
        rows = max(1, BLOCK_ROWS_BYTES // (spec.nbytes // spec.shape[0]))
        for r0 in range(0, spec.shape[0], rows):
            shape = (min(rows, spec.shape[0] - r0), *spec.shape[1:])
            if spec.dtype == "I32":                  # any word is 8 valid nibbles
                yield rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(np.int32)
            else:                                    # bf16 bits of magnitudes in [2^-8, 2^-1), random sign
                yield (rng.integers(0x3B80, 0x3F00, size=shape, dtype=np.uint16)
                       | (rng.integers(0, 2, size=shape, dtype=np.uint16) << 15))

    return blocks


def write_big_checkpoint(root, seed: int = 0):
    t, d = big_configs()
    target = write_target(root / "target", t, fast_blocks(seed, t), shard_mb=1536)
    drafter = write_drafter(root / "drafter", d, fast_blocks(seed + 1, d))
    return target, drafter
