"""`ddtree run --device cuda` on a machine that cannot run it exits 1 naming why: the cuda extra missing, or
no GPU (the GPU run itself is tests/runtime/test_cuda_executor_gpu.py)."""
import pytest

from ddtree.builder.build import build_engine
from ddtree.data import tiny_model_dirs
from tests.cli.bad_input import refuses


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_engine(*tiny_model_dirs(), 1, ["sm_90"], tmp_path_factory.mktemp("cuda-cli") / "e",
                        graphs=False)["engine"]


def test_without_a_gpu_the_reason_is_named(engine):
    from ddtree.runtime.cuda_executor import gpu_unavailable
    why = gpu_unavailable(0)
    if why is None:
        pytest.skip("a GPU is visible here: tests/runtime/test_cuda_executor_gpu.py runs it")
    refuses(["run", "--model", str(engine), "--device", "cuda", "--mode", "ar", "hi"], "DeviceUnavailableError",
            "--device", "'cuda'", why.split(" (")[0])


def test_without_the_cuda_extra_it_says_so(engine, tmp_path, monkeypatch):
    fake = tmp_path / "cuda"                      # a `cuda` package that fails to import, as without the extra
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no cuda-python here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    refuses(["run", "--model", str(engine), "--device", "cuda", "hi"], "DeviceUnavailableError",
            "cuda-python is not installed", "pip install -e '.[cuda]'")


def test_a_checkpoint_is_not_repacked_where_no_gpu_can_run_it():
    """Checkpoint dirs are repacked into a tp 1 engine at load (docs/interfaces.md 8), but only after the GPU is
    known to be there: without one the error names why, and nothing is built."""
    from ddtree.runtime.cuda_executor import gpu_unavailable
    why = gpu_unavailable(0)
    if why is None:
        pytest.skip("a GPU is visible here: test_a_checkpoint_runs_on_the_gpu runs it")
    r = refuses(["run", "--device", "cuda", "hi"], "DeviceUnavailableError", "'cuda'", why.split(" (")[0])
    assert "repacking" not in r.stderr


@pytest.mark.gpu
def test_a_checkpoint_runs_on_the_gpu():
    """The embedded tiny checkpoint with --device cuda: repacked at load into a temporary tp 1 engine for this
    GPU's architecture, then decoded there."""
    import json
    from ddtree.runtime.cuda_executor import gpu_unavailable
    from tests.cli.bad_input import ddtree
    if gpu_unavailable(0):
        pytest.skip("needs a CUDA GPU and cuda-python")
    r = ddtree(["run", "--device", "cuda", "--mode", "both", "--max-new-tokens", "16", "--json", "def f(x):"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "repacking" in r.stderr and (len(out["tokens"]) == 16 or out["stats"]["finish_reason"] == "stop")
