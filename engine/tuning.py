"""Calibrate the cost model per kernel: time every kernel on a few representative layers and keep
measured/analytic as that kernel's factor (the "semi-auto search" of MNN, done once per process,
~0.5 s). The analytic model keeps ranking shapes; the factor fixes each kernel's efficiency.
"""

from __future__ import annotations

import functools
import statistics

import numpy as np

from engine.builder import GraphBuilder
from engine.cost import Calibration, calibrate_rates
from engine.kernels import REGISTRY
from engine.measure import time_kernel
from engine.plan import compile_plan

# (cin, cout, k, stride, group, hw): one 3x3, one strided, one pointwise and one depthwise layer.
CASES = [(64, 64, 3, 1, 1, 28), (32, 64, 3, 2, 1, 28), (128, 128, 1, 1, 1, 14), (96, 96, 3, 1, 96, 28),
         (96, 96, 3, 2, 96, 56)]


def _case_graph(cin: int, cout: int, k: int, stride: int, group: int, hw: int):
    b = GraphBuilder("calibration")
    w = np.random.default_rng(0).standard_normal((cout, cin // group, k, k), dtype=np.float32)
    b.output(b.relu(b.conv(b.input("x", (1, cin, hw, hw)), w, np.zeros(cout, np.float32), strides=stride,
                           pads=k // 2, group=group)))
    return b.build()


def measure_factors(rates: Calibration) -> dict[str, float]:
    from engine.passes import optimize

    ratios: dict[str, list[float]] = {}
    for case in CASES:
        graph = optimize(_case_graph(*case))
        for kernel in REGISTRY["Conv"]:
            try:
                plan = compile_plan(graph, {}, rates, {"Conv": kernel.name})
            except ValueError:
                continue  # the kernel does not apply to this layer
            step = plan.steps[0]
            predicted = rates.seconds(kernel.cost(step.ctx))
            measured = time_kernel(kernel, step.ctx, step.params, repeat=5)  # best of 5: robust to noise
            ratios.setdefault(kernel.name, []).append(measured / predicted)
    return {name: statistics.median(r) for name, r in ratios.items()}


@functools.cache
def calibrate() -> Calibration:
    """Base rates plus per-kernel factors for this machine (cached for the process)."""
    rates = calibrate_rates()
    return rates.with_factors(measure_factors(rates))
