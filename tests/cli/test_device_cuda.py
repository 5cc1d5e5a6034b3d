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


def test_checkpoint_dirs_are_refused_on_cuda():
    refuses(["run", "--device", "cuda", "hi"], "DeviceUnavailableError", "'cuda'", "checkpoint dirs", "--tp 1")
