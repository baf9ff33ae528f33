"""A small reverse-mode autograd on numpy (micrograd/tinygrad style).

Every op is a :class:`Function` with ``forward`` and ``backward`` side by side; a :class:`Tensor`
remembers the function that produced it, and :meth:`Tensor.backward` walks the graph in reverse
topological order accumulating ``grad``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Tensor:
    """An array with an optional gradient.

    >>> w = Tensor(np.ones(3, np.float32), requires_grad=True)
    >>> (w * w).sum().backward(); w.grad
    array([2., 2., 2.], dtype=float32)
    """

    def __init__(self, data: Any, requires_grad: bool = False, name: str = "") -> None:
        self.data = np.asarray(data, dtype=np.float32) if not isinstance(data, np.ndarray) else data
        self.grad: np.ndarray | None = None
        self.requires_grad = requires_grad
        self.name = name
        self._ctx: Function | None = None
        self._node: _Node | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def numpy(self) -> np.ndarray:
        return self.data

    def backward(self, grad: np.ndarray | None = None) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``grad`` that requires it."""
        if self._node is None:
            return
        order, seen = [], set()

        def visit(t: _Node | Tensor) -> None:
            if id(t) in seen or t._ctx is None:
                return
            seen.add(id(t))
            for p in t._ctx.parents:
                visit(p)
            order.append(t)

        visit(self._node)
        grads = {id(self._node): np.ones_like(self.data) if grad is None else grad}
        for t in reversed(order):
            g = grads.pop(id(t), None)
            if g is None:
                continue
            for p, pg in zip(t._ctx.parents, t._ctx.backward(g), strict=True):
                if pg is None or not (p.requires_grad or p._ctx is not None):
                    continue
                pg = _unbroadcast(pg, p.shape)
                if p._ctx is None:
                    pg = np.ascontiguousarray(pg, dtype=np.float32)  # a leaf owns a real, writable grad
                    p.grad = pg if p.grad is None else p.grad + pg
                else:
                    grads[id(p)] = grads[id(p)] + pg if id(p) in grads else pg
        order.clear()  # ``visit`` refers to itself (a cycle): do not let it keep the saved arrays until a gc

    # operator sugar
    def __add__(self, o):
        return Add.apply(self, _t(o))

    def __mul__(self, o):
        return Mul.apply(self, _t(o))

    def __sub__(self, o):
        return Add.apply(self, Mul.apply(_t(o), Tensor(np.float32(-1))))

    def __matmul__(self, o):
        return MatMul.apply(self, _t(o))

    def sum(self):
        return Sum.apply(self)

    def mean(self):
        return Mul.apply(Sum.apply(self), Tensor(np.float32(1.0 / self.data.size)))

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, grad={'yes' if self.grad is not None else 'no'})"


def _t(x: Any) -> Tensor:
    return x if isinstance(x, Tensor) else Tensor(np.asarray(x, dtype=np.float32))


def _unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast gradient back to ``shape``."""
    if g.shape == shape:
        return g
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for i, d in enumerate(shape):
        if d == 1 and g.shape[i] != 1:
            g = g.sum(axis=i, keepdims=True)
    return g


class _Node:
    """The autograd record of a computed tensor: the function that produced it and its shape, but
    not its data, so an intermediate activation is freed as soon as no function saved it."""

    __slots__ = ("_ctx", "shape", "requires_grad")

    def __init__(self, ctx: Function, shape: tuple[int, ...]) -> None:
        self._ctx, self.shape, self.requires_grad = ctx, shape, False


class Function:
    """One differentiable op. Subclasses implement ``forward(*arrays, **attrs)`` returning an
    array (saving what backward needs on ``self``) and ``backward(grad)`` returning one gradient
    (or None) per input."""

    def __init__(self, parents: tuple[Tensor | _Node, ...]) -> None:
        self.parents = parents  # leaf tensors, or the records of computed ones

    @classmethod
    def apply(cls, *inputs: Tensor, **attrs: Any) -> Tensor:
        fn = cls(tuple(t._node if t._node is not None else t for t in inputs))
        out = Tensor(fn.forward(*[t.data for t in inputs], **attrs))
        if any(t.requires_grad or t._ctx is not None for t in inputs):
            out._ctx = fn
            out._node = _Node(fn, out.shape)
        return out

    def forward(self, *args: np.ndarray, **attrs: Any) -> np.ndarray:
        raise NotImplementedError

    def backward(self, grad: np.ndarray) -> tuple[np.ndarray | None, ...]:
        raise NotImplementedError

    def needs_grad(self, k: int) -> bool:
        """Whether input ``k``'s gradient is wanted (a leaf that requires it, or a computed tensor):
        a backward may skip the others (return None for them)."""
        p = self.parents[k]
        return p.requires_grad or p._ctx is not None


class Add(Function):
    def forward(self, a, b):
        return a + b

    def backward(self, g):
        return g, g


class Mul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a * b

    def backward(self, g):
        return g * self.b, g * self.a


class MatMul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a @ b

    def backward(self, g):
        return (g @ np.swapaxes(self.b, -1, -2) if self.needs_grad(0) else None,
                np.swapaxes(self.a, -1, -2) @ g if self.needs_grad(1) else None)


class MatMulT(Function):
    """``a @ b.T`` for a 2-d ``b`` kept as it is (a Gemm's transB weight): no transposed copy of the
    weight is made forward, and its gradient comes out in the weight's own layout."""

    def forward(self, a, b):
        self.a, self.b = a, b
        return a @ b.T

    def backward(self, g):
        return g @ self.b if self.needs_grad(0) else None, g.T @ self.a if self.needs_grad(1) else None


class Sum(Function):
    def forward(self, a):
        self.shape = a.shape
        return np.asarray(a.sum(), dtype=np.float32)

    def backward(self, g):
        return (np.broadcast_to(g, self.shape).astype(np.float32, copy=False),)
