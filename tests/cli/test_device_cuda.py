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


@pytest.fixture(scope="module")
def engine_tp2(tmp_path_factory):
    return build_engine(*tiny_model_dirs(), 2, ["sm_90"], tmp_path_factory.mktemp("cuda-cli-tp2") / "e",
                        graphs=False)["engine"]


def test_an_allreduce_that_cannot_run_is_named_before_any_gpu_is_touched(engine, engine_tp2):
    """--allreduce (parallel/rank_collective.py) is refused, naming the flag, wherever it has nothing to choose or cannot
    run: on the cpu device, on a tp 1 engine or a checkpoint (repacked to tp 1), and NCCL on ranks sharing a GPU."""
    refuses(["run", "--allreduce", "nccl", "hi"], "--allreduce nccl chooses the collective", "--device cpu")
    refuses(["run", "--model", str(engine), "--device", "cuda", "--allreduce", "auto", "hi"],
            "--allreduce auto: a tp 1 engine has no all-reduce")
    refuses(["run", "--device", "cuda", "--allreduce", "nccl", "hi"], "checkpoint dirs are repacked into a tp 1")
    refuses(["run", "--model", str(engine_tp2), "--device", "cuda", "--gpu", "0,0", "--allreduce", "nccl", "hi"],
            "--allreduce nccl: NCCL needs one GPU per rank", "--gpu 0,0")
    refuses(["run", "--allreduce", "ring", "hi"], "--allreduce", "'ring'", code=2)


def test_device_tensorrt_on_a_tp2_engine_without_plans_says_how_to_build_them(engine_tp2):
    """--device tensorrt reaches the plans check for a tp N engine (named, exit 1), not an error of its own."""
    refuses(["run", "--model", str(engine_tp2), "--device", "tensorrt", "hi"], "plans.json: missing",
            "ddtree-build --trt")
