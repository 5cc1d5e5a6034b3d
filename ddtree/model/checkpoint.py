"""Lazy readers for a Kimi K2.x checkpoint directory and a DFlash drafter directory.

Target dir: config.json + model.safetensors.index.json (`weight_map`: name -> shard file) + shards,
or a single model.safetensors. Names are canonicalised (K2.6's `language_model.` prefix stripped,
vision tower / projector skipped) and checked against the tensor table of `model/tensors.py`
(dtype and shape from the config) on every read. A linear is INT4 exactly when
`<module>.weight_packed` exists (docs/kimi-k2.md 4.1: decide by presence, never by the ignore list).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ddtree.model.bf16 import bf16_to_f32
from ddtree.model.config import ConfigError, load_drafter_config, load_model_config
from ddtree.model.fields import Fields, show
from ddtree.model.int4 import dequantize_packed
from ddtree.model.safetensors_io import CheckpointError, SafetensorsFile
from ddtree.model.tensors import TensorSpec, drafter_tensor_specs, target_tensor_specs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")


def _read_index(path: Path) -> dict[str, str]:
    """weight_map of a model.safetensors.index.json: an object of tensor name -> shard file name, the
    shard a plain file name in the checkpoint directory; CheckpointError naming the file, field and value."""
    try:
        index = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors index ({e})") from e
    f = Fields(index, path, error=CheckpointError)
    weight_map = f.obj("weight_map", what="tensor name -> shard file name").d
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or shard in (".", "..") or "/" in shard or "\\" in shard:
            raise CheckpointError(f"{path}: field 'weight_map' entry '{name}' = {show(shard)}: expected the "
                                  "file name of a shard in the checkpoint directory")
    return weight_map


class _ShardedTensors:
    """name -> tensor over one index + shards; shard headers parsed on first use."""

    def __init__(self, root: Path, canonical):
        self.root = root
        index_path = root / INDEX
        if index_path.exists():
            weight_map = _read_index(index_path)
        elif (root / SINGLE).exists():
            weight_map = {n: SINGLE for n in SafetensorsFile(root / SINGLE).keys()}
        else:
            raise CheckpointError(f"{root}: neither {INDEX} nor {SINGLE} found")
        self.file_name: dict[str, str] = {}       # canonical name -> shard file name
        self.stored_name: dict[str, str] = {}     # canonical name -> name inside the shard
        for stored, shard in weight_map.items():
            name = canonical(stored)
            if name is None:
                continue
            self.file_name[name] = shard
            self.stored_name[name] = stored
        self._shards: dict[str, SafetensorsFile] = {}

    def shard(self, file_name: str) -> SafetensorsFile:
        if file_name not in self._shards:
            self._shards[file_name] = SafetensorsFile(self.root / file_name)
        return self._shards[file_name]

    def entry(self, name: str) -> tuple[SafetensorsFile, str]:
        if name not in self.file_name:
            raise CheckpointError(f"{self.root}: tensor '{name}' is absent from the index")
        shard = self.shard(self.file_name[name])
        stored = self.stored_name[name]
        if stored not in shard:
            raise CheckpointError(f"{shard.path}: the index places tensor '{stored}' in this shard, "
                                  "but the shard does not hold it")
        return shard, stored


class _Reader:
    specs: dict[str, TensorSpec]

    def names(self) -> list[str]:
        return list(self._t.file_name)

    def has(self, name: str) -> bool:
        return name in self._t.file_name

    def _checked(self, name: str) -> tuple[SafetensorsFile, str]:
        """(shard, stored name) of a tensor whose dtype/shape agree with the config's tensor table."""
        shard, stored = self._t.entry(name)
        got, want = shard.entries[stored], self.specs.get(name)
        if want is not None and not _spec_ok(name, want, got):
            raise CheckpointError(f"{shard.path}: tensor '{stored}' is {got.dtype} {list(got.shape)}, "
                                  f"the config expects {want.dtype} {list(want.shape)}")
        return shard, stored

    def get(self, name: str) -> np.ndarray:
        """One tensor as stored (BF16 as uint16 bits), checked against the config's tensor table."""
        shard, stored = self._checked(name)
        return shard.read(stored)

    def get_f32(self, name: str) -> np.ndarray:
        a = self.get(name)
        return bf16_to_f32(a) if self.spec(name).dtype == "BF16" else a.astype(np.float32)

    def shard_of(self, name: str) -> Path:
        return self._t.root / self._t.file_name[name]

    def spec(self, name: str) -> TensorSpec:
        shard, stored = self._t.entry(name)
        return shard.entries[stored]

    def verify(self) -> None:
        """Every tensor the config implies is indexed, present in its shard, with the right dtype/shape."""
        for name in self.specs:
            self._checked(name)

    def close(self):
        for s in self._t._shards.values():
            s.close()


def _spec_ok(name: str, want: TensorSpec, got: TensorSpec) -> bool:
    if name.endswith(".weight_shape"):              # compressed-tensors writes I64; dumps show I32
        return got.dtype in ("I32", "I64") and got.shape == want.shape
    return want == got


class Checkpoint(_Reader):
    """A Kimi K2.x HF checkpoint directory (either layout)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint directory not found")
        self.config = load_model_config(self.path)
        self.specs = target_tensor_specs(self.config)
        prefix = self.config.tensor_prefix

        def canonical(stored: str) -> str | None:
            if stored.startswith(SKIPPED_PREFIXES):
                return None
            if prefix and stored.startswith(prefix):
                return stored[len(prefix):]
            return stored

        self._t = _ShardedTensors(self.path, canonical)

    def is_int4(self, module: str) -> bool:
        return self.has(f"{module}.weight_packed")

    def dense_weight(self, module: str, dtype=np.float32) -> np.ndarray:
        """W [out, in] of a linear, dequantised if INT4, as `dtype`."""
        if self.is_int4(module):
            if self.config.quant is None:
                raise ConfigError(f"{self.path}: '{module}' is INT4 but config.json has no quantization_config")
            shape = self.get(f"{module}.weight_shape")
            w = dequantize_packed(self.get(f"{module}.weight_packed"), self.get(f"{module}.weight_scale"),
                                  shape, self.config.quant.group_size, np.float32)
            return w.astype(dtype, copy=False)
        return self.get_f32(f"{module}.weight").astype(dtype, copy=False)


class DrafterCheckpoint(_Reader):
    """A DFlash drafter directory: config.json + model.safetensors (optionally sharded)."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: drafter directory not found")
        self.config = load_drafter_config(self.path)
        self.specs = drafter_tensor_specs(self.config)
        self._t = _ShardedTensors(self.path, lambda s: s[len("model."):] if s.startswith("model.") else s)
