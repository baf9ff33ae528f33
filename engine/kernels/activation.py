"""The activation every numba loop ends with, applied in place over a row: the loops of
:mod:`engine.kernels.jit` and the generated ones of :mod:`engine.kernels.nchwc_loops` inline it, so it lives
below both (the generated file imports it from here, never from ``jit``, which imports that file).

Activation codes (:data:`engine.kernels.accel.ACT_CODES`): 0 none, 1 relu, 2 clip(p0, p1), 3 hardswish,
4 hardsigmoid(alpha=p0, beta=p1), 5 sigmoid.

numba keys each file's on-disk cache on that file alone: after an edit here, touch ``jit.py`` and
``nchwc_loops.py`` so their cached machine code is rebuilt (the ahead-of-time module's key, ``aot.LOOP_SOURCES``,
includes this file).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(inline="always")
def act_row(row, code, p0, p1):
    """Activation over a contiguous row, one branch per code so each loop vectorises."""
    lo, hi = np.float32(p0), np.float32(p1)
    six, zero, one = np.float32(6.0), np.float32(0.0), np.float32(1.0)
    if code == 1:
        for k in range(row.shape[0]):
            row[k] = max(row[k], zero)
    elif code == 2:
        for k in range(row.shape[0]):
            row[k] = min(max(row[k], lo), hi)
    elif code == 3:
        for k in range(row.shape[0]):
            v = row[k]
            row[k] = v * min(max(v + np.float32(3.0), zero), six) / six
    elif code == 4:
        for k in range(row.shape[0]):
            row[k] = min(max(row[k] * lo + hi, zero), one)
    elif code == 5:
        for k in range(row.shape[0]):
            row[k] = one / (one + np.exp(-row[k]))
