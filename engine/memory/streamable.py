"""Model files laid out for streaming, and their graph opened without reading the big weights.

A budgeted run reads each big weight from the file straight into the arena, so the file must hold
the graph as it runs: optimised already (BatchNorm folded: folding needs every weight in memory),
and with each Gemm's constant ``B`` stored as ``(out features, in features)`` (``transB=1``) so an
output-feature slice is a contiguous byte range, and every block 4096-aligned so the loader can
read it with direct I/O. :func:`save_streamable` writes such a file;
:func:`open_streamable` gives its graph with small weights read (biases, shapes: they stay
resident, "pinned") and big ones as zero-byte placeholders of the right shape and dtype, which is
all planning needs.

Kernels that compute new arrays from a weight (Winograd's ``U``, tap-packed convs: their
:attr:`~engine.kernels.Kernel.streamed_params`) cannot run on a streamed weight without
materialising those arrays, over any budget. So the file also holds them, computed when it is
written, with the output channel moved to the first axis so an output-channel slice is again one
contiguous read: a *transformed-weight section* per node and kernel (header key ``transformed``:
node -> kernel -> param -> block). Which kernels: by default the ones the engine itself picks for
the model's input shapes (so a budgeted run can use the unbudgeted run's kernels), or those named.

>>> save_streamable("resnet18.onnx", "resnet18.sfe")          # doctest: +SKIP
>>> graph, pinned, streamed = open_streamable(WeightLoader("resnet18.sfe"))  # doctest: +SKIP
>>> transformed_sections(loader)["conv_10"]["conv_winograd_f23_numba"]   # doctest: +SKIP
{'u': 'w_11@conv_winograd_f23_numba.u'}
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from engine.format import save_model
from engine.ir import Graph, GraphError, Node, TensorInfo
from engine.memory.loader import DIRECT_ALIGN, ModelFileError, WeightLoader
from engine.passes import optimize

Sections = dict[str, dict[str, dict[str, str]]]  # node -> kernel -> transform param -> block name

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


def save_streamable(model: Graph | str | os.PathLike, path: str | os.PathLike,
                    transforms: str | Iterable[str] | None = "auto",
                    input_shapes: dict[str, tuple[int, ...]] | None = None, blocked: bool | None = None) -> int:
    """Write ``model`` (a Graph, ``.onnx`` or engine file) as a streamable engine file; returns its size.

    ``transforms``: whose transformed weights to store as well: ``"auto"`` (the kernels the engine
    picks for ``input_shapes``, default the model's own with unknown sizes set to 1), an iterable
    of kernel names (for every node they apply to), or None. ``blocked``: store the graph in the
    channel-blocked layout (:mod:`engine.layout`), its conv weights packed as the blocked kernels
    read them, output-channel blocks first (a slice of blocks is one read); default: as the
    unbudgeted engine does (when numba is installed), unless ``transforms`` names (NCHW) kernels.
    """
    from engine.kernels import accel
    from engine.layout import to_nchwc
    from engine.session import load_graph

    g = streamable(load_graph(model))
    if blocked is None:
        blocked = accel.available() and (transforms is None or isinstance(transforms, str))
    if blocked:
        g = to_nchwc(g)
    extra, sections = transformed_weights(g, transforms, input_shapes)
    return save_model(g, path, extra_weights=extra, extra_header={"transformed": sections}, align=DIRECT_ALIGN)


def transformed_weights(g: Graph, transforms: str | Iterable[str] | None,
                        input_shapes: dict[str, tuple[int, ...]] | None = None,
                        ) -> tuple[dict[str, np.ndarray], Sections]:
    """The transformed-weight blocks (output channel first) for ``save_streamable`` and their table."""
    from engine.kernels import NodeCtx, by_name, candidates
    from engine.ops import VIEW_OPS, infer_shapes
    from engine.plan import compile_plan
    from engine.tuning import calibrate

    if transforms is None:
        return {}, {}
    shapes = input_shapes or {t.name: tuple(d if isinstance(d, int) and d > 0 else 1 for d in t.shape)
                              for t in g.inputs}
    infos, folded = infer_shapes(g, shapes)
    consts = {**g.weights, **folded}
    chosen: list[tuple[Node, str]] = []
    if transforms == "auto":
        plan = compile_plan(g, shapes, calibrate(), transform=False)
        chosen = [(s.node, s.kernel.name) for s in plan.steps if s.kernel is not None and s.kernel.streamed_params]
    else:
        names = list(transforms)
        for node in g.topological_order():
            if node.op in VIEW_OPS or all(o in consts for o in node.outputs):
                continue
            ctx = NodeCtx(node, [infos[t] for t in node.inputs if t], [infos[t] for t in node.outputs], consts)
            ok = {k.name for k in candidates(ctx)}
            chosen += [(node, k) for k in names if k in ok and by_name(k).streamed_params]
    extra: dict[str, np.ndarray] = {}
    sections: Sections = {}
    for node, kname in chosen:
        w = node.inputs[1] if len(node.inputs) > 1 else None
        if w not in g.weights or is_pinned(np.asarray(g.weights[w]).nbytes, np.asarray(g.weights[w]).dtype):
            continue  # a resident weight: transformed in memory like any other
        kernel = by_name(kname)
        ctx = NodeCtx(node, [infos[t] for t in node.inputs if t], [infos[t] for t in node.outputs], consts)
        params = kernel.transform(ctx)
        for key, axis in kernel.streamed_params.items():
            block = np.ascontiguousarray(np.moveaxis(np.asarray(params[key]), axis, 0))
            stored = [b for params_of in sections.get(node.name, {}).values() for b in params_of.values()]
            same = next((b for b in stored if extra[b].shape == block.shape and np.array_equal(extra[b], block)),
                        None)  # Winograd F(2,3) in numpy and in numba share one U
            name = same or g.unique_name(f"{w}@{kname}.{key}", {**g.weights, **extra})
            extra.setdefault(name, block)
            sections.setdefault(node.name, {}).setdefault(kname, {})[key] = name
    return extra, sections


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
    extra = set(loader.header.get("extra_weights", ()))
    for name, b in loader.blocks.items():
        if name in extra:
            continue
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


def transformed_sections(loader: WeightLoader) -> Sections:
    """The file's transformed-weight table (node -> kernel -> param -> block), checked against its blocks."""
    sections: Sections = loader.header.get("transformed", {})
    for node, kernels in sections.items():
        for kernel, params in kernels.items():
            for key, block in params.items():
                if block not in loader.blocks:
                    raise ModelFileError(f"{loader.path}: transformed weight {key!r} of node {node!r} for kernel "
                                         f"{kernel!r} names block {block!r}, which the file does not hold")
    return sections
