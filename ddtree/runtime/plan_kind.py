"""One TensorRT-RTX plan kind on one GPU, its calls replayed as CUDA graphs (runtime/trt_executor.py PlanRanks).

    kind = PlanKind(trt, "moe_layer", engine, context, gpu)
    outputs = kind.call(feeds, weight)          # feeds {name: host array}; weight(name) -> its device array or None

A call binds the plan's inputs: feeds are copied into staging buffers of their size (kept, so their addresses never
move), the other inputs are the layer's weights (device-resident, bound by name), outputs get buffers of their
size, an output TensorRT aliases to an input (an in-place cache) its input's buffer. One key per (input shapes,
weight addresses) = per layer and step shape: its first call runs eagerly (TensorRT specialises its kernels for the
shapes and calls the plugins' on_shape_change), its second is captured into a CUDA graph on the Gpu's stream and
replayed, and every later call replays that graph after writing the feeds in place. So TensorRT's enqueue and the
plugins' Python enqueue run twice per key and never again (the plugins allocate nothing in enqueue and read their
per-step scalars from device buffers: backends/tensorrt/plugin_ops.py). The context's device memory (the plans are built
with REQUIRE_USER_ALLOCATION) is one buffer per size, shared by every key of the kind (calls run one at a time).
"""
from __future__ import annotations

import numpy as np

from ddtree.plugins.device import DeviceArray

TRT_NUMPY = {"BF16": np.uint16, "FLOAT": np.float32, "INT32": np.int32, "INT64": np.int64, "INT8": np.int8}
BF16_NAMES = ("bfloat16",)


class PlanKind:
    def __init__(self, trt, kind: str, engine, context, gpu):
        self.trt, self.kind, self.engine, self.ctx, self.gpu = trt, kind, engine, context, gpu
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.buffers: dict[tuple, object] = {}      # (name, nbytes) -> device buffer (never freed, never moved)
        self.seen: set = set()                      # keys run eagerly once
        self.graphs: dict[tuple, object] = {}       # key -> (graph, {output: (address, shape, dtype)})
        self.enqueues = 0                           # TensorRT enqueues issued (eager runs and captures)

    def _buffer(self, name: str, nbytes: int):
        key = (name, max(int(nbytes), 1))
        if key not in self.buffers:
            self.buffers[key] = self.gpu.alloc(key[1], np.uint8)
        return self.buffers[key]

    def call(self, feeds: dict, weight) -> dict[str, np.ndarray]:
        staged, shapes = {}, {}
        for name in self.inputs:
            if name in feeds:
                a = np.ascontiguousarray(np.asarray(feeds[name]))
                if a.dtype.name in BF16_NAMES:
                    a = a.view(np.uint16)
                staged[name] = (self._buffer(name, a.nbytes), a)
                shapes[name] = a.shape
            else:
                w = weight(name)
                if w is None:
                    raise KeyError(f"plan {self.kind}: input '{name}' is neither fed nor one of the rank's tensors")
                staged[name] = (w, None)
                shapes[name] = tuple(w.shape)
        key = tuple((n, shapes[n], None if staged[n][1] is not None else int(staged[n][0].ptr)) for n in self.inputs)
        for buf, a in staged.values():                           # feeds written in place (lands before return)
            if a is not None:
                self.gpu.copy_in(buf, a.reshape(-1).view(np.uint8))
        if key in self.graphs:
            graph, outs = self.graphs[key]
            self.gpu.replay(graph)
        else:
            outs = self._bind(staged, shapes)
            if key in self.seen:
                graph = self._capture()
                self.graphs[key] = (graph, outs)
                self.gpu.replay(graph)
            else:
                self._execute(self.gpu.stream)
                self.seen.add(key)
        return {name: DeviceArray(self.gpu, address, shape, dtype).numpy() for name, (address, shape, dtype) in outs.items()}

    def _bind(self, staged: dict, shapes: dict) -> dict:
        """Set every input's shape and address, the outputs' buffers and the context memory; -> the outputs."""
        ctx, addresses = self.ctx, {}
        for name in self.inputs:
            ctx.set_input_shape(name, tuple(shapes[name]))
            addresses[name] = int(staged[name][0].ptr)
        outs = {}
        for name in self.outputs:
            shape = tuple(ctx.get_tensor_shape(name))
            dtype = np.dtype(TRT_NUMPY[self.engine.get_tensor_dtype(name).name])
            aliased = self.engine.get_aliased_input_tensor(name)              # an in-place cache
            addresses[name] = addresses[aliased] if aliased else int(
                self._buffer(name, int(np.prod(shape)) * dtype.itemsize).ptr)
            outs[name] = (addresses[name], shape, dtype)
        for name, address in addresses.items():
            ctx.set_tensor_address(name, address)
        memory = self._buffer("context memory", int(ctx.update_device_memory_size_for_shapes()))
        ctx.set_device_memory(int(memory.ptr), memory.nbytes)
        return outs

    def _execute(self, stream) -> None:
        handle = int(getattr(stream, "stream", stream).handle)     # a graph builder's stream while capturing
        self.enqueues += 1
        if not self.ctx.execute_async_v3(handle):
            raise RuntimeError(f"plan {self.kind}: TensorRT-RTX execute_async_v3 failed")

    def _capture(self):
        handle = int(self.gpu.stream.handle)
        if not self.ctx.is_stream_capturable(handle):
            raise RuntimeError(f"plan {self.kind}: TensorRT-RTX says its stream cannot be captured (a plan built "
                               "without REQUIRE_USER_ALLOCATION, or a data-dependent shape)")
        return self.gpu.capture(self._execute)
