"""Model files laid out for streaming, and their graph opened without reading the big weights.

A budgeted run reads each big weight from the file straight into the arena, so the file must hold
the graph as it runs: optimised already (BatchNorm folded: folding needs every weight in memory),
and with each Gemm's constant ``B`` stored as ``(out features, in features)`` (``transB=1``) so an
output-feature slice is a contiguous byte range. :func:`save_streamable` writes such a file;
:func:`open_streamable` gives its graph with small weights read (biases, shapes: they stay
resident, "pinned") and big ones as zero-byte placeholders of the right shape and dtype, which is
all planning needs.

>>> save_streamable("resnet18.onnx", "resnet18.sfe")          # doctest: +SKIP
>>> graph, pinned, streamed = open_streamable(WeightLoader("resnet18.sfe"))  # doctest: +SKIP
"""

from __future__ import annotations

import os

import numpy as np

from engine.format import save_model
from engine.ir import Graph, GraphError, Node, TensorInfo
from engine.memory.loader import WeightLoader
from engine.passes import optimize

PIN_BYTES = 16 * 1024  # weights up to this size (and every non-float one) stay resident


def streamable(graph: Graph) -> Graph:
    """``graph`` optimised, with every constant Gemm ``B`` stored transposed (``transB=1``)."""
    g = optimize(graph)
    for node in g.nodes:
        if node.op == "Gemm" and not node.attrs.get("transB") and node.inputs[1] in g.weights:
            b = np.asarray(g.weights[node.inputs[1]])
            if b.ndim != 2:
                continue
            name = g.unique_name(node.inputs[1] + "_t", g.weights)
            g.weights[name] = np.ascontiguousarray(b.T)
            node.inputs = [node.inputs[0], name, *node.inputs[2:]]
            node.attrs["transB"] = 1
    used = {t for n in g.nodes for t in n.inputs}
    g.weights = {k: v for k, v in g.weights.items() if k in used}
    return g


def save_streamable(model: Graph | str | os.PathLike, path: str | os.PathLike) -> int:
    """Write ``model`` (a Graph, ``.onnx`` or engine file) as a streamable engine file; returns its size."""
    from engine.session import load_graph

    return save_model(streamable(load_graph(model)), path)


def placeholder(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A read-only array of this shape and dtype backed by one element (stride 0)."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape, strides=(0,) * len(shape),
                                           writeable=False)


def is_pinned(nbytes: int, dtype: np.dtype) -> bool:
    return nbytes <= PIN_BYTES or dtype.kind != "f"


def open_streamable(loader: WeightLoader) -> tuple[Graph, dict[str, np.ndarray], set[str]]:
    """The file's graph (small weights read, big ones placeholders), the pinned weights, and the
    names of the streamed ones. Raises :class:`GraphError` if the file is not streamable."""
    pinned, streamed, weights = {}, set(), {}
    for name, b in loader.blocks.items():
        if is_pinned(b.nbytes, b.dtype):
            pinned[name] = weights[name] = loader.read_into(name, np.empty(b.nbytes, np.uint8))
        else:
            streamed.add(name)
            weights[name] = placeholder(b.shape, b.dtype)
    h = loader.header
    graph = Graph(inputs=[TensorInfo(t["name"], tuple(t["shape"]), np.dtype(t["dtype"])) for t in h["inputs"]],
                  outputs=list(h["outputs"]), weights=weights, name=h["name"],
                  nodes=[Node(n["op"], n["inputs"], n["outputs"], n["attrs"], n["name"]) for n in h["nodes"]])
    again = optimize(graph)
    if set(again.weights) != set(graph.weights) or len(again.nodes) != len(graph.nodes) or any(
            n.op == "Gemm" and n.inputs[1] in streamed and not n.attrs.get("transB") for n in graph.nodes):
        raise GraphError(f"{loader.path} is not laid out for streaming (it still needs optimising or has "
                         f"Gemm weights stored (in, out)); write it with engine.memory.streamable.save_streamable")
    return graph, pinned, streamed
