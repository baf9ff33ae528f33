"""Train a graph (built in Python or imported from ONNX) with the autograd ops.

Float weights feeding Conv/Gemm/MatMul/BatchNorm(scale, bias)/Add/Mul become trainable
:class:`Tensor` parameters; BatchNorm running statistics are buffers updated in training mode.
:meth:`GraphModel.to_graph` gives back an inference graph with the trained weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from engine.autograd import functions as F
from engine.autograd.tensor import Tensor
from engine.ir import Graph, GraphError, Node
from engine.kernels.epilogue import activation_of
from engine.ops import conv_attrs, infer_shapes, pad_params, slice_params

PARAM_INPUTS = {"Conv": (1, 2), "Gemm": (1, 2), "MatMul": (0, 1), "BatchNormalization": (1, 2), "Add": (0, 1),
                "Mul": (0, 1), "Sub": (0, 1)}


class GraphModel:
    """Differentiable execution of a :class:`Graph`.

    >>> model = GraphModel(graph)                                          # doctest: +SKIP
    >>> loss = cross_entropy(model(x)["logits"], labels); loss.backward()   # doctest: +SKIP
    >>> SGD(model.parameters(), lr=0.1, momentum=0.9).step()               # doctest: +SKIP
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.params: dict[str, Tensor] = {}
        for node in graph.nodes:
            for i in PARAM_INPUTS.get(node.op, ()):
                name = node.inputs[i] if i < len(node.inputs) else ""
                w = graph.weights.get(name)
                if w is not None and w.dtype.kind == "f" and name not in self.params:
                    self.params[name] = Tensor(np.array(w, dtype=np.float32), requires_grad=True, name=name)
        self.buffers: dict[str, np.ndarray] = {}
        for node in graph.nodes:
            if node.op == "BatchNormalization":
                for name in node.inputs[3:5]:
                    self.buffers.setdefault(name, np.array(graph.weights[name], dtype=np.float32))
        self._shapes: dict[tuple, tuple] = {}

    def parameters(self) -> list[Tensor]:
        return list(self.params.values())

    def _infer(self, shapes: dict[str, tuple[int, ...]]):
        key = tuple(sorted(shapes.items()))
        if key not in self._shapes:
            self._shapes[key] = infer_shapes(self.graph, shapes)
        return self._shapes[key]

    def __call__(self, feeds: Mapping[str, np.ndarray] | np.ndarray, training: bool = True) -> dict[str, Tensor]:
        if not isinstance(feeds, Mapping):
            feeds = {self.graph.inputs[0].name: feeds}
        infos, folded = self._infer({k: tuple(np.shape(v)) for k, v in feeds.items()})
        env: dict[str, Tensor] = {k: Tensor(np.asarray(v, dtype=np.float32)) for k, v in feeds.items()}
        consts = {**self.graph.weights, **folded}

        def get(name: str) -> Tensor:
            if name in env:
                return env[name]
            if name in self.params:
                return self.params[name]
            return Tensor(np.asarray(consts[name]))

        order = self.graph.topological_order()
        uses: dict[str, int] = {}
        for node in order:
            for t in node.inputs:
                uses[t] = uses.get(t, 0) + 1
        for node in order:
            if all(o in folded for o in node.outputs):
                continue
            env[node.outputs[0]] = self._node(node, get, consts, infos, training)
            for t in node.inputs:  # drop activations nobody reads any more (functions keep what they saved)
                uses[t] -= 1
                if uses[t] == 0 and t in env and t not in self.graph.outputs:
                    del env[t]
        return {o: env[o] if o in env else get(o) for o in self.graph.outputs}

    def _node(self, node: Node, get, consts, infos, training: bool) -> Tensor:
        op, a = node.op, node.attrs
        ins = [get(t) if t else None for t in node.inputs]
        x = ins[0]
        out_shape = infos[node.outputs[0]].shape
        if op == "Conv":
            c = conv_attrs(node, ins[1].shape)
            b = ins[2] if len(ins) > 2 and ins[2] is not None else Tensor(np.zeros(ins[1].shape[0], np.float32))
            return F.Conv2d.apply(x, ins[1], b, stride=c["strides"], pads=c["pads"], dil=c["dilations"],
                                  group=c["group"])
        if op == "BatchNormalization":
            eps = a.get("epsilon", 1e-5)
            if training:
                return F.BatchNorm.apply(x, ins[1], ins[2], running_mean=self.buffers[node.inputs[3]],
                                         running_var=self.buffers[node.inputs[4]],
                                         momentum=1 - a.get("momentum", 0.9), eps=eps)
            mean, var = self.buffers[node.inputs[3]], self.buffers[node.inputs[4]]
            inv = Tensor((1 / np.sqrt(var + eps)).reshape(1, -1, 1, 1).astype(np.float32))
            xhat = F.Mul.apply(F.Add.apply(x, Tensor(-mean.reshape(1, -1, 1, 1))), inv)
            gamma = F.Reshape.apply(ins[1], shape=(1, -1, 1, 1))
            return F.Add.apply(F.Mul.apply(xhat, gamma), F.Reshape.apply(ins[2], shape=(1, -1, 1, 1)))
        if op == "Gemm":
            xa = F.Transpose.apply(x, perm=(1, 0)) if a.get("transA") else x
            y = F.MatMulT.apply(xa, ins[1]) if a.get("transB") else F.MatMul.apply(xa, ins[1])
            if a.get("alpha", 1.0) != 1.0:
                y = F.Mul.apply(y, Tensor(np.float32(a["alpha"])))
            if len(ins) > 2 and ins[2] is not None:
                c = ins[2] if a.get("beta", 1.0) == 1.0 else F.Mul.apply(ins[2], Tensor(np.float32(a["beta"])))
                y = F.Add.apply(y, c)
            return y
        if op == "MatMul":
            return F.MatMul.apply(x, ins[1])
        if op in ("Add", "Mul"):
            return getattr(F, op).apply(x, ins[1])
        if op == "Sub":
            return F.Add.apply(x, F.Mul.apply(ins[1], Tensor(np.float32(-1))))
        if op == "Div" and node.inputs[1] in consts:
            return F.Mul.apply(x, Tensor((1 / np.asarray(consts[node.inputs[1]])).astype(np.float32)))
        if op in ("Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid"):
            kind, p = activation_of(node, consts)
            if kind == "clip":
                return F.Clip.apply(x, lo=p[0], hi=p[1])
            if kind == "hardsigmoid":
                return F.HardSigmoid.apply(x, alpha=p[0], beta=p[1])
            return {"relu": F.Relu, "hardswish": F.HardSwish, "sigmoid": F.Sigmoid}[kind].apply(x)
        if op == "Softmax":
            return F.Softmax.apply(x, axis=a.get("axis", -1))
        if op in ("MaxPool", "AveragePool"):
            c = conv_attrs(node, (0, 0, *a["kernel_shape"]))
            if op == "MaxPool":
                return F.MaxPool2d.apply(x, k=c["kernel"], stride=c["strides"], pads=c["pads"])
            return F.AvgPool2d.apply(x, k=c["kernel"], stride=c["strides"], pads=c["pads"],
                                     count_include_pad=bool(a.get("count_include_pad", 0)))
        if op == "GlobalAveragePool":
            return F.GlobalAvgPool.apply(x)
        if op == "GlobalMaxPool":
            return F.GlobalMaxPool.apply(x)
        if op == "ReduceMean":
            rank = x.data.ndim
            axes = a.get("axes")
            if axes is None and len(node.inputs) > 1 and node.inputs[1]:
                axes = consts[node.inputs[1]]
            axes = sorted(int(v) % rank for v in (axes if axes is not None else range(rank)))
            return F.ReduceMean.apply(x, axes=axes, keepdims=bool(a.get("keepdims", 1)))
        if op in ("Flatten", "Reshape", "Squeeze", "Unsqueeze"):
            return F.Reshape.apply(x, shape=out_shape)
        if op in ("Identity", "Dropout"):
            return x
        if op == "Transpose":
            return F.Transpose.apply(x, perm=tuple(a.get("perm") or range(x.data.ndim)[::-1]))
        if op == "Concat":
            return F.Concat.apply(*[t for t in ins if t is not None], axis=a["axis"] % x.data.ndim)
        if op == "Slice":
            params = slice_params(node, lambda n: consts.get(n), x.shape)
            return F.Slice.apply(x, index=tuple(slice(*p) for p in params))
        if op == "Pad":
            pads, value = pad_params(node, lambda n: consts.get(n), x.data.ndim)
            return F.Pad.apply(x, pads=pads, value=value)
        raise GraphError(f"no differentiable implementation of '{op}' (node '{node.name}')")

    def to_graph(self) -> Graph:
        """An inference graph carrying the current (trained) weights and running statistics."""
        weights = dict(self.graph.weights)
        weights.update({k: t.data.copy() for k, t in self.params.items()})
        weights.update({k: v.copy() for k, v in self.buffers.items()})
        return Graph(list(self.graph.inputs), list(self.graph.outputs), list(self.graph.nodes), weights,
                     self.graph.name)


