"""A small Python API to define models directly in the IR.

Example::

    b = GraphBuilder("tiny")
    x = b.input("x", (None, 3, 32, 32))
    y = b.relu(b.conv(x, np.random.randn(8, 3, 3, 3).astype("float32"), pads=1))
    b.output(b.softmax(b.linear(b.flatten(b.global_avg_pool(y)), np.ones((8, 2), "float32"))))
    graph = b.build()
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.ir import Graph, Node, Shape, TensorInfo
from engine.ops import infer_shapes


class GraphBuilder:
    """Builds a :class:`Graph` op by op; each method returns the output tensor's name.

    >>> b = GraphBuilder(); x = b.input("x", (None, 4)); b.output(b.relu(x))
    >>> [n.op for n in b.build().nodes]
    ['Relu']
    """

    def __init__(self, name: str = "graph") -> None:
        self.graph = Graph(inputs=[], outputs=[], name=name)
        self._count = 0

    def _name(self, base: str) -> str:
        self._count += 1
        return f"{base}_{self._count}"

    def input(self, name: str, shape: Shape, dtype: str = "float32") -> str:
        self.graph.inputs.append(TensorInfo(name, tuple(shape), np.dtype(dtype)))
        return name

    def weight(self, value: np.ndarray, name: str | None = None) -> str:
        name = name or self._name("w")
        self.graph.weights[name] = np.ascontiguousarray(value)
        return name

    def _ref(self, t: str | np.ndarray) -> str:
        return self.weight(t) if isinstance(t, np.ndarray) else t

    def op(self, op: str, inputs: Sequence[str | np.ndarray | None], n_out: int = 1, **attrs) -> str:
        """Append a node of any supported op; returns its (first) output."""
        name = self._name(op.lower())
        outs = [f"{name}:{i}" if n_out > 1 else name for i in range(n_out)]
        ins = ["" if t is None else self._ref(t) for t in inputs]
        self.graph.nodes.append(Node(op, ins, outs, attrs, name))
        return outs[0]

    def output(self, *names: str) -> None:
        self.graph.outputs.extend(names)

    def build(self) -> Graph:
        """Validate (DAG, shapes) and return the graph."""
        self.graph.validate()
        infer_shapes(self.graph)
        return self.graph

    # -- convenience wrappers -------------------------------------------------------------
    def conv(self, x: str, w: str | np.ndarray, b: str | np.ndarray | None = None, *, strides: int = 1,
             pads: int = 0, group: int = 1, dilations: int = 1) -> str:
        k = (self.graph.weights[w] if isinstance(w, str) else w).shape[2:]
        return self.op("Conv", [x, w, b], kernel_shape=list(k), strides=[strides] * 2, pads=[pads] * 4,
                       group=group, dilations=[dilations] * 2)

    def batch_norm(self, x: str, scale, bias, mean, var, epsilon: float = 1e-5) -> str:
        return self.op("BatchNormalization", [x, scale, bias, mean, var], epsilon=epsilon)

    def relu(self, x: str) -> str:
        return self.op("Relu", [x])

    def relu6(self, x: str) -> str:
        return self.op("Clip", [x], min=0.0, max=6.0)

    def hard_swish(self, x: str) -> str:
        return self.op("HardSwish", [x])

    def hard_sigmoid(self, x: str, alpha: float = 0.2, beta: float = 0.5) -> str:
        return self.op("HardSigmoid", [x], alpha=alpha, beta=beta)

    def sigmoid(self, x: str) -> str:
        return self.op("Sigmoid", [x])

    def softmax(self, x: str, axis: int = -1) -> str:
        return self.op("Softmax", [x], axis=axis)

    def add(self, a: str | np.ndarray, b: str | np.ndarray) -> str:
        return self.op("Add", [a, b])

    def mul(self, a: str | np.ndarray, b: str | np.ndarray) -> str:
        return self.op("Mul", [a, b])

    def max_pool(self, x: str, kernel: int, strides: int = 1, pads: int = 0) -> str:
        return self.op("MaxPool", [x], kernel_shape=[kernel] * 2, strides=[strides] * 2, pads=[pads] * 4)

    def avg_pool(self, x: str, kernel: int, strides: int = 1, pads: int = 0) -> str:
        return self.op("AveragePool", [x], kernel_shape=[kernel] * 2, strides=[strides] * 2, pads=[pads] * 4)

    def global_avg_pool(self, x: str) -> str:
        return self.op("GlobalAveragePool", [x])

    def flatten(self, x: str, axis: int = 1) -> str:
        return self.op("Flatten", [x], axis=axis)

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        return self.op("Reshape", [x, np.asarray(shape, dtype=np.int64)])

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        return self.op("Transpose", [x], perm=list(perm))

    def concat(self, xs: Sequence[str], axis: int) -> str:
        return self.op("Concat", list(xs), axis=axis)

    def slice(self, x: str, starts: Sequence[int], ends: Sequence[int], axes: Sequence[int],
              steps: Sequence[int] | None = None) -> str:
        return self.op("Slice", [x], starts=list(starts), ends=list(ends), axes=list(axes),
                       steps=list(steps or [1] * len(starts)))

    def pad(self, x: str, pads: Sequence[int], value: float = 0.0) -> str:
        return self.op("Pad", [x], pads=list(pads), value=value)

    def matmul(self, a: str, b: str | np.ndarray) -> str:
        return self.op("MatMul", [a, b])

    def linear(self, x: str, w: str | np.ndarray, b: str | np.ndarray | None = None) -> str:
        """``x @ w + b`` with ``w`` of shape (in, out)."""
        return self.op("Gemm", [x, w, b])
