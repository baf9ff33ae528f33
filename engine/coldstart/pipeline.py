"""Pipelined first run: a preparation thread readies layer i+1, i+2, ... (reads its cached
transformed weights or transforms them, then binds the kernel) while the calling thread executes
layer i as soon as it is ready.

Schedule (NNV12's Algorithm 1 assigns each layer's read/transform to a preparation thread and
orders it so the execution thread stalls least; here there is one preparation thread and the
execution order is fixed by the plan, a chain): preparing in execution order is optimal for one
preparation thread. Exchange argument: if layer j > i were prepared before layer i, swapping them
makes layer i ready earlier and layer j ready no later than layer i was, so no execution starts
later. Layers with nothing to prepare (views, activations, pooling) are bound in the same order at
negligible cost. The recorded :class:`StepTiming` list shows, per layer, when it was prepared and
executed and how long the execution thread waited for it; :func:`schedule_table` prints it.

The overlap is bounded by Python's GIL: numpy releases it inside large array operations (the
convolution GEMMs), so preparation runs mostly while the execution thread is inside BLAS.
:class:`engine.coldstart.session.ColdSession` uses this thread only when a layer has a weight
transform to compute; when the weights are stored as the kernels read them, the kernel's readahead
already reads ahead of execution and :func:`run_serial` is faster (no thread start, no handoffs).

>>> from engine import GraphBuilder                            # doctest: +SKIP
>>> bound = BoundPlan(plan, bind=False)                        # doctest: +SKIP
>>> outputs, timings = run_pipelined(bound, feeds, prepare)    # doctest: +SKIP
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from engine.plan import StepPlan
from engine.session import BoundPlan


@dataclass
class StepTiming:
    """One layer of a pipelined run: seconds since the run started."""

    node: str
    kernel: str
    source: str  # its weights: "view" (nothing to transform), "cache", "transform"; "read+" if read from disk now
    prep_start: float = 0.0
    prep_end: float = 0.0
    exec_start: float = 0.0
    exec_end: float = 0.0
    wait: float = 0.0  # the execution thread waited this long for the preparation thread


def run_pipelined(bound: BoundPlan, feeds: Mapping[str, np.ndarray], prepare: Callable[[StepPlan], str]
                  ) -> tuple[dict[str, np.ndarray], list[StepTiming]]:
    """Run ``bound`` (laid out with ``bind=False``) once, preparing each step on a second thread
    with ``prepare(step) -> source`` and binding it there; fills ``bound.calls`` for later runs."""
    steps = bound.computing
    timings = [StepTiming(s.node.name, s.kernel.name, "") for s in steps]
    calls: list = [None] * len(steps)
    ready = [threading.Event() for _ in steps]
    failure: list[BaseException] = []
    t0 = time.perf_counter()

    def prep() -> None:
        try:
            for i, s in enumerate(steps):
                timings[i].prep_start = time.perf_counter() - t0
                timings[i].source = prepare(s)
                calls[i] = bound.bind_step(s)
                timings[i].prep_end = time.perf_counter() - t0
                ready[i].set()
        except BaseException as e:  # handed to the execution thread, which re-raises it
            failure.append(e)
            for ev in ready:
                ev.set()

    worker = threading.Thread(target=prep, name="engine-prepare", daemon=True)
    worker.start()
    bound.feed(feeds)
    for i in range(len(steps)):
        waited = time.perf_counter()
        ready[i].wait()
        timings[i].wait = time.perf_counter() - waited
        if failure:
            worker.join()
            raise failure[0]
        timings[i].exec_start = time.perf_counter() - t0
        calls[i]()
        timings[i].exec_end = time.perf_counter() - t0
    worker.join()
    bound.calls = calls
    return bound.fetch(), timings


def run_serial(bound: BoundPlan, feeds: Mapping[str, np.ndarray], prepare: Callable[[StepPlan], str]
               ) -> tuple[dict[str, np.ndarray], list[StepTiming]]:
    """The same work without the second thread (prepare, bind, execute each layer in turn)."""
    t0 = time.perf_counter()
    timings, calls = [], []
    bound.feed(feeds)
    for s in bound.computing:
        t = StepTiming(s.node.name, s.kernel.name, "", prep_start=time.perf_counter() - t0)
        t.source = prepare(s)
        call = bound.bind_step(s)
        t.prep_end = t.exec_start = time.perf_counter() - t0
        call()
        t.exec_end = time.perf_counter() - t0
        timings.append(t)
        calls.append(call)
    bound.calls = calls
    return bound.fetch(), timings


def schedule_table(timings: list[StepTiming]) -> str:
    """Per layer: where its weights came from, preparation and execution windows (ms), and waits."""
    rows = [f"{'node':<34} {'kernel':<18} {'weights':<14} {'prep ms':>15} {'exec ms':>15} {'wait ms':>8}"]
    for t in timings:
        rows.append(f"{t.node[:34]:<34} {t.kernel:<18} {t.source:<14} "
                    f"{t.prep_start * 1e3:>7.2f}-{t.prep_end * 1e3:<7.2f} {t.exec_start * 1e3:>7.2f}-"
                    f"{t.exec_end * 1e3:<7.2f} {t.wait * 1e3:>8.2f}")
    total_wait = sum(t.wait for t in timings)
    end = timings[-1].exec_end if timings else 0.0
    rows.append(f"first run {end * 1e3:.2f} ms; execution thread waited {total_wait * 1e3:.2f} ms in all")
    return "\n".join(rows)
