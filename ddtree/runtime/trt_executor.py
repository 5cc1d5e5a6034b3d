"""--device tensorrt: an engine's TensorRT-RTX plans (ddtree-build --trt) on the GPU they were built for.

What runs where. TensorRT-RTX plans are ahead-of-time plans for compute capability 12.0 (RTX PRO 6000 Blackwell,
SM120); TensorRT-RTX has no Hopper target and an H200 refuses them (docs/tensorrt-rtx.md section 2). So before
anything is loaded, check_gpu_runs_plans compares the GPU's compute capability (read from the driver, no context
made) with the plans' and refuses with the GPU's name, its compute capability and the way to run the engine on it
(--device cuda: the same kernels, launched by the cuda backend).

The capture design (docs/architecture.md "TensorRT-RTX path"): one execution context per plan kind
(embed, dense_layer, moe_layer, head, draft_*, tree_b<B>, accept, compact), all of a rank's contexts on one
device-memory block the runtime allocates (kinds run one after another), and the whole step captured once per
step shape into one CUDA graph: for each layer the runtime sets that layer's tensor addresses (its weights as
loaded from rank<r>/*.safetensors, its slice of the KV cache, the step's activation buffers) and enqueues the
kind's context on the capturing stream. So TensorRT and the plugins' Python enqueue run only while capturing; a
step is one graph launch, and the plugins' enqueue allocates nothing and reads per-step scalars from device
buffers (ops/tensorrt/plugin_ops.py). Why not one context per layer: 61 contexts hold 61 copies of every plugin's
workspaces and 61 sets of JIT-specialised kernels for the same shapes, and buy nothing that per-layer addresses in
one capture do not. Plans are built with REQUIRE_USER_ALLOCATION (every I/O address is the runtime's), as a
stream TensorRT runs on must be before it is captured. That executor is not written yet: only this check and the
plugins' runtime phase (create, attach, on_shape_change, enqueue under capture) are, and the latter has been run
on an H200 without a plan (tests/ops/test_trt_plugins_gpu.py); no plan has run anywhere.
"""
from __future__ import annotations

import json
from pathlib import Path

from ddtree import engine_dir as ed


class PlanDeviceError(RuntimeError):
    """This GPU cannot run the engine's TensorRT-RTX plans; the message names the GPU and what to use instead."""


def plans_compute_capability(engine_dir) -> tuple[int, int]:
    """The compute capability the engine's plans were built for (plans.json), or an error saying how to build them."""
    path = ed.plans_path(Path(engine_dir))
    if not path.is_file():
        raise ed.EngineFormatError(f"{path}: missing; --device tensorrt runs an engine's TensorRT-RTX plans "
                                   "(build them with ddtree-build --trt)")
    cc = json.loads(path.read_text())["compute_capability"]
    major, minor = (int(x) for x in str(cc).split("."))
    return major, minor


def gpu_identity(gpu: int) -> tuple[str, tuple[int, int]]:
    """(name, (major, minor)) of CUDA device `gpu`, from the driver without creating a context."""
    from cuda.bindings import driver

    from ddtree.plugins.device import check
    check(driver.cuInit(0), "cuInit")
    count = int(check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))
    if not 0 <= gpu < count:
        raise PlanDeviceError(f"--gpu {gpu}: this machine has {count} CUDA device(s)")
    dev = check(driver.cuDeviceGet(gpu), "cuDeviceGet")
    name = check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = bytes(name).split(b"\0")[0].decode()
    a = driver.CUdevice_attribute
    major = int(check(driver.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attribute"))
    minor = int(check(driver.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attribute"))
    return name, (major, minor)


def check_gpu_runs_plans(engine_dir, gpu: int = 0, identity=gpu_identity) -> tuple[str, tuple[int, int]]:
    """Raise PlanDeviceError unless GPU `gpu` has the compute capability the plans were built for. Reads only
    plans.json and the driver's device attributes: nothing is loaded or allocated before it says no."""
    want = plans_compute_capability(engine_dir)
    name, have = identity(gpu)
    if have != want:
        raise PlanDeviceError(
            f"--device tensorrt: GPU {gpu} ({name}) has compute capability {have[0]}.{have[1]}, but the TensorRT-RTX "
            f"plans of {engine_dir} are built for {want[0]}.{want[1]} (SM{want[0]}{want[1]}), and TensorRT-RTX cannot "
            f"run them on it{' (it has no Hopper target)' if have[0] == 9 else ''}; run this engine with "
            f"--device cuda (the same kernels, launched by the cuda backend)")
    return name, have
