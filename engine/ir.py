"""Graph IR: typed tensors, nodes with an op type and attributes, a graph with weights.

Shapes may hold ``None`` for a dimension that is only known when a session binds its inputs
(typically the batch). Weights are plain numpy arrays (possibly ``np.memmap`` views of a model
file); the graph never copies them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Shape = tuple[int | None, ...]


@dataclass(frozen=True)
class TensorInfo:
    """A named tensor's static type.

    >>> TensorInfo("x", (None, 3, 224, 224), np.dtype("float32")).nbytes_for(batch=2)
    1204224
    """

    name: str
    shape: Shape
    dtype: np.dtype = np.dtype(np.float32)

    def nbytes_for(self, batch: int = 1) -> int:
        dims = [batch if d is None else int(d) for d in self.shape]
        return math.prod(dims) * np.dtype(self.dtype).itemsize  # math.prod: ~10x numpy's on a short tuple


@dataclass
class Node:
    """One operation: ``outputs = op(inputs, **attrs)``; inputs and outputs are tensor names.

    >>> Node("Relu", ["x"], ["y"], name="relu0").op
    'Relu'
    """

    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    def __str__(self) -> str:
        return f"{self.op} '{self.name}' ({', '.join(self.inputs)}) -> ({', '.join(self.outputs)})"


class GraphError(ValueError):
    """A graph is malformed (cycle, dangling tensor, unsupported op...)."""


@dataclass
class Graph:
    """A dataflow graph: inputs, nodes, outputs and the constant weights nodes read.

    >>> g = Graph(inputs=[TensorInfo("x", (None, 4))], outputs=["y"],
    ...           nodes=[Node("Relu", ["x"], ["y"], name="r")])
    >>> [n.name for n in g.topological_order()]
    ['r']
    """

    inputs: list[TensorInfo]
    outputs: list[str]
    nodes: list[Node] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    name: str = "graph"

    def producers(self) -> dict[str, Node]:
        """Map each produced tensor name to the node producing it."""
        out: dict[str, Node] = {}
        for node in self.nodes:
            for t in node.outputs:
                if t in out:
                    raise GraphError(f"tensor '{t}' is produced twice ({out[t].name}, {node.name})")
                out[t] = node
        return out

    def consumers(self) -> dict[str, list[Node]]:
        """Map each tensor name to the nodes that read it."""
        out: dict[str, list[Node]] = {}
        for node in self.nodes:
            for t in node.inputs:
                if t:
                    out.setdefault(t, []).append(node)
        return out

    def topological_order(self) -> list[Node]:
        """Nodes ordered so each runs after its producers; stable w.r.t. the stored order."""
        producers = self.producers()
        available = {t.name for t in self.inputs} | set(self.weights) | {""}
        for t in list(producers):
            if t in available:
                raise GraphError(f"tensor '{t}' is both a graph input/weight and a node output")
        deps: dict[int, set[int]] = {}
        index = {id(n): i for i, n in enumerate(self.nodes)}
        for i, node in enumerate(self.nodes):
            deps[i] = set()
            for t in node.inputs:
                if t in available:
                    continue
                if t not in producers:
                    raise GraphError(f"node {node} reads '{t}', which nothing produces")
                deps[i].add(index[id(producers[t])])
        if all(max(deps[i], default=-1) < i for i in deps):
            return list(self.nodes)  # already sorted (the usual case): keep the stored order, O(n)
        order: list[Node] = []
        done: set[int] = set()
        # Kahn's algorithm over the stored order keeps already-sorted graphs unchanged.
        pending = list(range(len(self.nodes)))
        while pending:
            ready = [i for i in pending if deps[i] <= done]
            if not ready:
                names = ", ".join(self.nodes[i].name for i in pending[:5])
                raise GraphError(f"graph has a cycle through: {names}")
            for i in ready:
                order.append(self.nodes[i])
                done.add(i)
            pending = [i for i in pending if i not in done]
        return order

    def sort(self) -> Graph:
        """Reorder ``nodes`` topologically in place; returns self."""
        self.nodes = self.topological_order()
        return self

    def validate(self) -> None:
        """Raise :class:`GraphError` if the graph is not a DAG or an output is never produced."""
        self.topological_order()
        known = {t.name for t in self.inputs} | set(self.weights) | set(self.producers())
        for o in self.outputs:
            if o not in known:
                raise GraphError(f"graph output '{o}' is never produced")

    def input_info(self, name: str) -> TensorInfo:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(name)

    def op_types(self) -> set[str]:
        return {n.op for n in self.nodes}

    def unique_name(self, base: str, taken: Iterable[str] = ()) -> str:
        """A tensor/node name starting with ``base`` not used anywhere in the graph."""
        used = set(taken) | set(self.weights) | {t.name for t in self.inputs}
        for n in self.nodes:
            used.update(n.inputs)
            used.update(n.outputs)
            used.add(n.name)
        if base not in used:
            return base
        i = 1
        while f"{base}_{i}" in used:
            i += 1
        return f"{base}_{i}"
