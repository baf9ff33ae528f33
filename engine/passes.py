"""Load-time graph rewrites: drop no-ops, fold BatchNorm and constant biases into convs, turn
MatMul+Add into Gemm, and fuse residual adds and activations into the op that produces their input.

Every rewrite keeps the graph's computed values equal (up to float rounding); new weights are
computed once here, never per run.
"""

from __future__ import annotations

import copy

import numpy as np

from engine.ir import Graph, Node
from engine.kernels.epilogue import activation_of
from engine.ops import infer_shapes

FUSE_ACT_INTO = ("Conv", "Gemm", "Add")


class _Rewriter:
    def __init__(self, graph: Graph) -> None:
        self.g = Graph(list(graph.inputs), list(graph.outputs), [copy.copy(n) for n in graph.nodes],
                       dict(graph.weights), graph.name)
        for n in self.g.nodes:
            n.attrs, n.inputs, n.outputs = dict(n.attrs), list(n.inputs), list(n.outputs)
        self.infos, _ = infer_shapes(self.g)

    def sole_consumer(self, tensor: str) -> Node | None:
        if tensor in self.g.outputs:
            return None
        users = self.g.consumers().get(tensor, [])
        return users[0] if len(users) == 1 else None

    def absorb(self, producer: Node, consumer: Node) -> None:
        """``producer`` takes over ``consumer``'s outputs; ``consumer`` disappears."""
        producer.outputs = list(consumer.outputs)
        self.g.nodes.remove(consumer)

    def const(self, name: str) -> np.ndarray | None:
        return self.g.weights.get(name)

    def new_weight(self, base: str, value: np.ndarray) -> str:
        name = self.g.unique_name(base)
        self.g.weights[name] = np.ascontiguousarray(value, dtype=np.float32)
        return name

    # -- rewrites; each returns True if it changed something --------------------------------
    def drop_noops(self) -> bool:
        for n in self.g.nodes:
            if n.op in ("Identity", "Dropout") and n.outputs[0] not in self.g.outputs:
                src, dst = n.inputs[0], n.outputs[0]
                self.g.nodes.remove(n)
                for m in self.g.nodes:
                    m.inputs = [src if t == dst else t for t in m.inputs]
                return True
        return False

    def conv_bias(self, conv: Node) -> np.ndarray:
        b = self.const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] else None
        return np.zeros(self.infos[conv.inputs[1]].shape[0]) if b is None else b.astype(np.float64)

    def set_conv_params(self, conv: Node, w: np.ndarray, b: np.ndarray) -> None:
        conv.inputs[1] = self.new_weight(conv.inputs[1] + "_folded", w)
        b_name = self.new_weight(f"{conv.name}_bias", b)
        conv.inputs = conv.inputs[:1] + [conv.inputs[1], b_name] + conv.inputs[3:]

    def fold_batchnorm(self) -> bool:
        for conv in self.g.nodes:
            if conv.op != "Conv" or self.const(conv.inputs[1]) is None or conv.attrs.get("act"):
                continue
            bn = self.sole_consumer(conv.outputs[0])
            if bn is None or bn.op != "BatchNormalization" or any(self.const(t) is None for t in bn.inputs[1:5]):
                continue
            scale, beta, mean, var = (self.const(t).astype(np.float64) for t in bn.inputs[1:5])
            s = scale / np.sqrt(var + bn.attrs.get("epsilon", 1e-5))
            w = self.const(conv.inputs[1]).astype(np.float64) * s[:, None, None, None]
            self.set_conv_params(conv, w, (self.conv_bias(conv) - mean) * s + beta)
            self.absorb(conv, bn)
            return True
        return False

    def fold_const_add(self) -> bool:
        """Conv followed by Add of a per-channel constant: fold the constant into the bias."""
        for conv in self.g.nodes:
            if conv.op != "Conv" or conv.attrs.get("act") or len(conv.inputs) > 3:
                continue
            add = self.sole_consumer(conv.outputs[0])
            if add is None or add.op != "Add":
                continue
            other = add.inputs[1] if add.inputs[0] == conv.outputs[0] else add.inputs[0]
            c = self.const(other)
            cout = self.infos[conv.outputs[0]].shape[1]
            if c is None or c.size != cout or c.ndim > 4 or (c.ndim >= 3 and c.shape[-2:] != (1, 1)):
                continue
            self.set_conv_params(conv, self.const(conv.inputs[1]), self.conv_bias(conv) + c.reshape(-1))
            self.absorb(conv, add)
            return True
        return False

    def matmul_to_gemm(self) -> bool:
        for mm in self.g.nodes:
            if mm.op != "MatMul" or len(self.infos[mm.inputs[0]].shape) != 2 or self.const(mm.inputs[1]) is None:
                continue
            add = self.sole_consumer(mm.outputs[0])
            if add is None or add.op != "Add":
                continue
            other = add.inputs[1] if add.inputs[0] == mm.outputs[0] else add.inputs[0]
            c = self.const(other)
            if c is None or c.ndim > 2 or c.size != self.infos[mm.outputs[0]].shape[1]:
                continue
            mm.op, mm.inputs = "Gemm", [mm.inputs[0], mm.inputs[1], other]
            self.absorb(mm, add)
            return True
        return False

    def fuse_residual(self) -> bool:
        """Conv -> Add(other tensor of the same shape): the conv adds it in its epilogue."""
        for conv in self.g.nodes:
            if conv.op != "Conv" or conv.attrs.get("act") or len(conv.inputs) > 3:
                continue
            add = self.sole_consumer(conv.outputs[0])
            if add is None or add.op != "Add" or add.attrs.get("act"):
                continue
            other = add.inputs[1] if add.inputs[0] == conv.outputs[0] else add.inputs[0]
            if other == conv.outputs[0] or self.const(other) is not None:
                continue
            if self.infos[other].shape != self.infos[conv.outputs[0]].shape:
                continue
            conv.inputs = (conv.inputs + [""])[:3] + [other]
            self.absorb(conv, add)
            return True
        return False

    def fuse_activation(self) -> bool:
        for p in self.g.nodes:
            if p.op not in FUSE_ACT_INTO or p.attrs.get("act"):
                continue
            a = self.sole_consumer(p.outputs[0])
            if a is None or a.op not in ("Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid"):
                continue
            if a.op == "Clip" and any(t and self.const(t) is None for t in a.inputs[1:]):
                continue
            kind, params = activation_of(a, self.g.weights)
            p.attrs["act"], p.attrs["act_params"] = kind, list(params)
            self.absorb(p, a)
            return True
        return False


def optimize(graph: Graph) -> Graph:
    """A rewritten copy of ``graph`` (the input graph and its weights are left untouched).

    >>> from engine.builder import GraphBuilder
    >>> b = GraphBuilder(); x = b.input("x", (1, 2, 4, 4))
    >>> b.output(b.relu(b.conv(x, np.ones((2, 2, 1, 1), np.float32))))
    >>> [(n.op, n.attrs["act"]) for n in optimize(b.build()).nodes]
    [('Conv', 'relu')]
    """
    rw = _Rewriter(graph)
    passes = [rw.drop_noops, rw.fold_batchnorm, rw.fold_const_add, rw.matmul_to_gemm, rw.fuse_residual,
              rw.fuse_activation]
    for p in passes:
        while p():
            pass
    used = {t for n in rw.g.nodes for t in n.inputs} | set(rw.g.outputs)
    rw.g.weights = {k: v for k, v in rw.g.weights.items() if k in used}
    return rw.g.sort()
