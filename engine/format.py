"""The on-disk model format: one file, a JSON header then 64-byte aligned raw weights.

Layout::

    b"SFENGIN1" | u64 little-endian header length | JSON header | padding | weight blobs

The header holds the graph (inputs, outputs, nodes with attributes) and, per weight, its dtype,
shape, offset, size and checksums: CRC-32 (zlib), and CRC-32C when the optional ``crc32c`` package
(hardware CRC, about 5x zlib's speed) is installed; readers check whichever they can compute.
Weights are read lazily: either memory-mapped as a whole (:func:`load_model`, pages are touched
only when a kernel reads them), one at a time (:meth:`ModelFile.read_weight`), or block by block
into caller-owned buffers with checksums (:class:`engine.memory.loader.WeightLoader`) so a runtime
can stream weights layer by layer.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from engine.ir import Graph, Node, TensorInfo

try:  # optional: CRC-32C in hardware, so streaming weights is not held up by checking them
    import crc32c as _crc32c
except ImportError:  # pragma: no cover - zlib's CRC-32 is always written and checked
    _crc32c = None

MAGIC = b"SFENGIN1"
ALIGN = 64


def block_checksums(data: Any) -> dict[str, int]:
    """The checksums the header stores per weight: ``crc32`` always, ``crc32c`` when available."""
    out = {"crc32": zlib.crc32(data)}
    if _crc32c is not None:
        out["crc32c"] = _crc32c.crc32c(data)
    return out


def checksum_fn(entry: dict[str, Any]) -> tuple[str, Any] | None:
    """The fastest checksum this process can verify for a header weight entry: ``(key, fn)`` where
    ``fn(data, running)`` continues a running checksum, or None if the entry has none."""
    if _crc32c is not None and "crc32c" in entry:
        return "crc32c", _crc32c.crc32c
    if "crc32" in entry:
        return "crc32", zlib.crc32
    return None


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return v


def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def graph_structure(graph: Graph) -> dict[str, Any]:
    """The graph without its weight values, as JSON-able data (the file header's graph part)."""
    return {
        "name": graph.name,
        "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": np.dtype(t.dtype).str}
                   for t in graph.inputs],
        "outputs": list(graph.outputs),
        "nodes": [{"op": n.op, "name": n.name, "inputs": n.inputs, "outputs": n.outputs,
                   "attrs": {k: _jsonable(v) for k, v in n.attrs.items()}} for n in graph.nodes],
    }


def graph_from_structure(h: dict[str, Any], weights: dict[str, np.ndarray]) -> Graph:
    """The inverse of :func:`graph_structure`, with these weight values."""
    return Graph(
        inputs=[TensorInfo(t["name"], tuple(t["shape"]), np.dtype(t["dtype"])) for t in h["inputs"]],
        outputs=list(h["outputs"]),
        nodes=[Node(n["op"], n["inputs"], n["outputs"], n["attrs"], n["name"]) for n in h["nodes"]],
        weights=weights,
        name=h["name"],
    )


def save_model(graph: Graph, path: str | os.PathLike, extra_weights: dict[str, np.ndarray] | None = None,
               extra_header: dict[str, Any] | None = None, align: int = ALIGN) -> int:
    """Write ``graph`` to ``path``; returns the file size in bytes. ``extra_weights`` are stored as
    blocks the graph does not read (e.g. transformed weights for streaming), ``extra_header`` as
    more header keys. ``align`` (a multiple of 64) aligns every block's start and end in the file,
    e.g. to 4096 for direct I/O (the header is padded with spaces: readers need not know).

    >>> from engine.builder import GraphBuilder
    >>> import tempfile
    >>> b = GraphBuilder(); b.output(b.relu(b.input("x", (None, 2))))
    >>> save_model(b.build(), tempfile.mktemp()) > 0
    True
    """
    table, offset = [], 0
    blocks = {**graph.weights, **(extra_weights or {})}
    for name, w in blocks.items():
        w = np.asarray(w)
        table.append({"name": name, "dtype": w.dtype.str, "shape": list(w.shape), "offset": offset,
                      "nbytes": int(w.nbytes), **block_checksums(np.ascontiguousarray(w).data)})
        offset = _align(offset + w.nbytes, align)
    header = {**graph_structure(graph), **(extra_header or {}), "weights": table,
              "extra_weights": list(extra_weights or {})}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (_align(len(MAGIC) + 8 + len(blob), align) - len(MAGIC) - 8 - len(blob))
    data_start = _align(len(MAGIC) + 8 + len(blob))
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(blob)) + blob)
        f.write(b"\0" * (data_start - f.tell()))
        for entry, w in zip(table, blocks.values(), strict=True):
            f.seek(data_start + entry["offset"])
            f.write(np.ascontiguousarray(w).tobytes())
        f.truncate(data_start + offset)
        return data_start + offset


class ModelFile:
    """A model file opened for reading: the header now, each weight when asked.

    >>> mf = ModelFile(path)                        # doctest: +SKIP
    >>> w = mf.read_weight(mf.weight_names()[0])    # reads only that weight's bytes  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if f.read(len(MAGIC)) != MAGIC:
                raise ValueError(f"{self.path} is not a streamflow engine model (bad magic)")
            (n,) = struct.unpack("<Q", f.read(8))
            self.header: dict[str, Any] = json.loads(f.read(n))
        self.data_start = _align(len(MAGIC) + 8 + n)
        extra = set(self.header.get("extra_weights", ()))
        self._table = {w["name"]: w for w in self.header["weights"] if w["name"] not in extra}

    def weight_names(self) -> list[str]:
        return list(self._table)

    def weight_info(self, name: str) -> TensorInfo:
        e = self._table[name]
        return TensorInfo(name, tuple(e["shape"]), np.dtype(e["dtype"]))

    def read_weight(self, name: str) -> np.ndarray:
        """Read one weight from disk into a fresh array (no mapping of the rest of the file)."""
        e = self._table[name]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + e["offset"])
            raw = f.read(e["nbytes"])
        return np.frombuffer(raw, dtype=np.dtype(e["dtype"])).reshape(e["shape"]).copy()

    def graph(self, mmap: bool = True) -> Graph:
        """The graph with weights as read-only memory-mapped views (or fully read if not ``mmap``)."""
        h = self.header
        if mmap and self._table:
            whole = np.memmap(self.path, dtype=np.uint8, mode="r")
            weights = {}
            for name, e in self._table.items():
                start = self.data_start + e["offset"]
                raw = whole[start : start + e["nbytes"]]
                weights[name] = raw.view(np.dtype(e["dtype"])).reshape(e["shape"])
        else:
            weights = {name: self.read_weight(name) for name in self._table}
        return graph_from_structure(h, weights)


def load_model(path: str | os.PathLike, mmap: bool = True) -> Graph:
    """Load a model written by :func:`save_model`; weights are memory-mapped by default."""
    return ModelFile(path).graph(mmap=mmap)
