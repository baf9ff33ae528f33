"""Turn a kernel's analytic :class:`Cost` into seconds, with rates measured on this machine.

The calibration runs a few tiny benchmarks once per machine and engine version (~0.1 s; the
result is persisted by :func:`engine.tuning.calibrate`): BLAS GEMM throughput,
numpy vector throughput, memory bandwidth and the fixed cost of a Python-level numpy call.
:mod:`engine.tuning` then corrects each kernel by a factor measured on representative shapes.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from engine.kernels.base import Cost, Kernel


@dataclass(frozen=True)
class Calibration:
    """Rates used by the cost model. The defaults are a typical laptop core; use :func:`calibrate`."""

    gemm_flops_per_s: float = 5e10
    vector_flops_per_s: float = 1.5e9
    bytes_per_s: float = 8e9
    call_s: float = 2e-6
    jit_load_s: float = 1.2  # importing numba + loading its cached loops, once per process (kernels/accel.py)
    disk_bytes_per_s: float = 2e8  # reading a file that is not in the page cache (a cold start's weights)
    kernel_factors: dict[str, float] = field(default_factory=dict)  # measured / analytic, per kernel

    def seconds(self, cost: Cost, kernel: str | None = None) -> float:
        base = (cost.gemm_flops / self.gemm_flops_per_s + cost.vector_flops / self.vector_flops_per_s
                + cost.bytes / self.bytes_per_s + cost.calls * self.call_s)
        return base * self.kernel_factors.get(kernel, 1.0)

    def with_factors(self, factors: dict[str, float]) -> Calibration:
        return replace(self, kernel_factors=dict(factors))

    def first_run_extra(self, kernel: Kernel, weight_bytes: int, transform_bytes: int, cached: bool,
                        jit_loaded: bool, originals_read_anyway: bool = False) -> float:
        """What a kernel costs on a model's first run on top of its run time (seconds); see
        :meth:`first_run_choice`."""
        return self.first_run_choice(kernel, weight_bytes, transform_bytes, cached, jit_loaded,
                                     originals_read_anyway)[0]

    def first_run_choice(self, kernel: Kernel, weight_bytes: int, transform_bytes: int, cached: bool,
                         jit_loaded: bool, originals_read_anyway: bool = False) -> tuple[float, bool]:
        """(extra first-run seconds, whether to read the cached transformed weights) for a kernel.

        The first run must get the kernel's weights in the cheapest form (NNV12's first knob): read
        the original ``weight_bytes`` from disk and compute the transform (``transform_bytes``
        written, inputs read, at memory speed), or, when ``cached``, read the transformed copy
        instead. A transform that enlarges the weights (Winograd's U is 2.25x a 3x3 kernel) is
        recomputed from the smaller originals unless computing it costs more than reading the
        difference at this machine's disk rate. ``originals_read_anyway``: the originals are read
        even if the cached copy is used (they are part of a file read ahead whole), so the copy
        costs its whole read on top. Plus numba's load if the kernel needs it and it is not loaded.
        """
        extra, use_cache = weight_bytes / self.disk_bytes_per_s, False
        if transform_bytes:
            extra += 2 * transform_bytes / self.bytes_per_s
            if cached:
                from_cache = (transform_bytes + (weight_bytes if originals_read_anyway else 0)) / self.disk_bytes_per_s
                extra, use_cache = min((extra, False), (from_cache, True))
        if kernel.needs_jit and not jit_loaded:
            extra += self.jit_load_s
        return extra, use_cache

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _best(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@functools.cache
def calibrate_rates() -> Calibration:
    """Measure the base rates on this machine (cached for the process)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((256, 512), dtype=np.float32)
    b = rng.standard_normal((512, 784), dtype=np.float32)
    c = np.empty((256, 784), np.float32)
    gemm = 2 * 256 * 512 * 784 / _best(lambda: np.matmul(a, b, out=c))
    big = rng.standard_normal(1 << 21, dtype=np.float32)
    dst = np.empty_like(big)
    bw = 2 * big.nbytes / _best(lambda: np.copyto(dst, big))
    # A strided gather (what im2col and the depthwise taps do) measures the vector rate.
    src = rng.standard_normal((64, 60, 60), dtype=np.float32)
    out = np.empty((64, 29, 29), np.float32)
    vec = out.size / _best(lambda: np.multiply(src[:, 1:59:2, 1:59:2], 1.5, out=out))
    tiny = np.empty(4, np.float32)
    call = _best(lambda: [np.add(tiny, 1, out=tiny) for _ in range(100)]) / 100
    return Calibration(gemm, vec, bw, call)
