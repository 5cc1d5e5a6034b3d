"""Shared fixtures of the builder tests: a tiny synthetic checkpoint (the real on-disk formats),
engines built from it on demand (building with --arch needs the `cuda` extra's NVRTC; the cubin
cache is one temporary folder per session, tests/conftest.py)."""
from pathlib import Path

import pytest

from ddtree.builder.build import build_engine
from ddtree.model.synthetic import synth


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """(target dir, drafter dir) of the tiny preset, sharded small so tensors span many shards."""
    return synth(tmp_path_factory.mktemp("tiny-ckpt"), "tiny", seed=21, shard_mb=0.5)


@pytest.fixture(scope="session")
def engine_dir(tiny_ckpt, tmp_path_factory):
    """engine_dir(tp, experts) -> engine dir built from tiny_ckpt (once per session)."""
    root = tmp_path_factory.mktemp("engines")
    built = {}

    def get(tp: int, experts: str = "tp"):
        if (tp, experts) not in built:
            out = root / f"tp{tp}-{experts}"
            built[tp, experts] = Path(build_engine(*tiny_ckpt, tp, ["sm_120"], out, experts=experts)["engine"])
        return built[tp, experts]

    return get
