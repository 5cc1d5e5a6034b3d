"""Fixtures of the graph tests: tiny synthetic checkpoints (the real formats), engines built from them
(each with its graphs/ folder), and the float64 reference oracles."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ddtree.builder.build import build_engine
from ddtree.model.checkpoint import Checkpoint
from ddtree.model.synthetic import synth
from ddtree.reference.drafter import Drafter
from ddtree.reference.model import Target
from ddtree.reference.weights import load_dense_weights

PRESET_SEEDS = {"tiny": 21, "tiny-grouped": 5}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset) -> (target dir, drafter dir), written once per session."""
    made = {}

    def get(preset: str):
        if preset not in made:
            made[preset] = synth(tmp_path_factory.mktemp(f"ckpt-{preset}"), preset, seed=PRESET_SEEDS[preset])
        return made[preset]
    return get


@pytest.fixture(scope="session")
def engine(checkpoint, tmp_path_factory):
    """engine(preset, tp, experts) -> engine dir with graphs/ (built once per session). No cubins: these tests run
    the graphs on the CPU (onnx.reference), and the session's NVRTC compile belongs to the tests that read cubins."""
    root = tmp_path_factory.mktemp("graph-engines")
    built = {}

    def get(preset: str, tp: int, experts: str = "tp"):
        key = (preset, tp, experts)
        if key not in built:
            out = root / f"{preset}-tp{tp}-{experts}"
            built[key] = Path(build_engine(*checkpoint(preset), tp, [], out, experts=experts,
                                                    kernels=False)["engine"])
        return built[key]
    return get


@pytest.fixture(scope="session")
def oracles(checkpoint):
    """oracles(preset) -> (target, target with the graphs' float32 constants, drafter), float64."""
    made = {}

    def get(preset: str):
        if preset not in made:
            tdir, ddir = checkpoint(preset)
            ckpt = Checkpoint(tdir)
            target = Target(ckpt.config, load_dense_weights(ckpt, np.float64))
            cfg32 = replace(ckpt.config, routed_scaling_factor=float(np.float32(ckpt.config.routed_scaling_factor)))
            target32 = Target(cfg32, load_dense_weights(ckpt, np.float64))
            target32.mla.scale = float(np.float32(target32.mla.scale))     # the MlaTreeAttention attribute
            made[preset] = (target, target32, Drafter.from_checkpoint(ddir, target))
        return made[preset]
    return get
