"""Run a model inside a hard byte budget, streaming its weights from disk (FlexNN).

:class:`BudgetedSession` plans each input shape and budget with :mod:`engine.memory.budget_plan`,
binds every unit's kernel to fixed views of one arena of the budget (less an allowance for the
session's own objects, :meth:`BudgetedSession.reserve`, so the process's growth stays within the
budget), and runs inference with two threads: a loader thread reading each load into its planned
range (file reads release the GIL) and the calling thread computing (numpy/BLAS release it). A unit
computes only after its loads are in; a load starts only after the units before its start unit are
done, so it writes memory compute has freed. ``set_budget`` re-plans between inferences (plans are
cached per budget); the arena of the old budget is released before the new one is made.

>>> save_streamable(graph, "m.sfe")                                   # doctest: +SKIP
>>> sess = BudgetedSession("m.sfe", memory_budget=8 << 20)             # doctest: +SKIP
>>> y = sess.run(x)["out"]; sess.set_budget(4 << 20); y = sess.run(x)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine.cost import Calibration
from engine.ir import Graph, GraphError, TensorInfo
from engine.kernels import Kernel, NodeCtx, candidates
from engine.memory.budget_plan import ALIGN, BudgetError, BudgetPlan, Load, plan_budget
from engine.memory.loader import WeightLoader
from engine.memory.streamable import open_streamable
from engine.ops import VIEW_OPS, infer_shapes
from engine.plan import ExecutionPlan, StepPlan, compile_plan
from engine.session import GraphInputs, _thread_limiter
from engine.tuning import calibrate

RESERVE = 4 << 20  # kept out of the arena for the session's own objects, plus RESERVE_PER_NODE per node
RESERVE_PER_NODE = 16 << 10


_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "k": 1 << 10, "kib": 1 << 10, "mb": 1 << 20, "m": 1 << 20, "mib": 1 << 20,
          "gb": 1 << 30, "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str | int) -> int:
    """``"8MB"`` -> 8388608 (KB/MB/GB are binary, as memory is); ints pass through.

    >>> parse_bytes("8MB"), parse_bytes("1.5k"), parse_bytes(100)
    (8388608, 1536, 100)
    """
    if isinstance(text, int):
        return text
    s = text.strip().lower()
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(num):].strip()
    if unit not in _UNITS or not num:
        raise ValueError(f"not a byte size: {text!r} (use e.g. 8MB, 512KB, 1048576)")
    return int(float(num) * _UNITS[unit])


def measure_read_bps(loader: WeightLoader, streamed: set[str], probe: int = 1 << 20) -> float:
    """Bytes/s reading up to ``probe`` bytes of the largest streamed weight with the page cache
    dropped (what runs see); the probe buffer is small so opening stays within any budget."""
    if not streamed:
        return 1e9
    name = max(streamed, key=lambda n: loader.blocks[n].nbytes)
    b = loader.blocks[name]
    rows = max(1, min(b.shape[0] if b.shape else 1, probe // max(b.row_bytes, 1)))
    buf = np.empty(rows * b.row_bytes if b.shape else b.nbytes, np.uint8)
    loader.evict()
    t = time.perf_counter()
    loader.read_into(name, buf, rows=(0, rows) if b.shape else None)
    return buf.nbytes / max(time.perf_counter() - t, 1e-6)


# Kernels whose weight transform only reshapes/transposes (views), so the arena slot the loader
# fills is what they read; tests/engine/test_engine_budgeted.py checks this list by transforming
# zeros and ones. Kernels that copy weights (Winograd, tap packing) never get streamed weights:
# planning with them would materialise their transformed copies, over any budget.
VIEW_TRANSFORM_KERNELS = frozenset({"conv1x1_gemm", "conv_im2col", "depthwise_numpy", "depthwise_numba", "gemm_blas",
                                    "matmul_blas"})


def _view_safe(kernel: Kernel, ctx: NodeCtx, streamed: set[str]) -> bool:
    if not any(t in streamed for t in ctx.node.inputs):
        return True
    return type(kernel).transform is Kernel.transform or kernel.name in VIEW_TRANSFORM_KERNELS


def view_safe_overrides(graph: Graph, shapes: dict[str, tuple[int, ...]], calibration: Calibration,
                        streamed: set[str], least_scratch: bool = False) -> dict[str, str]:
    """Per node reading a streamed weight, the cheapest (or least-scratch) view-safe kernel; chosen
    before compiling so no copying transform ever runs on a weight."""
    infos, folded = infer_shapes(graph, shapes)
    consts = {**graph.weights, **folded}
    overrides = {}
    for node in graph.topological_order():
        if node.op in VIEW_OPS or all(o in consts for o in node.outputs):
            continue
        ctx = NodeCtx(node, [infos[t] for t in node.inputs if t], [infos[t] for t in node.outputs], consts)
        ok = [k for k in candidates(ctx) if _view_safe(k, ctx, streamed)]
        if not ok:
            raise GraphError(f"no kernel for node {node.name!r} ({node.op}) reads streamed weights in place")
        if least_scratch:
            least = min(k.scratch_bytes(ctx) for k in ok)
            ok = [k for k in ok if k.scratch_bytes(ctx) == least]
        if least_scratch or len(ok) < len(candidates(ctx)):
            overrides[node.name] = min(ok, key=lambda k: calibration.seconds(k.cost(ctx), k.name)).name
    return overrides


def transform_keeps_views(kernel: Kernel, ctx: NodeCtx, names: list[str]) -> bool:
    """True if ``kernel``'s transform of ``ctx`` leaves weights ``names`` as views, or copies that do
    not depend on their values (found by transforming all-zeros and all-ones placeholders)."""
    zeros = kernel.transform(ctx)
    ones_ctx = NodeCtx(ctx.node, ctx.ins, ctx.outs, {**ctx.consts, **{
        n: np.lib.stride_tricks.as_strided(np.ones(1, ctx.consts[n].dtype), ctx.consts[n].shape,
                                           (0,) * ctx.consts[n].ndim, writeable=False) for n in names}})
    ones = kernel.transform(ones_ctx)
    for key, p in zeros.items():
        p = np.asarray(p)
        if p.size <= 1 or any(np.shares_memory(p, ctx.consts[n]) for n in names):
            continue
        if not np.array_equal(p, np.asarray(ones[key])):
            return False
    return True


class _Bound:
    """A budget plan bound to its arena: views, pinned weight copies, load targets, one call per unit."""

    def __init__(self, bp: BudgetPlan, pinned: dict[str, np.ndarray], streamed: set[str]) -> None:
        self.bp = plan = bp
        ep = bp.exec_plan
        raw = np.empty(bp.budget + ALIGN, dtype=np.uint8)  # pages are touched only where used
        shift = (-raw.ctypes.data) % ALIGN
        self.arena = raw[shift : shift + bp.budget]
        self.views: dict[str, np.ndarray] = {}
        for name, buf in ep.arena.buffers.items():
            region = self.arena[ep.arena.offsets[name] : ep.arena.offsets[name] + buf.size]
            if name in ep.infos:
                region = region.view(ep.infos[name].dtype).reshape(ep.infos[name].shape)
            self.views[name] = region
        consts = dict(ep.consts)
        for name, off in plan.pinned_offsets.items():
            w = pinned[name]
            dst = self.arena[off : off + w.nbytes].view(w.dtype).reshape(w.shape)
            dst[...] = w
            consts[name] = dst
        self.slots = [self.arena[ld.offset : ld.offset + ld.nbytes] for ld in plan.loads]
        self.need = []
        self.calls = []
        last = -1
        for unit in plan.units:
            step = ep.steps[unit.step]
            unit_consts = dict(consts)
            for j in unit.loads:
                unit_consts[plan.loads[j].weight] = self._typed(j, ep)
            self.calls.append(self._bind(step, unit.rows, unit_consts))
            last = max([last, *unit.loads])
            self.need.append(last + 1)
        self.unit_count = len(self.calls)

    def _typed(self, j: int, ep: ExecutionPlan) -> np.ndarray:
        ld: Load = self.bp.loads[j]
        info = ep.consts[ld.weight]
        shape = info.shape if ld.rows is None else (ld.rows[1] - ld.rows[0], *info.shape[1:])
        return self.slots[j].view(info.dtype).reshape(shape)

    def array(self, tensor: str, consts: dict[str, np.ndarray]) -> np.ndarray:
        ep = self.bp.exec_plan
        if tensor in consts:
            return np.asarray(consts[tensor])
        return self.views[ep.location(tensor)].reshape(ep.infos[tensor].shape)

    def _bind(self, step: StepPlan, rows: tuple[int, int] | None, consts: dict[str, np.ndarray]):
        node, ctx = step.node, step.ctx
        ins = [self.array(t, consts) for t in node.inputs if t]
        outs = [self.views[t] for t in node.outputs]
        scratch = self.views.get(f"{node.name}#scratch", self.arena[:0])
        if rows is not None:
            a, b = rows
            bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
            if bias and bias in consts and consts[bias].shape[0] != b - a:
                consts[bias] = np.asarray(consts[bias])[a:b]
            def cut(info: TensorInfo) -> TensorInfo:
                return TensorInfo(info.name, (info.shape[0], b - a, *info.shape[2:]), info.dtype)
            in_infos = []
            for k, (t, info) in enumerate(zip([t for t in node.inputs if t], ctx.ins, strict=True)):
                if t in consts:
                    in_infos.append(TensorInfo(info.name, np.asarray(consts[t]).shape, info.dtype))
                elif k > 0:  # the residual input: its rows
                    in_infos.append(cut(info))
                else:
                    in_infos.append(info)
            ctx = NodeCtx(node, in_infos, [cut(o) for o in ctx.outs], consts)
            ins = [self.array(t, consts) for t in node.inputs if t]
            ins = [x if k == 0 or t in consts else x[:, a:b] for k, (t, x) in
                   enumerate(zip([t for t in node.inputs if t], ins, strict=True))]
            outs = [o[:, a:b] for o in outs]
        else:
            ctx = NodeCtx(node, ctx.ins, ctx.outs, consts)
        return step.kernel.bind(ctx, step.kernel.transform(ctx), ins, outs, scratch)


class _Run:
    """Progress of one inference shared by the two threads."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.loaded = 0
        self.computed = 0
        self.error: BaseException | None = None
        self.aborted = False
        self.done = threading.Event()


class BudgetedSession(GraphInputs):
    """Inference within ``memory_budget`` bytes (weights included), weights streamed from a file
    written by :func:`~engine.memory.streamable.save_streamable`.

    >>> sess = BudgetedSession("resnet18.sfe", memory_budget="8MB")   # doctest: +SKIP
    >>> sess.run(np.zeros((1, 3, 224, 224), "float32"))               # doctest: +SKIP
    >>> print(sess.plan_for({"x": (1, 3, 224, 224)}).table())         # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike, memory_budget: int | str, *, threads: int = 1,
                 calibration: Calibration | None = None, preload: bool = True, drop_cache: bool = True) -> None:
        self.loader = WeightLoader(path, drop_cache=drop_cache)
        self.graph, self.pinned, self.streamed = open_streamable(self.loader)
        self.weight_bytes = {n: b.nbytes for n, b in self.loader.blocks.items()}
        self.calibration = calibration or calibrate()
        self.preload = preload
        self.load_bps = measure_read_bps(self.loader, self.streamed)
        self._limit = _thread_limiter(threads)
        self._exec: dict[tuple, list[ExecutionPlan]] = {}
        self._plans: dict[tuple, BudgetPlan] = {}
        self._bound: tuple[tuple, _Bound] | None = None
        self._last_shapes: dict[str, tuple[int, ...]] | None = None
        self.budget = parse_bytes(memory_budget)
        if self.budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {memory_budget!r}")
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loader_loop, name="weight-loader", daemon=True)
        self._thread.start()

    def _exec_plans(self, shapes: Mapping[str, tuple[int, ...]]) -> list[ExecutionPlan]:
        """The fastest view-safe execution plan, then one with the least scratch (for tight budgets)."""
        key = self._key(shapes)
        if key not in self._exec:
            shapes = {n: tuple(s) for n, s in shapes.items()}
            with self._limit():
                fast = view_safe_overrides(self.graph, shapes, self.calibration, self.streamed)
                lean = view_safe_overrides(self.graph, shapes, self.calibration, self.streamed, least_scratch=True)
                plans = [compile_plan(self.graph, shapes, self.calibration, fast)]
                if lean != fast:
                    plans.append(compile_plan(self.graph, shapes, self.calibration, lean))
            self._exec[key] = plans
        return self._exec[key]

    def plan_for(self, shapes: Mapping[str, tuple[int, ...]], budget: int | str | None = None) -> BudgetPlan:
        """The budgeted plan for these input shapes (cached per shapes and budget)."""
        budget = self.budget if budget is None else parse_bytes(budget)
        key = (self._key(shapes), budget)
        if key not in self._plans:
            pinned = {n: w.nbytes for n, w in self.pinned.items()}
            plans = self._exec_plans(shapes)
            reserve = self.reserve()
            try:
                self._plans[key] = plan_budget(plans, self.streamed, self.weight_bytes, pinned,
                                               budget - reserve, self.load_bps, self.preload)
            except BudgetError as e:
                smallest = e.smallest + reserve
                raise BudgetError(f"no plan fits a budget of {budget} bytes ({budget / 2**20:.2f} MiB, of which "
                                  f"{reserve} bytes are kept for the session's own objects); the smallest feasible "
                                  f"budget is {smallest} bytes ({smallest / 2**20:.2f} MiB), with the finest slices "
                                  f"and no preloading", smallest) from None
        return self._plans[key]

    def reserve(self) -> int:
        """Bytes of the budget kept out of the arena for the session's own objects (header, graph,
        plans, bound closures): ``RESERVE`` plus ``RESERVE_PER_NODE`` per graph node, an estimate
        that ``bench.flexnn`` checks by measuring a fresh process's resident growth."""
        return RESERVE + RESERVE_PER_NODE * len(self.graph.nodes)

    def set_budget(self, nbytes: int | str) -> None:
        """Use ``nbytes`` from the next inference on (re-planned now if a shape has run; a budget
        below the minimum raises :class:`~engine.memory.budget_plan.BudgetError` and keeps the old one)."""
        budget = parse_bytes(nbytes)
        if self._last_shapes is not None:
            self.plan_for(self._last_shapes, budget)  # raises before anything changes
            self.budget = budget
            self._bind(self._last_shapes)
        else:
            self.budget = budget

    def _bind(self, shapes: Mapping[str, tuple[int, ...]]) -> _Bound:
        key = (self._key(shapes), self.budget)
        if self._bound is None or self._bound[0] != key:
            bp = self.plan_for(shapes)
            self._bound = None  # release the old arena before making the new one
            with self._limit():
                self._bound = (key, _Bound(bp, self.pinned, self.streamed))
        return self._bound[1]

    def run(self, feeds: Mapping[str, Any] | np.ndarray) -> dict[str, np.ndarray]:
        """Run on float32 inputs (a dict by input name, or one array for a single-input model)."""
        feeds = self._feeds(feeds)
        shapes = {k: v.shape for k, v in feeds.items()}
        bound = self._bind(shapes)
        self._last_shapes = shapes
        ep = bound.bp.exec_plan
        for t in ep.graph.inputs:
            np.copyto(bound.views[t.name], feeds[t.name], casting="same_kind")
        run = _Run()
        self._jobs.put((bound, run))
        try:
            with self._limit():
                for u, call in enumerate(bound.calls):
                    if run.loaded < bound.need[u]:
                        with run.cond:
                            while run.loaded < bound.need[u] and run.error is None:
                                run.cond.wait()
                    if run.error is not None:
                        raise run.error
                    call()
                    with run.cond:
                        run.computed = u + 1
                        run.cond.notify_all()
        finally:
            with run.cond:
                run.aborted = True
                run.cond.notify_all()
            run.done.wait()
        if run.error is not None:
            raise run.error
        return {o: bound.array(o, ep.consts).copy() for o in ep.graph.outputs}

    def _loader_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            bound, run = job
            try:
                for i, ld in enumerate(bound.bp.loads):
                    with run.cond:
                        while run.computed < ld.start_unit and not run.aborted:
                            run.cond.wait()
                        if run.aborted:
                            break
                    self.loader.read_into(ld.weight, bound.slots[i], ld.rows)
                    with run.cond:
                        run.loaded = i + 1
                        run.cond.notify_all()
            except BaseException as e:  # noqa: BLE001 - handed to the compute thread, which raises it
                with run.cond:
                    run.error = e
                    run.cond.notify_all()
            finally:
                run.done.set()

    def close(self) -> None:
        """Stop the loader thread and close the file."""
        self._jobs.put(None)
        self._thread.join()
        self._bound = None
        self.loader.close()

