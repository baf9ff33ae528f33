"""The numba accelerator, loaded on demand rather than on import.

Importing numba and loading its cached machine code costs about a second per process (numba's
own import, its typing registries, a scipy import for its BLAS check), far more than a whole
first inference. So :mod:`engine.kernels.jit` is imported only by :func:`load`, which also calls
every compiled function once on tiny inputs (numba loads each function's cache on its first call),
and kernels ask :func:`loaded` at bind time. A cold start plans without numba kernels
(their :attr:`Kernel.needs_jit` adds :func:`load_seconds` to their first-run cost) and a background
thread loads numba for the warm plan.

>>> available() in (True, False)
True
"""

from __future__ import annotations

import os
import threading
import time
from types import ModuleType

from engine.cache.fingerprint import find_spec

# LLVM's SLP vectoriser (off by default in numba) packs the generated NCHWc loops' scalar
# accumulators into vector registers (engine/kernels/nchwc_gen.py); numba reads this when imported.
os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")

ACT_CODES = {None: 0, "relu": 1, "clip": 2, "hardswish": 3, "hardsigmoid": 4, "sigmoid": 5}

_lock = threading.Lock()
_jit: ModuleType | None = None
_aot: ModuleType | None = None  # the same loops compiled ahead of time (kernels/aot.py): no numba import
_load_s: float | None = None
LOAD_S_GUESS = 1.2  # seconds, what loading took on the development machine; replaced once measured


def act_code(kind: str | None, params) -> tuple[int, float, float]:
    """(activation code, p0, p1) as the numba loops take them."""
    p = list(params) + [0.0, 0.0]
    return ACT_CODES[kind], float(p[0]), float(p[1])


def available() -> bool:
    """Whether numba is installed (without importing it; looked up once per process, with the engine version's
    record of where it is installed)."""
    return find_spec("numba") is not None


def loaded() -> ModuleType | None:
    """The compiled loops if loaded in this process (:func:`load_ahead_of_time` or :func:`load`), else
    None. The ahead-of-time module comes first: the same machine code, and a call costs ~1 us instead
    of the ~5 us numba's dispatcher spends checking the arguments' types."""
    return _aot or _jit


def loops() -> ModuleType:
    """The loops for a kernel being bound: already loaded ones, else numba's (:func:`load`)."""
    return _aot or _jit or load()


def load_ahead_of_time(cache_dir) -> ModuleType | None:
    """Load the ahead-of-time compiled loops for this machine from ``cache_dir`` if built (milliseconds);
    returns them, or None (then build them with :func:`engine.kernels.aot.build_in_background`)."""
    global _aot
    if _aot is None and available():
        from engine.kernels import aot

        with _lock:
            if _aot is None:
                _aot = aot.load(cache_dir)
    return _aot


def load() -> ModuleType:
    """Import numba, load every compiled loop (from numba's on-disk cache when present) and return
    the :mod:`engine.kernels.jit` module; idempotent and thread-safe. Raises ImportError without numba."""
    global _jit, _load_s
    if _jit is not None:
        return _jit
    with _lock:
        if _jit is None:
            started = time.perf_counter()
            from engine.kernels import jit

            _warm(jit)
            _load_s = time.perf_counter() - started
            _jit = jit
    return _jit


def load_seconds() -> float:
    """What :func:`load` costs: 0 once loaded, else the time it took when last measured."""
    if loaded() is not None:
        return 0.0
    return _load_s if _load_s is not None else LOAD_S_GUESS


def measured_load_seconds() -> float | None:
    """What :func:`load` took in this process, if it ran."""
    return _load_s


def _warm(jit: ModuleType) -> None:
    """Call each compiled function once with the argument types the kernels use."""
    import numpy as np

    x = np.zeros((2, 4, 4), np.float32)
    out = np.zeros((2, 4, 4), np.float32)
    w = np.zeros((2, 3, 3), np.float32)
    b = np.zeros(2, np.float32)
    jit.bias_act(x.reshape(2, -1), b, x.reshape(2, -1), True, True, 1, 0.0, 0.0)
    jit.bias_act(x.reshape(2, -1), x[:, 0, 0], x.reshape(2, -1), False, False, 0, 0.0, 0.0)
    taps = jit.depthwise_taps(4, 4, 3, 1, 1, 1)
    phases = np.zeros((1, 1, 4), np.float32)
    jit.depthwise(x, w, b, out, True, out, phases, taps, 1, 1, 1, 1, 1, 0.0, 0.0)
    jit.depthwise(x, w, b, out, False, out, phases, taps, 1, 1, 1, 1, 1, 0.0, 0.0)
    v = np.zeros((16, 2, 4), np.float32)
    jit.winograd23_in(x, v, 2, 2, 1, 1)
    m = np.zeros((16, 2, 4), np.float32)
    jit.winograd23_out(m, out, b, out, True, 2, 2, 1, 0.0, 0.0)
    jit.winograd23_out(m, out, b, out, False, 2, 2, 1, 0.0, 0.0)
    xb = np.zeros((1, 3, 3, 16), np.float32)
    yb = np.zeros((1, 3, 3, 16), np.float32)
    bb = np.zeros((1, 16), np.float32)
    jit.nchwc_conv(xb, np.zeros((1, 1, 1, 1, 16, 16), np.float32), bb, yb, False, yb, 1, 1, 0, 0, 1, 1, 0, 0.0, 0.0)
    jit.nchwc_depthwise(xb, np.zeros((1, 1, 1, 16), np.float32), bb, yb, False, yb, 1, 1, 0, 0, 1, 1, 0, 0.0, 0.0)
    jit.nchwc_maxpool(xb, yb, 1, 1, 1, 1, 0, 0, 1, 1)
