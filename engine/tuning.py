"""Calibrate the cost model per kernel: time every kernel on a few representative layers and keep
measured/analytic as that kernel's factor (the "semi-auto search" of MNN, ~1 s). The analytic model
keeps ranking shapes; the factor fixes each kernel's efficiency.

The result is persisted in the engine cache (:mod:`engine.cache.store`) under the CPU model,
CPU features and engine version (:func:`engine.cache.fingerprint.machine_key`), so only the
first process on a machine, after an engine change, pays for it; later ones read a small file.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import tempfile
import time
from dataclasses import replace

import numpy as np

from engine.builder import GraphBuilder
from engine.cache.fingerprint import machine_key
from engine.cache.store import EntryStore, default_dir
from engine.cost import Calibration, calibrate_rates
from engine.kernels import REGISTRY, accel
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


def measure_disk_rate(directory: str | os.PathLike, nbytes: int = 8 << 20) -> float | None:
    """Bytes/s reading a file just written to ``directory`` after dropping it from the page cache
    (what a cold start's weight reads see); None where the page cache cannot be dropped."""
    if not hasattr(os, "posix_fadvise"):
        return None
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=directory, prefix=".disk-rate-")
    try:
        os.write(fd, np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes())
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(nbytes)
        started = time.perf_counter()
        got = os.preadv(fd, [buf], 0)
        seconds = time.perf_counter() - started
    finally:
        os.close(fd)
        os.unlink(path)
    return got / seconds if got and seconds > 0 else None


def measure_calibration(directory: str | os.PathLike | None = None) -> Calibration:
    """Base rates, per-kernel factors, the cost of loading numba and (with ``directory``) the disk
    read rate there, measured now."""
    rates = calibrate_rates()
    cal = rates.with_factors(measure_factors(rates))
    if directory is not None:
        with contextlib.suppress(OSError):
            disk = measure_disk_rate(directory)
            if disk:
                cal = replace(cal, disk_bytes_per_s=disk)
    if accel.available():
        accel.load()  # already loaded by the numba kernels' timing above; keeps what it cost
        cal = replace(cal, jit_load_s=accel.measured_load_seconds() or cal.jit_load_s)
    return cal


def calibrate(cache_dir: str | os.PathLike | None = None) -> Calibration:
    """This machine's calibration: from the engine cache when valid for this CPU and engine version,
    else measured and stored (memoised per process and cache directory)."""
    return _calibrate(str(cache_dir or default_dir()))


def calibration_key() -> str:
    """The engine-cache entry holding this machine's calibration."""
    return f"calibration-{machine_key()}"


@functools.cache
def _calibrate(cache_dir: str) -> Calibration:
    store = EntryStore(cache_dir)
    key = calibration_key()
    hit = store.get(key)
    if hit is not None:
        try:
            return Calibration(**hit[1])
        except TypeError:  # written by another engine version's Calibration: measure again
            pass
    cal = measure_calibration(cache_dir)
    with contextlib.suppress(OSError):  # a read-only cache costs the next process a calibration, nothing else
        store.put(key, {}, meta=cal.as_dict())
    return cal
