"""Synthetic checkpoints in the exact real formats (`ddtree synth`).

A target dir holds config.json (real field names, either layout), model.safetensors.index.json
and shards `model-000NN-of-000MM.safetensors` of at most `shard_mb`; routed experts are INT4 in
the compressed-tensors packing, everything else BF16 (F32 router bias) as in the real model. A
drafter dir holds config.json + model.safetensors. Weights are either given (a name -> array
mapping in file format) or seeded random, generated tensor by tensor in row blocks, so even the
real-dimension preset is never whole in memory.
"""
from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from ddtree.model.bf16 import f32_to_bf16
from ddtree.model.config import DrafterConfig, KimiConfig, write_json
from ddtree.model.presets import get_preset
from ddtree.model.safetensors_io import NUMPY_DTYPE, check_array, write_safetensors
from ddtree.model.tensors import TensorSpec, drafter_tensor_specs, target_size, target_tensor_specs

BLOCK_BYTES = 64 << 20          # random tensors are generated and written in row blocks of this size
Source = Callable[[str, TensorSpec], Iterator[np.ndarray]]   # name, spec -> row blocks


# ----------------------------------------------------------------------------------------------
# seeded random weights, scaled so a forward through many layers stays tame

def _rng(seed: int, name: str, block: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode()), block])


def random_blocks(seed: int, cfg: KimiConfig | DrafterConfig) -> Source:
    """A Source of seeded random weights; every tensor is independent of the others (keyed by name)."""
    group = getattr(cfg, "quant", None).group_size if getattr(cfg, "quant", None) else 32

    def blocks(name: str, spec: TensorSpec) -> Iterator[np.ndarray]:
        shape = spec.shape
        if name.endswith(".weight_shape"):           # logical [out, in] of an INT4 expert linear
            H, I = cfg.hidden_size, cfg.moe_intermediate_size
            yield np.array([H, I] if ".down_proj." in name else [I, H], dtype=NUMPY_DTYPE[spec.dtype])
            return
        row_bytes = max(spec.nbytes // max(shape[0], 1), 1)
        rows_per_block = max(1, BLOCK_BYTES // row_bytes)
        for bi, r0 in enumerate(range(0, shape[0], rows_per_block)):
            rows = min(rows_per_block, shape[0] - r0)
            rng = _rng(seed, name, bi)
            yield _random_block(name, (rows, *shape[1:]), spec.dtype, rng, group)

    return blocks


def _random_block(name: str, shape: tuple, dtype: str, rng: np.random.Generator, group: int) -> np.ndarray:
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return f32_to_bf16(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32))
    if name.endswith("e_score_correction_bias"):
        return (0.05 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith("embed_tokens.weight"):
        return f32_to_bf16(rng.standard_normal(shape, dtype=np.float32))
    if name.endswith(".weight_packed"):
        # random INT4 codes in [-7, 7] (the QAT checkpoints use 15 levels), packed 8 per int32
        q = rng.integers(-7, 8, size=(shape[0], shape[1] * 8), dtype=np.int64)
        u = (q + 8).astype(np.uint32).reshape(shape[0], shape[1], 8) << (np.arange(8, dtype=np.uint32) * 4)
        return np.bitwise_or.reduce(u, axis=2).view(np.int32)
    if name.endswith(".weight_scale"):
        fan_in = shape[1] * group
        # |W| = |q| * s with E[q^2] = 56/3 for q uniform in [-7, 7] -> std(W) ~ 1/sqrt(fan_in)
        s = rng.uniform(0.75, 1.25, size=shape) / np.sqrt(fan_in * 56.0 / 3.0)
        return f32_to_bf16(s.astype(np.float32))
    if len(shape) == 2:                        # dense linear [out, in]
        return f32_to_bf16(rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1])))
    raise ValueError(f"synthetic: no generator for tensor '{name}' {list(shape)}")


def given_blocks(tensors: Mapping[str, np.ndarray], where: str) -> Source:
    """A Source over given arrays in file format (bf16 as uint16 bits), each checked against its spec."""

    def blocks(name: str, spec: TensorSpec) -> Iterator[np.ndarray]:
        if name not in tensors:
            raise KeyError(f"{where}: no weight given for tensor '{name}' ({spec.dtype} {list(spec.shape)})")
        yield check_array(name, spec, np.asarray(tensors[name]), where)

    return blocks


# ----------------------------------------------------------------------------------------------
# writers

def _shard_plan(specs: dict[str, TensorSpec], shard_mb: float) -> list[list[str]]:
    """Consecutive tensors into shards of at most shard_mb (a larger tensor gets a shard to itself)."""
    limit = int(shard_mb * (1 << 20))
    shards, cur, cur_bytes = [], [], 0
    for name, s in specs.items():
        if cur and cur_bytes + s.nbytes > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(name)
        cur_bytes += s.nbytes
    if cur:
        shards.append(cur)
    return shards


def _stream(names: list[str], specs: dict[str, TensorSpec], source: Source):
    for name in names:
        for block in source(name, specs[name]):
            yield name, block


def write_target(out_dir, cfg: KimiConfig, source: Source, layout: str | None = None,
                 shard_mb: float = 4096, shape_dtype: str = "I32", progress=None) -> Path:
    """Write a complete HF target checkpoint dir. `layout` defaults to cfg.layout."""
    layout = layout or cfg.layout
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = target_tensor_specs(cfg, shape_dtype)
    prefix = "language_model." if layout == "k2.6" else ""
    plan = _shard_plan(specs, shard_mb)
    weight_map, total = {}, 0
    for i, names in enumerate(plan):
        fname = f"model-{i + 1:05d}-of-{len(plan):06d}.safetensors"
        shard_specs = {prefix + n: specs[n] for n in names}
        renamed = ((prefix + n, b) for n, b in _stream(names, specs, source))
        write_safetensors(out / fname, shard_specs, renamed)
        for n in names:
            weight_map[prefix + n] = fname
        total += sum(specs[n].nbytes for n in names)
        if progress:
            progress(i + 1, len(plan), fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    write_json(out / "config.json", cfg.to_dict(layout))
    return out


def write_drafter(out_dir, dcfg: DrafterConfig, source: Source) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = drafter_tensor_specs(dcfg)
    write_safetensors(out / "model.safetensors", specs, _stream(list(specs), specs, source))
    write_json(out / "config.json", dcfg.to_dict())
    return out


def synth(out_dir, preset: str, seed: int = 0, layers: int | None = None, layout: str = "k2.6",
          shard_mb: float = 4096, force: bool = False, progress=None) -> tuple[Path, Path]:
    """`ddtree synth`: DIR/target (HF checkpoint) and DIR/drafter (DFlash), seeded random weights."""
    cfg, dcfg = get_preset(preset, layers)
    out = Path(out_dir)
    for sub in ("target", "drafter"):
        if (out / sub).exists():
            if not force:
                raise FileExistsError(f"{out / sub} already exists (use --force to overwrite)")
            shutil.rmtree(out / sub)
    target = write_target(out / "target", cfg, random_blocks(seed, cfg), layout, shard_mb, progress=progress)
    drafter = write_drafter(out / "drafter", dcfg, random_blocks(seed + 1, dcfg))
    return target, drafter


def estimate_bytes(preset: str, layers: int | None = None) -> int:
    """Bytes `synth` will write (for the free-disk check before writing), without building the tensor table."""
    return estimate(preset, layers)[0]


TABLE_BYTES_PER_TENSOR = 1024   # the tensor table, weight map and index JSON held while writing (measured
                                # ~740 B per tensor with tracemalloc on kimi-k2.6; rounded up)


def estimate(preset: str, layers: int | None = None) -> tuple[int, int]:
    """(bytes on disk, bytes of memory) `synth` needs: checked before anything is built or written. The
    weights are streamed a block at a time; what grows with the model is the table of its tensors."""
    cfg, dcfg = get_preset(preset, layers)
    target_bytes, target_tensors = target_size(cfg)
    drafter = drafter_tensor_specs(dcfg)
    disk = target_bytes + sum(s.nbytes for s in drafter.values())
    return disk, (target_tensors + len(drafter)) * TABLE_BYTES_PER_TENSOR
