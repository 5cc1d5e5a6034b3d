"""Torch models <-> checkpoint directories in the real formats.

Export goes through the synthetic-checkpoint writer (`write_target` / `write_drafter` with
`given_blocks`): BF16 everywhere (uint16 bits), the router bias F32, routed experts INT4
compressed-tensors group 32 (`int4.quantize_int4` + `pack_int4`, the same grid the QAT phase
trained onto). Import reads the files back through `Checkpoint` / `DrafterCheckpoint`, so a torch
model loaded this way holds exactly the values the numpy reference and every engine see.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ddtree.model.bf16 import f32_to_bf16
from ddtree.model.checkpoint import Checkpoint, DrafterCheckpoint
from ddtree.model.config import DrafterConfig, KimiConfig
from ddtree.model.int4 import pack_int4, quantize_int4
from ddtree.model.synthetic import given_blocks, write_drafter, write_target
from ddtree.model.tensors import drafter_tensor_specs, target_tensor_specs
from ddtree.reference.model import dense_weight_names
from ddtree.training.drafter_model import DFlashDrafter
from ddtree.training.target_model import KimiForCausalLM

INT4_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape")


def target_file_tensors(model: KimiForCausalLM) -> dict[str, np.ndarray]:
    """Canonical name -> array in file format for every tensor of the target's tensor table."""
    cfg = model.cfg
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    group = cfg.quant.group_size
    out = {}
    for name, spec in target_tensor_specs(cfg).items():
        if name.endswith(".weight_packed"):                    # one INT4 linear: all three tensors
            module = name[: -len(".weight_packed")]
            w = state[f"{module}.weight"]                                                # [out, in]
            q, scale = quantize_int4(w, group)
            out[name] = pack_int4(q)
            out[f"{module}.weight_scale"] = scale
            out[f"{module}.weight_shape"] = np.array(w.shape, dtype=np.int32)
        elif name.endswith(INT4_SUFFIXES):
            continue                                           # written with its weight_packed
        elif spec.dtype == "F32":
            out[name] = state[name].astype(np.float32)
        else:
            out[name] = f32_to_bf16(state[name])
    return out


def export_target(model: KimiForCausalLM, out_dir, shard_mb: float = 4.0) -> Path:
    return write_target(out_dir, model.cfg, given_blocks(target_file_tensors(model), "training export"),
                        layout="k2.6", shard_mb=shard_mb)


def export_drafter(model: DFlashDrafter, out_dir) -> Path:
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {name: f32_to_bf16(state[name]) for name in drafter_tensor_specs(model.c)}
    return write_drafter(out_dir, model.c, given_blocks(tensors, "training export"))


def load_target(path) -> KimiForCausalLM:
    """A torch target holding exactly the checkpoint's values (INT4 experts dequantised, bf16 -> f32)."""
    ckpt = Checkpoint(path)
    model = KimiForCausalLM(ckpt.config)
    state = {}
    for name, shape in dense_weight_names(ckpt.config).items():
        if name.endswith(".weight") and len(shape) == 2:
            state[name] = torch.from_numpy(ckpt.dense_weight(name[: -len(".weight")], np.float32).copy())
        else:
            state[name] = torch.from_numpy(ckpt.get_f32(name).copy())
    model.load_state_dict(state, strict=True)
    return model


def load_drafter(path) -> DFlashDrafter:
    ckpt = DrafterCheckpoint(path)
    model = DFlashDrafter(ckpt.config)
    model.load_state_dict({n: torch.from_numpy(ckpt.get_f32(n).copy()) for n in ckpt.specs}, strict=True)
    return model


def describe(cfg: KimiConfig, dcfg: DrafterConfig) -> str:
    n_t = sum(int(np.prod(s.shape)) for s in target_tensor_specs(cfg).values())
    n_d = sum(int(np.prod(s.shape)) for s in drafter_tensor_specs(dcfg).values())
    return f"target {n_t / 1e6:.2f} M stored values, drafter {n_d / 1e6:.2f} M"
