"""Shared fixtures of the builder tests: a tiny synthetic checkpoint (the real on-disk formats),
engines built from it at tp 1, 2, 4 (and expert-parallel at tp 2), and one kernel cache per
session so the cubins are compiled once (building with --arch needs the `cuda` extra's NVRTC)."""
import os

import pytest

from ddtree.builder.build import build_engine
from ddtree.model.synthetic import synth

ENGINES = [(1, "tp"), (2, "tp"), (4, "tp"), (2, "ep")]


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    """DDTREE_KERNEL_CACHE for this session (also seen by ddtree-build subprocesses)."""
    path = tmp_path_factory.mktemp("cubins")
    old = os.environ.get("DDTREE_KERNEL_CACHE")
    os.environ["DDTREE_KERNEL_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DDTREE_KERNEL_CACHE", None)
    else:
        os.environ["DDTREE_KERNEL_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """(target dir, drafter dir) of the tiny preset, sharded small so tensors span many shards."""
    return synth(tmp_path_factory.mktemp("tiny-ckpt"), "tiny", seed=21, shard_mb=0.5)


@pytest.fixture(scope="session")
def engines(tiny_ckpt, tmp_path_factory):
    """(tp, experts) -> engine dir built from tiny_ckpt."""
    root = tmp_path_factory.mktemp("engines")
    target, drafter = tiny_ckpt
    return {(tp, mode): build_engine(target, drafter, tp, ["sm_120"], root / f"tp{tp}-{mode}", experts=mode)["engine"]
            for tp, mode in ENGINES}
