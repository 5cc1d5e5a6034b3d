"""Thin GPU runtime over cuda.core (modules, launches, graphs, events) and cuda.bindings.driver
(raw device memory). Imported only where a GPU is used: `import ddtree` never needs cuda-python.

    gpu = Gpu()                                   # device 0, current, one non-blocking stream
    x = gpu.upload(np_array)                      # DeviceArray (ptr, shape, dtype)
    k = gpu.kernel("moe.cu", "moe_route")         # cubin for this GPU's arch, compiled once and cached
    a = gpu.kernel("mla_decode.cu", "mla_decode_r1_k2_s4", latent_defines(64, 16))   # per-model defines
    gpu.launch(k, grid, block, smem, x, np.int32(n), ...)
    y = x.numpy()
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from ddtree.plugins.compile import compile_cubin, defines_for


def _driver():
    from cuda.bindings import driver  # cuda: the cuda extra
    return driver


def check(result, what: str = "CUDA call"):
    """Unwrap a cuda.bindings (err, *values) tuple, raising with the call's name on failure."""
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else (tuple(values) or None)


def ptr(obj) -> np.uint64:
    """A kernel pointer argument: DeviceArray, int address, or None (null)."""
    if obj is None:
        return np.uint64(0)
    if isinstance(obj, DeviceArray):
        return np.uint64(obj.ptr)
    return np.uint64(int(obj))


def set_words(address: int, words, stream) -> None:
    """32-bit words stored from `address` in stream order, one cuMemsetD32Async each: capturable, no host sync
    (per-step parameters a graph reads). stream: a cuda.core stream, or a graph builder while capturing."""
    handle = getattr(stream, "stream", stream).handle
    for i, word in enumerate(words):
        check(_driver().cuMemsetD32Async(int(address) + 4 * i, int(word), 1, handle), "cuMemsetD32Async")


@dataclass
class DeviceArray:
    """Raw device allocation with a numpy shape/dtype view of it (freed by Gpu.free or at exit)."""
    gpu: "Gpu"
    ptr: int
    shape: tuple
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def numpy(self) -> np.ndarray:
        return self.gpu.download(self)

    def view(self, offset_elems: int, shape) -> "DeviceArray":
        """A sub-array starting offset_elems into this one (no copy, not owning)."""
        return DeviceArray(self.gpu, self.ptr + offset_elems * np.dtype(self.dtype).itemsize, tuple(shape), self.dtype)


def kernel_node_priorities(definition) -> dict[int, int]:
    """{priority: kernel nodes} of a captured graph definition (cuda.core GraphDefinition): the priority each
    kernel node took from its capturing stream (lower numbers run first)."""
    driver = _driver()
    attr = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PRIORITY
    counts: dict[int, int] = {}
    for node in definition.nodes():
        if node.type == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            value = check(driver.cuGraphKernelNodeGetAttribute(node.handle, attr), "cuGraphKernelNodeGetAttribute")
            p = int(value.priority)
            counts[p] = counts.get(p, 0) + 1
    return counts


class Gpu:
    def __init__(self, device_id: int = 0):
        from cuda.core import Device  # cuda: the cuda extra
        self.dev = Device(device_id)
        self.dev.set_current()
        self.stream = self.dev.create_stream()
        props = self.dev.properties
        self.arch = f"sm_{props.compute_capability_major}{props.compute_capability_minor}"
        self.name = self.dev.name
        self.sm_count = props.multiprocessor_count
        self.smem_optin = props.max_shared_memory_per_block_optin
        self.l2_bytes = props.l2_cache_size
        self._modules: dict[tuple, object] = {}        # (source, defines) -> module
        self._kernels: dict[tuple, object] = {}        # (source, defines, name) -> kernel
        self._smem_set: dict[tuple, int] = {}
        self._allocs: list[int] = []
        self._host_allocs: list[int] = []
        self._priority_stream = None                     # capture(main_first=True)'s stream
        self.capture_priorities: dict[int, int] = {}     # the last capture(main_first=True): kernel nodes a priority

    # ---- modules and launches -------------------------------------------------------------
    def defines(self, source: str) -> dict[str, int]:
        """Compile-time constants of `source` on this GPU (ring depth, warps): launchers size smem with them."""
        return defines_for(source, self.arch)

    def kernel(self, source: str, name: str, defines: dict[str, int] | None = None, arch: str | None = None):
        """`defines`: extra compile-time constants (the model's latent dims: compile.latent_defines); one
        module per (source, defines, arch). `arch` compiles for another arch than the device's own (sm_90a's
        wgmma kernels on an sm_90 GPU); None: the device's."""
        module_key = (source, tuple(sorted((defines or {}).items())), arch)
        key = (*module_key, name)
        if key not in self._kernels:
            if module_key not in self._modules:
                from cuda.core import ObjectCode  # cuda: the cuda extra
                path = compile_cubin(source, arch or self.arch, defines)
                self._modules[module_key] = ObjectCode.from_cubin(path.read_bytes(), name=source)
            self._kernels[key] = self._modules[module_key].get_kernel(name)
        return self._kernels[key]

    def module_global(self, source: str, name: str, defines: dict[str, int] | None = None,
                      arch: str | None = None) -> int:
        """Device address of the __device__ global `name` in the loaded module of (source, defines, arch), keyed as
        kernel() keys it: the trace and stamp buffers of diagnosis builds (tests/plugins/profile_*.py)."""
        key = (source, tuple(sorted((defines or {}).items())), arch)
        if key not in self._modules:
            raise KeyError(f"no module of {source} with defines {defines} (arch {arch}) is loaded; loaded: "
                           f"{sorted(k for k in self._modules if k[0] == source)}")
        driver = _driver()
        handle = self._modules[key].handle
        getter = driver.cuLibraryGetGlobal if isinstance(handle, driver.CUlibrary) else driver.cuModuleGetGlobal
        return int(check(getter(handle, name.encode()), f"get {name} of {source}")[0])

    def allow_smem(self, source: str, name: str, nbytes: int, defines: dict[str, int] | None = None,
                   arch: str | None = None) -> None:
        """Raise a kernel's dynamic shared-memory limit; checked against the device. The default limit is 48 KB
        less the kernel's static shared memory (router.cu's 16 B: its 49152 B plan at 46 rows failed to launch
        in a fresh process), so any dynamic size sets the attribute once per kernel and size rather than trusting 48 KB."""
        if nbytes > self.smem_optin:
            raise ValueError(f"{source}:{name} needs {nbytes} B of shared memory; {self.name} allows {self.smem_optin}")
        key = (source, tuple(sorted((defines or {}).items())), arch, name)
        if self._smem_set.get(key, 0) >= nbytes or nbytes <= 0:
            return
        driver = _driver()
        handle = self.kernel(source, name, defines, arch).handle
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if isinstance(handle, driver.CUkernel):
            check(driver.cuKernelSetAttribute(attr, nbytes, handle, driver.CUdevice(self.dev.device_id)),
                  "cuKernelSetAttribute")
        else:
            check(driver.cuFuncSetAttribute(handle, attr, nbytes), "cuFuncSetAttribute")
        self._smem_set[key] = nbytes

    def launch(self, kernel, grid, block, smem: int, *args, stream=None, pdl: bool = False, cluster=None) -> None:
        """pdl: programmatic dependent launch (the kernel may start before the previous one in the stream
        ends; it must call griddepcontrol.wait before reading that kernel's results). cluster: thread block
        cluster dims (sm_90+); `grid` then counts clusters (cuda.core's LaunchConfig)."""
        from cuda.core import LaunchConfig, launch  # cuda: the cuda extra
        extra = {} if cluster is None else {"cluster": cluster}
        config = LaunchConfig(grid=grid, block=block, shmem_size=int(smem), programmatic_stream_serialization=pdl,
                              **extra)
        launch(stream if stream is not None else self.stream, config, kernel, *args)

    # ---- memory ---------------------------------------------------------------------------
    def alloc(self, shape, dtype) -> DeviceArray:
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        address = int(check(_driver().cuMemAlloc(nbytes), f"cuMemAlloc({nbytes} B)"))
        self._allocs.append(address)
        return DeviceArray(self, address, shape, np.dtype(dtype))

    def mapped(self, shape, dtype) -> tuple[np.ndarray, int]:
        """Host memory the device writes directly (pinned, mapped): (a zeroed numpy view, its device address).
        A kernel's writes are visible to the host once the kernel is known to have finished (an event or a
        sync); the host reads, never writes, while the GPU may be writing."""
        driver = _driver()
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        host = int(check(driver.cuMemHostAlloc(nbytes, driver.CU_MEMHOSTALLOC_DEVICEMAP), f"cuMemHostAlloc({nbytes} B)"))
        self._host_allocs.append(host)
        device = int(check(driver.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
        view = np.frombuffer((ctypes.c_char * nbytes).from_address(host), dtype=dtype, count=nbytes // np.dtype(dtype).itemsize)
        view = view.reshape(shape)
        view[...] = 0
        return view, device

    def zeros(self, shape, dtype) -> DeviceArray:
        a = self.alloc(shape, dtype)
        self.memset(a, 0)
        return a

    def upload(self, array: np.ndarray) -> DeviceArray:
        array = np.ascontiguousarray(array)
        a = self.alloc(array.shape, array.dtype)
        self._host_to_device(a.ptr, array)
        return a

    def copy_in(self, dst: DeviceArray, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=dst.dtype)
        if array.nbytes > dst.nbytes:
            raise ValueError(f"copy_in: {array.nbytes} B do not fit in {dst.nbytes} B")
        self._host_to_device(dst.ptr, array)

    def _host_to_device(self, ptr: int, array: np.ndarray) -> None:
        """The bytes at ptr on return, and ordered after this stream's work. Not cuMemcpyHtoD: from pageable memory
        it returns once the bytes are staged, before they land, and it runs on the legacy stream, which this Gpu's
        non-blocking stream does not wait for, so a kernel launched next could read the old bytes."""
        if array.nbytes:
            check(_driver().cuMemcpyHtoDAsync(ptr, array.ctypes.data, array.nbytes, self.stream.handle),
                  "cuMemcpyHtoDAsync")
        self.sync()

    def download(self, a: DeviceArray) -> np.ndarray:
        self.sync()
        out = np.empty(a.shape, dtype=a.dtype)
        check(_driver().cuMemcpyDtoH(out.ctypes.data, a.ptr, out.nbytes), "cuMemcpyDtoH")
        return out

    def memset(self, a: DeviceArray, byte: int) -> None:
        check(_driver().cuMemsetD8Async(a.ptr, byte, a.nbytes, self.stream.handle), "cuMemsetD8Async")

    def copy_d2d(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        s = stream if stream is not None else self.stream
        handle = getattr(s, "stream", s).handle             # a graph builder's stream while capturing
        check(_driver().cuMemcpyDtoDAsync(dst, src, nbytes, handle), "cuMemcpyDtoDAsync")

    def free_all(self) -> None:
        self.sync()
        for address in self._allocs:
            check(_driver().cuMemFree(address), "cuMemFree")
        for address in self._host_allocs:
            check(_driver().cuMemFreeHost(address), "cuMemFreeHost")
        self._allocs.clear()
        self._host_allocs.clear()

    def bind_thread(self) -> None:
        """This GPU's context current on the calling thread. cuda.core's Device objects are per thread: the one
        made at load is initialised on the loading thread only, and a graph builder's split on another thread asks
        that thread's own Device, which must be set current there too."""
        from cuda.core import Device  # cuda: the cuda extra
        Device(self.dev.device_id).set_current()

    # ---- sync, timing, graphs -------------------------------------------------------------
    def sync(self) -> None:
        self.stream.sync()

    def timed_ms(self, fn, repeats: int = 1) -> list[float]:
        """Run fn() `repeats` times on the stream, each between two timing events; ms per run."""
        from cuda.core import EventOptions  # cuda: the cuda extra
        opts = EventOptions(timing_enabled=True)
        times = []
        for _ in range(repeats):
            start = self.stream.record(options=opts)
            fn()
            end = self.stream.record(options=opts)
            end.sync()
            times.append(end - start)
        return times

    def capture(self, fn, main_first: bool = False):
        """Record fn(stream_like) into a CUDA graph; returns the executable graph (launch with replay).
        main_first: the kernels fn launches on the builder it is given run at the GPU's greatest stream priority,
        those on the builders it splits off (parallel branches) at the default, lowest one: a graph's kernel node
        takes its capturing stream's priority, and the graph is instantiated to use the nodes' priorities. The
        block scheduler then places a main-chain kernel's waiting blocks before a branch's (neither preempts a
        running block)."""
        from cuda.core.graph import GraphCompleteOptions  # cuda: the cuda extra
        stream = self._main_first_stream() if main_first else self.stream
        builder = stream.create_graph_builder()
        builder.begin_building()
        try:
            fn(builder)
        except BaseException:
            builder.end_building()                       # leave the stream usable, then report the real error
            raise
        built = builder.end_building()
        if main_first:
            self.capture_priorities = kernel_node_priorities(built.graph_definition)
        graph = built.complete(GraphCompleteOptions(use_node_priority=True) if main_first else None)
        graph.upload(self.stream)
        return graph

    def _main_first_stream(self):
        """A stream at the context's greatest priority (created once): the captures of capture(main_first=True)."""
        if self._priority_stream is None:
            from cuda.core import StreamOptions  # cuda: the cuda extra
            _, greatest = check(_driver().cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
            self._priority_stream = self.dev.create_stream(options=StreamOptions(priority=int(greatest)))
        return self._priority_stream

    def replay(self, graph) -> None:
        graph.launch(self.stream)
