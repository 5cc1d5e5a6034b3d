"""A small onnx-graphsurgeon builder for the layer graphs: typed inputs, standard ops, `ddtree` nodes.

Dtypes: `act` is the activation dtype of a graph (bfloat16 in the engine's graphs and plans; float64
when a test runs the same graph under onnx.reference against the float64 reference). `acc` is the
dtype of the precision-sensitive parts (RMSNorm, router logits, lm_head logits): float32 when act
is bfloat16, act otherwise. Weights are graph inputs in their stored dtype and are cast to act
(bf16 -> float64 is exact), so one graph description serves both.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto

from ddtree.description.nodes import DOMAIN, node_spec

OPSET = 21
ACT_DTYPES = {"bfloat16": TensorProto.BFLOAT16, "float32": TensorProto.FLOAT, "float64": TensorProto.DOUBLE}
STORED_DTYPES = {"BF16": TensorProto.BFLOAT16, "F32": TensorProto.FLOAT, "I32": TensorProto.INT32,
                 "I64": TensorProto.INT64}
INT32, FLOAT = TensorProto.INT32, TensorProto.FLOAT


class GraphBuilder:
    def __init__(self, name: str, act: str):
        if act not in ACT_DTYPES:
            raise ValueError(f"graph {name}: activation dtype {act!r} is not one of {', '.join(ACT_DTYPES)}")
        self.name = name
        self.act = ACT_DTYPES[act]
        self.acc = FLOAT if self.act == TensorProto.BFLOAT16 else self.act
        self.graph = gs.Graph(opset=OPSET, name=name)
        self.metadata: dict[str, str] = {}
        self._count = 0

    # tensors -----------------------------------------------------------------------------------
    def _fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def input(self, name: str, dtype, shape) -> gs.Variable:
        v = gs.Variable(name, dtype=dtype, shape=list(shape))
        self.graph.inputs.append(v)
        return v

    def weight(self, name: str, spec) -> gs.Variable:
        """A weight input named like its rank safetensors tensor (spec: model.tensors.TensorSpec)."""
        if spec.dtype not in STORED_DTYPES:
            raise ValueError(f"graph {self.name}: weight '{name}' has dtype {spec.dtype}; graphs take "
                             f"{', '.join(STORED_DTYPES)}")
        return self.input(name, STORED_DTYPES[spec.dtype], spec.shape)

    def const(self, values, dtype=None) -> gs.Constant:
        arr = np.asarray(values, dtype=dtype)
        return gs.Constant(self._fresh("const"), values=arr)

    def const_acc(self, value: float) -> gs.Constant:
        return self.const(np.array(value, dtype=onnx.helper.tensor_dtype_to_np_dtype(self.acc)))

    def output(self, x: gs.Variable, name: str, dtype, shape) -> gs.Variable:
        """Expose node output x as the graph output `name` with a declared dtype and shape (renamed, not
        copied through an Identity, so an aliased plugin output stays the engine's output)."""
        if x in self.graph.inputs:
            raise ValueError(f"graph {self.name}: output {name} would be the graph input {x.name}")
        x.name, x.dtype, x.shape = name, dtype, list(shape)
        self.graph.outputs.append(x)
        return x

    def outputs(self, xs) -> None:
        """Expose `ddtree` node outputs (already named and typed) as graph outputs."""
        for x in xs:
            self.output(x, x.name, x.dtype, x.shape)

    # ops ---------------------------------------------------------------------------------------
    def op(self, op: str, inputs, attrs=None, dtype=None, shape=None, name: str | None = None) -> gs.Variable:
        out = gs.Variable(name or self._fresh(op.lower()), dtype=dtype, shape=shape)
        self.graph.nodes.append(gs.Node(op, inputs=list(inputs), outputs=[out], attrs=attrs or {},
                                        name=self._fresh(op)))
        return out

    def node(self, op: str, inputs, attrs: dict, outputs: list[tuple[str, int, list]], name: str) -> list:
        """A `ddtree` node; outputs = [(name, dtype, shape)], declared so TensorRT and checkers see them."""
        spec = node_spec(op)
        spec.check_attrs(attrs, f"graph {self.name} node {name}")
        if len(inputs) != len(spec.inputs) or len(outputs) != len(spec.outputs):
            raise ValueError(f"graph {self.name} node {name}: ddtree::{op} takes {len(spec.inputs)} inputs and "
                             f"{len(spec.outputs)} outputs, got {len(inputs)} and {len(outputs)}")
        outs = [gs.Variable(n, dtype=dt, shape=None if s is None else list(s)) for n, dt, s in outputs]
        self.graph.nodes.append(gs.Node(op, domain=DOMAIN, name=name, attrs=dict(attrs),
                                        inputs=list(inputs), outputs=outs))
        return outs

    def cast(self, x, to) -> gs.Variable:
        if getattr(x, "dtype", None) is not None and _same(x.dtype, to):
            return x
        return self.op("Cast", [x], {"to": to}, dtype=to)

    def linear(self, x, w) -> gs.Variable:
        """x [m, K] @ W[N, K]^T -> [m, N] in act."""
        return self.op("Gemm", [x, self.cast(w, self.act)], {"transB": 1}, dtype=self.act)

    def linear_acc(self, x, w) -> gs.Variable:
        """Same in acc (float32 logits from bf16 activations)."""
        return self.op("Gemm", [self.cast(x, self.acc), self.cast(w, self.acc)], {"transB": 1}, dtype=self.acc)

    def rms_norm(self, x, w, eps: float) -> gs.Variable:
        """w * x / sqrt(mean(x^2) + eps) over the last axis, computed in acc, returned in act."""
        xa = self.cast(x, self.acc)
        mean_square = self.op("ReduceMean", [self.op("Mul", [xa, xa]), self.const([-1], np.int64)], {"keepdims": 1})
        root = self.op("Sqrt", [self.op("Add", [mean_square, self.const_acc(eps)])])
        y = self.op("Mul", [self.cast(w, self.acc), self.op("Div", [xa, root])], dtype=self.acc)
        return self.cast(y, self.act)

    def swiglu(self, x, gate, up, down) -> gs.Variable:
        """down(silu(x gate^T) * x up^T): the dense MLP slice of a rank."""
        g = self.linear(x, gate)
        hidden = self.op("Mul", [self.op("Mul", [g, self.op("Sigmoid", [g])]), self.linear(x, up)])
        return self.linear(hidden, down)

    def reshape(self, x, shape) -> gs.Variable:
        """Reshape with 0 = keep that input dim (so zero-length token dims stay valid)."""
        return self.op("Reshape", [x, self.const(list(shape), np.int64)])

    def slice(self, x, axis: int, start: int, stop: int) -> gs.Variable:
        return self.op("Slice", [x, self.const([start], np.int64), self.const([stop], np.int64),
                                 self.const([axis], np.int64)])

    def add(self, a, b) -> gs.Variable:
        return self.op("Add", [a, b], dtype=self.act)

    # export ------------------------------------------------------------------------------------
    def export(self) -> onnx.ModelProto:
        self.graph.cleanup().toposort()
        model = gs.export_onnx(self.graph)
        model.producer_name = "ddtree"
        for key, value in self.metadata.items():
            model.metadata_props.add(key=key, value=value)
        onnx.checker.check_model(model)
        return model


def onnx_dtype(dtype) -> int:
    """A graphsurgeon dtype (ONNX enum int or numpy type) as the ONNX enum."""
    if isinstance(dtype, int):
        return dtype
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def _same(dtype, to) -> bool:
    return onnx_dtype(dtype) == to
