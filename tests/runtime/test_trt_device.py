"""--device tensorrt: the engine's plans run only on a GPU of their compute capability, and the refusal comes
before anything is loaded, naming the GPU, its compute capability and --device cuda. CPU: with a stated device
identity; GPU (an H200, which TensorRT-RTX cannot run plans on): the driver's own."""
import json

import pytest
from click.testing import CliRunner

from ddtree.engine_dir import plans_path
from ddtree.engine_dir.layout import EngineFormatError
from ddtree.runtime.trt_executor import PlanDeviceError, check_gpu_runs_plans


def plans_dir(tmp_path, cc="12.0"):
    plans_path(tmp_path).write_text(json.dumps({"format": "ddtree-plans/1", "compute_capability": cc, "plans": {}}))
    return tmp_path


def test_an_h200_is_refused_with_its_name_capability_and_the_cuda_device(tmp_path):
    loaded = []
    with pytest.raises(PlanDeviceError) as err:
        check_gpu_runs_plans(plans_dir(tmp_path), 1, identity=lambda g: loaded.append(g) or ("NVIDIA H200", (9, 0)))
    msg = str(err.value)
    assert loaded == [1]
    assert "GPU 1 (NVIDIA H200) has compute capability 9.0" in msg and "built for 12.0 (SM120)" in msg
    assert "no Hopper target" in msg and "--device cuda" in msg and str(tmp_path) in msg


def test_a_gpu_of_the_plans_capability_passes_and_other_capabilities_are_refused(tmp_path):
    d = plans_dir(tmp_path)
    assert check_gpu_runs_plans(d, 0, identity=lambda g: ("NVIDIA RTX PRO 6000", (12, 0))) == \
        ("NVIDIA RTX PRO 6000", (12, 0))
    with pytest.raises(PlanDeviceError, match=r"GPU 0 \(GB10\) has compute capability 12\.1") as err:
        check_gpu_runs_plans(d, 0, identity=lambda g: ("GB10", (12, 1)))
    assert "Hopper" not in str(err.value)


def test_an_engine_without_plans_says_how_to_build_them(tmp_path):
    with pytest.raises(EngineFormatError, match=r"plans.json: missing; --device tensorrt .*ddtree-build --trt"):
        check_gpu_runs_plans(tmp_path, 0, identity=lambda g: pytest.fail("the GPU was asked before the plans"))


def test_run_cli_device_tensorrt_needs_an_engine_dir():
    from ddtree.cli import main
    r = CliRunner().invoke(main, ["run", "hi", "--device", "tensorrt", "--max-new-tokens", "1"])
    assert r.exit_code == 1 and "--device tensorrt runs an engine directory's TensorRT-RTX plans" in r.output


@pytest.mark.gpu
@pytest.mark.trt
def test_device_tensorrt_on_this_gpu_refuses_before_loading(tmp_path):
    """A real --trt engine, ddtree-run --device tensorrt on the H200: the refusal names it (no Hopper target)."""
    from ddtree.cli import main
    from ddtree.runtime.trt_executor import gpu_identity
    from tests.backends.trt_plugin_calls import build_engine
    name, cc = gpu_identity(0)
    if cc == (12, 0):
        pytest.skip(f"{name} runs SM120 plans")
    engine = build_engine(tmp_path / "tiny-trt")
    r = CliRunner().invoke(main, ["run", "hi", "--device", "tensorrt", "--model", str(engine), "--max-new-tokens", "1"])
    assert r.exit_code == 1, r.output
    assert f"GPU 0 ({name}) has compute capability {cc[0]}.{cc[1]}" in r.output and "--device cuda" in r.output
