"""Shared synthetic models for the runtime tests: a tiny random target with random drafters of
block size 4 and 8, written by the synthetic writer and read back through the real readers."""
from dataclasses import replace

import pytest

from ddtree.model.presets import get_preset
from ddtree.model.synthetic import random_blocks, synth, write_drafter
from ddtree.reference.drafter import Drafter
from ddtree.reference.model import Target
from ddtree.runtime.executor import NumpyExecutor


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target, drafter4 = synth(root, "tiny", seed=11, shard_mb=1)
    _, dcfg = get_preset("tiny")
    dcfg8 = replace(dcfg, block_size=8)
    drafter8 = write_drafter(root / "drafter8", dcfg8, random_blocks(12, dcfg8))
    return {"target": target, 4: drafter4, 8: drafter8}


@pytest.fixture(scope="session")
def tiny_target(tiny_dirs):
    return Target.from_checkpoint(tiny_dirs["target"])


@pytest.fixture(scope="session")
def random_executors(tiny_dirs, tiny_target):
    """block size -> NumpyExecutor with a random DFlash drafter of that block size."""
    return {b: NumpyExecutor(tiny_target, Drafter.from_checkpoint(tiny_dirs[b], tiny_target)) for b in (4, 8)}
