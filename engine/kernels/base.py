"""What every kernel declares: applicability, cost, scratch, weight transform, and how it runs.

A kernel is bound once per plan to fixed views of the arena (inputs, outputs, scratch), so a run
is a list of closures writing into preallocated memory (``out=`` everywhere, no allocations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.ir import Node, TensorInfo

Step = Callable[[], None]
ALIGN = 64


@dataclass
class NodeCtx:
    """A node with concrete input/output types and access to constant values."""

    node: Node
    ins: list[TensorInfo]
    outs: list[TensorInfo]
    consts: dict[str, np.ndarray] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # derived facts, e.g. ConvGeom

    @property
    def attrs(self) -> dict[str, Any]:
        return self.node.attrs

    def const(self, i: int) -> np.ndarray | None:
        """The constant value of input ``i`` (weights, folded shapes), or None if computed."""
        if i >= len(self.node.inputs) or not self.node.inputs[i]:
            return None
        return self.consts.get(self.node.inputs[i])

    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and bool(self.node.inputs[i])


@dataclass
class Cost:
    """Analytic work of one kernel call: BLAS flops, vector (numpy/numba loop) flops, bytes moved,
    and the number of Python-level calls (each costs a fixed overhead)."""

    gemm_flops: float = 0.0
    vector_flops: float = 0.0
    bytes: float = 0.0
    calls: int = 1

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.gemm_flops + other.gemm_flops, self.vector_flops + other.vector_flops,
                    self.bytes + other.bytes, self.calls + other.calls)


def nbytes(shape: Sequence[int], dtype: Any = np.float32) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def scratch_size(*parts: tuple[Sequence[int], Any]) -> int:
    """Bytes needed to carve the given (shape, dtype) parts out of one scratch buffer."""
    return sum(aligned(nbytes(s, d)) for s, d in parts)


def carve(buf: np.ndarray, *parts: tuple[Sequence[int], Any]) -> list[np.ndarray]:
    """Split a uint8 scratch buffer into typed, aligned, contiguous views."""
    views, off = [], 0
    for shape, dtype in parts:
        n = nbytes(shape, dtype)
        views.append(buf[off : off + n].view(dtype).reshape(shape))
        off += aligned(n)
    return views


class Kernel:
    """One implementation of one or more ops.

    Subclasses set ``name`` and ``ops`` and override what differs from the defaults.

    >>> class Copy(Kernel):
    ...     name, ops = "copy", ("Identity",)
    ...     def bind(self, ctx, params, ins, outs, scratch):
    ...         return lambda: np.copyto(outs[0], ins[0])
    """

    name: str = "kernel"
    ops: tuple[str, ...] = ()
    needs_jit: bool = False  # runs numba loops: binding it loads numba (see kernels/accel.py)

    def applies(self, ctx: NodeCtx) -> bool:
        return True

    def cost(self, ctx: NodeCtx) -> Cost:
        moved = sum(nbytes(t.shape, t.dtype) for t in ctx.ins + ctx.outs)
        n = sum(int(np.prod(t.shape)) for t in ctx.outs)
        return Cost(vector_flops=n, bytes=moved)

    def scratch_bytes(self, ctx: NodeCtx) -> int:
        return 0

    def transform_bytes(self, ctx: NodeCtx) -> int:
        """Bytes of new arrays :meth:`transform` writes (0 when it only takes views): the
        preparation cost a cold (single) run pays on top of :meth:`cost`."""
        return 0

    def transform(self, ctx: NodeCtx) -> dict[str, np.ndarray]:
        """Weight transform done once at plan time (packing, Winograd...). Views cost nothing."""
        return {}

    #: Params of :meth:`transform` that are new arrays computed from the weight (input 1), each with
    #: the axis that follows the weight's output channels. A budgeted run (engine/memory) reads them
    #: precomputed from the model file, output-channel slices at a time, and calls
    #: :meth:`transform_streamed` instead of :meth:`transform`.
    streamed_params: dict[str, int] = {}

    def transform_streamed(self, ctx: NodeCtx, streamed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`transform` with the :attr:`streamed_params` given (``ctx``'s weight is then only a
        placeholder of the right shape); kernels with streamed params make only the rest here."""
        return {**self.transform(ctx), **streamed}

    def bind(self, ctx: NodeCtx, params: dict[str, np.ndarray], ins: list[np.ndarray],
             outs: list[np.ndarray], scratch: np.ndarray) -> Step:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kernel {self.name}>"
