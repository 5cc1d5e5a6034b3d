"""Synthetic checkpoints (written by ddtree.model.synthetic in the real on-disk format) and the
reference targets loaded from them, shared by the reference tests."""
import pytest

from ddtree.model.synthetic import synth
from ddtree.reference.model import Target


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory):
    """preset -> target checkpoint dir, written once per session."""
    made = {}

    def make(preset: str, layout: str = "k2.6"):
        key = (preset, layout)
        if key not in made:
            out = tmp_path_factory.mktemp(f"synth-{preset}-{layout}")
            made[key] = synth(out, preset, seed=0, layout=layout)[0]
        return made[key]

    return make


@pytest.fixture(scope="session")
def target(synth_dir):
    """preset -> float64 reference Target loaded from its synthetic checkpoint."""
    loaded = {}

    def load(preset: str):
        if preset not in loaded:
            loaded[preset] = Target.from_checkpoint(synth_dir(preset))
        return loaded[preset]

    return load
