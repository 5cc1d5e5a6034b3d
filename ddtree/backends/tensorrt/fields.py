"""Node attributes <-> plugin fields, the way the TensorRT-RTX ONNX parser converts them.

    int   -> INT32 [1]         float -> FLOAT32 [1]
    str   -> CHAR, the UTF-8 bytes plus a trailing NUL
    ints  -> INT32 [len]
A plugin keeps its attributes as a dict; get_fields_to_serialize writes these arrays and the
creator reads them back at RUNTIME, so `attrs_from_fields(field_arrays(attrs)) == attrs` exactly
(floats are float32 values, as ONNX stores them). numpy only; creators.py wraps the arrays.
"""
from __future__ import annotations

import numpy as np
import onnx

from ddtree.description.nodes import NodeSpec

NUMPY_OF_KIND = {"int": np.int32, "float": np.float32, "str": np.int8, "ints": np.int32}


def node_attrs(node: onnx.NodeProto) -> dict:
    """An ONNX node's attributes as python values (str for strings, floats widened from float32)."""
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else (list(v) if isinstance(v, (list, tuple)) else v)
    return out


def field_arrays(spec: NodeSpec, attrs: dict) -> list[tuple[str, np.ndarray, str]]:
    """[(field name, array, kind)] in the spec's field order."""
    out = []
    for name, kind in spec.fields.items():
        v = attrs[name]
        if kind == "str":
            arr = np.frombuffer(v.encode() + b"\0", dtype=np.int8).copy()
        elif kind == "ints":
            arr = np.asarray(v, dtype=np.int32)
        else:
            arr = np.asarray([v], dtype=NUMPY_OF_KIND[kind])
        out.append((name, arr, kind))
    return out


def attrs_from_fields(spec: NodeSpec, fields, where: str) -> dict:
    """[(name, data)] as TensorRT hands them to a creator -> attribute dict (checked against the spec)."""
    attrs = {}
    for name, data in fields:
        if name not in spec.fields:
            raise ValueError(f"{where}: unexpected plugin field {name!r}")
        kind, arr = spec.fields[name], np.asarray(data)
        if kind == "str":
            attrs[name] = arr.astype(np.int8).tobytes().split(b"\0")[0].decode()
        elif kind == "ints":
            attrs[name] = [int(x) for x in arr.reshape(-1)]
        elif arr.size != 1:
            raise ValueError(f"{where}: plugin field {name!r} must hold one value, got {arr.size}")
        else:
            attrs[name] = int(arr.reshape(-1)[0]) if kind == "int" else float(np.float32(arr.reshape(-1)[0]))
    spec.check_attrs(attrs, where)
    return attrs
