"""Measuring the engine: one kernel on one node in isolation (random inputs, fresh outputs and scratch). (The
warm-up that loads the kernels before a measurement runs a session: :func:`engine.session.warm_up_kernels`.)"""

from __future__ import annotations

import time

import numpy as np

from engine.kernels import Kernel, NodeCtx


def time_kernel(kernel: Kernel, ctx: NodeCtx, params: dict[str, np.ndarray] | None = None,
                repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds of one call (after one warm-up call)."""
    rng = np.random.default_rng(0)
    params = kernel.transform(ctx) if params is None else params
    ins = []
    for name, info in zip([t for t in ctx.node.inputs if t], ctx.ins, strict=True):
        const = ctx.consts.get(name)
        ins.append(np.asarray(const) if const is not None else
                   rng.standard_normal(info.shape, dtype=np.float32).astype(info.dtype))
    outs = [np.empty(o.shape, o.dtype) for o in ctx.outs]
    scratch = np.zeros(kernel.scratch_bytes(ctx) + 64, np.uint8)
    shift = (-scratch.ctypes.data) % 64
    call = kernel.bind(ctx, params, ins, outs, scratch[shift : shift + kernel.scratch_bytes(ctx)])
    call()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best

