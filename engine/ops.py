"""Op definitions: attribute defaults and shape inference for every op the engine knows.

Shape inference runs with concrete input shapes (a session binds the batch) and folds the small
integer "shape arithmetic" subgraphs exporters emit (Shape -> Slice -> Concat -> Reshape) into
constants, so every tensor downstream has a static shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from engine.ir import Graph, GraphError, Node, TensorInfo

ConcreteShape = tuple[int, ...]
# A shape function receives the node, its input infos and a constant lookup (array or None).
ShapeFn = Callable[[Node, list[TensorInfo], Callable[[str], np.ndarray | None]], list[tuple]]

ACTIVATIONS = ("Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid", "Relu6")
ELEMENTWISE_UNARY = ("Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid", "Identity", "Dropout")
BINARY = ("Add", "Mul", "Sub", "Div")
RASTER_OPS = ("Transpose", "Concat", "Slice", "Pad")
VIEW_OPS = ("Reshape", "Flatten", "Identity", "Dropout", "Squeeze", "Unsqueeze")

_SHAPES: dict[str, ShapeFn] = {}


def shape_fn(*ops: str) -> Callable[[ShapeFn], ShapeFn]:
    def register(fn: ShapeFn) -> ShapeFn:
        for op in ops:
            _SHAPES[op] = fn
        return fn

    return register


def supported_ops() -> set[str]:
    return set(_SHAPES)


def conv_attrs(node: Node, w_shape: tuple) -> dict[str, Any]:
    """Conv/pool attributes normalised to 2-D lists (kernel, strides, pads t,l,b,r, dilations)."""
    a = node.attrs
    k = list(a.get("kernel_shape") or w_shape[2:])
    nd = len(k)
    pads = list(a.get("pads", [0] * (2 * nd)))
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID", b"NOTSET", b"VALID"):
        raise GraphError(f"node {node}: auto_pad={a['auto_pad']!r} is not supported")
    return {
        "kernel": k,
        "strides": list(a.get("strides", [1] * nd)),
        "pads": pads,
        "dilations": list(a.get("dilations", [1] * nd)),
        "group": int(a.get("group", 1)),
    }


def _out_hw(in_hw, kernel, strides, pads, dilations, ceil=False):
    nd = len(kernel)
    out = []
    for i in range(nd):
        span = dilations[i] * (kernel[i] - 1) + 1
        total = in_hw[i] + pads[i] + pads[i + nd] - span
        out.append((-(-total // strides[i]) if ceil else total // strides[i]) + 1)
    return out


@shape_fn("Conv")
def _conv(node, ins, const):
    x, w = ins[0].shape, ins[1].shape
    a = conv_attrs(node, w)
    if x[1] != w[1] * a["group"]:
        raise GraphError(f"node {node}: input has {x[1]} channels, weight expects {w[1]}x{a['group']}")
    return [(x[0], w[0], *_out_hw(x[2:], a["kernel"], a["strides"], a["pads"], a["dilations"]))]


@shape_fn("MaxPool", "AveragePool")
def _pool(node, ins, const):
    x = ins[0].shape
    a = conv_attrs(node, (0, 0, *node.attrs["kernel_shape"]))
    ceil = bool(node.attrs.get("ceil_mode"))
    hw = _out_hw(x[2:], a["kernel"], a["strides"], a["pads"], a["dilations"], ceil)
    return [(x[0], x[1], *hw)]


@shape_fn("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(node, ins, const):
    x = ins[0].shape
    return [(x[0], x[1]) + (1,) * (len(x) - 2)]


# Channel-blocked (NCHWc) ops written by engine/layout.py: activations are (N, C/16, H, W, 16).
NCHWC_BLOCK = 16


def _blocked_hw(node, x_hw):
    a = conv_attrs(node, (0, 0, *node.attrs["kernel_shape"]))
    return _out_hw(x_hw, a["kernel"], a["strides"], a["pads"], a["dilations"], bool(node.attrs.get("ceil_mode")))


@shape_fn("NchwcConv", "NchwcDepthwiseConv")
def _nchwc_conv(node, ins, const):
    x, w = ins[0].shape, ins[1].shape
    return [(x[0], w[0], *_blocked_hw(node, x[2:4]), NCHWC_BLOCK)]


@shape_fn("NchwcMaxPool")
def _nchwc_pool(node, ins, const):
    x = ins[0].shape
    return [(x[0], x[1], *_blocked_hw(node, x[2:4]), NCHWC_BLOCK)]


@shape_fn("NchwcGlobalAveragePool", "NchwcGlobalMaxPool")
def _nchwc_global_pool(node, ins, const):
    x = ins[0].shape
    return [(x[0], x[1], 1, 1, NCHWC_BLOCK)]


@shape_fn("ReorderInput")
def _reorder_input(node, ins, const):
    n, c, h, w = ins[0].shape
    return [(n, -(-c // NCHWC_BLOCK), h, w, NCHWC_BLOCK)]


@shape_fn("ReorderOutput")
def _reorder_output(node, ins, const):
    n, _, h, w, _ = ins[0].shape
    return [(n, int(node.attrs["channels"]), h, w)]


@shape_fn(*ELEMENTWISE_UNARY, "Softmax", "BatchNormalization")
def _same(node, ins, const):
    return [ins[0].shape]


def broadcast(*shapes: tuple) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError as e:
        raise GraphError(f"shapes {shapes} do not broadcast") from e


@shape_fn(*BINARY)
def _binary(node, ins, const):
    return [broadcast(ins[0].shape, ins[1].shape)]


@shape_fn("MatMul")
def _matmul(node, ins, const):
    a, b = ins[0].shape, ins[1].shape
    if a[-1] != b[-2 if len(b) > 1 else 0]:
        raise GraphError(f"node {node}: MatMul {a} x {b}")
    batch = broadcast(a[:-2], b[:-2])
    return [(*batch, a[-2], b[-1]) if len(b) > 1 else (*a[:-1],)]


@shape_fn("Gemm")
def _gemm(node, ins, const):
    a, b = ins[0].shape, ins[1].shape
    m = a[1] if node.attrs.get("transA") else a[0]
    n = b[0] if node.attrs.get("transB") else b[1]
    return [(m, n)]


def reshape_target(in_shape: tuple, spec: np.ndarray, allowzero: bool = False) -> tuple:
    """ONNX Reshape semantics: 0 copies the input dim (unless allowzero), -1 is inferred."""
    out = [int(s) for s in spec]
    for i, s in enumerate(out):
        if s == 0 and not allowzero:
            out[i] = in_shape[i]
    if -1 in out:
        known = int(np.prod([s for s in out if s != -1]))
        out[out.index(-1)] = int(np.prod(in_shape)) // max(known, 1)
    if int(np.prod(out)) != int(np.prod(in_shape)):
        raise GraphError(f"cannot reshape {in_shape} to {tuple(spec)}")
    return tuple(out)


@shape_fn("Reshape")
def _reshape(node, ins, const):
    spec = const(node.inputs[1])
    if spec is None:
        raise GraphError(f"node {node}: Reshape target shape is not a constant")
    return [reshape_target(ins[0].shape, spec, bool(node.attrs.get("allowzero")))]


@shape_fn("Flatten")
def _flatten(node, ins, const):
    x = ins[0].shape
    axis = node.attrs.get("axis", 1) % max(len(x), 1)
    return [(int(np.prod(x[:axis])), int(np.prod(x[axis:])))]


def axes_of(node: Node, const, rank: int, attr: str = "axes", input_index: int = 1) -> list[int]:
    axes = node.attrs.get(attr)
    if axes is None and len(node.inputs) > input_index and node.inputs[input_index]:
        axes = const(node.inputs[input_index])
    return [int(a) % rank for a in (axes if axes is not None else [])]


@shape_fn("Squeeze")
def _squeeze(node, ins, const):
    x = ins[0].shape
    axes = axes_of(node, const, len(x)) or [i for i, d in enumerate(x) if d == 1]
    return [tuple(d for i, d in enumerate(x) if i not in axes)]


@shape_fn("Unsqueeze")
def _unsqueeze(node, ins, const):
    x = list(ins[0].shape)
    axes = node.attrs.get("axes")
    if axes is None:
        axes = const(node.inputs[1])
    for a in sorted(int(a) % (len(x) + len(axes)) for a in axes):
        x.insert(a, 1)
    return [tuple(x)]


@shape_fn("Transpose")
def _transpose(node, ins, const):
    x = ins[0].shape
    perm = node.attrs.get("perm") or list(range(len(x)))[::-1]
    return [tuple(x[p] for p in perm)]


@shape_fn("Concat")
def _concat(node, ins, const):
    axis = node.attrs["axis"] % len(ins[0].shape)
    out = list(ins[0].shape)
    out[axis] = sum(t.shape[axis] for t in ins)
    return [tuple(out)]


def slice_params(node: Node, const, shape: tuple) -> list[tuple[int, int, int]]:
    """Per-axis (start, stop, step) of an ONNX Slice, clamped like numpy."""
    def get(i, attr):
        if attr in node.attrs:
            return list(node.attrs[attr])
        if len(node.inputs) > i and node.inputs[i]:
            v = const(node.inputs[i])
            if v is None:
                raise GraphError(f"node {node}: Slice input {i} is not a constant")
            return [int(s) for s in v]
        return None

    starts, ends = get(1, "starts"), get(2, "ends")
    axes = get(3, "axes") or list(range(len(starts)))
    steps = get(4, "steps") or [1] * len(starts)
    params = [(0, d, 1) for d in shape]
    for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
        a %= len(shape)
        params[a] = slice(s, e, st).indices(shape[a])
    return params


@shape_fn("Slice")
def _slice(node, ins, const):
    params = slice_params(node, const, ins[0].shape)
    return [tuple(len(range(*p)) for p in params)]


def pad_params(node: Node, const, rank: int) -> tuple[list[int], float]:
    """ONNX Pad's begin+end pads (2*rank ints) and the constant value; only mode=constant."""
    mode = node.attrs.get("mode", "constant")
    if mode not in ("constant", b"constant"):
        raise GraphError(f"node {node}: Pad mode {mode!r} is not supported")
    pads = node.attrs.get("pads")
    if pads is None:
        pads = [int(p) for p in const(node.inputs[1])]
    value = node.attrs.get("value", 0.0)
    if len(node.inputs) > 2 and node.inputs[2]:
        value = float(const(node.inputs[2]).reshape(-1)[0])
    if len(node.inputs) > 3 and node.inputs[3]:
        axes = [int(a) % rank for a in const(node.inputs[3])]
        full = [0] * (2 * rank)
        for i, a in enumerate(axes):
            full[a], full[a + rank] = pads[i], pads[i + len(axes)]
        pads = full
    if any(p < 0 for p in pads):
        raise GraphError(f"node {node}: negative pads are not supported")
    return list(pads), float(value)


@shape_fn("Pad")
def _pad(node, ins, const):
    x = ins[0].shape
    pads, _ = pad_params(node, const, len(x))
    return [tuple(d + pads[i] + pads[i + len(x)] for i, d in enumerate(x))]


@shape_fn("Shape")
def _shape(node, ins, const):
    return [(len(ins[0].shape),)]


@shape_fn("Gather")
def _gather(node, ins, const):
    x, idx = ins[0].shape, ins[1].shape
    axis = node.attrs.get("axis", 0) % len(x)
    return [x[:axis] + tuple(idx) + x[axis + 1 :]]


@shape_fn("ReduceMean")
def _reduce(node, ins, const):
    x = ins[0].shape
    axes = axes_of(node, const, len(x)) or list(range(len(x)))
    keep = node.attrs.get("keepdims", 1)
    return [tuple((1 if i in axes else d) for i, d in enumerate(x) if keep or i not in axes)]


def _out_dtype(node: Node, ins: list[TensorInfo]) -> np.dtype:
    if node.op == "Shape":
        return np.dtype(np.int64)
    return ins[0].dtype if ins else np.dtype(np.float32)


# Evaluators for the integer shape-arithmetic subgraphs folded during inference.
def _fold_slice(node, vals, const):
    params = slice_params(node, const, vals[0].shape)
    return vals[0][tuple(slice(*p) for p in params)]


_FOLD: dict[str, Callable[[Node, list[np.ndarray], Callable], np.ndarray]] = {
    "Slice": _fold_slice,
    "Concat": lambda n, v, c: np.concatenate(v, axis=n.attrs["axis"]),
    "Gather": lambda n, v, c: np.take(v[0], v[1], axis=n.attrs.get("axis", 0)),
    "Unsqueeze": lambda n, v, c: v[0].reshape(_unsqueeze(n, [TensorInfo("", v[0].shape)], c)[0]),
    "Squeeze": lambda n, v, c: v[0].reshape(_squeeze(n, [TensorInfo("", v[0].shape)], c)[0]),
    "Reshape": lambda n, v, c: v[0].reshape(reshape_target(v[0].shape, v[1], bool(n.attrs.get("allowzero")))),
    "Identity": lambda n, v, c: v[0],
    "Mul": lambda n, v, c: v[0] * v[1],
    "Add": lambda n, v, c: v[0] + v[1],
}


def infer_shapes(
    graph: Graph, input_shapes: dict[str, ConcreteShape] | None = None
) -> tuple[dict[str, TensorInfo], dict[str, np.ndarray]]:
    """Concrete :class:`TensorInfo` for every tensor plus the folded integer constants.

    ``input_shapes`` overrides graph input shapes; a remaining ``None`` dim becomes 1.

    >>> from engine.builder import GraphBuilder
    >>> b = GraphBuilder(); x = b.input("x", (None, 8)); b.output(b.relu(x))
    >>> g = b.build(); infer_shapes(g, {"x": (2, 8)})[0][g.outputs[0]].shape
    (2, 8)
    """
    input_shapes = input_shapes or {}
    infos: dict[str, TensorInfo] = {}
    for t in graph.inputs:
        shape = tuple(input_shapes.get(t.name, t.shape))
        shape = tuple(1 if d is None else int(d) for d in shape)
        infos[t.name] = TensorInfo(t.name, shape, np.dtype(t.dtype))
    for name, w in graph.weights.items():
        infos[name] = TensorInfo(name, tuple(w.shape), w.dtype)
    folded: dict[str, np.ndarray] = {}

    def const(name: str) -> np.ndarray | None:
        if name in folded:
            return folded[name]
        w = graph.weights.get(name)
        # Only small integer/float weights take part in shape arithmetic; avoid paging big ones.
        return np.asarray(w) if w is not None and w.size <= 64 else None

    for node in graph.topological_order():
        if node.op not in _SHAPES:
            raise GraphError(f"unsupported op '{node.op}' at node '{node.name}'")
        ins = [infos[t] for t in node.inputs if t]
        try:
            shapes = _SHAPES[node.op](node, ins, const)
        except (KeyError, IndexError, TypeError) as e:
            raise GraphError(f"node {node}: cannot infer shape ({e!r})") from e
        dtype = _out_dtype(node, ins)
        for t, s in zip(node.outputs, shapes, strict=False):
            infos[t] = TensorInfo(t, tuple(int(d) for d in s), dtype)
        if node.op == "Shape":
            folded[node.outputs[0]] = np.array(ins[0].shape, dtype=np.int64)
        elif node.op in _FOLD and all(const(t) is not None for t in node.inputs if t):
            vals = [const(t) for t in node.inputs if t]
            if all(v.dtype.kind == "i" for v in vals) or node.op in ("Slice", "Concat", "Gather"):
                folded[node.outputs[0]] = np.asarray(_FOLD[node.op](node, vals, const))
    return infos, folded
