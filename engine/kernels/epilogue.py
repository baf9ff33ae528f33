"""Activations, applied in place (fused after a conv/gemm) or out of place (standalone ops).

In-place forms that need the input twice (HardSwish, Sigmoid) work chunk by chunk through a
small scratch buffer, so fusing them never costs an output-sized temporary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.ir import Node
from engine.kernels import accel

CHUNK = 16384  # floats; the chunk stays in L2
CHUNK_BYTES = CHUNK * 4


def bias_residual_act(y: np.ndarray, bias: np.ndarray | None, residual: np.ndarray | None, kind: str | None,
                      params: Sequence[float] = (), scratch: np.ndarray | None = None) -> None:
    """In place on ``y`` (C, M): ``y = act(y + bias[:, None] + residual)``; one pass with numba
    once it is loaded (:mod:`engine.kernels.accel`)."""
    jit = accel.loaded()
    if jit is not None and y.flags.c_contiguous:
        code, p0, p1 = accel.act_code(kind, params)
        b = bias.reshape(-1) if bias is not None else y.reshape(-1)[: y.shape[0]]  # unread; contiguous
        jit.bias_act(y, b, residual if residual is not None else y, bias is not None, residual is not None,
                     code, p0, p1)
        return
    if bias is not None:
        y += bias.reshape(-1, 1)
    if residual is not None:
        y += residual
    apply(y, y, kind, params, scratch)


def activation_of(node: Node, consts: dict[str, np.ndarray]) -> tuple[str, tuple[float, ...]]:
    """Normalise an activation node to (kind, params)."""
    if node.op == "Relu":
        return "relu", ()
    if node.op == "Clip":
        lo, hi = node.attrs.get("min", -np.inf), node.attrs.get("max", np.inf)
        if len(node.inputs) > 1 and node.inputs[1]:
            lo = float(np.asarray(consts[node.inputs[1]]))
        if len(node.inputs) > 2 and node.inputs[2]:
            hi = float(np.asarray(consts[node.inputs[2]]))
        return "clip", (float(lo), float(hi))
    if node.op == "HardSigmoid":
        return "hardsigmoid", (float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5)))
    return {"HardSwish": "hardswish", "Sigmoid": "sigmoid"}[node.op], ()


def needs_scratch(kind: str | None) -> bool:
    """Whether an in-place activation needs the chunk scratch (only while numba is not loaded)."""
    return accel.loaded() is None and kind in ("hardswish", "sigmoid")


def apply(x: np.ndarray, out: np.ndarray, kind: str | None, params: Sequence[float] = (),
          scratch: np.ndarray | None = None) -> None:
    """``out = act(x)``; ``out`` may be ``x`` (then ``scratch`` of CHUNK floats is needed for
    hardswish/sigmoid)."""
    if kind is None:
        if out is not x:
            np.copyto(out, x)
    elif kind == "relu":
        np.maximum(x, 0, out=out)
    elif kind == "clip":
        np.clip(x, params[0], params[1], out=out)
    elif kind == "hardsigmoid":
        np.multiply(x, params[0], out=out)
        out += params[1]
        np.clip(out, 0, 1, out=out)
    elif out is not x:
        _two_pass(x, out, kind)
    else:
        flat = x.reshape(-1)
        for s in range(0, flat.size, CHUNK):
            c = flat[s : s + CHUNK]
            t = scratch[: c.size]
            _two_pass(c, t, kind)
            np.copyto(c, t)


def _two_pass(x: np.ndarray, out: np.ndarray, kind: str) -> None:
    if kind == "hardswish":  # x * clip(x + 3, 0, 6) / 6
        np.add(x, 3.0, out=out)
        np.clip(out, 0.0, 6.0, out=out)
        out *= x
        out *= 1.0 / 6.0
    elif kind == "sigmoid":
        np.negative(x, out=out)
        np.exp(out, out=out)
        out += 1.0
        np.reciprocal(out, out=out)
    else:
        raise ValueError(f"unknown activation {kind!r}")
