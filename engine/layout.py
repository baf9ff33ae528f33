"""The channel-blocked layout pass: convs, depthwise convs, pools and the elementwise ops between
them move to NCHWc (``(N, C/16, H, W, 16)``, :mod:`engine.kernels.nchwc`); layout changes are
inserted only where a blocked region meets an op that needs NCHW (and at the graph's outputs).

How the layout propagates: nodes are visited in topological order; a tensor produced by a blocked
op lives under a new name (``<name>@nchwc``) and its NCHW original is only materialised, by one
``ReorderOutput``, if some consumer (or the graph output) needs it. A Conv reading an NCHW tensor
with few channels (a stem on an image) reads it directly (``input_block=1``); any other NCHW input
of a blocked op gets a ``ReorderInput``. Weights are packed here, once, so a saved or cached graph
holds them in the kernels' layout (nothing to transform at a cold start).

Padded channels (when C is not a multiple of 16) hold finite values that only ever meet zero
weights, so they never reach a real channel; ops that could make them infinite (Div by a blocked
tensor) stay NCHW.

>>> from engine.builder import GraphBuilder
>>> b = GraphBuilder(); x = b.input("x", (1, 3, 8, 8))
>>> b.output(b.relu(b.conv(x, np.ones((16, 3, 3, 3), np.float32), pads=1)))
>>> [n.op for n in to_nchwc(b.build()).nodes]
['NchwcConv', 'Relu', 'ReorderOutput']
"""

from __future__ import annotations

import numpy as np

from engine.ir import Graph, Node
from engine.kernels.nchwc import blocks, pack_channels, pack_conv_weight, pack_depthwise_weight
from engine.ops import ELEMENTWISE_UNARY, NCHWC_BLOCK, conv_attrs, infer_shapes

STEM_MAX_CHANNELS = 4  # a conv on at most this many NCHW channels reads them unblocked (input_block=1)
BLOCKED_BINARY = ("Add", "Sub", "Mul")
SUFFIX = "@nchwc"


class _Blocker:
    def __init__(self, graph: Graph) -> None:
        self.src = graph
        self.infos, _ = infer_shapes(graph)
        self.weights = dict(graph.weights)
        self.nodes: list[Node] = []
        self.blocked: dict[str, str] = {}  # NCHW tensor -> its blocked twin
        self.plain: set[str] = {t.name for t in graph.inputs} | set(graph.weights)  # NCHW tensors that exist
        self.names = {n.name for n in graph.nodes}

    # -- helpers ----------------------------------------------------------------------------------
    def shape(self, t: str) -> tuple[int, ...]:
        return self.infos[t].shape

    def const(self, t: str) -> np.ndarray | None:
        return self.weights.get(t) if t else None

    def node_name(self, base: str) -> str:
        name, i = base, 1
        while name in self.names:
            name, i = f"{base}_{i}", i + 1
        self.names.add(name)
        return name

    def weight(self, base: str, value: np.ndarray) -> str:
        name, i = base, 1
        while name in self.weights:
            name, i = f"{base}_{i}", i + 1
        self.weights[name] = np.ascontiguousarray(value, dtype=np.float32)
        return name

    def to_blocked(self, t: str) -> str:
        """The blocked twin of NCHW tensor ``t`` (a ReorderInput the first time it is asked for)."""
        if t not in self.blocked:
            self.blocked[t] = t + SUFFIX
            self.nodes.append(Node("ReorderInput", [t], [t + SUFFIX], {}, self.node_name(f"{t}/reorder_in")))
        return self.blocked[t]

    def to_plain(self, t: str) -> str:
        """NCHW tensor ``t`` (a ReorderOutput from its blocked twin the first time it is asked for)."""
        if t not in self.plain:
            self.nodes.append(Node("ReorderOutput", [self.blocked[t]], [t], {"channels": self.shape(t)[1]},
                                   self.node_name(f"{t}/reorder_out")))
            self.plain.add(t)
        return t

    def produce_blocked(self, node: Node, op: str, inputs: list[str], attrs: dict) -> None:
        out = node.outputs[0]
        self.blocked[out] = out + SUFFIX
        self.nodes.append(Node(op, inputs, [out + SUFFIX], attrs, node.name))

    def is_4d(self, t: str) -> bool:
        return len(self.shape(t)) == 4

    # -- per op -----------------------------------------------------------------------------------
    def conv(self, node: Node) -> bool:
        x, w = node.inputs[0], self.const(node.inputs[1])
        if w is None or w.ndim != 4 or not self.is_4d(x) or node.attrs.get("auto_pad", "NOTSET") not in (
                "NOTSET", b"NOTSET"):
            return False
        a = conv_attrs(node, w.shape)
        cout, cin = w.shape[0], self.shape(x)[1]
        depthwise = a["group"] == cin == cout and w.shape[1] == 1
        if a["group"] != 1 and not depthwise:
            return False
        b = self.const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        if len(node.inputs) > 2 and node.inputs[2] and b is None:
            return False
        bias = self.weight(f"{node.name}/bias{SUFFIX}", pack_channels(np.zeros(cout) if b is None else b, cout))
        attrs = {"kernel_shape": list(w.shape[2:]), "strides": a["strides"], "pads": a["pads"],
                 "dilations": a["dilations"]}
        attrs.update({k: node.attrs[k] for k in ("act", "act_params") if k in node.attrs})
        residual = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] else ""
        if depthwise:
            packed = self.weight(f"{node.inputs[1]}{SUFFIX}", pack_depthwise_weight(w))
            op, src = "NchwcDepthwiseConv", self.to_blocked(x)
        else:
            stem = x not in self.blocked and cin <= STEM_MAX_CHANNELS
            bi = 1 if stem else NCHWC_BLOCK
            packed = self.weight(f"{node.inputs[1]}{SUFFIX}", pack_conv_weight(w, bi))
            op, src = "NchwcConv", (x if stem else self.to_blocked(x))
        inputs = [src, packed, bias] + ([self.to_blocked(residual)] if residual else [])
        self.produce_blocked(node, op, inputs, attrs)
        return True

    def unary(self, node: Node) -> bool:
        x = node.inputs[0]
        if x not in self.blocked:
            return False
        self.produce_blocked(node, node.op, [self.blocked[x], *node.inputs[1:]], dict(node.attrs))
        return True

    def binary(self, node: Node) -> bool:
        out = node.outputs[0]
        if not self.is_4d(out) or not any(t in self.blocked for t in node.inputs):
            return False
        channels = self.shape(out)[1]
        inputs = []
        for t in node.inputs:
            c = self.const(t)
            if t in self.blocked and self.shape(t)[1] == channels:
                inputs.append(self.blocked[t])
            elif c is not None and c.size == 1:
                inputs.append(t)
            elif c is not None and c.size == channels and c.ndim <= 4 and c.shape[-2:] in ((1, 1), (channels, 1)):
                packed = pack_channels(c, channels).reshape(1, blocks(channels), 1, 1, NCHWC_BLOCK)
                inputs.append(self.weight(f"{t}{SUFFIX}", packed))
            else:
                return False
        self.produce_blocked(node, node.op, inputs, dict(node.attrs))
        return True

    def pool(self, node: Node) -> bool:
        x = node.inputs[0]
        if x not in self.blocked or node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
            return False
        if node.op in ("GlobalAveragePool", "GlobalMaxPool"):
            self.produce_blocked(node, "Nchwc" + node.op, [self.blocked[x]], {})
            return True
        a = conv_attrs(node, (0, 0, *node.attrs["kernel_shape"]))
        attrs = {"kernel_shape": a["kernel"], "strides": a["strides"], "pads": a["pads"],
                 "dilations": a["dilations"], "ceil_mode": int(node.attrs.get("ceil_mode", 0))}
        self.produce_blocked(node, "NchwcMaxPool", [self.blocked[x]], attrs)
        return True

    def rewrite(self, node: Node) -> bool:
        if node.op == "Conv":
            return self.conv(node)
        if node.op in ELEMENTWISE_UNARY:
            return self.unary(node)
        if node.op in BLOCKED_BINARY:
            return self.binary(node)
        if node.op in ("MaxPool", "GlobalAveragePool", "GlobalMaxPool"):
            return self.pool(node)
        return False

    def run(self) -> Graph:
        for node in self.src.topological_order():
            if not self.rewrite(node):
                inputs = [self.to_plain(t) if t and t in self.blocked and t not in self.plain else t
                          for t in node.inputs]
                self.nodes.append(Node(node.op, inputs, list(node.outputs), dict(node.attrs), node.name))
                self.plain.update(node.outputs)
        for t in self.src.outputs:
            if t in self.blocked:
                self.to_plain(t)
        used = {t for n in self.nodes for t in n.inputs}
        weights = {k: v for k, v in self.weights.items() if k in used}
        return Graph(list(self.src.inputs), list(self.src.outputs), self.nodes, weights, self.src.name).sort()


def blockable(graph: Graph) -> bool:
    """Whether :func:`to_nchwc` would move anything to the blocked layout (a 2-D conv with constant weights)."""
    return any(n.op == "Conv" and n.inputs[1] in graph.weights and np.asarray(graph.weights[n.inputs[1]]).ndim == 4
               for n in graph.nodes)


def to_nchwc(graph: Graph) -> Graph:
    """A copy of an optimised ``graph`` (:func:`engine.passes.optimize`) with blocked convs, pools and
    elementwise ops and the reorders between the layouts (module doc); the input graph is untouched."""
    if not blockable(graph):
        return graph
    return _Blocker(graph).run()
