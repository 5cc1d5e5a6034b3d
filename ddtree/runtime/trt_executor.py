"""--device tensorrt: an engine's TensorRT-RTX plans (ddtree-build --trt) on the GPU they were built for.

What runs where. TensorRT-RTX plans are ahead-of-time plans for compute capability 12.0 (RTX PRO 6000 Blackwell,
SM120); TensorRT-RTX has no Hopper target and an H200 refuses them (docs/tensorrt-rtx.md section 2). So before
anything is loaded, check_gpu_runs_plans compares the GPU's compute capability (read from the driver, no context
made) with the plans' and refuses with the GPU's name, its compute capability and the way to run the engine on it
(--device cuda: the same kernels, launched by the cuda backend).

What runs today (tp 1): PlanRanks runs each graph kind as its plan through a PlanKind (runtime/plan_kind.py): one
execution context per kind on memory this runtime allocates (the plans need it: REQUIRE_USER_ALLOCATION), the
weights uploaded once and bound by name for each layer, and each (layer, step shape) call captured into a CUDA graph
on its second call and replayed after, so TensorRT and the plugins' Python enqueue run only at the first eager call
and at the capture (tested on the CPU with a stand-in TensorRT and GPU: tests/runtime/test_plan_kind.py). The feeds
and caches are host arrays copied in and out per call; runtime/graph_executor.py drives the loop over it (the same
adapter runs the graphs under onnx.reference in the CPU tests). It has never run: no GPU here runs SM120 plans.

What it is to grow into: device-resident caches and activations, all of a rank's contexts on one device-memory block
(kinds run one after another), and the whole step captured once per step shape into one CUDA graph: for each layer
the runtime sets that layer's tensor addresses (its weights, its KV-cache slice, the step's activation buffers) and
enqueues the kind's context on the capturing stream, so a step is one graph launch. Why one context per kind, not
per layer: 61 contexts hold 61 copies of every plugin's workspaces and of the JIT-specialised kernels for the same
shapes, and buy nothing that per-layer addresses in one capture do not. tp > 1: one rank process per GPU
(RankProcesses(trt=...)), each with the one-shot registered for its AllReduce / AllGather plugins; the same loop over
the graphs as rank processes runs on the CPU (tests/runtime/test_graph_executor.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ddtree import engine_dir as ed
from ddtree.backends.tensorrt.kernels import register_rank_collective
from ddtree.backends.tensorrt.plugin_ops import device_gpu
from ddtree.description.layers import layer_weight_name
from ddtree.description.opset import RankLayout
from ddtree.parallel.rank_collective import RankCollective
from ddtree.plugins.device import check
from ddtree.runtime.cuda_ranks import all_reduce_elems, connect_one_shot
from ddtree.runtime.graph_ranks import GraphRanks, kind_maps
from ddtree.runtime.plan_kind import PlanKind


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
    from cuda.bindings import driver  # cuda: the cuda extra

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


class PlanRanks(GraphRanks):
    """GraphRanks whose graph kinds run as the engine's TensorRT-RTX plans on GPU `gpu`: a tp 1 engine, or rank `rank`
    of a tp N engine in its own process (runtime/ranks.py RankProcesses(trt=...)), its AllReduce / AllGather plugins
    on the one-shot over CUDA IPC, connected through the host `group` and registered for the GPU before the plans
    are deserialised (backends/tensorrt/kernels.py register_rank_collective)."""

    def __init__(self, engine_dir, gpu: int = 0, verify: bool = True, rank: int | None = None, group=None,
                 checked: tuple | None = None):
        check_gpu_runs_plans(engine_dir, gpu)                  # first: nothing is loaded on a GPU that cannot run them
        import ml_dtypes  # ml_dtypes: the graphs extra

        from ddtree.backends.tensorrt.creators import register_creators, trt  # onnx: the graphs extra
        root = Path(engine_dir)
        meta, digests = checked if checked is not None else ed.check_engine(root, verify)
        tp, r = int(meta["tp"]), 0 if rank is None else rank
        if tp != 1 and (rank is None or group is None):
            raise PlanDeviceError(f"--device tensorrt: {root} is a tp {tp} engine; its ranks run as processes, one "
                                  "per GPU (runtime/ranks.py RankProcesses(trt=...))")
        self.cfg, self.dcfg = ed.engine_configs(root, meta)
        index = json.loads(ed.graphs_index_path(root).read_text())
        self.tp, self.held, self.local, self.act, self.group, self.pool, self.trt = tp, 1, [r], index["act"], None, None, trt
        self.bf16 = ml_dtypes.bfloat16
        kinds = index["kinds"]
        self.prefix = {k: v["weight_prefix"] for k, v in kinds.items()}
        self.layer_kind, self.draft_kind = kind_maps((k, v["layers"], v["weight_prefix"]) for k, v in kinds.items())
        self.layouts = [RankLayout.from_plan(meta["plan"], q) for q in range(tp)]
        register_creators()
        self.gpu = device_gpu(gpu)
        if tp > 1:
            one_shot = connect_one_shot(self.gpu, r, group, all_reduce_elems(self.cfg, self.dcfg))
            register_rank_collective(gpu, RankCollective(one_shot=one_shot))
        tensors = ed.load_rank_tensors(root, r, meta["weight_files"], convert=ed.STORED, digests=digests)
        self.weights = [{name: self.gpu.upload(np.ascontiguousarray(a)) for name, a in tensors.items()}]
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        plans = json.loads(ed.plans_path(root).read_text())["plans"]
        self.kinds = {}
        for rel, p in ((rel, p) for rel, p in plans.items() if p["rank"] == r):
            engine = runtime.deserialize_cuda_engine((root / rel).read_bytes())
            if engine is None:
                raise PlanDeviceError(f"{root / rel}: TensorRT-RTX could not deserialise the plan")
            config = engine.create_runtime_config()
            config.set_execution_context_allocation_strategy(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
            self.kinds[p["kind"]] = PlanKind(trt, p["kind"], engine, engine.create_execution_context(config), self.gpu)

    def run(self, kind: str, feeds, layer: int | None = None) -> list[dict[str, np.ndarray]]:
        """Plan `kind` on feeds (host arrays) and layer `layer`'s weights; its outputs as host arrays (rank 0's),
        bf16 ones as ml_dtypes.bfloat16 (GraphRanks' dtype)."""
        feeds = feeds[0] if isinstance(feeds, list) else feeds
        out = self.kinds[kind].call(feeds, lambda name: self.weights[0].get(
            layer_weight_name(name, self.prefix.get(kind), layer)))
        return [{k: v.view(self.bf16) if v.dtype == np.uint16 else v for k, v in out.items()}]
