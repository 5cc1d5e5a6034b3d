"""Python IPluginV3 plugins and IPluginCreatorV3One creators for every `ddtree` node (description/nodes.py).

One generic plugin class is parameterised by a NodeSpec: its fields are the node's attributes
(backends/tensorrt/fields.py), its output dtypes and symbolic shapes follow the rules below, outputs that
update an input in place (caches) are aliased through IPluginV3OneBuildV2 (the builder must enable
PreviewFeature.ALIASED_PLUGIN_IO_10_03), and enqueue runs backends/tensorrt/kernels.py. Creators register
under namespace "ddtree" (= the nodes' ONNX domain), plugin name = op type, version "1".

Building a plan calls create_plugin(BUILD), the shape/type/format methods, configure_plugin and
get_fields_to_serialize; running one calls create_plugin(RUNTIME) with the stored fields, then
attach_to_context, on_shape_change and enqueue (docs/tensorrt-rtx.md 3.2-3.3). Register the creators
(`register_creators()`) in any process that builds or deserialises ddtree plans.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ddtree.backends.tensorrt import kernels
from ddtree.backends.tensorrt.fields import attrs_from_fields, field_arrays
from ddtree.backends.tensorrt.loader import import_trt
from ddtree.description.nodes import DOMAIN, NODES, PLUGIN_VERSION, NodeSpec

trt = import_trt()

FIELD_TYPES = {"int": trt.PluginFieldType.INT32, "float": trt.PluginFieldType.FLOAT32,
               "str": trt.PluginFieldType.CHAR, "ints": trt.PluginFieldType.INT32}
DTYPE_NAMES = {trt.DataType.BF16: "bfloat16", trt.DataType.FLOAT: "float32", trt.DataType.INT32: "int32"}
I32, F32 = trt.DataType.INT32, trt.DataType.FLOAT


def output_types(op: str, t: list) -> list:
    """Output dtypes from input dtypes (input indices as in NodeSpec.inputs)."""
    return {"AllReduce": lambda: [t[0]], "AllGather": lambda: [t[0]], "Rope": lambda: [t[0]], "KvAppend": lambda: [t[2]], "KvCompact": lambda: [t[0]],
            "MlaTreeAttention": lambda: [t[0]], "MarlinMoE": lambda: [t[0]],
            "DraftAttention": lambda: [t[0], t[6], t[7]], "VocabWinner": lambda: [t[0], I32],
            "VocabTopK": lambda: [F32, I32, F32, F32], "TreeBuild": lambda: [I32] * 4,
            "AcceptWalk": lambda: [I32] * 4}[op]()


def _dims(*exprs):
    d = trt.DimsExprs(len(exprs))
    for i, e in enumerate(exprs):
        d[i] = e
    return d


def output_shapes(op: str, a: dict, inputs: list, eb) -> list:
    """Symbolic output shapes (DimsExprs) from the input shapes and the attributes."""
    c = eb.constant
    if op in ("AllReduce", "MarlinMoE", "Rope", "MlaTreeAttention", "KvCompact"):
        return [trt.DimsExprs(inputs[0])]
    if op == "AllGather":
        return [_dims(c(a["world_size"]), *(inputs[0][i] for i in range(len(inputs[0]))))]
    if op == "KvAppend":
        return [trt.DimsExprs(inputs[2])]
    if op == "DraftAttention":
        return [_dims(inputs[0][0], c(a["heads"] * a["head_dim"])), trt.DimsExprs(inputs[6]),
                trt.DimsExprs(inputs[7])]
    if op == "VocabWinner":
        return [_dims(inputs[0][0]), _dims(inputs[0][0])]
    if op == "VocabTopK":
        rows = inputs[0][0]
        return [_dims(rows, c(a["k"])), _dims(rows, c(a["k"])), _dims(rows), _dims(rows)]
    if op == "TreeBuild":
        n = a["budget"] + 1
        return [_dims(c(n)), _dims(c(n)), _dims(c(n)), _dims(c(n), c(-(-n // 32)))]
    if op == "AcceptWalk":
        n = inputs[0][0]
        return [_dims(n), _dims(n), _dims(c(1)), _dims(c(1))]
    raise KeyError(op)


class DdtreePlugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuildV2, trt.IPluginV3OneRuntime):
    def __init__(self, spec: NodeSpec, attrs: dict, phase=None):
        trt.IPluginV3.__init__(self)
        trt.IPluginV3OneCore.__init__(self)
        trt.IPluginV3OneBuildV2.__init__(self)
        trt.IPluginV3OneRuntime.__init__(self)
        self.spec, self.attrs, self.phase = spec, dict(attrs), phase
        self.num_outputs = len(spec.outputs)
        self.plugin_namespace = DOMAIN
        self.plugin_name = spec.op
        self.plugin_version = PLUGIN_VERSION
        self.timing_cache_id = ""
        self.runner = None                          # runtime: the node's kernels (attach_to_context)
        self._fields = None                         # get_fields_to_serialize's collection, built once
        _never_freed(self)

    # core / build ----------------------------------------------------------------------------------
    def get_capability_interface(self, capability_type):
        return self

    def get_output_data_types(self, input_types):
        return output_types(self.spec.op, list(input_types))

    def get_output_shapes(self, inputs, shape_inputs, expr_builder):
        return output_shapes(self.spec.op, self.attrs, list(inputs), expr_builder)

    def get_aliased_input(self, output_index: int) -> int:
        return self.spec.aliases.get(output_index, -1)

    def supports_format_combination(self, pos, in_out, num_inputs):
        return in_out[pos].desc.format == trt.TensorFormat.LINEAR

    def configure_plugin(self, inputs, outputs):
        pass

    def get_workspace_size(self, inputs, outputs):
        return 0

    def get_valid_tactics(self):
        return []

    def set_tactic(self, tactic):
        pass

    def get_fields_to_serialize(self):
        # a PluginField points at its array's buffer without holding it: keep the arrays (and the
        # collection) alive on the plugin, or TensorRT serialises freed memory. Built once: TensorRT may hold a
        # collection it was given while it asks again, so a rebuilt one must not free the first (the attributes
        # never change after creation)
        if self._fields is None:
            self._field_arrays = field_arrays(self.spec, self.attrs)
            self._fields = trt.PluginFieldCollection([trt.PluginField(name, arr, FIELD_TYPES[kind])
                                                      for name, arr, kind in self._field_arrays])
        return self._fields

    def clone(self):
        return DdtreePlugin(self.spec, self.attrs, self.phase)

    # runtime ---------------------------------------------------------------------------------------
    def attach_to_context(self, context):
        """A clone of its own for the execution context, with the runner of its node (backends/tensorrt/kernels.py)."""
        plugin = self.clone()
        plugin.runner = kernels.node_runner(self.spec, self.attrs)
        return plugin

    def on_shape_change(self, inputs, outputs):
        """The runner prepares for these shapes: kernels loaded, workspaces allocated (enqueue allocates nothing)."""
        self._runner().prepare(*_dims_types(inputs), *_dims_types(outputs))

    def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
        in_dims, in_types = _dims_types(input_desc)
        out_dims, _ = _dims_types(output_desc)
        self._runner().enqueue(in_dims, in_types, [int(p) for p in inputs], out_dims, [int(p) for p in outputs],
                               int(stream))

    def _runner(self):
        if self.runner is None:
            raise RuntimeError(f"ddtree::{self.spec.op} plugin: used before attach_to_context (TensorRT attaches "
                               "each plugin to its execution context first)")
        return self.runner


def _never_freed(plugin: DdtreePlugin) -> None:
    """One reference no one releases: Python never deallocates a plugin. TensorRT's Python bindings leave the
    Python object of a plugin TensorRT deleted alive and registered at its C++ address (each
    get_capability_interface call keeps a reference, the destructor drops one); when that address is reused
    by another plugin whose Python object is deallocated, the binding's destructor finds and releases the stale
    object instead, until its count reaches zero and its holder deletes memory it no longer owns ("malloc():
    unaligned tcache chunk detected"). tests/backends/test_trt_plans.py::test_plugins_dropped_after_a_build
    reproduces it (every run aborted before this). TensorRT-owned plugins leak their Python objects anyway."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(plugin))


def _dims_types(descs) -> tuple[list, list]:
    """TensorRT tensor descriptors (PluginTensorDesc, or DynamicPluginTensorDesc's .desc) -> dims, dtype names."""
    descs = [getattr(d, "desc", d) for d in descs]
    return [tuple(d.dims) for d in descs], [DTYPE_NAMES.get(d.type, str(d.type)) for d in descs]


class DdtreeCreator(trt.IPluginCreatorV3One):
    def __init__(self, spec: NodeSpec):
        trt.IPluginCreatorV3One.__init__(self)
        self.spec = spec
        self.name = spec.op
        self.plugin_namespace = DOMAIN
        self.plugin_version = PLUGIN_VERSION
        self._empty = {name: np.array([], dtype=np.int8 if kind == "str" else np.float32 if kind == "float"
                                      else np.int32) for name, kind in spec.fields.items()}   # kept alive, as above
        self.field_names = trt.PluginFieldCollection([trt.PluginField(name, self._empty[name], FIELD_TYPES[kind])
                                                      for name, kind in spec.fields.items()])

    def create_plugin(self, name, field_collection, phase):
        fields = [(f.name, np.array(f.data, copy=True)) for f in field_collection]
        attrs = attrs_from_fields(self.spec, fields, f"ddtree::{self.spec.op} plugin {name!r}")
        return DdtreePlugin(self.spec, attrs, phase)


_CREATORS: dict[str, DdtreeCreator] = {}


def register_creators() -> dict[str, DdtreeCreator]:
    """Register one creator per ddtree node with TensorRT's plugin registry (once per process)."""
    registry = trt.get_plugin_registry()
    for op, spec in NODES.items():
        if op not in _CREATORS:
            creator = DdtreeCreator(spec)
            if not registry.register_creator(creator, DOMAIN):
                raise RuntimeError(f"TensorRT refused to register the ddtree::{op} plugin creator")
            _CREATORS[op] = creator
    return _CREATORS
